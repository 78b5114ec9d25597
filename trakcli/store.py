"""The Zarr v3 store: layout, resume, locking, provenance, checksums, export.

The only module that imports zarr. Layout (design.md, "Store layout")::

    <store>.zarr/                  attrs: schema_version, trakcli_version, config (resolved),
                                   identity (everything the train features depend on)
      train/<model_id>/            attrs: checkpoint, sha256
        features    [n_train, proj_dim] float32 (or float16), chunked by rows
        out_to_loss [n_train]           float32
        nonfinite   [n_train]           uint8, 1 = skipped (--skip-nonfinite), features zero
        done        [n_row_chunks]      uint8, set after the chunk's data is written
        kernel      [proj_dim, proj_dim] float64 lower Cholesky factor of ΦᵀΦ + λI;
                                        its attrs (lambda_reg, settings) are written last
      targets/<experiment>/        attrs: target data fingerprint, checkpoints (sha256 per model_id)
        <model_id>/features [n_target, proj_dim], done [n_target_chunks]
      scores/<experiment>/         attrs: lambda settings, checkpoints, target data
        scores [n_target, n_train] float32, chunked by train rows (columns);
        done   [n_train_chunks]    one flag per column block
      eval/                        attrs: identity (training recipe, model, train and target
                                   data, task, subset_fraction, eval seed), n_subsets
        masks   [n_subsets, n_train]  bool, the training rows of retrained model k
        outputs [n_subsets, n_target] float64, the targets' model outputs (margins) under model k
        done    [n_subsets]           uint8, set after row k of masks and outputs
    <store>.zarr.lock              JSON {host, pid, started}: the run using the store

Rules: a chunk's data is written before its ``done`` flag; a resumed run
recomputes only chunks not done; a run whose identity differs from the
store's refuses (naming the differing keys) unless ``overwrite``. Every chunk
carries a CRC32C checksum, so a corrupt or truncated chunk is reported with
its array and chunk index instead of being read as wrong numbers. Arrays are
written from numpy, never from torch tensors. Parallel writers (torchrun
ranks) write disjoint chunks; ``done`` has one chunk per flag so flags of
different writers never share a file, and attributes are written by rank 0.

The ``eval/`` group (`trak eval`'s counterfactual retraining) does not depend
on the projector or the checkpoints: ``trak eval`` may create the store before
``trak featurize`` (a root without an identity, which featurize then adopts),
and ``featurize --overwrite`` keeps it across the re-creation of the store.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from trakcli import __version__
from trakcli.errors import StoreError, StoreMismatchError

SCHEMA_VERSION = 1

STORAGE_DTYPES = ("float32", "float16")
COMPRESSORS = ("zstd", "blosc", "none")


class StoreCorruptError(StoreError):
    """A chunk failed its checksum or could not be decoded."""


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def jsonable(d: Any) -> Any:
    """``d`` round-tripped through JSON (what zarr attributes hold)."""
    return json.loads(json.dumps(d, default=str))


_UNSET = object()


def diff_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable lines ``key: store has X, this run has Y`` for differing leaves."""
    a, b = _flatten(jsonable(old)), _flatten(jsonable(new))
    show = lambda v: "<unset>" if v is _UNSET else repr(v)  # noqa: E731
    return [
        f"{k}: store has {show(a.get(k, _UNSET))}, this run has {show(b.get(k, _UNSET))}"
        for k in sorted(set(a) | set(b))
        if a.get(k, _UNSET) != b.get(k, _UNSET)
    ]


def settings_mismatch(what: str, old: dict[str, Any] | None, new: dict[str, Any], fix: str) -> StoreMismatchError:
    """The error for stored data made with other settings: ``what`` differs, key by key, and ``fix``."""
    lines = diff_keys(old or {}, new) or ["(identity differs)"]
    return StoreMismatchError(f"{what} were made with different settings:\n  " + "\n  ".join(lines) + f"\n{fix}")


def _codecs(compressor: str) -> list[Any]:
    base = {"zstd": [ZstdCodec(level=3)], "blosc": [BloscCodec(cname="zstd", clevel=3)], "none": []}[compressor]
    return [*base, Crc32cCodec()]


# ----------------------------------------------------------------------------
# the lock


@dataclass
class StoreLock:
    """An exclusive lock file ``<store>.lock`` naming the host and pid of the run.

    A lock left by a killed run on this host (its pid no longer alive) is
    stale and taken over. A lock held by a live process, or by another host,
    refuses the second run.
    """

    path: Path
    held: bool = False

    @staticmethod
    def for_store(store_path: Path) -> "StoreLock":
        return StoreLock(store_path.with_name(store_path.name + ".lock"))

    def acquire(self) -> str | None:
        """Take the lock; returns a message if a stale lock was taken over.

        Raises:
            StoreError: another live run holds the lock (names its host and pid).
        """
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        note = None
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                other = self._read()
                if other is None:  # being written right now, or empty: retry shortly
                    time.sleep(0.05)
                    other = self._read()
                if other is not None and not self._is_stale(other):
                    raise StoreError(
                        f"store {self.path.with_suffix('')} is in use by another run (host {other.get('host')}, "
                        f"pid {other.get('pid')}); wait for it to finish, or if that run is gone delete {self.path}"
                    )
                note = (
                    f"took over a stale lock of a run that is gone (host {other.get('host') if other else '?'}, "
                    f"pid {other.get('pid') if other else '?'})"
                )
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass
                continue
            except OSError as e:
                raise StoreError(f"cannot create the lock file {self.path}: {e}; choose a writable store path") from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return note
        raise StoreError(f"could not take the lock {self.path}; another run keeps taking it")

    def _read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    @staticmethod
    def _is_stale(other: dict[str, Any]) -> bool:
        if other.get("host") != socket.gethostname():
            return False  # cannot tell whether a process on another host lives
        pid = other.get("pid")
        if not isinstance(pid, int):
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def release(self) -> None:
        if self.held:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            self.held = False


# ----------------------------------------------------------------------------
# row-chunked arrays


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
        return _read_checked(self.done, slice(None), 0)

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
        return _read_checked(self.data[name], sel, self.axis, self.chunk_rows)

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


def _read_checked(arr: Any, sel: Any, axis: int, chunk: int | None = None) -> np.ndarray:
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
        return _read_checked(self.done, slice(None), 0)

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
                _read_checked(self.masks, slice(int(k), int(k) + 1), 0)
                _read_checked(self.outputs, slice(int(k), int(k) + 1), 0)
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
            _read_checked(self.masks, slice(0, n), 0, 1).astype(bool, copy=False),
            _read_checked(self.outputs, slice(0, n), 0, 1).astype(np.float64, copy=False),
        )


def _eval_kept(path: Path) -> Path:
    """Where ``featurize --overwrite`` keeps the ``eval/`` group while it re-creates the store."""
    return path.with_name(f".{path.name}.eval-kept")


def _restore_eval(path: Path) -> None:
    """Move a kept ``eval/`` group back into the store (also after a kill between the two moves)."""
    kept = _eval_kept(path)
    if kept.is_dir() and not (path / "eval").exists() and (path / "zarr.json").exists():
        os.replace(kept, path / "eval")


# ----------------------------------------------------------------------------
# the store


class Store:
    """A trakcli Zarr store on disk.

    Open with :meth:`create_or_check` (featurize) or :meth:`open_existing` (score, inspect).
    """

    def __init__(self, path: Path, group: Any):
        self.path = path
        self.root = group

    # -- opening --------------------------------------------------------------

    @staticmethod
    def prepare_parent(path: Path) -> None:
        """Create the directory that will hold the store (and its lock file).

        Raises:
            StoreError: a path component is a file, or the directory is not writable.
        """
        probe = path.parent
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if not probe.is_dir():
            raise StoreError(
                f"cannot create the store at {path}: {probe} is a file, not a directory; choose another store.path"
            )
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create the store at {path}: {e}; choose another store.path") from None
        if not os.access(path.parent, os.W_OK):
            raise StoreError(
                f"cannot create the store at {path}: {path.parent} is not writable; choose another store.path"
            )

    @classmethod
    def create_or_check(
        cls,
        path: str | Path,
        identity: dict[str, Any],
        config: dict[str, Any],
        overwrite: bool = False,
        create: bool = True,
    ) -> "Store":
        """Open the store for featurizing, creating it or checking it was made the same way.

        Args:
            path: store directory.
            identity: everything the train features depend on (model, task,
                grad_wrt, projector spec, grad_dim, train data fingerprint,
                chunking and storage).
            config: the resolved config, recorded in the attributes.
            overwrite: delete an existing store first.
            create: whether this process may create it (False on ranks > 0).

        Raises:
            StoreMismatchError: the store exists with a different identity (names the keys).
            StoreError: the path cannot be created or is not a trakcli store.
        """
        path = Path(path)
        identity = jsonable(identity)
        if overwrite and create and path.exists():
            if path.is_dir() and not ((path / "zarr.json").exists() or not any(path.iterdir())):
                raise StoreError(
                    f"refusing to --overwrite {path}: it is a directory but not a Zarr store; choose another store path"
                )
            try:
                if (path / "eval" / "zarr.json").exists():  # retraining does not depend on the features: keep it
                    kept = _eval_kept(path)
                    if kept.exists():
                        shutil.rmtree(kept)  # older than the store's own eval group
                    os.replace(path / "eval", kept)
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            except OSError as e:
                raise StoreError(f"cannot delete {path} for --overwrite: {e}") from None
        if (path / "zarr.json").exists():
            store = cls.open_existing(path)
            if create:
                _restore_eval(path)
            old = store.root.attrs.get("identity")
            if old is None and create and "train" not in store.root:
                # made by `trak eval` (retraining only): this run gives it its identity
                try:
                    store.root.attrs.update({"identity": identity, "config": jsonable(config)})
                except OSError as e:
                    raise StoreError(f"cannot write the attributes of {path}: {e}") from None
                return store
            if old != identity:
                raise settings_mismatch(
                    f"the contents of store {path}", old, identity,
                    "rerun with --overwrite to start over, or choose another store path",
                )
            return store
        if not create:
            raise StoreError(f"no trakcli store at {path}")
        return cls._create_root(path, {"identity": identity, "config": jsonable(config)})

    @classmethod
    def _create_root(cls, path: Path, attrs: dict[str, Any]) -> "Store":
        """Create a new store at ``path`` (absent or an empty directory) with ``attrs`` plus version and date.

        Raises:
            StoreError: ``path`` holds something else, or cannot be created.
        """
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise StoreError(f"{path} exists and is not a trakcli store; choose another store path or remove it")
        cls.prepare_parent(path)
        try:
            group = zarr.open_group(str(path), mode="a", zarr_format=3)
            group.attrs.update(
                {
                    "schema_version": SCHEMA_VERSION,
                    "trakcli_version": __version__,
                    **attrs,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                }
            )
        except OSError as e:
            raise StoreError(f"cannot create the store at {path}: {e}; choose a writable store path") from None
        _restore_eval(path)
        return cls(path, group)

    @classmethod
    def open_or_create(cls, path: str | Path) -> "Store":
        """Open a store, or create an empty one without an identity (for `trak eval` before featurize).

        ``trak featurize`` later adopts an empty store: it writes its identity
        and config (see :meth:`create_or_check`).

        Raises:
            StoreError: the path cannot be created, or exists and is not a trakcli store.
        """
        path = Path(path)
        if (path / "zarr.json").exists():
            store = cls.open_existing(path)
            _restore_eval(path)
            return store
        return cls._create_root(path, {})

    @classmethod
    def open_existing(cls, path: str | Path, mode: str = "r+") -> "Store":
        """Open a store that must exist.

        Raises:
            StoreError: missing path, not a Zarr group, or an unknown schema version.
        """
        path = Path(path)
        if not (path / "zarr.json").exists():
            raise StoreError(f"no trakcli store at {path}; run `trak featurize CONFIG` first")
        try:
            group = zarr.open_group(str(path), mode=mode, zarr_format=3)
        except Exception as e:
            raise StoreError(f"cannot open the store at {path}: {e}") from None
        version = group.attrs.get("schema_version")
        if version != SCHEMA_VERSION:
            raise StoreError(
                f"store {path} has schema_version {version!r}; this trakcli ({__version__}) reads {SCHEMA_VERSION}"
            )
        return cls(path, group)

    @property
    def identity(self) -> dict[str, Any]:
        return dict(self.root.attrs.get("identity", {}))

    @property
    def _storage(self) -> dict[str, Any]:
        return self.identity["storage"]

    # -- arrays ---------------------------------------------------------------

    def _arrays(
        self,
        group: Any,
        shape_of: dict[str, tuple[tuple[int, ...], str]],
        chunks_of: dict[str, tuple[int, ...]],
        n_chunks: int,
        create: bool,
    ) -> tuple[dict[str, Any], Any]:
        data = {}
        codecs = _codecs(self._storage["compressor"])
        for name, (shape, dtype) in shape_of.items():
            if name in group:
                arr = group[name]
                if tuple(arr.shape) != shape:
                    raise StoreMismatchError(
                        f"store array {arr.path} has shape {list(arr.shape)}, this run needs {list(shape)}; "
                        "rerun with --overwrite to start over"
                    )
            elif create:
                arr = group.create_array(
                    name, shape=shape, chunks=chunks_of[name], dtype=dtype, fill_value=0, compressors=codecs
                )
            else:
                raise StoreError(f"store array {group.path}/{name} is missing; it is created by rank 0")
            data[name] = arr
        if "done" in group:
            done = group["done"]
        elif create:
            done = group.create_array("done", shape=(n_chunks,), chunks=(1,), dtype="uint8", fill_value=0,
                                      compressors=[Crc32cCodec()])
        else:
            raise StoreError(f"store array {group.path}/done is missing; it is created by rank 0")
        return data, done

    def _group(self, name: str, create: bool = True) -> Any:
        if name in self.root:
            return self.root[name]
        if not create:
            raise StoreError(f"store group {name} is missing; it is created by rank 0")
        try:
            return self.root.require_group(name)
        except OSError as e:
            raise StoreError(f"cannot write group {name} in {self.path}: {e}") from None

    def model_ids(self) -> list[int]:
        """model_ids with a train group, sorted."""
        if "train" not in self.root:
            return []
        return sorted(int(k) for k in self.root["train"].group_keys())

    def train(
        self, model_id: int, checkpoint: str | None = None, sha256: str | None = None, create: bool = True
    ) -> ChunkedRows:
        """Train features of one checkpoint (created if absent and ``create``).

        Args:
            model_id: index of the checkpoint.
            checkpoint, sha256: recorded on creation and checked against the store.
            create: whether this process may create arrays and attributes (rank 0).

        Raises:
            StoreMismatchError: the store holds this model_id from a file with another sha256.
        """
        ident = self.identity
        n_train, proj_dim = ident["train_data"]["n"], ident["projector"]["proj_dim"]
        st = self._storage
        rows = st["chunk_rows"]
        group = self._group(f"train/{model_id}", create)
        if sha256 is not None:
            old = group.attrs.get("sha256")
            if old is None and create:
                group.attrs.update({"checkpoint": str(checkpoint), "sha256": sha256})
            elif old is not None and old != sha256:
                raise StoreMismatchError(
                    f"model_id {model_id}: the store's features come from {group.attrs.get('checkpoint')} "
                    f"(sha256 {old[:12]}), this run's checkpoint {checkpoint} has sha256 {sha256[:12]}; "
                    "rerun with --overwrite to start over"
                )
        data, done = self._arrays(
            group,
            {
                "features": ((n_train, proj_dim), st["dtype"]),
                "out_to_loss": ((n_train,), "float32"),
                "nonfinite": ((n_train,), "uint8"),
            },
            {"features": (rows, proj_dim), "out_to_loss": (rows,), "nonfinite": (rows,)},
            -(-n_train // rows),
            create,
        )
        return ChunkedRows(data, done, rows, n_train)

    def checkpoint_info(self, model_id: int) -> dict[str, Any]:
        return dict(self.root[f"train/{model_id}"].attrs)

    def read_kernel(self, model_id: int, settings: dict[str, Any]) -> tuple[np.ndarray, float] | None:
        """The stored Cholesky factor and λ if made with ``settings``, else None."""
        group = self.root[f"train/{model_id}"]
        if "kernel" not in group:
            return None
        arr = group["kernel"]
        attrs = dict(arr.attrs)
        if attrs.get("settings") != jsonable(settings):
            return None
        return _read_checked(arr, slice(None), 0), float(attrs["lambda_reg"])

    def write_kernel(self, model_id: int, factor: np.ndarray, settings: dict[str, Any], lambda_reg: float) -> None:
        """Write the kernel's Cholesky factor, then its attributes (the done marker)."""
        group = self.root[f"train/{model_id}"]
        p = factor.shape[0]
        try:
            if "kernel" in group:
                arr = group["kernel"]
                arr.attrs.clear()
            else:
                arr = group.create_array("kernel", shape=(p, p), chunks=(p, p), dtype="float64", fill_value=0,
                                         compressors=_codecs(self._storage["compressor"]))
            arr[:] = np.ascontiguousarray(factor)
            arr.attrs.update({"form": "cholesky_lower", "lambda_reg": lambda_reg, "settings": jsonable(settings)})
        except OSError as e:
            raise StoreError(f"writing the kernel of model_id {model_id} failed: {e}; rerun to resume") from None

    def targets(
        self, experiment: str, model_id: int, attrs: dict[str, Any], n_target: int, create: bool = True
    ) -> ChunkedRows:
        """Target features of one experiment and checkpoint (created if absent).

        Args:
            attrs: what the target features depend on (target data fingerprint,
                checkpoint sha256s); checked against the store.

        Raises:
            StoreMismatchError: the experiment was featurized with other targets or checkpoints.
        """
        proj_dim = self.identity["projector"]["proj_dim"]
        st = self._storage
        self._experiment_group("targets", experiment, attrs, create)
        group = self._group(f"targets/{experiment}/{model_id}", create)
        rows = st["chunk_rows"]
        data, done = self._arrays(
            group, {"features": ((n_target, proj_dim), st["dtype"])}, {"features": (rows, proj_dim)},
            -(-n_target // rows), create,
        )
        return ChunkedRows(data, done, rows, n_target)

    def scores(self, experiment: str, n_target: int, settings: dict[str, Any], create: bool = True) -> ChunkedRows:
        """The ``[n_target, n_train]`` score matrix of an experiment, chunked by train columns.

        Raises:
            StoreMismatchError: the experiment was scored with other settings.
        """
        n_train = self.identity["train_data"]["n"]
        cols = self._storage["chunk_rows"]
        group = self._experiment_group("scores", experiment, settings, create)
        t_rows = min(n_target, max(1, (8 << 20) // (4 * cols)))  # ~8 MB chunks
        data, done = self._arrays(
            group, {"scores": ((n_target, n_train), "float32")}, {"scores": (t_rows, cols)},
            -(-n_train // cols), create,
        )
        return ChunkedRows(data, done, cols, n_train, axis=1)

    def _experiment_group(self, kind: str, experiment: str, attrs: dict[str, Any], create: bool) -> Any:
        name = f"{kind}/{experiment}"
        attrs = jsonable(attrs)
        if name in self.root:
            group = self.root[name]
            old = {k: group.attrs.get(k) for k in attrs}
            if old != attrs:
                raise settings_mismatch(
                    f"{kind} of experiment {experiment!r} in {self.path}", old, attrs,
                    "rerun with --overwrite to recompute them, or set score.experiment to a new name",
                )
            return group
        group = self._group(name, create)
        if create:
            group.attrs.update(attrs)
        return group

    def eval_rows(
        self,
        identity: dict[str, Any],
        n_subsets: int,
        n_train: int,
        n_target: int,
        *,
        compressor: str = "zstd",
        overwrite: bool = False,
        create: bool = True,
    ) -> EvalRows:
        """The ``eval/`` group of retrained models, created, checked or extended.

        Args:
            identity: everything the retrained models depend on (training recipe,
                model, train and target data fingerprints, task, subset_fraction,
                eval seed); compared with the stored one.
            n_subsets: rows wanted; a group with fewer rows is extended (rows
                already done are kept), one with more keeps them.
            n_train, n_target: the row lengths of masks and outputs.
            compressor: codec of new arrays (each chunk also carries a CRC32C checksum).
            overwrite: discard a group made with another identity (or any group) and start over.
            create: whether a missing group may be created (False: read only).

        Raises:
            StoreMismatchError: the group was made with another identity (names the differing keys).
            StoreError: no group and ``create`` is False; the store cannot be written.
        """
        identity = jsonable(identity)
        try:
            if "eval" in self.root:
                group = self.root["eval"]
                old = group.attrs.get("identity")
                if overwrite:
                    del self.root["eval"]
                elif old != identity:
                    raise settings_mismatch(
                        f"the retrained models in {self.path}/eval", old, identity,
                        "rerun `trak eval lds CONFIG --overwrite` to retrain them, or restore those settings",
                    )
            if "eval" not in self.root:
                if not create:
                    raise StoreError(f"store {self.path} holds no retrained models yet; run `trak eval lds CONFIG`")
                group = self.root.require_group("eval")
                codecs = _codecs(compressor)
                group.create_array("masks", shape=(n_subsets, n_train), chunks=(1, n_train), dtype="bool",
                                   fill_value=False, compressors=codecs)
                group.create_array("outputs", shape=(n_subsets, n_target), chunks=(1, n_target), dtype="float64",
                                   fill_value=0.0, compressors=codecs)
                group.create_array("done", shape=(n_subsets,), chunks=(1,), dtype="uint8", fill_value=0,
                                   compressors=[Crc32cCodec()])
                group.attrs.update({"identity": identity, "n_subsets": n_subsets, "trakcli_version": __version__})
            group = self.root["eval"]
            arrays = {name: group[name] for name in ("masks", "outputs", "done")}
            for name, width in (("masks", n_train), ("outputs", n_target)):
                if arrays[name].shape[1:] != (width,):
                    raise StoreMismatchError(
                        f"store array {arrays[name].path} has shape {list(arrays[name].shape)}, this run needs rows "
                        f"of {width}; rerun `trak eval lds CONFIG --overwrite` to retrain"
                    )
            if create and arrays["done"].shape[0] < n_subsets:  # extend: done first grows last
                for name in ("masks", "outputs", "done"):
                    arr = arrays[name]
                    if arr.shape[0] < n_subsets:
                        arr.resize((n_subsets, *arr.shape[1:]))
                group.attrs["n_subsets"] = n_subsets
        except OSError as e:
            raise StoreError(f"cannot write the eval group of {self.path}: {e}") from None
        return EvalRows(arrays["masks"], arrays["outputs"], arrays["done"])

    def read_scores(self, experiment: str) -> tuple[np.ndarray, dict[str, Any]]:
        """The finished score matrix of an experiment and the attributes it was made with.

        Returns:
            (scores ``[n_target, n_train]`` float32, attrs: lambda settings, target data, checkpoints).

        Raises:
            StoreError: the experiment has no scores, or unfinished ones (names the command to run).
            StoreCorruptError: a chunk fails its checksum.
        """
        name = f"scores/{experiment}"
        if name not in self.root or "scores" not in self.root[name]:
            raise StoreError(
                f"store {self.path} holds no scores of experiment {experiment!r} (score.experiment); "
                "run `trak featurize CONFIG` and `trak score CONFIG` first"
            )
        group = self.root[name]
        flags = _read_checked(group["done"], slice(None), 0)
        if not (flags != 0).all():
            raise StoreError(
                f"the scores of experiment {experiment!r} in {self.path} are unfinished ({int((flags != 0).sum())}/"
                f"{flags.size} column blocks); run `trak score CONFIG` to finish them"
            )
        return _read_checked(group["scores"], slice(None), 0), dict(group.attrs)

    def eval_summary(self) -> dict[str, Any] | None:
        """The ``eval/`` group's identity and progress (None if absent), as plain data."""
        if "eval" not in self.root:
            return None
        group = self.root["eval"]
        flags = _read_checked(group["done"], slice(None), 0)
        return {
            "identity": group.attrs.get("identity"),
            "n_subsets": int(flags.size),
            "done": int((flags != 0).sum()),
            "bytes_on_disk": _du(self.path / "eval"),
        }

    def drop(self, name: str) -> None:
        """Delete a group or array (``--overwrite`` of derived data)."""
        if name in self.root:
            del self.root[name]

    # -- inspection and export --------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Provenance, progress and sizes, as plain data (``trak inspect``)."""
        ident = self.identity
        out: dict[str, Any] = {
            "store": str(self.path),
            "schema_version": self.root.attrs.get("schema_version"),
            "trakcli_version": self.root.attrs.get("trakcli_version"),
            "created": self.root.attrs.get("created"),
            "identity": ident,
            "bytes_on_disk": _du(self.path),
            "train": [],
            "targets": {},
            "scores": {},
        }
        for m in self.model_ids():
            rows = self.train(m, create=False)
            group = self.root[f"train/{m}"]
            flags = rows.flags()
            lo_done = sum(rows.rows(int(c))[1] - rows.rows(int(c))[0] for c in np.flatnonzero(flags))
            skipped = int(_read_checked(rows.data["nonfinite"], slice(None), 0).sum())
            entry = {
                "model_id": m,
                "checkpoint": group.attrs.get("checkpoint"),
                "sha256": group.attrs.get("sha256"),
                "rows_done": int(lo_done),
                "rows_total": rows.n_rows,
                "chunks_done": int(flags.sum()),
                "chunks_total": rows.n_chunks,
                "nonfinite_skipped": skipped,
                "kernel": dict(group["kernel"].attrs) if "kernel" in group else None,
                "bytes_on_disk": _du(self.path / "train" / str(m)),
            }
            out["train"].append(entry)
        ev = self.eval_summary()
        if ev is not None:
            out["eval"] = ev
        for kind in ("targets", "scores"):
            if kind not in self.root:
                continue
            for exp in sorted(self.root[kind].group_keys()):
                g = self.root[f"{kind}/{exp}"]
                info: dict[str, Any] = {"attrs": dict(g.attrs), "bytes_on_disk": _du(self.path / kind / exp)}
                if kind == "scores" and "scores" in g:
                    info["shape"] = list(g["scores"].shape)
                    flags = _read_checked(g["done"], slice(None), 0)
                    info["chunks_done"], info["chunks_total"] = int(flags.sum()), int(flags.size)
                out[kind][exp] = info
        return out

    def array(self, name: str) -> Any:
        """The zarr array at ``name`` (e.g. ``train/0/features``, ``scores/default/scores``).

        Raises:
            StoreError: no such array (lists what the store holds).
        """
        try:
            arr = self.root[name]
        except KeyError:
            arr = None
        if arr is None or not hasattr(arr, "shape"):
            have = [f"train/{m}/features" for m in self.model_ids()]
            if "scores" in self.root:
                have += [f"scores/{e}/scores" for e in self.root["scores"].group_keys()]
            if "eval" in self.root:
                have += ["eval/masks", "eval/outputs"]
            raise StoreError(f"store {self.path} has no array {name!r}; it holds {', '.join(have) or 'nothing yet'}")
        return arr

    def export(self, name: str, out: Path, row_block: int = 4096) -> tuple[int, ...]:
        """Stream array ``name`` to ``out`` (.npy, or .csv for 1-D/2-D) block by block.

        Returns:
            The exported shape.

        Raises:
            StoreError: unknown array, unwritable output, corrupt chunk.
        """
        arr = self.array(name)
        shape = tuple(arr.shape)
        try:
            if out.suffix.lower() == ".npy":
                mm = np.lib.format.open_memmap(out, mode="w+", dtype=arr.dtype, shape=shape)
                for lo in range(0, shape[0], row_block):
                    mm[lo : lo + row_block] = _read_checked(arr, slice(lo, lo + row_block), 0)
                mm.flush()
                del mm
            else:
                with open(out, "w") as f:
                    for lo in range(0, shape[0], row_block):
                        block = _read_checked(arr, slice(lo, lo + row_block), 0)
                        np.savetxt(f, block.reshape(block.shape[0], -1), delimiter=",", fmt="%.7g")
        except OSError as e:
            raise StoreError(f"cannot write {out}: {e}") from None
        return shape


def _du(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total
