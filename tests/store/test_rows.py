"""ChunkedRows, the unit of resume: done flags, pending chunks per rank, checked reads, verify."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from trakcli.errors import StoreError
from trakcli.store import ChunkedRows, StoreCorruptError
from trakcli.store.rows import codecs


def rows_of(path, n_rows=10, chunk_rows=4, width=3, axis=0) -> ChunkedRows:
    """A ChunkedRows over a fresh zarr array [n_rows, width] (or [width, n_rows] with axis 1)."""
    root = zarr.open_group(str(path), mode="a", zarr_format=3)
    shape = (n_rows, width) if axis == 0 else (width, n_rows)
    chunks = (chunk_rows, width) if axis == 0 else (width, chunk_rows)
    if "x" not in root:
        root.create_array("x", shape=shape, chunks=chunks, dtype="float32", fill_value=0, compressors=codecs("zstd"))
        root.create_array("done", shape=(-(-n_rows // chunk_rows),), chunks=(1,), dtype="uint8", fill_value=0)
    return ChunkedRows({"x": root["x"]}, root["done"], chunk_rows, n_rows, axis=axis)


def block(lo, hi, width=3, axis=0):
    b = np.arange(lo * width, hi * width, dtype=np.float32).reshape(hi - lo, width)
    return b if axis == 0 else b.T


def test_chunks_cover_the_rows_and_pending_splits_them_between_ranks(tmp_path):
    rows = rows_of(tmp_path / "s.zarr")
    assert rows.n_chunks == 3 and [rows.rows(c) for c in range(3)] == [(0, 4), (4, 8), (8, 10)]
    assert rows.pending() == [0, 1, 2] and not rows.is_complete()
    assert rows.pending(0, 2) == [0, 2] and rows.pending(1, 2) == [1]
    rows.write(1, x=block(4, 8))
    assert rows.pending() == [0, 2] and rows.pending(1, 2) == []
    assert rows.flags().tolist() == [0, 1, 0]
    np.testing.assert_array_equal(rows.read("x", 4, 8), block(4, 8))


def test_a_reopened_array_resumes_where_the_done_flags_say(tmp_path):
    first = rows_of(tmp_path / "s.zarr")
    first.write(0, x=block(0, 4))
    first.write(2, x=block(8, 10))
    again = rows_of(tmp_path / "s.zarr")  # another process, later
    assert again.pending() == [1]
    again.write(1, x=block(4, 8))
    assert again.is_complete()
    np.testing.assert_array_equal(again.read("x", 0, 10), block(0, 10))
    assert [lo for lo, _, _ in again.iter_chunks("x")] == [0, 4, 8]


def test_data_written_without_its_flag_is_pending(tmp_path):
    rows = rows_of(tmp_path / "s.zarr")
    rows.data["x"][0:4] = block(0, 4)  # a run killed between the data and the flag
    assert rows.pending() == [0, 1, 2]


def test_a_lost_or_corrupt_done_chunk_is_found_and_verify_makes_it_pending(tmp_path):
    rows = rows_of(tmp_path / "s.zarr")
    for c in range(3):
        rows.write(c, x=block(*rows.rows(c)))
    assert rows.check() == [] and rows.verify() == []
    (tmp_path / "s.zarr" / "x" / "c" / "1" / "0").unlink()  # a lost chunk file would read as zeros
    with pytest.raises(StoreCorruptError, match=r"chunk 1 .*is missing"):
        rows.read("x", 4, 8)
    chunk = tmp_path / "s.zarr" / "x" / "c" / "2" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))  # bit rot: the checksum fails
    assert rows.damaged(read=False) == {"x": [1]}  # without reading, only missing files are seen
    assert rows.check() == [1, 2]
    assert rows.verify() == [1, 2] and rows.pending() == [1, 2]
    for c in rows.pending():
        rows.write(c, x=block(*rows.rows(c)))
    np.testing.assert_array_equal(rows.read("x", 0, 10), block(0, 10))


def test_the_all_done_mark_spares_reading_each_flag_until_a_flag_is_cleared(tmp_path):
    rows = rows_of(tmp_path / "s.zarr")
    rows.write(0, x=block(0, 4))
    assert not rows.mark_complete() and "all_done" not in rows.done.attrs  # a chunk is pending: no mark
    for c in rows.pending():
        rows.write(c, x=block(*rows.rows(c)))
    assert rows.mark_complete() and rows_of(tmp_path / "s.zarr").done.attrs["all_done"] == 3
    flag = tmp_path / "s.zarr" / "done" / "c" / "1"
    flag.unlink()  # a lost flag, after the mark
    again = rows_of(tmp_path / "s.zarr")  # another process
    assert again.is_complete() and again.pending() == []  # a reader takes the mark: no flag is read
    assert again.pending(marked=False) == [1]  # a pass that writes reads every flag
    assert again.verify() == [] and "all_done" not in again.done.attrs  # verify drops the mark, then checks
    assert again.pending() == [1] and not again.mark_complete()
    again.write(1, x=block(4, 8))
    assert again.mark_complete() and again.pending() == []


def test_a_pass_that_knows_every_chunk_is_done_marks_without_reading_the_flags(tmp_path, monkeypatch):
    import trakcli.store.rows as rows_module

    rows = rows_of(tmp_path / "s.zarr")
    for c in rows.pending():
        rows.write(c, x=block(*rows.rows(c)))

    def no_read(*args, **kwargs):
        raise AssertionError("a flag was read")

    monkeypatch.setattr(rows_module, "_flags", no_read)
    assert rows.mark_complete(known=True) and rows_of(tmp_path / "s.zarr").done.attrs["all_done"] == 3
    with pytest.raises(AssertionError, match="a flag was read"):
        rows_of(tmp_path / "t.zarr").mark_complete()  # not known: the flags are read


def test_chunks_along_the_second_axis(tmp_path):
    rows = rows_of(tmp_path / "s.zarr", axis=1)
    rows.write(2, x=block(8, 10, axis=1))
    assert rows.pending() == [0, 1]
    np.testing.assert_array_equal(rows.read("x", 8, 10), block(8, 10, axis=1))


def test_a_failed_write_is_a_store_error_that_keeps_what_was_done(tmp_path, monkeypatch):
    rows = rows_of(tmp_path / "s.zarr")
    rows.write(0, x=block(0, 4))

    class Full:
        dtype = np.dtype("float32")
        path = "x"
        attrs: dict = {}

        def __setitem__(self, key, value):
            raise OSError(28, "No space left on device")

    rows.data["x"] = Full()
    with pytest.raises(StoreError, match=r"writing chunk 1 \(4:8\) of x failed.*No space left.*rerun the same command"):
        rows.write(1, x=block(4, 8))
    assert rows.pending() == [1, 2]  # chunk 0 stays done, chunk 1 is not marked


@pytest.mark.parametrize("axis", [0, 1])
def test_take_gives_rows_in_any_order_with_repeats_reading_each_chunk_once(tmp_path, axis, monkeypatch):
    rows = rows_of(tmp_path / "s.zarr", axis=axis)
    for c in range(rows.n_chunks):
        rows.write(c, x=block(*rows.rows(c), axis=axis))
    reads = []
    real = ChunkedRows.read
    monkeypatch.setattr(ChunkedRows, "read", lambda self, name, lo, hi: reads.append((lo, hi)) or real(self, name, lo, hi))
    idx = [9, 0, 5, 9, 1]
    got = rows.take("x", idx)
    want = np.take(block(0, 10, axis=axis), idx, axis=axis)
    np.testing.assert_array_equal(got, want)
    assert sorted(reads) == [(0, 4), (4, 8), (8, 10)]
    assert rows.take("x", []).shape == ((0, 3) if axis == 0 else (3, 0))
