"""`trak select` as a library function: choose the training rows that most help a target task.

LESS (Xia et al., ICML 2024, "LESS: Selecting Influential Data for Targeted Instruction Tuning", Eq. 2 and
Sec. 4.1) scores a candidate training row ``z`` against a target task ``D_val`` (a handful of its examples, in
groups, e.g. one per sub-task) by the cosine of projected gradient features, summed over the checkpoints of a
short warmup run, averaged over each group's examples and maximised over the groups; it keeps the top 5% of
the pool. Here, per pool row ``z`` and checkpoint ``m`` of ``M``:

    s_m(t, z) = cos(φ_m(t), φ_m(z))          (``normalize: unit``; else φ_m(t)ᵀφ_m(z))
    s(t, z)   = Σ_m s_m(t, z)
    max_mean: score(z) = max_g (1/|g|) Σ_{t∈g} s(t, z)
    mean:     score(z) = (1/n_target) Σ_t s(t, z)
    sum:      score(z) = Σ_t s(t, z)

φ_m are the stored train features of `trak featurize` (any featurizer, correction or curvature the config sets
up) and the target features computed the same way into ``targets/<select.experiment>``. The mean of cosines is
the inner product with the group's mean unit target feature ``c_{m,g}``, ``(1/|g|) Σ_{t∈g} s_m(t, z) =
⟨c_{m,g}, φ_m(z)/‖φ_m(z)‖⟩``: each pool row costs ``n_groups`` dot products per checkpoint, and the pool is
streamed in row blocks, so memory is O(block · proj_dim + n_train), never ``[n_target, n_train]``.

The ``k`` rows of highest score are kept (equal scores: the lower row index first) and written in the pool's
own format (:func:`~trakcli.jobs.pool_files.write_rows`), in pool order; their scores, ranks (and groups) go
to a sidecar ``<out stem>.scores.jsonl``. ``group_by`` groups the *targets* (a row's score is its best group's,
so a task with few examples is not drowned by one with many) but does not share the kept rows among them:
``quota: equal`` (:func:`quota_rows`) does, the groups taking turns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from trakcli.config import Config
from trakcli.data.load import load_dataset
from trakcli.data.sources import data_files, field_values
from trakcli.errors import ConfigError, DataError, StoreMismatchError
from trakcli.jobs.featurize import featurize
from trakcli.jobs.pool_files import check_out, read_tensors, scores_path, write_rows, write_scores
from trakcli.jobs.runtime import locked_store, torch_threads
from trakcli.jobs.score import check_train_complete, featurize_targets, open_targets, target_attrs
from trakcli.jobs.setup import JobSetup, prepare
from trakcli.progress import NULL_REPORTER, Reporter
from trakcli.store import Store
from trakcli.tasks import resolve_task

#: ``select.fraction`` when neither it nor ``select.count`` is set: LESS keeps 5% of the pool.
DEFAULT_FRACTION = 0.05
#: Bytes of one block of pool features read at once (float64 while scored).
BLOCK_BYTES = 64 << 20


def n_selected(n_train: int, fraction: float | None = None, count: int | None = None) -> int:
    """How many pool rows to keep: ``count`` (``select.count``), or ``round(fraction · n_train)`` (Python's round,
    at least 1; ``fraction`` and ``count`` None: :data:`DEFAULT_FRACTION`).

    Raises:
        ConfigError: both given, ``fraction`` outside (0, 1], or ``count`` not in 1..n_train.
    """
    if fraction is not None and count is not None:
        raise ConfigError(f"select.fraction ({fraction}) and select.count ({count}) are both set: give one")
    if count is not None:
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= n_train:
            raise ConfigError(f"select.count is {count!r} but data.train has {n_train} rows; keep 1 to {n_train} "
                              "rows, or give select.fraction instead")
        return count
    fraction = DEFAULT_FRACTION if fraction is None else fraction
    if not 0 < fraction <= 1:
        raise ConfigError(f"select.fraction is {fraction!r}; give a share of data.train in (0, 1], e.g. 0.05")
    return min(n_train, max(1, round(fraction * n_train)))


def top_rows(scores: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` (``1 <= k <= n``) rows of highest ``scores`` (``[n]`` finite), best first, equal scores in row
    order: ``[k]`` int64 indices, by an O(n) selection then an O(k log k) ordering."""
    n = scores.shape[0]
    if k >= n:
        return np.lexsort((np.arange(n), -scores)).astype(np.int64)
    kth = scores[np.argpartition(-scores, k - 1)[:k]].min()  # the k-th highest value
    above = np.flatnonzero(scores > kth)
    ties = np.flatnonzero(scores == kth)[: k - above.size]  # the lowest indices among the equal ones
    cand = np.concatenate([above, ties])
    return cand[np.lexsort((cand, -scores[cand]))].astype(np.int64)


def target_groups(section: Any, target: Any, group_by: str | None) -> tuple[np.ndarray, list[str]]:
    """Each target's group (``select.group_by``, a field of text data or a key of a tensor file holding ``[n_target]``
    values; None: one group ``"all"``): ``([n_target] int64 group index, group names)`` (:func:`group_codes`).

    Raises:
        DataError: no such field or key (naming the ones there are), rows without it, or a count that is not n_target.
    """
    n = len(target)
    if group_by is None:
        return np.zeros(n, dtype=np.int64), ["all"]
    where = f"select.group_by {group_by!r}"
    if section.text_source is not None:
        values = field_values(section.path, group_by, key="data.target")
        missing = [i for i, v in enumerate(values) if v is None]
        if len(missing) == len(values):
            raise DataError(f"{where}: data.target ({section.path}) has no field {group_by!r}; name a field of its "
                            "rows, or unset select.group_by (one group)")
        if missing:
            raise DataError(f"{where}: data.target rows {missing[:10]} have no {group_by!r} value; give every "
                            "target row its group")
    elif section.builtin is not None or group_by == section.labels:
        if section.builtin is not None and group_by != "labels":
            raise DataError(f"{where}: the built-in dataset's only per-row key is 'labels'")
        values = target.labels.tolist()
    else:
        files = data_files(section.path, key="data.target")
        contents = read_tensors(files[0])
        if group_by not in contents:
            raise DataError(f"{where}: data.target ({section.path}) has no key {group_by!r}; its keys are "
                            f"{sorted(contents)}")
        values = np.asarray(contents[group_by]).reshape(-1).tolist()
    if len(values) != n:
        raise DataError(f"{where}: {len(values)} values for {n} data.target rows; give one per row")
    return group_codes(values)


def group_codes(values: Sequence[Any]) -> tuple[np.ndarray, list[str]]:
    """Group indices of per-target values: ``([n_target] int64, names)``, numbered in order of first appearance,
    names the values as text (strings as they are, other values as JSON)."""
    names: dict[str, int] = {}
    codes = [names.setdefault(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False), len(names))
             for v in values]
    return np.asarray(codes, dtype=np.int64).reshape(-1), list(names)


def group_centroids(features: np.ndarray, groups: np.ndarray, n_groups: int, *, unit: bool,
                    total: bool = False) -> torch.Tensor:
    """The mean (``total``: the sum) of each group's target features ``[n_target, proj_dim]`` (``unit``: each
    divided by its norm first; a zero row counts as cosine 0), by ``groups`` ``[n_target]`` int64:
    ``[n_groups, proj_dim]`` float64, whose inner product with ``ẑ`` is the group's mean cosine with ``z``."""
    f = torch.from_numpy(np.asarray(features, dtype=np.float64))
    if unit:
        f = _unit(f)
    c = torch.zeros(n_groups, f.shape[1], dtype=torch.float64).index_add_(0, torch.from_numpy(groups), f)
    if not total:
        c /= torch.bincount(torch.from_numpy(groups), minlength=n_groups).clamp(min=1)[:, None].double()
    return c


def _unit(f: torch.Tensor) -> torch.Tensor:
    """Rows divided by their norm; zero rows stay zero."""
    norm = f.norm(dim=1, keepdim=True)
    return f / torch.where(norm > 0, norm, torch.ones_like(norm))


def pool_scores(
    train_rows: Sequence[Any], centroids: Sequence[torch.Tensor], *, unit: bool, reporter: Reporter = NULL_REPORTER,
    linalg_threads: int | None = None, per_group: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Every pool row's score against the target groups, ``max_g Σ_m ⟨c_{m,g}, φ̂_m(z)⟩`` (``φ̂``: unit features
    with ``unit``), float64, streamed over ``train_rows``'s stored features in row blocks.

    Args:
        train_rows: per model_id, the complete train features.
        centroids: per model_id, ``[n_groups, proj_dim]`` float64 (:func:`group_centroids`).
        unit, reporter, linalg_threads: unit-normalize the pool rows; block progress; torch threads.
        per_group: every group's score, ``[n_train, n_groups]`` (for :func:`quota_rows`), not the best.

    Returns:
        ``(scores [n_train] float64, best group [n_train] int64)`` (``per_group``: scores ``[n_train, n_groups]``).

    Raises:
        StoreCorruptError: a feature chunk is missing or corrupt.
    """
    first = train_rows[0]
    n, proj_dim, chunk = first.n_rows, centroids[0].shape[1], first.chunk_rows
    block = chunk * max(1, BLOCK_BYTES // (8 * chunk * max(1, proj_dim)))
    scores = np.empty((n, centroids[0].shape[0]) if per_group else n, dtype=np.float64)
    best = np.empty(n, dtype=np.int64)
    starts = range(0, n, block)
    with torch_threads(linalg_threads), reporter.task("select", len(starts)) as task:
        for lo in starts:
            hi = min(lo + block, n)
            acc = torch.zeros(hi - lo, centroids[0].shape[0], dtype=torch.float64)  # [rows, n_groups]
            for rows, c in zip(train_rows, centroids):
                f = torch.from_numpy(np.asarray(rows.read("features", lo, hi), dtype=np.float64))
                acc += (_unit(f) if unit else f) @ c.T
            top, arg = acc.max(dim=1)
            scores[lo:hi], best[lo:hi] = (acc if per_group else top).numpy(), arg.numpy()
            task.advance()
    return scores, best


def check_quota(k: int, n_groups: int) -> None:
    """Refuse ``select.quota: equal`` with fewer kept rows than target groups: ConfigError naming the count
    that works."""
    if k < n_groups:
        raise ConfigError(f"select.quota: equal shares {k} rows among {n_groups} target groups, so some group would "
                          f"keep none; keep at least {n_groups} rows (select.count={n_groups} or more), or unset "
                          "select.quota")


def quota_rows(group_scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``k`` (``n_groups <= k <= n``) rows shared equally among the groups (``select.quota: equal``): the groups
    take turns in index order, each keeping its highest-scoring row (``group_scores`` ``[n, n_groups]``) not yet
    kept, equal scores by lower row index. Every group keeps ``k // n_groups`` rows, the first
    ``k % n_groups`` one more; no row left out scores higher for a group than a row that group kept.

    Returns:
        ``(rows [k] int64, group [k] int64)``: the kept rows in the order taken, and the group that took each.

    Raises:
        ConfigError: ``k`` below the number of groups or above ``n``.
    """
    n, n_groups = group_scores.shape
    check_quota(k, n_groups)
    if k > n:
        raise ConfigError(f"select.count is {k} but data.train has {n} rows; keep 1 to {n} rows")
    share = -(-k // n_groups)  # the most a group keeps; it skips at most k - 1 rows others took
    ranked = [top_rows(group_scores[:, g], min(n, k - 1 + share)).tolist() for g in range(n_groups)]
    taken = np.zeros(n, dtype=bool)
    at = [0] * n_groups
    rows: list[int] = []
    groups: list[int] = []
    while len(rows) < k:
        for g in range(n_groups):
            if len(rows) == k:
                break
            while taken[ranked[g][at[g]]]:
                at[g] += 1
            r = ranked[g][at[g]]
            taken[r] = True
            rows.append(r)
            groups.append(g)
    return np.asarray(rows, dtype=np.int64), np.asarray(groups, dtype=np.int64)


@dataclass
class Selection:
    """The pool's scores and the rows kept.

    Attributes:
        scores: ``[n_train]`` float64, every pool row's score: its best group's (``max_mean``); with
            ``quota`` a kept row's is that of the group that kept it.
        ranked: ``[k]`` int64, the kept rows, best first (equal scores in row order).
        best_group: ``[n_train]`` int64, the group of each row's highest group score (``max_mean``); with
            ``quota`` a kept row's is the group that kept it.
        groups: the target groups' names; group_sizes: targets per group.
        targets_computed: target feature chunks computed in this run.
        quota: ``select.quota`` (``"equal"``) or None.
    """

    scores: np.ndarray
    ranked: np.ndarray
    best_group: np.ndarray
    groups: list[str]
    group_sizes: list[int]
    targets_computed: int = 0
    quota: str | None = None

    @property
    def rows(self) -> np.ndarray:
        """``[k]`` int64, the kept rows in pool order."""
        return np.sort(self.ranked)

    def kept_per_group(self) -> list[int]:
        """Kept rows per target group (by :attr:`best_group`), in the order of :attr:`groups`."""
        return np.bincount(self.best_group[self.ranked], minlength=len(self.groups)).tolist()


def select_rows(
    s: JobSetup, path: Path, target: Any, *, k: int, groups: np.ndarray | None = None,
    group_names: list[str] | None = None, aggregate: str = "max_mean", normalize: str | None = "unit",
    quota: str | None = None, experiment: str = "select", overwrite: bool = False, skip_nonfinite: bool = False,
    reporter: Reporter = NULL_REPORTER, linalg_threads: int | None = None,
) -> Selection | None:
    """:func:`select` on a prepared setup, loaded targets and finished train features (also ``Attributor.select``):
    under the store's lock, featurize the targets into ``targets/<experiment>`` (resumable, checked and repaired
    like `trak score`'s), score the pool (:func:`pool_scores`) and keep ``k`` rows (:func:`top_rows`; ``quota``
    ``"equal"``: :func:`quota_rows`).

    Args:
        s, path, target: the setup, the store, the target examples (of the train data's kind).
        k: rows to keep (:func:`n_selected`).
        groups, group_names: each target's group index ``[n_target]`` int64 and the groups' names
            (:func:`target_groups`); None: one group.
        aggregate, normalize, quota, experiment: ``select:``'s keys (module docstring).
        overwrite, skip_nonfinite: recompute the target features; give non-finite targets zero features.
        reporter, linalg_threads: progress and messages; torch threads of the score products.

    Returns:
        The :class:`Selection` on rank 0; None on the other ranks (under torchrun).

    Raises:
        StoreError: no or incomplete train features; targets of another input kind.
        StoreMismatchError: train features of other settings, or target features of other targets
            (names ``--overwrite`` and ``select.experiment``).
        ConfigError: a bad ``aggregate``, ``normalize`` or ``quota``, ``k`` outside 1..n_train, or with
            ``quota`` fewer than one row per group.
    """
    groups, group_names = _checked_groups(s.layout.n_train, len(target), k, groups, group_names, aggregate,
                                          normalize, quota)
    n_groups = len(group_names)
    shared = quota == "equal" and n_groups > 1
    t_attrs = target_attrs(s, target)  # as `trak score`'s target features (text: any max_length)
    computed = 0
    with locked_store(path, s.dist, reporter):
        store = Store.open_existing(path)
        train_rows = check_train_complete(s, store)
        try:
            if s.dist.is_main:
                if overwrite:
                    store.drop(f"targets/{experiment}")
                target_rows = open_targets(store, s, experiment, t_attrs, len(target), reporter)
            s.dist.barrier()
            if not s.dist.is_main:
                store.distributed = True  # what it misses, rank 0 was to create
                target_rows = open_targets(store, s, experiment, t_attrs, len(target), reporter)
        except StoreMismatchError as e:
            if e.fix is None:
                raise
            raise e.with_fix(replace(e.fix, experiment_key="select.experiment")) from None
        for model_id, rows in enumerate(target_rows):
            computed += featurize_targets(s, store, target, rows, model_id, refine=True, skip_nonfinite=skip_nonfinite,
                                          reporter=reporter, zero="they count as 0")
        s.dist.barrier()
        if not s.dist.is_main:
            return None
        centroids = [group_centroids(rows.read("features", 0, len(target)), groups, n_groups,
                                     unit=normalize == "unit", total=aggregate == "sum") for rows in target_rows]
        scores, best = pool_scores(train_rows, centroids, unit=normalize == "unit", reporter=reporter,
                                   linalg_threads=linalg_threads, per_group=shared)
    sizes = np.bincount(groups, minlength=len(group_names)).tolist()
    if not shared:
        return Selection(scores, top_rows(scores, k), best, list(group_names), sizes, computed, quota)
    kept, by = quota_rows(scores, k)
    best_scores = scores[np.arange(scores.shape[0]), best]
    best_scores[kept], best[kept] = scores[kept, by], by  # a kept row: the score of the group that kept it
    ranked = kept[np.lexsort((kept, -best_scores[kept]))]
    return Selection(best_scores, ranked, best, list(group_names), sizes, computed, quota)


def _checked_groups(n_train: int, n_target: int, k: int, groups: np.ndarray | None, names: list[str] | None,
                    aggregate: str, normalize: str | None, quota: str | None) -> tuple[np.ndarray, list[str]]:
    """:func:`select_rows`'s arguments checked before any feature is computed (its ConfigErrors): each target's
    group ``[n_target]`` int64 (one group unless ``max_mean``) and the groups' names."""
    if aggregate not in ("max_mean", "mean", "sum"):
        raise ConfigError(f"select.aggregate is {aggregate!r}; use max_mean, mean or sum")
    if quota not in (None, "equal"):
        raise ConfigError(f"select.quota is {quota!r}; use equal (every target group its share) or null")
    if normalize not in (None, "unit"):
        raise ConfigError(f"select.normalize is {normalize!r}; use unit (cosines) or null (inner products)")
    n_selected(n_train, count=k)
    if groups is None or aggregate != "max_mean":
        groups, names = np.zeros(n_target, dtype=np.int64), ["all"]
    groups = np.asarray(groups, dtype=np.int64)
    if groups.shape != (n_target,) or groups.min() < 0:
        raise ConfigError(f"groups: give one group index >= 0 per target ({n_target}), got shape "
                          f"{list(groups.shape)}")
    names = names or [str(g) for g in range(int(groups.max()) + 1)]
    if quota == "equal" and len(names) > 1:
        check_quota(k, len(names))
    return groups, names


@dataclass
class SelectResult:
    """What a select run did and chose.

    Attributes:
        store: the store path; out: the selected rows' file; scores_out: their scores (:func:`~trakcli.jobs.pool_files.scores_path`).
        n_train, n_target: pool rows and target examples.
        selection: the scores and the kept rows (:class:`Selection`).
        aggregate, normalize: ``select.aggregate`` and ``select.normalize``.
        n_models: checkpoints summed over.
        train_chunks_computed: train feature chunks computed by this run (0: all reused from the store).
        texts: short renderings of the ``select.show`` best rows (text data), else None.
    """

    store: Path
    out: Path
    scores_out: Path
    n_train: int
    n_target: int
    selection: Selection
    aggregate: str
    normalize: str | None
    n_models: int
    train_chunks_computed: int = 0
    texts: list[str] | None = None
    notes: list[str] = field(default_factory=list)


def select(cfg: Config, *, overwrite: bool = False, skip_nonfinite: bool = False, verify: bool = False,
           reporter: Reporter = NULL_REPORTER) -> SelectResult | None:
    """Score every data.train row against the data.target task and write the best ``select.fraction`` / ``count``.

    Train features come from the store: missing or unfinished ones are computed first by
    :func:`trakcli.jobs.featurize.featurize` (resumable; without TRAK's kernels, which `trak score` makes), finished
    ones are reused. Target features go to ``targets/<select.experiment>``, then the pool is scored in one
    streamed pass (:func:`select_rows`; formulas in the module docstring) and the rows are written
    (:func:`~trakcli.jobs.pool_files.write_rows`, :func:`~trakcli.jobs.pool_files.write_scores`). A rerun recomputes nothing but the cheap selection.

    Args:
        cfg: the config; ``data.target`` (the task's examples) and ``select.out`` are required.
        overwrite: recompute the target features (the train features are `trak featurize --overwrite`'s).
        skip_nonfinite: give rows with non-finite gradients zero features (score 0) instead of stopping.
        verify: rehash the checkpoints and check every stored train chunk (recomputing damaged ones).
        reporter: progress bars and messages.

    Returns:
        :class:`SelectResult` on rank 0; None on the other ranks (under torchrun).

    Raises:
        ConfigError: ``select.out`` unset, unwritable or not of the pool's format; ``select.count`` above n_train.
        DataError: ``select.group_by`` names no field or key of data.target; unreadable data.
        StoreMismatchError: the store was featurized with other settings, or ``select.experiment`` holds the
            features of other targets.
        As :func:`trakcli.jobs.featurize.featurize` otherwise.
    """
    sc = cfg.select
    out = check_out(cfg.data.train, sc.out)
    s = prepare(cfg, need_target=True, rehash=verify, reporter=reporter)
    k = n_selected(len(s.train), sc.fraction, sc.count)
    target = load_dataset(cfg.data.target, key="data.target", task=resolve_task(cfg.task))  # type: ignore[arg-type]  # checked by prepare
    groups, names = target_groups(cfg.data.target, target, sc.group_by)
    if sc.quota is not None and len(names) > 1:
        check_quota(k, len(names))  # before the train features are computed
    path = cfg.store.location
    computed = featurize(cfg, skip_nonfinite=skip_nonfinite, verify=verify, reporter=reporter, setup=s,
                         kernels=False).chunks_computed  # selection reads no kernel; `trak score` makes its own
    if computed == 0 and not verify:
        reporter.info(f"train features of {len(s.checkpoints)} checkpoints x {len(s.train)} rows: reused from {path}")
    if s.curvature is not None and s.exact_damping is not None:
        reporter.info("curvature.exact: select ranks by the stored features (as curvature.exact: false)")
    sel = select_rows(s, path, target, k=k, groups=groups, group_names=names, aggregate=sc.aggregate,
                      normalize=sc.normalize, quota=sc.quota, experiment=sc.experiment, overwrite=overwrite,
                      skip_nonfinite=skip_nonfinite, reporter=reporter, linalg_threads=cfg.linalg_threads)
    if sel is None:
        return None
    try:
        write_rows(cfg.data.train, sel.rows, out)
        write_scores(scores_path(out), sel)
    except OSError as e:
        raise ConfigError(f"select.out {out}: cannot write it ({e.strerror or e}); choose another path (the "
                          "features are in the store: the rerun only selects)") from None
    texts = None
    if sc.show and callable(getattr(s.train, "texts", None)):
        texts = s.train.texts(sel.ranked[: sc.show].tolist(), max_chars=200)
    return SelectResult(path, out, scores_path(out), len(s.train), len(target), sel, sc.aggregate, sc.normalize,
                        len(s.checkpoints), computed, texts)
