"""A plain training recipe for classifiers (the checkpoints of the quickstart).

The projected optimizer is ``trakcli.optim``; this is ordinary minibatch
training with a ``torch.optim`` optimizer and the cross-entropy loss.
"""

from __future__ import annotations

import torch
from torch import nn

from trakcli.progress import NULL_REPORTER, Reporter


def make_optimizer(
    name: str, params, *, lr: float, momentum: float = 0.9, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    """``torch.optim`` optimizer by name: ``sgd`` (with momentum), ``adam`` or ``adamw``."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}")


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

    Returns:
        The same model, trained, in eval mode.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = make_optimizer(optimizer, model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    n = inputs.shape[0]
    model.train()
    with reporter.task(description, epochs) as task:
        for _ in range(epochs):
            order = torch.randperm(n, generator=gen)
            for lo in range(0, n, batch_size):
                idx = order[lo : lo + batch_size]
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model(inputs[idx]), labels[idx])
                loss.backward()
                opt.step()
            task.advance()
    return model.eval()
