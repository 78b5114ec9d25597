"""The optimizer of the built-in recipe by name (:func:`make_optimizer`) and its learning-rate schedule
(:func:`lr_at`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


_INNER = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def make_optimizer(
    name: str,
    params,
    *,
    lr: float,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    projection: dict[str, Any] | None = None,
) -> torch.optim.Optimizer:
    """``torch.optim`` optimizer by name: ``sgd`` (with momentum), ``adam`` or ``adamw``; with ``projection`` the
    inner optimizer of a :class:`~trakcli.optim.ProjectedOptimizer`, weight decay decoupled in the full space."""
    if name not in _INNER:
        raise ValueError(f"unknown optimizer {name!r}")
    kwargs: dict[str, Any] = {"lr": lr}
    if name == "sgd":
        kwargs["momentum"] = momentum
    if projection is not None:
        from trakcli.optim import ProjectedOptimizer

        return ProjectedOptimizer(params, inner=_INNER[name], projection=projection, weight_decay=weight_decay, **kwargs)
    return _INNER[name](params, weight_decay=weight_decay, **kwargs)


def lr_at(step: int, *, lr: float, total_steps: int, schedule: str = "constant", warmup_steps: int = 0) -> float:
    """The learning rate of training step ``step``: linear warmup, then constant, linear or cosine decay.

    Step ``s`` (1-based) of the warmup uses ``lr * s / warmup_steps``; after it, with
    ``t = (s - warmup_steps - 1) / (total_steps - warmup_steps)`` (the share of the decay done before this step),
    ``linear`` uses ``lr * (1 - t)`` and ``cosine`` ``lr * (1 + cos(pi t)) / 2`` (Loshchilov & Hutter 2017, without
    restarts), ``constant`` ``lr``. The first step after the warmup uses ``lr``, the last one
    ``lr / (total_steps - warmup_steps)`` (linear).

    Raises:
        ValueError: an unknown schedule.
    """
    if warmup_steps and step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    t = min(1.0, max(0.0, (step - warmup_steps - 1) / max(1, total_steps - warmup_steps)))
    if schedule == "linear":
        return lr * (1.0 - t)
    if schedule == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * t))
    raise ValueError(f"schedule {schedule!r} is not one of constant, linear, cosine")


def optimizer_param_names(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter the optimizer holds, in its ``state_dict``'s order ("" for one not in ``model``)."""
    names = {id(p): k for k, p in model.named_parameters()}
    return [names.get(id(p), "") for g in opt.param_groups for p in g["params"]]

def optimizer_state_numel(opt: torch.optim.Optimizer) -> int:
    """Floats an optimizer holds as state (tensors other than step counters)."""
    if hasattr(opt, "state_numel"):
        return int(opt.state_numel())
    return sum(
        v.numel() for st in opt.state.values() for k, v in st.items() if isinstance(v, torch.Tensor) and k != "step"
    )
