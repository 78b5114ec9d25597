"""Row-chunked arrays with ``done`` flags, and the checksummed read.

A chunk's data is written before its ``done`` flag; a resumed run recomputes
only chunks not done. Every chunk carries a CRC32C checksum
(:func:`codecs`), so a corrupt or truncated chunk is reported by
:func:`read_checked` with its array and chunk index instead of being read as
wrong numbers. Arrays are written from numpy, never from torch tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from trakcli.errors import StoreError


class StoreCorruptError(StoreError):
    """A chunk failed its checksum or could not be decoded."""


def codecs(compressor: str) -> list[Any]:
    """The zarr codecs of a data array: ``compressor`` (one of :data:`COMPRESSORS`), then a CRC32C checksum."""
    base = {"zstd": [ZstdCodec(level=3)], "blosc": [BloscCodec(cname="zstd", clevel=3)], "none": []}[compressor]
    return [*base, Crc32cCodec()]


@dataclass
class ChunkedRows:
    """Arrays chunked along their first axis, with a ``done`` flag per chunk.

    Attributes:
        data: arrays written together per chunk (name -> zarr array; chunk axis first).
        done: ``[n_chunks]`` uint8 flags.
        chunk_rows: entries per chunk along the chunk axis.
        n_rows: length of the chunk axis.
        axis: which axis of the arrays the chunks split (0 = rows; scores use 1).
    """

    data: dict[str, Any]
    done: Any
    chunk_rows: int
    n_rows: int
    axis: int = 0

    @property
    def n_chunks(self) -> int:
        return -(-self.n_rows // self.chunk_rows)

    def rows(self, chunk: int) -> tuple[int, int]:
        """Range ``[lo, hi)`` of a chunk along the chunk axis."""
        lo = chunk * self.chunk_rows
        return lo, min(lo + self.chunk_rows, self.n_rows)

    def flags(self) -> np.ndarray:
        """``[n_chunks]`` uint8 done flags."""
        return read_checked(self.done, slice(None), 0)

    def pending(self, rank: int = 0, world_size: int = 1) -> list[int]:
        """Chunks not yet done; with ranks, those of chunk index ≡ rank (mod world_size)."""
        return [int(i) for i in np.flatnonzero(self.flags() == 0) if i % world_size == rank]

    def is_complete(self) -> bool:
        return bool((self.flags() != 0).all())

    def write(self, chunk: int, **arrays: np.ndarray) -> None:
        """Write a chunk of every array, then mark it done.

        Raises:
            StoreError: the write failed (disk full, permissions); chunks
                already done stay done and the run can be resumed.
        """
        lo, hi = self.rows(chunk)
        try:
            for name, arr in arrays.items():
                target = self.data[name]
                sel = (slice(None),) * self.axis + (slice(lo, hi),)
                target[sel] = np.ascontiguousarray(arr, dtype=target.dtype)
            self.done[chunk] = 1
        except OSError as e:
            raise StoreError(
                f"writing chunk {chunk} ({lo}:{hi}) of {next(iter(self.data.values())).path} failed: {e}; "
                "chunks written before are kept: free disk space or fix permissions, then rerun the same "
                "command to resume"
            ) from None

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Entries ``[lo, hi)`` along the chunk axis of array ``name`` (checksums verified)."""
        sel = (slice(None),) * self.axis + (slice(lo, hi),)
        return read_checked(self.data[name], sel, self.axis, self.chunk_rows)

    def iter_chunks(self, name: str) -> Iterator[tuple[int, int, np.ndarray]]:
        """Yield ``(lo, hi, block)`` of array ``name`` chunk by chunk."""
        for c in range(self.n_chunks):
            lo, hi = self.rows(c)
            yield lo, hi, self.read(name, lo, hi)

    def verify(self, names: list[str] | None = None) -> list[int]:
        """Reset the done flag of every done chunk that fails its checksum; returns those chunks."""
        bad = []
        flags = self.flags()
        for c in np.flatnonzero(flags):
            lo, hi = self.rows(int(c))
            for name in names or list(self.data):
                try:
                    self.read(name, lo, hi)
                except StoreCorruptError:
                    bad.append(int(c))
                    self.done[int(c)] = 0
                    break
        return bad


def read_checked(arr: Any, sel: Any, axis: int, chunk: int | None = None) -> np.ndarray:
    """``arr[sel]`` as numpy, every chunk's checksum verified.

    Args:
        arr: a zarr array.
        sel: the selection (a slice, or a tuple of slices).
        axis: the axis along which ``chunk`` counts (for the message).
        chunk: chunk length along ``axis``; given, the message names the first bad chunk.

    Raises:
        StoreCorruptError: a chunk fails its checksum or cannot be decoded (names
            the array, the chunk, and ``trak featurize CONFIG --verify``).
    """
    try:
        return np.asarray(arr[sel])
    except (ValueError, RuntimeError, OSError) as e:
        # find the first bad chunk of the selection, for the message
        where = ""
        if chunk is not None and isinstance(sel, tuple):
            s = sel[axis]
            start = s.start or 0
            stop = s.stop if s.stop is not None else arr.shape[axis]
            for lo in range((start // chunk) * chunk, stop, chunk):
                sub = (slice(None),) * axis + (slice(lo, min(lo + chunk, arr.shape[axis])),)
                try:
                    np.asarray(arr[sub])
                except (ValueError, RuntimeError, OSError):
                    where = f" chunk {lo // chunk} (entries {lo}:{min(lo + chunk, arr.shape[axis])} along axis {axis})"
                    break
        raise StoreCorruptError(
            f"store array {arr.path}{where} is corrupt or truncated ({e}); "
            "rerun `trak featurize CONFIG --verify` to recompute corrupt chunks"
        ) from None


@dataclass
class EvalRows:
    """The ``eval/`` group: one row per retrained model, with a ``done`` flag per row.

    Each row is its own chunk, so writing model k's row never touches another
    model's data, and a row torn by a kill has no ``done`` flag.

    Attributes:
        masks: zarr array ``[n_subsets, n_train]`` bool.
        outputs: zarr array ``[n_subsets, n_target]`` float64.
        done: zarr array ``[n_subsets]`` uint8.
    """

    masks: Any
    outputs: Any
    done: Any

    @property
    def n_subsets(self) -> int:
        return int(self.done.shape[0])

    def flags(self) -> np.ndarray:
        """``[n_subsets]`` uint8 done flags."""
        return read_checked(self.done, slice(None), 0)

    def pending(self, n: int | None = None) -> list[int]:
        """Rows ``k < n`` not yet done, in order."""
        flags = self.flags()[: self.n_subsets if n is None else n]
        return [int(k) for k in np.flatnonzero(flags == 0)]

    def write(self, k: int, mask: np.ndarray, outputs: np.ndarray) -> None:
        """Write row ``k`` of masks and outputs, then its done flag.

        Raises:
            StoreError: the write failed; rows written before stay done.
        """
        try:
            self.masks[k] = np.ascontiguousarray(mask, dtype=bool)
            self.outputs[k] = np.ascontiguousarray(outputs, dtype=np.float64)
            self.done[k] = 1
        except OSError as e:
            raise StoreError(
                f"writing row {k} of {self.masks.path} failed: {e}; rows written before are kept: free disk "
                "space or fix permissions, then rerun the same command to resume"
            ) from None

    def verify(self) -> list[int]:
        """Reset the done flag of every done row failing its checksum; returns those rows."""
        bad = []
        for k in np.flatnonzero(self.flags()):
            try:
                read_checked(self.masks, slice(int(k), int(k) + 1), 0)
                read_checked(self.outputs, slice(int(k), int(k) + 1), 0)
            except StoreCorruptError:
                self.done[int(k)] = 0
                bad.append(int(k))
        return bad

    def read(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``n`` rows: ``(masks [n, n_train] bool, outputs [n, n_target] float64)``.

        Raises:
            StoreError: a row among them is not done (names the rows).
            StoreCorruptError: a chunk fails its checksum.
        """
        missing = self.pending(n) + list(range(self.n_subsets, n))
        if missing:
            raise StoreError(
                f"{self.masks.path}: rows {missing[:10]} of {n} are not retrained yet; run `trak eval lds CONFIG` "
                "to finish them"
            )
        return (
            read_checked(self.masks, slice(0, n), 0, 1).astype(bool, copy=False),
            read_checked(self.outputs, slice(0, n), 0, 1).astype(np.float64, copy=False),
        )

