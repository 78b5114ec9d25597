"""Evaluation without gradients (loss, accuracy) and the forward-pass check before training.

:func:`evaluate` measures a classifier on tensors, :func:`evaluate_dataset` any task on a dataset
read in batches, :func:`validate` either of them for the per-epoch validation; :func:`check_forward`
runs the first example once before training and checks its labels against the logits. None of
them draws random numbers or changes the model's train/eval mode.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trakcli.data.tensors import Inputs, TensorDataset, inputs_to, slice_inputs
from trakcli.models.forward import forward, forward_errors
from trakcli.tasks import CustomTask, Task, check_by_first, make_batch, resolve_task
from trakcli.train.rows import TensorRows, TrainRows


def validate(
    model: nn.Module, validation: Any, task: Task, batch_size: int, max_tokens: int | None,
    name: str = "validation",
) -> tuple[float, float | None]:
    """``(loss, accuracy or None)`` of the validation data: tensors ``(inputs, labels)`` or a dataset.

    Tensors are on the model's device; a classifier's cross-entropy on tensors is :func:`evaluate`, anything
    else :func:`evaluate_dataset` in batches of ``batch_size`` rows and ``max_tokens`` padded tokens.
    ``name`` names tensors given as such in messages.
    """
    if isinstance(validation, tuple):
        if task.has_accuracy and type(task).loss is Task.loss:  # a classifier's cross-entropy
            return evaluate(model, validation[0], validation[1], batch_size=batch_size)
        validation = TensorDataset(validation[0], validation[1], name)
    device = next(model.parameters()).device
    return evaluate_dataset(model, validation, task, batch_size=batch_size, max_tokens=max_tokens, device=device)


def evaluate_dataset(
    model: nn.Module,
    data: Any,
    task: Task | str,
    *,
    batch_size: int = 256,
    max_tokens: int | None = None,
    device: torch.device | str = "cpu",
) -> tuple[float, float | None]:
    """Mean task loss (and, for classifiers, accuracy) over a dataset, without gradients, in eval mode.

    The loss is the task's (:meth:`~trakcli.tasks.Task.loss`), summed over the batches and
    divided by its terms (rows, or target tokens for language models), so it does not
    depend on the batching. The model's train/eval mode is restored afterwards; no
    random numbers are drawn.

    Args:
        model: the model, on ``device``.
        data: anything with ``len`` and ``batches(start, stop, batch_size, max_tokens)`` yielding
            ``(row_offset, inputs, labels)`` (:class:`~trakcli.data.tensors.TensorDataset`,
            :class:`~trakcli.data.text.TextDataset`, read lazily).
        task: the task.
        batch_size, max_tokens: the batches (rows; padded tokens).
        device: where the batches go.

    Returns:
        ``(loss, accuracy)``: mean loss in nats; share of rows whose argmax logit is the label,
        ``None`` for token-level tasks.

    Raises:
        DataError: the forward pass fails on a batch, or a row cannot be read.
    """
    task = resolve_task(task)
    was_training = model.training
    model.eval()
    loss_sum, count, right, rows = 0.0, 0, 0, 0
    try:
        with torch.no_grad():
            for _, x, y in data.batches(0, len(data), batch_size, max_tokens):
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


def evaluate(
    model: nn.Module, inputs: Inputs, labels: torch.Tensor, *, batch_size: int = 256
) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy of a classifier, without gradients, in eval mode.

    The model's train/eval mode is restored afterwards; no random numbers are drawn
    (by standard layers: dropout is off in eval mode), so calling this between
    training steps leaves the training unchanged.

    Args:
        model: classifier with logits ``[n, C]``, on the device of ``inputs``.
        inputs: ``[n, ...]`` float32 (or a dict of ``[n, L]`` tensors for a transformers model).
        labels: ``[n]`` int64 class labels, on the same device.
        batch_size: rows per forward pass (bounds the memory).

    Returns:
        ``(loss, accuracy)``: mean loss in nats, share of rows whose argmax logit is the label.
    """
    was_training = model.training
    model.eval()
    n = labels.shape[0]
    loss_sum, right = 0.0, 0
    try:
        with torch.no_grad():
            for lo in range(0, n, batch_size):
                hi = min(lo + batch_size, n)
                batch = slice_inputs(inputs, lo, hi)
                with forward_errors(model, batch):
                    logits = forward(model, batch)  # [b, C]
                loss_sum += nn.functional.cross_entropy(logits, labels[lo:hi], reduction="sum").item()
                right += int((logits.argmax(1) == labels[lo:hi]).sum())
    finally:
        model.train(was_training)
    return loss_sum / max(n, 1), right / max(n, 1)


def check_forward(
    model: nn.Module, inputs: Inputs | TrainRows, labels: torch.Tensor | None = None, task: Task | str = "classification"
) -> None:
    """One forward pass of the first example (eval mode, no gradients) before training starts.

    Any exception of it (a shape the model rejects, a bug in the user's
    ``forward``) becomes one :class:`~trakcli.errors.DataError` line naming the
    file and line (:func:`trakcli.models.forward.forward_errors`), and the labels
    must fit the loss: classes of the model (``[1, C]`` logits), or token ids of its
    vocabulary and -100 (``[1, L, V]`` logits of a causal LM). Tensors held in memory
    have every label checked; lazily read data its first row. Draws no random numbers
    (eval mode), so the training that follows is unchanged.

    Args:
        model: the model.
        inputs: ``[n, ...]`` (or a dict of ``[n, L]`` tensors), or the training rows (:class:`TrainRows`).
        labels: ``[n]`` int64 class labels or ``[n, L]`` per-token labels (with tensor ``inputs``).
        task: the task whose loss trains the model.

    Raises:
        DataError: the forward pass raised, the logits do not fit the task, or a label is out of range.
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

