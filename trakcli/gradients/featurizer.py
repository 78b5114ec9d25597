"""Kronecker-projected per-example gradients from one batched forward and backward (LoGra, Choe et al. 2024).

For a layer ``y_t = W a_t (+ b)`` applied at positions ``t``, the per-example gradient of the model output function is
``G = Σ_t g_t a_tᵀ`` (``g_t = ∂f/∂y_t``, ``a_t ← [a_t, 1]`` with a bias), so its Kronecker projection is

    (P_out ⊗ P_in) vec(G) = vec( Σ_t (P_out g_t)(P_in a_t)ᵀ )

(Choe et al. 2024, "What is Your Data Worth to GPT?", Sec. 3). A :class:`KroneckerFeaturizer` projects each covered
module's input when it runs (``P_in a_t``, ``[n, T, k_in]``: :meth:`trakcli.gradients.kinds.Kind.project_input`) and
its output gradient when it arrives (``P_out g_t``), adding their products to the example's ``[k_out, k_in]`` grid, in
one :class:`~trakcli.gradients.hooks.HookPass`. Only ``[n, T, k]`` tensors are kept; no ``[n, grad_dim]`` tensor, nor
any weight gradient, ever exists.

Exactness: the features equal ``(P_out ⊗ P_in) vec(G_i)`` of each example's own gradient when examples do
not interact in the forward pass (eval mode: the model is switched to it). Padding positions
(``attention_mask`` 0) get exactly zero output gradients from the model's mask (:mod:`trakcli.models.forward`),
and an ``nn.Embedding``'s ``padding_idx`` row gets no gradient, as in torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trakcli.errors import ConfigError, GradientError
from trakcli.gradients.hooks import HookPass, batch_rows, first_rows, logits_of
from trakcli.gradients.layers import SUPPORTED, Use, coverage_info, find_uses
from trakcli.gradients.vmap import select_parameters
from trakcli.projectors.base import check_model_id
from trakcli.projectors.kronecker import KroneckerProjector
from trakcli.tasks import checked_outputs, make_batch, resolve_task


class KroneckerFeaturizer:
    """Kronecker-projected per-example gradients ``φ`` and out-to-loss terms ``Q`` of batches.

    The output functions of :class:`trakcli.gradients.vmap.PerExampleGradients`, from one batched
    forward and one backward (the module docstring says how, and when it is exact).

    Args:
        model: the model; switched to eval mode.
        proj_dim, seed, dtype, distribution, split: the
            :class:`~trakcli.projectors.kronecker.KroneckerProjector`'s (``dtype``: of the accumulation).
        grad_wrt: parameter name patterns (:func:`trakcli.gradients.vmap.select_parameters`);
            ``None`` selects all; parameters outside supported layers are left out.
        task: the model output function (:func:`trakcli.tasks.resolve_task`).
        memory_mb: if set, the rows of a batch go through in passes whose covered layers' inputs,
            outputs, output gradients and projected inputs fit this many MiB (:meth:`rows_per_pass`).

    Attributes:
        projector: the :class:`~trakcli.projectors.kronecker.KroneckerProjector`.
        layers, uses, left_out: from :func:`~trakcli.gradients.layers.find_uses`.
        info: one line naming the left-out parameters and the fraction covered.
        grad_dim: covered parameter entries; param_names: their order.
        row_bytes: per kind of input, the largest bytes per row a pass has held.
        probe_bytes: per kind of input (:meth:`_shape_key`), the bytes per row (per token for token data)
            of the probe pass (with ``memory_mb``).
        second_moment: None, or a :class:`~trakcli.gradients.second_moment.SecondMoment` of kind ``adafactor`` over
            :attr:`layers`, folded into the factors: the features are ``(P_out ⊗ P_in) vec(D_out G D_in)``.
        curvature: None, or a :class:`~trakcli.curvature.Curvature` whose whitening is folded into the
            factors (:meth:`~trakcli.curvature.Curvature.fold`), after ``second_moment``.

    Raises:
        ConfigError: unknown task, bad ``grad_wrt`` or ``memory_mb``, or a
            ``grad_wrt`` that matches only unsupported parameters (named).
        ProjectorError: bad ``proj_dim``, ``seed``, ``dtype``, ``distribution`` or ``split``.
    """

    def __init__(self, model: nn.Module, *, proj_dim: int, seed: int = 0, dtype: torch.dtype | str = torch.float32,
                 distribution: str = "rademacher", split: str = "equal", grad_wrt: list[str] | None = None,
                 task: Any = "classification", memory_mb: float | None = None):
        task = resolve_task(task)
        number = isinstance(memory_mb, (int, float)) and not isinstance(memory_mb, bool)
        if memory_mb is not None and not (number and memory_mb > 0):
            raise ConfigError(f"data.grad_memory_mb must be a positive number of MiB, got {memory_mb!r}")
        self.task, self.memory_mb, self.model = task, memory_mb, model.eval()
        selected = select_parameters(model, grad_wrt)
        self.layers, self.uses, self.left_out = find_uses(model, selected)
        params = dict(model.named_parameters())
        selected_numel = sum(params[n].numel() for n in selected)
        self.info = coverage_info(self.layers, self.left_out, selected_numel)
        if not self.layers:
            shown = "; ".join(f"{n} ({why})" for n, why in self.left_out.items())
            raise ConfigError(f"grad_wrt: the kronecker projection covers {SUPPORTED}, and every selected parameter "
                              f"is outside them: {shown}; select such layers with grad_wrt, or use projector kind "
                              "rademacher, normal or sjlt")
        self.projector = KroneckerProjector(self.layers, proj_dim, seed, dtype, distribution, split)
        self.grad_dim, self.param_names = self.projector.grad_dim, self.projector.param_names
        self.row_bytes: dict[Any, int] = {}
        self.probe_bytes: dict[Any, int] = {}
        self.second_moment: Any = None
        self.curvature: Any = None

    def __call__(self, inputs, labels: torch.Tensor | None, model_id: int = 0, row_offset: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Features and out-to-loss terms of a batch.

        Args:
            inputs, labels, row_offset: as :meth:`PerExampleGradients.__call__
                <trakcli.gradients.vmap.PerExampleGradients.__call__>`.
            model_id: checkpoint index (selects the projection matrices).

        Returns:
            ``(phi [n, proj_dim], out_to_loss [n])``, float32 (phi float64 for a float64 projector), on the inputs'
            device; ``phi`` equals ``projector.project`` of the examples' own gradients.

        Raises:
            DataError: inputs the model cannot take, logits of the wrong shape,
                labels the task refuses (out of range, or no token data for language modeling).
            GradientError: a covered module that never ran, ran with another
                batch dimension, or whose batch-broadcast output was used per row.
        """
        model_id = check_model_id(model_id)
        first = first_rows(inputs)
        n = first.shape[0]
        if n == 0:
            return (torch.zeros(0, self.projector.proj_dim, dtype=self.projector.dtype, device=first.device),
                    torch.zeros(0, dtype=torch.float32, device=first.device))
        key = self._shape_key(inputs)
        if self.memory_mb is not None and key not in self.probe_bytes:
            # a discarded probe pass fixes the bytes per row (per token for token data): how a batch is cut depends
            # on the batch alone, never on what this process ran before (the same features, bit for bit, from any rank)
            probe, probe_labels, tokens = self._probe(inputs, labels)
            self.probe_bytes[key] = self._pass(probe, probe_labels, model_id, row_offset)[2] / tokens
        phis, qs = [], []
        step = self.rows_per_pass(inputs) or n
        for start in range(0, n, step):
            part, part_labels = batch_rows(inputs, labels, slice(start, start + step))
            phi, q, nbytes = self._pass(part, part_labels, model_id, row_offset + start)
            self.row_bytes[key] = max(self.row_bytes.get(key, 0), nbytes)
            phis.append(phi)
            qs.append(q)
        return (phis[0], qs[0]) if len(phis) == 1 else (torch.cat(phis), torch.cat(qs))

    #: Tokens of the probe pass of token data.
    PROBE_TOKENS = 8

    @staticmethod
    def _tokens(inputs) -> int | None:
        """The sequence length of token data (a dict with ``input_ids [n, L]``), else None."""
        ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
        return int(ids.shape[1]) if ids is not None and ids.ndim == 2 else None

    @classmethod
    def _shape_key(cls, inputs) -> Any:
        """What the bytes per row are measured for: the per-row shapes, or for token data the keys only
        (every held tensor is ``[n, T, ...]``, so the bytes per token are the same at any length)."""
        if isinstance(inputs, dict):
            if cls._tokens(inputs) is not None:
                return ("tokens",) + tuple(sorted(inputs))
            return tuple(sorted((k, tuple(v.shape[1:])) for k, v in inputs.items()))
        return tuple(inputs.shape[1:])

    def _probe(self, inputs, labels):
        """The probe: the first row (token data: its first :attr:`PROBE_TOKENS` tokens), its labels,
        and the count its bytes are divided by (tokens, or 1 row)."""
        length = self._tokens(inputs)
        if length is None:
            return (*batch_rows(inputs, labels, slice(0, 1)), 1)
        t = min(length, self.PROBE_TOKENS)
        cut = lambda v: v[:1, :t] if v.ndim >= 2 and v.shape[1] == length else v[:1]  # noqa: E731
        return {k: cut(v) for k, v in inputs.items()}, None if labels is None else cut(labels), t

    def rows_per_pass(self, inputs) -> int | None:
        """Rows of a batch like ``inputs`` that one forward + backward takes under ``memory_mb``.

        The bytes per row are measured once per kind of input on a discarded probe pass of one row (token
        data: of its first :attr:`PROBE_TOKENS` tokens, the cost then per token), so how a batch is cut depends
        on the batch alone.

        Returns:
            ``None`` without a memory bound; 1 while the bytes of this kind of input are not measured; else
            ``memory_mb`` MiB over the bytes per row (per token × the sequence length for token data), at least 1.
        """
        if self.memory_mb is None:
            return None
        per = self.probe_bytes.get(self._shape_key(inputs))
        if per is None:
            return 1
        per_row = per * (self._tokens(inputs) or 1)
        return max(1, int(self.memory_mb * 2**20 // max(1.0, per_row)))

    def _pass(self, inputs, labels: torch.Tensor, model_id: int, row_offset: int):
        """Features, out-to-loss and bytes per row of one forward + backward over all rows given."""
        model = self.model.eval()
        first = first_rows(inputs)
        n, device, proj = first.shape[0], first.device, self.projector
        factors = proj.transposed_factors(model_id, device)
        if self.second_moment is not None:  # (P_out D_out) ⊗ (P_in D_in): the correction folded into the factors
            factors = self.second_moment.factors(factors, model_id)
        if self.curvature is not None:  # (P_out W_out) ⊗ (P_in W_in): the curvature's whitening folded in
            factors = self.curvature.fold(factors, model_id)
        grids = _Grids(proj, factors, n, device)
        with HookPass(model, self.uses, n, device, grids) as hooks:
            logits = logits_of(model, inputs)
            self._raise(hooks)
            margin, q = checked_outputs(self.task, logits, make_batch(inputs, labels), row_offset)
            never = [use.name for use, c in zip(self.uses, hooks.calls) if not c]
            if never:
                raise GradientError(f"the forward pass never called {', '.join(never)} although their parameters are "
                                    "selected (the model uses their weights without calling the module, as "
                                    "nn.MultiheadAttention and the fused fast path of nn.TransformerEncoderLayer do, "
                                    "or not at all): leave them out with grad_wrt, or use projector kind rademacher, "
                                    "normal or sjlt")
            if margin.requires_grad:
                hooks.backward(margin)
            self._raise(hooks)
        return proj.features_from_grids(grids.grids), q.detach().to(torch.float32), hooks.nbytes // max(1, n)

    #: What each :class:`~trakcli.gradients.hooks.Problem` means for Kronecker factors, after its text.
    HINTS = {
        "input": "; it cannot be kronecker-projected",
        "batch": ": kronecker factors need the batch as the first dimension; leave it out with grad_wrt",
        "broadcast": ": its output is not broadcast against per-example tensors, so per-example factors cannot be "
                     "taken there; leave it out with grad_wrt",
    }

    def _raise(self, hooks: HookPass) -> None:
        """Raise :class:`GradientError` for the pass's problem, if any."""
        if hooks.problem is not None:
            raise GradientError(hooks.problem.text + self.HINTS.get(hooks.problem.code, ""))


class _Grids:
    """The :class:`~trakcli.gradients.hooks.Consumer` of Kronecker factors: keeps each call's projected input
    ``P a_t`` ``[b, T, k]`` and adds ``Σ_t (P g_t)(P a_t)ᵀ`` to each example's grid ``[n, k_out, k_in]`` of its layer.

    Args:
        projector: the :class:`~trakcli.projectors.kronecker.KroneckerProjector`.
        factors: per layer ``(P_outᵀ [d_out, k_out], P_inᵀ [d_in, k_in])`` of the checkpoint, in its dtype.
        n, device: rows of the batch and their device.
    """

    keeps_input = False

    def __init__(self, projector: KroneckerProjector, factors: list[tuple[torch.Tensor, torch.Tensor]], n: int,
                 device: torch.device):
        self.projector, self.factors = projector, factors
        self.grids = [torch.zeros(n, k_out, k_in, dtype=projector.dtype, device=device)
                      for k_out, k_in in projector.grids]

    def _sides(self, use: Use) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """``(input-side weight rows, input-side bias column, output side)`` of a use's transposed factors:
        a transposed use (the layer's out side is the module's input) reads ``P_out`` on its input."""
        p_out_t, p_in_t = self.factors[use.layer]
        cols = self.projector.layers[use.layer].weight_cols
        if use.transposed:
            return p_out_t, None, p_in_t[:cols]
        return (p_in_t[:cols] if use.weight is not None else None,
                p_in_t[cols] if use.bias is not None else None, p_out_t)

    def take_input(self, use: Use, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        p_w, p_b, _ = self._sides(use)
        return use.kind.project_input(use.module, x, output, p_w, p_b, self.projector.dtype)  # [b, T, k]

    def take_grad(self, use: Use, kept: torch.Tensor, g: torch.Tensor) -> None:
        gp = use.kind.out_grads(g, kept.shape[0]).to(self.projector.dtype) @ self._sides(use)[2]  # [n, T, k_bwd]
        grid = self.grids[use.layer]
        if use.transposed:
            grid.baddbmm_(kept.transpose(1, 2), gp)  # the module's input side is the layer's out side
        else:
            grid.baddbmm_(gp.transpose(1, 2), kept)
