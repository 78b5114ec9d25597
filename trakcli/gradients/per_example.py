"""Exact per-example gradients from layer hooks: one ordinary batched forward + backward, no torch.func.

For a module applied at positions ``t`` (tokens, pixels) of example ``i``, the
gradient of the model output function ``f_i`` (the task's, :mod:`trakcli.tasks`)
w.r.t. its parameters is a sum over positions of terms in the module's output
gradient ``g_{i,t} = ∂f_i/∂y_{i,t}`` and its input ``a_{i,t}`` (Goodfellow 2015,
"Efficient per-example gradient computations"; Rochette et al. 2019): ``G_i = Σ_t
g_{i,t} a_{i,t}ᵀ`` for a linear map, ``Σ_t g_{i,t} ⊙ x̂_{i,t}`` for a normalization's
weight; each kind's formula is in :mod:`trakcli.gradients.kinds` (:data:`HOOKED`).
:class:`~trakcli.gradients.hooks.HookPass` gives every ``(a, g)`` of one backward of
``Σ_i f_i``; calls of one module, and weights tied between modules (GPT-2's
``lm_head`` and ``wte``), accumulate.

This equals ``torch.func.vmap(grad(f))`` (:class:`trakcli.gradients.vmap.PerExampleGradients`)
when every selected parameter is used only inside its module's call and
examples do not interact (eval mode). :class:`LayerGradients` checks both on
the first batch it sees (the exactness guard) and, chosen by
:func:`per_example_gradients` with ``method="auto"``, falls back to vmap for
good when the check fails, with a ``reason`` for the caller to report once.
Its results equal vmap's to float32 rounding, so the method is not part of a
store's identity.
"""

from __future__ import annotations

import difflib
from typing import Any

import torch
from torch import nn

from trakcli.errors import ConfigError, GradientError
from trakcli.gradients.hooks import HookPass, batch_rows, first_rows, grad_flags, logits_of
from trakcli.gradients.kinds import KINDS
from trakcli.gradients.layers import HOOKED, Use, find_uses
from trakcli.gradients.vmap import PerExampleGradients, check_finite, select_parameters, selected_shapes
from trakcli.tasks import checked_outputs, is_builtin, make_batch, resolve_task

#: The values of ``gradient_method`` (config key and :func:`per_example_gradients`).
METHODS = ("auto", "hooks", "vmap")


def describe_left_out(left_out: dict[str, str], limit: int = 6) -> str:
    """``"a.weight (MultiheadAttention), b (parameter)"``: the first ``limit`` uncovered parameters and why."""
    shown = ", ".join(f"{n} ({why})" for n, why in list(left_out.items())[:limit])
    return shown + (f" and {len(left_out) - limit} more" if len(left_out) > limit else "")


class NotPerExample(Exception):
    """The layer hooks cannot give this model's per-example gradients (the message says why)."""


class _Exact:
    """The :class:`~trakcli.gradients.hooks.Consumer` of exact gradients: keeps each call's input and adds
    each call's per-example gradients ``[n, *param.shape]`` to ``grads`` (by parameter name)."""

    keeps_input = True

    def __init__(self):
        self.grads: dict[str, torch.Tensor] = {}

    def take_input(self, use: Use, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        return x

    def take_grad(self, use: Use, kept: torch.Tensor, g: torch.Tensor) -> None:
        w, b = use.kind.exact(use.module, kept, g, use.weight is not None)
        for name, t in ((use.weight, w), (use.bias, b)):
            if name is not None:
                self.grads[name] = self.grads[name] + t if name in self.grads else t


class LayerGradients:
    """``∇_θ f(z; θ)`` for each example of a batch, and ``Q(z)``, from layer hooks (no torch.func).

    The same interface and results (to float32 rounding) as
    :class:`trakcli.gradients.vmap.PerExampleGradients`; see the module docstring for
    the formulas. On the first batch it sees, the exactness guard compares the
    sum of the per-example gradients with the batch gradient of ``Σ_i f_i`` and
    example 0's gradient with its gradient computed alone (plain autograd); a
    mismatch (a selected weight used outside its module's call, e.g.
    ``F.linear(x, self.fc.weight)``, or examples that interact), or a covered
    module run on a tensor without the batch as its first dimension, either
    switches this object to vmap for good (``fallback=True``; ``method`` becomes
    ``"vmap"`` and ``reason`` says why) or raises.

    Args:
        model: the model; switched to eval mode.
        grad_wrt: parameter name patterns (:func:`trakcli.gradients.vmap.select_parameters`).
        task: the model output function (:func:`trakcli.tasks.resolve_task`).
        fallback: on a failed guard, use vmap (True) or raise :class:`GradientError` (False).

    Attributes:
        param_names, param_shapes, grad_dim, task, model: as :class:`PerExampleGradients`.
        uses: the covered module calls (:func:`~trakcli.gradients.layers.find_uses` over every kind).
        method: ``"hooks"``, or ``"vmap"`` after a fallback.
        reason: why vmap is used (None while on hooks).

    Raises:
        ConfigError: a bad ``grad_wrt`` or task, or a selected parameter the hooks do not cover (named).
    """

    def __init__(self, model: nn.Module, grad_wrt: list[str] | None = None, task: Any = "classification", *,
                 fallback: bool = False):
        self.task = resolve_task(task)
        self.model = model.eval()
        self.param_names, self.param_shapes, self.grad_dim = selected_shapes(model, grad_wrt)
        _, self.uses, left_out = find_uses(model, self.param_names, KINDS)
        if left_out:
            raise ConfigError(
                f"gradient_method: hooks covers {HOOKED}; these selected parameters are outside them: "
                f"{describe_left_out(left_out)}; leave them out with grad_wrt, or use gradient_method auto or vmap"
            )
        self.fallback = fallback
        self.method = "hooks"
        self.reason: str | None = None
        self.checked = False
        self._vmap: PerExampleGradients | None = None

    def __call__(self, inputs, labels: torch.Tensor | None, row_offset: int = 0
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Per-example gradients of the model output function and the out-to-loss terms of a batch.

        Args:
            inputs: ``[n, ...]`` model inputs on the model's device, or a dict of ``[n, L]``
                tensors (``input_ids``, ``attention_mask``) for a transformers model.
            labels: ``[n]`` int64 class indices, ``[n, L]`` per-token labels (``-100``: not a target),
                or None; the task reads them from its batch (:func:`trakcli.tasks.make_batch`).
            row_offset: dataset index of the batch's first row (for error messages).

        Returns:
            ``(grads, out_to_loss)``: ``grads[name]`` is ``[n, *param.shape]`` in the parameter's
            dtype (in ``param_names`` order); ``out_to_loss`` is ``[n]`` float32.

        Raises:
            DataError: inputs the model cannot take, logits or labels the task refuses.
            GradientError: (``fallback=False``) the guard or a module's batch dimension shows that the
                hooks cannot give this model's per-example gradients; a custom task's non-finite Q.
        """
        if self._vmap is not None:
            return self._vmap(inputs, labels, row_offset)
        try:
            grads, q = self._pass(inputs, labels, row_offset, guard=not self.checked)
        except NotPerExample as e:
            if not self.fallback:
                raise GradientError(
                    f"gradient_method hooks: {e}; use gradient_method auto (falls back to torch.func.vmap) or vmap"
                ) from None
            self.method, self.reason = "vmap", f"per-example gradients: torch.func.vmap instead of layer hooks: {e}"
            self._vmap = PerExampleGradients(self.model, self.param_names, self.task)
            return self._vmap(inputs, labels, row_offset)
        self.checked = True
        if not is_builtin(self.task):  # a built-in Q is finite where the features are
            check_finite(q, row_offset, what=f"out-to-loss terms Q of task {self.task.name}")
        return grads, q

    def flatten(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        """Concatenate per-parameter gradients into ``[n, grad_dim]`` (in ``param_names`` order)."""
        return torch.cat([grads[n].reshape(grads[n].shape[0], -1) for n in self.param_names], dim=1)

    # ------------------------------------------------------------------ one pass

    def _pass(self, inputs, labels, row_offset: int, guard: bool):
        first = first_rows(inputs)
        n, device = first.shape[0], first.device
        params = dict(self.model.named_parameters())
        if n == 0:
            return ({k: torch.zeros(0, *s, dtype=params[k].dtype, device=device) for k, s in self.param_shapes.items()},
                    torch.zeros(0, dtype=torch.float32, device=device))
        exact = _Exact()
        chosen = [params[k] for k in self.param_names] if guard else []
        batch: tuple[torch.Tensor | None, ...] = ()
        with HookPass(self.model, self.uses, n, device, exact, chosen) as hooks:
            f, q = self._outputs(inputs, labels, n, row_offset)
            if hooks.problem is None and f.requires_grad:
                batch = hooks.backward(f)
        if hooks.problem is not None:
            problem = hooks.problem
            raise NotPerExample(problem.text + ("; the hooks need the batch first" if problem.code == "batch" else ""))
        grads = {k: exact.grads[k].to(params[k].dtype) if k in exact.grads
                 else torch.zeros(n, *s, dtype=params[k].dtype, device=device) for k, s in self.param_shapes.items()}
        if guard:
            sums = {k: g.sum(0) for k, g in grads.items()}
            if f.requires_grad:
                self._compare(sums, dict(zip(self.param_names, batch)), grads,
                              "the per-example gradients of {name} do not add up to its batch gradient "
                              "(relative difference {rel:.2g}): the model uses it outside its module's call, "
                              "e.g. F.linear(x, self.fc.weight)")
            alone = self._alone(*batch_rows(inputs, labels, slice(0, 1)), params)
            self._compare({k: g[0] for k, g in grads.items()}, alone, grads,
                          "example 0's gradient of {name} in a batch differs from its gradient alone (relative "
                          "difference {rel:.2g}): examples interact in the forward pass (batch statistics, "
                          "a batch-wide operation) or a selected weight is used outside its module's call")
        return grads, q.detach().to(torch.float32)

    def _outputs(self, inputs, labels: torch.Tensor | None, n: int, row_offset: int):
        """``(f [n], Q [n])`` of the task on a batch, after its checks (a custom task's first on the first
        example, as :class:`PerExampleGradients` does, then on the batch)."""
        logits = logits_of(self.model, inputs)
        batch = make_batch(inputs, labels)
        if logits.ndim >= 1 and logits.shape[0] == n:
            checked_outputs(self.task, logits[:1], {k: v[:1] for k, v in batch.items()}, row_offset)
        return checked_outputs(self.task, logits, batch, row_offset)

    def _alone(self, inputs, labels: torch.Tensor | None, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Plain autograd gradient of ``f`` of one example alone (no hooks), per selected parameter."""
        chosen = [params[k] for k in self.param_names]
        with grad_flags(self.model, chosen):
            f, _ = self._outputs(inputs, labels, 1, 0)
            got = torch.autograd.grad(f.sum(), chosen, allow_unused=True) if f.requires_grad else [None] * len(chosen)
        return dict(zip(self.param_names, got))

    def _compare(self, ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor | None],
                 grads: dict[str, torch.Tensor], message: str) -> None:
        """Raise :class:`NotPerExample` when a parameter's ``ours`` and ``ref`` differ by more than rounding.

        Tolerance of parameter ``k``: ``rtol · (s_k + 0.01 · ‖s‖)`` with ``s_k = max(‖ref_k‖, max_i ‖G_{i,k}‖)``
        (``G_i`` the per-example gradients) and ``‖s‖`` over all selected parameters; ``rtol`` is 1e-4
        (float32, float64) or 8 machine epsilons of a 16-bit dtype. The second term is a floor for
        gradients that vanish up to rounding (a BERT key bias: ~1e-13 of the whole gradient).
        """
        refs = {k: torch.zeros_like(a) if ref.get(k) is None else ref[k].to(a.dtype) for k, a in ours.items()}
        scale = {k: max(float(refs[k].norm()), float(g.reshape(g.shape[0], -1).norm(dim=1).max()))
                 for k, g in grads.items()}
        total = sum(v * v for v in scale.values()) ** 0.5
        for name, a in ours.items():
            rtol = max(1e-4, 8 * torch.finfo(a.dtype).eps)
            diff = float((a - refs[name]).norm())
            if not diff <= rtol * (scale[name] + 0.01 * total):
                raise NotPerExample(message.format(name=name, rel=diff / max(scale[name], 1e-30)))


def check_method(method: Any) -> None:
    """Raise :class:`ConfigError` (with a did-you-mean) unless ``method`` is one of :data:`METHODS`."""
    if method not in METHODS:
        close = difflib.get_close_matches(str(method), METHODS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"gradient_method: {method!r} is not a method; {hint}use one of {', '.join(METHODS)}")


def per_example_gradients(model: nn.Module, grad_wrt: list[str] | None = None, task: Any = "classification",
                          method: str = "auto") -> PerExampleGradients | LayerGradients:
    """Per-example gradients by ``gradient_method``: layer hooks where they cover the model, else torch.func.vmap.

    Args:
        model: the model; switched to eval mode.
        grad_wrt: parameter name patterns (:func:`trakcli.gradients.vmap.select_parameters`).
        task: the model output function (:func:`trakcli.gradients.vmap.resolve_task`).
        method: ``auto``: :class:`LayerGradients` when every selected parameter is in a covered
            module (:data:`HOOKED`), falling back to vmap for good if its first-batch guard fails,
            else :class:`~trakcli.gradients.vmap.PerExampleGradients`; ``hooks``: :class:`LayerGradients`,
            raising instead of falling back; ``vmap``: :class:`~trakcli.gradients.vmap.PerExampleGradients`.

    Returns:
        An object with ``__call__(inputs, labels, row_offset) -> (grads, out_to_loss)``,
        ``param_names``, ``param_shapes``, ``grad_dim``, ``flatten``, ``method`` (``hooks`` / ``vmap``)
        and ``reason`` (why vmap is used under ``auto``, to report once; None otherwise).

    Raises:
        ConfigError: an unknown ``method``; a bad ``grad_wrt`` or task; ``hooks`` with a selected
            parameter outside the covered modules (named).
    """
    check_method(method)
    if method == "vmap":
        return PerExampleGradients(model, grad_wrt, task)
    if method == "hooks":
        return LayerGradients(model, grad_wrt, task)
    _, _, left_out = find_uses(model, select_parameters(model, grad_wrt), KINDS)
    if not left_out:
        return LayerGradients(model, grad_wrt, task, fallback=True)
    grads = PerExampleGradients(model, grad_wrt, task)
    grads.reason = f"per-example gradients: torch.func.vmap, as layer hooks do not cover {describe_left_out(left_out)}"
    return grads
