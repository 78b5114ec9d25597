"""Evaluation without gradients (loss, accuracy) and the forward-pass check before training.

:func:`validate` measures any task on tensors or a dataset read in batches; :func:`check_forward`
runs the first example once before training and checks its labels against the logits. Neither
draws random numbers or changes the model's train/eval mode.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trakcli.data.tensors import Inputs, TensorDataset, inputs_to
from trakcli.models.forward import forward, forward_errors
from trakcli.tasks import CustomTask, Task, check_by_first, make_batch, resolve_task
from trakcli.train.rows import TensorRows, TrainRows


def validate(
    model: nn.Module, validation: Any, task: Task | str, batch_size: int, max_tokens: int | None,
    name: str = "validation",
) -> tuple[float, float | None]:
    """``(mean task loss in nats, accuracy or None)`` of ``validation``, in eval mode without gradients.

    ``validation``: tensors ``(inputs, labels)`` on the model's device (``name`` in messages), or a dataset
    (``len``, ``batches(start, stop, batch_size, max_tokens)``). The loss is summed over the batches and divided
    by its terms, so it does not depend on the batching; the model's mode is restored.

    Raises:
        DataError: the forward pass fails on a batch, or a row cannot be read.
    """
    task = resolve_task(task)
    if isinstance(validation, tuple):
        if task.has_accuracy and type(task).loss is Task.loss:  # a classifier's tensors: batches of rows alone
            max_tokens = None
        validation = TensorDataset(validation[0], validation[1], name)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    loss_sum, count, right, rows = 0.0, 0, 0, 0
    try:
        with torch.no_grad():
            for _, x, y in validation.batches(0, len(validation), batch_size, max_tokens):
                x, y = inputs_to(x, device), y.to(device)
                with forward_errors(model, x):
                    logits = forward(model, x)  # [b, C] or [b, L, V]
                batch = make_batch(x, y)
                loss_sum += task.loss(logits, batch, reduction="sum").item()
                count += task.loss_count(batch)
                if task.has_accuracy:
                    right += task.correct(logits, batch)
                rows += len(y)
    finally:
        model.train(was_training)
    return loss_sum / max(count, 1), (right / max(rows, 1) if task.has_accuracy else None)


def check_forward(
    model: nn.Module, inputs: Inputs | TrainRows, labels: torch.Tensor | None = None, task: Task | str = "classification"
) -> None:
    """One forward pass of the first example (eval mode, no gradients) before training starts.

    Any exception of it becomes one :class:`~trakcli.errors.DataError` line naming the file and line, and the labels
    must fit the loss (classes of ``[1, C]`` logits, or token ids and -100 of a causal LM's): every label of tensors in
    memory, the first row of lazily read data. ``inputs``: tensors with ``labels``, or the training rows.
    """
    rows = inputs if isinstance(inputs, TrainRows) else TensorRows(inputs, labels)
    task = resolve_task(task)
    # the loss reads the labels as the built-in task of its kind does
    checker = task.trained_as() if isinstance(task, CustomTask) else task
    was_training = model.training
    model.eval()
    try:
        first, _ = rows.first()
        with torch.no_grad(), forward_errors(model, first):
            logits = forward(model, first)  # [1, C] or [1, L, V]
        all_inputs, all_labels = rows.checked()
        check_by_first(checker, logits, all_inputs, all_labels)
    finally:
        model.train(was_training)

