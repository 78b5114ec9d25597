"""Single rows of an uncompressed feature array, read by byte range and checked by their own CRC32C.

The exact re-ranking of a two-stage top-k (:mod:`trakcli.topk`) needs the
float copy of its candidate rows only: a few hundred thousand rows spread over
every chunk of a store of millions. Read chunk by chunk, that is the whole
float copy again; read row by row, it is ``proj_dim · 2`` bytes a candidate.

So the float copy of an ``int8`` / ``binary`` store (:mod:`trakcli.store.quantize`)
is written uncompressed (zarr codecs ``bytes`` then ``crc32c``: a chunk file is
the rows' little-endian bytes, row after row, then the chunk's 4-byte checksum),
with a per-row CRC32C beside it (``train/<model_id>/features_crc32c``
``[n_train]`` uint32, the checksum of each row's stored bytes, written in the same
chunk and under the same ``done`` flag). A row is then one ``pread`` of its bytes
at ``(row mod chunk_rows) · row_bytes`` in its chunk's file, verified against
its own checksum, as a chunk read is against the chunk's.

This holds for a store on a local file system; on an object store (or for a
float copy written compressed, or without the row checksums) the rows are read
by the chunks that hold them (:meth:`trakcli.store.rows.ChunkedRows.read_rows`).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from trakcli.store.bfloat16 import from_bits, is_bfloat16
from trakcli.store.integrity import StoreCorruptError, repair_command

#: The name of the per-row checksum array beside an array ``name``.
ROW_CRC_SUFFIX = "_crc32c"

#: Threads reading rows at once (reads of a cold disk overlap; on a warm page cache one would do).
READ_THREADS = 8


def row_checksums(bits: np.ndarray) -> np.ndarray:
    """``[rows]`` uint32 CRC32C of each row of ``bits`` ``[rows, width]`` as stored (little-endian bytes).

    CRC32C (Castagnoli), the checksum zarr's ``crc32c`` codec puts on every chunk (``google_crc32c``).
    """
    import google_crc32c  # zarr's own dependency for its crc32c codec

    rows = np.ascontiguousarray(bits, dtype=np.asarray(bits).dtype.newbyteorder("<"))
    return np.fromiter((google_crc32c.value(r.tobytes()) for r in rows), dtype=np.uint32, count=len(rows))


def _local_folder(arr: Any) -> Path | None:
    """The folder of the zarr array ``arr`` when the array is uncompressed (codecs ``bytes``, ``crc32c``) on a
    local file system, else None (read it chunk by chunk)."""
    from zarr.codecs import BytesCodec, Crc32cCodec
    from zarr.storage import LocalStore

    store = arr.store_path.store
    codecs = getattr(arr.metadata, "codecs", ())
    if not isinstance(store, LocalStore) or len(codecs) != 2:
        return None
    if not isinstance(codecs[0], BytesCodec) or not isinstance(codecs[1], Crc32cCodec):
        return None
    return Path(store.root) / arr.store_path.path


def local_chunk_file(arr: Any, chunk: int) -> Path | None:
    """The file of chunk ``chunk`` (along axis 0) of the zarr array ``arr`` when the array is uncompressed
    (codecs ``bytes``, ``crc32c``) on a local file system, else None (read it chunk by chunk)."""
    folder = _local_folder(arr)
    return None if folder is None else folder / _chunk_key(arr, chunk)


def _chunk_key(arr: Any, chunk: int) -> str:
    """The store key of chunk ``chunk`` along axis 0 of ``arr``, below the array's folder."""
    return arr.metadata.encode_chunk_key((chunk,) + (0,) * (arr.ndim - 1))


def read_rows(arr: Any, crc: np.ndarray, rows: np.ndarray, chunk_rows: int, decode: bool = True) -> np.ndarray | None:
    """Rows ``rows`` of the uncompressed 2-D zarr array ``arr``, each checked against its CRC32C.

    Args:
        arr: the zarr array ``[n, width]`` (chunks ``[chunk_rows, width]``).
        crc: ``[len(rows)]`` uint32, the stored checksum of each row asked for.
        rows: ``[r]`` int64 row indices, sorted, unique.
        chunk_rows: rows per chunk.
        decode: bfloat16 bits are returned as float32 (True) or as the stored uint16 (False).

    Returns:
        ``[r, width]`` in the array's dtype (float32 for bfloat16 bits when ``decode``), or None when ``arr`` is not an
        uncompressed array on a local file system (:func:`local_chunk_file`).

    Raises:
        StoreCorruptError: a row's bytes do not match its checksum, or its chunk file is shorter than the row
            (names the array, the chunk and the command that repairs it). A chunk file that is absent holds
            fill values (zarr writes no chunk of zeros): its rows read as zeros and are checked as such.
    """
    folder = _local_folder(arr)
    if folder is None:
        return None
    width = int(arr.shape[1])
    dtype = np.dtype(arr.dtype).newbyteorder("<")
    row_bytes = width * dtype.itemsize
    out = np.zeros((len(rows), width), dtype=dtype)
    chunks = rows // chunk_rows
    bounds = np.flatnonzero(np.diff(chunks)) + 1
    starts = np.concatenate([[0], bounds]).astype(np.int64)
    ends = np.concatenate([bounds, [len(rows)]]).astype(np.int64)

    def one_chunk(span: tuple[int, int]) -> None:
        a, b = span
        chunk = int(chunks[a])
        path = folder / _chunk_key(arr, chunk)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return  # fill values: zeros, checked below
        try:
            for i in range(a, b):
                got = os.pread(fd, row_bytes, int(rows[i] % chunk_rows) * row_bytes)
                if len(got) != row_bytes:
                    raise StoreCorruptError(
                        f"store array {arr.path} chunk {chunk} is truncated (row {int(rows[i])} reads {len(got)} "
                        f"of {row_bytes} bytes); {repair_command(arr.path)}", arr.path, [chunk])
                out[i] = np.frombuffer(got, dtype=dtype)
        finally:
            os.close(fd)

    spans = list(zip(starts.tolist(), ends.tolist()))
    if spans:
        with ThreadPoolExecutor(min(READ_THREADS, len(spans))) as pool:
            list(pool.map(one_chunk, spans))
    bad = np.flatnonzero(row_checksums(out) != np.asarray(crc, dtype=np.uint32))
    if len(bad):
        row = int(rows[bad[0]])
        raise StoreCorruptError(
            f"store array {arr.path} chunk {row // chunk_rows} is corrupt (row {row} fails its checksum"
            f"{f'; {len(bad)} rows in all' if len(bad) > 1 else ''}); {repair_command(arr.path)}",
            arr.path, sorted({int(rows[i]) // chunk_rows for i in bad}))
    out = out.astype(np.dtype(arr.dtype), copy=False)  # native byte order
    return from_bits(out) if decode and is_bfloat16(arr) else out
