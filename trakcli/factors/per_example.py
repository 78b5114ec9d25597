"""Exact per-example gradients from layer hooks: one ordinary batched forward + backward, no torch.func.

For a module applied at positions ``t`` (tokens, pixels) of example ``i``, the
gradient of the model output function ``f_i`` (the task's, :mod:`trakcli.tasks`)
w.r.t. its weight is a sum over positions of the module's output gradient
``g_{i,t} = ∂f_i/∂y_{i,t}`` times its input ``a_{i,t}`` (Goodfellow 2015,
"Efficient per-example gradient computations"; Rochette et al. 2019; the same
factors as the Kronecker projection, Choe et al. 2024):

* ``nn.Linear`` (any leading dims): ``G_i = Σ_t g_{i,t} a_{i,t}ᵀ`` ``[out, in]``, bias ``Σ_t g_{i,t}``;
  transformers' ``Conv1D`` (weight ``[in, out]``): ``Σ_t a_{i,t} g_{i,t}ᵀ``;
* ``nn.Conv1d`` / ``nn.Conv2d`` (``groups=1``): the same with ``a_{i,t}`` the unfolded
  input patch at output position ``t`` (``F.unfold`` after the module's padding);
* ``nn.Embedding``: row ``id_{i,t}`` of ``G_i`` gets ``g_{i,t}`` (``index_add``; the
  ``padding_idx`` row gets nothing, as in torch);
* ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm`` and ``nn.BatchNorm{1,2,3}d`` in eval
  mode (running statistics): weight ``Σ_t g_{i,t} ⊙ x̂_{i,t}``, bias ``Σ_t g_{i,t}``, with
  ``x̂`` the normalized input recomputed from the module's input and ``eps``.

One backward of ``Σ_i f_i`` gives every ``g_{i,t}`` (forward hooks keep each
covered module's input, tensor hooks on its output receive ``g``); a module
called several times, or weights tied between modules (GPT-2's ``lm_head`` and
``wte``), accumulate. A module run on a batch-broadcast input (BERT's and
GPT-2's position embeddings see ``position_ids [1, T]``) has its output
expanded to the batch, so each example receives its own gradient.

This equals ``torch.func.vmap(grad(f))`` (:class:`trakcli.gradients.PerExampleGradients`)
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
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from trakcli.errors import ConfigError, GradientError
from trakcli.factors.layers import find_layers, module_kind
from trakcli.gradients import PerExampleGradients, check_finite, select_parameters, selected_shapes
from trakcli.models.forward import forward, forward_errors
from trakcli.tasks import CustomTask, make_batch, resolve_task

#: The values of ``gradient_method`` (config key and :func:`per_example_gradients`).
METHODS = ("auto", "hooks", "vmap")

#: What the layer hooks cover (for messages).
HOOKED = (
    "nn.Linear, nn.Conv1d/nn.Conv2d with groups=1, nn.Embedding, transformers' Conv1D, nn.LayerNorm, nn.RMSNorm, "
    "nn.GroupNorm and nn.BatchNorm with running statistics"
)


@dataclass(frozen=True)
class GradUse:
    """One module whose calls feed the per-example gradients of selected parameters.

    Attributes:
        name: the module's name in the model.
        module: the module.
        kind: ``linear``, ``hf_conv1d``, ``conv1d``, ``conv2d``, ``embedding``, ``layer_norm``,
            ``rms_norm``, ``group_norm`` or ``batch_norm``.
        weight: name of the selected parameter its weight feeds (a tied weight: its first name), or None.
        bias: name of the selected parameter its bias feeds, or None.
    """

    name: str
    module: nn.Module
    kind: str
    weight: str | None
    bias: str | None


def norm_kind(module: nn.Module) -> tuple[str | None, str]:
    """``(kind, reason)``: the normalization kind of a module, or ``None`` and why it is not covered ("" if not a norm)."""
    rms = getattr(nn, "RMSNorm", None)
    if isinstance(module, nn.LayerNorm):
        kind, base = "layer_norm", nn.LayerNorm
    elif rms is not None and isinstance(module, rms):
        kind, base = "rms_norm", rms
    elif isinstance(module, nn.GroupNorm):
        kind, base = "group_norm", nn.GroupNorm
    elif isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        if module.running_mean is None or module.running_var is None:
            return None, f"{type(module).__name__} without running statistics (batch statistics mix the examples)"
        kind, base = "batch_norm", nn.BatchNorm1d
    else:
        return None, ""
    if type(module).forward is not base.forward:
        return None, f"{type(module).__name__} overrides the forward of {base.__name__}"
    return kind, ""


def gradient_uses(model: nn.Module, selected: list[str]) -> tuple[list[GradUse], dict[str, str]]:
    """The module calls that give the selected parameters' per-example gradients, and what they leave out.

    The weight layers are :func:`trakcli.factors.layers.find_layers`'s (the Kronecker
    projection's, tied weights included); normalization layers (:func:`norm_kind`) are added.

    Args:
        model: the model.
        selected: names of the selected parameters (:func:`trakcli.gradients.select_parameters`).

    Returns:
        ``(uses, left_out)``: ``left_out`` maps each selected parameter no use covers to a reason.
    """
    name_of = {id(p): n for n, p in model.named_parameters()}
    _, layer_uses, left_out = find_layers(model, selected)
    uses = []
    for u in layer_uses:
        kind = module_kind(u.module)[0] or u.kind
        bias = getattr(u.module, "bias", None) if u.bias else None
        uses.append(GradUse(u.name, u.module, kind, name_of[id(u.module.weight)] if u.weight else None,
                            name_of[id(bias)] if bias is not None else None))
    covered: set[str] = set()
    for mname, mod in model.named_modules():
        names = [name_of.get(id(p)) for p in (getattr(mod, "weight", None), getattr(mod, "bias", None))]
        names = [n if n in left_out else None for n in names]
        if not any(names):
            continue
        kind, why = norm_kind(mod)
        if kind is None:
            for n in names:
                if n is not None and why:
                    left_out[n] = why
            continue
        uses.append(GradUse(mname, mod, kind, names[0], names[1]))
        covered.update(n for n in names if n is not None)
    return uses, {n: why for n, why in left_out.items() if n not in covered}


def describe_left_out(left_out: dict[str, str], limit: int = 6) -> str:
    """``"a.weight (MultiheadAttention), b (parameter)"``: the first ``limit`` uncovered parameters and why."""
    shown = ", ".join(f"{n} ({why})" for n, why in list(left_out.items())[:limit])
    return shown + (f" and {len(left_out) - limit} more" if len(left_out) > limit else "")


class NotPerExample(Exception):
    """The layer hooks cannot give this model's per-example gradients (the message says why)."""


@dataclass
class _Pass:
    """State of one forward/backward pass."""

    n: int
    anchor: torch.Tensor
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    saved: list[tuple[torch.Tensor, int] | None] = field(default_factory=list)
    problem: str | None = None


def _patches(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``[n, C_in·k, positions]``: the input patch at every output position of a ``groups=1`` convolution."""
    pad = tuple(module._reversed_padding_repeated_twice)
    if any(pad):
        x = F.pad(x, pad, mode="constant" if module.padding_mode == "zeros" else module.padding_mode)
    if isinstance(module, nn.Conv1d):  # as a 2-D convolution of height 1
        x = x.unsqueeze(2)
        k, dil, stride = (1, *module.kernel_size), (1, *module.dilation), (1, *module.stride)
    else:
        k, dil, stride = module.kernel_size, module.dilation, module.stride
    return F.unfold(x, k, dilation=dil, padding=0, stride=stride)


def _normalized(use: GradUse, x: torch.Tensor) -> torch.Tensor:
    """``x̂``: the module's input normalized as its forward does, before the affine weight and bias."""
    m = use.module
    if use.kind == "layer_norm":
        return F.layer_norm(x, m.normalized_shape, None, None, m.eps)
    if use.kind == "rms_norm":
        return F.rms_norm(x, m.normalized_shape, None, m.eps)
    if use.kind == "group_norm":
        return F.group_norm(x, m.num_groups, None, None, m.eps)
    return F.batch_norm(x, m.running_mean, m.running_var, None, None, False, 0.0, m.eps)


class LayerGradients:
    """``∇_θ f(z; θ)`` for each example of a batch, and ``Q(z)``, from layer hooks (no torch.func).

    The same interface and results (to float32 rounding) as
    :class:`trakcli.gradients.PerExampleGradients`; see the module docstring for
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
        grad_wrt: parameter name patterns (:func:`trakcli.gradients.select_parameters`).
        task: the model output function (:func:`trakcli.tasks.resolve_task`).
        fallback: on a failed guard, use vmap (True) or raise :class:`GradientError` (False).

    Attributes:
        param_names, param_shapes, grad_dim, task, model: as :class:`PerExampleGradients`.
        uses: the covered module calls (:func:`gradient_uses`).
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
        self.uses, left_out = gradient_uses(model, self.param_names)
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
        if isinstance(self.task, CustomTask):
            check_finite(q, row_offset, what=f"out-to-loss terms Q of task {self.task.name}")
        return grads, q

    def flatten(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        """Concatenate per-parameter gradients into ``[n, grad_dim]`` (in ``param_names`` order)."""
        return torch.cat([grads[n].reshape(grads[n].shape[0], -1) for n in self.param_names], dim=1)

    # ------------------------------------------------------------------ one pass

    def _pass(self, inputs, labels, row_offset: int, guard: bool):
        first = next(iter(inputs.values())) if isinstance(inputs, dict) else inputs
        n, device = first.shape[0], first.device
        params = dict(self.model.named_parameters())
        if n == 0:
            return ({k: torch.zeros(0, *s, dtype=params[k].dtype, device=device) for k, s in self.param_shapes.items()},
                    torch.zeros(0, dtype=torch.float32, device=device))
        state = _Pass(n, torch.zeros((), device=device, requires_grad=True))
        chosen = [params[k] for k in self.param_names] if guard else []
        batch: tuple[torch.Tensor | None, ...] = ()
        with self._hooked(state, chosen):
            f, q = self._outputs(inputs, labels, n, row_offset)
            if state.problem is None and f.requires_grad:
                batch = torch.autograd.grad(f.sum(), [state.anchor, *chosen], allow_unused=True)[1:]
        if state.problem is not None:
            raise NotPerExample(state.problem)
        grads = {k: state.grads[k].to(params[k].dtype) if k in state.grads
                 else torch.zeros(n, *s, dtype=params[k].dtype, device=device) for k, s in self.param_shapes.items()}
        if guard:
            sums = {k: g.sum(0) for k, g in grads.items()}
            if f.requires_grad:
                self._compare(sums, dict(zip(self.param_names, batch)), grads,
                              "the per-example gradients of {name} do not add up to its batch gradient "
                              "(relative difference {rel:.2g}): the model uses it outside its module's call, "
                              "e.g. F.linear(x, self.fc.weight)")
            alone = self._alone({k: v[:1] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[:1],
                                None if labels is None else labels[:1], params)
            self._compare({k: g[0] for k, g in grads.items()}, alone, grads,
                          "example 0's gradient of {name} in a batch differs from its gradient alone (relative "
                          "difference {rel:.2g}): examples interact in the forward pass (batch statistics, "
                          "a batch-wide operation) or a selected weight is used outside its module's call")
        return grads, q.detach().to(torch.float32)

    def _outputs(self, inputs, labels: torch.Tensor | None, n: int, row_offset: int):
        """``(f [n], Q [n])`` of the task on a batch, after its checks (a custom task's first on the first
        example, as :class:`PerExampleGradients` does, then on the batch)."""
        with forward_errors(self.model, inputs):
            detached = {k: v.detach() for k, v in inputs.items()} if isinstance(inputs, dict) else inputs.detach()
            logits = forward(self.model, detached)
        batch = make_batch(inputs, labels)
        if isinstance(self.task, CustomTask) and logits.ndim >= 1 and logits.shape[0] == n:
            self.task.check(logits[:1], {k: v[:1] for k, v in batch.items()}, row_offset)
        self.task.check(logits, batch, row_offset)
        return self.task(logits, batch)

    def _alone(self, inputs, labels: torch.Tensor | None, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Plain autograd gradient of ``f`` of one example alone (no hooks), per selected parameter."""
        chosen = [params[k] for k in self.param_names]
        with self._hooked(None, chosen):
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

    # ------------------------------------------------------------------ hooks

    @contextmanager
    def _hooked(self, state: _Pass | None, chosen: list[torch.Tensor]) -> Iterator[None]:
        """Grad mode on, forward hooks on every covered module (none without ``state``); parameters
        require grad only when in ``chosen``."""
        flags = [(p, p.requires_grad) for p in self.model.parameters()]
        handles = []
        try:
            for p, _ in flags:
                p.requires_grad_(False)  # output gradients only: no weight gradient is computed
            for p in chosen:  # the guard's batch gradient
                p.requires_grad_(True)
            for use in self.uses if state is not None else []:
                handles.append(use.module.register_forward_hook(partial(self._forward_hook, state, use), with_kwargs=True))
            with torch.enable_grad():
                yield
        finally:
            for h in handles:
                h.remove()
            for p, flag in flags:
                p.requires_grad_(flag)

    def _forward_hook(self, state: _Pass, use: GradUse, module: nn.Module, args, kwargs, output):
        if state.problem is not None:
            return None
        x = args[0] if args else kwargs.get("input")
        if not torch.is_tensor(x) or not torch.is_tensor(output) or x.dim() == 0:
            state.problem = f"module {use.name} was called without a tensor input"
            return None
        b, n = x.shape[0], state.n
        if b not in (n, 1) or output.dim() == 0 or output.shape[0] != b:
            state.problem = (f"module {use.name} ran on a tensor of batch dimension {b} (output "
                             f"{list(output.shape)}) in a batch of {n} rows; the hooks need the batch first")
            return None
        if not torch.is_grad_enabled():
            return None  # run under no_grad: no gradient reaches its parameters
        broadcast = b == 1 and n > 1
        if broadcast:
            x, output = x.expand(n, *x.shape[1:]), output.expand(n, *output.shape[1:])
        out = output if output.requires_grad and not broadcast else output + state.anchor
        x = x.detach()
        state.saved.append((x, x._version))
        out.register_hook(partial(self._grad_hook, state, use, len(state.saved) - 1, broadcast))
        return out

    def _grad_hook(self, state: _Pass, use: GradUse, slot: int, broadcast: bool, g: torch.Tensor) -> None:
        saved, state.saved[slot] = state.saved[slot], None
        x, version = saved  # type: ignore[misc]
        if state.problem is not None:
            return
        if x._version != version:
            state.problem = f"the input of module {use.name} was changed in place after the module ran"
            return
        n, m, kind = state.n, use.module, use.kind
        if broadcast and not bool(g[1:].any()) and bool(g[0].any()):
            state.problem = (f"module {use.name} ran on a batch-broadcast input and only the first row of its output "
                             "received a gradient")
            return
        if kind in ("linear", "hf_conv1d"):
            a, gt = x.reshape(n, -1, x.shape[-1]), g.reshape(n, -1, g.shape[-1])  # [n, T, in], [n, T, out]
            left, right = (gt, a) if kind == "linear" else (a, gt)
            if use.weight is None:
                w = None
            elif a.shape[1] == 1:  # one position: an outer product (3x faster than a bmm over T = 1)
                w = left[:, 0, :, None] * right[:, 0, None, :]
            else:
                w = torch.bmm(left.transpose(1, 2), right)
            b = gt.sum(1)
        elif kind in ("conv1d", "conv2d"):
            gt = g.reshape(n, g.shape[1], -1)  # [n, C_out, positions]
            w = torch.bmm(gt, _patches(m, x).transpose(1, 2)).reshape(n, *m.weight.shape) if use.weight else None
            b = gt.sum(-1)
        elif kind == "embedding":
            ids, gt = x.reshape(n, -1), g.reshape(n, -1, g.shape[-1])  # [n, T], [n, T, d]
            if m.padding_idx is not None:  # torch gives the padding_idx row no gradient
                gt = gt * (ids != m.padding_idx).unsqueeze(-1).to(gt.dtype)
            rows = (ids + m.num_embeddings * torch.arange(n, device=ids.device).unsqueeze(1)).reshape(-1)
            w = gt.new_zeros(n * m.num_embeddings, gt.shape[-1]).index_add_(0, rows, gt.reshape(-1, gt.shape[-1]))
            w, b = w.view(n, *m.weight.shape), None
        else:  # normalization: weight Σ_t g ⊙ x̂, bias Σ_t g, over all but the affine dims
            channel = kind in ("group_norm", "batch_norm")
            shape = (n, g.shape[1], -1) if channel else (n, -1, *m.normalized_shape)
            dims = -1 if channel else 1
            w = (g * _normalized(use, x)).reshape(shape).sum(dims) if use.weight else None
            b = g.reshape(shape).sum(dims)
        for name, t in ((use.weight, w), (use.bias, b)):
            if name is not None:
                state.grads[name] = state.grads[name] + t if name in state.grads else t


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
        grad_wrt: parameter name patterns (:func:`trakcli.gradients.select_parameters`).
        task: the model output function (:func:`trakcli.gradients.resolve_task`).
        method: ``auto``: :class:`LayerGradients` when every selected parameter is in a covered
            module (:data:`HOOKED`), falling back to vmap for good if its first-batch guard fails,
            else :class:`~trakcli.gradients.PerExampleGradients`; ``hooks``: :class:`LayerGradients`,
            raising instead of falling back; ``vmap``: :class:`~trakcli.gradients.PerExampleGradients`.

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
    _, left_out = gradient_uses(model, select_parameters(model, grad_wrt))
    if not left_out:
        return LayerGradients(model, grad_wrt, task, fallback=True)
    grads = PerExampleGradients(model, grad_wrt, task)
    grads.reason = f"per-example gradients: torch.func.vmap, as layer hooks do not cover {describe_left_out(left_out)}"
    return grads
