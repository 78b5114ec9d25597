"""The forward pass of a model on a batch: a tensor, or a dict of text tensors for a transformers model.

Under ``torch.func.vmap`` the attention-mask builders of transformers 5 fail on a 2-D ``attention_mask`` (they branch on
``padding_mask.all()``, data-dependent control flow). So :func:`model_kwargs` passes a 4-D additive float mask
``[n, 1, L, L]`` (0 where attended, the dtype's minimum elsewhere; lower-triangular as well for causal LMs), which the
eager attention of :func:`trakcli.models.hf.build_hf_model` adds to its scores as given.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from trakcli.errors import DataError, ModelError, user_code
from trakcli.models.build import model_name
from trakcli.models.hf import is_causal


def additive_mask(attention_mask: torch.Tensor, causal: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """4-D additive attention mask from a padding mask (vmap-safe: no data-dependent control flow).

    Args:
        attention_mask: ``[n, L]`` 0/1 (int or bool), 1 on real tokens.
        causal: also mask keys after each query (``j > i``).
        dtype: dtype of the result.

    Returns:
        ``[n, 1, L, L]`` in ``dtype``: 0 where query i may attend key j, ``finfo(dtype).min`` elsewhere.
    """
    n, length = attention_mask.shape
    keep = (attention_mask != 0)[:, None, None, :]  # [n, 1, 1, L]
    if causal:
        idx = torch.arange(length, device=attention_mask.device)
        keep = keep & (idx[None, :] <= idx[:, None])[None, None]  # [n, 1, L, L]
    keep = keep.expand(n, 1, length, length)
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    return torch.where(keep, zero, torch.finfo(dtype).min)


def model_kwargs(model: nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keyword arguments of a transformers forward pass on ``inputs`` (``input_ids [n, L]`` int64, optionally
    ``attention_mask [n, L]``), the mask made 4-D by :func:`additive_mask`."""
    kw = dict(inputs)
    am = kw.get("attention_mask")
    if am is not None and am.ndim == 2:
        kw["attention_mask"] = additive_mask(am, is_causal(model))
    return kw


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a forward pass: ``output.logits``, ``output[0]`` or the tensor itself."""
    if torch.is_tensor(output):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, (tuple, list)):
        logits = output[0]
    if logits is None:
        raise ModelError(f"the model returned a {type(output).__name__} without logits")
    return logits


def forward(model: nn.Module, inputs: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of a batch: ``model(x)`` for a tensor, a transformers call for a dict of tensors."""
    if isinstance(inputs, dict):
        return logits_of(model(**model_kwargs(model, inputs)))
    return model(inputs)


def example_shape(inputs: torch.Tensor | dict[str, torch.Tensor]) -> object:
    """The shape of one example of a batch: ``list(x.shape[1:])``, or a dict of them for text inputs."""
    if isinstance(inputs, dict):
        return {k: list(v.shape[1:]) for k, v in inputs.items()}
    return list(inputs.shape[1:])


def forward_errors(model: nn.Module, inputs: torch.Tensor | dict[str, torch.Tensor]) -> AbstractContextManager[None]:
    """Report an exception of the model's forward pass on ``inputs`` (a shape the model rejects, any exception
    of the user's ``forward``) as one :class:`~trakcli.errors.DataError` line naming the per-example shape,
    the model and the exception's file and line (:func:`trakcli.errors.user_code`)."""
    return user_code(lambda: f"the model cannot take inputs of shape {example_shape(inputs)} per example: "
                     f"the forward pass of {model_name(model)}",
                     hint="check data.*.inputs against model.entrypoint / model.kwargs", error=DataError)
