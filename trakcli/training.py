"""A plain training recipe for classifiers (the checkpoints of the quickstart).

Ordinary minibatch training with the cross-entropy loss and a ``torch.optim``
optimizer, or that optimizer run in a random subspace by
:class:`trakcli.optim.ProjectedOptimizer` when a ``projection`` is given.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trakcli.progress import NULL_REPORTER, Reporter


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
    """``torch.optim`` optimizer by name: ``sgd`` (with momentum), ``adam`` or ``adamw``.

    With ``projection`` (the ``optimize.projection`` mapping), the named
    optimizer becomes the inner optimizer of a
    :class:`~trakcli.optim.ProjectedOptimizer`, and ``weight_decay`` is applied
    decoupled in the full parameter space (``W ← W(1 - lr·wd)``).
    """
    if name not in _INNER:
        raise ValueError(f"unknown optimizer {name!r}")
    kwargs: dict[str, Any] = {"lr": lr}
    if name == "sgd":
        kwargs["momentum"] = momentum
    if projection is not None:
        from trakcli.optim import ProjectedOptimizer

        return ProjectedOptimizer(params, inner=_INNER[name], projection=projection, weight_decay=weight_decay, **kwargs)
    return _INNER[name](params, weight_decay=weight_decay, **kwargs)


def train_classifier(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    weight_decay: float = 0.0,
    momentum: float = 0.9,
    optimizer: str = "sgd",
    seed: int = 0,
    reporter: Reporter = NULL_REPORTER,
    description: str = "train",
    projection: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
) -> nn.Module:
    """Train ``model`` in place with cross-entropy on ``(inputs, labels)``.

    The minibatch order is drawn from a ``torch.Generator`` seeded with
    ``seed``, so a run is reproducible on one machine.

    Args:
        model: the classifier, logits ``[n, C]``.
        inputs: ``[n, ...]`` float32.
        labels: ``[n]`` int64.
        epochs, batch_size, lr, weight_decay, momentum, optimizer: the recipe.
        seed: seed of the shuffling generator (initialize the model before calling).
        projection: run the optimizer in a random subspace (``optimize.projection``,
            see :func:`make_optimizer`); ``None``: plain.
        metrics: if given, filled with ``final_loss`` (mean loss of the last
            epoch) and ``optimizer_state_numel`` (floats of optimizer state).

    Returns:
        The same model, trained, in eval mode.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = make_optimizer(
        optimizer, model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay, projection=projection
    )
    loss_fn = nn.CrossEntropyLoss()
    n = inputs.shape[0]
    model.train()
    with reporter.task(description, epochs) as task:
        for _ in range(epochs):
            order = torch.randperm(n, generator=gen)
            total = 0.0
            for lo in range(0, n, batch_size):
                idx = order[lo : lo + batch_size]
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model(inputs[idx]), labels[idx])
                loss.backward()
                opt.step()
                total += loss.item() * len(idx)
            task.advance()
    if metrics is not None:
        metrics["final_loss"] = total / n
        metrics["optimizer_state_numel"] = optimizer_state_numel(opt)
    return model.eval()


def optimizer_state_numel(opt: torch.optim.Optimizer) -> int:
    """Floats an optimizer holds as state (tensors other than step counters)."""
    if hasattr(opt, "state_numel"):
        return int(opt.state_numel())
    return sum(
        v.numel() for st in opt.state.values() for k, v in st.items() if isinstance(v, torch.Tensor) and k != "step"
    )
