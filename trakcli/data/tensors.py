"""In-memory datasets (:class:`TensorDataset`, batched by slicing rows) and helpers on model inputs: a tensor
``[n, ...]`` or a dict of tensors ``[n, ...]`` (``{"input_ids": [n, L], "attention_mask": [n, L]}`` int64).
Text and language-model files are read lazily instead, by :class:`trakcli.data.text.TextDataset`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Union

import numpy as np
import torch

from trakcli.errors import DataError

#: A batch of model inputs: a tensor ``[n, ...]`` or a dict of tensors ``[n, ...]`` (text).
Inputs = Union[torch.Tensor, dict[str, torch.Tensor]]


def slice_inputs(inputs: Inputs, lo: int, hi: int) -> Inputs:
    """Rows ``[lo, hi)`` of a tensor or of every tensor of a dict."""
    if isinstance(inputs, dict):
        return {k: v[lo:hi] for k, v in inputs.items()}
    return inputs[lo:hi]


def index_inputs(inputs: Inputs, idx: torch.Tensor) -> Inputs:
    """Rows ``idx`` (a ``[b]`` int64 index tensor) of a tensor or of every tensor of a dict."""
    if isinstance(inputs, dict):
        return {k: v[idx] for k, v in inputs.items()}
    return inputs[idx]


def inputs_to(inputs: Inputs, device: torch.device | str) -> Inputs:
    """Move a tensor or every tensor of a dict to ``device``."""
    if isinstance(inputs, dict):
        return {k: v.to(device) for k, v in inputs.items()}
    return inputs.to(device)


def cut_batches(
    items: Iterable[Any], batch_size: int, max_tokens: int | None, length: Callable[[Any], int] = int,
) -> Iterator[list[Any]]:
    """Consecutive items cut greedily into batches: at most ``batch_size`` items and, with ``max_tokens``, at
    most ``max_tokens`` padded tokens (items x the batch's longest ``length(item)``, at least 1); a single item
    longer than ``max_tokens`` is a batch of its own. ``length`` defaults to the items being token counts."""
    batch: list[Any] = []
    longest = 1
    for item in items:
        n = length(item)
        grown = max(longest, n)
        if batch and (len(batch) >= batch_size or max_tokens is not None and (len(batch) + 1) * grown > max_tokens):
            yield batch
            batch, grown = [], max(1, n)
        batch.append(item)
        longest = grown
    if batch:
        yield batch


def fingerprint_rows(n: int | None, total: int, what: str) -> int:
    """``n`` checked as a count of leading rows to fingerprint (None: all ``total``).

    Raises:
        DataError: ``n`` is not an int in ``(0, total]``.
    """
    if n is None:
        return total
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= total:
        raise DataError(f"{what}: cannot fingerprint the first {n!r} rows of {total}")
    return n


def _token_rows(v: torch.Tensor, lo: int, hi: int, width: int, longest: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of ``v``; an ``[n, width]`` tensor (per token) cut to its first ``longest`` columns."""
    return v[lo:hi, :longest] if v.ndim == 2 and v.shape[1] == width else v[lo:hi]


@dataclass(frozen=True)
class TensorDataset:
    """Inputs and labels of one split.

    Attributes:
        inputs: ``[n, ...]`` float32 tensor on the CPU, or a dict of ``[n, L]``
            int64 tensors (text: ``input_ids``, ``attention_mask``).
        labels: ``[n]`` int64 class indices on the CPU, or for token data (a dict with
            ``input_ids``) ``[n, L]`` int64 per-token labels (-100: not a target); for a task of
            one's own any ``[n, ...]`` tensor (float targets float32, integers int64).
        name: human-readable origin, used in messages.
        image_shape: for image data stored flat, the shape of one image, ``(H, W)`` or ``(C, H, W)`` with ``C`` in 1 or
            3 (digits: ``(8, 8)``); used only to draw pictures (:mod:`trakcli.plots`), never in the fingerprint.
            ``None``: not declared (inputs of shape ``[n, H, W]`` or ``[n, C, H, W]`` are still drawn as images).
    """

    inputs: Inputs
    labels: torch.Tensor
    name: str
    image_shape: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def batches(
        self, start: int, stop: int, batch_size: int, max_tokens: int | None = None
    ) -> Iterator[tuple[int, Inputs, torch.Tensor]]:
        """Yield ``(row_offset, inputs[b], labels[b])`` for rows ``[start, stop)`` in consecutive batches of at most
        ``batch_size`` rows.

        ``max_tokens`` (``data.batch_tokens``) applies to token data only (a dict of inputs with a 2-D
        ``attention_mask [n, L]``): batches are cut by :func:`cut_batches` on each row's length up to its
        last attended position, and every ``[n, L]`` tensor of a batch (per-token labels too) is cut to the
        batch's longest: only columns that are padding in every row are dropped, which changes nothing a
        model computes from right-padded rows. ``None`` keeps the saved width.

        Yields:
            ``(row_offset, inputs, labels)``: the dataset index of the batch's first row, the rows'
            inputs (as :attr:`inputs`, ``[b, ...]``) and labels (``[b]``, or ``[b, L_b]`` per token).
        """
        am = self.inputs.get("attention_mask") if isinstance(self.inputs, dict) else None
        if max_tokens is None or am is None or am.ndim != 2:
            for lo in range(start, stop, batch_size):
                hi = min(lo + batch_size, stop)
                yield lo, slice_inputs(self.inputs, lo, hi), self.labels[lo:hi]
            return
        width = am.shape[1]
        real = am[start:stop] != 0  # [rows, L]
        last = width - real.flip(1).to(torch.int8).argmax(1)  # one past the last attended position
        lengths = torch.where(real.any(1), last, torch.zeros_like(last)).tolist()
        lo = start
        for rows in cut_batches(lengths, batch_size, max_tokens):
            hi, longest = lo + len(rows), max(1, *rows)
            inputs = {k: _token_rows(v, lo, hi, width, longest) for k, v in self.inputs.items()}
            yield lo, inputs, _token_rows(self.labels, lo, hi, width, longest)
            lo = hi

    def fingerprint(self, n: int | None = None) -> dict[str, Any]:
        """``{"n", "input_shape", "input_dtype", "sha256"}``: shape, dtype and a sha256 of the rows in order
        (inputs then labels); for a dict of inputs, shape and dtype by key and the tensors hashed in sorted
        key order. Two datasets with equal fingerprints hold the same rows in the same order. With ``n``
        (``0 < n <= len(self)``), what the first ``n`` rows would give on their own (how an appended store
        proves its old rows unchanged, :mod:`trakcli.store.append`).

        Raises:
            DataError: ``n`` is not a row count of this dataset.
        """
        n = fingerprint_rows(n, len(self), self.name)
        h = hashlib.sha256()
        if isinstance(self.inputs, dict):
            for k in sorted(self.inputs):
                h.update(k.encode())
                h.update(np.ascontiguousarray(self.inputs[k][:n].numpy()).tobytes())
            shape: Any = {k: list(v.shape[1:]) for k, v in sorted(self.inputs.items())}
            dtype: Any = {k: str(v.dtype).removeprefix("torch.") for k, v in sorted(self.inputs.items())}
        else:
            h.update(np.ascontiguousarray(self.inputs[:n].numpy()).tobytes())
            shape = list(self.inputs.shape[1:])
            dtype = str(self.inputs.dtype).removeprefix("torch.")
        h.update(np.ascontiguousarray(self.labels[:n].numpy()).tobytes())
        return {"n": n, "input_shape": shape, "input_dtype": dtype, "sha256": h.hexdigest()}
