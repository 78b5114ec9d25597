"""Pre- and post-step transforms of :class:`~trakcli.optim.ProjectedOptimizer`, broadcast with ``param_ndim``.

``param_ndim`` has rai_toolbox's meaning (``ParamTransformingOptimizer``): a tensor is viewed as a batch of sub-tensors
and the transform acts on each sub-tensor of the batch, i.e. on ``x.reshape(-1, *x.shape[ndim - k:])``:

* ``k > 0``: the trailing ``k`` dims form one item (``param_ndim=1`` on a ``[d0, d1, d2]`` tensor: ``d0·d1`` items of
  shape ``[d2]``); a ``k`` larger than the tensor's ndim makes the whole tensor one item.
* ``k <= 0``: an offset from the tensor's ndim: ``-1`` broadcasts over the first dim (each row of a weight matrix is one
  item; the default), ``0`` makes every scalar an item.
* ``None``: no broadcasting, the whole tensor is one item (batch of 1).

A transform takes the ``[B, ...]`` batch view and either modifies it in place
and returns ``None`` or returns a tensor of the same shape.
"""

from __future__ import annotations

from typing import Callable

import torch

Transform = Callable[[torch.Tensor], "torch.Tensor | None"]


def batch_view(x: torch.Tensor, param_ndim: int | None) -> torch.Tensor:
    """``x`` as ``[B, *item_shape]``, the items a transform acts on (module doc); a view when ``x`` is contiguous."""
    k = x.dim() if param_ndim is None else max(0, param_ndim if param_ndim >= 0 else x.dim() + param_ndim)
    if k >= x.dim():
        return x.reshape(1, *x.shape)
    return x.reshape(-1, *x.shape[x.dim() - k :])


def apply_transform(fn: Transform, x: torch.Tensor, param_ndim: int | None) -> None:
    """Apply ``fn`` to the batch view of ``x`` and write the result back into ``x`` (in place)."""
    view = batch_view(x, param_ndim)
    out = fn(view)
    if out is None:
        out = view
    if out.data_ptr() != x.data_ptr() or not x.is_contiguous():
        x.copy_(out.reshape(x.shape))


def sign_() -> Transform:
    """Gradient sign (signSGD, Bernstein et al. 2018): every entry becomes -1, 0 or +1."""

    def fn(g: torch.Tensor) -> None:
        g.sign_()

    return fn


def max_norm_(max_norm: float) -> Transform:
    """Rescale each item whose L2 norm exceeds ``max_norm`` to norm ``max_norm`` (per-row max-norm)."""

    def fn(x: torch.Tensor) -> None:
        norms = x.reshape(x.shape[0], -1).norm(dim=1).clamp_min(1e-30)
        factor = (max_norm / norms).clamp(max=1.0)
        x.mul_(factor.reshape(-1, *([1] * (x.dim() - 1))))

    return fn


def clamp_(lo: float | None = None, hi: float | None = None) -> Transform:
    """Clamp every entry to ``[lo, hi]`` (e.g. as a post-step transform on parameters)."""

    def fn(x: torch.Tensor) -> None:
        x.clamp_(min=lo, max=hi)

    return fn
