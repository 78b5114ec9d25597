"""Integrity of a store beyond zarr's own decoding: missing chunk files, unreadable metadata, the repair command.

- **Missing chunk files.** zarr reads a chunk whose file is missing as its fill value, so a read asks the
  store about the chunks that came back all fill value (:func:`fill_chunks`, :func:`missing_chunks`); arrays
  are written with ``write_empty_chunks`` (:func:`writable`), so every done chunk has a file.
- **Unreadable metadata.** :func:`node` turns zarr's error for a garbage ``zarr.json`` into a
  :class:`StoreMetadataError` naming the file and the command that repairs it.
- **Orphaned reads.** :func:`settle` waits for the chunk tasks zarr leaves running after a failed read.

Every array has one owner command (:func:`repair_command`).
"""

from __future__ import annotations

import asyncio
import itertools
import warnings
from typing import Any

import numpy as np

from trakcli.errors import StoreError

# errors zarr raises for a garbage or incomplete zarr.json (json.JSONDecodeError is a ValueError)
METADATA_ERRORS = (ValueError, TypeError, KeyError, AttributeError, OSError, NotImplementedError)


class StoreCorruptError(StoreError):
    """A chunk is missing, fails its checksum or cannot be decoded; or a ``zarr.json`` is unreadable.

    Attributes:
        array: the store path of the array or group (``train/1/features``); "" if unknown.
        chunks: indices along the array's chunk axis of the bad chunks found (may be empty).
    """

    def __init__(self, message: str, array: str = "", chunks: list[int] | None = None):
        super().__init__(message)
        self.array = array
        self.chunks = list(chunks or [])


class StoreMetadataError(StoreCorruptError):
    """The ``zarr.json`` of an array or group cannot be read or parsed."""


def repair_command(path: str) -> str:
    """How to repair the array or group at store path ``path`` (a clause naming the command).

    Example:
        ``repair_command("train/1/features")`` is
        ``"rerun `trak featurize CONFIG --verify`, which recomputes it"``.
    """
    parts = [p for p in path.split("/") if p]
    if not parts:
        return "the store's identity is lost: rerun `trak featurize CONFIG --overwrite` to start over"
    if parts[0] == "train" and parts[-1] == "kernel":
        return "rerun `trak score CONFIG`, which rebuilds the kernel"
    if parts[0] == "train":
        return "rerun `trak featurize CONFIG --verify`, which recomputes it"
    if parts[0] in ("targets", "scores"):
        return "rerun `trak score CONFIG`, which recomputes it"
    if parts[0] == "eval":
        return "rerun `trak eval lds CONFIG`, which retrains it (`--overwrite` if its metadata is unreadable)"
    return "rerun `trak featurize CONFIG --overwrite` to start over"


def repair_scope(path: str) -> str:
    """How much of a node with unreadable metadata a repair deletes: ``"node"`` (everything under it, recomputed)
    when its attributes hold records a run cannot re-derive (a checkpoint's sha256, a kernel's settings, an
    experiment's settings, a top-k's or the per-token scores' sizes, the ``eval`` identity); else ``"metadata"``
    (only ``zarr.json``, re-created over the chunks, which are checked by their checksums)."""
    parts = [p for p in path.split("/") if p]
    if parts == ["eval"] or (len(parts) == 2 and parts[0] in ("train", "targets", "scores")):
        return "node"
    if len(parts) == 3 and parts[0] == "scores" and parts[2] in ("top_k", "top_k_parts", "per_token"):  # k in attrs
        return "node"
    if parts and parts[0] == "train" and parts[-1] == "kernel":
        return "node"
    return "metadata"


def finishing_command(path: str) -> str:
    """The command that computes the unfinished parts of the array at ``path`` (for ``trak export``)."""
    parts = [p for p in path.split("/") if p]
    if parts and parts[0] == "train" and parts[-1] != "kernel":
        return "`trak featurize CONFIG`"
    if parts and parts[0] == "eval":
        return "`trak eval lds CONFIG`"
    return "`trak score CONFIG`"


def node(group: Any, path: str) -> Any | None:
    """The array or group at ``path`` below ``group`` (None if absent); StoreMetadataError if the ``zarr.json`` of the
    node (or of a group on the way to it) is unreadable, naming the file and the repair command."""
    try:
        return _get(group, path)
    except KeyError:
        return None
    except METADATA_ERRORS as e:
        parts = path.split("/")
        for i in range(1, len(parts)):  # the first node on the way whose zarr.json cannot be read
            try:
                _get(group, "/".join(parts[:i]))
            except KeyError:
                break
            except METADATA_ERRORS:
                path = "/".join(parts[:i])
                break
        raise metadata_error(_full(group, path), e) from None


def attrs_of(group: Any, path: str) -> dict[str, Any] | None:
    """The attributes of the node at ``path`` below ``group``; None if it is absent or its metadata unreadable."""
    try:
        found = node(group, path)
    except StoreCorruptError:
        return None
    return None if found is None else dict(found.attrs)


def keys(group: Any) -> list[str]:
    """Names of the child groups of ``group``; StoreMetadataError if a child's ``zarr.json`` is unreadable."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # as _get
            return list(group.group_keys())
    except METADATA_ERRORS as e:
        for name in child_names(group):
            node(group, name)  # raises on the unreadable child
        raise metadata_error(group.path or "", e) from None


def _get(group: Any, path: str) -> Any:
    """``group[path]``, without zarr's warning about a directory without ``zarr.json``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return group[path]


def metadata_error(path: str, e: BaseException) -> StoreMetadataError:
    """The error of an unreadable ``<path>/zarr.json``, naming the repair command."""
    where = f"{path}/zarr.json" if path else "zarr.json (the store's root)"
    return StoreMetadataError(f"store metadata {where} is unreadable ({e.__class__.__name__}: {e}); "
                              f"{repair_command(path)}", path)


def delete(group: Any, path: str, *, metadata_only: bool) -> None:
    """Delete the node at ``path`` below ``group`` (nothing if absent): only its ``zarr.json`` (the chunks kept, to
    be re-created over) or everything under it; StoreError if the store cannot be written."""
    from zarr.core.sync import sync

    full = _full(group, path)
    try:
        if metadata_only:
            sync(group.store.delete(f"{full}/zarr.json"))
        else:
            sync(group.store.delete_dir(full))
    except OSError as e:
        raise StoreError(f"cannot delete {full} from the store: {e}") from None


def writable(arr: Any) -> Any:
    """The same zarr array, writing every chunk even when it equals the fill value (a missing file always means a
    lost chunk)."""
    return arr.with_config({"write_empty_chunks": True})


def _bounds(arr: Any, sel: Any) -> list[tuple[int, int]]:
    """``(start, stop)`` per axis of a selection of ``arr``: a slice or a tuple of slices (steps of 1)."""
    sel = sel if isinstance(sel, tuple) else (sel,)
    sel = sel + (slice(None),) * (len(arr.shape) - len(sel))
    return [s.indices(n)[:2] for s, n in zip(sel, arr.shape)]


def chunk_coords(arr: Any, sel: Any) -> list[tuple[int, ...]]:
    """The grid coordinates of the chunks that a selection (a slice or a tuple of slices) of zarr array ``arr``
    touches."""
    bounds = _bounds(arr, sel)
    if any(stop <= start for start, stop in bounds):
        return []
    return list(itertools.product(*(range(a // c, -(-b // c)) for (a, b), c in zip(bounds, arr.chunks))))


def fill_chunks(arr: Any, sel: Any, values: np.ndarray) -> list[tuple[int, ...]]:
    """Grid coordinates of the chunks of a selection ``sel`` of ``arr`` whose ``values`` (as read, before any
    decoding) are all the fill value: the only chunks that can be missing from the store."""
    bounds = _bounds(arr, sel)
    fill = arr.fill_value
    is_nan = isinstance(fill, float) and np.isnan(fill)
    out = []
    for coords in chunk_coords(arr, sel):
        region = tuple(slice(max(i * c, a) - a, min((i + 1) * c, b) - a)
                       for i, c, (a, b) in zip(coords, arr.chunks, bounds))
        part = values[region]
        first = part.flat[0] if part.size else fill
        if not (np.isnan(first) if is_nan else first == fill):  # the cheap test rules out nearly every chunk
            continue
        if (np.isnan(part).all() if is_nan else (part == fill).all()):
            out.append(coords)
    return out


def missing_chunks(arr: Any, sel: Any = slice(None), among: list[tuple[int, ...]] | None = None,
                   ) -> list[tuple[int, ...]]:
    """Grid coordinates of the chunks of a selection (or of the chunks ``among``) whose file is missing from the store;
    StoreError if the store cannot be listed."""
    from zarr.core.sync import sync

    coords = chunk_coords(arr, sel) if among is None else among
    if not coords:
        return []
    names = [f"{arr.path}/{arr.metadata.encode_chunk_key(c)}" for c in coords]

    async def exist() -> list[bool]:
        return list(await asyncio.gather(*(arr.store.exists(n) for n in names)))

    try:
        flags = sync(exist())
    except OSError as e:
        raise StoreError(f"cannot read the store array {arr.path}: {e}") from None
    return [c for c, ok in zip(coords, flags) if not ok]


def settle(timeout: float = 30.0) -> None:
    """Wait for the chunk reads zarr left running on its event loop after a failed read, so that none is destroyed
    pending (with asyncio warnings) at exit."""
    from zarr.core.sync import sync

    async def drain() -> None:
        me = asyncio.current_task()
        others = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        if others:
            await asyncio.wait(others, timeout=timeout)

    try:
        sync(drain())
    except Exception:  # noqa: BLE001 - best effort: the caller is already reporting an error
        pass


def _full(group: Any, path: str) -> str:
    return f"{group.path}/{path}" if group.path else path


def child_names(group: Any) -> list[str]:
    """Names of the entries below ``group`` in its store, whatever their metadata (the store's listing)."""
    from zarr.core.sync import collect_aiterator

    try:
        return sorted(n for n in collect_aiterator(group.store.list_dir(group.path)) if n != "zarr.json")
    except Exception:  # noqa: BLE001 - a listing that fails lists nothing; the reads that follow report it
        return []
