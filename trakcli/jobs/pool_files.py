"""The rows `trak select` keeps, written in the pool's own format (:func:`write_rows`: JSONL, CSV, Parquet / Arrow,
``.pt`` / ``.npz`` tensors) beside their scores (:func:`write_scores`), and the checks of ``select.out``."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from trakcli.data.load import load_dataset
from trakcli.data.sources import data_files
from trakcli.errors import ConfigError, DataError
from trakcli.files import atomic_open, atomic_path, atomic_torch_save

#: The output suffixes each kind of pool is written as.
OUT_SUFFIXES = {"jsonl": (".jsonl",), "csv": (".csv",), "table": (".parquet", ".arrow"), "pt": (".pt", ".pth"),
                "npz": (".npz",)}


def pool_kind(section: Any) -> str:
    """The kind of file a ``data.train`` section reads: ``jsonl``, ``csv``, ``table`` (.parquet, .arrow, a
    datasets folder), ``pt`` (a .pt dict of tensors or the built-in digits) or ``npz``."""
    if section.builtin is not None:
        return "pt"
    if isinstance(section.path, list):
        raise ConfigError(f"data.train.path is a list of {len(section.path)} files; trak select writes the selected "
                          "rows in the format of one pool file: join the files into one, or select from each")
    suffix = Path(str(section.path)).suffix.lower()
    if section.text_source is None:
        return "npz" if suffix == ".npz" else "pt"
    return {".jsonl": "jsonl", ".csv": "csv"}.get(suffix, "table")


def scores_path(out: Path) -> Path:
    """Where the selected rows' scores go: ``<out stem>.scores.jsonl`` beside ``out``."""
    return out.with_name(out.stem + ".scores.jsonl")


def check_out(section: Any, out: Path | None) -> Path:
    """``select.out`` checked before any work: set, in a writable folder, of a suffix of the pool's format, not the
    pool itself.

    Raises:
        ConfigError: what is wrong with it and the fix.
    """
    kind = pool_kind(section)
    if out is None:
        raise ConfigError("select.out is unset: name the file the selected rows go to, e.g. select.out=selected"
                          + OUT_SUFFIXES[kind][0])
    where = f"select.out {out}"
    if out.suffix.lower() not in OUT_SUFFIXES[kind]:
        what = {"jsonl": "a .jsonl file", "csv": "a .csv file", "table": "a table (.parquet, .arrow or a datasets "
                "folder)", "pt": "tensors (.pt)", "npz": "tensors (.npz)"}[kind]
        raise ConfigError(f"{where}: data.train is {what}, written as {' or '.join(OUT_SUFFIXES[kind])}; give "
                          f"select.out that suffix (the pool's own format, which its training tools read)")
    parent = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise ConfigError(f"{where} is a directory; name a file")
    if parent.exists() and not parent.is_dir():
        raise ConfigError(f"{where}: {parent} is a file, not a directory; choose another path")
    if not parent.is_dir():
        raise ConfigError(f"{where}: directory {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ConfigError(f"{where}: cannot write to {parent if not out.exists() else out} (permission denied); "
                          "choose another path")
    if section.path is not None and not str(section.path).startswith("hf://") and out.resolve() == Path(
            section.path).resolve():
        raise ConfigError(f"{where} is data.train itself; choose another path (the pool is read, never rewritten)")
    return out


def write_rows(section: Any, rows: np.ndarray, out: Path) -> None:
    """Write pool rows ``rows`` (``[k]`` int64, ascending) to ``out`` in the pool's format, atomically: a
    ``.jsonl``'s lines or a ``.csv``'s header and records byte for byte; a table's columns as ``.parquet`` or
    ``.arrow`` (an Arrow IPC stream, what ``datasets`` writes); a tensor file's keys (``inputs``, ``labels``)
    indexed, same keys and dtypes (the built-in digits: ``{"inputs": [k, 64], "labels": [k]}``).

    Raises:
        DataError: the pool file cannot be read; pyarrow missing for a table.
        ConfigError: ``out`` has no suffix of the pool's format (:func:`check_out`).
    """
    kind = pool_kind(section)
    check_out(section, out)
    if section.builtin is not None:
        pool = load_dataset(section, key="data.train")
        idx = torch.from_numpy(rows)
        atomic_torch_save({"inputs": pool.inputs[idx], "labels": pool.labels[idx]}, out)
        return
    files = data_files(section.path, key="data.train")
    if kind in ("pt", "npz"):
        contents = read_tensors(files[0])
        keys = ([section.inputs] if isinstance(section.inputs, str) else list(section.inputs)) + [section.labels]
        picked = {k: contents[k][torch.from_numpy(rows) if torch.is_tensor(contents[k]) else rows] for k in keys}
        if kind == "pt":
            atomic_torch_save(picked, out)
        else:
            with atomic_path(out) as tmp:
                np.savez(tmp, **picked)
        return
    if kind == "jsonl" and len(files) == 1 and files[0].suffix.lower() == ".jsonl":
        _copy_lines(files[0], rows, out)
    elif kind == "csv" and len(files) == 1 and files[0].suffix.lower() == ".csv":
        _copy_csv(files[0], rows, out)
    else:
        _write_table(files, rows, out)


def read_tensors(path: Path) -> dict[str, Any]:
    """A ``.pt`` dict of tensors or an ``.npz`` file, as stored."""
    try:
        if path.suffix.lower() == ".npz":
            with np.load(path, allow_pickle=False) as f:
                return {k: f[k] for k in f.files}
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (unreadable or corrupt)
        raise DataError(f"cannot read data file {path}: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path} holds a {type(obj).__name__}, not a dict of tensors")
    return obj


def _copy_lines(path: Path, rows: np.ndarray, out: Path) -> None:
    """The non-blank lines ``rows`` of a ``.jsonl`` file (its rows), byte for byte, each ending in a newline."""
    keep = set(rows.tolist())
    row = 0
    with open(path, "rb") as src, atomic_open(out, "wb") as dst:
        for line in src:
            if not line.strip():
                continue
            if row in keep:
                dst.write(line if line.endswith(b"\n") else line + b"\n")
            row += 1


def _copy_csv(path: Path, rows: np.ndarray, out: Path) -> None:
    """The header and the records ``rows`` of a ``.csv`` file, byte for byte (a quoted field may span lines)."""
    keep = set(rows.tolist())
    with open(path, encoding="utf-8", newline="") as f:
        lines = f.readlines()
    reader = csv.reader(iter(lines))
    with atomic_open(out, "w", encoding="utf-8", newline="") as dst:
        start, row, header = 0, 0, True
        for record in reader:
            end = reader.line_num
            if header:
                dst.writelines(lines[start:end])
                header = False
            elif record:  # blank lines are no records (csv.DictReader skips them)
                if row in keep:
                    text = "".join(lines[start:end])
                    dst.write(text if text.endswith(("\n", "\r")) else text + "\n")
                row += 1
            start = end


def _write_table(files: Sequence[Path], rows: np.ndarray, out: Path) -> None:
    """Every column of rows ``rows`` of one table (``.parquet`` / ``.arrow`` files, datasets folders) to ``out``."""
    try:
        import pyarrow as pa
        import pyarrow.ipc as ipc
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("writing the selected rows of a table needs pyarrow: pip install pyarrow") from None

    def read(path: Path) -> list[Any]:
        if path.is_dir():
            state = json.loads((path / "state.json").read_text(encoding="utf-8"))
            return [t for f in state["_data_files"] for t in read(path / f["filename"])]
        if path.suffix.lower() == ".parquet":
            return [pq.read_table(path)]
        try:
            return [ipc.open_stream(pa.memory_map(str(path))).read_all()]
        except Exception:  # noqa: BLE001  (the other Arrow IPC layout)
            return [ipc.open_file(pa.memory_map(str(path))).read_all()]

    try:
        table = pa.concat_tables([t for f in files for t in read(f)]).take(pa.array(rows))
    except Exception as e:  # noqa: BLE001
        raise DataError(f"data.train: cannot read {', '.join(map(str, files))}: {type(e).__name__}: {e}") from None
    with atomic_path(out) as tmp:
        if out.suffix.lower() == ".parquet":
            pq.write_table(table, tmp)
        else:
            with pa.OSFile(str(tmp), "wb") as sink, ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)


def write_scores(path: Path, sel: Any) -> None:
    """The sidecar of a :class:`~trakcli.jobs.select.Selection`'s rows, one JSON line each in pool order: ``row`` (0-based in data.train),
    ``rank`` (1 = best), ``score`` and, with several target groups, ``group`` (the one of the highest score;
    with ``select.quota`` the one that kept the row, whose score ``score`` is)."""
    rank = {int(r): i + 1 for i, r in enumerate(sel.ranked)}
    with atomic_open(path, "w", encoding="utf-8") as f:
        for r in sel.rows.tolist():
            line: dict[str, Any] = {"row": r, "rank": rank[r], "score": float(sel.scores[r])}
            if len(sel.groups) > 1:
                line["group"] = sel.groups[int(sel.best_group[r])]
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
