"""The Zarr v3 store: layout, resume, provenance. The only module that imports zarr.

Layout (design.md, "Store layout")::

    <store>.zarr/                  attrs: schema_version, trakcli_version, config (resolved),
                                   identity (what the train features depend on)
      train/<model_id>/            attrs: checkpoint, sha256
        features    [n_train, proj_dim] float32, chunked by rows
        out_to_loss [n_train]           float32
        done        [n_row_chunks]      uint8, set after the chunk's data is written
        kernel      [proj_dim, proj_dim] float64 lower Cholesky factor of ΦᵀΦ + λI;
                                        its attrs (lambda_reg) are written last
      targets/<experiment>/        attrs: target data fingerprint
        <model_id>/features [n_target, proj_dim], done
      scores/<experiment>/         attrs: lambda settings, model_ids
        scores [n_target, n_train] float32, done [n_target_chunks]

Rules: a chunk's data is written before its ``done`` flag; resumed runs
recompute only chunks not done; a run whose identity differs from the
store's refuses (naming the differing keys) unless ``overwrite``. Arrays are
written from numpy, never from torch tensors.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import zarr

from trakcli import __version__
from trakcli.errors import StoreError, StoreMismatchError

SCHEMA_VERSION = 1


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def diff_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable lines ``key: store has X, this run has Y`` for differing leaves."""
    a, b = _flatten(json.loads(json.dumps(old))), _flatten(json.loads(json.dumps(new)))
    lines = []
    for k in sorted(set(a) | set(b)):
        if a.get(k, "<unset>") != b.get(k, "<unset>"):
            lines.append(f"{k}: store has {a.get(k, '<unset>')!r}, this run has {b.get(k, '<unset>')!r}")
    return lines


def jsonable(d: Any) -> Any:
    """``d`` round-tripped through JSON (what zarr attributes hold)."""
    return json.loads(json.dumps(d, default=str))


@dataclass
class ChunkedRows:
    """Row-chunked arrays of one matrix with a ``done`` flag per chunk.

    Attributes:
        data: arrays written together per chunk (name -> zarr array, first axis = rows).
        done: ``[n_chunks]`` uint8 flags.
        chunk_rows: rows per chunk.
        n_rows: total rows.
    """

    data: dict[str, Any]
    done: Any
    chunk_rows: int
    n_rows: int

    @property
    def n_chunks(self) -> int:
        return -(-self.n_rows // self.chunk_rows)

    def rows(self, chunk: int) -> tuple[int, int]:
        """Row range ``[lo, hi)`` of a chunk."""
        lo = chunk * self.chunk_rows
        return lo, min(lo + self.chunk_rows, self.n_rows)

    def pending(self) -> list[int]:
        """Indices of chunks not yet done."""
        flags = np.asarray(self.done[:])
        return [int(i) for i in np.flatnonzero(flags == 0)]

    def is_complete(self) -> bool:
        return not self.pending()

    def write(self, chunk: int, **arrays: np.ndarray) -> None:
        """Write a chunk's rows of every array, then mark it done."""
        lo, hi = self.rows(chunk)
        try:
            for name, arr in arrays.items():
                self.data[name][lo:hi] = np.ascontiguousarray(arr)
            self.done[chunk] = 1
        except OSError as e:
            raise StoreError(
                f"writing rows {lo}:{hi} to the store failed ({e}); what was done before is kept, "
                "free space or fix permissions and rerun the same command to resume"
            ) from None

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        return np.asarray(self.data[name][lo:hi])

    def iter_chunks(self, name: str) -> Iterator[tuple[int, int, np.ndarray]]:
        """Yield ``(lo, hi, rows)`` of array ``name`` chunk by chunk."""
        for c in range(self.n_chunks):
            lo, hi = self.rows(c)
            yield lo, hi, self.read(name, lo, hi)


class Store:
    """A trakcli Zarr store on disk.

    Open with :meth:`create_or_check` (featurize) or :meth:`open_existing` (score).
    """

    def __init__(self, path: Path, group: Any):
        self.path = path
        self.root = group

    # -- opening --------------------------------------------------------------

    @classmethod
    def create_or_check(
        cls, path: str | Path, identity: dict[str, Any], config: dict[str, Any], overwrite: bool = False
    ) -> "Store":
        """Open the store for featurizing, creating it or checking it was made the same way.

        Args:
            path: store directory.
            identity: everything the train features depend on (model, task,
                grad_wrt, projector spec, grad_dim, train data fingerprint, chunk_rows).
            config: the resolved config, recorded in the attributes.
            overwrite: delete an existing store first.

        Raises:
            StoreMismatchError: the store exists with a different identity (names the keys).
            StoreError: the path cannot be created or is not a trakcli store.
        """
        path = Path(path)
        identity = jsonable(identity)
        if overwrite and path.exists():
            if path.is_dir() and not ((path / "zarr.json").exists() or not any(path.iterdir())):
                raise StoreError(
                    f"refusing to --overwrite {path}: it is a directory but not a Zarr store; choose another store path"
                )
            try:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            except OSError as e:
                raise StoreError(f"cannot delete {path} for --overwrite: {e}") from None
        if path.exists() and (path / "zarr.json").exists():
            store = cls.open_existing(path)
            old = store.root.attrs.get("identity")
            if old != identity:
                lines = diff_keys(old or {}, identity)
                raise StoreMismatchError(
                    f"store {path} was made with different settings:\n  "
                    + "\n  ".join(lines or ["(identity differs)"])
                    + "\nrerun with --overwrite to start over, or choose another store path"
                )
            return store
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise StoreError(f"{path} exists and is not a trakcli store; choose another store path or remove it")
        try:
            group = zarr.open_group(str(path), mode="a", zarr_format=3)
            group.attrs.update(
                {
                    "schema_version": SCHEMA_VERSION,
                    "trakcli_version": __version__,
                    "identity": identity,
                    "config": jsonable(config),
                }
            )
        except (OSError, PermissionError) as e:
            raise StoreError(f"cannot create the store at {path}: {e}; choose a writable store path") from None
        return cls(path, group)

    @classmethod
    def open_existing(cls, path: str | Path) -> "Store":
        """Open a store that must exist.

        Raises:
            StoreError: missing path, not a Zarr group, or an unknown schema version.
        """
        path = Path(path)
        if not (path / "zarr.json").exists():
            raise StoreError(f"no trakcli store at {path}; run `trak featurize CONFIG` first")
        try:
            group = zarr.open_group(str(path), mode="r+", zarr_format=3)
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

    # -- arrays ---------------------------------------------------------------

    def _rows(self, group: Any, n_rows: int, chunk_rows: int, arrays: dict[str, tuple[tuple[int, ...], str]]) -> ChunkedRows:
        data = {}
        for name, (tail, dtype) in arrays.items():
            shape = (n_rows, *tail)
            if name in group:
                arr = group[name]
                if tuple(arr.shape) != shape:
                    raise StoreMismatchError(
                        f"store array {arr.path} has shape {list(arr.shape)}, this run needs {list(shape)}; "
                        "rerun with --overwrite to start over"
                    )
            else:
                arr = group.create_array(
                    name, shape=shape, chunks=(chunk_rows, *tail), dtype=dtype, fill_value=0
                )
            data[name] = arr
        n_chunks = -(-n_rows // chunk_rows)
        done = group["done"] if "done" in group else group.create_array(
            "done", shape=(n_chunks,), chunks=(1,), dtype="uint8", fill_value=0
        )
        return ChunkedRows(data, done, chunk_rows, n_rows)

    def _group(self, name: str) -> Any:
        try:
            return self.root.require_group(name)
        except OSError as e:
            raise StoreError(f"cannot write group {name} in {self.path}: {e}") from None

    def model_ids(self) -> list[int]:
        """model_ids with a train group, sorted."""
        if "train" not in self.root:
            return []
        return sorted(int(k) for k in self.root["train"].group_keys())

    def train(self, model_id: int, checkpoint: str | None = None, sha256: str | None = None) -> ChunkedRows:
        """Train features of one checkpoint (created if absent).

        Args:
            model_id: index of the checkpoint.
            checkpoint, sha256: when given, recorded on creation and checked against the store.

        Raises:
            StoreMismatchError: the store holds this model_id from a file with another sha256.
        """
        ident = self.identity
        n_train, proj_dim, chunk_rows = ident["train_data"]["n"], ident["projector"]["proj_dim"], ident["chunk_rows"]
        group = self._group(f"train/{model_id}")
        if sha256 is not None:
            old = group.attrs.get("sha256")
            if old is None:
                group.attrs.update({"checkpoint": str(checkpoint), "sha256": sha256})
            elif old != sha256:
                raise StoreMismatchError(
                    f"model_id {model_id}: the store's features come from {group.attrs.get('checkpoint')} "
                    f"(sha256 {old[:12]}), this run's checkpoint {checkpoint} has sha256 {sha256[:12]}; "
                    "rerun with --overwrite to start over"
                )
        return self._rows(
            group, n_train, chunk_rows, {"features": ((proj_dim,), "float32"), "out_to_loss": ((), "float32")}
        )

    def checkpoint_info(self, model_id: int) -> dict[str, Any]:
        return dict(self.root[f"train/{model_id}"].attrs)

    def read_kernel(self, model_id: int, lam_key: dict[str, Any]) -> np.ndarray | None:
        """The stored Cholesky factor if it was made with ``lam_key`` settings, else None."""
        group = self.root[f"train/{model_id}"]
        if "kernel" not in group:
            return None
        arr = group["kernel"]
        if dict(arr.attrs).get("settings") != jsonable(lam_key):
            return None
        return np.asarray(arr[:])

    def write_kernel(self, model_id: int, factor: np.ndarray, lam_key: dict[str, Any], lambda_reg: float) -> None:
        """Write the kernel's Cholesky factor, then its attributes (the done marker)."""
        group = self.root[f"train/{model_id}"]
        p = factor.shape[0]
        if "kernel" in group:
            arr = group["kernel"]
            arr.attrs.clear()
        else:
            arr = group.create_array("kernel", shape=(p, p), chunks=(p, p), dtype="float64", fill_value=0)
        arr[:] = np.ascontiguousarray(factor)
        arr.attrs.update({"form": "cholesky_lower", "lambda_reg": lambda_reg, "settings": jsonable(lam_key)})

    def targets(
        self, experiment: str, model_id: int, fingerprint: dict[str, Any], overwrite: bool = False
    ) -> ChunkedRows:
        """Target features of one experiment and checkpoint (created if absent).

        Raises:
            StoreMismatchError: the experiment was featurized on other target data.
        """
        proj_dim, chunk_rows = self.identity["projector"]["proj_dim"], self.identity["chunk_rows"]
        exp = self._experiment_group("targets", experiment, {"target_data": fingerprint}, overwrite)
        group = exp.require_group(str(model_id))
        return self._rows(group, fingerprint["n"], chunk_rows, {"features": ((proj_dim,), "float32")})

    def scores(
        self, experiment: str, n_target: int, settings: dict[str, Any], overwrite: bool = False
    ) -> ChunkedRows:
        """The score matrix of an experiment (created if absent), chunked by target rows.

        Raises:
            StoreMismatchError: the experiment was scored with other settings.
        """
        n_train, chunk_rows = self.identity["train_data"]["n"], self.identity["chunk_rows"]
        group = self._experiment_group("scores", experiment, settings, overwrite)
        return self._rows(group, n_target, chunk_rows, {"scores": ((n_train,), "float32")})

    def _experiment_group(self, kind: str, experiment: str, attrs: dict[str, Any], overwrite: bool) -> Any:
        name = f"{kind}/{experiment}"
        attrs = jsonable(attrs)
        if name in self.root:
            group = self.root[name]
            old = {k: group.attrs.get(k) for k in attrs}
            if old != attrs:
                if not overwrite:
                    lines = diff_keys(old, attrs)
                    raise StoreMismatchError(
                        f"{kind} of experiment {experiment!r} in {self.path} were made with different settings:\n  "
                        + "\n  ".join(lines)
                        + "\nrerun with --overwrite to recompute them, or set score.experiment to a new name"
                    )
                del self.root[name]
        if name not in self.root:
            group = self._group(name)
            group.attrs.update(attrs)
        return self.root[name]

    def drop(self, name: str) -> None:
        """Delete a group or array (used by --overwrite of derived data)."""
        if name in self.root:
            del self.root[name]
