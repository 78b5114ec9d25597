"""The streamed top-k of `trak score` (``score.top_k``): per target, the K highest and K lowest scores.

The train rows are cut into *segments* (runs of whole ``chunk_rows`` chunks,
:func:`segments`). One pass per segment reads its train features a block at a
time, scores every target against the block (the same ensembled score as the
full matrix: :mod:`trakcli.scoring`) and keeps a running top-k
(:func:`trakcli.scoring.merge_top_k`); the segment's K proponents and opponents
are then written to ``scores/<experiment>/top_k_parts`` with its done flag. When
every segment is done, the candidates of all segments are merged per chunk of
targets into ``scores/<experiment>/top_k`` (best first, equal scores by train
index: :func:`trakcli.scoring.order_top_k`) and the parts are dropped.

**Two-stage top-k** (``store.dtype`` int8 or binary, :mod:`trakcli.store.quantize`): per
segment, a first pass over the compressed codes scores every target against every row
approximately (:meth:`TwoStageScores.approx`) and keeps the K' = ``rescore_multiplier · K``
highest and lowest per target (the candidates); a second pass over the segment's float
copy (bfloat16) re-scores exactly the candidates of each block (:meth:`TwoStageScores.pairs`)
and keeps the K best of them per side, as the one-stage pass would if the true top-K of
the segment is among the candidates. When K' covers the segment every row is a candidate
and the result is the exact top-k. The second pass also computes the exact scores of a few
evenly spaced targets (``score.recall_queries``) against every row, so the recall of the
two-stage top-k against the exact top-k is measured on every run, recorded in the
attributes of ``top_k/proponents`` (``two_stage``) and reported.

Memory is O(n_target · (K + block)) + O(block · proj_dim), whatever n_train;
the store grows by O(n_segments · n_target · K) while the pass runs and keeps
O(n_target · K). A killed run resumes at its first segment not done. Under
``torchrun`` rank r computes the segments ≡ r (mod world_size) and rank 0
merges, so the arrays are the same as a single process writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import torch

from trakcli.distributed import Dist
from trakcli.errors import StoreError
from trakcli.jobs.runtime import event
from trakcli.progress import Reporter
from trakcli.scoring import merge_top_k, order_top_k
from trakcli.store import ChunkedRows, Store
from trakcli.store.rows import read_checked
from trakcli.store.store import TOP_K_ARRAYS

#: Train rows per segment (the unit of resume and of work between ranks), at least :data:`MIN_SEGMENTS` of them.
SEGMENT_ROWS = 1 << 17
MIN_SEGMENTS = 8
#: Bytes of one block's float32 scores ``[n_target, block]`` and of its features ``[block, proj_dim]``.
BLOCK_BYTES = 128 << 20

#: ``(lo, hi) -> [n_target, hi - lo]`` float32 scores of train rows ``lo .. hi``.
BlockScores = Callable[[int, int], torch.Tensor]

#: Default ``score.rescore_multiplier`` per ``store.dtype``: the smallest power of two that kept
#: recall@100 >= 0.99 in ``scripts/bench_topk.py`` (docs/guides/store.md gives the measurements).
DEFAULT_RESCORE_MULTIPLIER = {"int8": 2, "binary": 8}


class TwoStageScores(Protocol):
    """What the two-stage top-k needs of the scores (``trakcli.jobs.score`` implements it)."""

    def approx(self, lo: int, hi: int) -> torch.Tensor:
        """``[n_target, hi - lo]`` float32 approximate scores of train rows ``lo .. hi`` from the codes."""

    def load(self, lo: int, hi: int) -> Any:
        """The float copy of train rows ``lo .. hi`` (whatever :meth:`pairs` and :meth:`rows` take)."""

    def pairs(self, block: Any, targets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``[P]`` float32 exact scores of target ``targets[p]`` against row ``rows[p]`` of ``block`` (int64 ``[P]``)."""

    def rows(self, block: Any, targets: torch.Tensor) -> torch.Tensor:
        """``[len(targets), rows]`` float32 exact scores of the targets ``targets`` against the whole block."""


@dataclass(frozen=True)
class TwoStage:
    """Settings of a two-stage top-k.

    Attributes:
        codes: ``int8`` or ``binary`` (the store's dtype).
        multiplier: ``score.rescore_multiplier``: K' = multiplier · K candidates per segment and side.
        sample: ``[n_sample]`` target indices whose exact top-k is computed too (for the recall).
    """

    codes: str
    multiplier: int
    sample: tuple[int, ...]

    @classmethod
    def of(cls, codes: str, multiplier: int | None, recall_queries: int, n_target: int) -> "TwoStage":
        """The settings of a run: ``multiplier`` None takes :data:`DEFAULT_RESCORE_MULTIPLIER`; ``recall_queries``
        evenly spaced targets (all of them when there are fewer).

        Raises:
            StoreError: ``multiplier`` or ``recall_queries`` is not a positive integer.
        """
        multiplier = DEFAULT_RESCORE_MULTIPLIER[codes] if multiplier is None else multiplier
        for name, value in (("score.rescore_multiplier", multiplier), ("score.recall_queries", recall_queries)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StoreError(f"{name} must be a positive integer, got {value!r}; e.g. {name}=4")
        n = min(recall_queries, n_target)
        sample = tuple(int(i) for i in np.unique(np.linspace(0, n_target - 1, n).round().astype(np.int64)))
        return cls(codes, multiplier, sample)

    def settings(self) -> dict[str, Any]:
        """What the experiment's results depend on (recorded and checked with the score settings)."""
        return {"codes": self.codes, "rescore_multiplier": self.multiplier, "recall_queries": list(self.sample)}


def segments(n_train: int, chunk_rows: int) -> list[tuple[int, int]]:
    """The segments ``[(lo, hi), ...]`` of ``n_train`` rows: runs of whole chunks, a pure function of both.

    ``max(MIN_SEGMENTS, n_train / SEGMENT_ROWS)`` segments (fewer when there are fewer chunks), each
    the same number of chunks but the last.
    """
    n_chunks = -(-n_train // chunk_rows)
    want = min(n_chunks, max(MIN_SEGMENTS, -(-n_train // SEGMENT_ROWS)))
    per = -(-n_chunks // want) * chunk_rows
    return [(lo, min(lo + per, n_train)) for lo in range(0, n_train, per)]


def block_rows(n_target: int, proj_dim: int, chunk_rows: int) -> int:
    """Train rows scored at once: whole chunks, about :data:`BLOCK_BYTES` of scores and of features."""
    return chunk_rows * max(1, BLOCK_BYTES // (4 * chunk_rows * max(n_target, proj_dim)))


class TopK:
    """The top-k of one experiment: its segments, their parts and the merged arrays in the store.

    Args:
        store: the open store (score settings of the experiment already recorded or checked).
        experiment: the experiment.
        n_target: targets.
        k: ``score.top_k`` (at most n_train are kept).
        create: this process may create arrays (rank 0).
    """

    def __init__(self, store: Store, experiment: str, n_target: int, k: int, create: bool,
                 two_stage: TwoStage | None = None):
        layout = store.layout
        self.store, self.experiment = store, experiment
        self.n_target, self.k = n_target, min(k, layout.n_train)
        self.two_stage = two_stage
        self.segments = segments(layout.n_train, layout.chunk_rows)
        self.block = block_rows(n_target, layout.proj_dim, layout.chunk_rows)
        self.final = store.top_k(experiment, n_target, self.k, create=create, repair=create)
        self._create = create

    def verify(self) -> list[int]:
        """Reset the done flags of merged chunks that are missing or corrupt; returns them (recomputed)."""
        return self.final.verify()

    def is_complete(self) -> bool:
        return self.final.is_complete()

    def parts(self, create: bool) -> ChunkedRows:
        """The per-segment arrays (created if absent and ``create``).

        Two-stage: ``n_target + n_sample`` rows, the last ones the exact top-k of the sampled targets.
        """
        rows = self.n_target + (len(self.two_stage.sample) if self.two_stage else 0)
        return self.store.top_k_parts(self.experiment, rows, self.k, len(self.segments), create=create, repair=create)

    def compute_two_stage(self, scores: TwoStageScores, parts: ChunkedRows, dist: Dist, reporter: Reporter) -> int:
        """Compute this rank's pending segments two-stage (module docstring) into ``parts``; returns how many."""
        pending = parts.pending(dist.rank, dist.world_size)
        sample = torch.tensor(self.two_stage.sample, dtype=torch.int64)
        with reporter.task("top-k (two-stage)", len(pending)) as task:
            for seg in pending:
                event(f"start top-k segment {seg}")
                lo, hi = self.segments[seg]
                kc = min(self.two_stage.multiplier * self.k, hi - lo)  # K' candidates per side
                cand: list[Any] = [None, None, None, None]  # top values, top rows, low values, low rows
                for b in range(lo, hi, self.block):
                    block = scores.approx(b, min(b + self.block, hi))
                    cand[0], cand[1] = merge_top_k(cand[0], cand[1], block, b, kc, largest=True)
                    cand[2], cand[3] = merge_top_k(cand[2], cand[3], block, b, kc, largest=False)
                del block
                exact = [torch.empty(cand[1].shape), torch.empty(cand[3].shape)]  # exact scores of the candidates
                ref: list[Any] = [None, None, None, None]  # the sampled targets' exact top-k
                for b in range(lo, hi, self.block):
                    e = min(b + self.block, hi)
                    floats = scores.load(b, e)
                    for side, rows in ((0, cand[1]), (1, cand[3])):
                        t, j = ((rows >= b) & (rows < e)).nonzero(as_tuple=True)
                        exact[side][t, j] = scores.pairs(floats, t, rows[t, j] - b)
                    block = scores.rows(floats, sample)
                    ref[0], ref[1] = merge_top_k(ref[0], ref[1], block, b, self.k, largest=True)
                    ref[2], ref[3] = merge_top_k(ref[2], ref[3], block, b, self.k, largest=False)
                top_v, sel = torch.topk(exact[0], min(self.k, kc), dim=1)
                low_v, sel_low = torch.topk(exact[1], min(self.k, kc), dim=1, largest=False)
                got = _padded(top_v, torch.gather(cand[1], 1, sel), low_v, torch.gather(cand[3], 1, sel_low), self.k)
                want = _padded(*ref, self.k)
                parts.write(seg, **{name: np.concatenate([got[name], want[name]], axis=1) for name in got})
                event(f"done top-k segment {seg}")
                task.advance()
        return len(pending)

    def recall(self, parts: ChunkedRows) -> dict[str, Any]:
        """The recall@K of the two-stage top-k of the sampled targets against their exact top-k (from ``parts``).

        Returns:
            :meth:`TwoStage.settings` plus ``k``, ``recall`` ``{"proponents": r, "opponents": r}`` (mean over the
            sampled targets of |two-stage ∩ exact| / K, Python floats) and ``n_queries``.
        """
        n = len(self.two_stage.sample)
        rows = np.asarray(self.two_stage.sample)
        got = {name: read_checked(arr, (slice(None),), 0) for name, arr in parts.data.items()}
        recall = {}
        for side, largest in (("proponent", True), ("opponent", False)):
            sets = []
            for lo, hi in ((rows, None), (self.n_target, self.n_target + n)):
                sel = rows if hi is None else slice(lo, hi)
                vals = np.concatenate(list(got[f"{side}_scores"][:, sel]), axis=1)  # [n, n_segments * k]
                idx = np.concatenate(list(got[f"{side}s"][:, sel]), axis=1)
                vals = np.where(idx >= 0, vals, -np.inf if largest else np.inf).astype(np.float32)
                sets.append(order_top_k(vals, idx, self.k, largest)[1])
            hits = [len(set(a.tolist()) & set(b.tolist())) / self.k for a, b in zip(*sets)]
            recall[f"{side}s"] = float(np.mean(hits))
        return {**self.two_stage.settings(), "k": self.k, "n_queries": n, "recall": recall}

    def recorded_recall(self) -> dict[str, Any] | None:
        """The recall recorded by a two-stage run (:meth:`recall`), or None."""
        return self.final.attrs("proponents").get("two_stage")

    def compute(self, scores: BlockScores, parts: ChunkedRows, dist: Dist, reporter: Reporter) -> int:
        """Compute this rank's pending segments into ``parts``; returns how many."""
        pending = parts.pending(dist.rank, dist.world_size)
        with reporter.task("top-k", len(pending)) as task:
            for seg in pending:
                event(f"start top-k segment {seg}")
                lo, hi = self.segments[seg]
                top_v = top_i = low_v = low_i = None
                for b in range(lo, hi, self.block):
                    block = scores(b, min(b + self.block, hi))
                    top_v, top_i = merge_top_k(top_v, top_i, block, b, self.k, largest=True)
                    low_v, low_i = merge_top_k(low_v, low_i, block, b, self.k, largest=False)
                parts.write(seg, **_padded(top_v, top_i, low_v, low_i, self.k))
                event(f"done top-k segment {seg}")
                task.advance()
        return len(pending)

    def merge(self, parts: ChunkedRows) -> int:
        """Merge every segment's candidates into the final arrays, chunk of targets by chunk; returns chunks.

        Two-stage: the recall (:meth:`recall`) is recorded first, so a merged top-k always has it.
        """
        pending = self.final.pending()
        if self.two_stage is not None and pending:
            self.final.set_attrs("proponents", two_stage=self.recall(parts))
        for c in pending:
            lo, hi = self.final.rows(c)
            got = {name: read_checked(arr, (slice(None), slice(lo, hi)), 0) for name, arr in parts.data.items()}
            out = {}
            for side, largest in (("proponent", True), ("opponent", False)):
                vals = np.concatenate(list(got[f"{side}_scores"]), axis=1)  # [rows, n_segments * k]
                idx = np.concatenate(list(got[f"{side}s"]), axis=1)
                keep = idx >= 0  # segments shorter than k pad with -1
                vals = np.where(keep, vals, -np.inf if largest else np.inf).astype(np.float32)
                out[f"{side}_scores"], out[f"{side}s"] = order_top_k(vals, idx, self.k, largest)
            self.final.write(c, **out)
        return len(pending)

    def drop_parts(self) -> None:
        self.store.drop(f"scores/{self.experiment}/top_k_parts")

    def read(self, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
        """Targets ``[lo, hi)`` of the merged arrays (:data:`~trakcli.store.store.TOP_K_ARRAYS`), checked."""
        hi = self.n_target if hi is None else hi
        return {name: self.final.read(name, lo, hi) for name in TOP_K_ARRAYS}


def _padded(top_v, top_i, low_v, low_i, k: int) -> dict[str, np.ndarray]:
    """A segment's candidates as ``[1, n_target, k]`` arrays; a segment of fewer than k rows pads with index -1."""
    def pad(v: torch.Tensor, i: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        v, i = v.numpy().astype(np.float32), i.numpy().astype(np.int64)
        if v.shape[1] < k:
            fill = ((0, 0), (0, k - v.shape[1]))
            v, i = np.pad(v, fill), np.pad(i, fill, constant_values=-1)
        return v[None], i[None]

    pv, pi = pad(top_v, top_i)
    ov, oi = pad(low_v, low_i)
    return {"proponents": pi, "proponent_scores": pv, "opponents": oi, "opponent_scores": ov}
