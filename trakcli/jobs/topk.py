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

Memory is O(n_target · (K + block)) + O(block · proj_dim), whatever n_train;
the store grows by O(n_segments · n_target · K) while the pass runs and keeps
O(n_target · K). A killed run resumes at its first segment not done. Under
``torchrun`` rank r computes the segments ≡ r (mod world_size) and rank 0
merges, so the arrays are the same as a single process writes.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from trakcli.distributed import Dist
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

    def __init__(self, store: Store, experiment: str, n_target: int, k: int, create: bool):
        layout = store.layout
        self.store, self.experiment = store, experiment
        self.n_target, self.k = n_target, min(k, layout.n_train)
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
        """The per-segment arrays (created if absent and ``create``)."""
        return self.store.top_k_parts(self.experiment, self.n_target, self.k, len(self.segments),
                                      create=create, repair=create)

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
        """Merge every segment's candidates into the final arrays, chunk of targets by chunk; returns chunks."""
        pending = self.final.pending()
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
