"""Inspection of a store: provenance, progress, sizes and damage (``trak inspect [--verify]``).

Progress counts only chunks that are done *and* intact: a done chunk whose file is missing (always checked: the store
lists its files, nothing is read) or, with ``verify``, that fails its checksum (every done chunk of every array is read)
is reported under ``corrupt`` with the command that repairs it. An array or group whose ``zarr.json`` is unreadable is
reported the same way instead of stopping the inspection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from trakcli.store.append import APPENDS_ATTR, STALE_ATTR, stale_error
from trakcli.store.integrity import StoreCorruptError, child_names, missing_chunks, node, repair_command
from trakcli.store.location import disk_usage
from trakcli.store.rows import ChunkedRows, read_checked

if TYPE_CHECKING:
    from trakcli.store.store import Store


def eval_summary(store: "Store", verify: bool, corrupt: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``eval/`` group's identity and progress (None if absent); damage is appended to ``corrupt``."""
    try:
        group = node(store.root, "eval")
        if group is None:
            return None
        ok = _intact(_rows(store, "eval", ["masks", "outputs"], 0), "eval", verify, corrupt)
        identity = group.attrs.get("identity")
    except StoreCorruptError as e:
        corrupt.append(_entry(e))
        ok, identity = np.zeros(0), None
    return {"identity": identity, "n_subsets": int(ok.size), "done": int((ok != 0).sum()),
            "bytes_on_disk": disk_usage(store.path / "eval")}


def summary(store: "Store", verify: bool = False) -> dict[str, Any]:
    """Provenance, progress, sizes and damage, as plain data (``trak inspect``). ``verify``: read every done chunk
    of every array (checksums); else only check that the chunk files of done chunks exist.

    Returns:
        A dict with the root attributes (``identity``, versions, ``created``, ``appends``: each growth
        of the train rows, :mod:`trakcli.store.append`),
        ``train`` (one entry per checkpoint: rows and chunks done and intact,
        kernel attributes), ``targets`` and ``scores`` per experiment (a stale experiment's entry has
        ``stale``: the train rows it was scored over and the message naming the rescore), ``eval``,
        ``verified`` (= ``verify``) and ``corrupt``: one entry per damaged array,
        ``{"array", "chunks", "message", "repair"}``.
    """
    corrupt: list[dict[str, Any]] = []
    attrs = store.root.attrs
    out: dict[str, Any] = {
        "store": str(store.path), "schema_version": attrs.get("schema_version"),
        "trakcli_version": attrs.get("trakcli_version"), "created": attrs.get("created"), "identity": store.identity,
        "appends": list(attrs.get(APPENDS_ATTR) or []), "bytes_on_disk": disk_usage(store.path),
        "train": [], "targets": {}, "scores": {}, "verified": verify, "corrupt": corrupt,
    }
    train = _guard(lambda: node(store.root, "train"), corrupt)
    for m in sorted(int(k) for k in child_names(train) if k.isdigit()) if train is not None else []:
        entry = _guard(lambda: _train_entry(store, m, verify, corrupt), corrupt)
        if entry is not None:
            out["train"].append(entry)
    _implied(store, corrupt)
    ev = eval_summary(store, verify, corrupt)
    if ev is not None:
        out["eval"] = ev
    for kind in ("targets", "scores"):
        top = _guard(lambda: node(store.root, kind), corrupt)
        for exp in child_names(top) if top is not None else []:
            info = _guard(lambda: _experiment_entry(store, kind, exp, verify, corrupt), corrupt)
            if info is not None:
                out[kind][exp] = info
    return out


def _train_entry(store: "Store", m: int, verify: bool, corrupt: list[dict[str, Any]]) -> dict[str, Any] | None:
    group = node(store.root, f"train/{m}")
    if group is None:  # a directory that is not a zarr group
        return None
    rows = _rows(store, f"train/{m}", ["features", "out_to_loss", "nonfinite"], 0)
    ok = _intact(rows, f"train/{m}", verify, corrupt)
    nonfinite = rows.data["nonfinite"]
    skipped = _guard(lambda: int(read_checked(nonfinite, slice(None), 0, stored=False).sum()), corrupt)
    return {
        "model_id": m, "checkpoint": group.attrs.get("checkpoint"), "sha256": group.attrs.get("sha256"),
        "rows_done": int(sum(rows.rows(int(c))[1] - rows.rows(int(c))[0] for c in np.flatnonzero(ok))),
        "rows_partial": _partial_rows(group, rows, ok, verify), "rows_total": rows.n_rows,
        "chunks_done": int((ok != 0).sum()), "chunks_total": rows.n_chunks, "nonfinite_skipped": skipped,
        "kernel": _guard(lambda: _kernel(store, m, verify, corrupt), corrupt),
        "bytes_on_disk": disk_usage(store.path / "train" / str(m)),
    }


def _partial_rows(group: Any, rows: ChunkedRows, ok: np.ndarray, verify: bool) -> int:
    """Rows of train chunks not done (``rows_done``) that a rerun of `trak featurize` keeps: their chunk files
    present (with ``verify``, read back intact); the others are no damage (nothing marks them done)."""
    try:
        rows.progress = node(group, "rows_done")
    except StoreCorruptError:
        return 0
    if rows.progress is None or int(rows.progress.shape[0]) != len(ok):
        return 0
    kept = 0
    for c, n in rows.partial([int(c) for c in np.flatnonzero(ok == 0)]).items():
        lo = rows.rows(c)[0]
        try:
            if verify:
                for name in rows.data:
                    rows.read(name, lo, lo + n)
            elif any(missing_chunks(arr, (slice(lo, lo + n),)) for arr in rows.data.values()):
                continue
        except StoreCorruptError:
            continue
        kept += n
    return kept


def _kernel(store: "Store", m: int, verify: bool, corrupt: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The kernel's attributes if it is complete and intact (checked like any array), else None."""
    path = f"train/{m}/kernel"
    arr = node(store.root, path)
    if arr is None or "lambda_reg" not in arr.attrs:
        return None
    if verify:
        read_checked(arr, slice(None), 0)
    elif missing_chunks(arr):
        corrupt.append(_entry(StoreCorruptError(
            f"store array {path} is missing its chunk file; {repair_command(path)}", path, [0])))
        return None
    return dict(arr.attrs)


#: The done-tracked arrays of an experiment's derived groups that ``trak inspect`` counts.
DERIVED = {"top_k": ["proponents", "proponent_scores", "opponents", "opponent_scores"],
           "per_token": ["target_tokens", "document_tokens"]}


def _experiment_entry(store: "Store", kind: str, exp: str, verify: bool,
                      corrupt: list[dict[str, Any]]) -> dict[str, Any] | None:
    g = node(store.root, f"{kind}/{exp}")
    if g is None:
        return None
    info: dict[str, Any] = {"attrs": dict(g.attrs), "bytes_on_disk": disk_usage(store.path / kind / exp)}
    if kind == "targets":
        for m in child_names(g):
            _intact(_rows(store, f"targets/{exp}/{m}", ["features"], 0), f"targets/{exp}/{m}", verify, corrupt)
        return info
    if isinstance(g.attrs.get(STALE_ATTR), dict):
        info["stale"] = {**g.attrs[STALE_ATTR], "message": str(stale_error(store, exp))}

    def progress(group: str, names: list[str], axis: int) -> dict[str, Any]:
        rows = _rows(store, group, names, axis)
        ok = _intact(rows, group, verify, corrupt)
        return {"shape": list(rows.data[names[0]].shape), "chunks_done": int((ok != 0).sum()),
                "chunks_total": int(ok.size)}

    for sub, names in DERIVED.items():
        if node(g, sub) is not None:
            info[sub] = progress(f"scores/{exp}/{sub}", names, 0)
    if node(g, "scores") is not None:
        info.update(progress(f"scores/{exp}", ["scores"], 1))
    return info


def _rows(store: "Store", group: str, names: list[str], axis: int) -> ChunkedRows:
    """The done-tracked arrays of ``group`` as :class:`ChunkedRows` (shapes read from the arrays themselves);
    StoreCorruptError if one of them or ``done`` is missing (its ``zarr.json`` or the whole array)."""
    data = {}
    for name in [*names, "done"]:
        arr = node(store.root, f"{group}/{name}")
        if arr is None or not hasattr(arr, "shape"):
            raise _lost(store, f"{group}/{name}", "array")
        data[name] = arr
    done = data.pop("done")
    first = next(iter(data.values()))
    return ChunkedRows(data, done, int(first.chunks[axis]), int(first.shape[axis]), axis)


def _lost(store: "Store", path: str, kind: str) -> StoreCorruptError:
    """The error of a group or array the store's records imply that is missing (or has lost its ``zarr.json``)."""
    what = "has lost its metadata (zarr.json)" if (store.path / path).exists() else "is missing"
    return StoreCorruptError(f"store {kind} {path} {what}; {repair_command(path)}", path)


def _implied(store: "Store", corrupt: list[dict[str, Any]]) -> None:
    """Append to ``corrupt`` every group the store's records imply that is missing or incomplete. The records: an
    experiment's ``checkpoints`` (the sha256 of model_id 0..M-1 its target features and scores were made from) implies
    ``train/<m>`` holding those checkpoints' features and ``targets/<experiment>/<m>``; the train groups imply every
    smaller model_id (model_ids count from 0); a directory under ``train``, ``targets/<experiment>`` or ``scores`` is a
    group that must have its metadata; a train group must record its checkpoint's sha256. Arrays missing inside a
    present group are found where the group is read."""
    known = {e["array"] for e in corrupt}

    def add(e: StoreCorruptError) -> None:
        if e.array not in known:
            known.add(e.array)
            corrupt.append(_entry(e))

    train_dirs = [int(k) for k in _dirs(store, "train") if k.isdigit()]
    shas: dict[int, str | None] = {m: None for m in range(max(train_dirs) + 1)} if train_dirs else {}
    experiments: dict[str, list[Any]] = {}
    for kind in ("targets", "scores"):
        for exp in _dirs(store, kind):
            try:
                g = node(store.root, f"{kind}/{exp}")
            except StoreCorruptError:
                continue  # reported where the experiment is read
            if g is None:
                add(_lost(store, f"{kind}/{exp}", "group"))
                continue
            recorded = g.attrs.get("checkpoints")
            if not isinstance(recorded, list):
                add(StoreCorruptError(
                    f"store group {kind}/{exp} records no checkpoints (its creation was interrupted); "
                    f"{repair_command(f'{kind}/{exp}')}", f"{kind}/{exp}"))
                continue
            experiments[f"{kind}/{exp}"] = recorded
            for m, sha in enumerate(recorded):
                shas[m] = shas.get(m) or sha
            for name in _dirs(store, f"{kind}/{exp}"):  # arrays and subgroups, each with its metadata
                if node(g, name) is None:
                    add(_lost(store, f"{kind}/{exp}/{name}", "group" if kind == "targets" else "node"))
            if kind == "targets":
                for m in range(len(recorded)):
                    if node(g, str(m)) is None:
                        add(_lost(store, f"targets/{exp}/{m}", "group"))
    for m in sorted(shas):
        path = f"train/{m}"
        try:
            group = node(store.root, path)
        except StoreCorruptError:
            continue  # reported where the train group is read
        if group is None:
            add(_lost(store, path, "group"))
            continue
        for name in _dirs(store, path):
            if node(group, name) is None:
                add(_lost(store, f"{path}/{name}", "array"))
        sha = group.attrs.get("sha256")
        if sha is None:
            add(StoreCorruptError(
                f"store group {path} records no checkpoint sha256 (its features cannot be traced to a checkpoint); "
                f"{repair_command(path)}", path))
        for exp, recorded in experiments.items():
            if m < len(recorded) and sha is not None and recorded[m] != sha:
                add(StoreCorruptError(
                    f"{exp} was made from checkpoint sha256 {str(recorded[m])[:12]} for model_id {m}, but {path} "
                    f"holds the features of sha256 {sha[:12]}; {repair_command(exp)}", exp))


def _dirs(store: "Store", path: str) -> list[str]:
    """Names of the directories below store path ``path``, whatever their metadata (empty if ``path`` is absent)."""
    base = store.path / path
    try:
        return sorted(p.name for p in base.iterdir() if p.is_dir())
    except OSError:
        return []


def _intact(rows: ChunkedRows, group: str, verify: bool, corrupt: list[dict[str, Any]]) -> np.ndarray:
    """The done flags with damaged chunks cleared; each damaged array appended to ``corrupt``."""
    flags = rows.flags()
    damaged = rows.damaged(read=verify, flags=flags)
    flags = flags.copy()
    for name, bad in damaged.items():
        path = f"{group}/{name}"
        what = "missing or corrupt chunks" if verify else "missing chunks"
        what = "unreadable done flags" if name == "done" else what
        corrupt.append(_entry(StoreCorruptError(f"store array {path}: {what} {bad[:10]}; {repair_command(path)}",
                                                path, bad)))
        flags[bad] = 0
    return flags


def _entry(e: StoreCorruptError) -> dict[str, Any]:
    return {"array": e.array, "chunks": list(e.chunks), "message": str(e), "repair": repair_command(e.array)}


def _guard(fn: Any, corrupt: list[dict[str, Any]]) -> Any:
    """``fn()``, or None with the damage appended to ``corrupt`` if it meets a damaged array or unreadable metadata."""
    try:
        return fn()
    except StoreCorruptError as e:
        corrupt.append(_entry(e))
        return None
