"""What featurize and score share: the model, its gradients, the projector, the data, and the run identity.

The featurizer (:func:`build_featurizer`) is :class:`GradientFeaturizer` (per-example gradients of
``gradient_method``, then a projector) or, for ``projector.kind: kronecker``,
:class:`trakcli.gradients.KroneckerFeaturizer` (per-layer ``P_out ⊗ P_in`` features from one ordinary
forward + backward per batch). :func:`run_identity` is the one place a store's identity is built; the store
records it on creation and compares it on every later run (:meth:`trakcli.store.Store.create_or_check`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch

from trakcli.config import Config, ProjectorConfig
from trakcli.jobs.inputs import check_files, missing_train_files, resolve_checkpoints, resolve_optimizer_states
from trakcli.curvature import Curvature
from trakcli.data.load import load_dataset
from trakcli.data.stored import StoredRows
from trakcli.data.tensors import TensorDataset, index_inputs, inputs_to
from trakcli.distributed import Dist, init_from_env
from trakcli.errors import ConfigError, StoreError
from trakcli.gradients import KroneckerFeaturizer, LayerGradients, SecondMoment, check_method, per_example_gradients
from trakcli.gradients.second_moment import embedding_note
from trakcli.gradients.vmap import PerExampleGradients, select_parameters
from trakcli.curvature.kfac import curvature_layers, default_curvature_params
from trakcli.tasks import LossOutput, resolve_task, task_identity
from trakcli.jobs.runtime import apply_threads, event, grad_memory_for, resolve_device
from trakcli.models.build import build_model
from trakcli.models.checkpoints import file_sha256, load_checkpoint
from trakcli.models.peft import with_adapters
from trakcli.progress import NULL_REPORTER, Reporter
from trakcli.projectors import make_projector
from trakcli.store import Store, StoreLayout
from trakcli.store.hashes import HashCache

#: What computes ``(phi, q)`` of a batch in the featurize row loop.
Featurizer = Union["GradientFeaturizer", KroneckerFeaturizer]


def batch_rows_for(batch_size: int, grad_memory_mb: int, grad_dim: int) -> int:
    """``batch_size`` lowered so that ``rows x grad_dim`` float32 gradients fit ``grad_memory_mb`` MiB
    (:func:`~trakcli.jobs.runtime.grad_memory_for`); at least 1 (one example's gradient is never split)."""
    fit = (grad_memory_mb * 2**20) // (4 * max(1, grad_dim))
    return max(1, min(batch_size, fit))


def run_identity(model: dict[str, Any], task: Any, grad_wrt: list[str] | None, featurizer: Any, train: TensorDataset,
                 layout: StoreLayout, second_moment: SecondMoment | None = None,
                 curvature: Curvature | None = None) -> dict[str, Any]:
    """Everything the train features of a store depend on: recorded at creation, compared on every run.

    Args:
        model: what builds the model, JSON-able: ``model:`` of the config, or for :class:`trakcli.Attributor`
            the module's class.
        task: a built-in task name, a custom function spec or a callable (:func:`trakcli.tasks.task_identity`).
        grad_wrt: ``grad_wrt`` as written (None: every parameter).
        featurizer: its ``param_names``, ``grad_dim`` and ``projector`` (whose ``spec()`` fixes the matrix).
        train: the training set (its fingerprint).
        layout: the store layout (``chunk_rows``, ``dtype`` and ``compressor`` are recorded as ``storage``).
        second_moment, curvature: the gradient corrections, if any (their ``spec()``).

    Returns:
        A JSON-able dict: ``model``, the task's keys, ``grad_wrt``, ``grad_dim``, ``param_names``,
        ``projector``, ``train_data``, ``storage`` and, when set, ``second_moment`` and ``curvature``.
    """
    out = {
        "model": model, **task_identity(task), "grad_wrt": grad_wrt, "grad_dim": featurizer.grad_dim,
        "param_names": featurizer.param_names, "projector": featurizer.projector.spec(),
        "train_data": train.fingerprint(),
        "storage": {"chunk_rows": layout.chunk_rows, "dtype": layout.dtype, "compressor": layout.compressor},
    }
    if second_moment is not None:
        out["second_moment"] = second_moment.spec()
    if curvature is not None:
        out["curvature"] = curvature.spec()
    return out


class GradientFeaturizer:
    """Features of a batch: per-example gradients of the model output function, projected (anything with this
    ``__call__`` and these attributes can stand in, e.g. :class:`trakcli.gradients.KroneckerFeaturizer`).

    Args:
        grads: per-example gradients of the model (holds the model): layer hooks or vmap.
        projector: the JL projector, ``[grad_dim] -> [proj_dim]`` per ``model_id``.
        reporter: gets ``grads.reason`` (why ``gradient_method: auto`` uses vmap) once, when it is known.

    Attributes:
        grad_dim, param_names, proj_dim: the selected parameters' entries and names, the feature width.
        second_moment: None, or a :class:`~trakcli.gradients.SecondMoment` scaling each gradient (TrackStar).
        curvature: None, or a :class:`~trakcli.curvature.Curvature` whitening each gradient (after the scaling).
    """

    def __init__(self, grads: PerExampleGradients | LayerGradients, projector: Any, reporter: Reporter = NULL_REPORTER):
        self.grads, self.projector, self.reporter = grads, projector, reporter
        self.grad_dim: int = grads.grad_dim
        self.param_names: list[str] = grads.param_names
        self.proj_dim: int = projector.proj_dim
        self.reported: str | None = None
        self.second_moment: SecondMoment | None = None
        self.curvature: Curvature | None = None
        self._report()

    def _report(self) -> None:
        if self.grads.reason is not None and self.grads.reason != self.reported:
            self.reported = self.grads.reason
            self.reporter.info(self.grads.reason)

    def __call__(self, inputs: Any, labels: torch.Tensor, model_id: int, row_offset: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(phi, q)`` of one batch: ``[n, proj_dim]`` float32 features and ``[n]`` float32 ``Q = 1 - p_y``, on the
        model's device, for ``inputs`` (``[n, ...]`` or a dict of ``[n, L]``) and ``[n]`` int64 ``labels`` on the
        device; ``row_offset`` (the first row's index) names a failing example.

        Raises:
            GradientError: the batch cannot be differentiated.
        """
        g, q = self.transformed(inputs, labels, model_id, row_offset)
        return self.projector.project(g, model_id=model_id), q

    def transformed(self, inputs: Any, labels: torch.Tensor, model_id: int, row_offset: int,
                    curvature: Curvature | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``(g, q)`` of a batch as it is projected: ``g[name]`` ``[n, *shape]`` gradients scaled by
        ``second_moment`` and whitened by ``curvature`` (default: :attr:`curvature`), ``q`` ``[n]`` float32."""
        g, q = self.grads(inputs, labels, row_offset=row_offset)  # g[name]: [n, *shape], [n]
        self._report()
        if self.second_moment is not None:
            g = self.second_moment.scale_gradients(g, model_id)
        curvature = curvature or self.curvature
        if curvature is not None:
            g = curvature.whiten(g, model_id)
        return g, q


def rows_of(data: Any, indices: list[int], batch_rows: int, max_tokens: int | None = None) -> list[tuple[Any, torch.Tensor]]:
    """The rows ``indices`` of a dataset as ``(inputs, labels)`` batches of at most ``batch_rows`` rows (CPU):
    text data through its ``batches_of`` (``max_tokens`` padded tokens at most), tensors by indexing."""
    if hasattr(data, "batches_of"):
        return [(x, y) for _, x, y in data.batches_of(indices, batch_rows, max_tokens)]
    out = []
    for lo in range(0, len(indices), batch_rows):
        idx = torch.tensor(indices[lo:lo + batch_rows], dtype=torch.long)
        out.append((index_inputs(data.inputs, idx), data.labels[idx]))
    return out


@dataclass
class JobSetup:
    """Everything featurize and score share (:func:`prepare`).

    Attributes:
        checkpoints, shas: the checkpoint files by model_id and their sha256.
        train, model: the training set; the model (checkpoints are loaded into it in turn).
        featurizer: computes ``(phi, q)`` of a batch (:data:`Featurizer`).
        batch_rows, batch_tokens: rows per batch (:func:`batch_rows_for`; kronecker: ``data.batch_size``); most
            tokens per batch of token data (``data.batch_tokens``; None: rows only).
        device, dist: the model's device; this process's rank and world size.
        layout, identity: the shapes and storage of the store's arrays; its identity (:func:`run_identity`).
        states, state_shas: with ``second_moment.kind``, each checkpoint's optimizer state file and its sha256.
        curvature, refine: with ``curvature.kind`` kfac or ekfac, the featurizer's
            :class:`~trakcli.curvature.Curvature` and ``curvature.refine`` (:meth:`refine_targets`); else None.
        exact_damping, query_rank: with ``curvature.exact``, ``curvature.damping`` (else None);
            ``curvature.query_rank`` (the exact scores' rank of the targets' layer gradients; None: as memory allows).
        save_every_s: ``store.save_every_s``: seconds of work between two saves of a curvature pass's running sums
            and of the exact scores' rows.
    """

    checkpoints: list[Path]
    shas: list[str]
    train: TensorDataset
    model: torch.nn.Module
    featurizer: Featurizer
    batch_rows: int
    device: torch.device
    layout: StoreLayout
    identity: dict[str, Any]
    dist: Dist
    batch_tokens: int | None = None
    states: list[Path] | None = None
    state_shas: list[str] | None = None
    curvature: Curvature | None = None
    refine: Any = None
    exact_damping: float | None = None
    query_rank: int | None = None
    save_every_s: float = 30.0

    def state_record(self, model_id: int) -> tuple[str, str] | None:
        """``(optimizer state file, its sha256)`` of checkpoint ``model_id`` with a correction, else None."""
        if self.states is None or self.state_shas is None:
            return None
        return str(self.states[model_id]), self.state_shas[model_id]

    def batches(self, data: Any, start: int, stop: int):
        """``data.batches`` of rows ``[start, stop)``: at most ``batch_rows`` rows (token data: ``batch_tokens``)."""
        return data.batches(start, stop, self.batch_rows, max_tokens=self.batch_tokens)

    @property
    def grad_dim(self) -> int:
        """Entries of one example's gradient (the featurizer's)."""
        return self.featurizer.grad_dim

    @property
    def proj_dim(self) -> int:
        """Feature width: the store layout's, which is the projector's."""
        return self.layout.proj_dim

    def fit_curvature(self, model_id: int, store: Any = None, reporter: Reporter = NULL_REPORTER) -> None:
        """Fit (or read from ``store``) checkpoint ``model_id``'s curvature, if there is one, after loading it: each
        pass reports its rows and saves its running sums to ``store`` every :attr:`save_every_s` seconds of work, so
        a killed fit resumes (:meth:`~trakcli.curvature.Curvature.fit`). Under torchrun rank 0 fits and writes it
        and the other ranks read it (``store`` required)."""
        if self.curvature is None:
            return
        if self.dist.is_main or store is None:
            self.load(model_id)
            n = len(self.train)
            pick = self._sample(self.curvature.fit_rows)  # the same rows for every pass and rerun
            rows = n if pick is None else len(pick)
            stages: list[str] = []

            def batches():
                chunks = (((x, y) for _, x, y in self.batches(self.train, 0, n)) if pick is None else
                          iter(rows_of(self.train, pick, self.batch_rows, self.batch_tokens)))
                label = f"model {model_id}: {self.curvature.kind} {stages[-1] if stages else 'fit'}"
                with reporter.task(label, rows) as task:
                    for x, y in chunks:
                        yield inputs_to(x, self.device), y.to(self.device)
                        task.advance(len(y))

            def stage(name: str) -> None:
                stages.append(name)
                event(f"start curvature-{name} {model_id}")
                reporter.info(f"model {model_id}: fitting {self.curvature.kind} curvature ({name}) over "
                              f"{rows} train rows{'' if pick is None else f' (a sample of {n}, curvature.fit_rows)'}")

            def on_event(kind: str, name: str, a: int, b: int) -> None:
                event(f"{kind} curvature-{name} {model_id} {a}" + (f" {b}" if kind == "batch" else ""))
                if kind == "resume":
                    reporter.info(f"model {model_id}: the {name} pass resumes after its {a} saved rows of {rows}")

            event(f"start curvature {model_id}")
            self.curvature.fit(model_id, batches, store, stage, self.save_every_s, on_event)
            event(f"done curvature {model_id}")
        if store is not None and self.dist.world_size > 1:
            self.dist.barrier()
            if not self.dist.is_main:
                self.curvature.read(store, model_id)

    def _sample(self, k: int | None) -> list[int] | None:
        """A sample of ``k`` train rows seeded with ``curvature.seed``, sorted (None: ``k`` None or every row)."""
        n = len(self.train)
        if k is None or k >= n:
            return None
        gen = torch.Generator().manual_seed(self.curvature.seed)
        return sorted(torch.randperm(n, generator=gen)[:k].tolist())

    def check_curvature(self, rows: int) -> None:
        """A trial of the curvature on the first ``rows`` train rows (one batch, checkpoint 0, the standard basis in
        place of eigendecompositions), featurized with it and kept nowhere: what the curvature cannot use fails
        before a store exists.

        Raises:
            GradientError, DataError, ConfigError, ...: whatever the fit or the features of the batch raise.
        """
        if self.curvature is None or not len(self.train) or rows <= 0:
            return
        off, x, y = next(self.batches(self.train, 0, min(len(self.train), rows)))
        batch = [(inputs_to(x, self.device), y.to(self.device))]
        try:
            self.curvature.fit(0, lambda: iter(batch), trial=True)
            self.features(x, y, 0, off)
        finally:
            self.curvature.forget(0)

    def refine_targets(self, curvature: Curvature | None = None) -> None:
        """Turn on ``curvature.refine``'s conjugate-gradient refinement of ``curvature`` (default: the featurizer's)
        for the features computed next (the targets), over a seeded sample of ``refine.samples`` train rows."""
        curvature = curvature or self.curvature
        if curvature is None or self.refine is None or not self.refine.iterations:
            return
        pick = self._sample(self.refine.samples)
        pick = list(range(len(self.train))) if pick is None else pick

        def batches():
            return [(inputs_to(x, self.device), y.to(self.device))
                    for x, y in rows_of(self.train, pick, self.batch_rows, self.batch_tokens)]

        curvature.refine_targets(batches, self.refine.iterations, self.refine.tol)

    def load(self, model_id: int) -> None:
        """Load checkpoint ``model_id`` into the model and move it to the device."""
        load_checkpoint(self.model, self.checkpoints[model_id], model_id=model_id)
        self.model.to(self.device)

    def features(self, inputs: Any, labels: torch.Tensor, model_id: int, row_offset: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``featurizer(inputs, labels, model_id, row_offset)`` of a batch moved to the device: ``(phi [n, proj_dim]
        float32, q [n])``."""
        return self.featurizer(inputs_to(inputs, self.device), labels.to(self.device), model_id, row_offset)


def build_featurizer(
    model: torch.nn.Module, projector: ProjectorConfig, *, grad_wrt: list[str] | None, task: Any, memory_mb: int,
    gradient_method: str = "auto", reporter: Reporter = NULL_REPORTER,
) -> Featurizer:
    """The featurizer of a config's ``projector:`` section.

    ``kronecker``: a :class:`~trakcli.gradients.KroneckerFeaturizer` over the layers ``grad_wrt`` selects, its
    activations and output gradients bounded by ``memory_mb`` (``data.grad_memory_mb`` for the device); every
    other kind: :class:`GradientFeaturizer` over the per-example gradients of ``gradient_method`` (ignored by
    kronecker) with :func:`~trakcli.projectors.make_projector`'s projector; ``reporter`` gets why ``auto`` uses vmap.

    Raises:
        ConfigError: a bad ``grad_wrt``, or one selecting only parameters outside the supported (kronecker) or
            hooked (``gradient_method: hooks``) layers (named).
        ProjectorError: bad projector options.
    """
    check_method(gradient_method)
    if projector.kind == "kronecker":
        return KroneckerFeaturizer(model, **projector.kronecker_options(), grad_wrt=grad_wrt, task=task,
                                   memory_mb=memory_mb)
    grads = per_example_gradients(model, grad_wrt, task, gradient_method)
    return GradientFeaturizer(grads, make_projector(**projector.options(), grad_dim=grads.grad_dim), reporter)


def prepare(
    cfg: Config, *, need_target: bool = False, rehash: bool = False, reporter: Reporter = NULL_REPORTER,
    train_from_store: bool = False,
) -> JobSetup:
    """Check the input files, build the model and featurizer, load the train data, hash the checkpoints.

    Checkpoint sha256s come from the store's hash cache (:class:`~trakcli.store.hashes.HashCache`) while size and
    mtime are unchanged (``rehash``, ``--verify``: hashed again); with ``second_moment.kind`` the optimizer state
    files are found (:func:`~trakcli.jobs.inputs.resolve_optimizer_states`) and hashed too. PEFT adapter folders
    as checkpoints wrap the model (``grad_wrt`` then defaults to the adapter's parameters). The featurizer's notes
    (kronecker's coverage, why vmap) go to ``reporter.info`` once, on rank 0. With ``train_from_store``, data.train
    files that are gone are read from the store's record (:class:`~trakcli.data.stored.StoredRows`).

    Raises:
        ConfigError: a missing file, ``cuda`` without a GPU, or a bad ``grad_wrt``.
        DataError, ModelError, ProjectorError: the data, model or projector cannot be built.
    """
    hashes = HashCache.for_store(cfg.store.path)  # sha256s by (path, size, mtime_ns), beside the store
    if rehash:
        hashes.forget()
    missing = missing_train_files(cfg) if train_from_store else []
    check_files(cfg, need_checkpoints=True, need_target=need_target, need_train=not missing)
    apply_threads(cfg.num_threads)
    checkpoints = resolve_checkpoints(cfg, hashes)
    dist = init_from_env()
    device = resolve_device(cfg.device, dist)
    main_reporter = reporter if dist.is_main else NULL_REPORTER
    main_reporter.phase("loading data.train …")
    train = _stored_train(cfg, missing, main_reporter) if missing else \
        load_dataset(cfg.data.train, key="data.train", task=resolve_task(cfg.task))
    main_reporter.phase(f"loading the model {cfg.model.entrypoint} …")
    model = with_adapters(build_model(cfg.model.entrypoint, **cfg.model.kwargs), checkpoints)
    memory_mb = grad_memory_for(cfg.data.grad_memory_mb, device)
    c = cfg.curvature
    grad_wrt, task = curvature_selection(model, c, cfg.grad_wrt, cfg.task, main_reporter)
    featurizer = build_featurizer(model, cfg.projector, grad_wrt=grad_wrt, task=task, memory_mb=memory_mb,
                                  gradient_method=cfg.gradient_method, reporter=main_reporter)
    states = state_shas = second = None
    if cfg.second_moment.kind is not None:
        states = resolve_optimizer_states(cfg, checkpoints)
        state_shas = [hashes.sha256(p, file_sha256) for p in states]
        second = attach_second_moment(featurizer, model, cfg.second_moment.kind, states, cfg.second_moment.eps)
        note = embedding_note(model, featurizer.param_names)
        if note:
            main_reporter.info(note)
    curvature = attach_curvature(featurizer, model, c, task)
    if curvature is not None and not isinstance(featurizer, KroneckerFeaturizer):
        main_reporter.info(f"curvature {c.kind} with projector.kind {cfg.projector.kind}: whole per-example gradients "
                           "are whitened before the projection (projector.kind kronecker folds the curvature into "
                           "its per-layer factors instead, much faster on a large model)")
    if isinstance(featurizer, KroneckerFeaturizer):
        batch_rows = cfg.data.batch_size  # no [n, grad_dim] gradient: memory_mb bounds the passes instead
        main_reporter.info(featurizer.info)
    else:
        batch_rows = batch_rows_for(cfg.data.batch_size, memory_mb, featurizer.grad_dim)
    st = cfg.store
    layout = StoreLayout(len(train), featurizer.projector.proj_dim, st.chunk_rows, st.dtype, st.compressor)
    identity = run_identity(cfg.model.model_dump(mode="json"), cfg.task, cfg.grad_wrt, featurizer, train, layout,
                            second, curvature)
    with main_reporter.phase("hashing the checkpoint files (once per file) …"):
        shas = [hashes.sha256(c, file_sha256) for c in checkpoints]  # saved by jobs.runtime.locked_store
    return JobSetup(checkpoints, shas, train, model, featurizer, batch_rows, device, layout, identity, dist,
                    cfg.data.batch_tokens, states, state_shas, curvature, c.refine if curvature is not None else None,
                    c.damping if curvature is not None and c.exact else None, c.query_rank, cfg.store.save_every_s)


def curvature_selection(model: torch.nn.Module, curvature: Any, grad_wrt: list[str] | None, task: Any,
                        reporter: Reporter = NULL_REPORTER) -> tuple[list[str] | None, Any]:
    """The ``grad_wrt`` and task of a ``curvature:`` section's featurizer (``gram``: unchanged): ``output: loss``
    wraps the task in :class:`~trakcli.tasks.LossOutput`; ``grad_wrt`` unset selects every layer the curvature
    can factor (:func:`~trakcli.curvature.kfac.default_curvature_params`, its line to ``reporter``).

    Raises:
        ConfigError: no layer to factor, or a selected parameter outside them (named).
    """
    if curvature.kind == "gram":
        return grad_wrt, task
    if curvature.output == "loss":  # influence functions' gradient: the training loss on both sides, Q = 1
        task = LossOutput(resolve_task(task))
    if grad_wrt is None:
        grad_wrt, line = default_curvature_params(model, curvature.kind)
        reporter.info(line)
    else:
        curvature_layers(model, select_parameters(model, grad_wrt), curvature.kind)
    return grad_wrt, task


def attach_curvature(featurizer: Featurizer, model: torch.nn.Module, curvature: Any, task: Any) -> Curvature | None:
    """The :class:`~trakcli.curvature.Curvature` of a ``curvature:`` section over ``featurizer``'s parameters, set as
    its ``curvature`` (None for ``gram``); ``task`` as :func:`curvature_selection` returned it."""
    if curvature.kind == "gram":
        return None
    out = Curvature(model, featurizer.param_names, task, curvature.kind, curvature.feature_damping, curvature.fisher,
                    curvature.seed, output=curvature.output, fit_rows=curvature.fit_rows)
    featurizer.curvature = out
    return out


def _stored_train(cfg: Config, missing: list[str], reporter: Reporter) -> StoredRows:
    """The train rows as the store recorded them (count and fingerprint) when ``data.train``'s files are gone;
    without recorded rows, ConfigError naming the missing files (:func:`~trakcli.jobs.inputs.check_files`)."""
    try:
        fingerprint = Store.open_existing(cfg.store.location, mode="r").identity.get("train_data")
    except StoreError:
        fingerprint = None
    if not fingerprint:
        check_files(cfg, need_checkpoints=False)  # raises: the missing file, as without a store
    reporter.info(f"data.train's file {', '.join(missing)} is missing: the train features and their fingerprint "
                  f"are read from the store (n_train {fingerprint['n']}); train texts and labels are unavailable")
    return StoredRows(fingerprint, missing)


def attach_second_moment(featurizer: Featurizer, model: torch.nn.Module, kind: str, states: list[Path],
                         eps: float | None = None) -> SecondMoment:
    """Set ``featurizer.second_moment`` to the correction of ``kind`` (``adafactor`` or ``adam``) read from
    ``states`` (each checkpoint's optimizer state file, by model_id) with ``eps`` (``second_moment.eps``; None:
    the saved optimizer's eps squared), and return it. A :class:`~trakcli.gradients.KroneckerFeaturizer` folds
    the per-layer Adafactor scaling into its factors; a :class:`GradientFeaturizer` scales each gradient.

    Raises:
        ConfigError: ``adam`` with a Kronecker featurizer, or a bad ``kind`` or ``eps``.
    """
    kronecker = isinstance(featurizer, KroneckerFeaturizer)
    if kronecker and kind != "adafactor":
        raise ConfigError(f"second_moment.kind: {kind} scales each entry of the whole per-example gradient, which "
                          "projector.kind kronecker never forms; use second_moment.kind: adafactor (factored per "
                          "layer) or another projector kind")
    second = SecondMoment(model, featurizer.param_names, kind, states, eps,
                          layers=featurizer.layers if kronecker else None)
    featurizer.second_moment = second
    return second
