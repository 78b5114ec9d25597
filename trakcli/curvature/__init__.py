"""Curvature beyond TRAK's kernel: K-FAC and EK-FAC, fit per checkpoint and stored like the kernel.

``curvature.kind: gram`` is TRAK's kernel over the projected features (:mod:`trakcli.scoring`). ``kfac`` and ``ekfac``
(:mod:`.kfac`) fit per-layer Kronecker factors of the Fisher over the training data of each checkpoint, store them
(``train/<model_id>/curvature``, :mod:`trakcli.store.curvature`), and whiten every per-example gradient by the damped
inverse before it is projected; :class:`Curvature` holds the settings, the layers and the fitted factors of the
checkpoints, and is what a featurizer consults.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from trakcli.curvature.kfac import (
    FISHERS, KINDS, CurvatureFactors, LayerFactors, PassState, ResumeMismatch, correct_eigenvalues, curvature_layers,
    eigenbases, fit_covariances, fisher_loss,
)
from trakcli.curvature.refine import GaussNewton, refine
from trakcli.errors import ConfigError, StoreError
from trakcli.tasks import Task, resolve_task

__all__ = [
    "FISHERS", "KINDS", "Curvature", "CurvatureFactors", "LayerFactors", "PassState", "correct_eigenvalues", "curvature_layers",
    "eigenbases", "fisher_loss", "fit_covariances", "GaussNewton", "refine",
]


class Curvature:
    """The K-FAC / EK-FAC curvature of a model's selected parameters, per checkpoint.

    Args:
        model: the model (its layers; checkpoints are loaded into it by the caller).
        param_names: the selected parameters, every one in a linear, convolution or embedding layer.
        task: the model output function (its :meth:`~trakcli.tasks.Task.loss` is what the Fisher is of).
        kind: ``kfac`` or ``ekfac``.
        damping: relative damping of the whitening (δ = damping · mean eigenvalue, per layer), > 0:
            ``curvature.feature_damping`` for the stored features, ``curvature.damping`` for exact scores
            (:meth:`with_damping`).
        fisher: ``true`` (sampled labels) or ``empirical``.
        seed: seed of the sampled labels.
        output: ``curvature.output`` (``loss``: ``task`` is a :class:`~trakcli.tasks.LossOutput`; part of :meth:`spec`).
        fit_rows: ``curvature.fit_rows``, the size of the fit's sample (None: every row; part of :meth:`spec`).

    Raises:
        ConfigError: a bad kind, damping or fisher; parameters outside such layers (:func:`curvature_layers`).
    """

    def __init__(self, model: nn.Module, param_names: Sequence[str], task: Any, kind: str, damping: float = 0.1,
                 fisher: str = "true", seed: int = 0, output: str = "margin", fit_rows: int | None = None):
        if kind not in KINDS:
            raise ConfigError(f"curvature.kind must be gram, {' or '.join(KINDS)}, got {kind!r}")
        if fisher not in FISHERS:
            raise ConfigError(f"curvature.fisher must be one of {', '.join(FISHERS)}, got {fisher!r}")
        if not (isinstance(damping, (int, float)) and damping > 0):
            raise ConfigError(f"curvature damping must be a number > 0, got {damping!r}")
        self.kind, self.damping, self.fisher, self.seed = kind, float(damping), fisher, int(seed)
        self.task: Task = resolve_task(task)
        self.model, self.output, self.fit_rows = model, output, fit_rows
        self.layers, self.uses = curvature_layers(model, param_names, kind)
        self._factors: dict[int, CurvatureFactors] = {}
        self.refine_iterations, self.refine_tol = 0, 1e-4
        self._refine_batches: Callable[[], Sequence[Any]] | None = None
        self._gauss_newton: tuple[int, GaussNewton] | None = None
        self._folded: tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    def refine_targets(self, batches: Callable[[], Sequence[Any]] | None, iterations: int = 0,
                       tol: float = 1e-4) -> None:
        """Refine, from now on, the features :meth:`whiten` gives (the targets') by ``iterations`` conjugate-gradient
        steps on the Gauss-Newton matrix over ``batches()`` (:mod:`.refine`); ``batches=None`` turns it off.

        Args:
            batches: the training sample, ``(inputs, labels)`` on the model's device (called once per checkpoint).
            iterations: most steps per target (0: off).
            tol: relative residual at which a target's iterations stop.
        """
        self._refine_batches = batches if iterations > 0 else None
        self.refine_iterations, self.refine_tol = iterations, tol
        self._gauss_newton = None

    def spec(self) -> dict[str, Any]:
        """``{"kind", "feature_damping", "fisher", "seed"}`` (and ``output`` unless ``margin``, ``fit_rows`` when
        set): what the features depend on besides the data and checkpoint (the config's
        :meth:`~trakcli.config.CurvatureConfig.spec`)."""
        spec = {"kind": self.kind, "feature_damping": self.damping, "fisher": self.fisher, "seed": self.seed}
        if self.output != "margin":
            spec["output"] = self.output
        if self.fit_rows is not None:
            spec["fit_rows"] = self.fit_rows
        return spec

    def with_damping(self, damping: float) -> Curvature:
        """The same fitted curvature whitening with another damping (exact scores: ``curvature.damping``); the
        fits already read are shared, the refinement is off."""
        other = copy.copy(self)
        other.damping = float(damping)
        other._factors = {m: CurvatureFactors(f.layers, f.factors, other.damping) for m, f in self._factors.items()}
        other._refine_batches, other._gauss_newton, other._folded = None, None, None
        return other

    def settings(self) -> dict[str, Any]:
        """What a stored curvature is checked against: :meth:`spec` but the damping (applied when whitening,
        so another damping reuses the fit) and each layer's name and shape."""
        spec = {k: v for k, v in self.spec().items() if k not in ("feature_damping", "output")}
        return {**spec, "layers": [[layer.name, layer.d_out, layer.d_in] for layer in self.layers]}

    def factors(self, model_id: int) -> CurvatureFactors:
        """The fitted curvature of checkpoint ``model_id``.

        Raises:
            StoreError: it was neither fitted nor read in this process (run `trak featurize` first).
        """
        f = self._factors.get(model_id)
        if f is None:
            raise StoreError(f"the curvature of model_id {model_id} is not in the store; run `trak featurize CONFIG` "
                             "first (it fits the curvature of each checkpoint before its features)")
        return f

    def whiten(self, grads: dict[str, torch.Tensor], model_id: int) -> dict[str, torch.Tensor]:
        """Per-example gradients ``[n, *shape]`` whitened by checkpoint ``model_id``'s curvature
        (:meth:`~trakcli.curvature.kfac.CurvatureFactors.whiten`); with :meth:`refine_targets` on, the
        duals ``W⁻ᵀ x`` of their refined inverse-Hessian-vector products ``x`` instead (:mod:`.refine`)."""
        factors = self.factors(model_id)
        if self._refine_batches is None:
            return factors.whiten(grads)
        if self._gauss_newton is None or self._gauss_newton[0] != model_id:  # the model holds checkpoint model_id
            self._gauss_newton = (model_id, GaussNewton(self.model, list(grads), self.task, self._refine_batches()))
        gn = self._gauss_newton[1]
        first = next(iter(grads.values()))
        rows = []
        for i in range(first.shape[0]):
            x = refine(factors, gn, {n: g[i] for n, g in grads.items()}, self.refine_iterations, self.refine_tol)
            rows.append(factors.dual({n: t[None].to(first.dtype) for n, t in x.items()}))
        return {n: torch.cat([r[n] for r in rows]) for n in grads}

    def fit(self, model_id: int, batches: Callable[[], Iterable[Any]], store: Any = None,
            on_stage: Callable[[str], None] | None = None, save_every_s: float = 30.0,
            on_event: Callable[[str, str, int, int], None] | None = None, trial: bool = False) -> CurvatureFactors:
        """Fit checkpoint ``model_id`` (loaded into the model) over ``batches()``, resuming from and writing to ``store``.

        With a store: a finished curvature of the same :meth:`settings` is read, not fitted; stored covariances (pass 1)
        are reused; each stage is written when done (:func:`trakcli.store.curvature.write_curvature`); a pass's running
        sums are saved every ``save_every_s`` seconds of work (:func:`trakcli.store.curvature.write_partial`) and a pass
        resumes after them, ending with the factors of an uninterrupted fit bit for bit; a save that does not fit the
        batches (another ``data.batch_size``) is dropped and the pass starts over.

        Args:
            model_id: the checkpoint.
            batches: called once per pass; yields ``(inputs, labels)`` on the model's device, the same batches
                on every call.
            store: the open :class:`~trakcli.store.Store`, or None.
            on_stage: called with ``"covariances"``, ``"eigenvalues"`` before each pass that runs.
            save_every_s: seconds of work between two saves of a pass's sums (0: after every batch).
            on_event: called as ``on_event(kind, pass, a, b)``: ``("batch", pass, lo, hi)`` after the rows
                ``[lo, hi)`` are added, ``("partial", pass, rows, 0)`` after a save, ``("resume", pass, rows, 0)``
                when a pass starts after saved rows.
            trial: every pass, with the standard basis in place of the eigendecompositions (a trial of the
                passes, not factors to use: :func:`~trakcli.curvature.kfac.eigenbases`); without a store.

        Returns:
            The factors (also kept for :meth:`whiten`).
        """
        from trakcli.store.curvature import read_curvature, write_curvature

        settings = self.settings()
        done = read_curvature(store, model_id, settings, "done") if store is not None else None
        if done is not None:
            return self._keep(model_id, CurvatureFactors.from_arrays(self.layers, done, self.damping))
        cov = read_curvature(store, model_id, settings, "covariances") if store is not None else None
        if cov is not None:
            a = [torch.as_tensor(cov[f"{i}/a"]) for i in range(len(self.layers))]
            s = [torch.as_tensor(cov[f"{i}/s"]) for i in range(len(self.layers))]
        else:
            if on_stage:
                on_stage("covariances")
            a, s = self._pass("covariances", model_id, store, save_every_s, on_event,
                              lambda resume, on_batch: fit_covariances(
                                  self.model, self.layers, self.uses, self.task, batches(), self.fisher,
                                  self.seed + 2 * model_id, resume, on_batch))
            if store is not None:
                write_curvature(store, model_id, settings, "covariances", {
                    **{f"{i}/a": x.numpy() for i, x in enumerate(a)}, **{f"{i}/s": x.numpy() for i, x in enumerate(s)}})
        factors = eigenbases(self.layers, a, s, decompose=not trial)
        del a, s, cov  # decomposed: the eigenvalue pass needs the bases alone (a language model's are gigabytes)
        if self.kind == "ekfac":
            if on_stage:
                on_stage("eigenvalues")
            bases = factors
            factors = self._pass("eigenvalues", model_id, store, save_every_s, on_event,
                                 lambda resume, on_batch: correct_eigenvalues(
                                     self.model, self.layers, self.uses, self.task, bases, batches(), self.fisher,
                                     self.seed + 2 * model_id + 1, resume, on_batch))
        f = CurvatureFactors(list(self.layers), factors, self.damping)
        if store is not None:
            write_curvature(store, model_id, settings, "done", f.arrays())
        return self._keep(model_id, f)

    def _pass(self, name: str, model_id: int, store: Any, save_every_s: float,
              on_event: Callable[[str, str, int, int], None] | None,
              run: Callable[[PassState | None, Any], Any]) -> Any:
        """``run(resume, on_batch)`` of one fitting pass: from the store's saved sums, saving them every
        ``save_every_s`` seconds of work (:meth:`fit`)."""
        from time import monotonic

        from trakcli.store.curvature import read_partial, write_partial

        settings = self.settings()
        emit = on_event or (lambda *args: None)
        saved = read_partial(store, model_id, settings, name) if store is not None else None
        resume = None if saved is None else PassState(
            saved["rows"], {k: torch.from_numpy(v) for k, v in saved["sums"].items()}, saved["tokens"],
            None if saved["rng"] is None else torch.from_numpy(saved["rng"]), saved["device"])
        if resume is not None:
            emit("resume", name, resume.rows, 0)
        last = [monotonic()]

        def on_batch(lo: int, hi: int, state: Callable[[], PassState]) -> None:
            emit("batch", name, lo, hi)
            if store is None or monotonic() - last[0] < save_every_s:
                return
            st = state()
            write_partial(store, model_id, settings, name, st.rows, {k: v.numpy() for k, v in st.sums.items()},
                          st.tokens, None if st.rng is None else st.rng.numpy(), st.device)
            emit("partial", name, st.rows, 0)
            last[0] = monotonic()

        try:
            return run(resume, on_batch)
        except ResumeMismatch as e:
            if resume is None:
                raise
            store.notes.append(f"model_id {model_id}: the saved sums of the curvature's {name} pass do not fit this "
                               f"run's batches ({e}); the pass starts over")
            last[0] = monotonic()
            return run(None, on_batch)

    def forget(self, model_id: int) -> None:
        """Drop checkpoint ``model_id``'s factors from memory (a trial fit, :meth:`~trakcli.jobs.setup.JobSetup.check_curvature`)."""
        self._factors.pop(model_id, None)
        self._folded, self._gauss_newton = None, None

    def fold(self, factors: list[tuple[torch.Tensor, torch.Tensor]], model_id: int
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Kronecker projection factors with checkpoint ``model_id``'s whitening folded in (stored features).

        The whitening ``diag((Λ + δ)^-1/2)`` in the eigenbasis ``Q_S ⊗ Q_A`` does not separate for EK-FAC (nor, with its
        damping, for K-FAC); its closest separable form ``u_i v_j`` is fitted in the log domain (least squares of
        ``log (Λ_ij + δ)^-1/2 ≈ α_i + β_j``: row and column means). Then ``(P_out ⊗ P_in) vec(W G)`` is the Kronecker
        projection with ``P_out ← P_out diag(u) Q_Sᵀ`` and ``P_in ← P_in diag(v) Q_Aᵀ`` (as Bergson folds K-FAC into its
        projection), at the cost of TRAK's Kronecker features. Damping: ``feature_damping`` (:meth:`with_damping`).

        Args:
            factors: per layer ``(P_outᵀ [d_out, k_out], P_inᵀ [d_in, k_in])`` (the projector's), in order of
                :attr:`layers`.
            model_id: the checkpoint (its curvature fitted or read first).

        Returns:
            Per layer ``(Q_S diag(u) P_outᵀ, Q_A diag(v) P_inᵀ)`` in the factors' dtype and device.
        """
        key = (model_id, str(factors[0][0].device), factors[0][0].dtype, self.damping)
        if self._folded is not None and self._folded[0] == key:
            return self._folded[1]
        fitted = self.factors(model_id)
        if len(factors) != len(fitted.factors):
            raise StoreError(f"the projection has {len(factors)} layers and the curvature {len(fitted.factors)}; "
                             "rerun `trak featurize CONFIG --overwrite`")
        out = []
        for (p_out_t, p_in_t), f in zip(factors, fitted.factors):
            log_m = -0.5 * torch.log(f.eig.double().clamp(min=0) + f.damping(self.damping))  # [d_out, d_in]
            row, col = log_m.mean(1), log_m.mean(0)
            u, v = torch.exp(row - 0.5 * log_m.mean()), torch.exp(col - 0.5 * log_m.mean())
            w_out = (f.q_out.double() * u[None, :]).to(p_out_t)  # [d_out, d_out]: Q_S diag(u)
            w_in = (f.q_in.double() * v[None, :]).to(p_in_t)
            out.append((w_out @ p_out_t, w_in @ p_in_t))
        self._folded = (key, out)
        return out

    def read(self, store: Any, model_id: int) -> CurvatureFactors:
        """Checkpoint ``model_id``'s finished curvature from ``store`` (kept for :meth:`whiten`).

        Raises:
            StoreError: none made with these settings is stored (run `trak featurize CONFIG`).
        """
        from trakcli.store.curvature import read_curvature

        done = read_curvature(store, model_id, self.settings(), "done")
        if done is None:
            self._factors.pop(model_id, None)
            return self.factors(model_id)
        return self._keep(model_id, CurvatureFactors.from_arrays(self.layers, done, self.damping))

    def _keep(self, model_id: int, f: CurvatureFactors) -> CurvatureFactors:
        self._factors = {m: v for m, v in self._factors.items() if m == model_id}  # one checkpoint at a time
        self._factors[model_id] = f
        self._folded = None
        return f
