"""Fact-tracing retrieval statistics of ranked attributions: MRR and recall@k, pure numpy / scipy, no I/O.

Fact tracing (Akyürek et al. 2022, "Towards Tracing Factual Knowledge in Language Models Back to the Training
Data", FTRACE; Chang et al. 2025, "Scalable Influence and Fact Tracing for Large Language Model Pretraining",
TrackStar; EleutherAI Bergson's recall evaluation): each query states a fact whose *source* training documents
are known, and the attribution ranks the training set for the query (its proponents, best first). Per query:

- reciprocal rank: ``1 / r``, ``r`` the 1-based rank of the first source among the ranked rows, 0 when no
  source is among them; MRR is its mean over queries;
- recall@k: 1 when at least one source is among the top ``k`` ranked rows, else 0 (the "any source in the
  top k" form); recall@k is its mean over queries;
- source_recall@k: the fraction of the query's sources among the top ``k`` (recall@k when every query has one).

Every mean comes with a percentile bootstrap interval over queries (``scipy.stats.bootstrap``, one seed for all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from trakcli.errors import DataError
from trakcli.evaluation.lds import finite_or_none, mean_interval

#: recall@k reported when the ks are not given: those of these at most K (and K itself).
DEFAULT_KS = (1, 5, 10, 20, 50, 100)


def default_ks(k_max: int) -> list[int]:
    """The ks reported for a ranking of ``k_max`` rows per query: :data:`DEFAULT_KS` up to ``k_max``, and ``k_max``."""
    return sorted({k for k in DEFAULT_KS if k <= k_max} | {k_max})


def check_sources(sources: Sequence[Sequence[int]], n_train: int | None = None) -> list[np.ndarray]:
    """Validate each query's source rows (0-based train row indices holding its fact, at least one; below
    ``n_train`` unless it is None): per query a ``[n_sources]`` int64 array of distinct indices.

    Raises:
        DataError: a query with no sources, a non-integer or negative index, or an index >= ``n_train``
            (names the query row and the value).
    """
    out = []
    for q, src in enumerate(sources):
        try:
            arr = np.asarray(src if isinstance(src, (list, tuple, np.ndarray)) else [src])
        except (TypeError, ValueError):
            arr = np.asarray([], dtype=object)
        if arr.size == 0:
            raise DataError(f"sources: query row {q} has no source rows ({src!r}); every query needs at least one "
                            "train row index holding its fact: fix the row or drop it from the targets")
        if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer)
                                 or (np.issubdtype(arr.dtype, np.floating) and np.all(arr == np.round(arr)))):
            raise DataError(f"sources: query row {q} has sources {src!r}; expected a list of 0-based train row "
                            "indices (integers)")
        arr = arr.astype(np.int64)
        bad = arr[(arr < 0) | (arr >= n_train)] if n_train is not None else arr[arr < 0]
        if bad.size:
            limit = f"0..{n_train - 1} (data.train has {n_train} rows)" if n_train is not None else ">= 0"
            raise DataError(f"sources: query row {q} names train row {int(bad[0])}, out of range; source rows are "
                            f"0-based indices of data.train, {limit}")
        out.append(np.unique(arr))
    return out


@dataclass
class Interval:
    """A mean over queries and its bootstrap interval (NaN bounds with fewer than 2 queries)."""

    value: float
    ci_low: float
    ci_high: float

    def to_dict(self) -> dict[str, float | None]:
        return {"value": finite_or_none(self.value), "ci_low": finite_or_none(self.ci_low),
                "ci_high": finite_or_none(self.ci_high)}


@dataclass
class RecallResult:
    """MRR and recall@k of a ranking against known source documents.

    Attributes:
        mrr: mean reciprocal rank of the first source (0 for a query without a source in the top K).
        recall: k -> recall@k, the share of queries with at least one source in the top k.
        source_recall: k -> the mean over queries of the share of their sources in the top k.
        first_rank: ``[n_query]`` int64, 1-based rank of each query's first source; 0: not in the top K.
        n_sources: ``[n_query]`` int64, sources per query.
        n_query, k_max: the ranking's shape ``[n_query, k_max]``.
        n_bootstrap, confidence_level, seed: the bootstrap settings.
    """

    mrr: Interval
    recall: dict[int, Interval]
    source_recall: dict[int, Interval]
    first_rank: np.ndarray
    n_sources: np.ndarray
    n_query: int
    k_max: int
    n_bootstrap: int
    confidence_level: float
    seed: int

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (NaN -> None)."""
        return {
            "mrr": self.mrr.to_dict(),
            "recall": {str(k): v.to_dict() for k, v in self.recall.items()},
            "source_recall": {str(k): v.to_dict() for k, v in self.source_recall.items()},
            "n_query": self.n_query, "k_max": self.k_max, "n_not_found": int((self.first_rank == 0).sum()),
            "confidence_level": self.confidence_level, "n_bootstrap": self.n_bootstrap, "bootstrap_seed": self.seed,
            "first_rank": [int(r) for r in self.first_rank],
        }


def fact_recall(ranked: Any, sources: Sequence[Sequence[int]], ks: Sequence[int] | None = None, *,
                n_train: int | None = None, n_bootstrap: int = 1000, seed: int = 0,
                confidence_level: float = 0.95) -> RecallResult:
    """MRR and recall@k (:class:`RecallResult`) of ranked train rows against each query's known source rows.

    Definitions in the module docstring (recall@k: at least one source in the top k, as in TrackStar's and
    Bergson's fact tracing). ``ranked``: ``[n_query, K]`` integer train row indices per query, best first (e.g.
    the ``proponents`` of ``trak score`` with ``score.top_k: K``), -1 past a query's real ranking (never a
    source); ``sources``: per query the 0-based train rows holding its fact (checked below ``n_train`` unless it
    is None); ``ks``: each in 1..K (None: :func:`default_ks`). Each statistic's interval is a percentile
    bootstrap of its mean over queries (``n_bootstrap`` resamples, 0: none), all with the same ``seed``, hence
    the same resamples of the queries.

    Raises:
        DataError: ``ranked`` not a 2-D integer array, a number of rows other than ``len(sources)``,
            a k outside 1..K, or bad sources (:func:`check_sources`).
    """
    r = np.asarray(ranked)
    if r.ndim != 2 or not (np.issubdtype(r.dtype, np.integer) or r.size == 0):
        raise DataError(f"the ranking has shape {list(r.shape)} and dtype {r.dtype}; expected [n_query, K] integer "
                        "train row indices, best first")
    r = r.astype(np.int64, copy=False)
    n_query, k_max = r.shape
    if len(sources) != n_query:
        raise DataError(f"the ranking has {n_query} query rows but the sources list {len(sources)} queries; give one "
                        "list of source rows per ranked query, in the same order")
    if k_max < 1:
        raise DataError("the ranking has K = 0 rows per query; rank at least one train row per query")
    ks = default_ks(k_max) if ks is None else sorted({int(k) for k in ks})
    bad = [k for k in ks if not 1 <= k <= k_max]
    if bad:
        raise DataError(f"recall@k for k={bad[0]} needs the top {bad[0]} rows per query, but the ranking holds "
                        f"K={k_max}; choose k in 1..{k_max}, or rank more rows (trak score CONFIG "
                        f"score.top_k={max(bad)})")
    src = check_sources(sources, n_train)
    hits = np.zeros(r.shape, dtype=bool)  # whether each ranked row is a source of its query
    for q, s in enumerate(src):
        hits[q] = np.isin(r[q], s)
    first = np.where(hits.any(axis=1), hits.argmax(axis=1) + 1, 0).astype(np.int64)  # 1-based; 0: none ranked
    n_sources = np.array([s.size for s in src], dtype=np.int64)
    rr = np.where(first > 0, 1.0 / np.maximum(first, 1), 0.0)
    found = np.cumsum(hits, axis=1)  # [n_query, K] sources within the top j+1
    args = (n_bootstrap, seed, confidence_level)
    recall = {k: Interval(*mean_interval((found[:, k - 1] > 0).astype(np.float64), *args)) for k in ks}
    source_recall = {k: Interval(*mean_interval(found[:, k - 1] / n_sources, *args)) for k in ks}
    return RecallResult(
        mrr=Interval(*mean_interval(rr, *args)), recall=recall, source_recall=source_recall, first_rank=first,
        n_sources=n_sources, n_query=int(n_query), k_max=int(k_max), n_bootstrap=n_bootstrap,
        confidence_level=confidence_level, seed=seed,
    )


def rank_scores(scores: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` (at most n_train) highest-scoring train rows per target of ``scores`` ``[n_target, n_train]``,
    best first (equal scores by index): ``[n_target, k]`` int64."""
    s = np.asarray(scores, dtype=np.float64)
    k = min(k, s.shape[1])
    order = np.argsort(-s, axis=1, kind="stable")  # ties: lower index first
    return order[:, :k].astype(np.int64)
