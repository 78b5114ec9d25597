"""`trak score` as a library function: target features, per-checkpoint kernels, the ensembled score matrix.

Formula: Park et al. 2023 ("TRAK: Attributing Model Behavior at Scale",
Eq. 17), as written in :mod:`trakcli.scoring`. Under ``torchrun`` each process
computes the chunks of its rank; rank 0 holds the store's lock and writes
attributes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from trakcli.config import Config
from trakcli.data.load import load_dataset
from trakcli.data.tensors import TensorDataset
from trakcli.data.text import check_target_inputs
from trakcli.distributed import Dist
from trakcli.errors import ConfigError, StoreError
from trakcli.jobs.exact import exact_scorer, two_stage_exact
from trakcli.jobs.featurize import featurize_rows
from trakcli.jobs.per_token import PerTokenScores, check_per_token, per_token_width
from trakcli.jobs.plan import RunFlags, ScorePlan
from trakcli.jobs.kernels import finalize_kernels, kernel_of, report_notes
from trakcli.jobs.runtime import ChunkWriter, event, grad_memory_for, locked_store, torch_threads
from trakcli.jobs.setup import JobSetup, prepare
from trakcli.progress import NULL_REPORTER, Reporter
from trakcli.jobs.topk import StoredTopK, TwoStage
from trakcli.scoring import (
    DUAL, cosine_term, dual_target_sq_norms, ensemble_block, kernel_form, kernel_sq_norms, score_block,
    target_weights,
)
from trakcli.store import ChunkedRows, Store, StoreCorruptError, check_same
from trakcli.store.append import stale_error
from trakcli.store.bfloat16 import from_bits, is_bfloat16
from trakcli.store.curvature import drop_exact_rows
from trakcli.store.chunkread import aligned_empty, chunk_files
from trakcli.store.kernel import kernel_nbytes, read_kernel
from trakcli.store.quantize import is_quantized, signs
from trakcli.store.store import TOP_K_ARRAYS
from trakcli.tasks import resolve_task


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
        two_stage: for a two-stage top-k (``store.dtype`` int8 or binary, :mod:`trakcli.jobs.topk`): its
            settings (``codes``, ``rescore_multiplier``, ``recall_queries``), ``k``, ``n_queries``, the
            fraction of train rows the recall was measured over (``rows_measured``; 1.0: exact) and the
            measured ``recall`` ``{"proponents": r, "opponents": r}`` (recall@k against the exact top-k of the
            sampled targets, :meth:`trakcli.jobs.topk.StoredTopK.recall`); else None.
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
        store = Store.open_existing(self.store, mode="r")
        hi = self.n_target if hi is None else min(hi, self.n_target)
        return {name: store.read(f"scores/{self.experiment}/top_k/{name}", lo, hi) for name in TOP_K_ARRAYS}

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
        store = Store.open_existing(self.store, mode="r")
        hi = self.n_target if hi is None else min(hi, self.n_target)
        return {name: store.read(f"scores/{self.experiment}/per_token/{name}", lo, hi)
                for name in ("target_tokens", "document_tokens")}

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
    check_same(
        f"the train features in {store.path}", store.identity, s.identity,
        "score with the config that featurized the store, or rerun `trak featurize CONFIG --overwrite`",
    )
    have = store.model_ids()
    missing = [m for m in range(len(s.checkpoints)) if m not in have]
    if missing:
        raise StoreError(
            f"the store has no train features for model_ids {missing} (the config lists {len(s.checkpoints)} "
            f"checkpoints, the store has model_ids {have}); run `trak featurize CONFIG` first"
        )
    rows_all = []
    for model_id, ckpt in enumerate(s.checkpoints):
        rows = store.train(model_id, str(ckpt), s.shas[model_id], create=False,
                           optimizer_state=s.state_record(model_id))
        if not rows.is_complete():
            done = int((rows.flags() != 0).sum())
            raise StoreError(
                f"train features of model_id {model_id} ({ckpt}) are incomplete ({done}/{rows.n_chunks} chunks); "
                "run `trak featurize CONFIG` to finish them"
            )
        rows_all.append(rows)
    return rows_all


def _verify_train(train_rows: list[ChunkedRows]) -> None:
    """Read every chunk of the train features (``score --verify``); stop on damage, naming the repair.

    Raises:
        StoreCorruptError: a done chunk is missing or fails its checksum.
    """
    for model_id, rows in enumerate(train_rows):
        bad = rows.check()
        if bad:
            raise StoreCorruptError(
                f"train features of model_id {model_id} ({rows.path}): chunks {bad} are missing or corrupt; "
                "run `trak featurize CONFIG --verify` to recompute them, then score again",
                rows.path, bad,
            )


def score(
    cfg: Config,
    *,
    overwrite: bool = False,
    skip_nonfinite: bool = False,
    verify: bool = False,
    reporter: Reporter = NULL_REPORTER,
) -> ScoreResult:
    """Featurize the targets, finalize each checkpoint's kernel and write the ensembled scores.

    Formula: :mod:`trakcli.scoring` (Park et al. 2023, Eq. 17). Train features
    are streamed from the store one column block (``chunk_rows`` train rows) at
    a time, so memory is O(n_target·proj_dim + chunk_rows·proj_dim + proj_dim²
    + n_target·chunk_rows), never n_train·n_target.

    Args:
        cfg: config; ``data.target`` is required. ``score:`` gives the
            experiment and the ridge (one :class:`~trakcli.jobs.plan.ScorePlan`).
        overwrite, skip_nonfinite, verify: the run's :class:`~trakcli.jobs.plan.RunFlags`.
        reporter: progress bars and messages.

    Derived data is verified on every run: target features and score chunks
    that are missing or fail their checksum, and a corrupt kernel, are
    recomputed (one info line each). With ``verify`` every chunk of the train
    features is read too; a damaged one stops the run naming
    ``trak featurize CONFIG --verify``.

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
    """The :class:`ScoreResult` of an experiment :func:`score_targets` just scored (`trak score` and the API).

    Args:
        train, target: the datasets scored (``train`` may be a :class:`~trakcli.data.stored.StoredRows`).
    """
    top_k = None if plan.top_k is None else min(plan.top_k, len(train))
    return ScoreResult(
        store=path, experiment=plan.experiment, n_target=len(target), n_train=len(train), lambdas=lambdas,
        train_labels=None if train.labels is None else train.labels.numpy(), target_labels=target.labels.numpy(),
        train_data=train, target_data=target, chunks_computed=computed,
        top_k=top_k, full=plan.full, per_token=plan.per_token,
        two_stage=_recorded_recall(path, plan.experiment, len(target), plan.top_k),
    )


def _recorded_recall(path: Path, experiment: str, n_target: int, top_k: int | None) -> dict[str, Any] | None:
    """The two-stage record of the experiment's top-k (settings and measured recall), or None."""
    if not top_k:
        return None
    store = Store.open_existing(path, mode="r")
    return StoredTopK(store, experiment, n_target, top_k, create=False).recorded_recall()


@dataclass
class _Arrays:
    """One experiment's arrays in the store: per model_id its target features, the score matrix (``score.full``)
    and the top-k (``score.top_k``)."""

    targets: list[ChunkedRows]
    out: ChunkedRows | None
    top: StoredTopK | None


def score_targets(
    s: JobSetup,
    path: Path,
    target: TensorDataset,
    plan: ScorePlan,
    flags: RunFlags = RunFlags(),
    reporter: Reporter = NULL_REPORTER,
) -> tuple[list[float], int]:
    """:func:`score` on a prepared setup and loaded targets (also :class:`trakcli.Attributor`'s score).

    Under the store's lock: checks the train features (complete, same identity and checkpoints as
    ``s``), checks and repairs derived data, featurizes the targets into ``targets/<experiment>``,
    then :func:`finalize_and_score` into ``scores/<experiment>``.

    Args:
        s: the setup (featurizer, checkpoints and their sha256s, identity, process group).
        path: the store.
        target: the target examples.
        plan: what to compute (``score:`` of the config); flags: how to treat what is stored; reporter: as :func:`score`.

    Returns:
        (λ_m per model_id, target and score chunks computed by this process).

    Raises:
        As :func:`score`; ConfigError: ``score.normalize: unit`` with exact curvature scores.
    """
    plan = plan.for_setup(s)
    t_attrs = _target_attrs(s, target)
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
            store, s, plan, len(target), reporter if s.dist.is_main else NULL_REPORTER, train_rows[0])
        if two is not None:  # the experiment's top-k depends on them: recorded and checked with the settings
            settings["two_stage"] = two.settings()
        arrays = _open_arrays(store, s, plan, flags, settings, t_attrs, len(target), two, stale is not None,
                              train_rows, reporter)
        kept, kernels, computed = _featurize_targets(s, store, plan, target, arrays.targets, flags, reporter)
        s.dist.barrier()
        lambdas, n = finalize_and_score(
            store, train_rows, arrays.targets, arrays.out, plan, top=arrays.top, dist=s.dist, reporter=reporter,
            target_chunks=kept, kernels=kernels,
            exact=(lambda: exact_scorer(s, store, target, plan.grad_memory_mb, reporter, plan.experiment))
            if plan.exact else None,
        )
        computed += n
        if plan.exact and s.dist.is_main:  # every rank is done: the exact blocks' saved progress is not needed
            drop_exact_rows(store, plan.experiment)
        if plan.per_token and s.dist.is_main:
            computed += _per_token_scores(s, store, train_rows, target, plan, reporter)
        s.dist.barrier()
    return lambdas, computed


def _target_attrs(s: JobSetup, target: TensorDataset) -> dict[str, Any]:
    """What the target features depend on (recorded with them): the target data, the checkpoints and, where the
    setup has them, the optimizer states and the curvature solve's refinement.

    Raises:
        StoreError: targets of another kind than the train inputs (:func:`trakcli.data.text.check_target_inputs`).
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
                 train_rows: list[ChunkedRows], reporter: Reporter) -> _Arrays:
    """The experiment's arrays: created, checked and repaired by rank 0 (one info line per repair), then opened by
    the other ranks."""
    exp, n_models = plan.experiment, len(s.checkpoints)
    if s.dist.is_main:
        if flags.verify:
            _verify_train(train_rows)
        if flags.overwrite:
            if not stale:  # a stale experiment's target features depend on the checkpoints only: kept
                store.drop(f"targets/{exp}")
            store.drop(f"scores/{exp}")
        targets = []
        for model_id in range(n_models):  # derived data: checked on every run, damage recomputed
            targets.append(store.targets(exp, model_id, t_attrs, n_target, repair=True))
            bad = targets[-1].verify()
            if bad:
                reporter.info(f"model {model_id}: target feature chunks {bad} were missing or corrupt; recomputed")
        if plan.full:  # records or checks the experiment's settings with the matrix
            out = store.scores(exp, n_target, settings, repair=True)
            bad = out.verify()
            if bad:
                reporter.info(f"score column blocks {bad} were missing or corrupt; recomputed")
        else:
            out = None
            store.score_settings(exp, settings, repair=True)
        top = StoredTopK(store, exp, n_target, plan.top_k, create=True, two_stage=two) if plan.top_k else None
        bad = top.verify() if top else []
        if bad:
            reporter.info(f"top-k target chunks {bad} were missing or corrupt; recomputed")
        report_notes(store, reporter)
    s.dist.barrier()
    if not s.dist.is_main:  # opened after rank 0 has created or repaired them
        store.distributed = True
        targets = [store.targets(exp, m, t_attrs, n_target, create=False) for m in range(n_models)]
        out = store.scores(exp, n_target, settings, create=False) if plan.full else None
        top = StoredTopK(store, exp, n_target, plan.top_k, create=False, two_stage=two) if plan.top_k else None
    return _Arrays(targets, out, top)


def _featurize_targets(s: JobSetup, store: Store, plan: ScorePlan, target: TensorDataset, target_rows: list[ChunkedRows],
                       flags: RunFlags, reporter: Reporter
                       ) -> tuple[list[dict[int, np.ndarray]], dict[int, tuple[torch.Tensor, float]], int]:
    """The pending target features of every checkpoint, written (and the stored kernels read) in the background
    while the next checkpoint's are computed. Returns (per model_id the chunks written, kept for the scores;
    the kernels read ahead; chunks computed)."""
    kept: list[dict[int, np.ndarray]] = []
    kernels: dict[int, tuple[torch.Tensor, float]] = {}
    n_models = len(target_rows)
    prefetch = (s.dist.world_size == 1 and not plan.curvature
                and sum(kernel_nbytes(store, m) for m in range(n_models)) <= PREFETCH_BYTES)
    computed = 0
    with ChunkWriter() as writer:
        for model_id, rows in enumerate(target_rows):
            kept.append({})
            if s.curvature is not None and rows.pending(s.dist.rank, s.dist.world_size):
                s.curvature.read(store, model_id)  # the targets are whitened by the train side's curvature
                if not plan.exact:  # exact scores refine their own solves (trakcli.jobs.exact)
                    s.refine_targets()
            n, skip = featurize_rows(
                s, target, rows, model_id, with_out_to_loss=False, skip_nonfinite=flags.skip_nonfinite,
                reporter=reporter, label="targets", keep=kept[-1], writer=writer,
            )
            computed += n
            if skip:
                reporter.info(f"model {model_id}: targets {skip[:10]} have non-finite gradients; their scores are 0")
            if prefetch:
                writer.submit(_prefetch_kernel, store, model_id, plan.ridge(), kernels)
    return kept, kernels, computed


def _two_stage_plan(store: Store, s: JobSetup, plan: ScorePlan, n_target: int, reporter: Reporter,
                    train: ChunkedRows) -> TwoStage | None:
    """The two-stage top-k of this run (:mod:`trakcli.jobs.topk`), or None: when the store has codes
    (``store.dtype`` int8 or binary) and the top-k is streamed with TRAK's scores and primal kernels.

    Otherwise, on a store with codes, one info line says why the top-k comes from the exact streamed
    pass over the bfloat16 copy instead. ``train``: the first checkpoint's train rows (whether their chunk files
    are read directly decides ``score.rerank: auto``).
    """
    codes, layout = store.layout.dtype, store.layout
    if not plan.top_k or not is_quantized(codes):
        return None
    dual = not plan.curvature and kernel_form(layout.n_train, layout.proj_dim) == DUAL
    why = ("score.full is set: the top-k is ranked from the full score matrix" if plan.full else
           "score.normalize unit ranks by cosines, which the codes do not approximate" if plan.unit else
           "curvature.exact recomputes the scores exactly" if plan.exact else
           f"n_train {layout.n_train} < proj_dim {layout.proj_dim}: the dual kernel scores every "
           "row in one product" if dual else None)
    if why is not None:
        reporter.info(f"two-stage top-k not used ({why}); the top-k comes from the exact pass over the bfloat16 copy")
        return None
    return TwoStage.of(codes, plan.rescore_multiplier, plan.recall_queries, n_target, plan.top_k, layout.n_train,
                       layout.chunk_rows, plan.rerank, chunk_files(train.data["features"]) is not None,
                       layout.proj_dim)


def _per_token_scores(s: JobSetup, store: Store, train_rows: list[ChunkedRows], target: TensorDataset,
                      plan: ScorePlan, reporter: Reporter) -> int:
    """Compute the pending chunks of the experiment's per-token scores (:mod:`trakcli.jobs.per_token`); returns them."""
    exp, top_k = plan.experiment, plan.top_k
    k = min(top_k, len(s.train))
    width = per_token_width(s, target)
    arrays = store.per_token(exp, len(target), k, width, create=True, repair=True)
    bad = arrays.verify()
    if bad:
        reporter.info(f"per-token chunks {bad} were missing or corrupt; recomputed")
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
    store: Store,
    train_rows: list[ChunkedRows],
    target_rows: list[ChunkedRows],
    out: ChunkedRows | None,
    plan: ScorePlan,
    *,
    top: StoredTopK | None = None,
    dist: Dist | None = None,
    reporter: Reporter = NULL_REPORTER,
    target_chunks: list[dict[int, np.ndarray]] | None = None,
    kernels: dict[int, tuple[torch.Tensor, float]] | None = None,
    exact: Callable[[], Callable[[int, int], torch.Tensor]] | None = None,
) -> tuple[list[float], int]:
    """Finalize each checkpoint's kernel and write the pending score blocks.

    Kernels (:func:`trakcli.jobs.kernels.kernel_of`; normally made by `trak featurize`)
    are computed by rank ``m mod world_size`` and stored, so a rerun reuses
    them (in a single process a missing one is made where it is used): the float64
    Cholesky factor of ``Φ_mᵀΦ_m + λ_m I`` (``[proj_dim, proj_dim]``, form
    :data:`~trakcli.scoring.PRIMAL`), or when ``n_train < proj_dim`` the float32
    solved features ``X_m = (Φ_mΦ_mᵀ + λ_m I)⁻¹Φ_m`` (``[n_train, proj_dim]``, form
    :data:`~trakcli.scoring.DUAL`; :func:`~trakcli.scoring.kernel_form`). The form
    is in the kernel's attributes and its shape. Scores are computed
    one block of ``chunk_rows`` train columns at a time:
    ``[(1/M) Σ_m W_m Φ_m[block]ᵀ] ⊙ [(1/M) Σ_m Q_m[block]]`` with
    ``W_m = Φ_m(targets) A_m`` (float32 products of float64 solves); a dual
    checkpoint's term ``Φ_m(targets) X_mᵀ`` is one float32 product for all columns
    (summed over checkpoints in float64, memory ``[n_target, n_train]``) cut into the blocks.
    A rank with no pending block computes no weights.

    With ``top``, the K highest and lowest scores per target are found in one streamed
    pass (:mod:`trakcli.jobs.topk`), from the score matrix when ``out`` is given (after
    it is finished), else from the blocks as they are computed. With ``plan.normalize``
    ``"unit"`` the scores are the mean over checkpoints of the cosines in the kernel's
    space (:mod:`trakcli.scoring`, TrackStar), without Q. With ``plan.curvature`` there is no kernel:
    each checkpoint's term is ``Φ_m(targets) Φ_m[block]ᵀ`` (features already whitened by the curvature,
    :mod:`trakcli.curvature`) and λ_m is reported as 0.

    Args:
        store: the open store.
        train_rows: per model_id, complete train features (``features``, ``out_to_loss``).
        target_rows: per model_id, complete target features.
        out: the scores array of the experiment (chunked by train columns), or None (top-k only).
        plan: the ridge, normalization, threads (``linalg_threads``) and curvature of the scores.
        top: the experiment's top-k (``score.top_k``), or None.
        dist: the process group (default: a single process).
        reporter: progress of the score blocks.
        target_chunks: per model_id, target feature chunks this process has just written
            (chunk index -> ``[rows, proj_dim]`` float32), used instead of reading them back.
        kernels: stored kernels already read and verified (model_id -> (kernel, λ)), used
            instead of reading them again (single process).
        exact: makes the exact curvature scorer ``(lo, hi) -> [n_target, hi - lo]`` (:func:`trakcli.jobs.exact.exact_scorer`),
            called once when a block is pending; the blocks and top-k come from it. With ``top`` and
            ``plan.exact_two_stage``, the top-k is the exact re-scoring of candidates from the stored features
            (:func:`trakcli.jobs.exact.two_stage_exact`), on rank 0.

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
    """Read and verify checkpoint ``model_id``'s stored kernel into ``out`` (a background task).

    Anything short of a sound kernel made with ``settings`` leaves ``out`` without it, and
    :func:`~trakcli.jobs.kernels.kernel_of` then reads, repairs or makes it in the main thread.
    """
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
    scorer: Any = _BlockScores(train_rows, plan.unit)
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
            computed += top.compute_two_stage(scorer, parts, cands, dist, reporter)
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
    """The two-stage exact top-k (:func:`trakcli.jobs.exact.two_stage_exact`) on rank 0, written to the top-k arrays
    with its recall; returns the target chunks written."""
    written = 0
    if dist.is_main and not top.is_complete():
        approx = _BlockScores(train_rows, False)
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


def _as_tensor(arr: np.ndarray) -> torch.Tensor:
    """A stored feature array as a torch tensor: bfloat16 bits (uint16) viewed as ``torch.bfloat16`` (no copy),
    anything else as float32."""
    if arr.dtype == np.uint16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr.astype(np.float32, copy=False))


class _BlockScores:
    """The ensembled scores of every target against a block of train rows, ``(lo, hi) -> [n_target, hi - lo]``.

    TRAK's (:func:`~trakcli.scoring.score_block`: float32 products ``W_m Φ_m[block]ᵀ`` of float64
    solves, times the mean Q), or with ``unit`` the mean over checkpoints of the cosines in each
    kernel's space (:func:`~trakcli.scoring.cosine_term`). A dual checkpoint's term ``Φ_m(targets) X_mᵀ``
    is one float32 product for all columns (summed over checkpoints in float64, ``[n_target, n_train]``).
    """

    def __init__(self, train_rows: list[ChunkedRows], unit: bool):
        self.train_rows, self.unit = train_rows, unit
        self.weights: list[torch.Tensor] = []  # per primal checkpoint: W_m [n_target, proj_dim] float32
        self.primal: list[tuple[ChunkedRows, torch.Tensor, torch.Tensor]] = []  # rows, factor, target norms²
        self.dual_total: torch.Tensor | None = None
        # two-stage top-k, made on first use: per primal checkpoint the int8 target weights with their
        # per-target scales
        self._qweights: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # APPROX_BUFFERS (float32 output, int32 product, float32 term) [rows, n_target], reused in turn
        self._approx_out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._approx_turn = 0
        self._local = threading.local()  # per thread: the chunk-file readers of :meth:`_read`
        self._buffers: dict[tuple[int, str], list[np.ndarray | None]] = {}  # :meth:`_read`'s reused buffers

    def add(self, model_id: int, kernel: torch.Tensor | None, lam: float, phi_t: torch.Tensor) -> None:
        """Add checkpoint ``model_id``: its kernel (primal factor, dual X, or None: no kernel), ridge and target features."""
        rows = self.train_rows[model_id]
        if kernel is None:  # the features' own inner products (curvature kfac / ekfac)
            t_sq = phi_t.double().square().sum(1) if self.unit else torch.empty(0)
            self.weights.append(phi_t)
            self.primal.append((rows, None, t_sq))
            return
        if kernel.shape[0] == kernel.shape[1]:  # PRIMAL ([proj_dim, proj_dim]; the dual's X has n_train < proj_dim rows): Cholesky of ΦᵀΦ + λI
            w = target_weights(kernel, phi_t, dtype=torch.float32)
            self.weights.append(w)
            t_sq = (w.double() * phi_t.double()).sum(1) if self.unit else torch.empty(0)
            self.primal.append((rows, kernel, t_sq))
            return
        # DUAL: X_m = (Φ_mΦ_mᵀ + λI)⁻¹Φ_m [n_train, proj_dim], n_train < proj_dim; the term Φ_t X_mᵀ
        term = phi_t @ kernel.T  # float32, as the primal products
        if self.unit:
            phi = torch.from_numpy(rows.read("features", 0, rows.n_rows).astype(np.float32, copy=False))
            z_sq = (phi.double() * kernel.double()).sum(1)  # φᵀAφ = φ · X_i
            term = cosine_term(term.double(), dual_target_sq_norms(phi_t, term, phi, lam), z_sq)
        self.dual_total = term.double() if self.dual_total is None else self.dual_total.add_(term)

    # -- two-stage top-k (trakcli.jobs.topk.TwoStageScores) over int8 / binary codes --------------------------

    def _read(self, rows: ChunkedRows, name: str, lo: int, hi: int, raw: bool = False,
              slot: int | None = None) -> np.ndarray:
        """Entries ``lo .. hi`` (whole chunks) of array ``name`` of ``rows``, checked: straight from the chunk files
        where the store keeps them so (:mod:`trakcli.store.chunkread`: a local store; each thread its own
        reader), else through zarr (:meth:`~trakcli.store.rows.ChunkedRows.read`). With ``raw`` a bfloat16 array
        gives its stored uint16 bits (through zarr: decoded, float32). With ``slot``, read from the chunk files
        into the reused buffer ``slot`` of the array (:data:`SCAN_SLOTS` of them: a block's buffers are reused
        by a block that many reads later; fresh ones cost a page fault per 4 KiB each time)."""
        files = self._local.__dict__.setdefault("files", {})
        key = (id(rows), name)
        if key not in files:
            files[key] = chunk_files(rows.data[name])
        reader = files[key]
        if reader is None:
            return rows.read(name, lo, hi)
        shape = (hi - lo, *rows.data[name].shape[1:])
        if slot is None:
            out = np.empty(shape, dtype=reader.dtype)
        else:
            ring = self._buffers.setdefault(key, [None] * self.SCAN_SLOTS)
            if ring[slot] is None or ring[slot].shape[0] < shape[0]:
                ring[slot] = aligned_empty(shape, reader.dtype)  # whole chunks are read straight into it
            out = ring[slot][: shape[0]]
        reader.read(lo, hi, out)
        if not raw and is_bfloat16(rows.data[name]):
            return from_bits(out)
        return out

    def _mean_q(self, lo: int, hi: int, slot: int | None = None) -> torch.Tensor:
        """``[hi - lo]`` float32 mean out-to-loss over checkpoints (averaged in float64, as :func:`ensemble_block`).

        Read with each block, in the thread that reads the block: a per-row array of 512-row chunks costs
        zarr about 0.35 ms a chunk (7 s for 10^7 rows, measured), which a read of every row before the first
        block would add to the run, and which a block's read overlaps with the product of the block before.
        """
        rows = self.train_rows
        q = sum(self._read(r, "out_to_loss", lo, hi, slot=slot).astype(np.float64) for r in rows) / len(rows)
        return torch.from_numpy(np.asarray(q, dtype=np.float32))

    def _quantized_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per primal checkpoint ``(ŵ [n_target, proj_dim] int8, s_t [n_target] float32)``: the target weights
        ``W_m`` rounded with a per-target scale ``s_t = max|W_m[t]| / 127`` (made on first use)."""
        if self._qweights is None:  # threads may race here: each makes the same list, one is kept
            made = []
            for w in self.weights:  # [n_target, proj_dim] float32
                s_t = w.abs().amax(1) / 127
                safe = torch.where(s_t > 0, s_t, torch.ones_like(s_t))
                wq = torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8)  # [n_target, proj_dim]
                made.append((wq, s_t))
            self._qweights = made
        return self._qweights

    def read_codes(self, lo: int, hi: int, slot: int | None = None
                   ) -> tuple[list[np.ndarray], list[np.ndarray], torch.Tensor]:
        """What :meth:`product` needs of train rows ``lo .. hi`` (whole chunks): per primal checkpoint the codes
        ``[rows, proj_dim]`` int8 (±1 for binary) and the row scales ``[rows]`` float32, and the ``[rows]`` mean Q
        (``slot``: :meth:`_read`)."""
        proj_dim = self.weights[0].shape[1]
        codes = [signs(rows.code_dtype, self._read(rows, "codes", lo, hi, slot=slot), proj_dim)
                 for rows, _, _ in self.primal]
        scales = [self._read(rows, "scale", lo, hi, slot=slot).astype(np.float32, copy=False)
                  for rows, _, _ in self.primal]
        return codes, scales, self._mean_q(lo, hi, slot)

    def approx(self, lo: int, hi: int) -> torch.Tensor:
        """Approximate scores ``[hi - lo, n_target]`` float32 (train rows first) from the codes
        (:mod:`trakcli.store.quantize`): :meth:`product` of :meth:`read_codes`."""
        return self.product(*self.read_codes(lo, hi))

    def product(self, codes: list[np.ndarray], scales: list[np.ndarray], q: torch.Tensor,
                slot: int | None = None) -> torch.Tensor:
        """Approximate scores ``[rows, n_target]`` float32 (train rows first) from :meth:`read_codes`.

        Per checkpoint, ``W_m φ_i ≈ s_t s_i · (ŵ_t · c_i)``: the target weights ``W_m`` rounded to int8 with a
        per-target scale ``s_t = max|W_m[t]| / 127``, the row's codes ``c_i`` (int8, or ±1 for binary) and scale
        ``s_i``; the int8 product is exact in int32 (``torch._int_mm``). Summed over checkpoints, times the
        mean Q of the row, as :func:`~trakcli.scoring.score_block`. The product is ``codes · ŵᵀ`` with the codes
        as stored: on AVX-512 VNNI, 770 against 610 GOPS for ``ŵ · codesᵀ`` (1,000 targets, 4,096 rows, measured).

        With one checkpoint the scores are left divided by ``s_t`` (``s_i Q_i · (ŵ_t · c_i)``: one pass over the
        block fewer): a positive factor per target, which orders each target's rows as the scores do; the
        candidates, their thresholds and their merge across segments all stay in these units.
        The block returned is one of :data:`APPROX_BUFFERS` reused ones: valid until the call after the next;
        with ``slot`` (:meth:`scan_read`'s, products computed in several threads at once), buffer ``slot``.
        """
        qweights = self._quantized_weights()
        n, n_target = len(q), qweights[0][0].shape[0]
        if slot is None:
            if not self._approx_out or self._approx_out[0][0].shape[0] < n:
                self._approx_out = [self._product_buffers(n, n_target) for _ in range(self.APPROX_BUFFERS)]
            acc, prod, tmp = (t[:n] for t in self._approx_out[self._approx_turn])
            self._approx_turn = (self._approx_turn + 1) % self.APPROX_BUFFERS
        else:  # the output in the slot's buffer, the int32 product and the term in the thread's own
            ring = self._buffers.setdefault((0, "approx"), [None] * self.SCAN_SLOTS)
            if ring[slot] is None or ring[slot].shape[0] < n:
                ring[slot] = torch.empty(n, n_target)
            own = self._local.__dict__.get("product")
            if own is None or own[0].shape[0] < n:
                own = self._local.product = self._product_buffers(n, n_target)
            acc, (prod, tmp) = ring[slot][:n], (t[:n] for t in own[1:])
        for m, ((wq, s_t), c, scale) in enumerate(zip(qweights, codes, scales)):
            torch._int_mm(torch.from_numpy(c), wq.T, out=prod)  # [rows, n_target] int32
            term = acc if m == 0 else tmp
            torch.mul(prod, (torch.from_numpy(scale) * q)[:, None], out=term)  # float32
            if len(qweights) > 1:
                term.mul_(s_t[None, :])
            if m:
                acc.add_(term)
        return acc

    @staticmethod
    def _product_buffers(n: int, n_target: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The output, the int32 product and a float32 term of :meth:`product` for ``n`` rows."""
        return torch.empty(n, n_target), torch.empty(n, n_target, dtype=torch.int32), torch.empty(n, n_target)

    #: Output blocks of :meth:`approx` used in turn: a block stays valid until the call after the next
    #: (the caller filters one block while the next is computed). Reusing them keeps the process's memory
    #: flat: fresh 16 MB blocks, allocated in the reading thread and freed in the filtering one, take the
    #: candidate pass's peak RSS at 10^7 rows to 3.0 GiB against 1.6 GiB (measured).
    APPROX_BUFFERS = 3

    def gather(self, rows: np.ndarray) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The float copy of train rows ``rows`` (int64, sorted, unique) for :meth:`pairs`: per checkpoint
        ``[len(rows), proj_dim]``, read row by row where the store allows
        (:meth:`~trakcli.store.rows.ChunkedRows.read_rows`), kept as stored (torch bfloat16: 2 bytes a feature,
        converted by :meth:`pairs` as it gathers), and their ``[len(rows)]`` float32 mean Q."""
        feats = [_as_tensor(r.read_rows("features", rows, decode=False)) for r, _, _ in self.primal]
        if not len(rows):
            return feats, torch.zeros(0)
        lo = int(rows[0])
        return feats, self._mean_q(lo, int(rows[-1]) + 1)[torch.from_numpy(rows - lo)]

    def load(self, lo: int, hi: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The float copy of train rows ``lo .. hi``: per checkpoint ``[rows, proj_dim]`` float32 (bfloat16 as stored,
        converted once here for both :meth:`pairs` and :meth:`rows`), and the ``[rows]`` float32 mean Q."""
        feats = [torch.from_numpy(rows.read("features", lo, hi).astype(np.float32, copy=False))
                 for rows, _, _ in self.primal]
        return feats, self._mean_q(lo, hi)

    #: Buffers of each array that :meth:`scan_read` reads in turn (the ``i``-th read of a pass uses buffer
    #: ``i mod SCAN_SLOTS``): more than the blocks held at once by the reads ahead, the products and the caller
    #: (:func:`trakcli.jobs.topk._pipeline`: its ``depth + workers + 1``, 7).
    SCAN_SLOTS = 8

    def scan_read(self, lo: int, hi: int, slot: int | None = None
                  ) -> tuple[tuple[list[np.ndarray], list[np.ndarray], torch.Tensor], Any]:
        """Everything a one-pass two-stage top-k needs of train rows ``lo .. hi`` (whole chunks), read only (a
        thread reads the next blocks while the product of this one is computed): :meth:`read_codes`, and the
        float copy as :meth:`load` gives it, bfloat16 kept as stored (torch bfloat16; :meth:`pairs` and
        :meth:`rows` convert what they use). ``slot``: :meth:`_read`'s reused buffers."""
        slot = None if slot is None else slot % self.SCAN_SLOTS
        codes = self.read_codes(lo, hi, slot)
        feats = [_as_tensor(self._read(rows, "features", lo, hi, raw=True, slot=slot)) for rows, _, _ in self.primal]
        return (*codes, slot), (feats, codes[2])

    def scan_product(self, read: tuple[tuple[list[np.ndarray], list[np.ndarray], torch.Tensor], Any]
                     ) -> tuple[torch.Tensor, Any]:
        """``(approximate scores [rows, n_target], float copy)`` of a :meth:`scan_read` (:meth:`product`)."""
        codes, floats = read
        return self.product(*codes), floats

    #: Pairs scored at once by :meth:`pairs` (their gathered rows: ``PAIR_GROUP · proj_dim`` float32).
    PAIR_GROUP = 8192

    def pairs(self, block: tuple[list[torch.Tensor], torch.Tensor], targets: torch.Tensor,
              rows: torch.Tensor) -> torch.Tensor:
        """Exact scores ``[p]`` float32 of target ``targets[j]`` against row ``rows[j]`` of ``block``, pair by pair.

        ``[(1/M) Σ_m W_m[t] · Φ_m[i]] · Q̄_i``, the formula of :func:`~trakcli.scoring.score_block` for one
        pair: the rows and the target weights are gathered (``index_select``)
        and multiplied entry by entry and summed (float32), :data:`PAIR_GROUP` pairs at a time: only the pairs
        asked for, not the block's product.

        Args:
            block: :meth:`load`'s or :meth:`gather`'s float copy of rows (float32 or bfloat16, converted to
                float32 as they are gathered).
            targets: ``[p]`` int64 target indices.
            rows: ``[p]`` int64 row indices within the block.
        """
        feats, q = block
        out = torch.empty(len(rows), dtype=torch.float32)
        for g in range(0, len(rows), self.PAIR_GROUP):
            r, t = rows[g : g + self.PAIR_GROUP], targets[g : g + self.PAIR_GROUP]
            acc = None
            for w, f in zip(self.weights, feats):
                term = f.index_select(0, r).float().mul_(w.index_select(0, t)).sum(1)  # [group]
                acc = term if acc is None else acc.add_(term)
            out[g : g + self.PAIR_GROUP] = acc.div_(len(feats)).mul_(q[r])
        return out

    def rows(self, block: tuple[list[torch.Tensor], torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        """Exact scores ``[len(targets), rows]`` float32 of the targets ``targets`` against the whole block."""
        feats, q = block
        return score_block([w[targets] for w in self.weights], feats, [q] * len(feats))

    def __call__(self, lo: int, hi: int) -> torch.Tensor:
        return self.score_read(self.read_block(lo, hi), lo, hi)

    def read_block(self, lo: int, hi: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The stored rows ``lo .. hi`` that :meth:`score_read` needs: per primal checkpoint its features
        ``[hi - lo, proj_dim]`` float32, and per checkpoint its out-to-loss ``[hi - lo]`` (none with ``unit``).

        Only reads, so that a background thread reads the next block while this one is scored (on an object
        store the read is most of a block's time).
        """
        feats = [torch.from_numpy(r.read("features", lo, hi).astype(np.float32, copy=False)) for r, _, _ in self.primal]
        qs = [] if self.unit else [torch.from_numpy(r.read("out_to_loss", lo, hi)) for r in self.train_rows]
        return feats, qs

    def score_read(self, read: tuple[list[torch.Tensor], list[torch.Tensor]], lo: int, hi: int) -> torch.Tensor:
        """The scores ``[n_target, hi - lo]`` of rows ``lo .. hi`` from their :meth:`read_block`."""
        feats, qs = read
        if self.unit:
            total = torch.zeros(0) if self.dual_total is None else self.dual_total[:, lo:hi].clone()
            for w, f, (_, factor, t_sq) in zip(self.weights, feats, self.primal):
                z_sq = f.double().square().sum(1) if factor is None else kernel_sq_norms(factor, f)
                term = cosine_term(w @ f.T, t_sq, z_sq).double()
                total = term if total.numel() == 0 else total.add_(term)
            return (total / len(self.train_rows)).to(torch.float32)
        if self.dual_total is None:  # every checkpoint is of one form (kernel_form of n_train and proj_dim)
            return score_block(self.weights, feats, qs)
        return ensemble_block(self.dual_total[:, lo:hi], qs)
