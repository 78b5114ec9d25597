"""Chunk files read straight from a local store (trakcli.store.chunkread): the same entries as zarr reads, every
chunk checked, and no reader where the codecs or the store are not ones it reads."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from trakcli.store import StoreCorruptError
from trakcli.store.chunkread import chunk_files
from trakcli.store.rows import codecs


def _array(path, compressor, dtype="int8", shape=(103, 9), chunk_rows=10):
    root = zarr.open_group(str(path), mode="a", zarr_format=3)
    arr = root.create_array("x", shape=shape, chunks=(chunk_rows, *shape[1:]), dtype=dtype, fill_value=0,
                            compressors=codecs(compressor)[:-1], filters=(), serializer="auto",
                            config={"write_empty_chunks": True})
    rng = np.random.default_rng(0)
    data = (rng.integers(-127, 128, shape) if np.dtype(dtype).kind == "i" else rng.normal(size=shape)).astype(dtype)
    arr[:] = data
    return zarr.open_group(str(path), mode="r")["x"], data


def _with_crc(path, compressor, **kw):
    """An array with the store's codecs (compressor, then CRC32C), as the store writes its data arrays."""
    from zarr.codecs import BytesCodec

    root = zarr.open_group(str(path), mode="a", zarr_format=3)
    shape, chunk_rows, dtype = kw.get("shape", (103, 9)), kw.get("chunk_rows", 10), kw.get("dtype", "int8")
    arr = root.create_array("x", shape=shape, chunks=(chunk_rows, *shape[1:]), dtype=dtype, fill_value=0,
                            serializer=BytesCodec(), compressors=codecs(compressor),
                            config={"write_empty_chunks": True})
    rng = np.random.default_rng(0)
    data = (rng.integers(-127, 128, shape) if np.dtype(dtype).kind == "i" else rng.normal(size=shape)).astype(dtype)
    arr[:] = data
    return zarr.open_group(str(path), mode="r")["x"], data


@pytest.mark.parametrize("compressor,dtype", [("none", "uint16"), ("zstd", "int8"), ("zstd", "float32")])
def test_reads_equal_zarrs_for_whole_and_partial_chunk_runs(tmp_path, compressor, dtype):
    arr, data = _with_crc(tmp_path / "s.zarr", compressor, dtype=dtype)
    files = chunk_files(arr)
    assert files is not None and files.codec == ("raw" if compressor == "none" else "zstd")
    for lo, hi in [(0, 103), (0, 10), (10, 30), (3, 17), (95, 103), (100, 103), (40, 40)]:
        out = np.empty((hi - lo, 9), dtype=dtype)
        files.read(lo, hi, out)
        np.testing.assert_array_equal(out, data[lo:hi])


def test_a_flipped_bit_or_a_missing_chunk_names_the_chunk_and_the_repair(tmp_path):
    arr, _ = _with_crc(tmp_path / "s.zarr", "none", dtype="uint16")
    folder = tmp_path / "s.zarr" / "x"
    chunk = folder / arr.metadata.encode_chunk_key((2, 0))
    raw = bytearray(chunk.read_bytes())
    raw[11] ^= 0x04
    chunk.write_bytes(bytes(raw))
    files = chunk_files(arr)
    out = np.empty((30, 9), dtype=np.uint16)
    files.read(0, 20, out[:20])  # chunks 0 and 1 are fine
    with pytest.raises(StoreCorruptError, match=r"chunk 2 \(entries 20:30 along axis 0\) fails its checksum") as e:
        files.read(0, 30, out)
    assert e.value.chunks == [2] and "rerun `trak featurize CONFIG" in str(e.value)  # the repair for its array
    chunk.unlink()
    with pytest.raises(StoreCorruptError, match="chunk 2 .* is missing"):
        files.read(20, 30, out[:10])
    chunk.write_bytes(bytes(raw[:2]))  # shorter than its checksum
    with pytest.raises(StoreCorruptError, match="chunk 2 .* is truncated"):
        files.read(20, 30, out[:10])


def test_a_damaged_zstd_chunk_with_a_matching_checksum_is_reported_as_undecodable(tmp_path):
    from google_crc32c import value

    arr, _ = _with_crc(tmp_path / "s.zarr", "zstd")
    chunk = tmp_path / "s.zarr" / "x" / arr.metadata.encode_chunk_key((1, 0))
    body = bytearray(chunk.read_bytes()[:-4])
    body[0] ^= 0xFF  # the frame's magic number
    chunk.write_bytes(bytes(body) + value(bytes(body)).to_bytes(4, "little"))
    with pytest.raises(StoreCorruptError, match="chunk 1 .* cannot be decoded"):
        chunk_files(arr).read(10, 20, np.empty((10, 9), dtype=np.int8))


def test_no_reader_for_codecs_it_does_not_read(tmp_path):
    arr, _ = _with_crc(tmp_path / "a.zarr", "blosc")
    assert chunk_files(arr) is None
    plain, _ = _array(tmp_path / "b.zarr", "zstd")  # no checksum codec
    assert chunk_files(plain) is None


def test_whole_chunks_read_into_a_page_aligned_buffer_are_checked_as_any(tmp_path):
    from trakcli.store.chunkread import aligned_empty

    arr, data = _with_crc(tmp_path / "s.zarr", "none", dtype="uint16", shape=(100, 2048), chunk_rows=4)
    files = chunk_files(arr)  # 16 KiB chunks: whole pages, read in place
    out = aligned_empty((100, 2048), np.uint16)
    assert out.ctypes.data % 4096 == 0
    files.read(0, 100, out)
    np.testing.assert_array_equal(out, data)
    chunk = tmp_path / "s.zarr" / "x" / arr.metadata.encode_chunk_key((5, 0))
    raw = bytearray(chunk.read_bytes())
    raw[-7] ^= 0x01
    chunk.write_bytes(bytes(raw))
    with pytest.raises(StoreCorruptError, match=r"chunk 5 \(entries 20:24 along axis 0\) fails its checksum"):
        files.read(0, 100, out)
    chunk.write_bytes(bytes(raw[:-100]))
    with pytest.raises(StoreCorruptError, match="chunk 5 .* holds 16288 bytes, not 16388"):
        files.read(20, 24, out[20:24])
