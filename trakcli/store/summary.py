"""Inspection and export of a store: provenance, progress and sizes (``trak inspect``), arrays to files.

The :class:`~trakcli.store.store.Store` methods ``summary``, ``eval_summary``,
``array`` and ``export`` call these functions.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trakcli.errors import StoreError
from trakcli.store.rows import read_checked

if TYPE_CHECKING:
    from trakcli.store.store import Store


def eval_summary(store: "Store") -> dict[str, Any] | None:
    """The ``eval/`` group's identity and progress (None if absent), as plain data."""
    if "eval" not in store.root:
        return None
    group = store.root["eval"]
    flags = read_checked(group["done"], slice(None), 0)
    return {
        "identity": group.attrs.get("identity"),
        "n_subsets": int(flags.size),
        "done": int((flags != 0).sum()),
        "bytes_on_disk": du(store.path / "eval"),
    }


def summary(store: "Store") -> dict[str, Any]:
    """Provenance, progress and sizes, as plain data (``trak inspect``)."""
    ident = store.identity
    out: dict[str, Any] = {
        "store": str(store.path),
        "schema_version": store.root.attrs.get("schema_version"),
        "trakcli_version": store.root.attrs.get("trakcli_version"),
        "created": store.root.attrs.get("created"),
        "identity": ident,
        "bytes_on_disk": du(store.path),
        "train": [],
        "targets": {},
        "scores": {},
    }
    for m in store.model_ids():
        rows = store.train(m, create=False)
        group = store.root[f"train/{m}"]
        flags = rows.flags()
        lo_done = sum(rows.rows(int(c))[1] - rows.rows(int(c))[0] for c in np.flatnonzero(flags))
        skipped = int(read_checked(rows.data["nonfinite"], slice(None), 0).sum())
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
            "bytes_on_disk": du(store.path / "train" / str(m)),
        }
        out["train"].append(entry)
    ev = eval_summary(store)
    if ev is not None:
        out["eval"] = ev
    for kind in ("targets", "scores"):
        if kind not in store.root:
            continue
        for exp in sorted(store.root[kind].group_keys()):
            g = store.root[f"{kind}/{exp}"]
            info: dict[str, Any] = {"attrs": dict(g.attrs), "bytes_on_disk": du(store.path / kind / exp)}
            if kind == "scores" and "scores" in g:
                info["shape"] = list(g["scores"].shape)
                flags = read_checked(g["done"], slice(None), 0)
                info["chunks_done"], info["chunks_total"] = int(flags.sum()), int(flags.size)
            out[kind][exp] = info
    return out


def array(store: "Store", name: str) -> Any:
    """The zarr array at ``name`` (e.g. ``train/0/features``, ``scores/default/scores``).

    Raises:
        StoreError: no such array (lists what the store holds).
    """
    try:
        arr = store.root[name]
    except KeyError:
        arr = None
    if arr is None or not hasattr(arr, "shape"):
        have = [f"train/{m}/features" for m in store.model_ids()]
        if "scores" in store.root:
            have += [f"scores/{e}/scores" for e in store.root["scores"].group_keys()]
        if "eval" in store.root:
            have += ["eval/masks", "eval/outputs"]
        raise StoreError(f"store {store.path} has no array {name!r}; it holds {', '.join(have) or 'nothing yet'}")
    return arr


def export(store: "Store", name: str, out: Path, row_block: int = 4096) -> tuple[int, ...]:
    """Stream array ``name`` to ``out`` (.npy, or .csv for 1-D/2-D) block by block.

    Returns:
        The exported shape.

    Raises:
        StoreError: unknown array, unwritable output, corrupt chunk.
    """
    arr = array(store, name)
    shape = tuple(arr.shape)
    try:
        if out.suffix.lower() == ".npy":
            mm = np.lib.format.open_memmap(out, mode="w+", dtype=arr.dtype, shape=shape)
            for lo in range(0, shape[0], row_block):
                mm[lo : lo + row_block] = read_checked(arr, slice(lo, lo + row_block), 0)
            mm.flush()
            del mm
        else:
            with open(out, "w") as f:
                for lo in range(0, shape[0], row_block):
                    block = read_checked(arr, slice(lo, lo + row_block), 0)
                    np.savetxt(f, block.reshape(block.shape[0], -1), delimiter=",", fmt="%.7g")
    except OSError as e:
        raise StoreError(f"cannot write {out}: {e}") from None
    return shape


def du(path: Path) -> int:
    """Bytes of the files under ``path`` (0 if it is missing); files that vanish meanwhile count 0."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total
