"""In-memory datasets: ``inputs`` and ``labels [n]`` (int64 class indices), and batching by row slices.

``inputs`` is a tensor ``[n, ...]`` (float32), or for text a dict of tensors
``{"input_ids": [n, L], "attention_mask": [n, L]}`` (int64, tokenized by
:mod:`trakcli.data.text`). Batching is slicing rows (of every tensor of the dict).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterator, Union

import numpy as np
import torch

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


@dataclass(frozen=True)
class TensorDataset:
    """Inputs and labels of one split.

    Attributes:
        inputs: ``[n, ...]`` float32 tensor on the CPU, or a dict of ``[n, L]``
            int64 tensors (text: ``input_ids``, ``attention_mask``).
        labels: ``[n]`` int64 class indices on the CPU.
        name: human-readable origin, used in messages.
        input_shape: the per-example shape the fingerprint reports; ``None``:
            ``inputs.shape[1:]`` (text: ``[max_length]`` per key, since the
            tensors are padded to the longest text of each file).
        image_shape: for image data stored flat, the shape of one image,
            ``(H, W)`` or ``(C, H, W)`` with ``C`` in 1 or 3 (digits: ``(8, 8)``);
            used only to draw pictures (:mod:`trakcli.plots`), never in the
            fingerprint. ``None``: not declared (inputs of shape ``[n, H, W]``
            or ``[n, C, H, W]`` are still drawn as images).
    """

    inputs: Inputs
    labels: torch.Tensor
    name: str
    input_shape: Any = None
    image_shape: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def batches(self, start: int, stop: int, batch_size: int) -> Iterator[tuple[int, Inputs, torch.Tensor]]:
        """Yield ``(row_offset, inputs[b], labels[b])`` for rows ``[start, stop)`` in batches."""
        for lo in range(start, stop, batch_size):
            hi = min(lo + batch_size, stop)
            yield lo, slice_inputs(self.inputs, lo, hi), self.labels[lo:hi]

    def fingerprint(self) -> dict[str, Any]:
        """Shape, dtype and a sha256 of the rows in order (inputs then labels).

        Two datasets with equal fingerprints hold the same rows in the same order.
        For a dict of inputs, shape and dtype are dicts by key and the hash
        covers the tensors in sorted key order.
        """
        h = hashlib.sha256()
        if isinstance(self.inputs, dict):
            for k in sorted(self.inputs):
                h.update(k.encode())
                h.update(np.ascontiguousarray(self.inputs[k].numpy()).tobytes())
            shape: Any = {k: list(v.shape[1:]) for k, v in sorted(self.inputs.items())}
            dtype: Any = {k: str(v.dtype).removeprefix("torch.") for k, v in sorted(self.inputs.items())}
        else:
            h.update(np.ascontiguousarray(self.inputs.numpy()).tobytes())
            shape = list(self.inputs.shape[1:])
            dtype = str(self.inputs.dtype).removeprefix("torch.")
        h.update(np.ascontiguousarray(self.labels.numpy()).tobytes())
        return {
            "n": len(self),
            "input_shape": self.input_shape if self.input_shape is not None else shape,
            "input_dtype": dtype,
            "sha256": h.hexdigest(),
        }
