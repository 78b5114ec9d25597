"""`trak score` as a library function: target features, per-checkpoint kernels, the ensembled score matrix.

Formula: Park et al. 2023 ("TRAK: Attributing Model Behavior at Scale", Eq. 17), as written in :mod:`trakcli.scoring`.
Under ``torchrun`` each process computes the chunks of its rank; rank 0 holds the store's lock and writes attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from trakcli.config import Config
from trakcli.data.load import check_target_inputs, load_dataset
from trakcli.data.tensors import TensorDataset
from trakcli.distributed import Dist
from trakcli.errors import ConfigError, StoreError
from trakcli.jobs.exact import exact_scorer, two_stage_exact
from trakcli.jobs.featurize import featurize_rows
from trakcli.jobs.per_token import PerTokenScores, check_per_token, per_token_arrays, per_token_width
from trakcli.jobs.plan import RunFlags, ScorePlan
from trakcli.jobs.kernels import finalize_kernels, kernel_of, report_notes
from trakcli.jobs.runtime import ChunkWriter, event, grad_memory_for, locked_store, torch_threads
from trakcli.jobs.setup import JobSetup, prepare
from trakcli.progress import NULL_REPORTER, Reporter
from trakcli.scoring import DUAL, kernel_form
from trakcli.store import ChunkedRows, Store, StoreCorruptError, check_same
from trakcli.store.append import stale_error
from trakcli.store.curvature import drop_exact_rows
from trakcli.store.kernel import kernel_nbytes, read_kernel
from trakcli.store.quantize import is_quantized
from trakcli.tasks import resolve_task
from trakcli.topk import TOP_K_ARRAYS, StoredTopK, TwoStage
from trakcli.topk.features import FeatureScores
from trakcli.topk.plan import scan_has_floor


@dataclass
class ScoreResult:
    """Scores of one experiment, in the store.

    Attributes:
        store: the store path; experiment: the experiment name.
        n_target, n_train: the score matrix shape.
        lambdas: the ridge λ_m used per checkpoint.
        train_labels, target_labels: ``[n_train]``, ``[n_target]`` labels (for display); ``train_labels`` is
            None when the train rows were not read (their file is gone: :class:`~trakcli.data.stored.StoredRows`).
        chunks_computed: target and score chunks computed in this run.
        notes: messages for the user.
        top_k: K of the stored top-k arrays (``score.top_k``, at most n_train), or None.
        full: whether the full score matrix is in the store.
        per_token: whether the per-token scores of the top-k are in the store (``score.per_token``).
        train_data, target_data: the datasets the run read (``train_data`` a
            :class:`~trakcli.data.stored.StoredRows` when the train file is gone), or None.
        two_stage: for a two-stage top-k (``store.dtype`` int8 or binary, :mod:`trakcli.topk`): its
            settings (``codes``, ``rescore_multiplier``, ``recall_queries``), ``k``, ``n_queries``, the
            fraction of train rows the recall was measured over (``rows_measured``; 1.0: exact) and the
            measured ``recall`` ``{"proponents": r, "opponents": r}`` (recall@k against the exact top-k of the
            sampled targets, :meth:`trakcli.topk.StoredTopK.recall`); else None.
    """

    store: Path
    experiment: str
    n_target: int
    n_train: int
    lambdas: list[float]
    train_labels: np.ndarray | None
    target_labels: np.ndarray
    chunks_computed: int = 0
    notes: list[str] = field(default_factory=list)
    top_k: int | None = None
    full: bool = True
    per_token: bool = False
    two_stage: dict[str, Any] | None = None
    train_data: Any = field(default=None, repr=False)
    target_data: Any = field(default=None, repr=False)

    def top(self, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
        """Targets ``[lo, hi)`` of the top-k arrays (chunks checked).

        Returns:
            ``proponents`` / ``opponents``: ``[rows, K]`` int64 train indices, best first
            (highest / lowest score; equal scores by index); ``proponent_scores`` /
            ``opponent_scores``: ``[rows, K]`` float32.

        Raises:
            StoreError: the experiment has no top-k (``score.top_k`` unset).
            StoreCorruptError: a chunk is missing or corrupt (names ``trak score CONFIG``).
        """
        return self._read("top_k", TOP_K_ARRAYS, lo, hi)

    def tokens(self, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
        """Targets ``[lo, hi)`` of the per-token scores (``score.per_token``, :mod:`trakcli.jobs.per_token`).

        Returns:
            ``target_tokens`` / ``document_tokens``: ``[rows, 2, K, width]`` float32 (side 0 the proponents,
            1 the opponents, in top-k order; NaN where a token is not a target).

        Raises:
            StoreError: the experiment has no per-token scores.
            StoreCorruptError: a chunk is missing or corrupt (names ``trak score CONFIG``).
        """
        if not self.per_token:
            raise StoreError(f"experiment {self.experiment!r} has no per-token scores; score it with "
                             "score.per_token: true")
        return self._read("per_token", ("target_tokens", "document_tokens"), lo, hi)

    def _read(self, group: str, names: Any, lo: int, hi: int | None) -> dict[str, np.ndarray]:
        store = Store.open_existing(self.store, mode="r")
        hi = self.n_target if hi is None else min(hi, self.n_target)
        return {name: store.read(f"scores/{self.experiment}/{group}/{name}", lo, hi) for name in names}

    def head(self, n: int) -> np.ndarray:
        """The first ``n`` target rows of the full score matrix, ``[n, n_train]`` float32 (chunks checked).

        Raises:
            StoreCorruptError: a chunk is missing or corrupt (names ``trak score CONFIG``).
        """
        return self.rows(0, min(n, self.n_target))

    def rows(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Targets ``[lo, hi)`` of the full score matrix, ``[rows, n_train]`` float32 (chunks checked).

        Raises:
            StoreCorruptError: a chunk is missing or corrupt (names ``trak score CONFIG``).
        """
        return Store.open_existing(self.store, mode="r").read(f"scores/{self.experiment}/scores", lo, hi)

    @property
    def scores(self) -> np.ndarray:
        """All scores ``[n_target, n_train]`` float32, read into memory (chunks checked)."""
        return self.rows()


def check_train_complete(s: JobSetup, store: Store) -> list[ChunkedRows]:
    """The complete train rows of every checkpoint, after checking the store was featurized with this setup.

    Raises:
        StoreError: no train features, or missing or incomplete ones (run featurize).
        StoreMismatchError: the store was featurized with other settings.
    """
    if not store.identity:  # made by `trak eval` (retrained models only)
        raise StoreError(f"the store {store.path} holds no train features yet; run `trak featurize CONFIG` first")
    check_same(f"the train features in {store.path}", store.identity, s.identity,
               "score with the config that featurized the store, or rerun `trak featurize CONFIG --overwrite`")
    have = store.model_ids()
    missing = [m for m in range(len(s.checkpoints)) if m not in have]
    if missing:
        raise StoreError(f"the store has no train features for model_ids {missing} (the config lists "
                         f"{len(s.checkpoints)} checkpoints, the store has model_ids {have}); "
                         "run `trak featurize CONFIG` first")
    rows_all = []
    for model_id, ckpt in enumerate(s.checkpoints):
        rows = store.train(model_id, str(ckpt), s.shas[model_id], create=False,
                           optimizer_state=s.state_record(model_id))
        if not rows.is_complete():
            done = int((rows.flags() != 0).sum())
            raise StoreError(f"train features of model_id {model_id} ({ckpt}) are incomplete ({done}/{rows.n_chunks} "
                             "chunks); run `trak featurize CONFIG` to finish them")
        rows_all.append(rows)
    return rows_all


def _verify_train(train_rows: list[ChunkedRows]) -> None:
    """Read every chunk of the train features (``score --verify``); StoreCorruptError naming the repair on damage."""
    for model_id, rows in enumerate(train_rows):
        bad = rows.check()
        if bad:
            raise StoreCorruptError(f"train features of model_id {model_id} ({rows.path}): chunks {bad} are missing or "
                                    "corrupt; run `trak featurize CONFIG --verify` to recompute them, then score again",
                                    rows.path, bad)


def score(cfg: Config, *, overwrite: bool = False, skip_nonfinite: bool = False, verify: bool = False,
          reporter: Reporter = NULL_REPORTER) -> ScoreResult:
    """Featurize the targets, finalize each checkpoint's kernel and write the ensembled scores.

    Formula: :mod:`trakcli.scoring` (Park et al. 2023, Eq. 17). Train features are streamed from the store one column
    block (``chunk_rows`` train rows) at a time, so memory is O(n_target·proj_dim + chunk_rows·proj_dim + proj_dim² +
    n_target·chunk_rows), never n_train·n_target.

    Args:
        cfg: config; ``data.target`` is required. ``score:`` gives the
            experiment and the ridge (one :class:`~trakcli.jobs.plan.ScorePlan`).
        overwrite, skip_nonfinite, verify: the run's :class:`~trakcli.jobs.plan.RunFlags`.
        reporter: progress bars and messages.

    Derived data is verified on every run: target features and score chunks that are missing or fail their checksum, and
    a corrupt kernel, are recomputed (one info line each). With ``verify`` every chunk of the train features is read
    too; a damaged one stops the run naming ``trak featurize CONFIG --verify``.

    Returns:
        :class:`ScoreResult`; the ``[n_target, n_train]`` float32 scores are in the store.

    Raises:
        StoreError: no train features yet, or incomplete ones (run featurize); store in use;
            targets of another input shape than the train inputs.
        StoreMismatchError: train features made with other settings or checkpoints.
        StoreCorruptError: damaged train features (names ``trak featurize CONFIG --verify``).
        StoreStaleError: the experiment was scored before train rows were appended, and ``overwrite``
            is not set (names ``trak score CONFIG --overwrite``).
    """
    if cfg.score.method == "unroll":  # metagradients of the recorded trainings: no features
        from trakcli.jobs.unroll import unroll_score

        return unroll_score(cfg, overwrite=overwrite, reporter=reporter)
    s = prepare(cfg, need_target=True, rehash=verify, reporter=reporter, train_from_store=True)
    plan = ScorePlan.of(cfg.score, linalg_threads=cfg.linalg_threads,
                        grad_memory_mb=grad_memory_for(cfg.data.grad_memory_mb, s.device))
    path = cfg.store.location
    target = load_dataset(cfg.data.target, key="data.target", task=resolve_task(cfg.task))  # type: ignore[arg-type]  # checked by check_files
    lambdas, computed = score_targets(s, path, target, plan, RunFlags(overwrite, skip_nonfinite, verify), reporter)
    return score_result(path, plan, s.train, target, lambdas, computed)


def score_result(path: Path, plan: ScorePlan, train: Any, target: Any, lambdas: list[float],
                 computed: int) -> ScoreResult:
    """The :class:`ScoreResult` of an experiment just scored (``train`` may be a
    :class:`~trakcli.data.stored.StoredRows`)."""
    two_stage = None  # the two-stage record of the top-k (settings and measured recall)
    if plan.top_k:
        top = StoredTopK(Store.open_existing(path, mode="r"), plan.experiment, len(target), plan.top_k, create=False)
        two_stage = top.recorded_recall()
    return ScoreResult(
        store=path, experiment=plan.experiment, n_target=len(target), n_train=len(train), lambdas=lambdas,
        train_labels=None if train.labels is None else train.labels.numpy(), target_labels=target.labels.numpy(),
        train_data=train, target_data=target, chunks_computed=computed, two_stage=two_stage,
        top_k=None if plan.top_k is None else min(plan.top_k, len(train)), full=plan.full, per_token=plan.per_token)


def score_targets(s: JobSetup, path: Path, target: TensorDataset, plan: ScorePlan, flags: RunFlags = RunFlags(),
                  reporter: Reporter = NULL_REPORTER) -> tuple[list[float], int]:
    """:func:`score` on a prepared setup and loaded targets (also :class:`trakcli.Attributor`'s): under the store's
    lock, check the train features (:func:`check_train_complete`) and repair derived data, featurize the targets
    into ``targets/<experiment>``, then :func:`finalize_and_score` into ``scores/<experiment>``.

    Returns:
        (λ_m per model_id, target and score chunks computed by this process).

    Raises:
        As :func:`score`; ConfigError: ``score.normalize: unit`` with exact curvature scores.
    """
    plan = plan.for_setup(s)
    t_attrs = target_attrs(s, target)
    settings = plan.settings(t_attrs)
    if plan.exact and plan.unit:
        raise ConfigError("score.normalize: unit ranks by cosines of the stored features; with curvature.exact "
                          "the scores are exact inner products: set curvature.exact: false, or score.normalize: null")
    if plan.per_token:
        check_per_token(s, normalize=plan.normalize)
    with locked_store(path, s.dist, reporter):
        store = Store.open_existing(path)
        train_rows = check_train_complete(s, store)
        stale = stale_error(store, plan.experiment)  # scored before train rows were appended
        if stale is not None and not flags.overwrite:
            raise stale
        two = None if plan.exact_two_stage else _two_stage_plan(
            store, s, plan, len(target), reporter if s.dist.is_main else NULL_REPORTER)
        if two is not None:  # the experiment's top-k depends on them: recorded and checked with the settings
            settings["two_stage"] = two.settings()
        targets, out, top = _open_arrays(store, s, plan, flags, settings, t_attrs, len(target), two,
                                         stale is not None, train_rows, reporter)
        kept, kernels, computed = _featurize_targets(s, store, plan, target, targets, flags, reporter)
        s.dist.barrier()
        exact = (lambda: exact_scorer(s, store, target, plan.grad_memory_mb, reporter, plan.experiment)) \
            if plan.exact else None
        lambdas, n = finalize_and_score(store, train_rows, targets, out, plan, top=top, dist=s.dist, reporter=reporter,
                                        target_chunks=kept, kernels=kernels, exact=exact)
        computed += n
        if plan.exact and s.dist.is_main:  # every rank is done: the exact blocks' saved progress is not needed
            drop_exact_rows(store, plan.experiment)
        if plan.per_token and s.dist.is_main:
            computed += _per_token_scores(s, store, train_rows, target, plan, reporter)
        s.dist.barrier()
    return lambdas, computed


def target_attrs(s: JobSetup, target: TensorDataset) -> dict[str, Any]:
    """What the target features depend on (recorded with them): the target data, the checkpoints and, where the
    setup has them, the optimizer states and the curvature solve's refinement.

    Raises:
        StoreError: targets of another kind than the train inputs (:func:`trakcli.data.load.check_target_inputs`).
    """
    t_fp = target.fingerprint()
    check_target_inputs(t_fp, s.identity["train_data"])  # token data: any length; other data: the train's shape
    t_attrs = {"target_data": t_fp, "checkpoints": s.shas}
    if s.state_shas is not None:  # target features carry the correction too
        t_attrs["optimizer_states"] = s.state_shas
    if s.refine is not None and s.refine.spec() is not None:  # and the refinement of their curvature solve
        t_attrs["curvature_refine"] = s.refine.spec()
    return t_attrs


def _open_arrays(store: Store, s: JobSetup, plan: ScorePlan, flags: RunFlags, settings: dict[str, Any],
                 t_attrs: dict[str, Any], n_target: int, two: TwoStage | None, stale: bool,
                 train_rows: list[ChunkedRows], reporter: Reporter
                 ) -> tuple[list[ChunkedRows], ChunkedRows | None, StoredTopK | None]:
    """The experiment's target features, score matrix (``score.full``) and top-k (``score.top_k``): created,
    checked and repaired on rank 0 (one info line per repair), then opened on the other ranks."""
    exp = plan.experiment
    if s.dist.is_main:
        if flags.verify:
            _verify_train(train_rows)
        if flags.overwrite:
            if not stale:  # a stale experiment's target features depend on the checkpoints only: kept
                store.drop(f"targets/{exp}")
            store.drop(f"scores/{exp}")
        targets = open_targets(store, s, exp, t_attrs, n_target, reporter)
        if plan.full:  # records or checks the experiment's settings with the matrix
            out = _verified(store.scores(exp, n_target, settings, repair=True), reporter, "score column blocks")
        else:
            out = None
            store.score_settings(exp, settings, repair=True)
        top = _verified(StoredTopK(store, exp, n_target, plan.top_k, create=True, two_stage=two), reporter,
                        "top-k target chunks") if plan.top_k else None
        report_notes(store, reporter)
    s.dist.barrier()
    if not s.dist.is_main:  # opened after rank 0 has created or repaired them
        store.distributed = True
        targets = open_targets(store, s, exp, t_attrs, n_target, reporter)
        out = store.scores(exp, n_target, settings, create=False) if plan.full else None
        top = StoredTopK(store, exp, n_target, plan.top_k, create=False, two_stage=two) if plan.top_k else None
    return targets, out, top


def open_targets(store: Store, s: JobSetup, exp: str, t_attrs: dict[str, Any], n_target: int,
                 reporter: Reporter) -> list[ChunkedRows]:
    """Per model_id the target features ``targets/<exp>``: on rank 0 created, or checked and their damaged
    chunks marked to recompute (one info line each); on the other ranks (after rank 0's) opened."""
    if not s.dist.is_main:
        return [store.targets(exp, m, t_attrs, n_target, create=False) for m in range(len(s.checkpoints))]
    return [_verified(store.targets(exp, m, t_attrs, n_target, repair=True), reporter,
                      f"model {m}: target feature chunks") for m in range(len(s.checkpoints))]


def _verified(arrays: Any, reporter: Reporter, what: str) -> Any:
    """``arrays`` after their :meth:`verify`, which marks missing or corrupt chunks to recompute (an info line
    names them, ``what``)."""
    bad = arrays.verify()
    if bad:
        reporter.info(f"{what} {bad} were missing or corrupt; recomputed")
    return arrays


def featurize_targets(s: JobSetup, store: Store, target: TensorDataset, rows: ChunkedRows, model_id: int, *,
                      refine: bool, skip_nonfinite: bool, reporter: Reporter, zero: str, **kw: Any) -> int:
    """:func:`~trakcli.jobs.featurize.featurize_rows` of one checkpoint's pending target features, whitened by
    the train side's curvature (with ``refine``, its solve refined); targets skipped as non-finite are reported
    (``zero``: what that makes them). Returns the chunks computed."""
    if s.curvature is not None and rows.pending(s.dist.rank, s.dist.world_size):
        s.curvature.read(store, model_id)
        if refine:
            s.refine_targets()
    n, skip = featurize_rows(s, target, rows, model_id, with_out_to_loss=False, skip_nonfinite=skip_nonfinite,
                             reporter=reporter, label="targets", **kw)
    if skip:
        reporter.info(f"model {model_id}: targets {skip[:10]} have non-finite gradients; {zero}")
    return n


def _featurize_targets(s: JobSetup, store: Store, plan: ScorePlan, target: TensorDataset, target_rows: list[ChunkedRows],
                       flags: RunFlags, reporter: Reporter
                       ) -> tuple[list[dict[int, np.ndarray]], dict[int, tuple[torch.Tensor, float]], int]:
    """The pending target features of every checkpoint, written (and the stored kernels read) in the background
    while the next checkpoint's are computed; none for exact scores without a two-stage top-k (they never read
    them). Returns (per model_id the chunks written, kept for the scores; the kernels read ahead; chunks computed)."""
    kept: list[dict[int, np.ndarray]] = []
    kernels: dict[int, tuple[torch.Tensor, float]] = {}
    prefetch = (s.dist.world_size == 1 and not plan.curvature
                and sum(kernel_nbytes(store, m) for m in range(len(target_rows))) <= PREFETCH_BYTES)
    computed = 0
    if plan.exact and not plan.exact_two_stage:  # exact influence takes the targets' own layer gradients instead
        return [{} for _ in target_rows], kernels, computed
    with ChunkWriter() as writer:
        for model_id, rows in enumerate(target_rows):
            kept.append({})
            computed += featurize_targets(  # exact scores refine their own solves (trakcli.jobs.exact)
                s, store, target, rows, model_id, refine=not plan.exact, skip_nonfinite=flags.skip_nonfinite,
                reporter=reporter, zero="their scores are 0", keep=kept[-1], writer=writer)
            if prefetch:
                writer.submit(_prefetch_kernel, store, model_id, plan.ridge(), kernels)
    return kept, kernels, computed


def _two_stage_plan(store: Store, s: JobSetup, plan: ScorePlan, n_target: int, reporter: Reporter) -> TwoStage | None:
    """The two-stage top-k of this run (:mod:`trakcli.topk`) when the store has codes (``store.dtype`` int8 or
    binary) and the top-k is streamed with TRAK's scores and primal kernels; else None, with an info line why on a
    store with codes."""
    codes, layout = store.layout.dtype, store.layout
    if not plan.top_k or not is_quantized(codes):
        return None
    dual = not plan.curvature and kernel_form(layout.n_train, layout.proj_dim) == DUAL
    why = ("score.full is set: the top-k is ranked from the full score matrix" if plan.full else
           "score.normalize unit ranks by cosines, which the codes do not approximate" if plan.unit else
           "curvature.exact recomputes the scores exactly" if plan.exact else
           f"n_train {layout.n_train} < proj_dim {layout.proj_dim}: the dual kernel scores every "
           "row in one product" if dual else
           f"{layout.n_train} rows are too few for the one-pass scan's sampled floor, and the plain pass is "
           "faster here; score.rerank: scan forces it" if plan.rerank == "auto" and not scan_has_floor(
               plan.rescore_multiplier, codes, n_target, plan.top_k, layout.n_train, layout.chunk_rows,
               layout.proj_dim) else None)
    if why is not None:
        reporter.info(f"two-stage top-k not used ({why}); the top-k comes from the exact pass over the bfloat16 copy")
        return None
    return TwoStage.of(codes, plan.rescore_multiplier, plan.recall_queries, n_target, plan.top_k, plan.rerank)


def _per_token_scores(s: JobSetup, store: Store, train_rows: list[ChunkedRows], target: TensorDataset,
                      plan: ScorePlan, reporter: Reporter) -> int:
    """Compute the pending chunks of the experiment's per-token scores (:mod:`trakcli.jobs.per_token`); returns them."""
    exp, top_k = plan.experiment, plan.top_k
    k = min(top_k, len(s.train))
    width = per_token_width(s, target)
    arrays = _verified(per_token_arrays(store, exp, len(target), k, width, create=True, repair=True), reporter,
                       "per-token chunks")
    pending = arrays.pending()
    if not pending:
        return 0
    top = StoredTopK(store, exp, len(target), top_k, create=False)
    scorer = PerTokenScores(s, store, train_rows, target, k, width, plan.ridge(), plan.exact_damping)
    for chunk in pending:
        lo, hi = arrays.rows(chunk)
        arrays.write(chunk, **scorer.compute(lo, hi, top.read(lo, hi), reporter))
    return len(pending)


def finalize_and_score(
    store: Store, train_rows: list[ChunkedRows], target_rows: list[ChunkedRows], out: ChunkedRows | None,
    plan: ScorePlan, *, top: StoredTopK | None = None, dist: Dist | None = None, reporter: Reporter = NULL_REPORTER,
    target_chunks: list[dict[int, np.ndarray]] | None = None,
    kernels: dict[int, tuple[torch.Tensor, float]] | None = None,
    exact: Callable[[], Callable[[int, int], torch.Tensor]] | None = None,
) -> tuple[list[float], int]:
    """Finalize each checkpoint's kernel and write the pending score blocks (and the top-k).

    Kernels (:func:`trakcli.jobs.kernels.kernel_of`, normally made by `trak featurize`) are made by rank
    ``m mod world_size`` and stored (a single process makes a missing one where it is used): the float64
    Cholesky factor of ``Φ_mᵀΦ_m + λ_m I`` ``[proj_dim, proj_dim]`` (:data:`~trakcli.scoring.PRIMAL`), or when
    ``n_train < proj_dim`` the float32 ``X_m = (Φ_mΦ_mᵀ + λ_m I)⁻¹Φ_m`` ``[n_train, proj_dim]``
    (:data:`~trakcli.scoring.DUAL`). Scores are computed one block of ``chunk_rows`` train columns at a time,
    ``[(1/M) Σ_m W_m Φ_m[block]ᵀ] ⊙ [(1/M) Σ_m Q_m[block]]`` with ``W_m = Φ_m(targets) A_m``
    (:class:`~trakcli.topk.features.FeatureScores`); with ``plan.normalize`` ``"unit"`` the mean of the cosines
    (TrackStar, no Q); with ``plan.curvature`` no kernel (features already whitened, λ_m reported as 0). With
    ``top`` the K highest and lowest scores per target are found in one streamed pass (:mod:`trakcli.topk`),
    from the finished matrix when ``out`` is given. A rank with no pending block computes no weights.

    Args:
        store: the open store.
        train_rows, target_rows: per model_id, complete train and target features.
        out: the experiment's scores array (chunked by train columns), or None (top-k only).
        plan: the ridge, normalization, threads and curvature of the scores.
        top: the experiment's top-k (``score.top_k``), or None.
        dist: the process group (default: a single process).
        reporter: progress of the score blocks.
        target_chunks: per model_id, target feature chunks just written (chunk -> ``[rows, proj_dim]`` float32),
            used instead of reading them back.
        kernels: stored kernels already read and verified (model_id -> (kernel, λ)).
        exact: makes the exact scorer ``(lo, hi) -> [n_target, hi - lo]``
            (:func:`trakcli.jobs.exact.exact_scorer`), called once when a block is pending; with ``top`` and
            ``plan.exact_two_stage`` the top-k is instead :func:`trakcli.jobs.exact.two_stage_exact`'s, on rank 0.

    Returns:
        (λ_m per model_id, score blocks computed by this process).

    Raises:
        StoreError: a kernel another rank should have written is missing.
        TrakError: a kernel is not positive definite (see :func:`trakcli.scoring.kernel_factor`).
    """
    with torch_threads(plan.linalg_threads):
        return _finalize_and_score(store, train_rows, target_rows, out, plan, dist or Dist(), reporter,
                                   target_chunks or [{} for _ in target_rows], kernels or {}, top, exact)


#: `trak score` reads the stored kernels in the background, during the target features, when
#: all of them together take at most this many bytes (they are then in memory at once).
PREFETCH_BYTES = 1 << 30


def _prefetch_kernel(store: Store, model_id: int, settings: dict, out: dict[int, tuple[torch.Tensor, float]]) -> None:
    """Read and verify ``model_id``'s stored kernel into ``out`` (a background task); anything short of a sound
    kernel is left to :func:`~trakcli.jobs.kernels.kernel_of` in the main thread."""
    try:
        stored = read_kernel(store, model_id, settings)
    except Exception:  # noqa: BLE001  # corrupt or unreadable: handled (and reported) by kernel_of
        return
    if stored is not None:
        out[model_id] = (torch.from_numpy(stored[0]), stored[1])


def _target_features(rows: ChunkedRows, kept: dict[int, np.ndarray]) -> torch.Tensor:
    """One checkpoint's target features ``[n_target, proj_dim]`` float32: chunks taken out of ``kept``, the rest read."""
    parts = [kept.pop(c) if c in kept else rows.read("features", *rows.rows(c)) for c in range(rows.n_chunks)]
    return torch.from_numpy(np.concatenate(parts).astype(np.float32, copy=False))


def _finalize_and_score(
    store: Store, train_rows: list[ChunkedRows], target_rows: list[ChunkedRows], out: ChunkedRows | None,
    plan: ScorePlan, dist: Dist, reporter: Reporter, kept: list[dict[int, np.ndarray]],
    kernels: dict[int, tuple[torch.Tensor, float]], top: StoredTopK | None,
    exact: Callable[[], Callable[[int, int], torch.Tensor]] | None,
) -> tuple[list[float], int]:
    """:func:`finalize_and_score` in its thread setting."""
    n_models = len(train_rows)
    if exact is not None and plan.exact_two_stage and top is not None:
        return [0.0] * n_models, _exact_two_stage(store, train_rows, target_rows, kept, top, dist, reporter,
                                                  exact, plan.exact_two_stage)
    lam_key = plan.ridge()
    if dist.world_size > 1 and not plan.curvature:  # kernel m on rank m mod world_size, then every rank reads them all
        finalize_kernels(store, train_rows, lambda_reg=plan.lambda_reg, lambda_rel=plan.lambda_rel, dist=dist,
                          reporter=reporter)
    pending = out.pending(dist.rank, dist.world_size) if out is not None else []
    parts = cands = None
    if top is not None and not top.is_complete():
        two_stage = top.two_stage is not None
        if dist.is_main:
            parts = top.parts(create=True)
            cands = top.candidate_parts(create=True) if two_stage else None
        dist.barrier()
        if not dist.is_main:
            parts = top.parts(create=False)
            cands = top.candidate_parts(create=False) if two_stage else None
    segs = parts.pending(dist.rank, dist.world_size) if parts is not None and out is None else []
    scorer: Any = FeatureScores(train_rows, plan.unit)
    if exact is not None and (pending or segs):
        scorer = exact()
    lambdas = []
    for model_id in range(n_models):
        if plan.curvature:
            kernel, lam = None, 0.0
        elif model_id in kernels:
            kernel, lam = kernels.pop(model_id)
        elif dist.world_size == 1:  # one process: a missing kernel is made here
            kernel, lam = kernel_of(store, train_rows[model_id], model_id, lambda_reg=plan.lambda_reg,
                                    lambda_rel=plan.lambda_rel)
        else:
            stored = read_kernel(store, model_id, lam_key)
            if stored is None:
                raise StoreError(f"the kernel of model_id {model_id} is missing; rerun the same command")
            kernel, lam = torch.from_numpy(stored[0]), stored[1]
        lambdas.append(lam)
        if (pending or segs) and exact is None:  # a rank with nothing to compute computes no weights
            scorer.add(model_id, kernel, lam, _target_features(target_rows[model_id], kept[model_id]))
    report_notes(store, reporter)

    with reporter.task("score", len(pending)) as task:
        for chunk in pending:
            event(f"start score {chunk}")
            lo, hi = out.rows(chunk)
            out.write(chunk, scores=scorer(lo, hi).numpy())
            event(f"done score {chunk}")
            task.advance()
    dist.barrier()
    computed = len(pending)
    if parts is not None:
        if out is not None:  # ranked from the finished matrix
            scorer = lambda lo, hi: torch.from_numpy(out.read("scores", lo, hi))  # noqa: E731
        if top.two_stage is not None:  # planned by _two_stage_plan: codes, TRAK's scores, primal kernels, no matrix
            computed += top.compute_scan(scorer, parts, cands, dist, reporter)
        else:
            computed += top.compute(scorer, parts, dist, reporter)
        dist.barrier()
        if dist.is_main:
            computed += top.merge(parts)
            top.drop_parts()
        dist.barrier()
    return lambdas, computed


def _exact_two_stage(store: Store, train_rows: list[ChunkedRows], target_rows: list[ChunkedRows],
                     kept: list[dict[int, np.ndarray]], top: StoredTopK, dist: Dist, reporter: Reporter,
                     exact: Callable[[], Any], multiplier: int) -> int:
    """The two-stage exact top-k (:func:`trakcli.jobs.exact.two_stage_exact`) on rank 0, written with its
    recall; returns the target chunks written."""
    written = 0
    if dist.is_main and not top.is_complete():
        approx = FeatureScores(train_rows, False)
        for model_id in range(len(train_rows)):  # the stored features' own inner products, no kernel
            approx.add(model_id, None, 0.0, _target_features(target_rows[model_id], kept[model_id]))
        layout = store.layout
        arrays, info = two_stage_exact(exact(), approx, layout.n_train,
                                       top.k, multiplier, layout.chunk_rows, reporter=reporter)
        top.final.set_attrs("proponents", exact_two_stage=info)
        for chunk in top.final.pending():
            lo, hi = top.final.rows(chunk)
            top.final.write(chunk, **{name: a[lo:hi] for name, a in arrays.items()})
            written += 1
    dist.barrier()
    return written
