"""`trak score` as a library function: target features, per-checkpoint kernels, the ensembled score matrix.

Formula: Park et al. 2023 ("TRAK: Attributing Model Behavior at Scale",
Eq. 17), as written in :mod:`trakcli.scoring`. Under ``torchrun`` each process
computes the chunks of its rank; rank 0 holds the store's lock and writes
attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from trakcli.config import Config
from trakcli.data.load import load_dataset
from trakcli.data.tensors import TensorDataset
from trakcli.distributed import Dist
from trakcli.errors import StoreError
from trakcli.jobs.featurize import featurize_rows
from trakcli.jobs.kernels import finalize_kernels, kernel_of, report_notes, ridge_settings
from trakcli.jobs.runtime import ChunkWriter, event, locked_store, torch_threads
from trakcli.jobs.setup import JobSetup, prepare
from trakcli.progress import NULL_REPORTER, Reporter
from trakcli.scoring import ensemble_block, score_block, target_weights
from trakcli.store import ChunkedRows, Store, StoreCorruptError, check_same


@dataclass
class ScoreResult:
    """Scores of one experiment, in the store.

    Attributes:
        store: the store path; experiment: the experiment name.
        n_target, n_train: the score matrix shape.
        lambdas: the ridge λ_m used per checkpoint.
        train_labels, target_labels: ``[n_train]``, ``[n_target]`` int64 labels (for display).
        chunks_computed: target and score chunks computed in this run.
        notes: messages for the user.
    """

    store: Path
    experiment: str
    n_target: int
    n_train: int
    lambdas: list[float]
    train_labels: np.ndarray
    target_labels: np.ndarray
    chunks_computed: int = 0
    notes: list[str] = field(default_factory=list)

    def head(self, n: int) -> np.ndarray:
        """The first ``n`` target rows of the scores, ``[n, n_train]`` float32 (chunks checked).

        Raises:
            StoreCorruptError: a chunk is missing or corrupt (names ``trak score CONFIG``).
        """
        return self._read(0, min(n, self.n_target))

    def _read(self, lo: int, hi: int | None) -> np.ndarray:
        return Store.open_existing(self.store, mode="r").read(f"scores/{self.experiment}/scores", lo, hi)

    @property
    def scores(self) -> np.ndarray:
        """All scores ``[n_target, n_train]`` float32, read into memory (chunks checked)."""
        return self._read(0, None)


def _check_train_complete(s: JobSetup, store: Store) -> list[ChunkedRows]:
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
        rows = store.train(model_id, str(ckpt), s.shas[model_id], create=False)
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
            experiment and the ridge.
        overwrite: recompute the experiment's target features and scores.
        skip_nonfinite: give targets with non-finite gradients zero features (zero scores).
        verify: recompute target and score chunks that fail their checksum.
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
    """
    s = prepare(cfg, need_target=True, reporter=reporter)
    sc = cfg.score
    path = Path(cfg.store.path)
    target = load_dataset(cfg.data.target, key="data.target")  # type: ignore[arg-type]  # checked by check_files
    lambdas, computed = score_targets(
        s, path, target, experiment=sc.experiment, lambda_reg=sc.lambda_reg, lambda_rel=sc.lambda_rel,
        overwrite=overwrite, skip_nonfinite=skip_nonfinite, verify=verify, reporter=reporter,
        linalg_threads=cfg.linalg_threads,
    )
    return ScoreResult(
        store=path,
        experiment=sc.experiment,
        n_target=len(target),
        n_train=len(s.train),
        lambdas=lambdas,
        train_labels=s.train.labels.numpy(),
        target_labels=target.labels.numpy(),
        chunks_computed=computed,
    )


def score_targets(
    s: JobSetup,
    path: Path,
    target: TensorDataset,
    *,
    experiment: str,
    lambda_reg: float | None,
    lambda_rel: float,
    overwrite: bool = False,
    skip_nonfinite: bool = False,
    verify: bool = False,
    reporter: Reporter = NULL_REPORTER,
    linalg_threads: int | None = None,
) -> tuple[list[float], int]:
    """:func:`score` on a prepared setup and loaded targets (also :class:`trakcli.Attributor`'s score).

    Under the store's lock: checks the train features (complete, same identity and checkpoints as
    ``s``), checks and repairs derived data, featurizes the targets into ``targets/<experiment>``,
    then :func:`finalize_and_score` into ``scores/<experiment>``.

    Args:
        s: the setup (featurizer, checkpoints and their sha256s, identity, process group).
        path: the store.
        target: the target examples.
        experiment, lambda_reg, lambda_rel: ``score:`` of the config.
        overwrite, skip_nonfinite, verify, reporter: as :func:`score`.
        linalg_threads: torch threads for the kernels and score products (:func:`finalize_and_score`).

    Returns:
        (λ_m per model_id, target and score chunks computed by this process).

    Raises:
        As :func:`score`.
    """
    exp = experiment
    t_fp = target.fingerprint()
    if t_fp["input_shape"] != s.identity["train_data"]["input_shape"]:
        raise StoreError(
            f"data.target inputs have shape {t_fp['input_shape']} per example but the train inputs have "
            f"{s.identity['train_data']['input_shape']}; targets must be examples of the same kind"
        )
    t_attrs = {"target_data": t_fp, "checkpoints": s.shas}
    settings = {"lambda_reg": lambda_reg, "lambda_rel": lambda_rel, **t_attrs}
    n_models = len(s.checkpoints)
    computed = 0
    with locked_store(path, s.dist, reporter):
        store = Store.open_existing(path)
        train_rows = _check_train_complete(s, store)
        if s.dist.is_main:
            if verify:
                _verify_train(train_rows)
            if overwrite:
                store.drop(f"targets/{exp}")
                store.drop(f"scores/{exp}")
            target_rows = []
            for model_id in range(n_models):  # derived data: checked on every run, damage recomputed
                target_rows.append(store.targets(exp, model_id, t_attrs, len(target), repair=True))
                bad = target_rows[-1].verify()
                if bad:
                    reporter.info(f"model {model_id}: target feature chunks {bad} were missing or corrupt; recomputed")
            out = store.scores(exp, len(target), settings, repair=True)
            bad = out.verify()
            if bad:
                reporter.info(f"score column blocks {bad} were missing or corrupt; recomputed")
            report_notes(store, reporter)
        s.dist.barrier()
        if not s.dist.is_main:  # opened after rank 0 has created or repaired them
            target_rows = [store.targets(exp, m, t_attrs, len(target), create=False) for m in range(n_models)]
            out = store.scores(exp, len(target), settings, create=False)

        # 1. target features: written, and the stored kernels read, in the background while the next
        #    checkpoint's target features are computed
        kept: list[dict[int, np.ndarray]] = []
        kernels: dict[int, tuple[torch.Tensor, float]] = {}
        prefetch = s.dist.world_size == 1 and sum(map(store.kernel_nbytes, range(n_models))) <= PREFETCH_BYTES
        ridge = ridge_settings(lambda_reg, lambda_rel)
        with ChunkWriter() as writer:
            for model_id, rows in enumerate(target_rows):
                kept.append({})
                n, skip = featurize_rows(
                    s, target, rows, model_id, with_out_to_loss=False, skip_nonfinite=skip_nonfinite,
                    reporter=reporter, label="targets", keep=kept[-1], writer=writer,
                )
                computed += n
                if skip:
                    reporter.info(f"model {model_id}: targets {skip[:10]} have non-finite gradients; their scores are 0")
                if prefetch:
                    writer.submit(_prefetch_kernel, store, model_id, ridge, kernels)
        s.dist.barrier()

        # 2. kernels and scores
        lambdas, n = finalize_and_score(
            store, train_rows, target_rows, out, lambda_reg=lambda_reg, lambda_rel=lambda_rel,
            dist=s.dist, reporter=reporter, linalg_threads=linalg_threads, target_chunks=kept, kernels=kernels,
        )
        computed += n
    return lambdas, computed


def finalize_and_score(
    store: Store,
    train_rows: list[ChunkedRows],
    target_rows: list[ChunkedRows],
    out: ChunkedRows,
    *,
    lambda_reg: float | None,
    lambda_rel: float,
    dist: Dist | None = None,
    reporter: Reporter = NULL_REPORTER,
    linalg_threads: int | None = None,
    target_chunks: list[dict[int, np.ndarray]] | None = None,
    kernels: dict[int, tuple[torch.Tensor, float]] | None = None,
) -> tuple[list[float], int]:
    """Finalize each checkpoint's kernel and write the pending score blocks.

    Kernels (:func:`trakcli.jobs.kernels.kernel_of`; normally made by `trak featurize`)
    are computed by rank ``m mod world_size`` and stored, so a rerun reuses
    them (in a single process a missing one is made where it is used): the float64
    Cholesky factor of ``Φ_mᵀΦ_m + λ_m I`` (``[proj_dim, proj_dim]``, form
    :data:`~trakcli.scoring.PRIMAL`), or when ``n_train < proj_dim`` the float32
    solved features ``X_m = (Φ_mΦ_mᵀ + λ_m I)⁻¹Φ_m`` (``[n_train, proj_dim]``, form
    :data:`~trakcli.scoring.DUAL`; :func:`~trakcli.scoring.kernel_form`). The form
    is in the kernel's attributes and its shape; a primal kernel stored by an older
    trakcli is reused as it is, an older dual one is made again. Scores are computed
    one block of ``chunk_rows`` train columns at a time:
    ``[(1/M) Σ_m W_m Φ_m[block]ᵀ] ⊙ [(1/M) Σ_m Q_m[block]]`` with
    ``W_m = Φ_m(targets) A_m`` (float32 products of float64 solves); a dual
    checkpoint's term ``Φ_m(targets) X_mᵀ`` is one float32 product for all columns
    (summed over checkpoints in float64, memory ``[n_target, n_train]``) cut into the blocks.
    A rank with no pending block computes no weights.

    Args:
        store: the open store.
        train_rows: per model_id, complete train features (``features``, ``out_to_loss``).
        target_rows: per model_id, complete target features.
        out: the scores array of the experiment (chunked by train columns).
        lambda_reg, lambda_rel: the ridge (see :func:`trakcli.scoring.resolve_lambda`).
        dist: the process group (default: a single process).
        reporter: progress of the score blocks.
        linalg_threads: torch threads for this function's dense linear algebra (the
            ``linalg_threads`` setting; None: :data:`trakcli.jobs.runtime.DEFAULT_THREADS`).
        target_chunks: per model_id, target feature chunks this process has just written
            (chunk index -> ``[rows, proj_dim]`` float32), used instead of reading them back.
        kernels: stored kernels already read and verified (model_id -> (kernel, λ)), used
            instead of reading them again (single process).

    Returns:
        (λ_m per model_id, score blocks computed by this process).

    Raises:
        StoreError: a kernel another rank should have written is missing.
        TrakError: a kernel is not positive definite (see :func:`trakcli.scoring.kernel_factor`).
    """
    with torch_threads(linalg_threads):
        return _finalize_and_score(store, train_rows, target_rows, out, lambda_reg, lambda_rel, dist or Dist(),
                                   reporter, target_chunks or [{} for _ in target_rows], kernels or {})


#: `trak score` reads the stored kernels in the background, during the target features, when
#: all of them together take at most this many bytes (they are then in memory at once).
PREFETCH_BYTES = 1 << 30


def _prefetch_kernel(store: Store, model_id: int, settings: dict, out: dict[int, tuple[torch.Tensor, float]]) -> None:
    """Read and verify checkpoint ``model_id``'s stored kernel into ``out`` (a background task).

    Anything short of a sound kernel made with ``settings`` leaves ``out`` without it, and
    :func:`~trakcli.jobs.kernels.kernel_of` then reads, repairs or makes it in the main thread.
    """
    try:
        stored = store.read_kernel(model_id, settings)
    except Exception:  # noqa: BLE001  # corrupt or unreadable: handled (and reported) by kernel_of
        return
    if stored is not None:
        out[model_id] = (torch.from_numpy(stored[0]), stored[1])


def _target_features(rows: ChunkedRows, kept: dict[int, np.ndarray]) -> torch.Tensor:
    """One checkpoint's target features ``[n_target, proj_dim]`` float32: chunks taken out of ``kept``, the rest read."""
    parts = [kept.pop(c) if c in kept else rows.read("features", *rows.rows(c)) for c in range(rows.n_chunks)]
    return torch.from_numpy(np.concatenate(parts).astype(np.float32, copy=False))


def _finalize_and_score(
    store: Store, train_rows: list[ChunkedRows], target_rows: list[ChunkedRows], out: ChunkedRows,
    lambda_reg: float | None, lambda_rel: float, dist: Dist, reporter: Reporter, kept: list[dict[int, np.ndarray]],
    kernels: dict[int, tuple[torch.Tensor, float]],
) -> tuple[list[float], int]:
    """:func:`finalize_and_score` in its thread setting."""
    n_models = len(train_rows)
    lam_key = ridge_settings(lambda_reg, lambda_rel)
    proj_dim = store.layout.proj_dim
    if dist.world_size > 1:  # kernel m on rank m mod world_size, then every rank reads them all
        finalize_kernels(store, train_rows, lambda_reg=lambda_reg, lambda_rel=lambda_rel, dist=dist, reporter=reporter)
    pending = out.pending(dist.rank, dist.world_size)
    weights, primal, lambdas, dual_total = [], [], [], None
    for model_id in range(n_models):
        if model_id in kernels:
            kernel, lam = kernels.pop(model_id)
        elif dist.world_size == 1:  # one process: a missing kernel is made here
            kernel, lam = kernel_of(store, train_rows[model_id], model_id, lambda_reg=lambda_reg, lambda_rel=lambda_rel)
        else:
            stored = store.read_kernel(model_id, lam_key)
            if stored is None:
                raise StoreError(f"the kernel of model_id {model_id} is missing; rerun the same command")
            kernel, lam = torch.from_numpy(stored[0]), stored[1]
        lambdas.append(lam)
        if not pending:
            continue
        phi_t = _target_features(target_rows[model_id], kept[model_id])
        if kernel.shape[0] == proj_dim:  # PRIMAL: the Cholesky factor of Φ_mᵀΦ_m + λI
            weights.append(target_weights(kernel, phi_t, dtype=torch.float32))
            primal.append(train_rows[model_id])
        else:  # DUAL: X_m = (Φ_mΦ_mᵀ + λI)⁻¹Φ_m [n_train, proj_dim], n_train < proj_dim; the term Φ_t X_mᵀ
            term = phi_t @ kernel.T  # float32, as the primal products
            dual_total = term.double() if dual_total is None else dual_total.add_(term)
    report_notes(store, reporter)

    with reporter.task("score", len(pending)) as task:
        for chunk in pending:
            event(f"start score {chunk}")
            lo, hi = out.rows(chunk)
            feats = [torch.from_numpy(r.read("features", lo, hi).astype(np.float32, copy=False)) for r in primal]
            qs = [torch.from_numpy(r.read("out_to_loss", lo, hi)) for r in train_rows]
            if dual_total is None:
                scores = score_block(weights, feats, qs)
            else:  # dual terms, and primal ones of kernels an older trakcli stored (float32 products, as above)
                total = dual_total[:, lo:hi] + sum((w @ f.T).double() for w, f in zip(weights, feats))
                scores = ensemble_block(total, qs)
            out.write(chunk, scores=scores.numpy())
            event(f"done score {chunk}")
            task.advance()
    dist.barrier()
    return lambdas, len(pending)
