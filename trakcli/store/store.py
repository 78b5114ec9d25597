"""The :class:`Store`: opening, creating and checking a trakcli Zarr store and its arrays.

An array is *finished* when every ``done`` flag of its group is set (a kernel: when its attributes, written last, are
there); every read of a finished array checks that it is finished, made from the store's current train rows, and not
damaged, and names the command that makes or repairs it. Layout and rules: the package docstring (:mod:`trakcli.store`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from trakcli import __version__
from trakcli.errors import Fix, StoreError
from trakcli.files import atomic_open
from trakcli.store.append import grow_if_appended, stale_error
from trakcli.store.bfloat16 import array_attrs, is_bfloat16, logical_dtype, storage_dtype
from trakcli.store.quantize import code_arrays, feature_dtype
from trakcli.store.evalgroup import delete_keeping_eval, headless_store, remove_leftovers, restore_eval
from trakcli.store.integrity import (
    StoreCorruptError, StoreMetadataError, delete, finishing_command, keys, node, repair_command, repair_scope,
    writable,
)
from trakcli.store.layout import LAYOUT_ATTR, StoreLayout, check_same, jsonable, mismatch
from trakcli.store.location import (
    Location, check_reachable, entries, holds_objects, is_remote, store_location, zarr_store,
)
from trakcli.store.rows import ChunkedRows, codecs, flag_array, read_checked

#: An array of a group: (shape, zarr dtype, chunk shape, dimension names).
Spec = tuple[tuple[int, ...], str, tuple[int, ...], tuple[str, ...]]

SCHEMA_VERSION = 2
"""The store layout this trakcli reads and writes; a store of any other version is refused."""


def _bare_root(path: Location) -> bool:
    """Whether ``path`` holds only a root ``zarr.json`` without attributes (a creation killed before its attributes)."""
    try:
        if entries(path) != ["zarr.json"]:
            return False
        meta = json.loads((path / "zarr.json").read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("node_type") == "group" and not meta.get("attributes")


def _missing(what: str, distributed: bool = False) -> str:
    """The message for a store array or group that is absent (or lost its ``zarr.json``) where it is only read;
    ``distributed``: read by a rank > 0 of a distributed featurize, which waits for rank 0 to create it."""
    return (f"{what} is missing (or its zarr.json metadata was deleted); rerun `trak featurize CONFIG`, which "
            "re-creates it and recomputes only chunks whose files are lost"
            + ("; rank 0 creates it before the other ranks read it: every rank must see the same store.path"
               if distributed else ""))


def _headless(path: Location) -> StoreError:
    """The error for a store directory holding store groups but no root ``zarr.json``."""
    return StoreError(f"{path} holds store groups ({', '.join(sorted(entries(path)))}) but no root metadata "
                      "(zarr.json): a store whose creation or deletion was interrupted; "
                      "rerun `trak featurize CONFIG --overwrite` to start over")


class Store:
    """A trakcli Zarr store on disk.

    Open with :meth:`create_or_check` (featurize) or :meth:`open_existing` (score, inspect).
    The shapes of the feature and score arrays come from :attr:`layout`.

    Attributes:
        notes: what this process repaired in the store (unreadable metadata
            re-created, a corrupt kernel dropped), one line each, for the job to report.
        distributed: set by a rank > 0 of a distributed featurize, which only reads what rank 0
            created: a missing array or group is then reported with rank 0's part in it.
    """

    def __init__(self, path: Location, group: Any):
        self.path = path
        self.root = group
        self._layout: StoreLayout | None = None  # told by create_or_check; the recorded attribute wins
        self.notes: list[str] = []
        self.distributed = False  # read by a rank > 0 of a distributed featurize (named in messages)

    # -- opening --------------------------------------------------------------

    @staticmethod
    def prepare_parent(path: Location) -> None:
        """Create the directory that will hold the store (and its lock file); on an object store, check that it answers
        and holds the bucket (:func:`trakcli.store.location.check_reachable`). StoreError if a path component is a
        file, or the directory is not writable; or the object store does not answer, refuses the credentials, or has
        no such bucket."""
        if is_remote(path):
            check_reachable(path)
            return
        probe = path.parent
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if not probe.is_dir():
            raise StoreError(f"cannot create the store at {path}: {probe} is a file, not a directory; choose another "
                             "store.path")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create the store at {path}: {e}; choose another store.path") from None
        if not os.access(path.parent, os.W_OK):
            raise StoreError(f"cannot create the store at {path}: {path.parent} is not writable; choose another "
                             "store.path")

    @classmethod
    def create_or_check(cls, path: str | Path, identity: dict[str, Any], config: dict[str, Any], layout: StoreLayout,
                        overwrite: bool = False, create: bool = True,
                        prefix: Callable[[int], dict[str, Any]] | None = None) -> "Store":
        """Open the store for featurizing, creating it or checking it was made the same way.

        Args:
            identity: everything the train features depend on (model, task, grad_wrt, projector spec,
                grad_dim, train data fingerprint, chunking and storage); recorded and compared as a whole.
            config: the resolved config, recorded in the attributes.
            layout: the shapes and storage of the arrays, recorded in the root attribute ``layout`` and checked.
            overwrite: delete an existing store first.
            create: whether this process may create it (False on ranks > 0).
            prefix: the fingerprint of the first ``n`` rows of this run's train data: given, a store
                whose train rows this run's extend (the same first rows, more after them) is grown
                to them instead of refused (:func:`trakcli.store.append.grow_if_appended`).

        Raises:
            StoreMismatchError: the store exists with a different identity or layout (names the keys),
                or this run's train rows extend the store's but its old rows differ.
            StoreError: the path cannot be created or is not a trakcli store.
        """
        path = store_location(path)
        identity = jsonable(identity)
        attrs = {"identity": identity, "config": jsonable(config), LAYOUT_ATTR: layout.to_attrs()}
        if create:
            remove_leftovers(path)
            if _bare_root(path):  # a root created without its attributes (and nothing else): never a store
                (path / "zarr.json").unlink()
        if overwrite and create and path.exists():
            delete_keeping_eval(path)
        if cls.exists(path):
            store = cls.open_existing(path)
            if create:
                restore_eval(path)
            old = store.root.attrs.get("identity")
            if old is None and create and "train" not in store.root:
                # made by `trak eval` (retraining only): this run gives it its identity
                try:
                    store.root.attrs.update(attrs)
                except OSError as e:
                    raise StoreError(f"cannot write the attributes of {path}: {e}") from None
                return store
            fix = Fix("start_over_or_new_path", store=str(path))
            if create and prefix is not None and grow_if_appended(store, identity, layout, prefix):
                old = store.root.attrs.get("identity")
            check_same(f"the contents of store {path}", old, identity, fix)
            check_same(f"the arrays of store {path}", store.root.attrs.get(LAYOUT_ATTR), jsonable(layout.to_attrs()),
                       fix)
            store._layout = layout
            return store
        if not create:
            raise StoreError(f"no trakcli store at {path}")
        store = cls._create_root(path, attrs)
        store._layout = layout
        return store

    @classmethod
    def _create_root(cls, path: Location, attrs: dict[str, Any]) -> "Store":
        """Create a new store at ``path`` (absent or an empty directory; else StoreError) with ``attrs``, version
        and date."""
        if headless_store(path):
            raise _headless(path)
        if holds_objects(path):
            raise StoreError(f"{path} exists and is not a trakcli store; choose another store path or remove it")
        cls.prepare_parent(path)
        try:
            import zarr

            # the root's metadata and its attributes in one (atomic) write: a store is whole or absent
            attrs = {"schema_version": SCHEMA_VERSION, "trakcli_version": __version__, **attrs,
                     "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            group = zarr.create_group(store=zarr_store(path), zarr_format=3, overwrite=path.exists(), attributes=attrs)
        except OSError as e:
            raise StoreError(f"cannot create the store at {path}: {e}; choose a writable store path") from None
        restore_eval(path)
        return cls(path, group)

    @staticmethod
    def exists(path: str | Path) -> bool:
        """Whether ``path`` (a directory, or an object-store URL) holds a store's root metadata."""
        return (store_location(path) / "zarr.json").exists()

    @classmethod
    def open_or_create(cls, path: str | Path) -> "Store":
        """Open a store, or create an empty one without an identity (for `trak eval` before featurize, which adopts
        it: :meth:`create_or_check`); StoreError if the path cannot be created, or is not a trakcli store."""
        path = store_location(path)
        if cls.exists(path):
            store = cls.open_existing(path)
            restore_eval(path)
            return store
        return cls._create_root(path, {})

    @classmethod
    def open_existing(cls, path: str | Path, mode: str = "r+") -> "Store":
        """Open a store that must exist; StoreError for a missing path, not a Zarr group, or an unknown schema
        version."""
        path = store_location(path)
        if not cls.exists(path):
            if headless_store(path):
                raise _headless(path)
            raise StoreError(f"no trakcli store at {path}; run `trak featurize CONFIG` first")
        try:
            import zarr  # on the first open: importing this module does not import zarr

            group = zarr.open_group(store=zarr_store(path, read_only=mode == "r"), mode=mode, zarr_format=3)
        except Exception as e:  # noqa: BLE001 - a garbage zarr.json raises JSON, value or key errors
            raise StoreMetadataError(f"cannot open the store at {path}: its metadata {path}/zarr.json is "
                                     f"unreadable ({e.__class__.__name__}: {e}); the store's identity is "
                                     "lost: rerun `trak featurize CONFIG --overwrite` to start over") from None
        version = group.attrs.get("schema_version")
        if version is None and not dict(group.attrs):
            fix = ("rerun `trak featurize CONFIG`, which creates it" if _bare_root(path)
                   else "rerun `trak featurize CONFIG --overwrite` to start over")
            raise StoreError(f"store {path} is incomplete: its creation was interrupted before its attributes were "
                             f"written; {fix}")
        if version != SCHEMA_VERSION:
            raise StoreError(f"store {path} has schema_version {version!r}, this trakcli ({__version__}) reads "
                             f"schema_version {SCHEMA_VERSION}; re-featurize it: `trak featurize CONFIG --overwrite`")
        return cls(path, group)

    @property
    def identity(self) -> dict[str, Any]:
        """The run identity recorded at creation (``{}`` for a store made by `trak eval` before featurize)."""
        return dict(self.root.attrs.get("identity", {}))

    @property
    def layout(self) -> StoreLayout:
        """The shapes and storage of the feature and score arrays: the root attribute ``layout`` if recorded, else the
        one :meth:`create_or_check` was given; StoreError if neither is (no train features yet) or it is damaged."""
        recorded = self.root.attrs.get(LAYOUT_ATTR)
        if recorded is not None:
            return StoreLayout.from_attrs(recorded, str(self.path))
        if self._layout is not None:
            return self._layout
        raise StoreError(f"store {self.path} holds no train features yet; run `trak featurize CONFIG` first")

    # -- arrays ---------------------------------------------------------------

    def _node(self, path: str, repair: bool = False) -> Any | None:
        """The array or group at ``path`` (None if absent); an unreadable ``zarr.json`` on the way raises
        StoreMetadataError, or with ``repair`` is deleted (with the node, :func:`repair_scope`) and noted, and the
        node reads as absent so that the caller re-creates it."""
        for _ in range(path.count("/") + 2):
            try:
                return node(self.root, path)
            except StoreMetadataError as e:
                if not repair:
                    raise
                whole = repair_scope(e.array) == "node"
                delete(self.root, e.array, metadata_only=not whole)
                self.notes.append(f"{e.array}: its metadata (zarr.json) was unreadable; " + (
                    "it is recomputed" if whole else "re-created, its chunks are verified by their checksums"))
        return node(self.root, path)

    def _arrays(self, group: Any, arrays: dict[str, Spec], n_chunks: int, create: bool, repair: bool = False,
                compressors: dict[str, str] | None = None) -> tuple[dict[str, Any], Any]:
        """The ``arrays`` (name -> shape, dtype, chunks, dimension names) of ``group`` and its ``done`` flags (created
        when absent and ``create``), compressed with the store's compressor unless ``compressors`` names another."""
        data = {}
        recreated = []  # arrays created now beside an existing done array: their done chunks must be checked
        for name, (shape, dtype, chunks, dims) in arrays.items():
            noted = len(self.notes)
            arr = self._node(f"{group.path}/{name}", repair and create)
            if arr is None and create and len(self.notes) == noted:
                recreated.append(name)
            if arr is not None:
                held = "bfloat16" if is_bfloat16(arr) else str(arr.dtype)
                if tuple(arr.shape) != shape or str(arr.dtype) != storage_dtype(dtype) or held != dtype:
                    differs = (f"has shape {list(arr.shape)}, this run needs {list(shape)}" if tuple(arr.shape) != shape
                               else f"holds {held}, this run stores {dtype}")
                    raise mismatch(f"store array {arr.path} {differs}; ", Fix("start_over", store=str(self.path)))
            elif create:
                arr = group.create_array(name, shape=shape, chunks=chunks, dtype=storage_dtype(dtype), fill_value=0,
                                         compressors=codecs((compressors or {}).get(name, self.layout.compressor)),
                                         dimension_names=dims, attributes=array_attrs(dtype))
            else:
                raise StoreError(_missing(f"store array {group.path}/{name}", self.distributed))
            data[name] = writable(arr)
        done = self._node(f"{group.path}/done", repair and create)
        if done is None and create:
            done = flag_array(group, "done", n_chunks)
        elif done is None:
            raise StoreError(_missing(f"store array {group.path}/done", self.distributed))
        elif recreated:
            self._recheck(group.path, {n: data[n] for n in recreated}, done, arrays[recreated[0]])
        return data, done

    def _recheck(self, group: str, arrays: dict[str, Any], done: Any, first: Spec) -> None:
        """Clear the done flags of chunks whose files are missing from ``arrays``, re-created (same shape and codecs,
        ``first`` the spec of the first) over their chunk files after their metadata was lost; a note names each."""
        if not done.shape[0]:
            return
        axis = 1 if group.startswith("scores/") and next(iter(arrays)) == "scores" else 0
        rows = ChunkedRows(arrays, done, first[2][axis], first[0][axis], axis)
        flags = rows.flags(marked=False)
        if not flags.any():
            return
        bad = sorted({c for lost in rows.damaged(read=False, flags=flags).values() for c in lost})
        if bad:
            rows.unmark()
        for c in bad:
            done[c] = 0
        for name in arrays:
            self.notes.append(f"{group}/{name}: its metadata (zarr.json) was missing; re-created over its chunk files"
                              + (f", done chunks {bad[:10]} without their files are recomputed" if bad else ""))

    def _group(self, name: str, create: bool = True, repair: bool = False, attrs: dict[str, Any] | None = None) -> Any:
        """The group at ``name``; if absent and ``create``, created with ``attrs`` in the same (atomic) metadata write
        (a leftover directory whose records cannot be re-derived deleted first); else StoreError."""
        group = self._node(name, repair and create)
        if group is not None:
            return group
        if not create:
            raise StoreError(_missing(f"store group {name}", self.distributed))
        leftover = self.path / name
        if leftover.is_dir() and any(leftover.iterdir()) and repair_scope(name) == "node":
            # contents without the group's metadata, whose records (a checkpoint's sha256, an experiment's
            # settings) are lost with it: nothing in it can be trusted, it is computed again
            delete(self.root, name, metadata_only=False)
            self.notes.append(f"{name}: its metadata (zarr.json) was missing; it is recomputed")
        try:
            return self.root.create_group(name, attributes=jsonable(attrs or {}))
        except OSError as e:
            raise StoreError(f"cannot write group {name} in {self.path}: {e}") from None

    def model_ids(self) -> list[int]:
        """model_ids with a train group, sorted."""
        train = node(self.root, "train")
        return [] if train is None else sorted(int(k) for k in keys(train) if k.isdigit())

    def train(self, model_id: int, checkpoint: str | None = None, sha256: str | None = None, create: bool = True,
              repair: bool = False, optimizer_state: tuple[str, str] | None = None) -> ChunkedRows:
        """Train features of one checkpoint (created if absent and ``create``).

        Args:
            checkpoint, sha256: recorded on creation and checked against the store.
            optimizer_state: ``(path, sha256)`` of the checkpoint's optimizer state file when the features carry
                the second-moment correction: recorded and checked like the checkpoint's.
            create: whether this process may create arrays and attributes (rank 0).
            repair: re-create unreadable metadata (``featurize --verify``, with ``create``); the caller then
                verifies the chunks.

        Raises:
            StoreMismatchError: the store holds this model_id from a file (checkpoint or optimizer
                state) with another sha256.
            StoreMetadataError: unreadable metadata (without ``repair``).
        """
        layout = self.layout
        n_train, proj_dim, rows = layout.n_train, layout.proj_dim, layout.chunk_rows
        record = {"checkpoint": str(checkpoint), "sha256": sha256} if sha256 is not None else None
        if record is not None and optimizer_state is not None:
            record.update(optimizer_state=optimizer_state[0], optimizer_state_sha256=optimizer_state[1])
        group = self._group(f"train/{model_id}", create, repair, attrs=record)
        if sha256 is not None:
            old = group.attrs.get("sha256")
            if old is not None and old != sha256 and create and self._nothing_done(f"train/{model_id}"):
                # nothing computed from the recorded checkpoint (a run that failed on it, e.g. a truncated
                # file): the model_id is bound to this run's checkpoint instead
                self.notes.append(f"model_id {model_id}: no features were computed from "
                                  f"{group.attrs.get('checkpoint')} (sha256 {old[:12]}); it now takes {checkpoint} "
                                  f"(sha256 {sha256[:12]})")
                progress = self._node(f"train/{model_id}/rows_done")  # rows of the old checkpoint: before it is rebound
                if progress is not None and progress.shape[0]:
                    progress[:] = np.zeros(progress.shape[0], dtype=np.int32)
                old = None
            if old is None and create:
                group.attrs.update(record)
            # featurize starts over with --overwrite; a reader (trak score) cannot: the features must be remade
            fix = (Fix("start_over", store=str(self.path)) if create else
                   "restore the checkpoint (and optimizer state) the store was featurized with, or featurize again "
                   "with `trak featurize CONFIG --overwrite`")
            if old is not None and old != sha256:
                raise mismatch(f"model_id {model_id}: the store's features come from {group.attrs.get('checkpoint')} "
                               f"(sha256 {old[:12]}), this run's checkpoint {checkpoint} has sha256 "
                               f"{sha256[:12]}; ", fix)
            was = group.attrs.get("optimizer_state_sha256")
            if old is not None and optimizer_state is not None and was != optimizer_state[1]:
                raise mismatch(f"model_id {model_id}: the store's features were corrected with the optimizer state "
                               f"{group.attrs.get('optimizer_state')} (sha256 {str(was)[:12]}), this run's "
                               f"{optimizer_state[0]} has sha256 {optimizer_state[1][:12]}; ", fix)
        codes = code_arrays(layout.dtype, n_train, proj_dim)
        # the float copy and the codes uncompressed, read straight from their files by a scan (trakcli.store.chunkread);
        # a float copy of an earlier layout may be compressed: a repair keeps it so
        plain = {}
        if codes and not ("features" in group and _compressed(group["features"])):
            plain = {"features": "none", "codes": "none"}
        arrays: dict[str, Spec] = {
            "features": ((n_train, proj_dim), feature_dtype(layout.dtype), (rows, proj_dim), ("train", "proj")),
            "out_to_loss": ((n_train,), "float32", (rows,), ("train",)),
            "nonfinite": ((n_train,), "uint8", (rows,), ("train",)),
        }
        for name, (shape, dtype) in codes.items():  # int8 / binary stores: codes and scales (trakcli.store.quantize)
            arrays[name] = (shape, dtype, (rows, *shape[1:]), ("train", "code")[:len(shape)])
        data, done = self._arrays(group, arrays, -(-n_train // rows), create, repair, compressors=plain)
        progress = self._rows_done(group, done.shape[0], create, repair)
        return ChunkedRows(data, done, rows, n_train, progress=progress)

    def _rows_done(self, group: Any, n_chunks: int, create: bool, repair: bool) -> Any | None:
        """The ``[n_chunks]`` int32 ``rows_done`` counts of a train group (:meth:`ChunkedRows.write_partial`), created
        when absent and ``create``; None when absent and not ``create`` (no partial progress)."""
        arr = self._node(f"{group.path}/rows_done", repair and create)
        if arr is None and create:
            arr = flag_array(group, "rows_done", n_chunks, "int32")
        if arr is not None and tuple(arr.shape) != (n_chunks,):  # an append resized done and not this yet
            if not create:
                return None
            arr.resize((n_chunks,))
        return arr

    def _nothing_done(self, group: str) -> bool:
        """Whether no chunk of ``group`` is done (no ``done`` array, or every flag 0) and it has no kernel."""
        done = self._node(f"{group}/done")
        if self._node(f"{group}/kernel") is not None:
            return False
        if done is None:
            return True
        try:
            return not np.asarray(done[:]).any()
        except Exception:  # noqa: BLE001 - unreadable flags: not provably empty
            return False

    def targets(self, experiment: str, model_id: int, attrs: dict[str, Any], n_target: int, create: bool = True,
                repair: bool = False) -> ChunkedRows:
        """Target features ``[n_target, proj_dim]`` of one experiment and checkpoint (created if absent and
        ``create``; ``repair``: unreadable metadata re-created). ``attrs``: what they depend on (target data
        fingerprint, checkpoint sha256s), recorded or checked: StoreMismatchError if the experiment differs."""
        layout = self.layout
        proj_dim, rows = layout.proj_dim, layout.chunk_rows
        self._experiment_group("targets", experiment, attrs, create, repair)
        group = self._group(f"targets/{experiment}/{model_id}", create, repair)
        # fewer targets than a chunk: one chunk of n_target rows, not a padded one
        spec = ((n_target, proj_dim), feature_dtype(layout.dtype), (min(rows, n_target), proj_dim), ("target", "proj"))
        data, done = self._arrays(group, {"features": spec}, -(-n_target // rows), create, repair)
        return ChunkedRows(data, done, rows, n_target)

    def scores(self, experiment: str, n_target: int, settings: dict[str, Any], create: bool = True,
               repair: bool = False) -> ChunkedRows:
        """The ``[n_target, n_train]`` score matrix of an experiment, chunked by train columns; StoreMismatchError if
        the experiment was scored with other settings."""
        n_train, cols = self.layout.n_train, self.layout.chunk_rows
        group = self._experiment_group("scores", experiment, settings, create, repair)
        t_rows = min(n_target, max(1, (8 << 20) // (4 * cols)))  # ~8 MB chunks
        spec = ((n_target, n_train), "float32", (t_rows, cols), ("target", "train"))
        data, done = self._arrays(group, {"scores": spec}, -(-n_train // cols), create, repair)
        return ChunkedRows(data, done, cols, n_train, axis=1)

    def score_settings(self, experiment: str, settings: dict[str, Any], create: bool = True,
                       repair: bool = False) -> None:
        """Record (or check) the settings of an experiment's scores without creating the score matrix;
        StoreMismatchError if the experiment was scored with other settings."""
        self._experiment_group("scores", experiment, settings, create, repair)

    def sized_rows(self, name: str, sizes: dict[str, int], arrays: dict[str, Spec], n_rows: int, chunk_rows: int,
                   create: bool = True, repair: bool = False) -> ChunkedRows:
        """The ``arrays`` (name -> shape, zarr dtype, chunk shape, dimension names) of the derived group ``name``
        (each job declares its own), ``n_rows`` entries along their first axis in chunks of ``chunk_rows``, with a
        done flag per chunk. ``sizes``: what their shapes depend on (``{"k": 100}``), recorded on creation and
        checked on open (StoreMismatchError naming ``--overwrite``)."""
        group = self._node(name, repair and create)
        if group is not None:
            check_same(f"{name} in {self.path}", {a: group.attrs.get(a) for a in sizes}, sizes,
                       Fix("recompute_scores", store=str(self.path)))
        else:
            group = self._group(name, create, attrs=sizes)
        data, done = self._arrays(group, arrays, -(-n_rows // chunk_rows), create, repair)
        return ChunkedRows(data, done, chunk_rows, n_rows)

    def _experiment_group(self, kind: str, experiment: str, attrs: dict[str, Any], create: bool, repair: bool) -> Any:
        name = f"{kind}/{experiment}"
        attrs = jsonable(attrs)
        group = self._node(name, repair and create)
        if group is not None and create and not any(k in group.attrs for k in attrs):
            # a group without any of its records (made by a run killed before writing them): nothing in it is
            # known to come from these settings; it is computed again
            self.drop(name)
            self.notes.append(f"{name}: its settings were never recorded (an interrupted run); it is recomputed")
            group = None
        if group is not None:
            check_same(f"{kind} of experiment {experiment!r} in {self.path}", {k: group.attrs.get(k) for k in attrs},
                       attrs, Fix("recompute_experiment", store=str(self.path)))
            return group
        return self._group(name, create, attrs=attrs)

    def drop(self, name: str) -> None:
        """Delete a group or array and everything under it (``--overwrite`` of derived data), even if unreadable."""
        delete(self.root, name, metadata_only=False)

    # -- finished arrays: checked reads and export ------------------------------

    def array(self, name: str) -> Any:
        """The zarr array at ``name`` (e.g. ``train/0/features``, ``scores/default/scores``).

        Raises:
            StoreError: no such array (lists what the store holds).
            StoreMetadataError: its ``zarr.json`` is unreadable (names the repair).
        """
        arr = node(self.root, name)
        if arr is None or not hasattr(arr, "shape"):
            have = [f"train/{m}/features" for m in self.model_ids()]
            scores = node(self.root, "scores")
            if scores is not None:
                for e in keys(scores):
                    have += [f"scores/{e}/{a}" for a in ("scores", "top_k") if node(scores, f"{e}/{a}") is not None]
            if node(self.root, "eval") is not None:
                have += ["eval/masks", "eval/outputs"]
            raise StoreError(f"store {self.path} has no array {name!r}; it holds {', '.join(have) or 'nothing yet'}")
        return arr

    def _finished(self, name: str) -> tuple[Any, bool]:
        """The array ``name`` once it is fresh (no scores from before an append), finished and made from the
        store's train features; and whether its chunks must all have files."""
        arr = self.array(name)
        parts = name.split("/")
        stale = stale_error(self, parts[1]) if len(parts) > 2 and parts[0] == "scores" else None
        if stale is not None:
            raise stale
        stored = self._check_finished(name, arr)
        self._check_sources(name)
        return arr, stored

    def _check_finished(self, name: str, arr: Any) -> bool:
        """Refuse an array with chunks not computed yet (naming how many, the first ones and the command that
        finishes them: StoreError); returns whether its chunks must all have files."""
        parts = name.split("/")
        leaf = parts[-1]
        if leaf == "done":
            return False  # flags: a missing chunk is a flag not set
        if leaf == "kernel":
            if "lambda_reg" not in arr.attrs:
                raise StoreError(f"store array {name} in {self.path} is unfinished (its kernel was never completed); "
                                 f"run {finishing_command(name)} to compute it")
            return True
        done = node(self.root, "/".join(parts[:-1] + ["done"]))
        if done is None:
            return True
        flags = read_checked(done, slice(None), 0, stored=False)
        pending = np.flatnonzero(flags == 0)
        if pending.size:
            unit = "column blocks" if parts[0] == "scores" else ("rows" if parts[0] == "eval" else "row chunks")
            first = ", ".join(str(int(c)) for c in pending[:10]) + (", ..." if pending.size > 10 else "")
            raise StoreError(f"store array {name} in {self.path} is unfinished: {pending.size} of {flags.size} {unit} "
                             f"are not computed yet ({first}); run {finishing_command(name)} to finish them")
        return True

    def _check_sources(self, name: str) -> None:
        """Refuse (StoreCorruptError) an array of ``targets/<experiment>`` or ``scores/<experiment>`` when a
        ``train/<m>`` of the checkpoints it records (their sha256) is missing or holds another checkpoint's features."""
        parts = name.split("/")
        if len(parts) < 2 or parts[0] not in ("targets", "scores"):
            return
        exp = "/".join(parts[:2])
        group = node(self.root, exp)
        recorded = group.attrs.get("checkpoints") if group is not None else None
        for m, sha in enumerate(recorded if isinstance(recorded, list) else []):
            train = node(self.root, f"train/{m}")
            if train is None:
                raise StoreCorruptError(f"{exp} in {self.path} was made with the train features of model_id {m}, but "
                                        f"store group train/{m} is missing; {repair_command(f'train/{m}')}",
                                        f"train/{m}")
            if train.attrs.get("sha256") != sha:
                raise StoreCorruptError(f"{exp} in {self.path} was made from checkpoint sha256 {str(sha)[:12]} for "
                                        f"model_id {m}, but train/{m} holds the features of sha256 "
                                        f"{str(train.attrs.get('sha256'))[:12]}; {repair_command(exp)}", exp)

    def read(self, name: str, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Rows ``[lo, hi)`` (axis 0) of the finished array ``name``, every chunk checked.

        In the array's dtype; float32 for bfloat16 features (:mod:`trakcli.store.bfloat16`).

        Raises:
            StoreError: no such array, or an unfinished one (names the command that finishes it).
            StoreCorruptError: a chunk is missing or fails its checksum, or the train features an
                experiment's array was made from are gone (:meth:`_check_sources`); names the repair.
            StoreStaleError: an experiment's scores made before train rows were appended (names the rescore).
        """
        arr, stored = self._finished(name)
        return read_checked(arr, slice(lo, hi), 0, stored=stored)

    def read_scores(self, experiment: str) -> tuple[np.ndarray, dict[str, Any]]:
        """The finished score matrix of an experiment and the attributes it was made with."""
        name = f"scores/{experiment}"
        group = node(self.root, name)
        if group is not None and node(group, "scores") is None and node(group, "top_k") is not None:
            raise StoreError(f"experiment {experiment!r} in {self.path} holds only its top-k (score.top_k), not the "
                             "full score matrix this needs; run `trak score CONFIG score.full=true`")
        if group is None or node(group, "scores") is None:
            raise StoreError(f"store {self.path} holds no scores of experiment {experiment!r} (score.experiment); "
                             "run `trak featurize CONFIG` and `trak score CONFIG` first")
        return self.read(f"{name}/scores"), dict(group.attrs)

    def export(self, name: str, out: Path, row_block: int = 4096) -> tuple[int, ...]:
        """Stream the finished array ``name`` to ``out`` (.npy, or .csv for 1-D/2-D) block by block, through a
        temporary file renamed into place (a failure leaves an existing ``out`` as it was). The .npy file has the
        array's dtype; bfloat16 features are written as float32 (the same numbers, at twice the bytes).

        Returns:
            The exported shape.

        Raises:
            StoreError: unknown or unfinished array (names the command that finishes it), unwritable output.
            StoreCorruptError: a chunk is missing or fails its checksum, or (scores, target features) the
                train features they were made from are gone (:meth:`_check_sources`); names the repair.
            StoreStaleError: an experiment's scores made before train rows were appended (names the rescore).
        """
        arr, stored = self._finished(name)
        shape = tuple(int(n) for n in arr.shape)
        dtype = np.dtype(logical_dtype(arr))  # bfloat16 bits: float32 (numpy has no bfloat16)
        kept = f"; {out} is unchanged" if out.exists() else f"; nothing was written to {out}"

        def blocks():
            for lo in range(0, shape[0], row_block):
                yield read_checked(arr, slice(lo, lo + row_block), 0, stored=stored)

        try:
            if out.suffix.lower() == ".npy":
                with atomic_open(out, "wb") as f:
                    np.lib.format.write_array_header_1_0(  # a plain dtype and shape: far below 1.0's 64 KiB
                        f, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape})
                    for block in blocks():
                        f.write(np.ascontiguousarray(block, dtype=dtype).tobytes())
            else:
                with atomic_open(out, "w") as f:
                    for block in blocks():
                        np.savetxt(f, block.reshape(block.shape[0], -1), delimiter=",", fmt="%.7g")
        except StoreCorruptError as e:
            raise StoreCorruptError(f"{e}{kept}", e.array, e.chunks) from None
        except OSError as e:
            raise StoreError(f"cannot write {out}: {e}{kept}") from None
        return shape


def _compressed(arr: Any) -> bool:
    """Whether a zarr array's chunks are compressed (a codec beside the bytes and the checksum)."""
    return any(type(c).__name__ not in ("BytesCodec", "Crc32cCodec") for c in getattr(arr.metadata, "codecs", ()))
