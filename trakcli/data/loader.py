"""Batches given to the Python API (:class:`trakcli.Attributor`): checked, concatenated, or read as
:class:`LoaderRows` from a re-iterable (a ``DataLoader``, a list of batches) one store chunk at a time.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import torch

from trakcli.data.load import checked_dataset
from trakcli.data.tensors import Inputs, TensorDataset, fingerprint_rows, slice_inputs
from trakcli.errors import DataError


def split_batch(batch: Any, index: int) -> tuple[Inputs, torch.Tensor]:
    """``(inputs, labels)`` of the ``index``-th batch: a pair ``(inputs, labels)`` (a tuple or list), or a dict
    ``{"inputs": x, "labels": y}``, or ``{"labels": y, **kwargs}`` whose other keys are the model's keyword inputs.

    Raises:
        DataError: any other form.
    """
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise DataError(f"batch {index} is a dict without 'labels' (keys {sorted(batch)}); add the labels")
        x = batch["inputs"] if "inputs" in batch else {k: v for k, v in batch.items() if k != "labels"}
        return x, batch["labels"]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise DataError(f"batch {index} is a "
                    f"{type(batch).__name__}{f' of {len(batch)}' if isinstance(batch, (tuple, list)) else ''}; give "
                    "(inputs, labels) pairs or dicts with 'labels'")


def tensor_batches(batches: Iterable[Any], name: str) -> Iterator[tuple[Inputs, torch.Tensor]]:
    """``(inputs, labels)`` of each batch on the CPU, labels ``[n, ...]`` (a scalar as ``[1]``).

    Raises:
        DataError: no batches, a batch that is not tensors, inputs and labels of different lengths.
    """
    seen = False
    for i, b in enumerate(batches):
        x, y = split_batch(b, i)
        tensors = list(x.values()) if isinstance(x, dict) else [x]
        if not all(isinstance(t, torch.Tensor) for t in [*tensors, y]):
            raise DataError(f"{name}: batch {i} holds {type(x).__name__} inputs / {type(y).__name__} labels; give tensors")
        y = y.detach().cpu()
        y = y.reshape(1) if y.ndim == 0 else y  # [n, ...]: the task reads (and checks) them as they are
        rows = (tensors[0].shape[0] if tensors[0].ndim else 0)
        if y.shape[0] != rows:
            raise DataError(f"{name}: batch {i} has {rows} inputs but {y.shape[0]} labels; give one label per example "
                            "(or per-token labels of the shape of input_ids)")
        seen = True
        yield x, y
    if not seen:
        raise DataError(f"{name}: the iterable yielded no batch")


def concat_batches(parts: list[tuple[Inputs, torch.Tensor]], name: str, task: Any = None) -> TensorDataset:
    """One checked CPU dataset of ``(inputs, labels)`` batches (float inputs as float32, labels as the task reads
    them: :func:`trakcli.data.load.checked_dataset`).

    Raises:
        DataError: batches that do not concatenate (e.g. text padded to another length per batch: pad to one
            ``max_length``), or labels the task refuses.
    """

    def cat(pieces: list[torch.Tensor], what: str) -> torch.Tensor:
        try:
            t = torch.cat([p.detach().cpu() for p in pieces])
        except RuntimeError as e:
            raise DataError(f"{name}: the {what} of the batches do not stack ({str(e).splitlines()[0]}); give every "
                            "batch the same per-example shape (text: pad to one max_length, "
                            "padding='max_length')") from None
        return t.to(torch.float32) if t.is_floating_point() else t.contiguous()

    xs = [x for x, _ in parts]
    if isinstance(xs[0], dict):
        inputs: Inputs = {k: cat([x[k] for x in xs], f"inputs {k!r}") for k in xs[0]}  # type: ignore[index]
    else:
        inputs = cat(xs, "inputs")  # type: ignore[arg-type]
    return checked_dataset(inputs, cat([y for _, y in parts], "labels"), key=name, name=name, task=task)


def is_reiterable(batches: Any) -> bool:
    """Whether iterating ``batches`` again yields the same batches from the start (a DataLoader, a list, a tuple),
    rather than going on where it stopped (a generator, an iterator)."""
    return iter(batches) is not batches if hasattr(batches, "__iter__") else False


def in_fixed_order(batches: Any) -> bool:
    """Whether ``batches`` is not a DataLoader that draws its rows in another order on every pass (shuffling)."""
    sampler = getattr(batches, "sampler", None)
    return sampler is None or type(sampler).__name__ in ("SequentialSampler", "_InfiniteConstantSampler")


class LoaderRows:
    """The rows of a re-iterable of batches, read as a job asks for them (the interface of the datasets
    `trak featurize` reads).

    Args:
        batches: a re-iterable of batches (:func:`split_batch`): every iteration yields the same rows in the same
            order (a ``DataLoader`` without shuffling, a list of batches).
        name: what the batches are, for messages (``"train batches"``).
        task: the task reading the labels (None: ``classification``).

    Memory: one store chunk of rows at a time (:meth:`batches`), never the whole. The fingerprint is the
    :class:`~trakcli.data.tensors.TensorDataset` one of the same rows (the same store identity whether the rows
    came concatenated or streamed); it reads the batches once per input key and once for the labels. A pass
    that asks for rows before the last one read starts the iteration again.

    Attributes:
        first_rows: rows of the first batch (the default featurizer batch size).
        labels: None (the labels are read with the rows, not kept).

    Raises:
        DataError: (at construction) a shuffling DataLoader; no batches; batches that are not tensors or whose
            inputs and labels disagree in length.
    """

    labels = None

    def __init__(self, batches: Iterable[Any], name: str, task: Any = None):
        if not in_fixed_order(batches):
            raise DataError(f"{name}: the DataLoader draws its rows with a {type(batches.sampler).__name__}, another "
                            "order on every pass; give the rows in one fixed order (shuffle=False)")
        self.source, self.name, self.task = batches, name, task
        sizes, first = [], None
        for x, y in tensor_batches(batches, name):
            if first is None:
                first = concat_batches([(x, y)], name, task)  # checks the first batch as the whole will be
            sizes.append(int(y.shape[0]))
        self.first_rows = sizes[0]
        self._n = sum(sizes)
        self._first = first
        self._fingerprints: dict[int, dict[str, Any]] = {}
        # the pass a window goes on with: its pieces, the row it is at, and the rest of a piece cut by the last window
        self._cursor: tuple[Iterator[tuple[Inputs, torch.Tensor]], int, tuple[Inputs, torch.Tensor] | None] | None = None

    def __len__(self) -> int:
        return self._n

    def fingerprint(self, n: int | None = None) -> dict[str, Any]:
        """The :meth:`TensorDataset.fingerprint <trakcli.data.tensors.TensorDataset.fingerprint>` of the first ``n``
        rows (None: all), computed once per ``n``.

        Raises:
            DataError: ``n`` is not a row count of these rows; the batches changed between passes.
        """
        n = fingerprint_rows(n, self._n, self.name)
        if n not in self._fingerprints:
            self._fingerprints[n] = self._hash(n)
        return self._fingerprints[n]

    def _hash(self, n: int) -> dict[str, Any]:
        first = self._first.fingerprint()
        keyed = isinstance(self._first.inputs, dict)
        h = hashlib.sha256()
        for key in (sorted(self._first.inputs) if keyed else [None]):
            if key is not None:
                h.update(key.encode())
            for x, _ in self._rows(0, n):
                part = x[key] if key is not None else x
                h.update(np.ascontiguousarray(part.numpy()).tobytes())
        for _, y in self._rows(0, n):
            h.update(np.ascontiguousarray(y.numpy()).tobytes())
        return {**first, "n": n, "sha256": h.hexdigest()}

    def _rows(self, start: int, stop: int) -> Iterator[tuple[Inputs, torch.Tensor]]:
        """Rows ``[start, stop)`` as checked ``(inputs, labels)`` pieces (float inputs float32, labels as the task
        reads them), in order, from a fresh pass over the batches."""
        at = 0
        for x, y in tensor_batches(self.source, self.name):
            rows = int(y.shape[0])
            lo, hi = max(start - at, 0), min(stop - at, rows)
            if lo < hi:
                piece = concat_batches([(slice_inputs(x, lo, hi), y[lo:hi])], self.name, self.task)
                yield piece.inputs, piece.labels
            at += rows
            if at >= stop:
                return
        if at < stop:
            raise DataError(f"{self.name}: the batches held {self._n} rows on the first pass and {at} now; give the "
                            "same rows on every pass")

    def window(self, start: int, stop: int) -> TensorDataset:
        """Rows ``[start, stop)`` as one :class:`~trakcli.data.tensors.TensorDataset` (read in one pass, or
        continuing the last pass when it ended at ``start``).

        Raises:
            DataError: rows outside ``[0, len)``; the batches changed between passes.
        """
        if not 0 <= start < stop <= self._n:
            raise DataError(f"{self.name}: rows [{start}, {stop}) are not within the {self._n} rows")
        if self._cursor is None or self._cursor[1] != start:
            self._cursor = (self._rows(start, self._n), start, None)
        it, at, rest = self._cursor
        parts = []
        while at < stop:
            x, y = rest or next(it, (None, None))
            rest = None
            if y is None:
                raise DataError(f"{self.name}: the batches ended at row {at}, before row {stop}; give the same "
                                "rows on every pass")
            rows = int(y.shape[0])
            cut = min(rows, stop - at)
            parts.append((slice_inputs(x, 0, cut), y[:cut]))
            if cut < rows:  # the rest of this piece starts the next window
                rest = (slice_inputs(x, cut, rows), y[cut:rows])
            at += cut
        self._cursor = (it, at, rest)
        return concat_batches(parts, self.name, self.task)

    def batches(self, start: int, stop: int, batch_size: int, max_tokens: int | None = None
                ) -> Iterator[tuple[int, Inputs, torch.Tensor]]:
        """As :meth:`TensorDataset.batches <trakcli.data.tensors.TensorDataset.batches>` on rows ``[start, stop)``
        (the same batches, cut from the window of those rows)."""
        if start >= stop:
            return
        for lo, x, y in self.window(start, stop).batches(0, stop - start, batch_size, max_tokens):
            yield start + lo, x, y

    def batches_of(self, indices: list[int], batch_rows: int, max_tokens: int | None = None
                   ) -> Iterator[tuple[int, Inputs, torch.Tensor]]:
        """The rows ``indices`` (any order) as batches of at most ``batch_rows`` rows, read in one pass.

        Yields:
            ``(position, inputs, labels)``: the position in ``indices`` of the batch's first row.
        """
        want = np.asarray(indices, dtype=np.int64)
        got: dict[int, tuple[Inputs, torch.Tensor]] = {}
        lo = 0
        wanted = sorted(set(want.tolist()))
        for x, y in self._rows(0, wanted[-1] + 1 if wanted else 0):
            rows = int(y.shape[0])
            for r in wanted[np.searchsorted(wanted, lo):np.searchsorted(wanted, lo + rows)]:
                got[r] = (slice_inputs(x, r - lo, r - lo + 1), y[r - lo:r - lo + 1])
            lo += rows
        picked = concat_batches([got[int(r)] for r in want], self.name, self.task)
        yield from picked.batches(0, len(want), batch_rows, max_tokens)

