"""The rows the built-in recipe trains on: tensors batched by index (:class:`TensorRows`), or text read and
tokenized batch by batch (:class:`DatasetRows`); :func:`count_steps` for the learning-rate schedule."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

from trakcli.data.tensors import Inputs, cut_batches, index_inputs, inputs_to, slice_inputs
from trakcli.tasks import IGNORE_INDEX


class TrainRows:
    """The rows the built-in recipe trains on (``n`` of them), batched in a given order."""

    n: int

    def batches(
        self, order: torch.Tensor, start: int, batch_size: int, max_tokens: int | None = None
    ) -> Iterator[tuple[int, Inputs, torch.Tensor]]:
        """``(rows, inputs, labels)`` of each batch of the rows ``order[start:]`` (``order``: a permutation of
        ``range(n)``): its number of rows, its inputs and labels on the training device."""
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
    """Rows held as tensors on the training device (``inputs`` ``[n, ...]`` or a dict of ``[n, L]`` tensors,
    ``labels`` ``[n]`` or ``[n, L]``): minibatches are ``batch_size`` rows of ``order``."""

    def __init__(self, inputs: Inputs, labels: torch.Tensor):
        self.inputs, self.labels = inputs, labels
        self.n = int(labels.shape[0])

    def batches(self, order, start, batch_size, max_tokens=None):
        for lo in range(start, self.n, batch_size):
            idx = order[lo : lo + batch_size]
            yield len(idx), index_inputs(self.inputs, idx), self.labels[idx]

    def first(self):
        return slice_inputs(self.inputs, 0, 1), self.labels[:1]

    def checked(self):
        return self.inputs, self.labels


class DatasetRows(TrainRows):
    """Rows of a lazily read text dataset (``batches_of``, ``token_lengths``), tokenized as their batches are needed.

    Every batch is padded to its own longest row and holds at most ``batch_size`` rows and ``max_tokens``
    padded tokens, as featurize batches. ``rows``: the dataset rows trained on (None: all); ``masked``:
    tokens left out of the loss, ``{dataset row: [positions]}``.
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


def count_steps(data: TrainRows, *, epochs: int, batch_size: int, max_tokens: int | None, seed: int) -> int:
    """Optimizer steps of a whole training: the epochs' batches in the orders the seeded generator draws."""
    gen = torch.Generator().manual_seed(seed)
    total = 0
    for _ in range(epochs):
        order = torch.randperm(data.n, generator=gen)
        total += data.steps_per_epoch(batch_size, max_tokens, order)
    return total
