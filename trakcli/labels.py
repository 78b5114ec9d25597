"""Labels as tasks read them (:meth:`~trakcli.tasks.Task.check_labels`): numbers of any shape ``[n, ...]``
(:func:`any_labels`), or the class indices of the built-in tasks (:func:`class_labels`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from trakcli.errors import DataError

#: Label of a token that is not a target (PyTorch's ``cross_entropy`` ``ignore_index``, as in transformers).
IGNORE_INDEX = -100


def as_tensor(value: Any, what: str, expected: str) -> torch.Tensor:
    """A tensor, array or (nested) list of numbers as a tensor (:class:`DataError` naming ``what`` and an example
    value: not numbers)."""
    if torch.is_tensor(value):
        return value
    try:
        arr = np.asarray(value)
    except ValueError as e:  # ragged nested lists
        reason = str(e).split(". ")[0]
        raise DataError(f"{what} must be an array of {expected}; it cannot be made one ({reason})") from None
    if arr.dtype.kind not in "biuf":  # bool, int, uint, float: what torch takes
        example = arr.reshape(-1)[0] if arr.size else None
        example = example.item() if isinstance(example, np.generic) else example
        kinds = {"U": "strings", "S": "bytes", "O": "Python objects", "c": "complex numbers"}
        kind = kinds.get(arr.dtype.kind, str(arr.dtype))
        fix = (
            "; map each class name to an index 0, 1, ... before saving (e.g. sorted(set(names)).index(name))"
            if expected.startswith("integer") and arr.dtype.kind in "USO" else ""
        )
        raise DataError(f"{what} must be {expected}, got {kind} (e.g. {example!r}){fix}")
    return torch.as_tensor(arr)


def class_labels(value: Any, what: str, source: str, key: str, n: int,
                 token_shape: list[int] | None = None) -> torch.Tensor:
    """Checked int64 class labels of the built-in tasks (else :class:`DataError`): ``[n]`` class indices >= 0
    (``[n, 1]`` taken as ``[n]``), or with ``token_shape`` (``[n, L]`` of ``input_ids``) per-token labels, token
    ids >= 0 or -100. ``what`` and ``source`` name the labels in messages (``"labels 'y'"``, ``" of data.pt"``).
    """
    y = as_tensor(value, f"{key}: {what}{source}", "integer class indices")
    per_token = token_shape is not None and y.ndim == 2 and (y.shape[1] != 1 or token_shape[1] == 1)
    if per_token and list(y.shape) != token_shape:
        raise DataError(f"{key}: per-token {what} must have the shape of input_ids {token_shape}, got {list(y.shape)}")
    if not per_token and y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if not per_token and (y.ndim != 1 or y.shape[0] != n):
        also = f", or [n, L] per-token labels shaped like input_ids {token_shape}" if token_shape is not None else ""
        raise DataError(f"{key}: {what} must be 1-D class indices with one per row ({n}){also}, got shape "
                        f"{list(y.shape)}")
    if y.dtype == torch.bool or y.is_complex() or (y.is_floating_point() and not torch.equal(y, y.round())):
        kind = "integer per-token labels" if per_token else "integer class indices"
        got = "non-integer floats" if y.is_floating_point() else f"{y.dtype} values"
        raise DataError(f"{key}: {what} must be {kind}, got {got} (e.g. {_first_bad(y)})")
    bad_mask = (y < 0) & (y != IGNORE_INDEX) if per_token else y < 0
    if bad_mask.any():
        bad = torch.nonzero(bad_mask)[:5].tolist() if per_token else torch.nonzero(bad_mask).flatten()[:5].tolist()
        if per_token:
            raise DataError(f"{key}: per-token {what} must be token ids >= 0 or {IGNORE_INDEX} (not a target); "
                            f"positions [row, token] {bad} hold other negative values")
        raise DataError(f"{key}: labels must be >= 0; rows {bad} have negative labels")
    return y.to(torch.int64).contiguous()


def any_labels(value: Any, what: str, source: str, key: str, n: int,
               token_shape: list[int] | None = None) -> torch.Tensor:
    """Labels of any shape ``[n, ...]`` of a task that does not check them: floats as float32, integers as int64,
    bools as they are (:class:`DataError`: not real numbers, or not ``n`` rows)."""
    del token_shape  # any shape is taken
    y = as_tensor(value, f"{key}: {what}{source}", "numbers")
    if y.is_complex():
        raise DataError(f"{key}: {what}{source} must be real numbers, got {y.dtype} values")
    if y.ndim == 0 or y.shape[0] != n:
        raise DataError(f"{key}: {what} must have one row per example, [n, ...] with n = {n}, got shape "
                        f"{list(y.shape)}")
    if y.is_floating_point():
        y = y.to(torch.float32)
    elif y.dtype != torch.bool:
        y = y.to(torch.int64)
    return y.contiguous()


def _first_bad(y: torch.Tensor) -> Any:
    """The first label that is not an integer (for messages)."""
    if y.is_floating_point():
        flat = y.reshape(-1)
        bad = torch.nonzero(flat != flat.round())
        return flat[bad[0, 0]].item() if bad.numel() else flat[0].item()
    return y.reshape(-1)[0].item() if y.numel() else None
