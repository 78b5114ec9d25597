"""Exact per-example gradients from layer hooks: one ordinary batched forward + backward, no torch.func.

Each covered module's per-example parameter gradients are sums over positions of terms in its input and output
gradient (Goodfellow 2015, "Efficient per-example gradient computations"; Rochette et al. 2019; each kind's formula in
:mod:`trakcli.gradients.kinds`), taken from one :class:`~trakcli.gradients.hooks.HookPass` of ``Σ_i f_i``; calls of
one module, and weights tied between modules, accumulate. This equals ``torch.func.vmap(grad(f))``
(:class:`trakcli.gradients.vmap.PerExampleGradients`) when every selected parameter is used only inside its module's
call and examples do not interact (eval mode): :class:`LayerGradients` checks both on its first batch and, under
``gradient_method: auto``, falls back to vmap for good when the check fails. The results equal vmap's to float32
rounding, so the method is not part of a store's identity.
"""

from __future__ import annotations

import difflib
from typing import Any

import torch
from torch import nn

from trakcli.errors import ConfigError, GradientError
from trakcli.gradients.hooks import HookPass, batch_rows, first_rows, grad_flags, logits_of
from trakcli.gradients.kinds import KINDS
from trakcli.gradients.layers import HOOKED, Use, describe_left_out, find_uses
from trakcli.gradients.vmap import PerExampleGradients, check_finite, select_parameters
from trakcli.tasks import checked_outputs, is_builtin, make_batch

#: The values of ``gradient_method`` (config key and :func:`per_example_gradients`).
METHODS = ("auto", "hooks", "vmap")


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


class LayerGradients(PerExampleGradients):
    """``∇_θ f(z; θ)`` for each example of a batch, and ``Q(z)``, from layer hooks (no torch.func).

    The interface, arguments and results (to float32 rounding) of its base
    :class:`~trakcli.gradients.vmap.PerExampleGradients`. On the first batch, the exactness guard compares the sum of
    the per-example gradients with the batch gradient of ``Σ_i f_i``, and example 0's gradient with its gradient
    alone; a mismatch (a selected weight used outside its module's call, e.g. ``F.linear(x, self.fc.weight)``, or
    examples that interact), or a covered module run without the batch as its first dimension, switches to vmap for
    good with ``fallback`` (``method`` becomes ``"vmap"``, ``reason`` says why), else raises :class:`GradientError`
    from :meth:`__call__`.

    Attributes:
        uses: the covered module calls (:func:`~trakcli.gradients.layers.find_uses` over every kind).

    Raises:
        ConfigError: a bad ``grad_wrt`` or task, or a selected parameter the hooks do not cover (named).
    """

    method = "hooks"

    def __init__(self, model: nn.Module, grad_wrt: list[str] | None = None, task: Any = "classification", *,
                 fallback: bool = False):
        super().__init__(model, grad_wrt, task)
        _, self.uses, left_out = find_uses(model, self.param_names, KINDS)
        if left_out:
            raise ConfigError(f"gradient_method: hooks covers {HOOKED}; these selected parameters are outside them: "
                              f"{describe_left_out(left_out)}; leave them out with grad_wrt, or use gradient_method "
                              "auto or vmap")
        self.fallback, self.checked = fallback, False
        self._vmap: PerExampleGradients | None = None

    def __call__(self, inputs, labels: torch.Tensor | None, row_offset: int = 0
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """As :meth:`PerExampleGradients.__call__ <trakcli.gradients.vmap.PerExampleGradients.__call__>`.

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
                raise GradientError(f"gradient_method hooks: {e}; use gradient_method auto (falls back to "
                                    "torch.func.vmap) or vmap") from None
            self.method, self.reason = "vmap", f"per-example gradients: torch.func.vmap instead of layer hooks: {e}"
            self._vmap = PerExampleGradients(self.model, self.param_names, self.task)
            return self._vmap(inputs, labels, row_offset)
        self.checked = True
        if not is_builtin(self.task):  # a built-in Q is finite where the features are
            check_finite(q, row_offset, what=f"out-to-loss terms Q of task {self.task.name}")
        return grads, q

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
        if (problem := hooks.problem) is not None:
            raise NotPerExample(problem.text + ("; the hooks need the batch first" if problem.code == "batch" else ""))
        grads = {k: exact.grads[k].to(params[k].dtype) if k in exact.grads
                 else torch.zeros(n, *s, dtype=params[k].dtype, device=device) for k, s in self.param_shapes.items()}
        if guard:
            if f.requires_grad:
                self._compare({k: g.sum(0) for k, g in grads.items()}, dict(zip(self.param_names, batch)), grads,
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
        """``(f [n], Q [n])`` of the task on a batch, checked on the first example (as the base does), then all."""
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
        task: the model output function (:func:`trakcli.tasks.resolve_task`).
        method: ``auto``: :class:`LayerGradients` when every selected parameter is in a covered
            module (:data:`HOOKED`), falling back to vmap for good if its first-batch guard fails,
            else :class:`~trakcli.gradients.vmap.PerExampleGradients`; ``hooks``: :class:`LayerGradients`,
            raising instead of falling back; ``vmap``: :class:`~trakcli.gradients.vmap.PerExampleGradients`.

    Returns:
        A :class:`~trakcli.gradients.vmap.PerExampleGradients` (:class:`LayerGradients` is one), whose ``reason``
        says why vmap is used under ``auto``, to report once (None otherwise).

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
