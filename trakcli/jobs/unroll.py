"""`trak score` with ``score.method: unroll``: metagradient scores of the runs `trak optimize` recorded.

For every checkpoint of a `trak optimize` manifest trained with ``optimize.replay: true`` and every target z,
:class:`trakcli.unroll.Unroller` computes ``∂ℓ_z(θ_T)/∂w_i`` for every train row i by reverse mode through
the recorded steps (Ilyas & Engstrom 2025, "MAGIC"); the score is minus its mean over the checkpoints,
``τ(z, i) = −(1/M) Σ_m ∂ℓ_z(θ_T^m)/∂w_i`` (positive: upweighting i lowers the target's loss; 0 for a row
outside a model's ``subset_fraction`` subset), in nats of the target's loss per unit of weight on the
example's loss (one more copy of it in every epoch: weight 2).

The targets are scored ``data.batch_size`` at a time (one replay of every model per chunk, the targets' adjoints
stacked); each finished chunk is written with its done flag to ``scores/<experiment>/unroll_rows``
(``[n_chunks, batch_size, n_train]`` float32), so a killed run resumes at the first chunk not done. Once every chunk is
done, the matrix (``scores/<experiment>/scores``) and, with ``score.top_k``, the top-k are written from them and the
chunks dropped. Under ``torchrun`` rank r scores the chunks ``c ≡ r (mod N)``; rank 0 holds the lock, creates the arrays
first and writes the results: the store equals one process's bit for bit (the same device kind and thread count).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trakcli.config import Config
from trakcli.data.load import load_dataset
from trakcli.data.tensors import inputs_to, slice_inputs
from trakcli.distributed import Dist, init_from_env
from trakcli.errors import ConfigError, GradientError, StoreMismatchError
from trakcli.jobs.inputs import resolve_checkpoints
from trakcli.jobs.optimize import model_rows
from trakcli.jobs.plan import ScorePlan
from trakcli.jobs.runtime import apply_threads, event, locked_store, resolve_device
from trakcli.models.build import build_model
from trakcli.models.checkpoints import read_state_dict
from trakcli.progress import NULL_REPORTER, Reporter
from trakcli.store import Store
from trakcli.store.layout import StoreLayout
from trakcli.store.manifest import is_manifest_path, read_manifest
from trakcli.store.rows import ChunkedRows
from trakcli.tasks import resolve_task
from trakcli.topk import StoredTopK
from trakcli.unroll import ReplayRecord, Unroller, no_record

#: The group of finished chunks of targets (``scores/<experiment>/unroll_rows``), dropped once the matrix is written.
ROWS_GROUP = "unroll_rows"


def unroll_score(cfg: Config, *, overwrite: bool = False, reporter: Reporter = NULL_REPORTER) -> Any:
    """Score ``data.target`` against ``data.train`` by metagradients of the recorded trainings (module docstring):
    ``cfg`` has ``score.method: unroll`` and ``checkpoints:`` the ``manifest.json`` of a run trained with
    ``optimize.replay: true``; ``overwrite`` drops the experiment's scores first.

    Returns:
        A :class:`trakcli.jobs.score.ScoreResult` (``lambdas`` all 0: no ridge).

    Raises:
        ConfigError: no data.target; a recipe or model the steps cannot be differentiated through (named).
        CheckpointError: checkpoints not from a manifest, or without replay records (names
            ``trak optimize CONFIG optimize.replay=true --overwrite``); a record that does not reproduce its checkpoint.
        StoreMismatchError: the store holds other train data, or the experiment other settings (names ``--overwrite``).
        GradientError: non-finite metagradients (names the model and the targets).
    """
    from trakcli.jobs.score import score_result

    if cfg.data.target is None:
        raise ConfigError("data.target: required by trak score (the targets to attribute); add data.target")
    if not is_manifest_path(cfg.checkpoints):
        raise no_record(f"checkpoints {cfg.checkpoints!r}", "they are not the manifest.json of a `trak optimize` run")
    apply_threads(cfg.num_threads)
    manifest_path = Path(cfg.checkpoints)  # type: ignore[arg-type]
    checkpoints = resolve_checkpoints(cfg)  # complete and unchanged since trained
    manifest = read_manifest(manifest_path)
    if (manifest["recipe"]["optimize"] or {}).get("lora"):
        raise ConfigError("optimize.lora: score.method: unroll differentiates the training of every weight, not "
                          "LoRA adapters; train without optimize.lora")
    task = resolve_task(cfg.task)
    dist = init_from_env()
    device = resolve_device(cfg.device, dist)
    main_reporter = reporter if dist.is_main else NULL_REPORTER
    main_reporter.phase("loading data.train and data.target …")
    train = load_dataset(cfg.data.train, key="data.train", task=task)
    target = load_dataset(cfg.data.target, key="data.target", task=task)
    n_train, n_target = len(train), len(target)
    chunk = cfg.data.batch_size
    plan = replace(ScorePlan.of(cfg.score), per_token=False)
    exp, full = plan.experiment, plan.full
    top_k = None if plan.top_k is None else min(plan.top_k, n_train)
    entries = manifest["models"][:len(checkpoints)]
    settings = {"method": "unroll", "target_data": target.fingerprint(),
                "trained_checkpoints": [e["sha256"] for e in entries], "targets_per_replay": chunk, "output": "loss"}
    path = cfg.store.location
    n_chunks = -(-n_target // chunk)
    computed = 0
    with locked_store(path, dist, reporter):
        todo = False
        if dist.is_main:  # creates or repairs every array before the other ranks open them
            store = _open_store(cfg, path, train)
            if overwrite:
                store.drop(f"scores/{exp}")
            store.score_settings(exp, settings, repair=True)
            done_matrix = not full or store.scores(exp, n_target, settings, repair=True).is_complete()
            done_top = top_k is None or StoredTopK(store, exp, n_target, top_k, create=True).is_complete()
            todo = not (done_matrix and done_top)
            if todo:
                rows = _chunk_rows(store, exp, chunk, n_train, n_chunks, create=True)
        todo = _from_main(dist, todo)
        if todo and not dist.is_main:  # opened after rank 0 has created them
            store = Store.open_existing(path)
            store.distributed = True
            rows = _chunk_rows(store, exp, chunk, n_train, n_chunks, create=False)
        pending = rows.pending(dist.rank, dist.world_size, marked=False) if todo else []
        if pending:
            unrollers = [_unroller(cfg, manifest_path, e, ckpt, train, device, main_reporter)
                         for e, ckpt in zip(entries, checkpoints)]
            for c in pending:
                lo, hi = c * chunk, min((c + 1) * chunk, n_target)
                event(f"start unroll {c}")
                block = np.zeros((1, chunk, n_train), dtype=np.float32)
                block[0, :hi - lo] = _chunk_scores(unrollers, target, lo, hi, n_train, device, main_reporter)
                rows.write(c, scores=block)
                event(f"done unroll {c}")
                computed += 1
        dist.barrier()
        if dist.is_main:
            if todo:
                computed += _write_results(store, rows, exp, settings, n_target, chunk, full, top_k, reporter)
            store.drop(f"scores/{exp}/{ROWS_GROUP}")
        dist.barrier()
    return score_result(path, plan, train, target, [0.0] * len(checkpoints), computed)


def replayed_checkpoints(cfg: Config) -> list[str]:
    """The sha256s of the checkpoints whose recorded trainings ``eval.retrain_seed: replay`` reruns, in model_id order.

    Raises:
        CheckpointError: checkpoints that are not a `trak optimize` manifest, or a model without a replay
            record (names ``trak optimize CONFIG optimize.replay=true --overwrite``); a changed checkpoint.
    """
    if not is_manifest_path(cfg.checkpoints):
        raise no_record(f"checkpoints {cfg.checkpoints!r}", "eval.retrain_seed: replay reruns recorded trainings, "
                                                            "and they are not the manifest.json of a `trak optimize` run")
    checkpoints = resolve_checkpoints(cfg)
    entries = read_manifest(Path(cfg.checkpoints))["models"][:len(checkpoints)]  # type: ignore[arg-type]
    for e, ckpt in zip(entries, checkpoints):
        if not e.get("replay"):
            raise no_record(f"model {e['model_id']} ({ckpt})", "its manifest entry lists no replay record, which "
                            "eval.retrain_seed: replay reruns")
    return [e["sha256"] for e in entries]


#: The Unroller (and subset) of each recorded training rerun by :func:`reweighted_model` in this process, by
#: (manifest, model_id, checkpoint sha256, device).
_REPLAYS: dict[tuple[str, int, str, str], tuple[Unroller, torch.Tensor | None]] = {}


def reweighted_model(cfg: Config, model_id: int, mask: np.ndarray, train: Any, device: torch.device) -> torch.nn.Module:
    """Checkpoint ``model_id``'s recorded training rerun with the rows outside ``mask`` (``[n_train]`` bool over
    data.train) weighted 0: the same initialization, order, batches and learning rates
    (:meth:`Unroller.reweighted_params <trakcli.unroll.Unroller.reweighted_params>`), the counterfactual whose
    derivative at weight 1 ``score.method: unroll`` computes; in eval mode on ``device``. The record is checked
    against its checkpoint once per process.

    Raises:
        CheckpointError: as :func:`replayed_checkpoints`, or a record that does not reproduce its checkpoint.
        ConfigError: a recipe or model the steps cannot be rerun through (as ``score.method: unroll``).
    """
    path = Path(cfg.checkpoints)  # type: ignore[arg-type]
    if not is_manifest_path(cfg.checkpoints):
        replayed_checkpoints(cfg)  # raises, naming the command
    entry = read_manifest(path)["models"][model_id]
    key = (str(path.resolve()), model_id, str(entry.get("sha256")), str(device))
    if key not in _REPLAYS:  # first use of this checkpoint here: its file's sha256 and record are checked
        replayed_checkpoints(cfg)
        _REPLAYS[key] = _unroller(cfg, path, entry, resolve_checkpoints(cfg)[model_id], train, device, NULL_REPORTER)
    unroller, subset = _REPLAYS[key]
    weights = torch.from_numpy(np.asarray(mask, dtype=np.float32))
    if subset is not None:  # the model trained on its own subset of data.train: its rows, in its numbering
        weights = weights[subset]
    params = unroller.reweighted_params(weights)
    unroller.model.load_state_dict({**unroller.model.state_dict(), **params})
    return unroller.model.eval()


def _chunk_rows(store: Store, exp: str, chunk: int, n_train: int, n_chunks: int, create: bool) -> ChunkedRows:
    """The finished chunks of targets, ``scores/<exp>/unroll_rows``: ``[n_chunks, chunk, n_train]`` float32 (zeros
    past n_target), a done flag per chunk (created or repaired when ``create``; StoreMismatchError naming
    ``--overwrite`` for chunks of another size)."""
    t_rows = min(chunk, max(1, (4 << 20) // (4 * n_train)))  # store chunks of ~4 MB, within one chunk of targets
    arrays = {"scores": ((n_chunks, chunk, n_train), "float32", (1, t_rows, n_train), ("chunk", "target", "train"))}
    return store.sized_rows(f"scores/{exp}/{ROWS_GROUP}", {"targets": chunk}, arrays, n_chunks, 1, create, create)


def _from_main(dist: Dist, value: bool) -> bool:
    """Rank 0's ``value`` on every rank (``torch.distributed.broadcast_object_list``; a single process: itself)."""
    if dist.world_size == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return bool(box[0])


def _open_store(cfg: Config, path: Any, train: Any) -> Store:
    """The config's store: an existing one whose train data is ``train`` (else StoreMismatchError), or a new one
    for the unrolled scores."""
    fp = train.fingerprint()
    if Store.exists(path):
        store = Store.open_existing(path)
        if store.identity and store.identity.get("train_data") != fp:
            raise StoreMismatchError(f"the store {path} holds features of other train data than data.train; "
                                     "score.method: unroll writes its scores beside them only for the same data: set "
                                     "another store.path")
        return store
    identity = {"method": "unroll", "model": cfg.model.model_dump(mode="json"), "task": cfg.task, "train_data": fp}
    layout = StoreLayout(n_train=len(train), proj_dim=1, chunk_rows=cfg.store.chunk_rows, dtype="float32",
                         compressor=cfg.store.compressor)
    return Store.create_or_check(path, identity, cfg.resolved(), layout)


def _unroller(cfg: Config, manifest_path: Path, entry: dict[str, Any], checkpoint: Path, train: Any,
              device: torch.device, reporter: Reporter) -> tuple[Unroller, torch.Tensor | None]:
    """One model's :class:`Unroller` and its subset (or None); CheckpointError without a replay record, or with
    one whose replay does not reproduce the checkpoint."""
    i = entry["model_id"]
    what = f"model {i} ({checkpoint})"
    if not entry.get("replay"):
        raise no_record(what, "its manifest entry lists no replay record")
    record = ReplayRecord(manifest_path.parent / entry["replay"], what)
    subset = entry.get("subset_indices")
    subset_t = None if subset is None else torch.tensor(subset, dtype=torch.int64)
    rows = model_rows(train, subset_t, device)  # as `trak optimize` trained it
    torch.manual_seed(entry.get("seed", 0))
    model = build_model(cfg.model.entrypoint, **cfg.model.kwargs).to(device)
    unroller = Unroller(model, rows, record, resolve_task(cfg.task))
    with reporter.phase(f"{what}: checking that its record replays to the checkpoint …"):
        final = unroller.final_params()
        saved = read_state_dict(checkpoint)
        worst = max(float((final[k].cpu() - saved[k].float()).abs().max() / (saved[k].float().abs().max() + 1e-12))
                    for k in final)
    if worst > 1e-3:
        raise no_record(what, f"its replay record does not reproduce the checkpoint (relative difference "
                              f"{worst:.2g}): the record is of another training")
    return unroller, subset_t


def _chunk_scores(unrollers: list[tuple[Unroller, torch.Tensor | None]], target: Any, lo: int, hi: int,
                  n_train: int, device: torch.device, reporter: Reporter) -> np.ndarray:
    """Scores of targets ``[lo, hi)``: ``−(1/M) Σ_m`` metagradients, ``[hi - lo, n_train]`` float32
    (GradientError naming the model and targets when one is not finite)."""
    x = inputs_to(slice_inputs(target.inputs, lo, hi), device)
    y = target.labels[lo:hi].to(device)
    total = torch.zeros(hi - lo, n_train, dtype=torch.float64)
    for m, (unroller, subset) in enumerate(unrollers):
        mg = unroller.metagradients(x, y, reporter, description=f"unroll targets {lo}-{hi} model {m}").cpu()
        if not torch.isfinite(mg).all():
            raise GradientError(f"model {m}: the metagradients of targets {lo}-{hi} are not finite; the recorded "
                                "training is unstable to differentiate through (lower optimize.lr, or use fewer "
                                "epochs)")
        if subset is None:
            total += mg.double()
        else:
            total[:, subset] += mg.double()
    return (-total / len(unrollers)).float().numpy()


def _write_results(store: Store, rows: Any, exp: str, settings: dict[str, Any], n_target: int, chunk: int,
                   full: bool, top_k: int | None, reporter: Reporter) -> int:
    """Write the matrix (``full``) and the top-k from the finished chunks of targets; returns chunks written."""
    n_chunks = -(-n_target // chunk)
    matrix = np.concatenate([rows.read("scores", c, c + 1)[0] for c in range(n_chunks)])[:n_target]
    written = 0
    if full:
        out = store.scores(exp, n_target, settings, repair=True)
        for c in out.pending():
            lo, hi = out.rows(c)
            out.write(c, scores=matrix[:, lo:hi])
            written += 1
    if top_k is not None:
        top = StoredTopK(store, exp, n_target, top_k, create=True)
        if not top.is_complete():
            parts = top.parts(create=True)
            scorer = lambda lo, hi: torch.from_numpy(np.ascontiguousarray(matrix[:, lo:hi]))  # noqa: E731
            written += top.compute(scorer, parts, Dist(), reporter)
            written += top.merge(parts)
            top.drop_parts()
    return written
