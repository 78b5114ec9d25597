"""Exact curvature scores (``curvature.exact``), recomputed while scoring instead of read through the stored
``proj_dim`` features (docs/guides/curvature.md measures what the projection costs):

    τ(t, z) = [(1/M) Σ_m ⟨W_m g_m(t), W_m g_m(z)⟩] · [(1/M) Σ_m Q_m(z)]

the influence g(t)ᵀ (F + δ)⁻¹ g(z) of the fitted curvature with damping ``curvature.damping``, computed as
kronfluence computes its pairwise scores (train gradients recomputed for the queries).

* :class:`ExactInfluence` (projector kind kronecker, the default with a curvature): each target's
  preconditioned per-layer gradient once per checkpoint, then one hooked forward + backward per block of train
  rows scores every target (:mod:`trakcli.curvature.influence`). The blocks stream into the top-k or the
  matrix like TRAK's; within a block the running sums are saved every ``store.save_every_s`` seconds of work
  (:func:`trakcli.store.curvature.write_exact_rows`) and a rerun resumes after them with the same sums.
* :func:`exact_scores` (whole per-example gradients; what ``curvature.refine`` needs): the targets' whitened
  gradients ``[n_target, grad_dim]`` float32 in chunks of at most ``data.grad_memory_mb``, one pass over the
  train rows per chunk, the scores ``[n_target, n_train]`` float64.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from time import monotonic
from typing import Any, Callable

import numpy as np
import torch

from trakcli.curvature.influence import (InfluencePass, QueryGradients, QueryLayerGrads, fitting_rank, hooked_pass,
                                        query_bytes)
from trakcli.data.tensors import inputs_to
from trakcli.jobs.setup import batch_rows_for, rows_of
from trakcli.gradients import KroneckerFeaturizer
from trakcli.gradients.hooks import first_rows
from trakcli.jobs.runtime import event
from trakcli.progress import NULL_REPORTER, Reporter
from trakcli.scoring import merge_top_k, order_top_k
from trakcli.store.curvature import drop_exact_rows, read_exact_rows, write_exact_rows


class ExactInfluence:
    """Exact (E)K-FAC influence of every target on train rows ``[lo, hi)``: ``(lo, hi) -> [n_target, hi - lo]``.

    ``τ(t, z) = [(1/M) Σ_m Σ_layers ⟨H_m(t), G_m(z)⟩] · [(1/M) Σ_m Q_m(z)]`` (``Q = 1`` for the loss
    output; :mod:`trakcli.curvature.influence` for ``H`` and ``G``), float32 out of float64 sums.

    Args:
        s, store, target: the :class:`~trakcli.jobs.setup.JobSetup`, the open store (the fitted curvatures),
            the targets.
        damping: ``curvature.damping``.
        memory_mb: MiB of the targets' preconditioned gradients over all checkpoints (``data.grad_memory_mb``):
            full rank when they fit and ``rank`` is None, else the largest rank that fits.
        rank: ``curvature.query_rank`` (None: as ``memory_mb`` allows).
        reporter: the rank kept, progress over the targets and over each block's rows × checkpoints.
        experiment: the experiment whose blocks' progress is saved in the store (None: nothing saved).

    Attributes:
        rank: the rank kept (None: full).
        whole_segments: a top-k asks for each segment in one call, whose saved progress a rerun resumes.

    Raises:
        StoreError: a checkpoint's curvature is not in the store (run `trak featurize`).
        GradientError, DataError: as featurize.
    """

    whole_segments = True

    def __init__(self, s: Any, store: Any, target: Any, damping: float, memory_mb: int = 1024,
                 rank: int | None = None, reporter: Reporter = NULL_REPORTER, experiment: str | None = None):
        self.s, self.n_target = s, len(target)
        self.store, self.experiment, self.reporter = store, experiment, reporter
        self._last: tuple[int, int] | None = None  # the block of the previous call (its saved progress is dropped)
        curv = s.curvature
        self.layers, self.uses, self.task = curv.layers, curv.uses, curv.task
        n_models = len(s.checkpoints)
        budget = memory_mb * 2**20 // max(1, n_models)
        self.rank = rank if rank is not None else fitting_rank(self.layers, self.n_target, budget)
        held = query_bytes(self.layers, self.n_target, self.rank) * n_models
        form = "full rank" if self.rank is None else f"rank {self.rank}"
        reporter.info(f"exact {curv.kind} influence: {self.n_target} targets' preconditioned layer gradients kept at "
                      f"{form} ({held / 2**20:,.0f} MiB over {n_models} checkpoint(s)); one hooked pass over the "
                      "train rows scores them all")
        self.queries: list[QueryGradients] = []
        for model_id in range(n_models):
            s.load(model_id)
            factors = curv.read(store, model_id)
            factors = type(factors)(factors.layers, factors.factors, float(damping))
            parts = []
            with reporter.task(f"model {model_id}: targets' layer gradients", self.n_target) as task:
                for off, x, y in s.batches(target, 0, self.n_target):
                    x, y = inputs_to(x, s.device), y.to(s.device)
                    n = first_rows(x).shape[0]
                    grads = QueryLayerGrads(self.layers, factors, n, self.rank)
                    hooked_pass(s.model, self.uses, self.task, x, y, grads, off)
                    parts.append(grads.finish())
                    task.advance(len(y))
                    release_freed_memory()
            self.queries.append(_concat(parts).to(s.device))
            curv.forget(model_id)  # the pass over the train rows needs the queries alone, not the factors
            release_freed_memory()
        self._loaded = n_models - 1

    def __call__(self, lo: int, hi: int) -> torch.Tensor:
        """Scores of every target against train rows ``[lo, hi)``: ``[n_target, hi - lo]`` float32 (CPU).

        With an experiment, the block's running sums are saved (and resumed, bit for bit); those of this
        process's previous block are dropped first: its caller has stored what it returned.
        """
        event(f"start exact {lo}")
        if self.experiment is not None and self._last is not None and self._last != (lo, hi):
            drop_exact_rows(self.store, self.experiment, *self._last)
        self._last = (lo, hi)
        n_models = len(self.queries)
        with self.reporter.task(f"exact influence, train rows {lo}-{hi}", (hi - lo) * n_models) as task:
            out = self._score(lambda: ((x, y, off) for off, x, y in self.s.batches(self.s.train, lo, hi)), hi - lo,
                              task, block=(lo, hi) if self.experiment is not None else None)
        event(f"done exact {lo}")
        return out

    def score_rows(self, rows: list[int], reporter: Reporter = NULL_REPORTER) -> torch.Tensor:
        """Scores of every target against the train rows ``rows`` (any order): ``[n_target, len(rows)]`` float32."""
        s = self.s

        def batches():
            at = 0
            for x, y in rows_of(s.train, rows, s.batch_rows, s.batch_tokens):
                yield x, y, rows[at]
                at += len(y)

        with reporter.task("exact influence of the candidates", len(rows) * len(self.queries)) as task:
            return self._score(batches, len(rows), task)

    def _score(self, batches: Callable[[], Any], n: int, task: Any, block: tuple[int, int] | None = None
               ) -> torch.Tensor:
        """``τ`` of the rows the batches of ``batches()`` give (``(inputs, labels, first row)``, in order); with
        ``block`` ``(lo, hi)``, resumed from and saved to the store's progress of those rows (:meth:`__call__`)."""
        s = self.s
        n_models = len(self.queries)
        total = torch.zeros(self.n_target, n, dtype=torch.float64)
        q_sum = torch.zeros(n, dtype=torch.float64)
        start_model, start_row = 0, 0
        saved = self._resume(block, n) if block is not None else None
        if saved is not None:
            start_model, start_row, sums = saved
            total, q_sum = sums[:-1].clone(), sums[-1].clone()
            task.advance(start_model * n + start_row)
        mark, last = start_row, monotonic()

        def save(model_id: int, at: int) -> None:
            nonlocal mark, last
            piece = torch.cat([total[:, mark:at], q_sum[None, mark:at]]).numpy()
            write_exact_rows(self.store, self.experiment, *block, n_models, self.n_target, model_id, mark, at, piece)
            event(f"partial exact {block[0]} {model_id} {at}")
            mark, last = (at, monotonic()) if at < n else (0, monotonic())

        for model_id in range(start_model, n_models):
            queries = self.queries[model_id]
            if self._loaded != model_id:
                s.load(model_id)
                self._loaded = model_id
            at, skip = 0, start_row if model_id == start_model else 0
            for x, y, first in batches():
                rows = first_rows(x).shape[0]
                if at < skip:  # scored before the run that saved these sums was stopped
                    at += rows
                    continue
                x, y = inputs_to(x, s.device), y.to(s.device)
                acc = InfluencePass(self.layers, queries, rows, s.device)
                q = hooked_pass(s.model, self.uses, self.task, x, y, acc, first)
                total[:, at:at + rows] += acc.finish().T.cpu()
                q_sum[at:at + rows] += q.double().cpu()
                at += rows
                event(f"batch exact {model_id} {first} {first + rows}")
                task.advance(rows)
                release_freed_memory()
                if block is not None and (at == n or monotonic() - last >= s.save_every_s):
                    save(model_id, at)
        return (total / n_models * (q_sum / n_models)[None, :]).float()

    def _resume(self, block: tuple[int, int], n: int) -> tuple[int, int, torch.Tensor] | None:
        """``(model_id, rows, sums [n_target + 1, n] float64)`` saved for ``block``, or None (nothing saved, or
        saved at a row that is not the end of a batch of this run: then dropped)."""
        got = read_exact_rows(self.store, self.experiment, *block, len(self.queries), self.n_target)
        if got is None:
            return None
        model_id, rows, sums = got
        ends, at = {0}, 0
        for _, x, y in self.s.batches(self.s.train, *block):
            at += len(y)
            ends.add(at)
        if model_id >= len(self.queries) or rows not in ends or at != n:  # another batching: scored again
            drop_exact_rows(self.store, self.experiment, *block)
            return None
        if rows == n:  # the checkpoint's rows are done: the next one starts
            model_id, rows = model_id + 1, 0
        event(f"resume exact {block[0]} {model_id} {rows}")
        return model_id, rows, torch.from_numpy(sums)


#: The recall of a two-stage exact top-k is estimated on a seeded sample of the train rows that are not
#: candidates: at least this many rows, or :data:`RECALL_FRACTION` of the train rows if more.
RECALL_ROWS = 256
RECALL_FRACTION = 0.02


def two_stage_exact(exact: ExactInfluence, approx: Callable[[int, int], torch.Tensor], n_train: int, k: int,
                    multiplier: int, block: int, seed: int = 0, reporter: Reporter = NULL_REPORTER
                    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The exact top-k of every target from candidates of the stored features (``score.rescore_multiplier``).

    1. One streamed pass over the stored (curvature-folded) features: per target its K' = ``multiplier`` · k
       highest and lowest approximate scores (``approx``, blocks of ``block`` rows).
    2. The union U of every target's candidates, and a seeded sample S of the other rows (:data:`RECALL_ROWS`,
       :data:`RECALL_FRACTION`), scored exactly for every target in one hooked pass over U ∪ S
       (:meth:`ExactInfluence.score_rows`): the cost is that of |U ∪ S| rows, not of the corpus.
    3. Per target, the k best exact scores among U (every target's candidates, not only its own).
    4. Recall of the exact top-k, estimated per target and side: a sampled row outside U that beats the
       target's k-th exact score stands for ``(n_train − |U|) / |S|`` rows the top-k missed;
       ``recall = 1 − min(k, missed) / k``, averaged over the targets (exact when S holds every row outside U).

    Returns:
        ``(arrays, recall)``: the top-k arrays (``proponents``, ``proponent_scores``, ``opponents``,
        ``opponent_scores``, ``[n_target, k]``, best first) and ``{"candidates", "rows_scored", "sample_rows",
        "recall": {"proponents", "opponents"}}``.
    """
    k = min(k, n_train)
    k_c = min(n_train, multiplier * k)
    kept = {True: (None, None), False: (None, None)}
    with reporter.task("candidates from the stored features", -(-n_train // block)) as task:
        for lo in range(0, n_train, block):
            scores = approx(lo, min(n_train, lo + block)).float()
            for largest in (True, False):
                kept[largest] = merge_top_k(*kept[largest], scores, lo, k_c, largest)
            task.advance()
    union = sorted(set(kept[True][1].reshape(-1).tolist()) | set(kept[False][1].reshape(-1).tolist()))
    others = np.setdiff1d(np.arange(n_train), np.asarray(union, dtype=np.int64))
    m = min(len(others), max(RECALL_ROWS, int(RECALL_FRACTION * n_train)))
    sample = np.sort(np.random.default_rng(seed).choice(others, size=m, replace=False)) if m else others[:0]
    rows = union + sample.tolist()
    reporter.info(f"two-stage exact top-{k}: {k_c} candidates per target and side from the stored features, "
                  f"{len(union):,} distinct rows, and {m:,} sampled rows for the recall, scored exactly "
                  f"({len(rows):,} of {n_train:,} train rows)")
    got = exact.score_rows(rows, reporter).numpy().astype(np.float64)  # [n_t, |U| + |S|]
    cand, samp = got[:, :len(union)], got[:, len(union):]
    idx = np.broadcast_to(np.asarray(union, dtype=np.int64), cand.shape)
    arrays, recall = {}, {}
    for side, largest in (("proponent", True), ("opponent", False)):
        vals, top = order_top_k(cand, idx, k, largest)
        arrays[f"{side}s"], arrays[f"{side}_scores"] = top, vals.astype(np.float32)
        if m:
            kth = vals[:, -1:]
            beats = (samp > kth) if largest else (samp < kth)
            missed = beats.sum(1) * (len(others) / m)
            recall[f"{side}s"] = float(np.mean(1.0 - np.minimum(k, missed) / k))
        else:  # every row was a candidate
            recall[f"{side}s"] = 1.0
    info = {"candidates": k_c, "rows_scored": len(union), "sample_rows": int(m), "recall": recall}
    reporter.info(f"two-stage exact top-{k}: estimated recall of the exact top-k, proponents "
                  f"{recall['proponents']:.3f}, opponents {recall['opponents']:.3f} (sample of {m:,} rows)")
    return arrays, info


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to call
        return None


def release_freed_memory() -> None:
    """Return the C heap's free memory to the system (glibc's ``malloc_trim(0)``; elsewhere nothing).

    A batch of the exact scores frees gigabytes of temporaries (every layer's inputs and rotated gradients)
    that glibc keeps in its heap, fragmented; kept, they grow the process's resident memory by about one
    batch's working set every few batches (SmolLM2, 100 queries: 9.0 GiB peak where 2.8 GiB is live).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def exact_scorer(s: Any, store: Any, target: Any, memory_mb: int = 1024,
                 reporter: Reporter = NULL_REPORTER, experiment: str | None = None) -> Callable[[int, int], torch.Tensor]:
    """The exact scores of `trak score`, ``(lo, hi) -> [n_target, hi - lo]`` float32: :class:`ExactInfluence`
    (blocks' progress saved under ``experiment``) with a Kronecker featurizer and no refinement, else
    :func:`exact_scores` (the whole matrix computed once)."""
    refine = s.refine is not None and s.refine.iterations
    if isinstance(s.featurizer, KroneckerFeaturizer) and not refine:
        return ExactInfluence(s, store, target, s.exact_damping, memory_mb, s.query_rank, reporter, experiment)
    matrix = exact_scores(s, store, target, s.exact_damping, memory_mb, reporter)
    return lambda lo, hi: torch.from_numpy(matrix[:, lo:hi])


def _concat(parts: list[QueryGradients]) -> QueryGradients:
    """Queries of consecutive batches as one :class:`QueryGradients`; each part's tensors are released once copied
    (``parts`` is emptied), so the queries are held about once, not twice."""
    if len(parts) == 1:
        return parts.pop()
    first = parts[0]
    out = QueryGradients(sum(p.n_query for p in parts), [], [], [], first.ranks)
    for j in range(len(first.ranks)):
        for side, dim in (("full", 0), ("left", 1), ("right", 1)):
            pieces = [getattr(p, side)[j] for p in parts]
            getattr(out, side).append(None if pieces[0] is None else torch.cat(pieces, dim=dim))
            for p in parts:
                getattr(p, side)[j] = None
    parts.clear()
    return out


def exact_scores(s: Any, store: Any, target: Any, damping: float, memory_mb: int = 1024,
                 reporter: Reporter = NULL_REPORTER) -> np.ndarray:
    """The exact curvature scores ``[n_target, n_train]`` float32 of every target against every train row (module
    docstring), from whole per-example gradients (``s.featurizer`` a ``GradientFeaturizer`` with a curvature);
    ``memory_mb``: most MiB of the targets' whitened gradients held at once.

    Raises:
        StoreError: a checkpoint's curvature is not in the store (run `trak featurize`).
        GradientError, DataError: as featurize.
    """
    feat, n_t, n, n_models = s.featurizer, len(target), len(s.train), len(s.checkpoints)
    chunk = batch_rows_for(n_t, memory_mb, feat.grad_dim)  # targets whose whitened gradients fit memory_mb
    total = np.zeros((n_t, n), dtype=np.float64)
    q_sum = np.zeros(n, dtype=np.float64)
    for model_id in range(n_models):
        s.load(model_id)
        s.curvature.read(store, model_id)
        train_view = s.curvature.with_damping(damping)
        target_view = s.curvature.with_damping(damping)
        s.refine_targets(target_view)  # the targets' solves refined by conjugate gradients, if asked
        for t_lo in range(0, n_t, chunk):
            t_hi = min(n_t, t_lo + chunk)
            event(f"start exact {model_id} {t_lo}")
            parts = []
            for off, x, y in s.batches(target, t_lo, t_hi):
                g, _ = feat.transformed(inputs_to(x, s.device), y.to(s.device), model_id, off, curvature=target_view)
                parts.append(feat.grads.flatten(g).float())
            w_t = torch.cat(parts)  # [chunk, grad_dim]
            with reporter.task(f"exact scores model {model_id}", n) as task:
                for off, x, y in s.batches(s.train, 0, n):
                    g, q = feat.transformed(inputs_to(x, s.device), y.to(s.device), model_id, off, curvature=train_view)
                    total[t_lo:t_hi, off:off + len(y)] += (w_t @ feat.grads.flatten(g).float().T).double().cpu().numpy()
                    if t_lo == 0:
                        q_sum[off:off + len(y)] += q.double().cpu().numpy()
                    task.advance(len(y))
            event(f"done exact {model_id} {t_lo}")
    return (total / n_models * (q_sum / n_models)[None, :]).astype(np.float32)
