"""Training: the built-in recipe for classifiers and causal LMs, and one model of a config's recipe.

:func:`train_model` is ordinary minibatch training with the task's loss
(:meth:`trakcli.tasks.Task.loss`: cross-entropy of a classifier's logits, or the
next-token cross-entropy over the target tokens of a causal LM) and a
``torch.optim`` optimizer, or that optimizer run in a random subspace by
:class:`trakcli.optim.ProjectedOptimizer` when a ``projection`` is given, with
an optional warmup and linear / cosine decay of the learning rate (:func:`lr_at`).
Rows held as tensors (:class:`TensorRows`) are batched by index; text and
language-model data (:class:`DatasetRows`) are read and tokenized batch by batch,
each batch padded to its own longest row. :func:`train_classifier` is
:func:`train_model` on tensors with the classification task. :func:`train_one` builds, seeds and trains one model with a config's
recipe (``optimize:``) or with the user's
``optimize.entrypoint``; `trak optimize` (:func:`trakcli.jobs.optimize.optimize`)
and the retraining of `trak eval` both call it. A model killed mid-training
resumes from its training state file bit-identically.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from trakcli.config import Config, OptimizeConfig
from trakcli.data.tensors import Inputs, TensorDataset, cut_batches, index_inputs, inputs_to, slice_inputs
from trakcli.errors import ConfigError, ModelError, TrainingError, user_code
from trakcli.files import atomic_torch_save
from trakcli.tasks import IGNORE_INDEX, CustomTask, Task, check_by_first, make_batch, resolve_task
from trakcli.jobs.divergence import check_loss, check_weights
from trakcli.models.forward import forward, forward_errors
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


class TrainRows:
    """The rows the built-in recipe trains on, batched in a given order.

    Attributes:
        n: number of rows.
    """

    n: int

    def batches(
        self, order: torch.Tensor, start: int, batch_size: int, max_tokens: int | None = None
    ) -> Iterator[tuple[int, Inputs, torch.Tensor]]:
        """Batches of the rows ``order[start:]`` (``order``: ``[n]`` int64, a permutation of ``range(n)``).

        Yields:
            ``(rows, inputs, labels)``: the batch's number of rows (the next entries of
            ``order``), its inputs and labels on the training device.
        """
        raise NotImplementedError

    def first(self) -> tuple[Inputs, torch.Tensor]:
        """``(inputs, labels)`` of the first row alone (``[1, ...]``), on the training device."""
        raise NotImplementedError

    def checked(self) -> tuple[Inputs, torch.Tensor]:
        """``(inputs, labels)`` whose labels :func:`check_forward` checks against the first row's logits."""
        return self.first()

    def steps_per_epoch(self, batch_size: int, max_tokens: int | None, order: torch.Tensor) -> int:
        """Batches of one epoch in ``order``: ``ceil(n / batch_size)`` for fixed-size batches."""
        return -(-self.n // batch_size)


class TensorRows(TrainRows):
    """Rows held as tensors (on the training device): minibatches are ``batch_size`` rows of ``order``.

    Args:
        inputs: ``[n, ...]`` float32, or a dict of ``[n, L]`` tensors (``input_ids``, ``attention_mask``).
        labels: ``[n]`` int64 class labels, or ``[n, L]`` int64 per-token labels (-100: not a target).
    """

    def __init__(self, inputs: Inputs, labels: torch.Tensor):
        self.inputs, self.labels = inputs, labels
        self.n = int(labels.shape[0])

    def batches(self, order, start, batch_size, max_tokens=None):
        """Consecutive ``batch_size`` slices of ``order[start:]`` (``max_tokens`` is not used: the rows are
        already padded)."""
        for lo in range(start, self.n, batch_size):
            idx = order[lo : lo + batch_size]
            yield len(idx), index_inputs(self.inputs, idx), self.labels[idx]

    def first(self):
        return slice_inputs(self.inputs, 0, 1), self.labels[:1]

    def checked(self):
        return self.inputs, self.labels


class DatasetRows(TrainRows):
    """Rows of a lazily read text or language-model dataset, tokenized as their batches are needed.

    Every batch is padded to its own longest row and holds at most ``batch_size`` rows
    and ``max_tokens`` padded tokens (``data.batch_tokens``), as featurize batches
    (:meth:`trakcli.data.text.TextDataset.batches_of`); the corpus is never held in memory.

    Args:
        data: a :class:`~trakcli.data.text.TextDataset` (anything with ``batches_of`` and ``token_lengths``).
        rows: the dataset rows to train on (a subset), in dataset order; ``None``: all.
        device: where the batches go.
        masked: tokens left out of the loss, ``{dataset row: [positions]}`` (their labels set to ``-100``).
    """

    def __init__(self, data: Any, rows: Sequence[int] | torch.Tensor | None = None, device: torch.device | str = "cpu",
                 masked: dict[int, list[int]] | None = None):
        self.data = data
        self.rows = list(range(len(data))) if rows is None else [int(i) for i in rows]
        self.n = len(self.rows)
        self.device = device
        self.masked = masked or {}
        self._lengths: list[int] | None = None

    def batches(self, order, start, batch_size, max_tokens=None):
        ids = [self.rows[i] for i in order[start:].tolist()]
        at = 0
        for count, x, y in self.data.batches_of(ids, batch_size, max_tokens):
            for j, row in enumerate(ids[at:at + count]):
                for pos in self.masked.get(row, ()):
                    if pos < y.shape[1]:
                        y[j, pos] = IGNORE_INDEX
            at += count
            yield count, inputs_to(x, self.device), y.to(self.device)

    def first(self):
        _, x, y = next(self.data.batches_of(self.rows[:1], 1))
        return inputs_to(x, self.device), y.to(self.device)

    def steps_per_epoch(self, batch_size, max_tokens, order):
        if max_tokens is None:
            return super().steps_per_epoch(batch_size, max_tokens, order)
        if self._lengths is None:
            self._lengths = self.data.token_lengths(self.rows)  # [n] ints: one tokenizing pass, not the corpus
        return sum(1 for _ in cut_batches([self._lengths[i] for i in order.tolist()], batch_size, max_tokens))

    def padded(self) -> tuple[Inputs, torch.Tensor]:
        """Every row of the subset in one batch padded to the longest (for a user's training function)."""
        order = torch.arange(self.n)
        _, x, y = next(self.batches(order, 0, max(1, self.n)))
        return x, y


def lr_at(step: int, *, lr: float, total_steps: int, schedule: str = "constant", warmup_steps: int = 0) -> float:
    """The learning rate of training step ``step``: linear warmup, then constant, linear or cosine decay.

    Step ``s`` (1-based) of the warmup uses ``lr * s / warmup_steps``; after it, with
    ``t = (s - warmup_steps - 1) / (total_steps - warmup_steps)`` (the share of the decay
    done before this step), ``linear`` uses ``lr * (1 - t)`` and ``cosine``
    ``lr * (1 + cos(pi t)) / 2`` (Loshchilov & Hutter 2017, without restarts), ``constant``
    ``lr``. The first step after the warmup uses ``lr``, the last one ``lr / (total_steps - warmup_steps)``
    (linear).

    Args:
        step: 1-based step over the whole training.
        lr: the peak learning rate.
        total_steps: steps of the whole training (all epochs).
        schedule: ``constant``, ``linear`` or ``cosine``.
        warmup_steps: steps of linear warmup (0: none).

    Returns:
        The learning rate, a float >= 0.

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


def count_steps(data: TrainRows, *, epochs: int, batch_size: int, max_tokens: int | None, seed: int) -> int:
    """Optimizer steps of a whole training: the epochs' batches in the orders the seeded generator draws.

    With fixed-size batches ``epochs * ceil(n / batch_size)``; with a token budget each
    epoch's order is drawn as training draws it and its batches counted from the rows' lengths.
    """
    gen = torch.Generator().manual_seed(seed)
    total = 0
    for _ in range(epochs):
        order = torch.randperm(data.n, generator=gen)
        total += data.steps_per_epoch(batch_size, max_tokens, order)
    return total


def train_classifier(
    model: nn.Module,
    inputs: Inputs,
    labels: torch.Tensor,
    **kwargs: Any,
) -> nn.Module:
    """Train a classifier in place with cross-entropy on ``(inputs, labels)``: :func:`train_model` with the
    classification task on tensors.

    Args:
        model: the classifier, logits ``[n, C]``.
        inputs: ``[n, ...]`` float32, or a dict of ``[n, L]`` tensors for a transformers model.
        labels: ``[n]`` int64.
        **kwargs: the keyword arguments of :func:`train_model`.

    Returns:
        The same model, trained, in eval mode.
    """
    return train_model(model, TensorRows(inputs, labels), **kwargs)


def optimizer_param_names(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter the optimizer holds, in its ``state_dict``'s order ("" for one not in ``model``)."""
    names = {id(p): k for k, p in model.named_parameters()}
    return [names.get(id(p), "") for g in opt.param_groups for p in g["params"]]


def train_model(
    model: nn.Module,
    data: TrainRows,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    task: Task | str = "classification",
    weight_decay: float = 0.0,
    momentum: float = 0.9,
    optimizer: str = "sgd",
    schedule: str = "constant",
    warmup_steps: int = 0,
    warmup_fraction: float = 0.0,
    max_tokens: int | None = None,
    seed: int = 0,
    reporter: Reporter = NULL_REPORTER,
    description: str = "train",
    projection: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    resume_path: str | Path | None = None,
    checkpoint_every: int = 0,
    validation: Any = None,
    name: str = "the model",
    optimizer_state: dict[str, Any] | None = None,
    epoch_end: Callable[[int, nn.Module, torch.optim.Optimizer], None] | None = None,
) -> nn.Module:
    """Train ``model`` in place on ``data`` with the task's loss (:meth:`trakcli.tasks.Task.loss`).

    Classification: cross-entropy of ``[n, C]`` logits; language modeling: the mean
    next-token cross-entropy over the target tokens of ``[n, L, V]`` logits. The
    minibatch order is drawn from a ``torch.Generator`` seeded with ``seed`` (one
    permutation per epoch), so a run is reproducible on one machine. The learning
    rate follows :func:`lr_at` (warmup, then ``schedule``). The progress task (one
    step per epoch) shows after every step the epoch's running mean ``loss`` (per
    row; per target token for language models), for classifiers the training
    accuracy ``acc`` (of the minibatches' own forward passes, in train mode: no
    extra pass), with a schedule the step's ``lr``, and with ``validation`` the
    ``val_loss`` (/ ``val_acc``) of the last finished epoch.

    Args:
        model: the model, on the device of ``data``'s batches.
        data: the rows (:class:`TensorRows`, :class:`DatasetRows`).
        epochs, batch_size, lr, weight_decay, momentum, optimizer: the recipe.
        task: the task whose loss is minimized (a :class:`~trakcli.tasks.Task` or a name).
        schedule, warmup_steps, warmup_fraction: the learning rate schedule (:func:`lr_at`);
            ``warmup_fraction`` of all steps (rounded up) in place of ``warmup_steps``.
        max_tokens: most padded tokens per batch of :class:`DatasetRows` (``data.batch_tokens``).
        seed: seed of the shuffling generator (initialize the model before calling).
        projection: run the optimizer in a random subspace (``optimize.projection``,
            see :func:`make_optimizer`); ``None``: plain.
        metrics: if given, filled with ``final_loss`` (mean loss of the last
            epoch), ``optimizer_state_numel`` (floats of optimizer state) and
            ``history``: one dict per epoch with ``epoch`` (1-based), ``loss``
            (mean minibatch loss) and, for classifiers, ``accuracy`` (share of the
            epoch's minibatch predictions that were right, in train mode), plus
            ``val_loss`` (and ``val_accuracy``) with ``validation``.
        resume_path: a file for the training state (model, optimizer, shuffling
            generator, position), written atomically every ``checkpoint_every``
            steps and at every epoch end, and deleted when training ends. If it
            exists at the start, training resumes from it, and the result is
            bit-identical to an uninterrupted run.
        checkpoint_every: steps between training-state checkpoints (0: at epoch ends only).
        validation: ``(inputs, labels)`` tensors or a dataset (``batches(start, stop, batch_size,
            max_tokens)``: :class:`~trakcli.data.tensors.TensorDataset`, :class:`~trakcli.data.text.TextDataset`)
            evaluated after every epoch (eval mode, no gradients); never changes the training.
        name: the model in messages, e.g. ``"model 3"``.
        optimizer_state: if given, filled with the final ``state_dict`` of the optimizer
            (``"state_dict"``) and the parameter names in its order (``"param_names"``).
        epoch_end: if given, called as ``epoch_end(epoch, model, optimizer)`` (1-based epoch) after
            every finished epoch, before its training state is saved: a resumed run calls it for
            the epochs it trains, and a kill between the two repeats the call on resume.

    Returns:
        The same model, trained, in eval mode.

    Raises:
        CheckpointError: the resume file cannot be read or was made with another recipe.
        TrainingError: a step's loss is not finite or above ``DIVERGED_FACTOR`` times
            the first step's (:func:`trakcli.jobs.divergence.check_loss`): names the model and the step.
        DataError: a row of lazily read data cannot be read or tokenized.
    """
    task = resolve_task(task)
    gen = torch.Generator().manual_seed(seed)
    opt = make_optimizer(
        optimizer, [p for p in model.parameters() if p.requires_grad], lr=lr, momentum=momentum, weight_decay=weight_decay, projection=projection
    )
    n = data.n
    scheduled = schedule != "constant" or bool(warmup_steps) or bool(warmup_fraction)
    total_steps = 0
    if scheduled:
        total_steps = count_steps(data, epochs=epochs, batch_size=batch_size, max_tokens=max_tokens, seed=seed)
        if warmup_fraction:
            warmup_steps = math.ceil(warmup_fraction * total_steps)
    with_acc = task.has_accuracy
    recipe: dict[str, Any] = {
        "epochs": epochs, "batch_size": batch_size, "lr": lr, "weight_decay": weight_decay, "momentum": momentum,
        "optimizer": optimizer, "seed": seed, "projection": projection, "n": n,
    }
    # the schedule and the token budget are recorded when they shape the training
    if scheduled:
        recipe.update(schedule=schedule, warmup_steps=warmup_steps)
    if max_tokens is not None and isinstance(data, DatasetRows):
        recipe["max_tokens"] = max_tokens
    pos: dict[str, Any] = {
        "epoch": 0, "lo": 0, "total": 0.0, "correct": 0, "units": 0, "step": 0, "order": None, "history": [],
        "first_loss": None,
    }
    if resume_path is not None and Path(resume_path).exists():
        pos = _load_training_state(Path(resume_path), recipe, model, opt, gen)
    model.train()
    step = pos["step"]  # optimizer steps taken so far, over all epochs
    saves = 0  # steps since this call started, for checkpoint_every
    total, correct, units, history, first_loss = pos["total"], pos["correct"], pos["units"], pos["history"], pos["first_loss"]
    with reporter.task(description, epochs) as bar:
        bar.advance(pos["epoch"])
        if history:
            _show_epoch(bar, history[-1])
        for epoch in range(pos["epoch"], epochs):
            if pos["order"] is not None:
                order, lo, total, correct, units = pos["order"], pos["lo"], pos["total"], pos["correct"], pos["units"]
                pos["order"] = None
            else:
                order, lo, total, correct, units = torch.randperm(n, generator=gen), 0, 0.0, 0, 0
            for rows, x, y in data.batches(order, lo, batch_size, max_tokens):
                step += 1
                saves += 1
                step_lr = lr
                if scheduled:
                    step_lr = lr_at(step, lr=lr, total_steps=total_steps, schedule=schedule, warmup_steps=warmup_steps)
                    for group in opt.param_groups:
                        group["lr"] = step_lr
                opt.zero_grad(set_to_none=True)
                logits = forward(model, x)  # [b, C] or [b, L, V]
                batch = make_batch(x, y)
                loss = task.loss(logits, batch)
                value = loss.item()
                first_loss = value if first_loss is None else first_loss
                check_loss(value, first_loss, name=name, step=step, epoch=epoch + 1, lr=step_lr)
                loss.backward()
                opt.step()
                count = task.loss_count(batch)
                total += value * count
                units += count
                if with_acc:
                    correct += task.correct(logits, batch)
                lo += rows
                shown: dict[str, Any] = {"loss": total / max(units, 1)}
                if with_acc:
                    shown["acc"] = correct / lo
                if scheduled:
                    shown["lr"] = step_lr
                bar.update(**shown)
                end_of_epoch = lo >= n
                if end_of_epoch:
                    entry: dict[str, Any] = {"epoch": epoch + 1, "loss": total / max(units, 1)}
                    if with_acc:
                        entry["accuracy"] = correct / n
                    if validation is not None:
                        val_loss, val_acc = _validate(model, validation, task, batch_size, max_tokens)
                        entry["val_loss"] = val_loss
                        if val_acc is not None:
                            entry["val_accuracy"] = val_acc
                    history.append(entry)
                    _show_epoch(bar, entry)
                    if epoch_end is not None:
                        epoch_end(epoch + 1, model, opt)
                        model.train()
                if resume_path is not None and (end_of_epoch or (checkpoint_every and saves % checkpoint_every == 0)):
                    at = {"epoch": epoch + 1, "lo": 0} if end_of_epoch else {"epoch": epoch, "lo": lo}
                    _save_training_state(
                        Path(resume_path), recipe, model, opt, gen, order, total, correct=correct, units=units,
                        step=step, history=history, first_loss=first_loss, **at,
                    )
            bar.advance()
    if metrics is not None:
        metrics["final_loss"] = total / max(units, 1)
        metrics["optimizer_state_numel"] = optimizer_state_numel(opt)
        metrics["history"] = history
    if optimizer_state is not None:
        optimizer_state["state_dict"] = opt.state_dict()
        optimizer_state["param_names"] = optimizer_param_names(model, opt)
    if resume_path is not None:
        Path(resume_path).unlink(missing_ok=True)
    return model.eval()


def _show_epoch(task: Any, entry: dict[str, Any]) -> None:
    """Put a finished epoch's values on the progress bar (validation ones only when present)."""
    if "val_accuracy" in entry:
        task.update(val_loss=entry["val_loss"], val_acc=entry["val_accuracy"])
    elif "val_loss" in entry:
        task.update(val_loss=entry["val_loss"])


def _validate(
    model: nn.Module, validation: Any, task: Task, batch_size: int, max_tokens: int | None
) -> tuple[float, float | None]:
    """``(loss, accuracy or None)`` of the validation data: tensors ``(inputs, labels)`` or a dataset."""
    if isinstance(validation, tuple):
        if task.has_accuracy and type(task).loss is Task.loss:  # a classifier's cross-entropy
            return evaluate(model, validation[0], validation[1], batch_size=batch_size)
        validation = TensorDataset(validation[0], validation[1], "validation")
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


def check_recipe(cfg: Config, *, purpose: str = "trak optimize") -> OptimizeConfig:
    """Refuse configs whose recipe cannot train: no recipe section.

    Args:
        cfg: a :class:`~trakcli.config.Config`.
        purpose: the command, for messages.

    Returns:
        ``cfg.recipe``, the :class:`~trakcli.config.OptimizeConfig` recipe.

    Raises:
        ConfigError: no ``optimize:`` section.
    """
    oc = cfg.recipe
    if oc is None:
        example = "{n_models: 10, out_dir: ckpts, ...}" if purpose == "trak optimize" else "{epochs: 20, lr: 0.05, ...}"
        raise ConfigError(
            f"optimize: section missing; {purpose} needs the training recipe: add optimize: {example} for the "
            "built-in recipe, or optimize: {entrypoint: train.py:train} to train with your own function "
            "(called as train(model, inputs, labels, seed=...))"
        )
    return oc


def check_init_checkpoint(oc: OptimizeConfig) -> None:
    """Refuse a recipe whose ``init_checkpoint`` names no file, before any model trains.

    Args:
        oc: the recipe (``cfg.recipe``).

    Raises:
        ConfigError: ``init_checkpoint`` is set and is not a file.
    """
    if oc.init_checkpoint is not None and not oc.init_checkpoint.is_file():
        raise ConfigError(
            f"optimize.init_checkpoint: file {str(oc.init_checkpoint)!r} does not exist; give a state dict of "
            "the model (.pt / .safetensors) or remove the key to train from scratch"
        )


def load_training_function(cfg: Config) -> Callable[..., Any] | None:
    """The user's training function of ``optimize.entrypoint`` (None: the built-in recipe).

    Resolved like ``model.entrypoint`` (:func:`trakcli.models.load_function`):
    ``"path/to/file.py:function"`` or ``"package.module:function"``.

    Raises:
        ModelError: the file or module cannot be imported, or has no such function.
    """
    oc = cfg.recipe
    if oc is None or oc.entrypoint is None:
        return None
    from trakcli.models.build import load_function

    return load_function(oc.entrypoint, key="optimize.entrypoint", builtins={})


def train_one(
    cfg: Config,
    inputs: Inputs | TrainRows,
    labels: torch.Tensor | None = None,
    *,
    seed: int,
    device: torch.device | str = "cpu",
    reporter: Reporter = NULL_REPORTER,
    description: str = "train",
    metrics: dict[str, Any] | None = None,
    resume_path: str | Path | None = None,
    validation: Any = None,
    name: str | None = None,
    optimizer_state: dict[str, Any] | None = None,
    epoch_end: Callable[[int, nn.Module, torch.optim.Optimizer], None] | None = None,
) -> nn.Module:
    """Build, seed and train one model with the config's recipe: what `trak optimize` does for model i.

    Steps: ``torch.manual_seed(seed)``; build ``model.entrypoint`` with
    ``model.kwargs`` on ``device``; load ``optimize.init_checkpoint`` if set;
    then train it on ``(inputs, labels)`` (or the rows ``inputs``):

    * with ``optimize.entrypoint``: call the user's
      function ``fn(model, inputs, labels, seed=seed, **optimize.kwargs)`` (lazily
      read rows are given to it padded, as tensors); it trains the model in place
      (returns None) or returns the trained model;
    * else :func:`train_model` with the task's loss (``cfg.task``) and the recipe's
      epochs, batch size, optimizer, lr (and its schedule), momentum, weight decay
      and projection, its minibatch order drawn with ``seed``; batches of lazily
      read text hold at most ``data.batch_tokens`` padded tokens.

    `trak optimize` trains model i with ``seed = optimize.seed + i``, so
    calling this with the same seed and rows reproduces its checkpoint.

    Args:
        cfg: a validated :class:`~trakcli.config.Config` with a recipe (``cfg.recipe``).
        inputs: ``[n, ...]`` float32 inputs on ``device`` (or a dict of ``[n, L]`` tensors for text), or the
            rows (:class:`TensorRows`; :class:`DatasetRows` of lazily read text, batches moved to ``device``).
        labels: ``[n]`` int64 class labels or ``[n, L]`` per-token labels on ``device`` (with tensor ``inputs``).
        seed: seed of the initialization and of the minibatch order.
        device: where the model lives.
        reporter, description: progress of the built-in recipe (one step per epoch, with
            the running loss and accuracy).
        metrics: filled with ``final_loss``, ``optimizer_state_numel`` and the per-epoch
            ``history`` by the built-in recipe (see :func:`train_model`).
        resume_path: the built-in recipe's training-state file (see :func:`train_model`);
            the state is saved every ``optimize.checkpoint_every`` steps and at epoch ends.
        validation: ``(inputs, labels)`` on ``device`` or a dataset, evaluated after every epoch of the
            built-in recipe (``data.validation``); ignored by a ``optimize.entrypoint``.
        name: the model in messages (``"model 3"``); default ``description``.
        optimizer_state: filled by the built-in recipe with the final optimizer ``state_dict``
            and ``param_names`` (see :func:`train_model`).
        epoch_end: called by the built-in recipe after every epoch (see :func:`train_model`).

    Returns:
        The trained model, in eval mode, on ``device``.

    Raises:
        ConfigError: no recipe (see :func:`check_recipe`).
        ModelError: the model or the training function cannot be loaded, or the
            training function returned something that is not an ``nn.Module``.
        UserCodeError: the model's entrypoint or the training function raised (file and line named).
        CheckpointError: ``init_checkpoint`` or the resume file cannot be read.
        DataError: the built-in recipe's first forward pass fails, or a label does not fit the
            model's logits (:func:`check_forward`).
        TrainingError: the training diverged (see :func:`train_model`), or it left
            non-finite weights (named).
    """
    from trakcli.models.build import build_model
    from trakcli.models.checkpoints import load_checkpoint

    oc = check_recipe(cfg)
    fn = load_training_function(cfg)
    torch.manual_seed(seed)
    model = build_model(cfg.model.entrypoint, **cfg.model.kwargs).to(device)
    if oc.init_checkpoint is not None:
        load_checkpoint(model, oc.init_checkpoint)
        model.to(device)
    if oc.lora is not None:
        from trakcli.models.peft import add_lora

        model = add_lora(model, **oc.lora.model_dump())
    name = name or description
    rows = inputs if isinstance(inputs, TrainRows) else TensorRows(inputs, labels)
    if fn is not None:
        if isinstance(inputs, DatasetRows):
            inputs, labels = inputs.padded()
        elif isinstance(inputs, TensorRows):
            inputs, labels = inputs.inputs, inputs.labels
        with user_code(f"optimize.entrypoint {oc.entrypoint}"):
            out = fn(model, inputs, labels, seed=seed, **oc.kwargs)
        if out is None:
            out = model
        if not isinstance(out, nn.Module):
            raise ModelError(
                f"optimize.entrypoint {oc.entrypoint!r} returned a {type(out).__name__}; it must train "
                "the model in place and return None, or return the trained torch.nn.Module"
            )
        model = out.to(device).eval()
    else:
        projection = oc.projection.model_dump() if oc.projection is not None else None
        task = resolve_task(cfg.task)
        check_forward(model, rows, task=task)
        model = train_model(
            model, rows, task=task,
            epochs=oc.epochs, batch_size=oc.batch_size, lr=oc.lr, weight_decay=oc.weight_decay,
            momentum=oc.momentum, optimizer=oc.optimizer, schedule=oc.schedule, warmup_steps=oc.warmup_steps,
            warmup_fraction=oc.warmup_fraction, max_tokens=cfg.data.batch_tokens, seed=seed,
            reporter=reporter, description=description, projection=projection, metrics=metrics,
            resume_path=resume_path, checkpoint_every=oc.checkpoint_every, validation=validation, name=name,
            optimizer_state=optimizer_state, epoch_end=epoch_end,
        )
    if fn is not None:
        check_weights(model, name=name, how=f"optimize.entrypoint {oc.entrypoint}",
                      fix="check its learning rate and inputs")
    else:
        check_weights(model, name=name, how="training", fix=f"lower the learning rate (lr {oc.lr:g})")
    return model


def _save_training_state(
    path: Path, recipe, model, opt, gen, order, total, *, correct: int, units: int, step: int, history: list,
    first_loss: float | None, epoch: int, lo: int,
) -> None:
    """Write the training state atomically (plain tensors and numbers: loads with ``weights_only=True``)."""
    state = {
        "recipe": recipe,
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "generator": gen.get_state(),
        "torch_rng": torch.get_rng_state(),
        "order": order.cpu(),
        "epoch": epoch,
        "lo": lo,
        "total": total,
        "correct": correct,
        "units": units,
        "step": step,
        "history": history,
        "first_loss": first_loss,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(state, path)
    except OSError as e:
        raise TrainingError(
            f"cannot write the training state {path}: {e}; free disk space and rerun the same command, "
            "which resumes from the last state written"
        ) from None


def _load_training_state(path: Path, recipe, model, opt, gen) -> dict[str, Any]:
    from trakcli.errors import CheckpointError

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same problem for the user
        raise CheckpointError(
            f"cannot read the training state {str(path)!r} ({e.__class__.__name__}: {e}); delete it or "
            "rerun with --overwrite to start the model over"
        ) from None
    if state.get("recipe") != recipe:
        saved = state.get("recipe") or {}
        diff = sorted(k for k in set(saved) | set(recipe) if saved.get(k) != recipe.get(k))
        raise CheckpointError(
            f"the training state {str(path)!r} was made with another recipe (differs in: {', '.join(diff)}); "
            "rerun with the same settings to resume, or with --overwrite to start over"
        )
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    gen.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    at_epoch_start = state["lo"] == 0
    per_epoch = -(-recipe["n"] // recipe["batch_size"])
    return {
        "epoch": state["epoch"],
        "lo": state["lo"],
        "total": state["total"],
        "correct": state.get("correct", 0),  # states written before trakcli recorded accuracy
        # states without these counted rows and fixed-size batches
        "units": state.get("units", state["lo"]),
        "step": state.get("step", state["epoch"] * per_epoch + -(-state["lo"] // recipe["batch_size"])),
        "order": None if at_epoch_start else state["order"],
        "history": list(state.get("history", [])),
        "first_loss": state.get("first_loss"),  # states written before the divergence check: the next step's
    }


def optimizer_state_numel(opt: torch.optim.Optimizer) -> int:
    """Floats an optimizer holds as state (tensors other than step counters)."""
    if hasattr(opt, "state_numel"):
        return int(opt.state_numel())
    return sum(
        v.numel() for st in opt.state.values() for k, v in st.items() if isinstance(v, torch.Tensor) and k != "step"
    )
