"""The three jobs (optimize, featurize, score) as library functions.

The CLI is a thin layer over these; they take a validated
:class:`~trakcli.config.Config`, raise :class:`~trakcli.errors.TrakError` on
bad input, and report progress through a :class:`~trakcli.progress.Reporter`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trakcli import __version__
from trakcli.config import Config, check_files, resolve_checkpoints
from trakcli.data import TensorDataset, load_dataset
from trakcli.errors import ConfigError, StoreError, StoreMismatchError
from trakcli.gradients import PerExampleGradients, check_finite
from trakcli.models import build_model, file_sha256, load_checkpoint
from trakcli.progress import NULL_REPORTER, Reporter
from trakcli.projectors import make_projector
from trakcli.scoring import gram_matrix, kernel_factor, resolve_lambda, score_block, target_weights
from trakcli.store import ChunkedRows, Store, diff_keys, jsonable
from trakcli.training import train_classifier


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda if available else cpu; ``cuda`` without a GPU is a ConfigError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: 'cuda' was asked for but no CUDA GPU is available; use device=cpu or auto")
    return torch.device(name)


@dataclass
class _Setup:
    """Everything featurize and score share: model, gradients, projector, data, store identity."""

    cfg: Config
    checkpoints: list[Path]
    train: TensorDataset
    model: torch.nn.Module
    grads: PerExampleGradients
    projector: Any
    device: torch.device
    identity: dict[str, Any]


def _apply_threads(cfg: Config) -> None:
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)


def _setup(cfg: Config, *, need_target: bool = False) -> _Setup:
    check_files(cfg, need_checkpoints=True, need_target=need_target)
    _apply_threads(cfg)
    checkpoints = resolve_checkpoints(cfg)
    device = resolve_device(cfg.device)
    train = load_dataset(cfg.data.train, key="data.train")
    model = build_model(cfg.model.entrypoint, **cfg.model.kwargs)
    grads = PerExampleGradients(model, cfg.grad_wrt, cfg.task)
    projector = make_projector(**cfg.projector.options(), grad_dim=grads.grad_dim)
    identity = {
        "model": cfg.model.model_dump(mode="json"),
        "task": cfg.task,
        "grad_wrt": cfg.grad_wrt,
        "grad_dim": grads.grad_dim,
        "projector": projector.spec(),
        "train_data": train.fingerprint(),
        "chunk_rows": cfg.store.chunk_rows,
    }
    return _Setup(cfg, checkpoints, train, model, grads, projector, device, identity)


def _featurize_rows(
    s: _Setup,
    data: TensorDataset,
    rows: ChunkedRows,
    model_id: int,
    checkpoint: Path,
    *,
    with_out_to_loss: bool,
    reporter: Reporter,
    label: str,
) -> int:
    """Compute and write the pending chunks of one checkpoint; returns how many were computed."""
    pending = rows.pending()
    if not pending:
        return 0
    load_checkpoint(s.model, checkpoint)
    s.model.to(s.device)
    proj_dim = s.projector.proj_dim
    n_rows = sum(rows.rows(c)[1] - rows.rows(c)[0] for c in pending)
    with reporter.task(f"{label} model {model_id}", n_rows) as task:
        for chunk in pending:
            lo, hi = rows.rows(chunk)
            feats = np.empty((hi - lo, proj_dim), dtype=np.float32)
            q_all = np.empty(hi - lo, dtype=np.float32)
            for off, x, y in data.batches(lo, hi, s.cfg.data.batch_size):
                g, q = s.grads(x.to(s.device), y.to(s.device), row_offset=off)
                phi = s.projector.project(g, model_id=model_id)
                check_finite(phi, off)
                feats[off - lo : off - lo + len(y)] = phi.detach().cpu().numpy()
                q_all[off - lo : off - lo + len(y)] = q.detach().cpu().numpy()
                task.advance(len(y))
            if with_out_to_loss:
                rows.write(chunk, features=feats, out_to_loss=q_all)
            else:
                rows.write(chunk, features=feats)
    return len(pending)


@dataclass
class FeaturizeResult:
    """What a featurize run did.

    Attributes:
        store: the store path.
        n_models: checkpoints featurized.
        chunks_computed: row chunks computed in this run.
        chunks_total: row chunks over all checkpoints.
    """

    store: Path
    n_models: int
    chunks_computed: int
    chunks_total: int
    grad_dim: int
    proj_dim: int
    n_train: int


def featurize(cfg: Config, *, overwrite: bool = False, reporter: Reporter = NULL_REPORTER) -> FeaturizeResult:
    """Project the per-example gradients of every training example for every checkpoint.

    Writes ``train/<model_id>/{features, out_to_loss, done}`` chunk by chunk;
    a rerun recomputes only chunks not done (a finished store is a no-op).

    Raises:
        ConfigError, DataError, ModelError, CheckpointError, ProjectorError,
        GradientError, StoreError, StoreMismatchError (see their docs).
    """
    s = _setup(cfg)
    store = Store.create_or_check(cfg.store.path, s.identity, cfg.resolved(), overwrite=overwrite)
    computed = total = 0
    for model_id, ckpt in enumerate(s.checkpoints):
        rows = store.train(model_id, str(ckpt), file_sha256(ckpt))
        total += rows.n_chunks
        computed += _featurize_rows(
            s, s.train, rows, model_id, ckpt, with_out_to_loss=True, reporter=reporter, label="featurize"
        )
    return FeaturizeResult(
        Path(cfg.store.path), len(s.checkpoints), computed, total, s.grads.grad_dim, s.projector.proj_dim, len(s.train)
    )


@dataclass
class ScoreResult:
    """Scores of one experiment.

    Attributes:
        scores: ``[n_target, n_train]`` float32 TRAK scores.
        lambdas: the ridge λ_m used per checkpoint.
        train_labels, target_labels: ``[n_train]``, ``[n_target]`` int64 labels (for display).
    """

    scores: np.ndarray
    lambdas: list[float]
    train_labels: np.ndarray
    target_labels: np.ndarray
    experiment: str
    store: Path
    chunks_computed: int = 0
    notes: list[str] = field(default_factory=list)


def _open_for_scoring(s: _Setup) -> Store:
    path = Path(s.cfg.store.path)
    if not (path / "zarr.json").exists():
        raise StoreError(f"no train features at {path}; run `trak featurize CONFIG` first")
    store = Store.open_existing(path)
    if store.identity != jsonable(s.identity):
        lines = diff_keys(store.identity, s.identity)
        raise StoreMismatchError(
            f"the train features in {path} were made with different settings:\n  "
            + "\n  ".join(lines)
            + "\nscore with the config that featurized the store, or rerun `trak featurize CONFIG --overwrite`"
        )
    return store


def score(cfg: Config, *, overwrite: bool = False, reporter: Reporter = NULL_REPORTER) -> ScoreResult:
    """Featurize the targets, finalize each checkpoint's kernel and write the ensembled scores.

    Formula: design.md "Math" / :mod:`trakcli.scoring` (Park et al. 2023, Eq. 17).

    Args:
        cfg: config; ``data.target`` is required.
        overwrite: recompute the experiment's target features and scores.

    Returns:
        :class:`ScoreResult` with the ``[n_target, n_train]`` float32 scores.

    Raises:
        StoreError: no train features yet, or incomplete ones (run featurize).
        StoreMismatchError: train features made with other settings or checkpoints.
    """
    s = _setup(cfg, need_target=True)
    store = _open_for_scoring(s)
    exp = cfg.score.experiment
    train_rows: list[ChunkedRows] = []
    for model_id, ckpt in enumerate(s.checkpoints):
        rows = store.train(model_id, str(ckpt), file_sha256(ckpt))
        if not rows.is_complete():
            done = rows.n_chunks - len(rows.pending())
            raise StoreError(
                f"train features of model_id {model_id} ({ckpt}) are incomplete ({done}/{rows.n_chunks} chunks); "
                "run `trak featurize CONFIG` to finish them"
            )
        train_rows.append(rows)

    target = load_dataset(cfg.data.target, key="data.target")  # type: ignore[arg-type]  # checked by check_files
    t_fp = target.fingerprint()
    if t_fp["input_shape"] != s.identity["train_data"]["input_shape"]:
        raise StoreError(
            f"data.target inputs have shape {t_fp['input_shape']} per example but the train inputs have "
            f"{s.identity['train_data']['input_shape']}; targets must be examples of the same kind"
        )
    if overwrite:
        store.drop(f"targets/{exp}")
        store.drop(f"scores/{exp}")
    computed = 0
    target_rows = []
    for model_id, ckpt in enumerate(s.checkpoints):
        rows = store.targets(exp, model_id, t_fp)
        computed += _featurize_rows(
            s, target, rows, model_id, ckpt, with_out_to_loss=False, reporter=reporter, label="targets"
        )
        target_rows.append(rows)

    lam_key = {"lambda_reg": cfg.score.lambda_reg, "lambda_rel": cfg.score.lambda_rel}
    weights, lambdas = [], []
    with reporter.task("finalize kernels", len(s.checkpoints)) as task:
        for model_id, rows in enumerate(train_rows):
            factor_np = store.read_kernel(model_id, lam_key)
            if factor_np is None:
                gram = gram_matrix(torch.from_numpy(c) for _, _, c in rows.iter_chunks("features"))
                lam = resolve_lambda(gram, rows.n_rows, cfg.score.lambda_reg, cfg.score.lambda_rel)
                factor = kernel_factor(gram, lam)
                store.write_kernel(model_id, factor.numpy(), lam_key, lam)
            else:
                factor = torch.from_numpy(factor_np)
                lam = float(store.root[f"train/{model_id}/kernel"].attrs["lambda_reg"])
            lambdas.append(lam)
            phi_t = torch.from_numpy(target_rows[model_id].read("features", 0, len(target)))
            weights.append(target_weights(factor, phi_t))
            task.advance()

    settings = {
        **lam_key,
        "checkpoints": [store.checkpoint_info(m).get("sha256") for m in range(len(s.checkpoints))],
        "target_data": t_fp,
    }
    out = store.scores(exp, len(target), settings)
    pending = out.pending()
    with reporter.task("score", len(pending)) as task:
        for chunk in pending:
            t_lo, t_hi = out.rows(chunk)
            block = np.empty((t_hi - t_lo, len(s.train)), dtype=np.float32)
            for c in range(train_rows[0].n_chunks):
                lo, hi = train_rows[0].rows(c)
                feats = [torch.from_numpy(r.read("features", lo, hi)) for r in train_rows]
                qs = [torch.from_numpy(r.read("out_to_loss", lo, hi)) for r in train_rows]
                block[:, lo:hi] = score_block([w[t_lo:t_hi] for w in weights], feats, qs).numpy()
            out.write(chunk, scores=block)
            task.advance()
    scores = out.read("scores", 0, len(target))
    return ScoreResult(
        scores=scores,
        lambdas=lambdas,
        train_labels=s.train.labels.numpy(),
        target_labels=target.labels.numpy(),
        experiment=exp,
        store=Path(cfg.store.path),
        chunks_computed=computed + len(pending),
    )


def optimize(cfg: Config, *, overwrite: bool = False, reporter: Reporter = NULL_REPORTER) -> list[Path]:
    """Train ``optimize.n_models`` independently seeded models and write their checkpoints.

    Model ``i`` is initialized after ``torch.manual_seed(optimize.seed + i)``
    and trained by :func:`trakcli.training.train_classifier`; it is written
    atomically to ``optimize.out_dir/model_{i:03d}.pt``. Existing files are
    kept (a rerun resumes) unless ``overwrite``.

    Returns:
        The checkpoint paths, in model_id order.

    Raises:
        ConfigError: no ``optimize`` section.
    """
    oc = cfg.optimize
    if oc is None:
        raise ConfigError("optimize: section missing; add optimize: {n_models: 10, out_dir: ckpts, ...}")
    check_files(cfg, need_checkpoints=False)
    _apply_threads(cfg)
    train = load_dataset(cfg.data.train, key="data.train")
    device = resolve_device(cfg.device)
    try:
        oc.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"optimize.out_dir: cannot create {str(oc.out_dir)!r}: {e}") from None
    paths = []
    x, y = train.inputs.to(device), train.labels.to(device)
    for i in range(oc.n_models):
        path = oc.out_dir / f"model_{i:03d}.pt"
        paths.append(path)
        if path.exists() and not overwrite:
            reporter.info(f"{path} exists, kept (use --overwrite to retrain)")
            continue
        torch.manual_seed(oc.seed + i)
        model = build_model(cfg.model.entrypoint, **cfg.model.kwargs).to(device)
        train_classifier(
            model, x, y,
            epochs=oc.epochs, batch_size=oc.batch_size, lr=oc.lr, weight_decay=oc.weight_decay,
            momentum=oc.momentum, optimizer=oc.optimizer, seed=oc.seed + i,
            reporter=reporter, description=f"train model {i}",
        )
        with torch.no_grad():
            acc = (model(x).argmax(1) == y).float().mean().item()
        tmp = path.with_suffix(".pt.tmp")
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, tmp)
        os.replace(tmp, path)
        reporter.info(f"model {i}: train accuracy {acc:.3f} -> {path}")
    return paths
