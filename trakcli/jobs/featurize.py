"""`trak featurize` as a library function: train features of every checkpoint, chunk by chunk, into the store.

Under ``torchrun`` each process computes the row chunks of its rank (chunk index ≡ rank mod world_size); rank 0
creates the store, holds its lock and writes its attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from time import monotonic

import numpy as np
import torch

from trakcli.config import Config
from trakcli.data.tensors import TensorDataset
from trakcli.gradients.vmap import check_finite
from trakcli.jobs.kernels import finalize_kernels, report_notes
from trakcli.jobs.runtime import ChunkWriter, event, locked_store
from trakcli.jobs.setup import JobSetup, prepare
from trakcli.models.checkpoints import load_checkpoint
from trakcli.progress import NULL_REPORTER, Reporter
from trakcli.store import ChunkedRows, Store, StoreCorruptError
from trakcli.store.append import kept_rows


def featurize_rows(
    s: JobSetup, data: TensorDataset, rows: ChunkedRows, model_id: int, *, with_out_to_loss: bool,
    skip_nonfinite: bool, reporter: Reporter, label: str, computed: FirstBatch | None = None,
    keep: dict[int, np.ndarray] | None = None, writer: ChunkWriter | None = None, kept: dict[int, int] | None = None,
    save_every_s: float = 30.0,
) -> tuple[int, list[int]]:
    """Compute and write this rank's pending chunks of one checkpoint (train rows or targets).

    Each batch goes through ``s.featurizer`` (:meth:`JobSetup.features`); a chunk's ``features`` (and ``out_to_loss``,
    ``nonfinite``) are written as float32 before its done flag. Train rows written in line also save a chunk's rows so
    far (:meth:`ChunkedRows.write_partial`) every ``save_every_s`` seconds of work and on Ctrl-C; a rerun resumes after
    them, at a batch boundary of an uninterrupted run (batches are cut greedily from the chunk's first row), so the
    store is the same bit for bit. A KeyboardInterrupt leaves with a note of the train rows stored.

    Args:
        s, data, rows, model_id: the setup, the rows to featurize, the store's rows of checkpoint ``model_id``.
        with_out_to_loss: also write ``out_to_loss`` and ``nonfinite`` (train rows).
        skip_nonfinite: give non-finite examples zero features and ``Q = 0`` instead of raising.
        reporter, label: progress (``"<label> model <model_id>"``) and test events.
        computed: a batch already featurized (:func:`first_batch`), used where the same batch comes up.
        keep: gets each written chunk's features as the store returns them (:meth:`ChunkedRows.as_stored`).
        writer: writes the chunks in the background (`trak score`'s targets) instead of in line.
        kept: ``{chunk: rows}`` whose first rows are stored already (an append's old partial chunk,
            :func:`trakcli.store.append.kept_rows`; rows an interrupted run saved count the same way); if they do
            not read back intact, the whole chunk is computed.
        save_every_s: seconds of work between two saves of a chunk's rows (``store.save_every_s``; 0: every batch).

    Returns:
        (chunks computed, indices of examples skipped as non-finite).

    Raises:
        GradientError: an example has non-finite features (without ``skip_nonfinite``).
    """
    pending = rows.pending(s.dist.rank, s.dist.world_size, marked=False)
    if not pending:
        return 0, []
    names = dict(zip(sorted(s.sources), s.checkpoints)) if getattr(s, "sources", None) else dict(enumerate(s.checkpoints))
    reporter.phase(f"loading checkpoint {model_id} ({names.get(model_id, model_id)}) …")  # the API's setup: its own
    s.load(model_id)
    skipped: list[int] = []
    partial = with_out_to_loss and writer is None and rows.progress is not None  # train rows, written in line
    saved = rows.partial(pending) if partial else {}  # rows an interrupted run saved, per chunk
    kept = {c: k for c, k in (kept or {}).items() if c in pending and with_out_to_loss}
    kept = {c: max(kept.get(c, 0), saved.get(c, 0)) for c in {*kept, *saved}}
    n_rows = sum(rows.rows(c)[1] - rows.rows(c)[0] for c in pending) - sum(kept.values())
    stored = {c: kept.get(c, 0) for c in pending}  # rows of each pending chunk in the store, for the note
    counted = set(saved)  # chunks whose rows_done count may be set: cleared once they are done
    try:
        with reporter.task(f"{label} model {model_id}", n_rows) as task:
            for chunk in pending:
                event(f"start {label} {model_id} {chunk}")
                lo, hi = rows.rows(chunk)
                feats = np.empty((hi - lo, s.proj_dim), dtype=np.float32)
                q_all = np.empty(hi - lo, dtype=np.float32)
                bad_all = np.zeros(hi - lo, dtype=np.uint8)
                start = lo + _read_kept(rows, lo, kept.get(chunk, 0), feats, q_all, bad_all)
                if start - lo < kept.get(chunk, 0):  # the kept rows did not read back: computed again
                    stored[chunk] = 0
                if start > lo:
                    event(f"resume {label} {model_id} {chunk} {start - lo}")
                arrays = {"features": feats}
                if with_out_to_loss:
                    arrays.update(out_to_loss=q_all, nonfinite=bad_all)
                end, last_save = start, monotonic()

                def save() -> None:  # the rows of the batches finished so far, then their count
                    nonlocal last_save
                    counted.add(chunk)
                    rows.write_partial(chunk, end - lo, **arrays)
                    stored[chunk] = end - lo
                    event(f"partial {label} {model_id} {chunk} {end - lo}")
                    last_save = monotonic()

                try:
                    for off, x, y in s.batches(data, start, hi):
                        if computed is not None and computed.key == (model_id, off, len(y)):
                            phi, q, computed = computed.phi, computed.q, None
                        else:
                            phi, q = s.features(x, y, model_id, off)  # [b, proj_dim], [b] on s.device
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
                        end = off + len(y)
                        event(f"batch {label} {model_id} {chunk} {off} {end}")
                        if partial and end < hi and monotonic() - last_save >= save_every_s:
                            save()
                except KeyboardInterrupt:
                    if partial and end - lo > stored[chunk]:  # Ctrl-C: keep the batches finished
                        save()
                    raise
                if keep is not None:  # as stored (float16 and bfloat16 stores round), so a reader sees the same values
                    keep[chunk] = rows.as_stored("features", feats)
                if writer is None:  # a chunk with saved rows clears their count after its flag (as if never interrupted)
                    write_chunk(rows, chunk, arrays, f"{label} {model_id} {chunk}", chunk in counted)
                    stored[chunk] = hi - lo
                else:
                    writer.submit(write_chunk, rows, chunk, arrays, f"{label} {model_id} {chunk}")
    except KeyboardInterrupt as e:
        if partial:
            total = rows.n_rows
            have = total - sum(rows.rows(c)[1] - rows.rows(c)[0] - stored[c] for c in pending)
            e.add_note(f"{have} of {total} train rows of model {model_id} are stored"
                       + (f" (models 0-{model_id - 1} are complete)" if model_id > 1 else
                          " (model 0 is complete)" if model_id == 1 else ""))
        raise
    return len(pending), skipped


def _read_kept(rows: ChunkedRows, lo: int, n: int, feats: np.ndarray, q: np.ndarray, bad: np.ndarray) -> int:
    """Read the ``n`` kept rows from ``lo`` into the chunk's buffers: ``n``, or 0 when they do not read back intact."""
    if n <= 0:
        return 0
    try:
        old = {name: rows.read(name, lo, lo + n) for name in ("features", "out_to_loss", "nonfinite")}
    except StoreCorruptError:
        return 0
    feats[:n], q[:n], bad[:n] = old["features"], old["out_to_loss"], old["nonfinite"]
    return n


def write_chunk(rows: ChunkedRows, chunk: int, arrays: dict[str, np.ndarray], what: str,
                clear_partial: bool = False) -> None:
    """:meth:`ChunkedRows.write` of a chunk (with ``clear_partial``, its ``rows_done`` reset), then ``done <what>``."""
    rows.write(chunk, clear_partial, **arrays)
    event(f"done {what}")


@dataclass
class FirstBatch:
    """The features ``phi`` ``[n, proj_dim]`` and ``q`` ``[n]`` (float32, on the device) of the row loop's batch
    ``key``: ``(model_id, row_offset, n)``, computed before the loop (:func:`first_batch`) for it to reuse."""

    key: tuple[int, int, int]
    phi: torch.Tensor
    q: torch.Tensor


def first_batch(s: JobSetup, reporter: Reporter, chunk_rows: int) -> FirstBatch | None:
    """Load checkpoint 0 and compute the row loop's first batch (chunk 0 of ``chunk_rows`` rows) before the store
    exists, so that a model, checkpoint or task mistake fails without needing ``--overwrite``; stripped key
    prefixes of wrapped models (``module.``, ``_orig_mod.``) are reported once.

    Returns:
        The batch's features, or None without train rows or with a curvature (tried, not kept).

    Raises:
        CheckpointError, ModelError, GradientError, ...: whatever the first batch raises.
    """
    reporter.phase(f"loading checkpoint 0 ({s.checkpoints[0]}) …")
    stripped = load_checkpoint(s.model, s.checkpoints[0], model_id=0)
    if stripped:
        reporter.info(f"checkpoint {s.checkpoints[0]}: stripped the key prefix {''.join(stripped)!r} "
                      "(a DistributedDataParallel / torch.compile model); other checkpoints are loaded the same way")
    s.model.to(s.device)
    if not len(s.train):
        return None
    if s.curvature is not None:  # tried on the batch here; fit with the store, whose passes keep partial sums
        s.check_curvature(chunk_rows)
        return None
    reporter.phase("the first batch: reading it and its per-example gradients …")
    off, x, y = next(s.batches(s.train, 0, min(len(s.train), chunk_rows)))
    phi, q = s.features(x, y, 0, off)
    return FirstBatch((0, off, len(y)), phi, q)


@dataclass
class FeaturizeResult:
    """What a featurize run did.

    Attributes:
        store: the store path.
        n_models: checkpoints featurized.
        chunks_computed: row chunks computed in this run (by this process).
        chunks_total: row chunks over all checkpoints.
        grad_dim, proj_dim: gradient and feature widths.
        n_train: training examples.
        skipped: per model_id, example indices skipped as non-finite in this run.
        repaired: chunks whose checksum failed and that were recomputed (``verify``).
        kernels_computed: kernels made in this run (by this process).
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
    kernels_computed: int = 0


def featurize(
    cfg: Config, *, overwrite: bool = False, skip_nonfinite: bool = False, verify: bool = False,
    reporter: Reporter = NULL_REPORTER, setup: JobSetup | None = None, kernels: bool = True,
) -> FeaturizeResult:
    """Project the per-example gradients of every training example for every checkpoint, then make the kernels.

    Writes ``train/<model_id>/{features, out_to_loss, nonfinite, done}`` chunk by chunk; a rerun recomputes only
    chunks not done (a finished store is a no-op), whatever the batch size. Within a chunk, the rows computed so
    far are saved every ``store.save_every_s`` seconds of work and on Ctrl-C, and a rerun starts after them
    (:func:`featurize_rows`). Then each checkpoint's missing kernel (the factor of ``Φ_mᵀΦ_m + λ_m I`` or its
    dual, with ``score.lambda_reg`` / ``score.lambda_rel``) is made (:func:`trakcli.jobs.kernels.finalize_kernels`;
    rank ``m mod world_size``), so that `trak score` computes only the target side.

    Train data that extends the store's rows (the same first ``n_old`` rows, new rows after them) grows the
    store instead of being refused (:mod:`trakcli.store.append`): only the new rows are featurized, the kernels
    are made again, and the experiments scored before are marked stale until rescored.

    Args:
        cfg: the validated config.
        overwrite: delete the store and start over.
        skip_nonfinite: record examples whose gradients are not finite in ``nonfinite`` and store zero
            features for them (no influence on the kernel, zero scores) instead of stopping.
        verify: hash every checkpoint again (not trusting the hash cache); read every done chunk and recompute
            those missing or failing their checksum; re-create unreadable array metadata; read and verify the
            stored kernels too (a corrupt one is made again).
        reporter: progress bars and messages.
        setup: the :func:`~trakcli.jobs.setup.prepare` of ``cfg`` (with ``rehash=verify``) when the caller made
            it already (`trak select`): the train set is then neither loaded nor hashed again.
        kernels: make TRAK's kernels after the features (False: `trak select`, which does not use them).

    Raises:
        ConfigError: a file the config names cannot be used.
        DataError: the data cannot be read or does not fit the model.
        ModelError: the model cannot be built or run.
        CheckpointError: a checkpoint cannot be loaded.
        ProjectorError: the projector cannot be made.
        GradientError: non-finite gradients, with the example indices.
        StoreError: unwritable path, store in use, write failure.
        StoreMismatchError: the store was made with other settings, or the train data has more rows
            than the store but its first rows are not the featurized ones.
    """
    s = setup if setup is not None else prepare(cfg, rehash=verify, reporter=reporter)
    path = cfg.store.location
    first = None
    if s.dist.is_main and s.checkpoints and (overwrite or not path.exists()):
        if s.proj_dim > s.grad_dim and cfg.projector.kind != "noop":
            reporter.info(f"projector.proj_dim {s.proj_dim} exceeds grad_dim {s.grad_dim}: the features are a random "
                          f"embedding of the gradients into more dimensions, which adds nothing; set projector.kind: "
                          f"noop (the gradients themselves) or projector.proj_dim <= {s.grad_dim}")
        first = first_batch(s, reporter, s.layout.chunk_rows)  # fails before the store exists
    computed = total = repaired = 0
    skipped: dict[int, list[int]] = {}
    train_rows: list[ChunkedRows] = []
    with locked_store(path, s.dist, reporter):
        if s.dist.is_main:
            store = Store.create_or_check(path, s.identity, cfg.resolved(), layout=s.layout, overwrite=overwrite,
                                          prefix=s.train.fingerprint)  # train rows appended: grown, not refused
            for model_id, ckpt in enumerate(s.checkpoints):
                opened = store.train(model_id, str(ckpt), s.shas[model_id], repair=verify,
                                     optimizer_state=s.state_record(model_id))
                if verify:  # every flag is read and checked, none taken from the mark (one process drops it)
                    opened.unmark()
            report_notes(store, reporter)  # unreadable metadata re-created (--verify)
        s.dist.barrier()
        if not s.dist.is_main:
            store = Store.create_or_check(path, s.identity, cfg.resolved(), layout=s.layout, create=False)
            store.distributed = True  # what it misses, rank 0 was to create
        for model_id, ckpt in enumerate(s.checkpoints):
            rows = store.train(model_id, str(ckpt), s.shas[model_id], create=s.dist.is_main,
                               optimizer_state=s.state_record(model_id))
            if verify:
                bad = [c for c in rows.verify() if c % s.dist.world_size == s.dist.rank]
                repaired += len(bad)
                if bad:
                    reporter.info(f"model {model_id}: chunks {bad} failed their checksum or are missing; recomputed")
            total += rows.n_chunks
            if s.curvature is not None and rows.pending(0, 1, marked=False):  # the features of this checkpoint need its curvature
                s.fit_curvature(model_id, store, reporter)
            n, skip = featurize_rows(s, s.train, rows, model_id, with_out_to_loss=True, skip_nonfinite=skip_nonfinite,
                                     reporter=reporter, label="featurize", computed=first if model_id == 0 else None,
                                     kept=kept_rows(store, model_id), save_every_s=cfg.store.save_every_s)
            computed += n
            if skip:
                skipped[model_id] = skip
            train_rows.append(rows)
        s.dist.barrier()
        made = 0
        if kernels and s.checkpoints and s.curvature is None:  # the train side of `trak score` (TRAK's finalize_features)
            made = finalize_kernels(store, train_rows, lambda_reg=cfg.score.lambda_reg, lambda_rel=cfg.score.lambda_rel,
                                    dist=s.dist, reporter=reporter, verify=verify, linalg_threads=cfg.linalg_threads)
        if s.dist.is_main:  # every rank has passed the barrier above: later passes need not read each flag
            for rows in train_rows:  # one process wrote every chunk it found not done: no second read
                rows.mark_complete(known=s.dist.world_size == 1)
    return FeaturizeResult(path, len(s.checkpoints), computed, total, s.grad_dim, s.proj_dim, len(s.train), skipped,
                           repaired, made)
