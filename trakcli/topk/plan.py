"""The plan of a top-k: its segments, blocks and, over a store with codes, the two-stage settings
(:class:`TwoStage`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from trakcli.errors import StoreError

#: Train rows per segment (the unit of resume and of work between ranks), at least :data:`MIN_SEGMENTS` of them.
SEGMENT_ROWS = 1 << 17
#: Train rows per segment of a two-stage top-k: each segment's candidate pass starts from no threshold, so larger
#: segments pay the costly first blocks less often.
TWO_STAGE_SEGMENT_ROWS = 1 << 20
MIN_SEGMENTS = 8
#: Bytes of one block's float32 scores ``[n_target, block]`` and of its features ``[block, proj_dim]``.
BLOCK_BYTES = 128 << 20
#: Bytes of one block's approximate scores in a two-stage candidate pass: small enough that the filtering of a
#: block stays in the processor's cache.
APPROX_BLOCK_BYTES = 16 << 20

#: Train rows (whole segments, evenly spaced) whose exact scores against the sampled targets measure the recall
#: of a two-stage top-k: all rows when there are fewer, else an estimate (:meth:`StoredTopK.recall`).
RECALL_ROWS = 1_000_000

#: Every how many columns of a first block :func:`merge_top_k_filtered` estimates its threshold from.
SEED_STRIDE = 8

#: ``(lo, hi) -> [n_target, hi - lo]`` float32 scores of train rows ``lo .. hi``.
BlockScores = Callable[[int, int], torch.Tensor]

#: The arrays of a top-k (``scores/<experiment>/top_k``, and per segment its parts) and their dtypes:
#: ``proponents`` / ``opponents`` ``[n_target, k]`` train rows (highest / lowest scores first) and their scores.
TOP_K_ARRAYS = {"proponents": "int64", "proponent_scores": "float32", "opponents": "int64", "opponent_scores": "float32"}

#: Default ``score.rescore_multiplier`` per ``store.dtype`` (measured in docs/guides/store.md with
#: ``benchmarks/bench_topk.py``): int8 2 kept recall@100 at 1.0; binary 16 bounds the re-ranking cost (sign codes
#: do not find the top 100 at any multiplier; the run reports the recall).
DEFAULT_RESCORE_MULTIPLIER = {"int8": 2, "binary": 16}

#: The one-pass top-k samples every this many blocks for its starting floor (:meth:`StoredTopK._seed_floors`).
SEED_STRIDE_BLOCKS = 16
#: The fewest sampled chunks above a starting floor (:meth:`StoredTopK._seed_floors`): below it, no floor.
SEED_MIN = 8
#: :class:`RunningTopK`'s ``batch`` in a one-pass top-k: a fresher threshold, as every passing score is also
#: scored exactly.
SCAN_MERGE_BATCH = 0.25


@dataclass(frozen=True)
class TwoStage:
    """Settings of a two-stage top-k.

    Attributes:
        codes: ``int8`` or ``binary`` (the store's dtype).
        multiplier: ``score.rescore_multiplier``: K' = multiplier · K candidates per target and side.
        sample: ``[n_sample]`` target indices whose exact top-k is computed too (for the recall).
        rerank: ``scan``: one pass reads the codes and the float copy of every row
            (:meth:`~trakcli.topk.stored.StoredTopK.compute_scan`).
    """

    codes: str
    multiplier: int
    sample: tuple[int, ...]
    rerank: str = "scan"

    @classmethod
    def of(cls, codes: str, multiplier: int | None, recall_queries: int, n_target: int, k: int,
           rerank: str = "auto") -> "TwoStage":
        """The settings of a run: ``multiplier`` None takes :data:`DEFAULT_RESCORE_MULTIPLIER`; ``recall_queries``
        evenly spaced targets (all of them when there are fewer); ``rerank`` ``auto`` or ``scan`` (the one-pass
        re-ranking, :meth:`~trakcli.topk.stored.StoredTopK.compute_scan`).

        Raises:
            StoreError: ``multiplier`` or ``recall_queries`` is not a positive integer; another ``rerank``.
        """
        multiplier = DEFAULT_RESCORE_MULTIPLIER[codes] if multiplier is None else multiplier
        for name, value in (("score.rescore_multiplier", multiplier), ("score.recall_queries", recall_queries)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StoreError(f"{name} must be a positive integer, got {value!r}; e.g. {name}=4")
        n = min(recall_queries, n_target)
        sample = tuple(int(i) for i in np.unique(np.linspace(0, n_target - 1, n).round().astype(np.int64)))
        if rerank not in ("auto", "scan"):
            raise StoreError(f"score.rerank must be auto or scan, got {rerank!r}")
        return cls(codes, multiplier, sample)

    def settings(self) -> dict[str, Any]:
        """What the experiment's results depend on (recorded and checked with the score settings; the re-ranking
        too, as the stored parts of an unfinished run are laid out by it: always ``scan``)."""
        return {"codes": self.codes, "rescore_multiplier": self.multiplier, "recall_queries": list(self.sample),
                "rerank": self.rerank}


def seed_sample(n_train: int, chunk_rows: int, block: int, candidates: int) -> tuple[list[int], int] | None:
    """The sample of a one-pass top-k's starting floor (:meth:`StoredTopK._seed_floors`): the first rows of the sampled
    blocks of ``block`` rows (every :data:`SEED_STRIDE_BLOCKS`-th) and m, or None when the sample cannot give a floor (m
    < :data:`SEED_MIN`, or more than the sampled chunks: a store of fewer than about 3 · candidates chunks)."""
    starts = list(range(0, n_train - block + 1, block * SEED_STRIDE_BLOCKS))
    sampled = len(starts) * (block // chunk_rows)
    m = int(np.ceil(3 * candidates * sampled / -(-n_train // chunk_rows)))
    return None if m < SEED_MIN or m > sampled else (starts, m)


def scan_has_floor(multiplier: int | None, codes: str, n_target: int, k: int, n_train: int, chunk_rows: int,
                   proj_dim: int) -> bool:
    """Whether the one-pass scan of a two-stage top-k can start from a sampled floor (:func:`seed_sample`).

    Without one, a scan scores about K' · ln(blocks) pairs per target and side exactly and costs more than the
    plain streamed pass over the float copy, which ``score.rerank: auto`` then takes.
    """
    multiplier = DEFAULT_RESCORE_MULTIPLIER[codes] if multiplier is None else multiplier
    candidates = min(multiplier * min(k, n_train), n_train)
    block = block_rows(n_target, proj_dim, chunk_rows, APPROX_BLOCK_BYTES)
    return seed_sample(n_train, chunk_rows, block, candidates) is not None


def segments(n_train: int, chunk_rows: int, rows: int = SEGMENT_ROWS) -> list[tuple[int, int]]:
    """The segments ``[(lo, hi), ...]`` of ``n_train`` rows: runs of whole chunks, a pure function of the three.

    ``max(MIN_SEGMENTS, n_train / rows)`` segments (fewer when there are fewer chunks), each
    the same number of chunks but the last.
    """
    n_chunks = -(-n_train // chunk_rows)
    want = min(n_chunks, max(MIN_SEGMENTS, -(-n_train // rows)))
    per = -(-n_chunks // want) * chunk_rows
    return [(lo, min(lo + per, n_train)) for lo in range(0, n_train, per)]


def measured_segments(segs: list[tuple[int, int]], rows: int) -> list[int]:
    """The fewest evenly spaced segments of ``segs`` that hold at least ``rows`` rows (all when fewer are there)."""
    sizes = [hi - lo for lo, hi in segs]
    want, n = min(rows, sum(sizes)), len(sizes)
    for m in range(1, n + 1):
        pick = sorted({int(i) for i in np.linspace(0, n - 1, m).round()})
        if sum(sizes[i] for i in pick) >= want:
            return pick
    return list(range(n))


def block_rows(n_target: int, proj_dim: int, chunk_rows: int, budget: int = BLOCK_BYTES) -> int:
    """Train rows scored at once: whole chunks, about ``budget`` bytes of float32 scores and of features."""
    return chunk_rows * max(1, budget // (4 * chunk_rows * max(n_target, proj_dim)))


