"""The three jobs (optimize, featurize, score) as library functions.

The CLI is a thin layer over these; they take a validated
:class:`~trakcli.config.Config`, raise :class:`~trakcli.errors.TrakError` on
bad input, and report progress through a :class:`~trakcli.progress.Reporter`.
Under ``torchrun`` each process computes the row chunks of its rank
(chunk index ≡ rank mod world_size); rank 0 creates the store, holds its
lock and writes its attributes.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from trakcli.config import Config, check_files, recipe_key, resolve_checkpoints
from trakcli.data import TensorDataset, index_inputs, inputs_to, load_dataset
from trakcli.distributed import Dist, init_from_env
from trakcli.errors import ConfigError, GradientError, StoreError
from trakcli.gradients import OUTPUT_FUNCTIONS, PerExampleGradients, check_finite
from trakcli.hf import forward
from trakcli.models import build_model, file_sha256, load_checkpoint
from trakcli.progress import NULL_REPORTER, Reporter
from trakcli.projectors import make_projector
from trakcli.scoring import gram_matrix, kernel_factor, resolve_lambda, score_block, target_weights
from trakcli.store import ChunkedRows, Store, StoreLock, _flatten, jsonable, settings_mismatch
from trakcli.training import check_init_checkpoint, check_recipe, load_training_function, train_one


def _event(message: str) -> None:
    """Append a line to ``$TRAK_EVENT_LOG`` (how the kill-and-resume tests count work)."""
    path = os.environ.get("TRAK_EVENT_LOG")
    if path:
        with open(path, "a") as f:
            f.write(message + "\n")


def resolve_device(name: str, dist: Dist | None = None) -> torch.device:
    """``auto`` -> cuda if available else cpu; ``cuda`` without a GPU is a ConfigError.

    Under torchrun each process takes the GPU of its ``LOCAL_RANK``.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device: 'cuda' was asked for but no CUDA GPU is available; use device=cpu or auto")
        return torch.device("cuda", dist.local_rank if dist else 0)
    return torch.device(name)


def _apply_threads(cfg: Config) -> None:
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)


@dataclass
class _Setup:
    """Everything featurize and score share: model, gradients, projector, data, store identity."""

    cfg: Config
    checkpoints: list[Path]
    shas: list[str]
    train: TensorDataset
    model: torch.nn.Module
    grads: PerExampleGradients
    projector: Any
    device: torch.device
    identity: dict[str, Any]
    dist: Dist


def _setup(cfg: Config, *, need_target: bool = False) -> _Setup:
    check_files(cfg, need_checkpoints=True, need_target=need_target)
    _apply_threads(cfg)
    checkpoints = resolve_checkpoints(cfg)
    dist = init_from_env()
    device = resolve_device(cfg.device, dist)
    train = load_dataset(cfg.data.train, key="data.train")
    model = build_model(cfg.model.entrypoint, **cfg.model.kwargs)
    grads = PerExampleGradients(model, cfg.grad_wrt, cfg.task)
    projector = make_projector(**cfg.projector.options(), grad_dim=grads.grad_dim)
    identity = {
        "model": cfg.model.model_dump(mode="json"),
        "task": cfg.task,
        "output_function": OUTPUT_FUNCTIONS[cfg.task],
        "grad_wrt": cfg.grad_wrt,
        "grad_dim": grads.grad_dim,
        "param_names": grads.param_names,
        "projector": projector.spec(),
        "train_data": train.fingerprint(),
        "storage": {
            "chunk_rows": cfg.store.chunk_rows,
            "dtype": cfg.store.dtype,
            "compressor": cfg.store.compressor,
        },
    }
    shas = [file_sha256(c) for c in checkpoints]
    return _Setup(cfg, checkpoints, shas, train, model, grads, projector, device, identity, dist)


def rows_per_batch(cfg: Config, grad_dim: int) -> int:
    """``data.batch_size``, lowered so that ``rows x grad_dim`` float32 gradients fit ``data.grad_memory_mb``.

    Returns:
        At least 1 (a single example's gradient is never split).
    """
    fit = (cfg.data.grad_memory_mb * 2**20) // (4 * max(1, grad_dim))
    return max(1, min(cfg.data.batch_size, fit))


@contextmanager
def _locked(path: Path, dist: Dist, reporter: Reporter) -> Iterator[None]:
    """Hold ``<store>.lock`` (rank 0) for the duration of a run."""
    lock = StoreLock.for_store(Path(path)) if dist.is_main else None
    if lock is not None:
        Store.prepare_parent(Path(path))
        note = lock.acquire()
        if note:
            reporter.info(note)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _featurize_rows(
    s: _Setup,
    data: TensorDataset,
    rows: ChunkedRows,
    model_id: int,
    *,
    with_out_to_loss: bool,
    skip_nonfinite: bool,
    reporter: Reporter,
    label: str,
) -> tuple[int, list[int]]:
    """Compute and write this rank's pending chunks of one checkpoint.

    Returns:
        (chunks computed, indices of examples skipped as non-finite).
    """
    pending = rows.pending(s.dist.rank, s.dist.world_size)
    if not pending:
        return 0, []
    load_checkpoint(s.model, s.checkpoints[model_id])
    s.model.to(s.device)
    proj_dim = s.projector.proj_dim
    skipped: list[int] = []
    n_rows = sum(rows.rows(c)[1] - rows.rows(c)[0] for c in pending)
    with reporter.task(f"{label} model {model_id}", n_rows) as task:
        for chunk in pending:
            _event(f"start {label} {model_id} {chunk}")
            lo, hi = rows.rows(chunk)
            feats = np.empty((hi - lo, proj_dim), dtype=np.float32)
            q_all = np.empty(hi - lo, dtype=np.float32)
            bad_all = np.zeros(hi - lo, dtype=np.uint8)
            for off, x, y in data.batches(lo, hi, rows_per_batch(s.cfg, s.grads.grad_dim)):
                g, q = s.grads(inputs_to(x, s.device), y.to(s.device), row_offset=off)
                phi = s.projector.project(g, model_id=model_id)
                if skip_nonfinite:
                    bad = ~(torch.isfinite(phi).all(dim=1) & torch.isfinite(q))
                    if bad.any():
                        phi[bad], q[bad] = 0.0, 0.0
                        bad_all[off - lo : off - lo + len(y)] = bad.cpu().numpy()
                        skipped += (torch.nonzero(bad).flatten() + off).tolist()
                else:
                    check_finite(phi, off)
                feats[off - lo : off - lo + len(y)] = phi.detach().cpu().numpy()
                q_all[off - lo : off - lo + len(y)] = q.detach().cpu().numpy()
                task.advance(len(y))
            if with_out_to_loss:
                rows.write(chunk, features=feats, out_to_loss=q_all, nonfinite=bad_all)
            else:
                rows.write(chunk, features=feats)
            _event(f"done {label} {model_id} {chunk}")
    return len(pending), skipped


@dataclass
class FeaturizeResult:
    """What a featurize run did.

    Attributes:
        store: the store path.
        n_models: checkpoints featurized.
        chunks_computed: row chunks computed in this run (by this process).
        chunks_total: row chunks over all checkpoints.
        skipped: per model_id, example indices skipped as non-finite in this run.
        repaired: chunks whose checksum failed and that were recomputed (``verify``).
    """

    store: Path
    n_models: int
    chunks_computed: int
    chunks_total: int
    grad_dim: int
    proj_dim: int
    n_train: int
    skipped: dict[int, list[int]] = field(default_factory=dict)
    repaired: int = 0


def featurize(
    cfg: Config,
    *,
    overwrite: bool = False,
    skip_nonfinite: bool = False,
    verify: bool = False,
    reporter: Reporter = NULL_REPORTER,
) -> FeaturizeResult:
    """Project the per-example gradients of every training example for every checkpoint.

    Writes ``train/<model_id>/{features, out_to_loss, nonfinite, done}`` chunk
    by chunk; a rerun recomputes only chunks not done (a finished store is a
    no-op), whatever the batch size.

    Args:
        cfg: the validated config.
        overwrite: delete the store and start over.
        skip_nonfinite: record examples whose gradients are not finite in
            ``nonfinite`` and store zero features for them (no influence on
            the kernel, zero scores) instead of stopping.
        verify: read every done chunk and recompute those failing their checksum.

    Raises:
        ConfigError, DataError, ModelError, CheckpointError, ProjectorError,
        GradientError (non-finite gradients, with the example indices),
        StoreError (unwritable path, store in use, write failure),
        StoreMismatchError (store made with other settings).
    """
    s = _setup(cfg)
    path = Path(cfg.store.path)
    computed = total = repaired = 0
    skipped: dict[int, list[int]] = {}
    with _locked(path, s.dist, reporter):
        if s.dist.is_main:
            store = Store.create_or_check(path, s.identity, cfg.resolved(), overwrite=overwrite)
            for model_id, ckpt in enumerate(s.checkpoints):
                store.train(model_id, str(ckpt), s.shas[model_id])
        s.dist.barrier()
        if not s.dist.is_main:
            store = Store.create_or_check(path, s.identity, cfg.resolved(), create=False)
        for model_id, ckpt in enumerate(s.checkpoints):
            rows = store.train(model_id, str(ckpt), s.shas[model_id], create=s.dist.is_main)
            if verify:
                bad = [c for c in rows.verify() if c % s.dist.world_size == s.dist.rank]
                repaired += len(bad)
                if bad:
                    reporter.info(f"model {model_id}: chunks {bad} failed their checksum and are recomputed")
            total += rows.n_chunks
            n, skip = _featurize_rows(
                s, s.train, rows, model_id, with_out_to_loss=True, skip_nonfinite=skip_nonfinite,
                reporter=reporter, label="featurize",
            )
            computed += n
            if skip:
                skipped[model_id] = skip
        s.dist.barrier()
    return FeaturizeResult(
        path, len(s.checkpoints), computed, total, s.grads.grad_dim, s.projector.proj_dim, len(s.train),
        skipped, repaired,
    )


@dataclass
class ScoreResult:
    """Scores of one experiment, in the store.

    Attributes:
        store: the store path; experiment: the experiment name.
        n_target, n_train: the score matrix shape.
        lambdas: the ridge λ_m used per checkpoint.
        train_labels, target_labels: ``[n_train]``, ``[n_target]`` int64 labels (for display).
        chunks_computed: target and score chunks computed in this run.
    """

    store: Path
    experiment: str
    n_target: int
    n_train: int
    lambdas: list[float]
    train_labels: np.ndarray
    target_labels: np.ndarray
    chunks_computed: int = 0
    notes: list[str] = field(default_factory=list)

    def head(self, n: int) -> np.ndarray:
        """The first ``n`` target rows of the scores, ``[n, n_train]`` float32."""
        return self._array()[: min(n, self.n_target)]

    def _array(self) -> Any:
        return Store.open_existing(self.store, mode="r").array(f"scores/{self.experiment}/scores")

    @property
    def scores(self) -> np.ndarray:
        """All scores ``[n_target, n_train]`` float32, read into memory."""
        return np.asarray(self._array()[:])


def _check_train_complete(s: _Setup, store: Store) -> list[ChunkedRows]:
    if not store.identity:  # made by `trak eval` (retrained models only)
        raise StoreError(f"the store {store.path} holds no train features yet; run `trak featurize CONFIG` first")
    if store.identity != jsonable(s.identity):
        raise settings_mismatch(
            f"the train features in {store.path}", store.identity, s.identity,
            "score with the config that featurized the store, or rerun `trak featurize CONFIG --overwrite`",
        )
    have = store.model_ids()
    missing = [m for m in range(len(s.checkpoints)) if m not in have]
    if missing:
        raise StoreError(
            f"the store has no train features for model_ids {missing} (the config lists {len(s.checkpoints)} "
            f"checkpoints, the store has model_ids {have}); run `trak featurize CONFIG` first"
        )
    rows_all = []
    for model_id, ckpt in enumerate(s.checkpoints):
        rows = store.train(model_id, str(ckpt), s.shas[model_id], create=False)
        if not rows.is_complete():
            done = int((rows.flags() != 0).sum())
            raise StoreError(
                f"train features of model_id {model_id} ({ckpt}) are incomplete ({done}/{rows.n_chunks} chunks); "
                "run `trak featurize CONFIG` to finish them"
            )
        rows_all.append(rows)
    return rows_all


def score(
    cfg: Config,
    *,
    overwrite: bool = False,
    skip_nonfinite: bool = False,
    verify: bool = False,
    reporter: Reporter = NULL_REPORTER,
) -> ScoreResult:
    """Featurize the targets, finalize each checkpoint's kernel and write the ensembled scores.

    Formula: design.md "Math" / :mod:`trakcli.scoring` (Park et al. 2023, Eq. 17).
    Train features are streamed from the store one column block (``chunk_rows``
    train rows) at a time, so memory is O(n_target·proj_dim + chunk_rows·proj_dim
    + proj_dim² + n_target·chunk_rows), never n_train·n_target.

    Args:
        cfg: config; ``data.target`` is required.
        overwrite: recompute the experiment's target features and scores.
        skip_nonfinite: give targets with non-finite gradients zero features (zero scores).
        verify: recompute target and score chunks that fail their checksum.

    Returns:
        :class:`ScoreResult`; the ``[n_target, n_train]`` float32 scores are in the store.

    Raises:
        StoreError: no train features yet, or incomplete ones (run featurize); store in use.
        StoreMismatchError: train features made with other settings or checkpoints.
    """
    s = _setup(cfg, need_target=True)
    path = Path(cfg.store.path)
    exp = cfg.score.experiment
    target = load_dataset(cfg.data.target, key="data.target")  # type: ignore[arg-type]  # checked by check_files
    t_fp = target.fingerprint()
    if t_fp["input_shape"] != s.identity["train_data"]["input_shape"]:
        raise StoreError(
            f"data.target inputs have shape {t_fp['input_shape']} per example but the train inputs have "
            f"{s.identity['train_data']['input_shape']}; targets must be examples of the same kind"
        )
    t_attrs = {"target_data": t_fp, "checkpoints": s.shas}
    lam_key = {"lambda_reg": cfg.score.lambda_reg, "lambda_rel": cfg.score.lambda_rel}
    settings = {**lam_key, **t_attrs}
    n_models = len(s.checkpoints)
    computed = 0
    with _locked(path, s.dist, reporter):
        store = Store.open_existing(path)
        train_rows = _check_train_complete(s, store)
        if s.dist.is_main:
            if overwrite:
                store.drop(f"targets/{exp}")
                store.drop(f"scores/{exp}")
            for model_id in range(n_models):
                store.targets(exp, model_id, t_attrs, len(target))
            store.scores(exp, len(target), settings)
        s.dist.barrier()

        # 1. target features
        target_rows = []
        for model_id in range(n_models):
            rows = store.targets(exp, model_id, t_attrs, len(target), create=False)
            if verify:
                rows.verify()
            n, skip = _featurize_rows(
                s, target, rows, model_id, with_out_to_loss=False, skip_nonfinite=skip_nonfinite,
                reporter=reporter, label="targets",
            )
            computed += n
            if skip:
                reporter.info(f"model {model_id}: targets {skip[:10]} have non-finite gradients; their scores are 0")
            target_rows.append(rows)
        s.dist.barrier()

        out = store.scores(exp, len(target), settings, create=False)
        if verify:
            out.verify()
        lambdas, n = finalize_and_score(
            store, train_rows, target_rows, out, lambda_reg=cfg.score.lambda_reg, lambda_rel=cfg.score.lambda_rel,
            dist=s.dist, reporter=reporter,
        )
        computed += n
    return ScoreResult(
        store=path,
        experiment=exp,
        n_target=len(target),
        n_train=len(s.train),
        lambdas=lambdas,
        train_labels=s.train.labels.numpy(),
        target_labels=target.labels.numpy(),
        chunks_computed=computed,
    )


def finalize_and_score(
    store: Store,
    train_rows: list[ChunkedRows],
    target_rows: list[ChunkedRows],
    out: ChunkedRows,
    *,
    lambda_reg: float | None,
    lambda_rel: float,
    dist: Dist | None = None,
    reporter: Reporter = NULL_REPORTER,
) -> tuple[list[float], int]:
    """Finalize each checkpoint's kernel and write the pending score blocks.

    Kernels (Cholesky factors of ``Φ_mᵀΦ_m + λ_m I``, float64) are computed by
    rank ``m mod world_size`` and stored, so a rerun reuses them. Scores are
    computed one block of ``chunk_rows`` train columns at a time:
    ``[(1/M) Σ_m W_m Φ_m[block]ᵀ] ⊙ [(1/M) Σ_m Q_m[block]]`` with
    ``W_m = Φ_m(targets) A_m`` (float32 products of float64 solves).

    Args:
        store: the open store.
        train_rows: per model_id, complete train features (``features``, ``out_to_loss``).
        target_rows: per model_id, complete target features.
        out: the scores array of the experiment (chunked by train columns).
        lambda_reg, lambda_rel: the ridge (see :func:`trakcli.scoring.resolve_lambda`).

    Returns:
        (λ_m per model_id, score blocks computed by this process).
    """
    dist = dist or Dist()
    n_models = len(train_rows)
    n_target = target_rows[0].n_rows
    lam_key = {"lambda_reg": lambda_reg, "lambda_rel": lambda_rel}
    for model_id in range(dist.rank, n_models, dist.world_size):
        if store.read_kernel(model_id, lam_key) is None:
            _event(f"start kernel {model_id}")
            rows = train_rows[model_id]
            gram = gram_matrix(
                torch.from_numpy(c.astype(np.float32, copy=False)) for _, _, c in rows.iter_chunks("features")
            )
            lam = resolve_lambda(gram, rows.n_rows, lambda_reg, lambda_rel)
            store.write_kernel(model_id, kernel_factor(gram, lam).numpy(), lam_key, lam)
    dist.barrier()
    weights, lambdas = [], []
    for model_id in range(n_models):
        kernel = store.read_kernel(model_id, lam_key)
        if kernel is None:
            raise StoreError(f"the kernel of model_id {model_id} is missing; rerun the same command")
        factor, lam = kernel
        phi_t = torch.from_numpy(target_rows[model_id].read("features", 0, n_target).astype(np.float32))
        weights.append(target_weights(torch.from_numpy(factor), phi_t).to(torch.float32))
        lambdas.append(lam)

    pending = out.pending(dist.rank, dist.world_size)
    with reporter.task("score", len(pending)) as task:
        for chunk in pending:
            _event(f"start score {chunk}")
            lo, hi = out.rows(chunk)
            feats = [torch.from_numpy(r.read("features", lo, hi).astype(np.float32, copy=False)) for r in train_rows]
            qs = [torch.from_numpy(r.read("out_to_loss", lo, hi)) for r in train_rows]
            out.write(chunk, scores=score_block(weights, feats, qs).numpy())
            _event(f"done score {chunk}")
            task.advance()
    dist.barrier()
    return lambdas, len(pending)


def recipe_sections(cfg: Config) -> dict[str, Any]:
    """The training recipe as the user spelled it: ``{"training": ..., "optimizer": ...}`` or ``{"optimize": ...}``.

    JSON-able; an omitted ``optimizer:`` (with ``training:``) is shown with its defaults.
    """
    from trakcli.config import OptimizerConfig

    if cfg.training is not None:
        return {
            "training": cfg.training.model_dump(mode="json"),
            "optimizer": (cfg.optimizer or OptimizerConfig()).model_dump(mode="json"),
        }
    return {"optimize": cfg.optimize.model_dump(mode="json") if cfg.optimize is not None else None}


# recipe keys that never change what a model trains to (a rerun may change them and keep its models)
_RUN_ONLY = ("n_models", "out_dir", "metrics", "checkpoint_every")


def _trained_with(recipe: dict[str, Any]) -> dict[str, Any]:
    """The flat recipe of a manifest's ``recipe`` sections, without the run-only keys (for comparing runs)."""
    from trakcli.config import OptimizeConfig, OptimizerConfig, TrainingConfig

    if "optimize" in recipe:
        flat = OptimizeConfig.model_validate(recipe["optimize"])
    else:
        flat = OptimizeConfig.from_sections(
            TrainingConfig.model_validate(recipe["training"]), OptimizerConfig.model_validate(recipe["optimizer"])
        )
    return {k: v for k, v in flat.model_dump(mode="json").items() if k not in _RUN_ONLY}


def _previous_models(cfg: Config, path: Path, identity: dict[str, Any], reporter: Reporter) -> dict[int, dict]:
    """The entries of an earlier run's manifest at ``path``, by model_id, if it trained the same way.

    Raises:
        ConfigError: the manifest's models were trained with another recipe, model or data
            (names the differing keys; --overwrite retrains).
    """
    from trakcli.manifest import read_manifest

    if not path.exists():
        return {}
    try:
        old = read_manifest(path, key="optimize.out_dir")
        old_identity = {k: old.get(k) for k in ("model", "task", "train_data")}
        old_identity["recipe"] = _trained_with(old["recipe"])
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        reporter.info(f"{path}: not a readable manifest ({str(e).splitlines()[0]}); it is written anew")
        return {}
    a, b = _flatten(old_identity), _flatten(identity)
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if diff:
        key = recipe_key(cfg)
        shown = ", ".join(d.replace("recipe.", "") for d in diff)
        out_dir = str(cfg.optimize.out_dir)  # type: ignore[union-attr]
        raise ConfigError(
            f"{key}.out_dir: {out_dir!r} holds models that trak optimize trained differently "
            f"(its manifest differs in: {shown}); rerun with --overwrite to retrain them, or choose another out_dir"
        )
    return {m["model_id"]: m for m in old["models"]}


def optimize(cfg: Config, *, overwrite: bool = False, reporter: Reporter = NULL_REPORTER) -> list[Path]:
    """Train ``optimize.n_models`` independently seeded models and write their checkpoints and manifest.

    Model ``i`` is built, seeded with ``optimize.seed + i`` and trained by
    :func:`trakcli.training.train_one` (the built-in recipe, or the user's
    ``training.entrypoint``), the same function that retrains the models of
    `trak eval` (:mod:`trakcli.eval`), on a random ``subset_fraction`` of
    ``data.train`` if below 1 (drawn with ``optimize.seed + i``); it is written
    atomically to ``optimize.out_dir/model_{i:03d}.pt``. Existing files are
    kept (a rerun resumes) unless ``overwrite``; a model killed mid-training
    resumes from its training state in ``out_dir/.resume/`` (saved every
    ``optimize.checkpoint_every`` steps and at epoch ends), bit-identically.
    With ``optimize.projection`` the optimizer runs in a random subspace
    (:class:`trakcli.optim.ProjectedOptimizer`). With ``data.validation`` the
    built-in recipe evaluates the model on it after every epoch.

    After every finished model, ``out_dir/manifest.json`` is written atomically
    (:mod:`trakcli.manifest`): the recipe in the user's spelling, the model, and per
    model its checkpoint (relative path), sha256, seed, subset indices and metrics
    (final loss, train / target / validation accuracy, optimizer state floats,
    per-epoch history); ``complete`` once all ``n_models`` are listed. A kept file
    reuses its entry of the previous manifest when its sha256 still matches, else
    its accuracies are measured and it is recorded with ``origin: found``. With
    ``optimize.metrics`` the same per-model metrics also go to that JSON file.

    Returns:
        The checkpoint paths, in model_id order.

    Raises:
        ConfigError: no ``optimize`` section, an output path that cannot be written, or an
            out_dir whose manifest records models trained another way (without ``overwrite``).
        DataError: data.train, data.target or data.validation cannot be loaded.
        OptimizerError: projection settings the model cannot use.
    """
    from trakcli import __version__
    from trakcli.manifest import FORMAT, FORMAT_VERSION, MANIFEST_NAME, checkpoint_sha256, write_manifest
    from trakcli.training import evaluate

    oc = check_recipe(cfg)
    check_files(cfg, need_checkpoints=False, need_validation=True)
    load_training_function(cfg)  # a bad training.entrypoint fails before any model trains
    _apply_threads(cfg)
    train = load_dataset(cfg.data.train, key="data.train")
    heldout = load_dataset(cfg.data.target, key="data.target") if cfg.data.target is not None else None
    valset = load_dataset(cfg.data.validation, key="data.validation") if cfg.data.validation is not None else None
    device = resolve_device(cfg.device)
    try:
        oc.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"optimize.out_dir: cannot create {str(oc.out_dir)!r}: {e}") from None
    check_init_checkpoint(oc, recipe_key(cfg))
    recipe = recipe_sections(cfg)
    identity = {
        "model": cfg.model.model_dump(mode="json"),
        "task": cfg.task,
        "train_data": train.fingerprint(),
        "recipe": _trained_with(recipe),
    }
    manifest_path = oc.out_dir / MANIFEST_NAME
    previous = {} if overwrite else _previous_models(cfg, manifest_path, identity, reporter)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "trakcli_version": __version__,
        "n_models": oc.n_models,
        "complete": False,
        "recipe": recipe,
        "model": identity["model"],
        "task": cfg.task,
        "train_data": identity["train_data"],
        "validation_data": valset.fingerprint() if valset is not None else None,
        "models": [],
    }
    if overwrite:
        write_manifest(manifest_path, manifest)  # the old manifest no longer describes the files
    paths = []
    rows: list[dict[str, Any]] = []
    x, y = inputs_to(train.inputs, device), train.labels.to(device)
    held = (inputs_to(heldout.inputs, device), heldout.labels.to(device)) if heldout is not None else None
    val = (inputs_to(valset.inputs, device), valset.labels.to(device)) if valset is not None else None
    eval_rows = cfg.data.batch_size

    def final_metrics(model: torch.nn.Module) -> dict[str, Any]:
        """Accuracy on all of data.train, on data.target and loss / accuracy on data.validation (classifiers)."""
        if cfg.task == "language_modeling":  # a user training function trained an LM: no class accuracy
            return {}
        out: dict[str, Any] = {"train_accuracy": evaluate(model, x, y, batch_size=eval_rows)[1]}
        if held is not None:
            out["target_accuracy"] = evaluate(model, *held, batch_size=eval_rows)[1]
        if val is not None:
            out["validation_loss"], out["validation_accuracy"] = evaluate(model, *val, batch_size=eval_rows)
        return out

    for i in range(oc.n_models):
        path = oc.out_dir / f"model_{i:03d}.pt"
        paths.append(path)
        entry: dict[str, Any] = {"model_id": i, "checkpoint": path.name, "sha256": None, "seed": oc.seed + i}
        xi, yi = x, y
        if oc.subset_fraction < 1:
            gen = torch.Generator().manual_seed(oc.seed + i)
            k = max(1, round(oc.subset_fraction * len(y)))
            subset = torch.randperm(len(y), generator=gen)[:k].sort().values
            entry["subset_indices"] = subset.tolist()
            xi, yi = index_inputs(x, subset.to(device)), y[subset.to(device)]
        kept = path.exists() and not overwrite
        if kept:
            sha = checkpoint_sha256(path)
            prev = previous.get(i)
            if prev is not None and prev.get("sha256") == sha and prev.get("checkpoint") == path.name:
                entry = prev
                reporter.info(f"{path} exists, kept (use --overwrite to retrain)")
            else:
                model = build_model(cfg.model.entrypoint, **cfg.model.kwargs)
                load_checkpoint(model, path)
                model.to(device).eval()
                entry.update(sha256=sha, origin="found", metrics=final_metrics(model))
                why = "changed since the manifest was written" if prev is not None else "not in a manifest"
                reporter.info(
                    f"{path} exists ({why}): kept and recorded as it is, without a training history "
                    "(use --overwrite to retrain)"
                )
        else:
            stats: dict[str, Any] = {}
            resume = oc.out_dir / ".resume" / f"model_{i:03d}.pt"
            if overwrite:
                resume.unlink(missing_ok=True)
            elif resume.exists():
                reporter.info(f"model {i}: resuming from {resume}")
            model = train_one(
                cfg, xi, yi, seed=oc.seed + i, device=device, reporter=reporter,
                description=f"train model {i}", metrics=stats, resume_path=resume, validation=val,
            )
            try:
                resume.parent.rmdir()  # only when empty: no other model's state is pending
            except OSError:
                pass
            tmp = path.with_suffix(".pt.tmp")
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, tmp)
            os.replace(tmp, path)
            history = stats.pop("history", None)
            metrics = {**stats, **final_metrics(model)}
            if history is not None:
                metrics["history"] = history
            entry.update(sha256=checkpoint_sha256(path), origin="trained", metrics=metrics)
            reporter.info(_model_line(i, metrics, model) + f" -> {path}")
        manifest["models"].append(entry)
        manifest["complete"] = len(manifest["models"]) == oc.n_models
        write_manifest(manifest_path, manifest)
        _event(f"manifest {i}")
        rows.append({
            "model_id": i, "seed": entry["seed"], "checkpoint": str(path), "sha256": entry["sha256"],
            **({"subset_indices": entry["subset_indices"]} if "subset_indices" in entry else {}),
            **entry.get("metrics", {}),
            **({"kept": True} if kept else {}),
        })
    if oc.metrics is not None:
        import json

        summary = {
            "trakcli_version": __version__,
            **recipe,
            "model": identity["model"],
            "n_params": sum(p.numel() for p in build_model(cfg.model.entrypoint, **cfg.model.kwargs).parameters()),
            "manifest": str(manifest_path),
            "models": rows,
        }
        try:
            oc.metrics.parent.mkdir(parents=True, exist_ok=True)
            tmp = oc.metrics.with_suffix(oc.metrics.suffix + ".tmp")
            tmp.write_text(json.dumps(summary, indent=2) + "\n")
            os.replace(tmp, oc.metrics)
        except OSError as e:
            raise ConfigError(f"optimize.metrics: cannot write {str(oc.metrics)!r}: {e}") from None
        reporter.info(f"metrics -> {oc.metrics}")
    reporter.info(f"manifest -> {manifest_path}")
    return paths


def _model_line(i: int, metrics: dict[str, Any], model: torch.nn.Module) -> str:
    """The one line `trak optimize` prints per trained model."""
    parts = [f"model {i}:"]
    if "final_loss" in metrics:
        parts.append(f"loss {metrics['final_loss']:.4f},")
    for name in ("train", "target", "validation"):
        key = f"{name}_accuracy"
        if key in metrics:
            parts.append(f"{name} accuracy {metrics[key]:.3f},")
    if "optimizer_state_numel" in metrics:
        n_params = sum(p.numel() for p in model.parameters())
        share = metrics["optimizer_state_numel"] / (2 * n_params)
        parts.append(f"optimizer state {metrics['optimizer_state_numel']} floats ({share:.1%} of AdamW's)")
    return " ".join(parts).rstrip(",:")
