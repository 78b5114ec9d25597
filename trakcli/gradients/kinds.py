"""The layer kinds the hooks cover, each defined once: how a module is recognized, and how its input and output
gradient give its per-example parameter gradients (exact) or their Kronecker factors.

For a module applied at positions ``t`` (tokens, pixels) of example ``i``, with input ``a_{i,t}`` and output gradient
``g_{i,t} = ∂f_i/∂y_{i,t}`` (Goodfellow 2015, "Efficient per-example gradient computations"; Rochette et al. 2019; the
Kronecker factors of LoGra, Choe et al. 2024):

* :class:`Linear` (``nn.Linear``, any leading dims): ``G_i = Σ_t g_{i,t} a_{i,t}ᵀ`` ``[out, in]``,
  bias ``Σ_t g_{i,t}``; :class:`HFConv1D` (transformers' ``Conv1D``, weight ``[in, out]``): ``Gᵢᵀ``;
* :class:`Conv` (``nn.Conv1d`` / ``nn.Conv2d``, ``groups=1``): the same with ``a_{i,t}`` the
  unfolded input patch at output position ``t`` (``F.unfold`` after the module's padding);
* :class:`Embedding` (``nn.Embedding``): ``a_{i,t}`` is one-hot, so row ``id_{i,t}`` of ``G_i``
  gets ``g_{i,t}`` (the ``padding_idx`` row gets nothing, as in torch);
* the normalizations (exact gradients only; not a matrix, so no Kronecker layer): ``nn.LayerNorm``, ``nn.RMSNorm``,
  transformers' Llama-style ``*RMSNorm``, ``nn.GroupNorm`` and ``nn.BatchNorm{1,2,3}d`` with running statistics:
  weight ``Σ_t g_{i,t} ⊙ x̂_{i,t}``, bias ``Σ_t g_{i,t}``, with ``x̂`` the normalized input recomputed from the
  module's input as its forward computes it.

A module is covered only with the ``forward`` of its class (a subclass that overrides
it is refused, named), so these formulas are the module's own.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn


class Kind:
    """A layer kind: how its modules are recognized and how their calls give parameter gradients.

    Attributes:
        name: the kind's name (``KroneckerLayer.kind`` of its layers, part of the projector spec).
        label: how messages name it (kinds of one label are listed once).
        classes: the module classes it covers.
        base: the class whose ``forward`` a covered module must have.
        role: where the weight sits in the layer's ``[d_out, d_in]`` matrix: ``weight``
            (``param.reshape(d_out, -1)``) or ``weight_t`` (``param.reshape(-1, d_out).T``).
        kronecker: whether its weight is a matrix applied to the input at each position, so
            a Kronecker layer covers it (the normalizations are covered by exact gradients only).
    """

    name = ""
    label = ""
    classes: tuple[type, ...] = ()
    base: type = nn.Module
    role = "weight"
    kronecker = True

    def matches(self, module: nn.Module) -> bool:
        """Whether ``module`` is of this kind (it may still be refused, :meth:`refusal`)."""
        return isinstance(module, self.classes)

    def refusal(self, module: nn.Module) -> str:
        """Why a module of this kind is not covered ("" when it is)."""
        if type(module).forward is not self.base.forward:
            return f"{type(module).__name__} overrides the forward of {self.base.__name__}"
        return ""

    def d_out(self, module: nn.Module) -> int:
        """Rows of the layer's gradient matrix: output features or channels."""
        raise NotImplementedError

    def bias(self, module: nn.Module) -> nn.Parameter | None:
        """The module's bias parameter, if any."""
        bias = getattr(module, "bias", None)
        return bias if isinstance(bias, nn.Parameter) else None

    # ------------------------------------------------------------ Kronecker factors (kronecker kinds)

    def out_grads(self, g: torch.Tensor, n: int) -> torch.Tensor:
        """``g_t`` at every position, ``[n, T, d_out]``, from the output gradient (the module's output shape)."""
        return g.reshape(n, -1, g.shape[-1])

    def project_input(self, module: nn.Module, x: torch.Tensor, output: torch.Tensor, p_w: torch.Tensor | None,
                      p_b: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """``P a_t`` at every position, ``[b, T, k]`` in ``dtype``, for the module's input ``x`` ``[b, ...]``.

        Args:
            module: the module; x, output: its input and output of one call.
            p_w: ``[d_in_weight, k]``: the transposed factor's weight rows, or None (bias only).
            p_b: ``[k]``: the factor's bias column (the folded-in 1 of ``a_t``), or None.
            dtype: the projector's dtype.
        """
        xr = x.detach().reshape(x.shape[0], -1, x.shape[-1])
        if p_w is None:
            return p_b.expand(x.shape[0], xr.shape[1], p_b.shape[-1])
        a = xr.to(dtype) @ p_w
        return a + p_b if p_b is not None else a

    def layer_input(self, module: nn.Module, x: torch.Tensor, output: torch.Tensor, width: int, cols: int,
                    weight: bool, bias: bool, dtype: torch.dtype) -> torch.Tensor:
        """``a_t`` itself at every position, ``[b, T, width]`` in ``dtype``: the input in columns ``[0, cols)`` when
        ``weight``, 1 in column ``cols`` when ``bias`` (the folded-in bias), zeros elsewhere; ``width`` is the
        layer's ``d_in``, ``cols`` its weight columns. :meth:`project_input` with the identity as ``P`` (the
        default); a kind whose ``a_t`` is at hand overrides it with a copy.
        """
        eye = torch.eye(width, dtype=dtype, device=x.device)
        return self.project_input(module, x, output, eye[:cols] if weight else None, eye[cols] if bias else None,
                                  dtype)

    # ------------------------------------------------------------ exact per-example gradients

    def exact(self, module: nn.Module, x: torch.Tensor, g: torch.Tensor, weight: bool
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per-example gradients of one call: ``(weight [n, *W.shape] or None, bias [n, *b.shape] or None)``.

        Args:
            module: the module; x: its input ``[n, ...]`` of the call; g: the gradient of ``Σ_i f_i``
                w.r.t. its output ``[n, ...]`` (row ``i`` is example ``i``'s own).
            weight: whether the weight's gradient is needed (else None is returned for it).
        """
        raise NotImplementedError


def _filled(a: torch.Tensor, width: int, cols: int, weight: bool, bias: bool, dtype: torch.dtype) -> torch.Tensor:
    """:meth:`Kind.layer_input` of ``a`` ``[b, T, cols]``, the layer's inputs; always a new tensor."""
    if weight and not bias and width == cols:
        return a.to(dtype, copy=True)
    out = a.new_zeros(*a.shape[:2], width, dtype=dtype)
    if weight:
        out[..., :cols] = a
    if bias:
        out[..., cols] = 1
    return out


class Linear(Kind):
    """``nn.Linear``: ``y_t = W a_t + b`` on the last dim, any leading dims."""

    name, label, classes, base = "linear", "nn.Linear", (nn.Linear,), nn.Linear

    def d_out(self, module):
        return module.out_features

    def _sides(self, gt, a):
        return gt, a  # G = Σ_t g_t a_tᵀ: [out, in], the weight's layout

    def layer_input(self, module, x, output, width, cols, weight, bias, dtype):
        return _filled(x.detach().reshape(x.shape[0], -1, x.shape[-1]), width, cols, weight, bias, dtype)

    def exact(self, module, x, g, weight):
        n = x.shape[0]
        a, gt = x.reshape(n, -1, x.shape[-1]), g.reshape(n, -1, g.shape[-1])  # [n, T, in], [n, T, out]
        left, right = self._sides(gt, a)
        if not weight:
            w = None
        elif a.shape[1] == 1:  # one position: an outer product (3x faster than a bmm over T = 1)
            w = left[:, 0, :, None] * right[:, 0, None, :]
        else:
            w = torch.bmm(left.transpose(1, 2), right)
        return w, gt.sum(1)


class HFConv1D(Linear):
    """transformers' ``Conv1D`` (GPT-2): ``y_t = Wᵀ a_t + b`` with the weight stored ``[in, out]``."""

    name, label, role = "hf_conv1d", "transformers' Conv1D", "weight_t"

    def matches(self, module):
        return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers")

    def refusal(self, module):
        return ""

    def d_out(self, module):
        return module.nf  # weight [in, out], out = nf

    def _sides(self, gt, a):
        return a, gt  # Gᵀ = Σ_t a_t g_tᵀ: [in, out], the weight's layout


class Conv(Kind):
    """``nn.Conv1d`` / ``nn.Conv2d`` with ``groups=1``: a linear map of the unfolded patch at each output position."""

    label = "nn.Conv1d/nn.Conv2d with groups=1"

    def __init__(self, cls: type):
        self.name, self.classes, self.base = cls.__name__.lower(), (cls,), cls

    def refusal(self, module):
        if module.groups != 1:
            return f"{type(module).__name__} with groups={module.groups} (only groups=1 is supported)"
        return super().refusal(module)

    def d_out(self, module):
        return module.out_channels

    def out_grads(self, g, n):
        return g.reshape(n, g.shape[1], -1).transpose(1, 2)  # [n, positions, C_out]

    def project_input(self, module, x, output, p_w, p_b, dtype):
        b, positions = x.shape[0], math.prod(output.shape[2:])
        if p_w is None:
            return p_b.expand(b, positions, p_b.shape[-1])
        k = p_w.shape[-1]
        weight = p_w.T.reshape(k, *module.weight.shape[1:])  # P_in as k filters over the patch
        # the module's own convolution (stride, padding, padding_mode, dilation) with P_in as its weight
        a = module._conv_forward(x.detach().to(dtype), weight, p_b)  # [b, k, *positions]
        return a.reshape(b, k, positions).transpose(1, 2)

    def layer_input(self, module, x, output, width, cols, weight, bias, dtype):
        return _filled(self.patches(module, x.detach()).transpose(1, 2), width, cols, weight, bias, dtype)

    def exact(self, module, x, g, weight):
        n = x.shape[0]
        gt = g.reshape(n, g.shape[1], -1)  # [n, C_out, positions]
        w = torch.bmm(gt, self.patches(module, x).transpose(1, 2)).reshape(n, *module.weight.shape) if weight else None
        return w, gt.sum(-1)

    @staticmethod
    def patches(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``[n, C_in·k, positions]``: the input patch at every output position (``F.unfold`` after the padding)."""
        pad = tuple(module._reversed_padding_repeated_twice)
        if any(pad):
            x = F.pad(x, pad, mode="constant" if module.padding_mode == "zeros" else module.padding_mode)
        if isinstance(module, nn.Conv1d):  # as a 2-D convolution of height 1
            x = x.unsqueeze(2)
            k, dil, stride = (1, *module.kernel_size), (1, *module.dilation), (1, *module.stride)
        else:
            k, dil, stride = module.kernel_size, module.dilation, module.stride
        return F.unfold(x, k, dilation=dil, padding=0, stride=stride)


class Embedding(Kind):
    """``nn.Embedding`` without ``scale_grad_by_freq``: ``y_t = W[id_t]``, i.e. ``Wᵀ`` times a one-hot ``a_t``."""

    name, label, classes, base, role = "embedding", "nn.Embedding", (nn.Embedding,), nn.Embedding, "weight_t"

    def refusal(self, module):
        if module.scale_grad_by_freq:
            return "nn.Embedding with scale_grad_by_freq (batch-dependent gradient)"
        return super().refusal(module)

    def d_out(self, module):
        return module.embedding_dim

    def bias(self, module):
        return None

    def project_input(self, module, x, output, p_w, p_b, dtype):
        b = x.shape[0]
        ids = x.reshape(b, -1)
        a = p_w[ids.flatten()].view(b, ids.shape[1], p_w.shape[-1])  # P_in a_t: the column of P_in at id_t
        if module.padding_idx is not None:  # torch gives the padding_idx row no gradient
            a = a * (ids != module.padding_idx).unsqueeze(-1).to(dtype)
        return a

    def exact(self, module, x, g, weight):
        n = x.shape[0]
        ids, gt = x.reshape(n, -1), g.reshape(n, -1, g.shape[-1])  # [n, T], [n, T, d]
        if module.padding_idx is not None:  # torch gives the padding_idx row no gradient
            gt = gt * (ids != module.padding_idx).unsqueeze(-1).to(gt.dtype)
        rows = (ids + module.num_embeddings * torch.arange(n, device=ids.device).unsqueeze(1)).reshape(-1)
        w = gt.new_zeros(n * module.num_embeddings, gt.shape[-1]).index_add_(0, rows, gt.reshape(-1, gt.shape[-1]))
        return w.view(n, *module.weight.shape), None


class Norm(Kind):
    """A normalization ``y = x̂ ⊙ w + b``: weight ``Σ_t g_t ⊙ x̂_t``, bias ``Σ_t g_t`` (exact gradients only).

    Attributes:
        channel: the affine parameters are per channel (dim 1: GroupNorm, BatchNorm), else
            over the trailing dims (LayerNorm, RMSNorm).
    """

    kronecker = False
    channel = False

    def normalized(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x̂``: the module's input normalized as its forward does, before the affine weight and bias."""
        raise NotImplementedError

    def exact(self, module, x, g, weight):
        n = x.shape[0]
        shape = (n, g.shape[1], -1) if self.channel else (n, -1, *module.weight.shape)  # the trailing dims of w
        dims = -1 if self.channel else 1
        w = (g * self.normalized(module, x)).reshape(shape).sum(dims) if weight else None
        return w, g.reshape(shape).sum(dims)


class LayerNorm(Norm):
    name, label, classes, base = "layer_norm", "nn.LayerNorm", (nn.LayerNorm,), nn.LayerNorm

    def normalized(self, module, x):
        return F.layer_norm(x, module.normalized_shape, None, None, module.eps)


class RMSNorm(Norm):
    name, label, classes, base = "rms_norm", "nn.RMSNorm", (nn.RMSNorm,), nn.RMSNorm

    def normalized(self, module, x):
        return F.rms_norm(x, module.normalized_shape, None, module.eps)


class HFRMSNorm(Norm):
    """transformers' Llama-style RMSNorm (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ...): ``weight * (x̂).to(x.dtype)``
    with ``x̂ = x · rsqrt(mean(x²) + variance_epsilon)`` over the last dim in float32
    (``transformers/models/llama/modeling_llama.py``). Recognized by the class name ending in ``RMSNorm`` in a
    ``transformers`` module, one parameter ``weight`` ``[d]``, ``variance_epsilon`` and a forward taking the
    hidden states alone (Gemma's ``(1 + weight)`` keeps ``eps``: refused); another formula under these names
    is caught by the exactness guard of :class:`trakcli.gradients.LayerGradients`.
    """

    name, label = "hf_rms_norm", "transformers' Llama-style RMSNorm"

    def matches(self, module):
        return type(module).__name__.endswith("RMSNorm") and type(module).__module__.startswith("transformers")

    def refusal(self, module):
        cls = type(module).__name__
        params = dict(module.named_parameters(recurse=False))
        if set(params) != {"weight"} or params["weight"].dim() != 1:
            return f"{cls} with parameters {sorted(params)} (covered: one weight [d], Llama's RMSNorm)"
        if not isinstance(getattr(module, "variance_epsilon", None), (int, float)):
            return f"{cls} without variance_epsilon (not Llama's RMSNorm forward)"
        if len(inspect.signature(type(module).forward).parameters) != 2:
            return f"{cls} whose forward takes more than the hidden states (not Llama's RMSNorm forward)"
        return ""

    def normalized(self, module, x):
        xf = x.to(torch.float32)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)).to(x.dtype)


class GroupNorm(Norm):
    name, label, classes, base, channel = "group_norm", "nn.GroupNorm", (nn.GroupNorm,), nn.GroupNorm, True

    def normalized(self, module, x):
        return F.group_norm(x, module.num_groups, None, None, module.eps)


class BatchNorm(Norm):
    name, label = "batch_norm", "nn.BatchNorm with running statistics"
    classes, base, channel = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), nn.BatchNorm1d, True

    def refusal(self, module):
        if module.running_mean is None or module.running_var is None:
            return f"{type(module).__name__} without running statistics (batch statistics mix the examples)"
        return super().refusal(module)

    def normalized(self, module, x):
        return F.batch_norm(x, module.running_mean, module.running_var, None, None, False, 0.0, module.eps)


#: Every kind, in the order a module is matched against them.
KINDS: tuple[Kind, ...] = (
    Linear(), Conv(nn.Conv1d), Conv(nn.Conv2d), Embedding(), HFConv1D(),
    LayerNorm(), RMSNorm(), HFRMSNorm(), GroupNorm(), BatchNorm(),
)

#: The kinds a Kronecker-factored projection covers.
KRONECKER_KINDS = tuple(k for k in KINDS if k.kronecker)


def kind_of(module: nn.Module, kinds: tuple[Kind, ...] = KINDS) -> tuple[Kind | None, str]:
    """``(kind, "")`` for a covered module; ``(None, reason)`` for a refused one; ``(None, "")`` for another module."""
    for kind in kinds:
        if kind.matches(module):
            why = kind.refusal(module)
            return (None, why) if why else (kind, "")
    return None, ""


def describe(kinds: tuple[Kind, ...]) -> str:
    """``"a, b and c"``: the labels of ``kinds`` (for messages)."""
    labels = list(dict.fromkeys(k.label for k in kinds))
    return labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " and " + labels[-1]
