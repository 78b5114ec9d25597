"""Streaming merges of a top-k: running top-k of score blocks (with a threshold that skips most of a block),
the merge of segments' parts, and the background reads and products that feed them."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import numpy as np
import torch

from trakcli.scoring import merge_top_k, order_top_k
from trakcli.topk.plan import SEED_STRIDE, BlockScores


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
    ``score_read``, as :class:`~trakcli.topk.features.FeatureScores`), the next span is read by a background
    thread while this one is scored and merged (at most two blocks of features in memory)."""
    read = getattr(scores, "read_block", None)
    if read is None:
        yield from (scores(lo, hi) for lo, hi in spans)
        return
    with ThreadPoolExecutor(1) as pool:
        nxt = pool.submit(read, *spans[0]) if spans else None
        for i, (lo, hi) in enumerate(spans):
            got = nxt.result()
            nxt = pool.submit(read, *spans[i + 1]) if i + 1 < len(spans) else None
            yield scores.score_read(got, lo, hi)


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
    this one. At most ``depth + workers + 1`` spans' reads are held at once. One torch thread a product: the
    caller's filtering and the reads share the cores, and a product split over threads waits for its slowest."""
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
    """Exact scores of (target, row) pairs, computed once each as their block passes (:meth:`StoredTopK.compute_scan`),
    keyed ``target · n_train + row``."""

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


#: Columns of a block whose best score is compared first by :func:`_beyond`.
FILTER_GROUP = 16


def _beyond(block: torch.Tensor, thr: torch.Tensor, largest: bool,
            rows_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(targets, columns)`` of the scores of ``block`` ``[n_target, cols]`` (``rows_first``: ``[cols, n_target]``,
    as :meth:`~trakcli.topk.features.FeatureScores.scan_product` gives them) beyond ``thr`` ``[n_target]`` (above,
    or below when not ``largest``); the pairs come by target in the first layout.

    The columns are cut into ``cols / FILTER_GROUP`` strided groups (group g: columns g, g + cols / FILTER_GROUP,
    ...); the best score of each group is compared first, then the columns of the groups that pass: little more
    than one read of the block when few pass. Each layout is reduced and indexed along its own axes.
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


def merge_top_k_filtered(values: torch.Tensor | None, indices: torch.Tensor | None, block: torch.Tensor, offset: int,
                         k: int, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
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
    if values is None:  # the seeded threshold must leave k per target
        if int(torch.bincount(t, minlength=block.shape[0]).min()) < k:
            return merge_top_k(values, indices, block, offset, k, largest)
        values = torch.empty(block.shape[0], 0)
        indices = torch.empty(block.shape[0], 0, dtype=torch.int64)
    return _merge_pairs(values, indices, t, j + offset, block[t, j], k, largest)


def _merge_pairs(values: torch.Tensor, indices: torch.Tensor, t: torch.Tensor, rows: torch.Tensor,
                 scores: torch.Tensor, k: int, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The best ``k`` of the kept ``values`` / ``indices`` ``[n_target, c]`` and the ``scores`` of the pairs
    (target ``t``, train row ``rows``), ``t`` ascending."""
    n = values.shape[0]
    count = torch.bincount(t, minlength=n)
    pos = torch.arange(len(t)) - (torch.cumsum(count, 0) - count)[t]  # rank of each score in its target
    width = int(count.max())
    got = torch.full((n, width), float("-inf") if largest else float("inf"))
    got[t, pos] = scores
    idx = torch.zeros((n, width), dtype=torch.int64)  # a filler (±inf) never beats a kept (finite) value
    idx[t, pos] = rows
    both, both_idx = torch.cat([values, got], dim=1), torch.cat([indices, idx], dim=1)
    kept, sel = torch.topk(both, min(k, both.shape[1]), dim=1, largest=largest, sorted=False)
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

    A block's scores beyond the kept k-th best (:func:`_beyond`) are set aside and merged with the kept ones only
    once ``batch · n_target · k`` are, or at :meth:`result`; between merges the threshold is the last merge's, so
    more scores pass, never fewer: the result is that of :func:`~trakcli.scoring.merge_top_k` over every block.
    Until k finite scores per target are kept, and for a block where more than a quarter pass, blocks are merged
    at once. With a ``floor``, only scores beyond it count (strictly): the result is the k best of those (padded
    with -inf / +inf and row -1 where fewer pass).

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
        """Take the scores ``[cols, n_target]`` (train rows first, as
        :meth:`~trakcli.topk.features.FeatureScores.scan_product` gives them) of train rows
        ``offset .. offset + cols``."""
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
        self.values, self.indices = _merge_pairs(self.values, self.indices, t[order], rows[order], vals[order],
                                                 self.k, self.largest)
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
