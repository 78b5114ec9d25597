"""Row-chunked arrays with ``done`` flags, and the checked read.

A chunk's data is written before its ``done`` flag, and train rows keep the progress of a chunk not yet
done (``rows_done``, :meth:`ChunkedRows.write_partial`). :func:`read_checked` reports a corrupt, truncated or
lost chunk with its array, its chunk index and the command that repairs it. Arrays are written from numpy.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from trakcli.errors import StoreError
from trakcli.store.bfloat16 import from_bits, is_bfloat16, round_to_bfloat16, to_bits
from trakcli.store.chunkread import aligned_empty, chunk_files
from trakcli.store.integrity import StoreCorruptError, chunk_coords, fill_chunks, missing_chunks, repair_command, settle
from trakcli.store.quantize import BINARY, INT8, encode

__all__ = ["ChunkedRows", "EvalRows", "StoreCorruptError", "codecs", "read_checked"]

READ_ERRORS = (ValueError, RuntimeError, OSError, TypeError)  # what zarr raises for an undecodable chunk
#: Chunks above which :meth:`ChunkedRows.partial` reads every chunk's count at once rather than one by one.
READ_RUN_CHUNKS = 32


def codecs(compressor: str) -> list[Any]:
    """The zarr codecs of a data array: ``compressor`` (one of :data:`COMPRESSORS`), then a CRC32C checksum."""
    from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec  # zarr is imported when a store is opened, not before

    base = {"zstd": [ZstdCodec(level=3)], "blosc": [BloscCodec(cname="zstd", clevel=3)], "none": []}[compressor]
    return [*base, Crc32cCodec()]


def flag_array(group: Any, name: str, n: int, dtype: str = "uint8", dim: str = "chunk") -> Any:
    """A new ``[n]`` array of per-chunk flags or counts in ``group``: one chunk per entry (writers of different
    chunks never share a file), fill value 0, checksummed."""
    return group.create_array(name, shape=(n,), chunks=(1,), dtype=dtype, fill_value=0, compressors=codecs("none"),
                              dimension_names=(dim,))


@dataclass
class ChunkedRows:
    """Arrays chunked along their first axis, with a ``done`` flag per chunk.

    Attributes:
        data: arrays written together per chunk (name -> zarr array; chunk axis first).
        done: ``[n_chunks]`` uint8 flags.
        chunk_rows: entries per chunk along the chunk axis.
        n_rows: length of the chunk axis.
        axis: which axis of the arrays the chunks split (0 = rows; scores use 1).
        bad_flags: chunks whose done flag itself is unreadable (found by :meth:`flags`).
        progress: ``[n_chunks]`` int32 ``rows_done``: of a chunk not done, how many of its first rows are
            written (:meth:`write_partial`); 0 when none or when the chunk is done. None: the rows keep no
            partial progress (target features, scores, a store made before it, opened read-only).
    """

    data: dict[str, Any]
    done: Any
    chunk_rows: int
    n_rows: int
    axis: int = 0
    bad_flags: set[int] = field(default_factory=set)
    progress: Any = None

    @property
    def n_chunks(self) -> int:
        return -(-self.n_rows // self.chunk_rows)

    @property
    def path(self) -> str:
        """Store path of the first data array (``train/0/features``), for messages."""
        return str(next(iter(self.data.values())).path)

    def rows(self, chunk: int) -> tuple[int, int]:
        """Range ``[lo, hi)`` of a chunk along the chunk axis."""
        lo = chunk * self.chunk_rows
        return lo, min(lo + self.chunk_rows, self.n_rows)

    def flags(self, marked: bool = True) -> np.ndarray:
        """``[n_chunks]`` uint8 done flags; an unreadable flag counts as not done (and goes to :attr:`bad_flags`).
        ``marked``: trust the done array's :data:`ALL_DONE` mark (:meth:`mark_complete`) instead of reading them."""
        n = int(self.done.shape[0])
        if marked and n and self.done.attrs.get(ALL_DONE) == n:
            return np.ones(n, dtype=np.uint8)
        return _flags(self.done, self.bad_flags)

    def mark_complete(self, known: bool = False) -> bool:
        """Record on the done array that every chunk is done (:data:`ALL_DONE`), once every flag reads set;
        returns whether the mark is set. ``known``: the caller (a single process whose pass read every flag and
        wrote each chunk not done) knows it without reading the flags again."""
        n = int(self.done.shape[0])
        if self.done.attrs.get(ALL_DONE) == n:
            return True
        if not n:
            return False
        bad: set[int] = set()
        if not known and (not (_flags(self.done, bad) != 0).all() or bad):
            return False
        self.done.attrs.update({ALL_DONE: n})
        return True

    def unmark(self) -> None:
        """Drop the :data:`ALL_DONE` mark (before a flag is cleared)."""
        drop_all_done(self.done)

    def pending(self, rank: int = 0, world_size: int = 1, marked: bool = True) -> list[int]:
        """Chunks not yet done; with ranks, those of chunk index ≡ rank (mod world_size). ``marked``: as
        :meth:`flags` (a pass that writes the chunks reads every flag, so that a flag cleared since is seen)."""
        return [int(i) for i in np.flatnonzero(self.flags(marked) == 0) if i % world_size == rank]

    def is_complete(self) -> bool:
        return bool((self.flags() != 0).all())

    def write(self, chunk: int, clear_partial: bool = False, **arrays: np.ndarray) -> None:
        """Write a chunk of every array, then mark it done.

        Args:
            chunk: the chunk index.
            clear_partial: then reset the chunk's ``rows_done`` count to 0 (:meth:`write_partial`).
            **arrays: per array name, the chunk's entries (numpy, any real dtype), cast to the array's dtype
                (bfloat16 bits for a bfloat16 array). Rows with ``codes`` (int8 or binary stores) given only
                ``features`` get codes and scales derived from the features as stored (:meth:`_encoded`).

        Raises:
            StoreError: the write failed (disk full, permissions); chunks already done stay done.
        """
        lo, hi = self.rows(chunk)
        encoded = self._encoded(arrays)  # before any write
        try:
            for name, arr in encoded.items():
                self.data[name][(slice(None),) * self.axis + (slice(lo, hi),)] = arr
            self.done[chunk] = 1
            if clear_partial and self.progress is not None:
                self.progress[chunk] = 0  # after the flag: a done chunk never reads its count
        except OSError as e:
            raise _write_failed(f"chunk {chunk} ({lo}:{hi}) of {self.path}", e, "chunks") from None

    def _encoded(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``arrays`` as written (:meth:`write`): each cast to its array, and in an int8 / binary store the codes of
        the features as stored (rounded to bfloat16: the same whether a row is computed or read back) added."""
        if "codes" in self.data and "features" in arrays and "codes" not in arrays:
            stored = round_to_bfloat16(arrays["features"]) if is_bfloat16(self.data["features"]) else arrays["features"]
            arrays = {**arrays, **encode(self.code_dtype, stored)}
        return {name: to_bits(arr) if is_bfloat16(self.data[name]) else
                np.ascontiguousarray(arr, dtype=self.data[name].dtype) for name, arr in arrays.items()}

    def partial(self, chunks: Sequence[int]) -> dict[int, int]:
        """``{chunk: rows}``: of the chunks ``chunks`` (not done), those whose first ``rows`` rows are written
        (:meth:`write_partial`); a chunk without any, or whose count is unreadable or out of range, is left out.
        The rows are not read here (the caller reads them back, checked)."""
        if self.progress is None or not len(chunks):
            return {}
        n_chunks = int(self.progress.shape[0])
        listed = _stored_chunks(self.progress)  # a count of 0 has no file: one listing, not a read per chunk
        candidates = [int(c) for c in chunks if int(c) < n_chunks and (listed is None or int(c) in listed)]
        if len(candidates) > READ_RUN_CHUNKS:
            counts = _flags(self.progress, set())  # one count per chunk, like the flags; unreadable reads 0
        else:
            counts = {c: read_entry(self.progress, c) for c in candidates}
        out = {c: int(counts[c]) for c in candidates}
        return {c: n for c, n in out.items() if 0 < n <= self.rows(c)[1] - self.rows(c)[0]}

    def write_partial(self, chunk: int, n: int, **arrays: np.ndarray) -> None:
        """Write the first ``n`` rows (``0 < n <=`` the chunk's rows) of a chunk not done, then record ``n`` in its
        ``rows_done`` count; the chunk stays not done (a resumed run computes only the others, :meth:`partial`). The
        whole chunk is written, its rows from ``n`` on as zeros (``arrays`` as :meth:`write`, only their first ``n``
        rows read), so that zarr never reads back an older, possibly damaged, file of the chunk. Rows only (axis 0). A
        failed write raises StoreError (the count is then not recorded)."""
        if self.progress is None or self.axis != 0:
            return
        lo, hi = self.rows(chunk)
        head = {}
        for name, arr in arrays.items():
            head[name] = np.zeros_like(arr)
            head[name][:n] = arr[:n]
        encoded = self._encoded(head)
        try:
            for name, arr in encoded.items():
                self.data[name][lo:hi] = arr
            self.progress[chunk] = n  # after the rows it counts
        except OSError as e:
            raise _write_failed(f"the first {n} rows of chunk {chunk} ({lo}:{hi}) of {self.path}", e,
                                "chunks") from None

    @property
    def code_dtype(self) -> str | None:
        """``int8`` or ``binary`` when the rows carry codes (:mod:`trakcli.store.quantize`), else None."""
        if "codes" not in self.data:
            return None
        return INT8 if np.dtype(self.data["codes"].dtype) == np.int8 else BINARY

    def set_attrs(self, name: str, **attrs: Any) -> None:
        """Record JSON-able ``attrs`` on array ``name``."""
        self.data[name].attrs.update(attrs)

    def attrs(self, name: str) -> dict[str, Any]:
        """The attributes of array ``name``."""
        return dict(self.data[name].attrs)

    def as_stored(self, name: str, arr: np.ndarray) -> np.ndarray:
        """``arr`` as :meth:`read` returns it once :meth:`write` has stored it in array ``name`` (bfloat16: float32
        values rounded to bfloat16; else cast to the array's dtype, no copy when it has it already)."""
        target = self.data[name]
        if is_bfloat16(target):
            return round_to_bfloat16(arr)
        return np.asarray(arr).astype(target.dtype, copy=False)

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Entries ``[lo, hi)`` along the chunk axis of array ``name``, in its dtype (float32 for bfloat16), every
        chunk's file and checksum checked (StoreCorruptError naming the chunk and its repair: :func:`read_checked`)."""
        sel = (slice(None),) * self.axis + (slice(lo, hi),)
        return read_checked(self.data[name], sel, self.axis)

    #: Buffers per array that :meth:`read_direct` reads into in turn when asked (``slot``).
    DIRECT_SLOTS = 8

    def read_direct(self, name: str, lo: int, hi: int, *, raw: bool = False, slot: int | None = None) -> np.ndarray:
        """Entries ``[lo, hi)`` (whole chunks) of array ``name``, checked as :meth:`read`: straight from the chunk files
        where the store keeps them so (:mod:`trakcli.store.chunkread`, one reader per thread), else as :meth:`read`.

        Args:
            raw: a bfloat16 array gives its stored uint16 bits (through zarr: decoded, float32).
            slot: read into this array's reused buffer ``slot mod DIRECT_SLOTS`` (valid until a later read reuses
                the slot) instead of a fresh one.
        """
        local = self.__dict__.setdefault("_direct", threading.local())
        files = local.__dict__.setdefault("files", {})
        if name not in files:
            files[name] = chunk_files(self.data[name])
        reader = files[name]
        if reader is None:
            return self.read(name, lo, hi)
        shape = (hi - lo, *self.data[name].shape[1:])
        if slot is None:
            out = np.empty(shape, dtype=reader.dtype)
        else:
            ring = self.__dict__.setdefault("_slots", {}).setdefault(name, [None] * self.DIRECT_SLOTS)
            slot %= self.DIRECT_SLOTS
            if ring[slot] is None or ring[slot].shape[0] < shape[0]:
                ring[slot] = aligned_empty(shape, reader.dtype)  # whole chunks are read straight into it
            out = ring[slot][: shape[0]]
        reader.read(lo, hi, out)
        if not raw and is_bfloat16(self.data[name]):
            return from_bits(out)
        return out

    def reads_chunk_files(self, name: str) -> bool:
        """Whether :meth:`read_direct` reads array ``name`` from its chunk files (a local store)."""
        return chunk_files(self.data[name]) is not None

    def take(self, name: str, indices: Sequence[int]) -> np.ndarray:
        """Entries ``indices`` (any order, repeats allowed, returned in that order) along the chunk axis of array
        ``name``, each chunk that holds one of them read once (checked as :meth:`read`)."""
        idx = np.asarray(list(indices), dtype=np.int64)
        chunks = np.unique(idx // self.chunk_rows)
        if not len(chunks):
            return self.read(name, 0, 0)
        joined = np.concatenate([self.read(name, *self.rows(int(c))) for c in chunks.tolist()], axis=self.axis)
        # every chunk but the array's last holds chunk_rows entries, and the last sorts last
        at = np.searchsorted(chunks, idx // self.chunk_rows) * self.chunk_rows + idx % self.chunk_rows
        return np.take(joined, at, axis=self.axis)

    def iter_chunks(self, name: str) -> Iterator[tuple[int, int, np.ndarray]]:
        """Yield ``(lo, hi, block)`` of array ``name`` chunk by chunk."""
        for c in range(self.n_chunks):
            lo, hi = self.rows(c)
            yield lo, hi, self.read(name, lo, hi)

    def damaged(self, read: bool = True, names: list[str] | None = None,
                flags: np.ndarray | None = None) -> dict[str, list[int]]:
        """``{array name: [chunk, ...]}``: the done chunks of ``names`` (default: every array) that are damaged, and
        under ``"done"`` the unreadable flags. ``read``: read every done chunk (checksums), else only ask which
        chunk files exist; ``flags``: the :meth:`flags` the caller has just read."""
        flags = self.flags(marked=False) if flags is None else flags
        out: dict[str, list[int]] = {"done": sorted(self.bad_flags)} if self.bad_flags else {}
        for name in names or list(self.data):
            if read:
                bad = []
                for c in np.flatnonzero(flags):
                    try:
                        self.read(name, *self.rows(int(c)))
                    except StoreCorruptError:
                        bad.append(int(c))
            else:
                sel = (slice(None),) * self.axis + (slice(0, self.n_rows),)
                bad = sorted({int(c[self.axis]) for c in missing_chunks(self.data[name], sel) if flags[c[self.axis]]})
            if bad:
                out[name] = bad
        return out

    def check(self, names: list[str] | None = None) -> list[int]:
        """Done chunks that are missing or fail their checksum in any array (every done chunk is read)."""
        return sorted({c for bad in self.damaged(True, names).values() for c in bad})

    def verify(self, names: list[str] | None = None) -> list[int]:
        """Reset the done flag of every chunk that is missing, fails its checksum, or whose flag is unreadable;
        returns those chunks (pending now)."""
        self.unmark()  # the flags are read and checked, not taken from the mark
        bad = self.check(names)
        for c in bad:
            self.done[c] = 0
        self.bad_flags.clear()
        return bad


#: Attribute of a ``done`` array: its number of chunks, once every one was done (:meth:`ChunkedRows.mark_complete`).
ALL_DONE = "all_done"


def _write_failed(what: str, e: OSError, kept: str) -> StoreError:
    """The error of a failed write of ``what`` (once zarr's other chunk writes have settled)."""
    settle()
    return StoreError(f"writing {what} failed: {e}; {kept} written before are kept: free disk space or fix "
                      "permissions, then rerun the same command to resume")


def drop_all_done(done: Any) -> None:
    """Remove :data:`ALL_DONE` from the zarr array ``done``, if it has it (before any of its flags is cleared)."""
    if ALL_DONE in done.attrs:
        del done.attrs[ALL_DONE]


def read_entry(arr: Any, c: int) -> int:
    """Entry ``c`` of the 1-D zarr array ``arr`` of flags or counts (0 if it is unreadable)."""
    try:
        return int(read_checked(arr, slice(c, c + 1), 0, stored=False)[0])
    except StoreCorruptError:
        return 0


def _stored_chunks(arr: Any) -> set[int] | None:
    """Indices of the chunks of the 1-D zarr array ``arr`` that have a file (from one listing of the store);
    None if the store cannot be listed."""
    from zarr.core.sync import collect_aiterator

    try:
        keys = set(collect_aiterator(arr.store.list_prefix(arr.path + "/")))
    except Exception:  # noqa: BLE001 - no listing: the caller reads every entry
        return None
    return {c for c in range(int(arr.shape[0])) if f"{arr.path}/{arr.metadata.encode_chunk_key((c,))}" in keys}


def _flags(done: Any, bad: set[int]) -> np.ndarray:
    """The done flags of ``done`` (one entry per chunk, uint8; or the int32 ``rows_done`` counts); unreadable
    entries read 0 and are added to ``bad``."""
    try:
        return read_checked(done, slice(None), 0, stored=False)
    except StoreCorruptError:
        out = np.zeros(done.shape[0], dtype=done.dtype)
        for c in range(done.shape[0]):
            try:
                out[c] = read_checked(done, slice(c, c + 1), 0, stored=False)[0]
            except StoreCorruptError:
                bad.add(c)
        return out


def read_checked(arr: Any, sel: Any, axis: int = 0, *, stored: bool = True) -> np.ndarray:
    """``arr[sel]`` (a zarr array; a slice or a tuple of slices) as numpy, every chunk's checksum verified; a
    bfloat16 array is decoded to float32.

    Args:
        axis: the axis along which chunks are counted (in the message and ``StoreCorruptError.chunks``).
        stored: every chunk of the selection must have a file (a done chunk, or a finished array); False for
            flags, whose missing chunks legitimately read as the fill value (a flag not set).

    Raises:
        StoreCorruptError: a chunk is missing, fails its checksum or cannot be decoded (names the array, the
            chunk, and the command that repairs it: :func:`repair_command`).
    """
    def where(coords: tuple[int, ...]) -> str:
        grid = [-(-int(n) // int(c)) for n, c in zip(arr.shape, arr.chunks)]
        spans = [f"{i * c}:{min((i + 1) * c, int(n))}" for i, c, n in zip(coords, arr.chunks, arr.shape)]
        if all(g == 1 for a, g in enumerate(grid) if a != axis):  # chunked along one axis: name its index
            return f" chunk {coords[axis]} (entries {spans[axis]} along axis {axis})"
        return f" chunk {tuple(int(i) for i in coords)} (entries [{', '.join(spans)}])"

    try:
        out = np.asarray(arr[sel])
    except READ_ERRORS as e:
        settle()
        first = None
        for coords in chunk_coords(arr, sel):  # the first bad chunk of the selection, for the message
            region = tuple(slice(i * c, (i + 1) * c) for i, c in zip(coords, arr.chunks))
            try:
                np.asarray(arr[region])
            except READ_ERRORS:
                settle()
                first = coords
                break
        raise StoreCorruptError(f"store array {arr.path}{where(first) if first is not None else ''} is corrupt or "
                                f"truncated ({e}); {repair_command(arr.path)}",
                                arr.path, [] if first is None else [int(first[axis])]) from None
    if stored:  # a missing chunk reads as the fill value: only chunks read so are asked about
        candidates = fill_chunks(arr, sel, out)
        gone = missing_chunks(arr, among=candidates) if candidates else []
        if gone:
            bad = sorted({int(c[axis]) for c in gone})
            key = arr.metadata.encode_chunk_key(gone[0])
            raise StoreCorruptError(f"store array {arr.path}{where(gone[0])} is missing (its file {arr.path}/{key} is "
                                    f"gone{f'; {len(gone)} chunks in all' if len(gone) > 1 else ''}); "
                                    f"{repair_command(arr.path)}", arr.path, bad)
    return from_bits(out) if is_bfloat16(arr) else out


@dataclass
class EvalRows:
    """The ``eval/`` group: one row per retrained model, each its own chunk, with a ``done`` flag per row.

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

    def pending(self, n: int | None = None) -> list[int]:
        """Rows ``k < n`` not yet done, in order (an unreadable flag counts as not done: the model is retrained)."""
        return [int(k) for k in np.flatnonzero(_flags(self.done, set())[:n] == 0)]

    def write(self, k: int, mask: np.ndarray, outputs: np.ndarray) -> None:
        """Write row ``k`` of masks and outputs, then its done flag; StoreError if the write fails (rows written
        before stay done)."""
        try:
            self.masks[k] = np.ascontiguousarray(mask, dtype=bool)
            self.outputs[k] = np.ascontiguousarray(outputs, dtype=np.float64)
            self.done[k] = 1
        except OSError as e:
            raise _write_failed(f"row {k} of {self.masks.path}", e, "rows") from None

    def verify(self) -> list[int]:
        """Reset the done flag of every done row that is missing or fails its checksum; returns those rows."""
        return ChunkedRows({"masks": self.masks, "outputs": self.outputs}, self.done, 1, self.n_subsets).verify()

    def read(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``n`` rows: ``(masks [n, n_train] bool, outputs [n, n_target] float64)``.

        Raises:
            StoreError: a row among them is not done (names the rows).
            StoreCorruptError: a chunk fails its checksum.
        """
        missing = self.pending(n) + list(range(self.n_subsets, n))
        if missing:
            raise StoreError(f"{self.masks.path}: rows {missing[:10]} of {n} are not retrained yet; "
                             "run `trak eval lds CONFIG` to finish them")
        return (read_checked(self.masks, slice(0, n), 0).astype(bool, copy=False),
                read_checked(self.outputs, slice(0, n), 0).astype(np.float64, copy=False))
