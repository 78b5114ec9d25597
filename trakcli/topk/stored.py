"""The top-k of one experiment in the store (:class:`StoredTopK`): its segments, their parts, the merged arrays,
and the passes that compute them (the exact stream, the two-stage candidates and re-ranking, the recall)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from trakcli.distributed import Dist
from trakcli.files import event
from trakcli.progress import Reporter
from trakcli.scoring import order_top_k
from trakcli.store import ChunkedRows, Store
from trakcli.store.rows import read_checked
from trakcli.topk import plan  # its sizes are read at each use (tests set them small)
from trakcli.topk.features import FeatureScores
from trakcli.topk.plan import TOP_K_ARRAYS, BlockScores, TwoStage, block_rows, measured_segments, seed_sample, segments
from trakcli.topk.stream import (RunningTopK, _blocks, _KthBest, _merge_parts, _merge_sides, _one_thread, _padded,
                                 _pipeline, _PairScores, _unmeasured)


def top_k_arrays(store: Store, experiment: str, n_target: int, k: int, create: bool = True,
                 repair: bool = False) -> ChunkedRows:
    """The top-k arrays of an experiment (``scores/<experiment>/top_k``), chunked by target rows.

    Arrays: ``proponents`` / ``opponents`` ``[n_target, k]`` int64 train indices (highest / lowest scores first)
    and ``proponent_scores`` / ``opponent_scores`` ``[n_target, k]`` float32 (:data:`TOP_K_ARRAYS`), with a done
    flag per chunk of target rows (about 4 MB). Call after :meth:`~trakcli.store.Store.score_settings`, which
    checks the experiment.

    Raises:
        StoreMismatchError: the stored top-k has another ``k`` (names ``--overwrite``).
    """
    t_rows = min(n_target, max(1, (4 << 20) // (12 * k)))  # ~4 MB chunks of indices and scores
    arrays = {name: ((n_target, k), dtype, (t_rows, k), ("target", "rank")) for name, dtype in TOP_K_ARRAYS.items()}
    return store.sized_rows(f"scores/{experiment}/top_k", {"k": k}, arrays, n_target, t_rows, create, repair)


def top_k_parts(store: Store, experiment: str, n_target: int, k: int, n_segments: int, create: bool = True,
                repair: bool = False, name: str = "top_k_parts") -> ChunkedRows:
    """Per segment of train rows, its own top-k (``scores/<experiment>/<name>``), chunked by segment.

    The arrays of :func:`top_k_arrays` with a leading segment axis, ``[n_segments, n_target, k]``, and a done flag
    per segment: the resumable state of a streamed top-k pass, merged into the top-k when every segment is done,
    then dropped. ``name``: the group (``top_k_candidates`` holds the candidates of a two-stage top-k).

    Raises:
        StoreMismatchError: the parts were made with another ``k`` or segmentation.
    """
    t_rows = min(n_target, max(1, (4 << 20) // (12 * k)))
    arrays = {a: ((n_segments, n_target, k), dtype, (1, t_rows, k), ("segment", "target", "rank"))
              for a, dtype in TOP_K_ARRAYS.items()}
    return store.sized_rows(f"scores/{experiment}/{name}", {"k": k}, arrays, n_segments, 1, create, repair)


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
                                 plan.SEGMENT_ROWS if two_stage is None else plan.TWO_STAGE_SEGMENT_ROWS)
        self.block = block_rows(n_target, layout.proj_dim, layout.chunk_rows)
        self.approx_block = block_rows(n_target, layout.proj_dim, layout.chunk_rows, plan.APPROX_BLOCK_BYTES)
        self.final = top_k_arrays(store, experiment, n_target, self.k, create=create, repair=create)

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
            n, k = self.n_target, self.k
        else:
            n, k = self.n_target + len(self.two_stage.sample), self.candidates
        return top_k_parts(self.store, self.experiment, n, k, len(self.segments), create=create, repair=create)

    @property
    def candidates(self) -> int:
        """K': candidates per target and side of a two-stage top-k (at most n_train)."""
        return min(self.two_stage.multiplier * self.k, self.store.layout.n_train)

    def candidate_parts(self, create: bool) -> ChunkedRows:
        """Step 1 of a two-stage top-k: per segment, its K' candidates by approximate score (created if ``create``)."""
        return top_k_parts(self.store, self.experiment, self.n_target, self.candidates, len(self.segments),
                           create=create, repair=create, name="top_k_candidates")

    def compute_scan(self, scores: FeatureScores, parts: ChunkedRows, cands: ChunkedRows, dist: Dist,
                     reporter: Reporter, seed: bool = True) -> int:
        """The two-stage top-k in one pass over this rank's pending segments; returns them. Every rank calls it.

        Per block, the codes and the float copy of its rows are read together (:func:`_pipeline`); a running top-K' per
        target and side takes candidates from the approximate scores, and every pair it takes in is scored exactly from
        the block's float copy (:meth:`FeatureScores.pairs`), as are the sampled targets against every row of a measured
        segment. A segment writes its candidates with their approximate scores (``top_k_candidates``), their exact ones
        in the same slots (``top_k_parts``), then the sampled targets' exact top-k; :meth:`merge` keeps the K' best
        approximate scores per target and side, and among them the K best exact ones.

        With ``seed``, each side starts from a floor that leaves about 3 K' rows above it (:meth:`_seed_floors`).
        Should it leave fewer than K' for a target (checked when every segment is done), the pass runs again
        without it: the top-k is the same either way.
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
                sides = [RunningTopK(kc, side.largest, floor=side.kth, batch=plan.SCAN_MERGE_BATCH) for side in seen]
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

    def _seed_floors(self, scores: FeatureScores) -> list[torch.Tensor | None]:
        """Per side (highest, lowest) ``[n_target]`` approximate scores to start the running top-K' from, or None.

        From every :data:`SEED_STRIDE_BLOCKS`-th block (a fraction f of the chunks), per target the best score of
        each sampled chunk; the floor is the m-th best of those, m = 3 · K' · f (:func:`seed_sample`), so that
        about 3 · K' rows lie above it.
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
        return measured_segments(self.segments, plan.RECALL_ROWS)

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

    def _merge_scan(self, got: dict[str, np.ndarray], rows: Any, cands: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The final top-k of targets ``rows`` of a two-stage top-k: per target and side the K' best approximate
        scores over the segments' candidates ``cands`` (equal ones by row, as :meth:`_merged_candidates`), then
        the K best exact ones among them (``got``: the exact scores of the same slots, :meth:`compute_scan`)."""
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

    def _scan_candidates(self, targets: slice) -> dict[str, np.ndarray]:
        """The stored candidates ``[n_segments, targets, K']`` of a two-stage top-k (:meth:`compute_scan`)."""
        return {name: read_checked(arr, (slice(None), targets), 0)
                for name, arr in self.candidate_parts(create=False).data.items()}

    def recall(self, parts: ChunkedRows) -> dict[str, Any]:
        """The recall@K of the two-stage top-k of the sampled targets against their exact top-k (from ``parts``).

        Over the rows of :meth:`recall_segments`, a fraction f of the train rows: with f = 1 the mean over the
        sampled targets of |two-stage ∩ exact| / K; with f < 1 the estimate ``1 - u / K`` (a lower bound), u the
        rows outside the two-stage top-k that beat its K-th score, counted over the sampled rows and divided by f
        (docs/guides/store.md).

        Returns:
            :meth:`TwoStage.settings` plus ``k``, ``candidates`` (K'), ``n_queries``, ``rows_measured`` (f, a
            float) and ``recall`` ``{"proponents": r, "opponents": r}`` (Python floats in [0, 1]).
        """
        n = len(self.two_stage.sample)
        measured = self.recall_segments()
        frac = sum(self.segments[s][1] - self.segments[s][0] for s in measured) / self.store.layout.n_train
        got = {name: read_checked(arr, (slice(None),), 0) for name, arr in parts.data.items()}
        sample = np.asarray(self.two_stage.sample)
        mine = self._merge_scan(got, sample, self._scan_candidates(slice(None)))
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
                got: list[Any] = [None, None, None, None]
                step = hi - lo if getattr(scores, "whole_segments", False) else self.block  # exact: saves its own rows
                spans = [(b, min(b + step, hi)) for b in range(lo, hi, step)]
                for (b, _), block in zip(spans, _blocks(scores, spans)):
                    got = _merge_sides(got, block, b, self.k)
                parts.write(seg, **_padded(*got, self.k))
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
                self.final.write(c, **self._merge_scan(got, slice(None), self._scan_candidates(slice(lo, hi))))
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
        """Targets ``[lo, hi)`` of the merged arrays (:data:`~trakcli.topk.plan.TOP_K_ARRAYS`), checked."""
        hi = self.n_target if hi is None else hi
        return {name: self.final.read(name, lo, hi) for name in TOP_K_ARRAYS}


