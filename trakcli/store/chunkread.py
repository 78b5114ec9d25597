"""Runs of whole chunks of a local zarr array, read straight from their files.

A scan over every row of a large store (the one-pass two-stage top-k, :mod:`trakcli.topk`) reads tens of
thousands of chunks; through zarr each costs processor time beyond its bytes, and a buffered read the page
cache's copy, both competing with the scan's products. :class:`ChunkFiles` reads the chunk files of one array
whose codecs are ``bytes`` [``zstd``] ``crc32c``, checks each chunk's CRC32C (the 4 bytes, little-endian,
that zarr's ``crc32c`` codec appends) and decodes it into the caller's buffer; an uncompressed chunk with
``O_DIRECT`` where the file system allows it. An edge chunk is stored at the full chunk shape (zarr v3).
Any other array (an object store, another codec) has no :class:`ChunkFiles` and is read through zarr.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from trakcli.store.integrity import StoreCorruptError, repair_command

#: Alignment of ``O_DIRECT`` offsets, lengths and buffers (the page size covers every logical block size).
ALIGN = 4096
#: Bytes of the checksum zarr's crc32c codec appends to a chunk.
CRC_BYTES = 4


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array whose memory starts on a page (:data:`ALIGN`), as ``O_DIRECT`` reads need."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype=np.uint8, count=n).view(dtype).reshape(shape)


def chunk_files(arr: Any) -> "ChunkFiles | None":
    """A :class:`ChunkFiles` of the zarr array ``arr`` (chunked along axis 0 only), or None when it is not kept as
    files this module reads: codecs bytes [zstd] crc32c in a local folder, little-endian entries."""
    from zarr.codecs import BytesCodec, Crc32cCodec, ZstdCodec
    from zarr.storage import LocalStore

    codecs = tuple(getattr(arr.metadata, "codecs", ()))
    if (not isinstance(arr.store_path.store, LocalStore) or np.dtype(arr.dtype).byteorder == ">"
            or any(int(c) != int(n) for c, n in zip(arr.chunks[1:], arr.shape[1:]))
            or not codecs or not isinstance(codecs[0], BytesCodec) or not isinstance(codecs[-1], Crc32cCodec)):
        return None
    if len(codecs) == 2:
        return ChunkFiles(arr, "raw")
    if len(codecs) == 3 and isinstance(codecs[1], ZstdCodec):
        return ChunkFiles(arr, "zstd")
    return None


class ChunkFiles:
    """The chunk files of one local zarr array (see the module docstring); one per thread (it owns a buffer).

    Args:
        arr: the zarr array ``[n, ...]`` chunked ``[chunk_rows, ...]`` along axis 0 only.
        codec: ``raw`` or ``zstd`` (:func:`chunk_files` finds it).
    """

    def __init__(self, arr: Any, codec: str):
        from zarr.storage import LocalStore

        store = arr.store_path.store
        assert isinstance(store, LocalStore)  # chunk_files checked it
        self.arr, self.codec = arr, codec
        self.folder = Path(store.root) / arr.store_path.path
        self.chunk_rows = int(arr.chunks[0])
        self.dtype = np.dtype(arr.dtype)
        self.row_items = int(np.prod(arr.shape[1:], dtype=np.int64))
        self.chunk_bytes = self.chunk_rows * self.row_items * self.dtype.itemsize
        slack = self.chunk_bytes // 64 + 1024 if codec == "zstd" else 0  # zstd's worst-case growth is far less
        self._size = -(-(self.chunk_bytes + slack + CRC_BYTES) // ALIGN) * ALIGN
        self._buf = mmap.mmap(-1, self._size)  # page-aligned, as O_DIRECT needs
        self._direct = getattr(os, "O_DIRECT", 0)
        from google_crc32c import cext  # zarr's own dependency for its crc32c codec

        self._crc32c = cext.value
        self._zstd = None
        if codec == "zstd":
            from numcodecs import Zstd

            self._zstd = Zstd()

    def read(self, lo: int, hi: int, out: np.ndarray) -> None:
        """Entries ``[lo, hi)`` along axis 0 into ``out`` (``[hi - lo, ...]``, C-contiguous, the array's dtype);
        every chunk they touch is read whole and checked.

        Raises:
            StoreCorruptError: a chunk's file is missing, shorter than its checksum, fails its checksum or cannot be
                decoded (names the array, the chunk and the command that repairs it).
        """
        if out.shape[0] != hi - lo or not out.flags.c_contiguous or out.dtype != self.dtype:
            raise ValueError(f"out must be C-contiguous {self.dtype} with {hi - lo} rows, got {out.dtype} {out.shape}")
        flat = out.reshape(-1).view(np.uint8)
        per_row = self.row_items * self.dtype.itemsize
        for c in range(lo // self.chunk_rows, -(-hi // self.chunk_rows)):
            a, b = max(lo, c * self.chunk_rows), min(hi, (c + 1) * self.chunk_rows)  # rows of the chunk asked for
            whole = b - a == self.chunk_rows
            got = self._chunk(c, flat[(a - lo) * per_row:(b - lo) * per_row] if whole else None)
            if got is not None:
                at = (a - c * self.chunk_rows) * per_row
                flat[(a - lo) * per_row:(b - lo) * per_row] = got[at:at + (b - a) * per_row]

    def _chunk(self, c: int, into: np.ndarray | None = None) -> np.ndarray | None:
        """Chunk ``c``'s decoded bytes ``[chunk_bytes]`` uint8 (a view of this reader's buffer or a fresh array), or
        None when they were decoded straight into ``into`` (``[chunk_bytes]`` uint8, contiguous)."""
        key = self.arr.metadata.encode_chunk_key((c,) + (0,) * (self.arr.ndim - 1))
        path = self.folder / key
        if self.codec == "raw" and into is not None and into.ctypes.data % ALIGN == 0 and not self.chunk_bytes % ALIGN:
            # straight into place (O_DIRECT: no copy at all), the checksum into this reader's buffer
            size = self._load(path, c, into)
            if size != self.chunk_bytes + CRC_BYTES:
                raise self._corrupt(c, f"holds {size} bytes, not {self.chunk_bytes + CRC_BYTES}")
            if self._crc32c(into) != int.from_bytes(self._buf[:CRC_BYTES], "little"):
                raise self._corrupt(c, "fails its checksum")
            return None
        size = self._load(path, c)
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=size)
        body = raw[: size - CRC_BYTES]
        if size < CRC_BYTES or self._crc32c(body) != int.from_bytes(raw[size - CRC_BYTES:size].tobytes(), "little"):
            raise self._corrupt(c, "fails its checksum" if size >= CRC_BYTES else "is truncated")
        if self.codec == "raw":
            if size - CRC_BYTES != self.chunk_bytes:
                raise self._corrupt(c, f"holds {size - CRC_BYTES} bytes, not {self.chunk_bytes}")
            return body
        out = np.empty(self.chunk_bytes, dtype=np.uint8) if into is None else into
        try:
            self._zstd.decode(body, out=out)
        except Exception as e:  # numcodecs raises RuntimeError / ValueError for a bad frame
            raise self._corrupt(c, f"cannot be decoded ({e})") from None
        return out if into is None else None

    def _load(self, path: Path, c: int, into: np.ndarray | None = None) -> int:
        """Read chunk ``c``'s file into the buffer (with ``into``, ``[chunk_bytes]`` page-aligned: its first
        ``chunk_bytes`` into ``into``, the rest into the buffer); returns its size in bytes."""
        iov = [self._buf] if into is None else [memoryview(into), memoryview(self._buf)[:ALIGN]]
        limit = self._size if into is None else self.chunk_bytes + ALIGN
        try:
            fd = os.open(path, os.O_RDONLY | self._direct)
            try:
                size = os.preadv(fd, iov, 0)
            finally:
                os.close(fd)
        except FileNotFoundError:
            raise self._corrupt(c, f"is missing (its file {self.arr.path}/{path.name} is gone)") from None
        except OSError:
            if not self._direct:
                raise
            self._direct = 0  # a file system without O_DIRECT (tmpfs): buffered from now on
            return self._load(path, c, into)
        if size == limit:  # larger than any chunk this array writes
            raise self._corrupt(c, "is larger than a chunk can be")
        return size

    def _corrupt(self, c: int, what: str) -> StoreCorruptError:
        lo = c * self.chunk_rows
        return StoreCorruptError(f"store array {self.arr.path} chunk {c} (entries {lo}:{lo + self.chunk_rows} along "
                                 f"axis 0) {what}; {repair_command(self.arr.path)}", self.arr.path, [c])
