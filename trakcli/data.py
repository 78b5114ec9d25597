"""Datasets: the bundled digits data, user tensor files and text files.

A dataset here is held in memory: ``inputs`` and ``labels [n]`` (int64 class
indices). ``inputs`` is a tensor ``[n, ...]`` (float32), or for text a dict of
tensors ``{"input_ids": [n, L], "attention_mask": [n, L]}`` (int64, tokenized by
:mod:`trakcli.hf`). Batching is slicing rows (of every tensor of the dict).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Union

import numpy as np
import torch

from trakcli.config import DatasetConfig
from trakcli.errors import DataError

DIGITS_TEST_FRACTION = 0.2
DIGITS_SEED = 0
DIGITS_IMAGE_SHAPE = (8, 8)  # each flat row of 64 pixels is an 8x8 image

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


def load_digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes), split once.

    The split is fixed: ``sklearn.model_selection.train_test_split`` with
    ``test_size=0.2``, ``random_state=0`` and stratified by label, giving
    1437 train and 360 target rows. Pixels (0..16) are scaled to [0, 1].

    Returns:
        ``(x_train [1437, 64] float32, y_train [1437] int64,
        x_target [360, 64] float32, y_target [360] int64)``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_ta, y_tr, y_ta = train_test_split(
        x, y, test_size=DIGITS_TEST_FRACTION, random_state=DIGITS_SEED, stratify=y
    )
    as_x = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float32) / 16.0)  # noqa: E731
    as_y = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64))  # noqa: E731
    return as_x(x_tr), as_y(y_tr), as_x(x_ta), as_y(y_ta)


def _read_file(path: Path) -> dict[str, Any]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as f:
                return {k: f[k] for k in f.files}
        if suffix in (".pt", ".pth"):
            obj = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(obj, dict):
                raise DataError(
                    f"{path} holds a {type(obj).__name__}, not a dict of tensors; "
                    "save it as torch.save({'x_train': x, 'y_train': y, ...}, path)"
                )
            return obj
    except DataError:
        raise
    except Exception as e:  # unreadable or corrupt file
        raise DataError(f"cannot read data file {path}: {e}") from None
    raise DataError(f"data file {path} has suffix {suffix!r}; use a .pt dict of tensors or an .npz file")


def load_dataset(cfg: DatasetConfig, *, key: str = "data.train") -> TensorDataset:
    """Load one dataset described by the config.

    Args:
        cfg: the dataset section (``builtin``+``split`` or ``path``+``inputs``+``labels``).
        key: the dotted config key, used in error messages.

    Returns:
        A :class:`TensorDataset` with float32 inputs (text: a dict of int64
        ``input_ids`` / ``attention_mask``, see :func:`trakcli.hf.load_text`) and
        int64 labels.

    Raises:
        DataError: unreadable file, missing key, empty data, mismatched lengths
            or non-integer labels.
    """
    if cfg.builtin == "digits":
        x_tr, y_tr, x_ta, y_ta = load_digits_split()
        if cfg.split == "train":
            return TensorDataset(x_tr, y_tr, "digits/train", image_shape=DIGITS_IMAGE_SHAPE)
        return TensorDataset(x_ta, y_ta, "digits/target", image_shape=DIGITS_IMAGE_SHAPE)
    if cfg.text is not None:
        from trakcli.hf import load_text

        if cfg.path is None or cfg.tokenizer is None:  # the config model fills both or refuses
            raise DataError(f"{key}: a text dataset needs `path` and `tokenizer`")
        inputs, labels, name = load_text(cfg.path, cfg.text, cfg.labels, cfg.tokenizer, cfg.max_length, key=key)
        shape = {k: [cfg.max_length] for k in sorted(inputs)}
        return TensorDataset(inputs, labels, name, input_shape=shape)
    assert cfg.path is not None and cfg.inputs is not None and cfg.labels is not None  # config validated
    contents = _read_file(cfg.path)
    missing = [k for k in (cfg.inputs, cfg.labels) if k not in contents]
    if missing:
        raise DataError(
            f"{key}: {cfg.path} has no key {', '.join(repr(m) for m in missing)}; "
            f"its keys are {sorted(contents)}"
        )
    x = torch.as_tensor(np.asarray(contents[cfg.inputs]) if not torch.is_tensor(contents[cfg.inputs]) else contents[cfg.inputs])
    y = torch.as_tensor(np.asarray(contents[cfg.labels]) if not torch.is_tensor(contents[cfg.labels]) else contents[cfg.labels])
    name = f"{cfg.path}[{cfg.inputs}]"
    if x.ndim == 0 or x.shape[0] == 0:
        raise DataError(f"{key}: {name} is empty (shape {list(x.shape)}); it needs at least one row")
    if y.ndim != 1:
        raise DataError(f"{key}: labels {cfg.labels!r} must be 1-D class indices, got shape {list(y.shape)}")
    if y.shape[0] != x.shape[0]:
        raise DataError(
            f"{key}: {x.shape[0]} inputs but {y.shape[0]} labels; {cfg.inputs!r} and {cfg.labels!r} "
            "must have the same number of rows"
        )
    if y.is_floating_point():
        if not torch.equal(y, y.round()):
            raise DataError(f"{key}: labels {cfg.labels!r} must be integer class indices, got non-integer floats")
    if y.dtype == torch.bool or y.is_complex():
        raise DataError(f"{key}: labels {cfg.labels!r} must be integer class indices, got {y.dtype}")
    if (y < 0).any():
        bad = torch.nonzero(y < 0).flatten()[:5].tolist()
        raise DataError(f"{key}: labels must be >= 0; rows {bad} have negative labels")
    x = x.to(torch.float32).contiguous()
    return TensorDataset(x, y.to(torch.int64).contiguous(), name)
