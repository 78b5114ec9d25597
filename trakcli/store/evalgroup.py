"""The store's ``eval/`` group: the retrained models of `trak eval` (masks and outputs per model).

It does not depend on the projector or the checkpoints: ``trak eval`` may create the store before ``trak featurize`` (a
root without an identity, which featurize then adopts), and ``featurize --overwrite`` keeps the group across the
re-creation of the store (:func:`eval_kept`, :func:`restore_eval`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trakcli import __version__
from trakcli.errors import StoreError, StoreMismatchError
from trakcli.store.integrity import StoreCorruptError, delete, node, writable
from trakcli.store.layout import check_same, jsonable
from trakcli.store.location import Location, entries, holds_objects, is_remote, replace, rmtree
from trakcli.store.rows import EvalRows, codecs, flag_array

if TYPE_CHECKING:
    from trakcli.store.store import Store


def eval_kept(path: Location) -> Location:
    """Where ``featurize --overwrite`` keeps the ``eval/`` group while it re-creates the store."""
    return path.with_name(f".{path.name}.eval-kept")


def restore_eval(path: Location) -> None:
    """Move a kept ``eval/`` group back into the store (also after a kill between the two moves)."""
    kept = eval_kept(path)
    if kept.is_dir() and not (path / "eval").exists() and (path / "zarr.json").exists():
        replace(kept, path / "eval")


#: The top-level groups of a store: a directory holding only these (and no root ``zarr.json``) is a
#: store whose root metadata was lost.
STORE_GROUPS = frozenset({"train", "targets", "scores", "eval"})


def headless_store(path: Location) -> bool:
    """Whether ``path`` is a directory holding store groups but no root ``zarr.json`` (its root metadata lost)."""
    try:
        names = set(entries(path))
    except OSError:
        return False
    return bool(names) and "zarr.json" not in names and names <= STORE_GROUPS and any(
        (path / n / "zarr.json").exists() or (path / n).is_dir() for n in names)


def being_deleted(path: Location) -> Location:
    """Where ``featurize --overwrite`` moves the old store before deleting it."""
    return path.with_name(f".{path.name}.deleting")


def remove_leftovers(path: Location) -> None:
    """Delete what a deletion killed midway left (:func:`being_deleted`); failures are ignored."""
    trash = being_deleted(path)
    if trash.exists():
        rmtree(trash, ignore_errors=True)


def delete_keeping_eval(path: Location) -> None:
    """Delete the store at ``path`` for ``featurize --overwrite``, its ``eval/`` group kept aside (:func:`eval_kept`)
    until :func:`restore_eval` moves it into the re-created store. The store is renamed out of the way
    (:func:`being_deleted`, atomic), then deleted; on an object store (no rename) its root ``zarr.json`` goes first.
    StoreError if ``path`` is a file, a directory but not a Zarr store, or cannot be deleted."""
    if path.exists() and not path.is_dir():
        raise StoreError(f"refusing to --overwrite {path}: it is a file, not a Zarr store; choose another store.path "
                         "or move the file away")
    if path.is_dir() and not ((path / "zarr.json").exists() or not holds_objects(path) or headless_store(path)):
        raise StoreError(f"refusing to --overwrite {path}: it is a directory but not a Zarr store; choose another "
                         "store path")
    try:
        if (path / "eval" / "zarr.json").exists():
            kept = eval_kept(path)
            if kept.exists():
                rmtree(kept)  # older than the store's own eval group
            replace(path / "eval", kept)
        if is_remote(path):
            if (path / "zarr.json").exists():
                (path / "zarr.json").unlink()
            rmtree(path)
            return
        remove_leftovers(path)
        trash = being_deleted(path)
        replace(path, trash)
        rmtree(trash)
    except OSError as e:
        raise StoreError(f"cannot delete {path} for --overwrite: {e}") from None


def open_eval_rows(store: "Store", identity: dict[str, Any], n_subsets: int, n_train: int, n_target: int, *,
                   compressor: str = "zstd", overwrite: bool = False, create: bool = True) -> EvalRows:
    """The ``eval/`` group of retrained models, created, checked or extended.

    Args:
        identity: everything the retrained models depend on (training recipe, model, train and target data
            fingerprints, task, subset_fraction, eval seed); compared with the stored one.
        n_subsets: rows wanted; a group with fewer rows is extended (rows done are kept), one with more keeps them.
        n_train, n_target: the row lengths of masks and outputs.
        compressor: codec of new arrays (each chunk also carries a CRC32C checksum).
        overwrite: discard the group and start over.
        create: whether a missing group may be created (False: read only).

    Raises:
        StoreMismatchError: the group was made with another identity (names the differing keys).
        StoreError: no group and ``create`` is False; the store cannot be written.
        StoreCorruptError: an array of the group is missing or its metadata unreadable.
    """
    identity = jsonable(identity)
    try:
        if overwrite:
            delete(store.root, "eval", metadata_only=False)  # also when its metadata is unreadable
        group = node(store.root, "eval")
        if group is not None:
            check_same(f"the retrained models in {store.path}/eval", group.attrs.get("identity"), identity,
                       "rerun `trak eval lds CONFIG --overwrite` to retrain them, or restore those settings")
        else:
            if not create:
                raise StoreError(f"store {store.path} holds no retrained models yet; run `trak eval lds CONFIG`")
            group = store.root.require_group("eval")
            array_codecs = codecs(compressor)
            group.create_array("masks", shape=(n_subsets, n_train), chunks=(1, n_train), dtype="bool",
                               fill_value=False, compressors=array_codecs, dimension_names=("subset", "train"))
            group.create_array("outputs", shape=(n_subsets, n_target), chunks=(1, n_target), dtype="float64",
                               fill_value=0.0, compressors=array_codecs, dimension_names=("subset", "target"))
            flag_array(group, "done", n_subsets, dim="subset")
            group.attrs.update({"identity": identity, "n_subsets": n_subsets, "trakcli_version": __version__})
        arrays = {}
        for name in ("masks", "outputs", "done"):
            arrays[name] = node(group, name)
            if arrays[name] is None:
                raise StoreCorruptError(f"store array eval/{name} is missing; rerun `trak eval lds CONFIG --overwrite` "
                                        "to retrain", f"eval/{name}")
        for name, width in (("masks", n_train), ("outputs", n_target)):
            if arrays[name].shape[1:] != (width,):
                raise StoreMismatchError(f"store array {arrays[name].path} has shape {list(arrays[name].shape)}, this "
                                         f"run needs rows of {width}; rerun `trak eval lds CONFIG --overwrite` to "
                                         "retrain")
        if create and arrays["done"].shape[0] < n_subsets:  # extend: done first grows last
            for arr in (arrays["masks"], arrays["outputs"], arrays["done"]):
                if arr.shape[0] < n_subsets:
                    arr.resize((n_subsets, *arr.shape[1:]))
            group.attrs["n_subsets"] = n_subsets
    except OSError as e:
        raise StoreError(f"cannot write the eval group of {store.path}: {e}") from None
    return EvalRows(writable(arrays["masks"]), writable(arrays["outputs"]), arrays["done"])
