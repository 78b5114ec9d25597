"""Per-example gradients of the model output function, with torch.func.

For classification (Park et al. 2023, TRAK, Sec. 3 and App. E) the model output
function of an example ``z = (x, y)`` is the margin

    f(z; θ) = logit_y − logsumexp_{j≠y} logit_j  = log(p_y / (1 − p_y)),

and the out-to-loss term is ``Q(z) = 1 − p_y`` (``∂loss/∂f`` for the
cross-entropy loss). Gradients are ``vmap(grad(f))`` over the batch with
``torch.func.functional_call``; only the parameters selected by ``grad_wrt``
are differentiated, the rest (and the buffers) are passed as constants. The
model is put in eval mode, so dropout and batch-norm statistics are fixed.

Gradients are returned per parameter, as a dict of named tensors, so that a
projector can consume them chunk by chunk (and so that factored projections
can plug in later).
"""

from __future__ import annotations

import fnmatch
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from trakcli.errors import ConfigError, DataError, GradientError


def select_parameters(model: nn.Module, grad_wrt: list[str] | None) -> list[str]:
    """Names of the parameters to differentiate, in ``model.named_parameters()`` order.

    Args:
        model: the model.
        grad_wrt: ``fnmatch`` patterns (``"2.*"``, ``"*.weight"``); ``None`` selects all.

    Raises:
        ConfigError: a pattern that matches no parameter (names the parameters),
            or a selection that is empty.
    """
    names = [n for n, p in model.named_parameters()]
    if grad_wrt is None:
        selected = names
    else:
        unmatched = [pat for pat in grad_wrt if not any(fnmatch.fnmatchcase(n, pat) for n in names)]
        if unmatched:
            shown = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "")
            raise ConfigError(
                [f"grad_wrt: pattern {pat!r} matches no parameter; the model's parameters are: {shown}" for pat in unmatched]
            )
        selected = [n for n in names if any(fnmatch.fnmatchcase(n, pat) for pat in grad_wrt)]
    if not selected:
        raise ConfigError("grad_wrt: no parameter selected; the model has no parameters to differentiate")
    return selected


def classification_margin(logits: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Margin and out-to-loss term of one example (vmap-safe: no data-dependent indexing).

    Args:
        logits: ``[C]`` float logits.
        label: ``[]`` int64 class index.

    Returns:
        ``(margin [], out_to_loss [])`` where margin = logit_y − logsumexp_{j≠y} logit_j
        and out_to_loss = 1 − softmax(logits)_y (Park et al. 2023, Eq. 13 and App. E).
    """
    mask = torch.arange(logits.shape[-1], device=logits.device) == label
    logit_y = (logits * mask).sum()
    others = logits.masked_fill(mask, float("-inf"))
    margin = logit_y - torch.logsumexp(others, dim=-1)
    # 1 - p_y = sigmoid(-margin), computed stably
    out_to_loss = torch.sigmoid(-margin)
    return margin, out_to_loss


class PerExampleGradients:
    """Computes ``∇_θ f(z; θ)`` for each example of a batch, and ``Q(z)``.

    Args:
        model: the model; it is switched to eval mode.
        grad_wrt: parameter name patterns (see :func:`select_parameters`).
        task: model output function; only ``"classification"`` for now.

    Attributes:
        param_names: the differentiated parameters, in order.
        param_shapes: their shapes.
        grad_dim: total number of differentiated entries.
    """

    def __init__(self, model: nn.Module, grad_wrt: list[str] | None = None, task: str = "classification"):
        if task != "classification":
            raise ConfigError(f"task: {task!r} is not supported; use 'classification'")
        self.model = model.eval()
        self.param_names = select_parameters(model, grad_wrt)
        params = dict(model.named_parameters())
        self.param_shapes = {n: tuple(params[n].shape) for n in self.param_names}
        self.grad_dim = int(sum(params[n].numel() for n in self.param_names))
        self._fn: Callable | None = None

    def _constants(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        chosen = set(self.param_names)
        params = {n: p.detach() for n, p in self.model.named_parameters() if n in chosen}
        const = {n: p.detach() for n, p in self.model.named_parameters() if n not in chosen}
        const.update({n: b.detach() for n, b in self.model.named_buffers()})
        return params, const

    def __call__(
        self, inputs: torch.Tensor, labels: torch.Tensor, row_offset: int = 0
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Per-example gradients of the margin and the out-to-loss terms of a batch.

        Args:
            inputs: ``[n, ...]`` model inputs on the model's device.
            labels: ``[n]`` int64 class indices.
            row_offset: dataset index of the batch's first row (for error messages).

        Returns:
            ``(grads, out_to_loss)``: ``grads[name]`` is ``[n, *param.shape]``
            in the parameter's dtype; ``out_to_loss`` is ``[n]`` float32.

        Raises:
            DataError: inputs of a shape the model cannot take, or labels out of range.
        """
        params, const = self._constants()
        model = self.model

        def f(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
            logits = functional_call(model, {**p, **const}, (x.unsqueeze(0),))
            margin, q = classification_margin(logits.reshape(-1), y)
            return margin, q.detach()

        self._check_batch(inputs, labels, params, const, row_offset)
        grads, q = vmap(grad(f, has_aux=True), in_dims=(None, 0, 0))(params, inputs, labels)
        return grads, q.to(torch.float32)

    def _check_batch(self, inputs, labels, params, const, row_offset: int) -> None:
        """One plain forward pass to turn shape errors into clear messages."""
        try:
            with torch.no_grad():
                logits = functional_call(self.model, {**params, **const}, (inputs[:1],))
        except RuntimeError as e:
            raise DataError(
                f"the model cannot take inputs of shape {list(inputs.shape[1:])} per example: {e}; "
                "check data.*.inputs against model.entrypoint / model.kwargs"
            ) from None
        if logits.ndim != 2 or logits.shape[0] != 1:
            raise DataError(
                f"the model must return logits [n, num_classes]; for a batch of 1 it returned shape {list(logits.shape)}"
            )
        n_classes = logits.shape[1]
        bad = (labels < 0) | (labels >= n_classes)
        if bad.any():
            rows = (torch.nonzero(bad).flatten()[:5] + row_offset).tolist()
            raise DataError(
                f"labels out of range: the model has {n_classes} classes but examples {rows} have labels "
                f"{labels[bad][:5].tolist()}; labels must be in [0, {n_classes - 1}]"
            )

    def flatten(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        """Concatenate per-parameter gradients into ``[n, grad_dim]`` (in ``param_names`` order)."""
        return torch.cat([grads[n].reshape(grads[n].shape[0], -1) for n in self.param_names], dim=1)


def check_finite(rows: torch.Tensor, row_offset: int) -> None:
    """Raise if any example's row has NaN or inf entries.

    Called on the projected features ``[n, proj_dim]`` rather than on the
    ``[n, grad_dim]`` gradients: a non-finite gradient entry meets nonzero
    matrix entries and makes its features non-finite, and the check then costs
    O(proj_dim) instead of O(grad_dim) per example.

    Args:
        rows: ``[n, ...]`` per-example values (features or gradients).
        row_offset: dataset index of the first row.

    Raises:
        GradientError: naming the (global) indices of the offending examples.
    """
    bad = ~torch.isfinite(rows.reshape(rows.shape[0], -1)).all(dim=1)
    if bad.any():
        rows = (torch.nonzero(bad).flatten() + row_offset).tolist()
        raise GradientError(
            f"non-finite gradients for examples {rows[:10]}{' ...' if len(rows) > 10 else ''}; "
            "check those inputs and the checkpoint for NaN/inf values"
        )
