"""The Python API: :class:`Attributor`, TRAK over your own ``nn.Module`` and batches, on the jobs of
``trak featurize`` / ``trak score`` (the same store, resume, identity checks and scores; docs/guides/python-api.md).

Train rows are read as the jobs need them: a rows object (a text or tensor dataset) directly, a re-iterable of
batches (a ``DataLoader``, a list) streamed one store chunk at a time (:class:`~trakcli.data.loader.LoaderRows`),
a one-shot iterable or a shuffling DataLoader read into CPU memory; target batches are read into memory. Row
``i`` of the store is the ``i``-th example the batches yield: a reshuffled loader is another dataset, refused.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import torch

from trakcli.config import CurvatureConfig, DataConfig, ProjectorConfig, ScoreConfig, StoreConfig, validate_section
from trakcli.data.loader import LoaderRows, concat_batches, in_fixed_order, is_reiterable, tensor_batches
from trakcli.data.tensors import TensorDataset
from trakcli.distributed import Dist
from trakcli.curvature import Curvature
from trakcli.errors import ArgumentError, CheckpointError, ConfigError, StoreError, TrakError, worded
from trakcli.gradients import KroneckerFeaturizer
from trakcli.tasks import resolve_task, task_identity
from trakcli.jobs.featurize import featurize_rows
from trakcli.jobs.runtime import grad_memory_for, locked_store, resolve_device
from trakcli.data.stored import StoredRows
from trakcli.jobs.plan import RunFlags, ScorePlan
from trakcli.jobs.score import ScoreResult, score_result, score_targets
from trakcli.jobs.setup import JobSetup, attach_curvature, batch_rows_for, build_featurizer, curvature_selection
from trakcli.jobs.setup import run_identity
from trakcli.models.checkpoints import file_sha256, load_checkpoint, nonfinite_parameters
from trakcli.progress import Reporter, default_reporter
from trakcli.store import Store, StoreLayout
from trakcli.store.append import kept_rows
from trakcli.topk import TOP_K_ARRAYS

@dataclass(frozen=True)
class TopK:
    """The top of each target (:meth:`Attributor.top_k`), best first; equal scores by train index.

    Attributes:
        proponents: ``[n_target, k]`` int64 train indices of the highest scores.
        proponent_scores: ``[n_target, k]`` float32, descending.
        opponents: ``[n_target, k]`` int64 train indices of the lowest scores.
        opponent_scores: ``[n_target, k]`` float32, ascending.
    """

    proponents: np.ndarray
    proponent_scores: np.ndarray
    opponents: np.ndarray
    opponent_scores: np.ndarray


_DEFAULT_LAMBDA_REL: float = ScoreConfig.model_fields["lambda_rel"].default
#: The featurizer batch size of a rows object given to :meth:`Attributor.featurize` (``data.batch_size``'s default).
DEFAULT_BATCH_SIZE: int = DataConfig.model_fields["batch_size"].default


@contextmanager
def api_wording() -> Iterator[None]:
    """Re-raise a :class:`~trakcli.errors.TrakError` with its :class:`~trakcli.errors.Fix` worded for the Python
    API (``overwrite=True``, not the CLI's flags); other exceptions pass unchanged."""
    try:
        yield
    except TrakError as e:
        if e.fix is None:
            raise
        raise e.for_front("api") from None


def collect_batches(batches: Iterable[Any], name: str, task: Any = None) -> tuple[TensorDataset, int]:
    """All batches read into one CPU dataset, checked as ``trak featurize`` checks a data file; ``(the dataset,
    the rows of the first batch)``. ``name`` names the batches in messages; ``task`` (None: classification)
    checks the labels.

    Raises:
        DataError: no batches, a batch that is not tensors, batches that do not concatenate, inputs and labels
            of different lengths, or labels the task refuses.
    """
    parts = list(tensor_batches(batches, name))
    return concat_batches(parts, name, task), int(parts[0][1].shape[0])


def checkpoint_name_and_sha(checkpoint: Any) -> tuple[str, str]:
    """What the store records of a checkpoint: its path (or ``"<state dict>"``) and sha256 (of a state dict: over
    its sorted keys with each tensor's dtype, shape and bytes)."""
    if isinstance(checkpoint, Mapping):
        h = hashlib.sha256()
        for k in sorted(checkpoint):
            t = checkpoint[k].detach().cpu().contiguous()
            h.update(f"{k}|{t.dtype}|{list(t.shape)}|".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return "<state dict>", h.hexdigest()
    return str(checkpoint), file_sha256(checkpoint)


@dataclass
class ApiSetup(JobSetup):
    """A :class:`~trakcli.jobs.setup.JobSetup` whose checkpoints (``sources``, per model_id) may be state dicts."""

    sources: dict[int, Any] = field(default_factory=dict)

    def load(self, model_id: int) -> None:
        """Load checkpoint ``model_id`` (a file, or a state dict) onto the device.

        Raises:
            CheckpointError: the state dict does not fit the model, or has NaN / inf weights.
        """
        src = self.sources[model_id]
        if not isinstance(src, Mapping):
            load_checkpoint(self.model, src, model_id=model_id)
        else:
            try:
                self.model.load_state_dict(dict(src), strict=True)
            except RuntimeError as e:
                raise CheckpointError(f"the state dict given for model_id {model_id} does not fit the model: "
                                      f"{' '.join(str(e).split())[:400]}") from None
            bad = nonfinite_parameters(self.model)
            if bad:
                raise CheckpointError(f"the state dict given for model_id {model_id} has non-finite weights: "
                                      f"{', '.join(bad)}")
        self.model.to(self.device)


class Attributor:
    """TRAK over your own model and batches, in a store that ``trak inspect`` / ``trak export`` read.

    Args:
        model: the ``nn.Module`` (checkpoints are loaded into it in turn; it is put in eval mode).
        store: the store directory, or a ``store:`` section as a dict (``path``, ``chunk_rows``, ``dtype``,
            ``compressor``).
        task: ``classification`` (the margin ``logit_y − logsumexp_{j≠y} logit_j``),
            ``text_classification``, ``language_modeling``, a ``"file.py:fn"`` / ``"pkg.mod:fn"`` spec,
            a callable ``fn(logits [n, ...], batch) -> (f [n], Q [n])`` (``batch``: the batch's tensors by name,
            ``labels`` among them) or a :class:`trakcli.tasks.Task` (docs/guides/own-models.md, "Custom model outputs").
        projector: the ``projector:`` section as a dict (``kind``, ``proj_dim``, ``seed``, ...) or a
            :class:`~trakcli.config.ProjectorConfig`.
        grad_wrt: fnmatch patterns of the parameters to differentiate (None: all).
        gradient_method: as the config key: ``auto`` (layer hooks where they cover the model, else
            torch.func.vmap; the reason goes to ``reporter.info`` once), ``hooks`` or ``vmap``. Not part
            of the store identity (the gradients agree to float32 rounding).
        device: ``cpu``, ``cuda`` or ``auto``.
        batch_size: rows per featurizer batch (None: the rows of the first batch given), lowered to fit
            ``grad_memory_mb`` like ``data.batch_size``.
        grad_memory_mb: as ``data.grad_memory_mb`` (None: 1024 on a CPU, a quarter of the GPU's memory on a CUDA GPU).
        reporter: progress and messages; None: plain progress on stderr
            (:class:`trakcli.progress.StderrReporter`: one line rewritten in place on a terminal, else a line
            at the start and end of each step, at each tenth of its work and at least every 30 s). Pass
            ``trakcli.progress.NULL_REPORTER`` for none, or your own :class:`trakcli.progress.Reporter`.
        curvature: the ``curvature:`` section as a dict, a :class:`~trakcli.config.CurvatureConfig` or its kind (``"ekfac"``, ``{"kind": "kfac",
            "feature_damping": 0.1}``; docs/guides/curvature.md): fitted per checkpoint over the train batches by
            :meth:`featurize`, stored, and used by :meth:`score` through the stored features (``exact: false``;
            exact scores and the refinement need the train rows while scoring: `trak score` has them).

    Raises:
        ConfigError: a bad ``store``, ``projector``, ``task``, ``grad_wrt``, ``gradient_method`` or ``curvature``
            (parameters outside linear, convolution or embedding layers are named).
        ProjectorError, ModelError: the projector or a custom task function cannot be built or imported.
    """

    def __init__(
        self, model: torch.nn.Module, *, store: str | Path | dict[str, Any],
        task: str | Callable[..., Any] = "classification", projector: dict[str, Any] | ProjectorConfig | None = None,
        grad_wrt: str | list[str] | None = None, gradient_method: str = "auto", device: str = "auto",
        batch_size: int | None = None, grad_memory_mb: int | None = None, reporter: Reporter | None = None,
        curvature: str | dict[str, Any] | CurvatureConfig | None = None,
    ):
        self.store: StoreConfig = validate_section(StoreConfig, {"path": store} if isinstance(store, (str, Path)) else store, "store")
        if isinstance(projector, ProjectorConfig):  # a config object is its fields as given
            projector = projector.model_dump(exclude_unset=True)
        if isinstance(curvature, CurvatureConfig):
            curvature = curvature.model_dump(exclude_unset=True)
        self.projector: ProjectorConfig = validate_section(ProjectorConfig, projector or {}, "projector")
        self.task = resolve_task(task)
        self.grad_wrt = [grad_wrt] if isinstance(grad_wrt, str) else grad_wrt
        reporter = default_reporter() if reporter is None else reporter
        self.model, self.batch_size, self.reporter = model, batch_size, reporter
        self._streamed: dict[int, tuple[Any, LoaderRows]] = {}  # train batches by id: each fingerprinted once
        self.dist = Dist()
        self.device = resolve_device(device, self.dist)
        self.grad_memory_mb = grad_memory_mb = grad_memory_for(grad_memory_mb, self.device)
        raw = {"kind": curvature} if isinstance(curvature, str) else dict(curvature or {})
        if raw.get("exact"):
            raise ConfigError("curvature.exact: exact scores recompute the train gradients while scoring, which "
                              "Attributor.score does not see; use `trak score` with a config, or exact: false")
        self.curvature_config: CurvatureConfig = validate_section(CurvatureConfig, {"exact": False, **raw}, "curvature")
        c = self.curvature_config
        if c.kind != "gram":  # as `trak featurize`: kronecker unless a kind is given, the loss, the layers it factors
            if c.refine.iterations:
                raise ConfigError("curvature.refine: the conjugate-gradient refinement needs the training rows when "
                                  "scoring, which Attributor.score does not see; use `trak score` with a config")
            if "kind" not in (projector or {}):
                self.projector = self.projector.model_copy(update={"kind": "kronecker"})
        grad_wrt, task = curvature_selection(model, c, self.grad_wrt, self.task, reporter)
        self.featurizer = build_featurizer(model, self.projector, grad_wrt=grad_wrt, task=task,
                                           memory_mb=grad_memory_mb, gradient_method=gradient_method, reporter=reporter)
        if isinstance(self.featurizer, KroneckerFeaturizer):
            reporter.info(self.featurizer.info)
        self.curvature: Curvature | None = attach_curvature(self.featurizer, model, c, task)

    def _train_rows(self, batches: Any) -> tuple[Any, int]:
        """The train rows of ``batches`` (module docstring) and the default batch size."""
        if all(hasattr(batches, a) for a in ("__len__", "batches", "fingerprint")):  # a rows object
            return batches, DEFAULT_BATCH_SIZE
        if not is_reiterable(batches) or not in_fixed_order(batches):  # read once: one order, checked as a dataset
            return collect_batches(batches, "train batches", self.task)
        held = self._streamed.get(id(batches))
        if held is None or held[0] is not batches:
            held = self._streamed[id(batches)] = (batches, LoaderRows(batches, "train batches", self.task))
        return held[1], held[1].first_rows

    @property
    def path(self) -> Any:
        """The store: a local :class:`~pathlib.Path`, or a :class:`upath.UPath` for an ``s3://`` URL."""
        return self.store.location

    def _setup(self, n_train: int, train: Any, batch_size: int, sources: dict[int, Any]) -> ApiSetup:
        names, shas = {}, {}
        for m, src in sources.items():
            names[m], shas[m] = checkpoint_name_and_sha(src)
        ordered = sorted(sources)
        st, f = self.store, self.featurizer
        layout = StoreLayout(n_train, f.projector.proj_dim, st.chunk_rows, st.dtype, st.compressor)
        if isinstance(f, KroneckerFeaturizer):
            rows = batch_size  # no [n, grad_dim] gradient: memory_mb bounds the passes instead
        else:
            rows = batch_rows_for(batch_size, self.grad_memory_mb, f.grad_dim)
        model_desc = {"module": f"{type(self.model).__module__}.{type(self.model).__qualname__}", "api": True}
        identity = run_identity(model_desc, self.task, self.grad_wrt, f, train, layout, curvature=self.curvature)
        return ApiSetup([names[m] for m in ordered], [shas[m] for m in ordered], train, self.model, f, rows,
                        self.device, layout, identity, self.dist, curvature=self.curvature, sources=dict(sources),
                        save_every_s=self.store.save_every_s)

    def _config(self) -> dict[str, Any]:
        """What the store records as its ``config`` attribute."""
        return {"api": "trakcli.Attributor", **task_identity(self.task), "grad_wrt": self.grad_wrt,
                "projector": self.projector.model_dump(mode="json"), "store": self.store.model_dump(mode="json"),
                "curvature": self.curvature_config.model_dump(mode="json"), "device": str(self.device)}

    def featurize(self, batches: Iterable[Any], *, checkpoint: Any, model_id: int) -> int:
        """Train features of one checkpoint into ``train/<model_id>`` (traker's ``load_checkpoint`` + ``featurize``).

        Creates the store on the first call and checks it on later ones (model, task, grad_wrt,
        projector, the train batches' fingerprint, storage); a chunk already done is not recomputed,
        so an interrupted call resumes where it stopped. Batches that hold the store's rows and more
        after them grow the store: only the new rows are featurized (:mod:`trakcli.store.append`),
        and experiments scored before are stale until scored again with ``overwrite=True``.

        Args:
            batches: the train batches, the same rows in the same order on every call (see the module doc).
            checkpoint: a state dict file or a state dict in memory.
            model_id: the checkpoint's index, 0 to M-1 (``score`` reads model_ids ``0..len(checkpoints)-1``).

        Returns:
            Row chunks computed in this call (0: already done).

        Raises:
            DataError, GradientError, CheckpointError: bad batches, inputs, labels or checkpoint.
            StoreMismatchError: the store was made with other settings or train data, or holds ``model_id`` from another
                checkpoint (the message says to use another store path, or to delete the store).
            StoreError: the store is in use or cannot be written.
        """
        train, first = self._train_rows(batches)
        s = self._setup(len(train), train, self.batch_size or first, {model_id: checkpoint})
        with locked_store(self.path, self.dist, self.reporter):
            with api_wording():
                store = Store.create_or_check(self.path, s.identity, self._config(), layout=s.layout,
                                              prefix=train.fingerprint)  # more rows after the old: grown
                rows = store.train(model_id, s.checkpoints[0], s.shas[0])
            for note in store.notes:
                self.reporter.info(worded(note, "api"))
            store.notes.clear()
            if s.curvature is not None and rows.pending(0, 1, marked=False):  # fitted over the train batches before the features
                s.fit_curvature(model_id, store, self.reporter)
            n, _ = featurize_rows(s, train, rows, model_id, with_out_to_loss=True, skip_nonfinite=False,
                                  reporter=self.reporter, label="featurize", kept=kept_rows(store, model_id),
                                  save_every_s=self.store.save_every_s)
        return n

    def score(
        self, batches: Iterable[Any], *, checkpoints: list[Any], experiment: str = "default",
        lambda_reg: float | None = None, lambda_rel: float = _DEFAULT_LAMBDA_REL, normalize: str | None = None,
        overwrite: bool = False,
    ) -> ScoreResult:
        """Scores of the target batches against the featurized train set (traker's ``start_scoring_checkpoint``
        + ``score`` per checkpoint, then ``finalize_scores``), as ``trak score`` computes them.

        Args:
            batches: the target batches.
            checkpoints: the checkpoints of model_ids ``0..M-1``, as given to :meth:`featurize`
                (checked against the sha256 the store recorded).
            experiment: the name of this set of targets in the store (``scores/<experiment>``).
            lambda_reg, lambda_rel: the ridge, as ``score.lambda_reg`` / ``score.lambda_rel``.
            normalize: ``"unit"``: cosine scores in the kernel's space (``score.normalize``).
            overwrite: recompute this experiment's target features and scores.

        Returns:
            :class:`~trakcli.jobs.score.ScoreResult`, the result ``trak score`` and :func:`trakcli.score` return,
            read from the store when asked: ``.scores`` (``[n_target, n_train]`` float32, all in memory),
            ``.rows(lo, hi)`` (some targets' rows), ``n_target``, ``n_train``, ``lambdas``. For the top of each
            target at corpus scale, :meth:`top_k`.

        Raises:
            ConfigError: an ``experiment`` that is not one store group name (empty, with ``/`` or ``..``).
            StoreError: no store, or train features missing / incomplete for a model_id.
            StoreMismatchError: the store was featurized with other settings or checkpoints.
            StoreStaleError: the experiment was scored before train rows were appended (pass ``overwrite=True``).
            DataError, GradientError, CheckpointError: bad batches or checkpoints.
        """
        return self._score(batches, checkpoints, experiment, lambda_reg, lambda_rel, normalize, None, overwrite)

    def top_k(
        self, batches: Iterable[Any], k: int, *, checkpoints: list[Any], experiment: str = "default",
        lambda_reg: float | None = None, lambda_rel: float = _DEFAULT_LAMBDA_REL, normalize: str | None = None,
        full: bool = False, overwrite: bool = False,
    ) -> TopK:
        """Per target, the ``k`` highest- and lowest-scoring train rows, as ``trak score`` with ``score.top_k``.

        One streamed pass over the stored train features (:mod:`trakcli.topk`): memory does not grow with n_train, and
        the dense ``[n_target, n_train]`` matrix is neither formed nor stored unless ``full``.

        Args:
            batches: the target batches.
            k: how many of each side (at most n_train are returned).
            checkpoints, experiment, lambda_reg, lambda_rel, overwrite: as :meth:`score`.
            normalize: ``"unit"``: cosine scores in the kernel's space (``score.normalize``).
            full: also store the full score matrix (read it with :meth:`score`'s store path).

        Returns:
            :class:`TopK`: ``[n_target, k]`` indices and scores of proponents and opponents.

        Raises:
            ConfigError: ``k`` is not a positive int, or ``normalize`` is not None or "unit".
            As :meth:`score`.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"k={k!r}: give a positive int, the proponents and opponents kept per target")
        self._score(batches, checkpoints, experiment, lambda_reg, lambda_rel, normalize, (k, full), overwrite)
        store = Store.open_existing(self.path, mode="r")
        return TopK(**{name: store.read(f"scores/{experiment}/top_k/{name}") for name in TOP_K_ARRAYS})

    def select(
        self, batches: Iterable[Any], *, checkpoints: list[Any], fraction: float | None = None,
        count: int | None = None, groups: Any = None, aggregate: str = "max_mean", normalize: str | None = "unit",
        experiment: str = "select", overwrite: bool = False, quota: str | None = None,
    ) -> Any:
        """The train rows that most help the target batches' task (LESS: Xia et al. 2024), as ``trak select`` scores
        them: cosines of the stored features summed over checkpoints, aggregated over the targets
        (:mod:`trakcli.jobs.select`).

        Args:
            batches: the target batches (a handful of the task's examples).
            checkpoints: the checkpoints of model_ids ``0..M-1``, as given to :meth:`featurize`.
            fraction, count: how many rows to keep, as ``select.fraction`` / ``select.count`` (neither: 5%).
            groups: ``[n_target]`` group of each target (any values; ``aggregate="max_mean"``), or None: one group.
            aggregate, normalize, experiment: as ``select.aggregate``, ``select.normalize``, ``select.experiment``.
            overwrite: recompute the target features.
            quota: ``"equal"``: every group of ``groups`` keeps an equal share of the rows (``select.quota``); None:
                the rows are ranked together by their best group's score.

        Returns:
            :class:`trakcli.jobs.select.Selection`: ``scores`` ``[n_train]`` float64, ``ranked`` ``[k]`` int64
            (best first), ``rows`` (the same rows in train order).

        Raises:
            ConfigError: bad sizes, groups or options (as the ``select:`` keys).
            As :meth:`score` otherwise.
        """
        from trakcli.config.schema import SelectConfig
        from trakcli.jobs.select import group_codes, n_selected, select_rows

        validate_section(SelectConfig, {"fraction": fraction, "count": count, "aggregate": aggregate,
                                        "normalize": normalize, "experiment": experiment, "quota": quota,
                                        "group_by": None if groups is None else "groups"}, "select")
        target, stored, s = self._targets(batches, checkpoints)
        codes, names = group_codes(list(groups)) if groups is not None else (None, None)
        with api_wording():
            return select_rows(s, self.path, target, k=n_selected(stored.layout.n_train, fraction, count),
                               groups=codes, group_names=names, aggregate=aggregate, normalize=normalize,
                               experiment=experiment, overwrite=overwrite, reporter=self.reporter, quota=quota)

    def report(
        self, path: str | Path, *, experiment: str | None = None, k: int = 5, train: Any = None, target: Any = None,
        title: str | None = None,
    ) -> Path:
        """Write one self-contained HTML page of an experiment's answers, as ``trak report`` does.

        Per target its ``k`` proponents and opponents with their scores, read from the store (nothing is
        recomputed): the top-k of :meth:`top_k`, else the score matrix of :meth:`score`. The page
        (:func:`trakcli.report.render_report`) opens from the file in any browser.

        Args:
            path: the ``.html`` file to write (atomically).
            experiment: the experiment to show; None: the one this Attributor scored last.
            k: proponents and opponents per target (at most the ``k`` that :meth:`top_k` kept).
            train, target: what to show of the rows: lists of texts, pictures ``[n, H, W]`` /
                ``[n, C, H, W]``, or datasets; None: their indices only.
            title: the page's heading (default: the experiment).

        Returns:
            ``path`` as a :class:`~pathlib.Path`.

        Raises:
            ArgumentError: no ``experiment`` given and none scored by this Attributor.
            ConfigError: ``k`` is not a positive int.
            StoreError: the store has no finished scores of the experiment.
            StoreStaleError: its scores were made before train rows were appended (the message says to rescore
                with ``overwrite=True``).
            DataError: rows that do not match the experiment's train or target rows.
        """
        from trakcli.report import experiment_page, write_page

        experiment = experiment if experiment is not None else getattr(self, "_reported", None)
        if experiment is None:
            raise ArgumentError("Attributor.report: experiment=None, and this Attributor has scored nothing yet; call "
                                "score or top_k first, or name the stored experiment (experiment=...)")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"k={k!r}: give a positive int, the proponents and opponents shown per target")
        fix = "Attributor.score or Attributor.top_k"
        with api_wording():  # stale scores: rescore with overwrite=True
            page, _ = experiment_page(Store.open_existing(self.path, mode="r"), experiment, k, train=train,
                                      target=target, title=title, fix=fix)
        return write_page(path, page)

    def _score(
        self, batches: Iterable[Any], checkpoints: list[Any], experiment: str, lambda_reg: float | None,
        lambda_rel: float, normalize: str | None, top: tuple[int, bool] | None, overwrite: bool,
    ) -> ScoreResult:
        """Featurize the target batches and score them (:func:`~trakcli.jobs.score.score_targets`); the lazy result."""
        validate_section(ScoreConfig, {"experiment": experiment}, "score")  # one store group name, as in a config
        if normalize not in (None, "unit"):
            raise ConfigError(f"normalize={normalize!r}: use None (TRAK's scores) or 'unit' (cosine scores)")
        target, _, s = self._targets(batches, checkpoints)
        plan = ScorePlan(experiment=experiment, lambda_reg=lambda_reg, lambda_rel=lambda_rel,
                         top_k=top[0] if top else None, full=top is None or top[1], normalize=normalize)
        with api_wording():
            lambdas, computed = score_targets(s, self.path, target, plan, RunFlags(overwrite=overwrite), self.reporter)
        self._reported = experiment  # what report() shows by default
        return score_result(self.path, plan, s.train, target, lambdas, computed)

    def _targets(self, batches: Iterable[Any], checkpoints: list[Any]) -> tuple[TensorDataset, Store, ApiSetup]:
        """The target batches read, the store opened and the setup of its featurized train rows."""
        if not checkpoints:
            raise ConfigError("checkpoints: give the checkpoints of model_ids 0..M-1, as featurized")
        target, first = collect_batches(batches, "target batches", self.task)
        stored = Store.open_existing(self.path, mode="r")
        if not stored.identity:
            raise StoreError(f"the store {self.path} holds no train features yet; call Attributor.featurize first")
        known = StoredRows(stored.identity["train_data"], [])
        return target, stored, self._setup(stored.layout.n_train, known, self.batch_size or first,
                                           dict(enumerate(checkpoints)))
