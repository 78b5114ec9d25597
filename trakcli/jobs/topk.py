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

**Two-stage top-k** (``store.dtype`` int8 or binary, :mod:`trakcli.store.quantize`). With
``score.rerank`` ``scan`` (:meth:`StoredTopK.compute_scan`), one pass reads each block's codes and float
copy together and scores every candidate exactly as its block passes; the merge then keeps, per target
and side, the K' best approximate scores and among them the K best exact ones. With ``rows``, three steps:

1. per segment, a pass over the compressed codes scores every target against every row
   approximately (:meth:`TwoStageScores.approx`) and keeps the K' = ``rescore_multiplier · K``
   highest and lowest per target (``scores/<experiment>/top_k_candidates``, done per segment;
   :class:`RunningTopK`: only the scores that beat the current K'-th best are merged);
2. the segments' candidates are merged into K' candidates per target and side (every rank
   computes the same merge from the stored parts), their (target, row) pairs sorted by row;
3. per segment, the float copy (bfloat16) of the segment's candidate rows is read, row by row
   (:meth:`TwoStageScores.gather`; :mod:`trakcli.store.rowread`: ``proj_dim · 2`` bytes a row, not
   the segment's chunks), and the candidate pairs are re-scored exactly
   (:meth:`TwoStageScores.pairs`: gathered dot products, not a product over the rows;
   ``top_k_parts``, done per segment). In the segments of :meth:`StoredTopK.recall_segments`
   (at least :data:`RECALL_ROWS` rows, evenly spaced; all of them for a smaller store) a few
   evenly spaced targets (``score.recall_queries``) are also scored exactly against every row.

Two-stage segments hold :data:`TWO_STAGE_SEGMENT_ROWS` rows. The candidate pass computes the
next block's product, and the re-ranking reads the next segment's rows, in a background thread
while the current one is merged (:func:`_ahead`).

The merge keeps the K best exact scores among each target's candidates: the exact top-k
whenever the true top-K rows are among the candidates (always when K' >= n_train). The
sampled targets' exact scores measure the recall of the result on every run (exactly when
every row was measured, else an estimate: :meth:`StoredTopK.recall`); it is recorded
in the attributes of ``top_k/proponents`` (``two_stage``) and reported. Exact re-ranking costs
O(n_target · K' · proj_dim) in reads and products, whatever n_train.

Memory is O(n_target · (K + block)) + O(block · proj_dim), whatever n_train
(two-stage: K' for K, two blocks at once, plus the merge of step 2,
O(n_segments · n_target · K'), and the mean Q of every row, 4 bytes a row);
the store grows by O(n_segments · n_target · K) (two-stage: K') while the pass runs
and keeps O(n_target · K). A killed run resumes at its first segment not done. Under
``torchrun`` rank r computes the segments ≡ r (mod world_size) and rank 0
merges, so the arrays are the same as a single process writes.
"""

from __future__ import annotations

import contextlib
import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

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
#: Train rows per segment of a two-stage top-k. Each segment's candidate pass starts from no threshold, and
#: its first blocks cost the most to filter (most of their scores pass); larger segments pay that less often
#: (measured: 0.6 s of filtering per 131,072-row segment, 1,000 targets, K' = 200).
TWO_STAGE_SEGMENT_ROWS = 1 << 20
MIN_SEGMENTS = 8
#: Bytes of one block's float32 scores ``[n_target, block]`` and of its features ``[block, proj_dim]``.
BLOCK_BYTES = 128 << 20
#: Bytes of one block's approximate scores in the candidate pass of a two-stage top-k: small enough that the
#: scaling and filtering of a block's int8 product stay in the processor's cache (measured on the candidate
#: pass, 10^6 rows, 1,000 targets: 4,096-row blocks took a third of the time of 32,768-row ones outside the
#: product itself).
APPROX_BLOCK_BYTES = 16 << 20

#: Train rows (whole segments, evenly spaced) whose exact scores against the sampled targets measure the recall
#: of a two-stage top-k: all rows when there are fewer, else an estimate (:meth:`StoredTopK.recall`).
RECALL_ROWS = 1_000_000

#: Every how many columns of a first block :func:`merge_top_k_filtered` estimates its threshold from.
SEED_STRIDE = 8

#: ``(lo, hi) -> [n_target, hi - lo]`` float32 scores of train rows ``lo .. hi``.
BlockScores = Callable[[int, int], torch.Tensor]

#: Default ``score.rescore_multiplier`` per ``store.dtype`` (docs/guides/store.md gives the measurements of
#: ``benchmarks/bench_topk.py``, 10^6 rows, proj_dim 1024, top 100). int8: 2, the smallest that kept recall@100 at
#: 1.0 (1 gave 0.97 / 0.93). binary: no multiplier up to 16 came near 0.99 (16 gave 0.35 / 0.10): sign codes of
#: these features do not find the top 100; 16 bounds the re-ranking cost, and the run reports the recall.
DEFAULT_RESCORE_MULTIPLIER = {"int8": 2, "binary": 16}


class TwoStageScores(Protocol):
    """What the two-stage top-k needs of the scores (``trakcli.jobs.score`` implements it)."""

    def approx(self, lo: int, hi: int) -> torch.Tensor:
        """``[n_target, hi - lo]`` float32 approximate scores of train rows ``lo .. hi`` from the codes."""

    def load(self, lo: int, hi: int) -> Any:
        """The float copy of train rows ``lo .. hi`` (whatever :meth:`pairs` and :meth:`rows` take)."""

    def gather(self, rows: np.ndarray) -> Any:
        """The float copy of train rows ``rows`` (int64, sorted, unique), as :meth:`load` gives a block."""

    def pairs(self, block: Any, targets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``[p]`` float32 exact scores of target ``targets[p]`` against row ``rows[p]`` of ``block`` (int64)."""

    def rows(self, block: Any, targets: torch.Tensor) -> torch.Tensor:
        """``[len(targets), rows]`` float32 exact scores of the targets ``targets`` against the whole block."""

    def scan_read(self, lo: int, hi: int, slot: int) -> Any:
        """Everything :meth:`scan_product` needs of train rows ``lo .. hi``, read only (the codes, the float copy),
        for the ``slot``-th read of the pass (buffers may be reused by a read many slots later)."""

    def scan_product(self, read: Any) -> tuple[torch.Tensor, Any]:
        """``(approximate scores [rows, n_target] as :meth:`approx`, float copy as :meth:`load`)`` of a
        :meth:`scan_read`."""


@dataclass(frozen=True)
class TwoStage:
    """Settings of a two-stage top-k.

    Attributes:
        codes: ``int8`` or ``binary`` (the store's dtype).
        multiplier: ``score.rescore_multiplier``: K' = multiplier · K candidates per target and side.
        sample: ``[n_sample]`` target indices whose exact top-k is computed too (for the recall).
        rerank: ``scan`` (one pass reads the codes and the float copy of every row: :meth:`StoredTopK.compute_scan`)
            or ``rows`` (a pass over the codes, then the float copy of the candidate rows alone), by
            :func:`rerank_mode`.
    """

    codes: str
    multiplier: int
    sample: tuple[int, ...]
    rerank: str = "rows"

    @classmethod
    def of(cls, codes: str, multiplier: int | None, recall_queries: int, n_target: int, k: int, n_train: int,
           chunk_rows: int, rerank: str = "auto", local: bool = True, proj_dim: int | None = None) -> "TwoStage":
        """The settings of a run: ``multiplier`` None takes :data:`DEFAULT_RESCORE_MULTIPLIER`; ``recall_queries``
        evenly spaced targets (all of them when there are fewer); ``rerank`` ``scan`` or ``rows``, or ``auto``:
        :func:`rerank_mode` of K' = min(multiplier · k, n_train) candidates (``local``: the store's float copy is
        read from its chunk files directly; ``proj_dim``: the one-pass blocks' width, for its sampled floor).

        Raises:
            StoreError: ``multiplier`` or ``recall_queries`` is not a positive integer.
        """
        multiplier = DEFAULT_RESCORE_MULTIPLIER[codes] if multiplier is None else multiplier
        for name, value in (("score.rescore_multiplier", multiplier), ("score.recall_queries", recall_queries)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StoreError(f"{name} must be a positive integer, got {value!r}; e.g. {name}=4")
        n = min(recall_queries, n_target)
        sample = tuple(int(i) for i in np.unique(np.linspace(0, n_target - 1, n).round().astype(np.int64)))
        if rerank == "auto":
            block = None if proj_dim is None else block_rows(n_target, proj_dim, chunk_rows, APPROX_BLOCK_BYTES)
            rerank = rerank_mode(n_target, min(multiplier * min(k, n_train), n_train), n_train, chunk_rows, local,
                                 block)
        elif rerank not in ("scan", "rows"):
            raise StoreError(f"score.rerank must be auto, scan or rows, got {rerank!r}")
        return cls(codes, multiplier, sample, rerank)

    def settings(self) -> dict[str, Any]:
        """What the experiment's results depend on (recorded and checked with the score settings; the re-ranking
        too, as the stored parts of an unfinished run are laid out by it)."""
        return {"codes": self.codes, "rescore_multiplier": self.multiplier, "recall_queries": list(self.sample),
                "rerank": self.rerank}


#: On an object store, a two-stage top-k re-ranks in one pass over every row (``scan``) when its candidate pairs
#: number at least this many per chunk of train rows: reading the candidates' chunks would then fetch nearly every
#: chunk of the float copy anyway, after a pass over the codes.
SCAN_PAIRS_PER_CHUNK = 8


def seed_sample(n_train: int, chunk_rows: int, block: int, candidates: int) -> tuple[list[int], int] | None:
    """The sample of a one-pass top-k's starting floor (:meth:`StoredTopK._seed_floors`): the first rows of the
    sampled blocks of ``block`` rows (every :data:`SEED_STRIDE_BLOCKS`-th) and m, or None when the sample cannot
    give a floor (m < :data:`SEED_MIN`, or more than the sampled chunks: a store of fewer than about
    3 · candidates chunks)."""
    starts = list(range(0, n_train - block + 1, block * SEED_STRIDE_BLOCKS))
    sampled = len(starts) * (block // chunk_rows)
    m = int(np.ceil(3 * candidates * sampled / -(-n_train // chunk_rows)))
    return None if m < SEED_MIN or m > sampled else (starts, m)


def rerank_mode(n_target: int, candidates: int, n_train: int, chunk_rows: int, local: bool = True,
                block: int | None = None) -> str:
    """``scan`` or ``rows`` (:class:`TwoStage`) for ``2 · n_target · candidates`` pairs over ``n_train`` rows.

    ``scan`` where its starting floor can be sampled (:func:`seed_sample` of blocks of ``block`` rows, when
    given): without it a scan scores about K' · ln(blocks) pairs per target exactly, and ``rows`` was faster
    (200,000 rows, 1,000 targets: 7.2 against 13.7 s, measured). Then on a store whose chunk files are read
    directly (``local``: :mod:`trakcli.store.chunkread`); there it was faster than ``rows`` at every size
    measured from 10^6 rows (1,000 targets: 10.0 against 14.8 s) to 10^7 rows, down to 5 targets (33.7 against
    40.5 s: its parallel, ``O_DIRECT`` reads of 30 GB against a pass over the 10 GB of codes and 2,000 row
    reads). On an object store, ``scan`` from :data:`SCAN_PAIRS_PER_CHUNK` pairs a chunk.
    """
    if block is not None and seed_sample(n_train, chunk_rows, block, candidates) is None:
        return "rows"
    if local:
        return "scan"
    n_chunks = -(-n_train // chunk_rows)
    return "scan" if 2 * n_target * candidates >= SCAN_PAIRS_PER_CHUNK * n_chunks else "rows"


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


class StoredTopK:
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
        self.segments = segments(layout.n_train, layout.chunk_rows,
                                 SEGMENT_ROWS if two_stage is None else TWO_STAGE_SEGMENT_ROWS)
        self.block = block_rows(n_target, layout.proj_dim, layout.chunk_rows)
        self.approx_block = block_rows(n_target, layout.proj_dim, layout.chunk_rows, APPROX_BLOCK_BYTES)
        self.final = store.top_k(experiment, n_target, self.k, create=create, repair=create)
        self._create = create

    def verify(self) -> list[int]:
        """Reset the done flags of merged chunks that are missing or corrupt; returns them (recomputed)."""
        return self.final.verify()

    def is_complete(self) -> bool:
        return self.final.is_complete()

    def parts(self, create: bool) -> ChunkedRows:
        """The per-segment arrays (created if absent and ``create``).

        Two-stage (step 3): ``[n_segments, n_target + n_sample, K']``: per segment the exact scores of the
        candidates in it (NaN elsewhere), then the exact top-k of the sampled targets (padded with index -1).
        """
        if self.two_stage is None:
            return self.store.top_k_parts(self.experiment, self.n_target, self.k, len(self.segments), create=create,
                                          repair=create)
        return self.store.top_k_parts(self.experiment, self.n_target + len(self.two_stage.sample), self.candidates,
                                      len(self.segments), create=create, repair=create)

    @property
    def candidates(self) -> int:
        """K': candidates per target and side of a two-stage top-k (at most n_train)."""
        return min(self.two_stage.multiplier * self.k, self.store.layout.n_train)

    def candidate_parts(self, create: bool) -> ChunkedRows:
        """Step 1 of a two-stage top-k: per segment, its K' candidates by approximate score (created if ``create``)."""
        return self.store.top_k_parts(self.experiment, self.n_target, self.candidates, len(self.segments),
                                      create=create, repair=create, name="top_k_candidates")

    def compute_two_stage(self, scores: TwoStageScores, parts: ChunkedRows, cands: ChunkedRows, dist: Dist,
                          reporter: Reporter) -> int:
        """Steps 1 to 3 (module docstring) for this rank's pending segments; returns the segments computed.

        Every rank calls it (it holds a barrier between steps 1 and 2). With ``rerank`` ``scan``,
        :meth:`compute_scan` instead.
        """
        if self.two_stage.rerank == "scan":
            return self.compute_scan(scores, parts, cands, dist, reporter)
        kc, n = self.candidates, len(self.segments)
        pending = cands.pending(dist.rank, dist.world_size)
        spans = self._spans(pending, self.approx_block)
        blocks = _ahead(scores.approx, [span[1:] for span in spans])  # the next block's product while this one merges
        seen = [_KthBest(kc, largest=True), _KthBest(kc, largest=False)]  # over the segments computed here
        with reporter.task("top-k candidates", len(pending)) as task:
            for seg, group in itertools.groupby(zip(spans, blocks), key=lambda x: x[0][0]):
                event(f"start top-k candidates {seg}")
                top, low = (RunningTopK(kc, side.largest, floor=side.kth) for side in seen)
                for (_, b, _), block in group:
                    top.add(block, b)
                    low.add(block, b)
                found = (top.result(), low.result())
                for side, (values, _) in zip(seen, found):
                    side.add(values)
                cands.write(seg, **_padded(*found[0], *found[1], kc))
                event(f"done top-k candidates {seg}")
                task.advance()
        dist.barrier()
        pending_exact = parts.pending(dist.rank, dist.world_size)
        if not pending_exact:
            return len(pending)
        cand = self._merged_candidates(cands)  # [n_target, K'] rows per side
        pairs = _CandidatePairs(cand)
        sample = torch.tensor(self.two_stage.sample, dtype=torch.int64)
        measured = set(self.recall_segments())

        def candidates_of(seg: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
            """The candidate pairs of a segment and the float copy of their rows (read row by row)."""
            t, r, slot = pairs.within(*self.segments[seg])
            rows, at = torch.unique(r, return_inverse=True)  # sorted: each row read once
            return t, at, slot, scores.gather(rows.numpy())

        with reporter.task("top-k exact re-ranking", len(pending_exact)) as task:
            for seg, (t, at, slot, floats) in zip(pending_exact, _ahead(candidates_of, [(s,) for s in pending_exact])):
                event(f"start top-k segment {seg}")
                exact = torch.full((2 * self.n_target * kc,), float("nan"))  # [side, target, K'] flat
                if len(t):  # only the (target, row) pairs that are candidates: n_target · K' dot products in all
                    exact[slot] = scores.pairs(floats, t, at)
                exact = exact.view(2, self.n_target, kc)
                mine = {"proponents": cand[0].numpy()[None], "proponent_scores": exact[0].numpy()[None],
                        "opponents": cand[1].numpy()[None], "opponent_scores": exact[1].numpy()[None]}
                if seg in measured:  # the sampled targets' exact top-k over the segment's every row
                    ref: list[Any] = [None, None, None, None]
                    spans = [span[1:] for span in self._spans([seg], self.approx_block)]  # 16 targets: small blocks
                    for (b, _), block_floats in zip(spans, _ahead(scores.load, spans)):
                        block = scores.rows(block_floats, sample)
                        ref = _merge_sides(ref, block, b, self.k)
                    want = _padded(*ref, kc)
                else:  # not read whole: no exact top-k here
                    want = _unmeasured(len(sample), kc)
                parts.write(seg, **{name: np.concatenate([mine[name], want[name]], axis=1) for name in mine})
                event(f"done top-k segment {seg}")
                task.advance()
        return len(pending) + len(pending_exact)

    def compute_scan(self, scores: TwoStageScores, parts: ChunkedRows, cands: ChunkedRows, dist: Dist,
                     reporter: Reporter, seed: bool = True) -> int:
        """The two-stage top-k in one pass (``rerank`` ``scan``) over this rank's pending segments; returns them.

        Per block of a segment, the codes and the float copy of its rows are read together (a thread reads the
        blocks ahead, another computes the next block's product: :func:`_pipeline`), the candidates are
        filtered from the approximate scores as in step 1, and every pair the running top-K' takes in is scored
        exactly at once from the block's float copy (:meth:`TwoStageScores.pairs`), as are the sampled targets
        against every row of a measured segment. A segment writes its candidates with their approximate
        scores (``top_k_candidates``) and, in the same slots, their exact ones (``top_k_parts``), then the
        sampled targets' exact top-k. The merge (:meth:`merge`) takes the K' best approximate scores of all
        segments per target and side, as step 2 does, and among them the K best exact ones, as step 3 does:
        the same top-k as the two passes, each row's float copy read once, in order.

        Every pair that enters a running top-K' is scored exactly, and a running top-K' that starts from nothing
        takes in about K' · ln(blocks) per target and side (1,700 over the 2,441 blocks of 10^7 rows, K' = 200).
        With ``seed``, each side
        starts instead from a floor that leaves about three times K' rows above it (:meth:`_seed_floors`, from
        a sample of the rows). A floor that leaves fewer than K' rows above it for some target would lose
        candidates: then every target has fewer than K' (checked when every segment is done), and the pass
        runs again without the seed. The candidates, and so the top-k, are the same with or without it.
        """
        kc = self.candidates
        pending = parts.pending(dist.rank, dist.world_size)
        sample = torch.tensor(self.two_stage.sample, dtype=torch.int64)
        measured = set(self.recall_segments())
        spans = self._spans(pending, self.approx_block)
        floors = self._seed_floors(scores) if seed and pending else [None, None]
        seen = [_KthBest(kc, largest=True, base=floors[0]), _KthBest(kc, largest=False, base=floors[1])]
        blocks = _pipeline(scores.scan_read, scores.scan_product, [span[1:] for span in spans])
        with reporter.task("top-k (one pass)", len(pending)) as task, _one_thread():
            for seg, group in itertools.groupby(zip(spans, blocks), key=lambda x: x[0][0]):
                event(f"start top-k segment {seg}")
                sides = [RunningTopK(kc, side.largest, floor=side.kth, batch=SCAN_MERGE_BATCH) for side in seen]
                exact = _PairScores(self.store.layout.n_train)
                ref: list[Any] = [None, None, None, None]
                for (_, b, _), (approx, floats) in group:
                    for side in sides:
                        side.add(approx, b)
                    t, r = (torch.cat(x) for x in zip(*(side.take_fresh() for side in sides)))
                    exact.add(t, r, lambda t, r: scores.pairs(floats, t, r - b))
                    if seg in measured:  # the sampled targets' exact top-k over the segment's every row
                        block = scores.rows(floats, sample)
                        ref = _merge_sides(ref, block, b, self.k)
                found = [side.result() for side in sides]
                for side, (values, _) in zip(seen, found):
                    side.add(values)
                got = _padded(*found[0], *found[1], kc)
                cands.write(seg, **got)
                mine = {name: got[name] for name in ("proponents", "opponents")}
                for side in ("proponent", "opponent"):
                    mine[f"{side}_scores"] = exact.lookup(got[f"{side}s"][0])[None]
                want = _padded(*ref, kc) if seg in measured else _unmeasured(len(sample), kc)
                parts.write(seg, **{name: np.concatenate([mine[name], want[name]], axis=1) for name in mine})
                event(f"done top-k segment {seg}")
                task.advance()
        if not seed:
            return len(pending)
        dist.barrier()
        short = any(bool(((rows >= 0).sum(1) < kc).any()) for rows in self._merged_candidates(cands))
        if not short:
            return len(pending)
        reporter.info("the sampled floor of the one-pass top-k left a target fewer than K' candidates; "
                      "scanning again without it")
        if dist.is_main:
            for arrays in (cands, parts):
                arrays.unmark()
                for c in range(len(self.segments)):
                    arrays.done[c] = 0
        dist.barrier()
        return len(pending) + self.compute_scan(scores, parts, cands, dist, reporter, seed=False)

    def _seed_floors(self, scores: TwoStageScores) -> list[torch.Tensor | None]:
        """Per side (highest, lowest) ``[n_target]`` approximate scores to start the running top-K' from, or None.

        Every :data:`SEED_STRIDE_BLOCKS`-th block of ``approx_block`` rows is scored from its codes; a fraction f
        of the chunks. Per target the best score of each sampled chunk is taken (one per chunk: rows that rank
        together are often stored together), and the floor is the m-th best of those, m = 3 · K' · f: about
        3 · K' rows lie above it, and for fewer than K' to lie above it the sample would have to hold three
        times its share of the chunks that hold a target's top K'. None when m < :data:`SEED_MIN` (too small
        a sample to say).
        """
        layout = self.store.layout
        rows_per = self.approx_block
        plan = seed_sample(layout.n_train, layout.chunk_rows, rows_per, self.candidates)
        if plan is None:
            return [None, None]
        starts, m = plan
        chunks_per = rows_per // layout.chunk_rows
        best, worst = [], []
        for approx, _ in _pipeline(scores.scan_read, scores.scan_product, [(a, a + rows_per) for a in starts]):
            per_chunk = approx.view(chunks_per, layout.chunk_rows, -1)
            best.append(per_chunk.amax(1))
            worst.append(per_chunk.amin(1))
        top = torch.topk(torch.cat(best), m, dim=0).values[-1]  # [n_target]: the m-th best chunk
        low = torch.topk(torch.cat(worst), m, dim=0, largest=False).values[-1]
        # one step outward: a score equal to the floor passes it (a floor is beaten strictly)
        return [torch.nextafter(top, torch.tensor(-np.inf)), torch.nextafter(low, torch.tensor(np.inf))]

    def recall_segments(self) -> list[int]:
        """The segments whose every row is read for the recall (:func:`measured_segments` of :data:`RECALL_ROWS`)."""
        return measured_segments(self.segments, RECALL_ROWS)

    def _spans(self, pending: list[int], block: int | None = None) -> list[tuple[int, int, int]]:
        """``(segment, lo, hi)`` of every block (``block`` rows, default :attr:`block`) of the segments ``pending``,
        in order."""
        block = block or self.block
        return [(seg, b, min(b + block, self.segments[seg][1]))
                for seg in pending for b in range(self.segments[seg][0], self.segments[seg][1], block)]

    def _merged_candidates(self, cands: ChunkedRows) -> list[torch.Tensor]:
        """Step 2: the K' candidates per target of all segments, ``[proponent rows, opponent rows]`` ``[n_target, K']``
        int64 (by approximate score; equal scores by row, so every rank computes the same)."""
        got = {name: read_checked(arr, (slice(None),), 0) for name, arr in cands.data.items()}
        return [torch.from_numpy(np.ascontiguousarray(
                    _merge_parts(got[f"{side}_scores"], got[f"{side}s"], self.candidates, largest)[1]))
                for side, largest in (("proponent", True), ("opponent", False))]

    def _merge_exact(self, got: dict[str, np.ndarray], rows: Any,
                     cands: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The final top-k of targets ``rows`` from step 3's parts ``got`` (``[n_segments, n, K']`` arrays), or,
        with ``rerank`` ``scan``, from the segments' candidates ``cands`` and the exact scores of the same slots
        in ``got`` (:meth:`compute_scan`)."""
        if self.two_stage.rerank == "scan":
            return self._merge_scan(got, rows, cands)
        out = {}
        for side, largest in (("proponent", True), ("opponent", False)):
            vals = np.fmax.reduce(got[f"{side}_scores"][:, rows], axis=0)  # each candidate is exact in one segment
            idx = got[f"{side}s"][0, rows]
            vals = np.where(np.isnan(vals), -np.inf if largest else np.inf, vals).astype(np.float32)
            out[f"{side}_scores"], out[f"{side}s"] = order_top_k(vals, idx, self.k, largest)
        return out

    def _merge_scan(self, got: dict[str, np.ndarray], rows: Any, cands: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """:meth:`_merge_exact` of a one-pass top-k: per target and side the K' best approximate scores over the
        segments (equal ones by row, as :meth:`_merged_candidates`), then the K best exact scores among them."""
        out = {}
        for side, largest in (("proponent", True), ("opponent", False)):
            idx = np.concatenate(list(cands[f"{side}s"][:, rows]), axis=1)  # [n, n_segments · K']
            approx = np.concatenate(list(cands[f"{side}_scores"][:, rows]), axis=1)
            exact = np.concatenate(list(got[f"{side}_scores"][:, rows]), axis=1)
            worst = -np.inf if largest else np.inf
            key = np.where(idx >= 0, -approx if largest else approx, np.inf)
            pick = np.lexsort((idx, key), axis=-1)[:, : self.candidates]  # the merged K' candidates
            idx, exact = np.take_along_axis(idx, pick, 1), np.take_along_axis(exact, pick, 1)
            exact = np.where((idx >= 0) & ~np.isnan(exact), exact, worst).astype(np.float32)
            out[f"{side}_scores"], out[f"{side}s"] = order_top_k(exact, idx, self.k, largest)
        return out

    def _scan_candidates(self, targets: slice) -> dict[str, np.ndarray] | None:
        """The stored candidates ``[n_segments, targets, K']`` of a one-pass top-k (:meth:`compute_scan`), else
        None."""
        if self.two_stage is None or self.two_stage.rerank != "scan":
            return None
        return {name: read_checked(arr, (slice(None), targets), 0)
                for name, arr in self.candidate_parts(create=False).data.items()}

    def recall(self, parts: ChunkedRows) -> dict[str, Any]:
        """The recall@K of the two-stage top-k of the sampled targets against their exact top-k (from ``parts``).

        The sampled targets' exact scores are known over the rows of :meth:`recall_segments`, a fraction f of
        the train rows. With f = 1 the recall is exact: the mean over the sampled targets of
        |two-stage ∩ exact| / K. With f < 1 it is estimated: a row that the two-stage top-k R missed but that
        belongs to the exact top-k beats R's K-th score τ, so ``1 - u / K`` bounds the recall from below, u the
        rows outside R that beat τ; u is counted over the sampled rows and divided by f (an unbiased estimate of
        u for rows sampled by whole segments, in which candidates are spread as anywhere).

        Returns:
            :meth:`TwoStage.settings` plus ``k``, ``candidates`` (K'), ``n_queries``, ``rows_measured`` (f, a
            float) and ``recall`` ``{"proponents": r, "opponents": r}`` (Python floats in [0, 1]).
        """
        n = len(self.two_stage.sample)
        measured = self.recall_segments()
        frac = sum(self.segments[s][1] - self.segments[s][0] for s in measured) / self.store.layout.n_train
        got = {name: read_checked(arr, (slice(None),), 0) for name, arr in parts.data.items()}
        sample = np.asarray(self.two_stage.sample)
        mine = self._merge_exact(got, sample, self._scan_candidates(slice(None)))
        recall = {}
        for side, largest in (("proponent", True), ("opponent", False)):
            ref_vals, ref_rows = got[f"{side}_scores"][:, self.n_target:], got[f"{side}s"][:, self.n_target:]
            if frac >= 1:
                exact = _merge_parts(ref_vals, ref_rows, self.k, largest)[1]
                hits = [len(set(a.tolist()) & set(b.tolist())) / self.k for a, b in zip(mine[f"{side}s"], exact)]
                recall[f"{side}s"] = float(np.mean(hits))
                continue
            est = []
            for j in range(n):  # the rows of the measured segments beyond the K-th score of the two-stage top-k
                tau, kept = mine[f"{side}_scores"][j, -1], set(mine[f"{side}s"][j].tolist())
                vals, rows = ref_vals[measured, j].ravel(), ref_rows[measured, j].ravel()
                beyond = (vals > tau) if largest else (vals < tau)
                u = sum(1 for r in rows[beyond & (rows >= 0)].tolist() if r not in kept)
                est.append(1.0 - min(self.k, u / frac) / self.k)
            recall[f"{side}s"] = float(np.mean(est))
        return {**self.two_stage.settings(), "k": self.k, "candidates": self.candidates, "n_queries": n,
                "rows_measured": float(min(frac, 1.0)), "recall": recall}

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
                step = hi - lo if getattr(scores, "whole_segments", False) else self.block  # exact: saves its own rows
                spans = [(b, min(b + step, hi)) for b in range(lo, hi, step)]
                for (b, _), block in zip(spans, _blocks(scores, spans)):
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
            if self.two_stage is not None:
                self.final.write(c, **self._merge_exact(got, slice(None), self._scan_candidates(slice(lo, hi))))
                continue
            out = {}
            for side, largest in (("proponent", True), ("opponent", False)):
                out[f"{side}_scores"], out[f"{side}s"] = _merge_parts(got[f"{side}_scores"], got[f"{side}s"],
                                                                      self.k, largest)
            self.final.write(c, **out)
        return len(pending)

    def drop_parts(self) -> None:
        self.store.drop(f"scores/{self.experiment}/top_k_parts")
        if self.two_stage is not None:
            self.store.drop(f"scores/{self.experiment}/top_k_candidates")

    def read(self, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
        """Targets ``[lo, hi)`` of the merged arrays (:data:`~trakcli.store.store.TOP_K_ARRAYS`), checked."""
        hi = self.n_target if hi is None else hi
        return {name: self.final.read(name, lo, hi) for name in TOP_K_ARRAYS}


def _merge_parts(vals: np.ndarray, idx: np.ndarray, k: int, largest: bool) -> tuple[np.ndarray, np.ndarray]:
    """The best ``k`` (scores, train rows) of each target over the segments' parts ``[n_segments, n, K]``
    (float32 scores, int64 rows; a segment shorter than K pads with row -1, never kept), best first
    (:func:`trakcli.scoring.order_top_k`)."""
    vals = np.concatenate(list(vals), axis=1)  # [n, n_segments * K]
    idx = np.concatenate(list(idx), axis=1)
    vals = np.where(idx >= 0, vals, -np.inf if largest else np.inf).astype(np.float32)
    return order_top_k(vals, idx, k, largest)


def _blocks(scores: BlockScores, spans: list[tuple[int, int]]) -> Iterator[torch.Tensor]:
    """The scores of each span in order; when ``scores`` reads apart from scoring (``read_block`` and
    ``score_read``, as :class:`trakcli.jobs.score` has), the next span is read by a background thread while
    this one is scored and merged (at most two blocks of features in memory)."""
    read = getattr(scores, "read_block", None)
    if read is None:
        yield from (scores(lo, hi) for lo, hi in spans)
        return
    for (lo, hi), got in zip(spans, _ahead(read, spans)):
        yield scores.score_read(got, lo, hi)


def _ahead(fn: Callable[[int, int], Any], spans: list[tuple[int, int]]) -> Iterator[Any]:
    """``fn(lo, hi)`` of each span in order, the next one computed by a background thread while the caller uses
    this one (reading and decompressing a block, or its product, overlap the caller's work on the previous block:
    at most two blocks in memory)."""
    with ThreadPoolExecutor(1) as pool:
        nxt = pool.submit(fn, *spans[0]) if spans else None
        for i in range(len(spans)):
            cur = nxt.result()
            nxt = pool.submit(fn, *spans[i + 1]) if i + 1 < len(spans) else None
            yield cur


#: The one-pass top-k samples every this many blocks for its starting floor (:meth:`StoredTopK._seed_floors`).
SEED_STRIDE_BLOCKS = 16
#: The fewest sampled chunks above a starting floor (:meth:`StoredTopK._seed_floors`): below it, no floor.
SEED_MIN = 8
#: :class:`RunningTopK`'s ``batch`` in a one-pass top-k: every score that passes the threshold is also scored
#: exactly, so the threshold is kept fresher than in a pass over the codes alone.
SCAN_MERGE_BATCH = 0.25

@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Torch ops of the calling thread on one thread (restored after): the filtering of a block is many small ops,
    and the products of the next blocks keep the cores busy meanwhile (:func:`_pipeline`); the setting is the
    calling thread's own."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _pipeline(read: Callable[[int, int, int], Any], compute: Callable[[Any], Any], spans: list[tuple[int, int]],
              depth: int = 4, workers: int = 2) -> Iterator[Any]:
    """``compute(read(lo, hi, i))`` of each span ``i`` in order, in background threads: ``depth`` of them read up
    to ``depth`` spans ahead, each its own (waiting on the disk or the network, not the processor; one request
    at a time each), and ``workers`` compute the next spans, each on one torch thread, while the caller uses
    this one. At most ``depth + workers + 1`` spans' reads are held at once.

    One torch thread a product, not one product on every core: the caller's filtering and the reads share the
    cores, and a product split over threads waits for its slowest one (measured, one-pass top-k at 10^7 rows on
    two cores: 23.8 ms a block with one product on two threads, 18.6 ms with two products on one each, against
    11.9 ms for a product alone)."""
    with ThreadPoolExecutor(depth) as reader, \
            ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(1,)) as worker:
        reads = [reader.submit(read, *span, i) for i, span in enumerate(spans[: depth + workers])]
        products = [worker.submit(lambda f: compute(f.result()), reads[i]) for i in range(min(workers, len(spans)))]
        for i in range(len(spans)):
            cur = products[i].result()
            products[i] = reads[i] = None
            if i + workers < len(spans):
                products.append(worker.submit(lambda f: compute(f.result()), reads[i + workers]))
            if i + depth + workers < len(spans):
                reads.append(reader.submit(read, *spans[i + depth + workers], i + depth + workers))
            yield cur


class _PairScores:
    """Exact scores of (target, row) pairs, computed once each as their block passes (:meth:`StoredTopK.compute_scan`).

    Args:
        n_train: train rows (pairs are keyed ``target · n_train + row``).
    """

    def __init__(self, n_train: int):
        self.n_train = n_train
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []

    def add(self, targets: torch.Tensor, rows: torch.Tensor,
            score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Score the pairs ``(targets[j], rows[j])`` (int64, repeats allowed) with ``score(targets, rows)`` (``[p]``
        float32), each distinct pair once."""
        if not len(targets):
            return
        keys = torch.unique(targets * self.n_train + rows)
        self._keys.append(keys)
        self._values.append(score(keys // self.n_train, keys % self.n_train))

    def lookup(self, rows: np.ndarray) -> np.ndarray:
        """``[n_target, c]`` float32 exact scores of target t against ``rows[t, j]`` (NaN where the row is -1).

        Raises:
            RuntimeError: a pair was never scored (a defect: every candidate is scored as its block passes).
        """
        out = np.full(rows.shape, np.nan, dtype=np.float32)
        t, j = np.nonzero(rows >= 0)
        if not len(t):
            return out
        keys = torch.cat(self._keys) if self._keys else torch.empty(0, dtype=torch.int64)
        values = torch.cat(self._values) if self._values else torch.empty(0)
        keys, order = torch.sort(keys)
        want = torch.from_numpy(t.astype(np.int64) * self.n_train + rows[t, j])
        at = torch.searchsorted(keys, want).clamp_(max=max(len(keys) - 1, 0))
        if not len(keys) or not bool((keys[at] == want).all()):
            raise RuntimeError("a candidate of the one-pass top-k has no exact score")
        out[t, j] = values[order[at]].numpy()
        return out


class _CandidatePairs:
    """The ``(target, row)`` pairs of the merged candidates of both sides, sorted by row once, so that each block
    of the re-ranking pass takes its pairs as one slice (:meth:`within`).

    Args:
        cand: ``[proponent rows, opponent rows]``, each ``[n_target, K']`` int64.
    """

    def __init__(self, cand: list[torch.Tensor]):
        rows = torch.cat([c.reshape(-1) for c in cand])  # flat position: side · n_target · K' + target · K' + slot
        self.rows, order = torch.sort(rows, stable=True)
        self.slot = order
        self.target = (order % cand[0].numel()) // cand[0].shape[1]

    def within(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(targets, rows, flat positions)`` of the pairs whose row lies in ``lo .. hi``."""
        a, b = (int(i) for i in torch.searchsorted(self.rows, torch.tensor([lo, hi])))
        return self.target[a:b], self.rows[a:b], self.slot[a:b]


#: Columns of a block whose best score is compared first by :func:`_beyond`.
FILTER_GROUP = 16


def _beyond(block: torch.Tensor, thr: torch.Tensor, largest: bool,
            rows_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(targets, columns)`` of the scores of ``block`` beyond ``thr`` ``[n_target]`` (above, or below when not
    ``largest``).

    Args:
        block: ``[n_target, cols]`` scores, or ``[cols, n_target]`` with ``rows_first`` (as
            :meth:`TwoStageScores.approx` gives them); the pairs come by target in the first layout.

    The columns are cut into ``cols / FILTER_GROUP`` groups of :data:`FILTER_GROUP` columns, group g holding
    columns g, g + cols / FILTER_GROUP, g + 2 cols / FILTER_GROUP, ...; the best score of each group is compared
    first (one reduction over the block, across its rows of groups: an order of magnitude faster than over
    contiguous runs of 64 columns, measured), then the columns of the groups that pass: little more than one
    read of the block when few pass. Each layout is reduced and indexed along its own axes: a transposed view
    of the other layout takes 5 to 9 times as long (measured, 4,096 × 1,000 blocks).
    """
    beats = torch.gt if largest else torch.lt
    c = block.shape[0] if rows_first else block.shape[1]
    if c % FILTER_GROUP:
        got = beats(block, thr[None, :] if rows_first else thr[:, None]).nonzero(as_tuple=True)
        return got[::-1] if rows_first else got
    stride = c // FILTER_GROUP
    if rows_first:
        groups = block.view(FILTER_GROUP, stride, -1)  # groups[m, g, t] = block[m · stride + g, t]
        best = groups.amax(0) if largest else groups.amin(0)  # [stride, n_target]
        rg, rt = beats(best, thr[None, :]).nonzero(as_tuple=True)
        pm, pi = beats(groups[:, rg, rt], thr[rt][None, :]).nonzero(as_tuple=True)  # of [FILTER_GROUP, passing]
    else:
        groups = block.view(block.shape[0], FILTER_GROUP, stride)  # groups[t, m, g] = block[t, m · stride + g]
        best = groups.amax(1) if largest else groups.amin(1)  # [n_target, stride]
        rt, rg = beats(best, thr[:, None]).nonzero(as_tuple=True)
        pi, pm = beats(groups[rt, :, rg], thr[rt][:, None]).nonzero(as_tuple=True)  # of [passing, FILTER_GROUP]
    return rt[pi], pm * stride + rg[pi]


def merge_top_k_filtered(
    values: torch.Tensor | None, indices: torch.Tensor | None, block: torch.Tensor, offset: int, k: int,
    largest: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~trakcli.scoring.merge_top_k` that looks only at the block's scores beyond the kept k-th best.

    Once ``k`` finite values are kept, a score of the block can only enter the top-k if it beats the
    target's current k-th best (strictly: a tie with it keeps the kept row); those are found by one comparison
    over the block, and only they (few after the first blocks) are merged by ``topk``. For the first block
    the threshold is the (2k / :data:`SEED_STRIDE`)-th best of every :data:`SEED_STRIDE`-th column, kept only
    when at least k scores of every target beat it (then the top-k of the block is among them). Otherwise,
    and when many pass, the block goes to :func:`~trakcli.scoring.merge_top_k`.
    """
    if values is None:  # a threshold from every SEED_STRIDE-th column, that about 2k of the block's scores pass
        if block.shape[1] < 4 * SEED_STRIDE * k:
            return merge_top_k(values, indices, block, offset, k, largest)
        sub = block[:, ::SEED_STRIDE].contiguous()
        thr = torch.topk(sub, max(1, 2 * k // SEED_STRIDE), dim=1, largest=largest, sorted=False).values
        thr = thr.amin(1) if largest else thr.amax(1)
    elif values.shape[1] < k:
        return merge_top_k(values, indices, block, offset, k, largest)
    else:
        thr = values.amin(1) if largest else values.amax(1)
    if not torch.isfinite(thr).all():
        return merge_top_k(values, indices, block, offset, k, largest)
    t, j = _beyond(block, thr, largest)
    if len(t) == 0 and values is not None:
        return values, indices
    if 4 * len(t) > block.numel():
        return merge_top_k(values, indices, block, offset, k, largest)
    count = torch.bincount(t, minlength=block.shape[0])
    if values is None:  # the seeded threshold must leave k per target
        if int(count.min()) < k:
            return merge_top_k(values, indices, block, offset, k, largest)
        values = torch.empty(block.shape[0], 0)
        indices = torch.empty(block.shape[0], 0, dtype=torch.int64)
    pos = torch.arange(len(t)) - (torch.cumsum(count, 0) - count)[t]  # rank of each passing score in its target
    width = int(count.max())
    got = torch.full((block.shape[0], width), float("-inf") if largest else float("inf"))
    got[t, pos] = block[t, j]
    rows = torch.zeros((block.shape[0], width), dtype=torch.int64)  # a filler (±inf) never beats a kept value
    rows[t, pos] = j + offset
    both, both_idx = torch.cat([values, got], dim=1), torch.cat([indices, rows], dim=1)
    kept, sel = torch.topk(both, k, dim=1, largest=largest, sorted=False)
    return kept, torch.gather(both_idx, 1, sel)


def _kth(values: torch.Tensor | None, k: int, largest: bool) -> torch.Tensor | None:
    """The k-th best ``[n_target]`` of ``values`` ``[n_target, c]`` (a running top-k: its k best), or None when
    c < k or a target's k-th best is not finite."""
    if values is None or values.shape[1] < k:
        return None
    kth = values.amin(1) if largest else values.amax(1)
    return kth if bool(torch.isfinite(kth).all()) else None


class _KthBest:
    """The k-th best score per target of the values merged so far (:meth:`add`), or None before k are.

    A segment's candidate pass needs only the scores beyond it (:class:`RunningTopK`'s ``floor``): the
    candidates of every segment merged then give the same K' per target as without it.
    """

    def __init__(self, k: int, largest: bool, base: torch.Tensor | None = None):
        self.k, self.largest, self.base = k, largest, base
        self.values: torch.Tensor | None = None  # [n_target, <= k] the best k so far
        self.kth: torch.Tensor | None = base  # [n_target]

    def add(self, values: torch.Tensor) -> None:
        """Merge ``[n_target, c]`` scores (±inf where a target has none)."""
        both = values if self.values is None else torch.cat([self.values, values], dim=1)
        self.values = torch.topk(both, min(self.k, both.shape[1]), dim=1, largest=self.largest, sorted=False).values
        if self.base is None:
            self.kth = _kth(self.values, self.k, self.largest)
            return
        # with a base floor (finite): the better of it and the k-th best, where a target has k finite ones
        worst = torch.tensor(float("-inf") if self.largest else float("inf"))
        own = (self.values.amin(1) if self.largest else self.values.amax(1)) if self.values.shape[1] >= self.k \
            else worst.expand(self.values.shape[0])
        own = torch.where(torch.isfinite(own), own, worst)
        self.kth = torch.maximum(own, self.base) if self.largest else torch.minimum(own, self.base)


class RunningTopK:
    """The running top-k of one side over blocks of scores, whose merges are batched.

    A block's scores beyond the kept k-th best (:func:`_beyond`) are set aside; they are merged with the kept
    ones (one ``topk`` over ``[n_target, k + passed]``) only once ``n_target · k`` have been set aside, or at
    :meth:`result`. Between merges the threshold is the one of the last merge: lower than the current k-th
    best, so more scores pass, never fewer; the result is that of :func:`~trakcli.scoring.merge_top_k` over
    every block. Until k finite scores per target are kept (the first blocks), and for a block where more than
    a quarter pass, blocks go to :func:`merge_top_k_filtered` / :func:`~trakcli.scoring.merge_top_k` at once.

    With a ``floor``, only scores beyond it count (strictly): the result is the k best of those, fewer for a
    target where fewer pass (padded with -inf / +inf and row -1). A floor that is the k-th best of rows already
    seen elsewhere (:meth:`StoredTopK.compute_two_stage`: the segments before) leaves the top-k over both
    unchanged, and spares filtering most of the scores of the first blocks.

    Args:
        k: how many to keep per target.
        largest: keep the highest (proponents) or the lowest (opponents).
        floor: ``[n_target]`` float32 scores to beat, or None.
        batch: merge once ``batch · n_target · k`` scores are set aside (smaller: a fresher threshold, so fewer
            scores pass it, for more merges).
    """

    def __init__(self, k: int, largest: bool, floor: torch.Tensor | None = None, batch: float = 1.0):
        self.k, self.largest, self.batch = k, largest, batch
        self.floor = floor if floor is not None and bool(torch.isfinite(floor).all()) else None
        self.values: torch.Tensor | None = None  # [n_target, <= k] float32
        self.indices: torch.Tensor | None = None  # [n_target, <= k] int64 train rows
        self.thr: torch.Tensor | None = self.floor  # [n_target]: the kept k-th best at the last merge, or the floor
        if self.floor is not None:
            self.values = torch.empty(len(self.floor), 0)
            self.indices = torch.empty(len(self.floor), 0, dtype=torch.int64)
        self._passed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (targets, rows, scores)
        self._n_passed = 0
        self._fresh: list[tuple[torch.Tensor, torch.Tensor]] = []  # (targets, rows) taken since take_fresh()

    def take_fresh(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(targets, rows)`` int64 of the scores that :meth:`add` took in since the last call: every pair kept
        now or set aside to be merged (a superset of the pairs of the blocks since then in :meth:`result`)."""
        got, self._fresh = self._fresh, []
        if not got:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
        return torch.cat([t for t, _ in got]), torch.cat([r for _, r in got])

    def _kept_from(self, offset: int) -> None:
        """Note the kept pairs of rows from ``offset`` on (the block just merged whole) as fresh."""
        t, c = (self.indices >= offset).nonzero(as_tuple=True)
        self._fresh.append((t, self.indices[t, c]))

    def add(self, block: torch.Tensor, offset: int) -> None:
        """Take the scores ``[cols, n_target]`` (train rows first, as :meth:`TwoStageScores.approx` gives them) of
        train rows ``offset .. offset + cols``."""
        if self.thr is None:
            self.values, self.indices = merge_top_k_filtered(self.values, self.indices, block.T.contiguous(),
                                                             offset, self.k, self.largest)
            self._threshold()
            self._kept_from(offset)
            return
        t, j = _beyond(block, self.thr, self.largest, rows_first=True)
        if 4 * len(t) > block.numel() and self.floor is None:
            self._merge()
            self.values, self.indices = merge_top_k(self.values, self.indices, block.T.contiguous(), offset, self.k,
                                                    self.largest)
            self._threshold()
            self._kept_from(offset)
            return
        if len(t):
            self._fresh.append((t, j + offset))
            self._passed.append((t, j + offset, block[j, t]))
            self._n_passed += len(t)
            if self._n_passed >= self.batch * block.shape[1] * self.k:
                self._merge()

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``([n_target, k] scores, [n_target, k] int64 rows)`` of every block taken, in no particular order
        (fewer than k columns when fewer rows were taken or passed the floor; a target's missing ones are
        -inf / +inf with row -1)."""
        self._merge()
        if self.floor is not None:
            self.indices = torch.where(torch.isfinite(self.values), self.indices, -1)
        return self.values, self.indices

    def _threshold(self) -> None:
        own = _kth(self.values, self.k, self.largest)
        if self.floor is None or own is None:
            self.thr = own if self.floor is None else self.floor
            return
        self.thr = torch.maximum(own, self.floor) if self.largest else torch.minimum(own, self.floor)

    def _merge(self) -> None:
        if not self._passed:
            return
        t, rows, vals = (torch.cat(x) for x in zip(*self._passed))
        self._passed, self._n_passed = [], 0
        order = torch.argsort(t, stable=True)  # by target, each target's scores in the order they came
        t, rows, vals = t[order], rows[order], vals[order]
        n = self.values.shape[0]
        count = torch.bincount(t, minlength=n)
        pos = torch.arange(len(t)) - (torch.cumsum(count, 0) - count)[t]  # rank of each score in its target
        width = int(count.max())
        got = torch.full((n, width), float("-inf") if self.largest else float("inf"))
        got[t, pos] = vals
        idx = torch.zeros((n, width), dtype=torch.int64)  # a filler (±inf) never beats a kept (finite) value
        idx[t, pos] = rows
        both, both_idx = torch.cat([self.values, got], dim=1), torch.cat([self.indices, idx], dim=1)
        kept, sel = torch.topk(both, min(self.k, both.shape[1]), dim=1, largest=self.largest, sorted=False)
        self.values, self.indices = kept, torch.gather(both_idx, 1, sel)
        self._threshold()


def _merge_sides(ref: list[Any], block: torch.Tensor, offset: int, k: int) -> list[Any]:
    """``[top values, top rows, low values, low rows]`` of ``ref`` merged with ``block`` ``[n, cols]`` of rows
    ``offset ..`` (:func:`~trakcli.scoring.merge_top_k` of both sides)."""
    top = merge_top_k(ref[0], ref[1], block, offset, k, largest=True)
    low = merge_top_k(ref[2], ref[3], block, offset, k, largest=False)
    return [*top, *low]


def _unmeasured(n: int, k: int) -> dict[str, np.ndarray]:
    """The parts of ``n`` sampled targets in a segment not read whole: no exact top-k (row -1)."""
    idx, val = np.full((1, n, k), -1, np.int64), np.zeros((1, n, k), np.float32)
    return {"proponents": idx, "proponent_scores": val, "opponents": idx, "opponent_scores": val}


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
