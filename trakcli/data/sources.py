"""Rows of text data files, read as a batch needs them: ``.jsonl`` (byte offsets of its lines), ``.csv``,
``.parquet`` / ``.arrow`` files and Hugging Face ``save_to_disk`` folders (columnar tables, memory-mapped where
possible), local or on the Hugging Face Hub (:func:`data_files`), and the checks of a row's field values.
:class:`trakcli.data.text.TextDataset` tokenizes what these give.
"""

from __future__ import annotations

import csv
import json
from array import array
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from trakcli.errors import DataError
from trakcli.models.hub import is_hub_url, resolve_hub_dataset


# --- reading rows -----------------------------------------------------------------------------------


class _JsonlRows:
    """A ``.jsonl`` file held as the byte offsets of its non-blank lines; rows are parsed when read."""

    def __init__(self, path: Path, key: str):
        self.path, self.key = path, key
        offsets = array("q")
        pos = 0
        try:
            with open(path, "rb") as f:
                for line in f:
                    if line.strip():
                        offsets.append(pos)
                    pos += len(line)
        except OSError as e:
            raise DataError(f"{key}: cannot read {path}: {e}") from None
        self.offsets = np.frombuffer(offsets, dtype=np.int64) if len(offsets) else np.zeros(0, np.int64)  # [n]
        self.size = pos

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    def fields(self) -> list[str]:
        return sorted(self.read(0, 1)[0]) if len(self) else []

    def read(self, lo: int, hi: int) -> list[dict[str, Any]]:
        if hi <= lo:
            return []
        start = int(self.offsets[lo])
        end = int(self.offsets[hi]) if hi < len(self) else self.size
        try:
            with open(self.path, "rb") as f:
                f.seek(start)
                data = f.read(end - start)
        except OSError as e:
            raise DataError(f"{self.key}: cannot read {self.path}: {e}") from None
        lines = [line for line in data.split(b"\n") if line.strip()]
        if len(lines) != hi - lo:
            raise DataError(f"{self.key}: {self.path} changed while it was read (rows {lo}..{hi - 1}); "
                            "keep the data file unchanged during a run")
        return [self._parse(line, lo + j) for j, line in enumerate(lines)]

    def take(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        out = []
        try:
            with open(self.path, "rb") as f:
                for i in indices:
                    f.seek(int(self.offsets[i]))
                    out.append(self._parse(f.readline(), int(i)))
        except OSError as e:
            raise DataError(f"{self.key}: cannot read {self.path}: {e}") from None
        return out

    def _parse(self, line: bytes, row: int) -> dict[str, Any]:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            problem = f"is not valid JSON ({e.msg})"
        except UnicodeDecodeError as e:
            problem = f"is not UTF-8 ({e.reason})"
        else:
            if isinstance(rec, dict):
                return rec
            problem = f"is a {type(rec).__name__}, not a JSON object"
        raise DataError(f"{self.key}: {self.path} line {self._line_number(row)} {problem}") from None

    def _line_number(self, row: int) -> int:
        """1-based line number of ``row`` (counts the newlines before it; only for messages)."""
        remaining, count = int(self.offsets[row]), 0
        with open(self.path, "rb") as f:
            while remaining > 0:
                block = f.read(min(remaining, 1 << 20))
                if not block:
                    break
                count += block.count(b"\n")
                remaining -= len(block)
        return count + 1


class _TableRows:
    """A pyarrow table (of the needed columns only); rows are sliced out and converted when read."""

    def __init__(self, table: Any, names: list[str], needed: list[str]):
        self.names = names
        self.columns = [c for c in dict.fromkeys(needed) if c in names]
        self.n = int(table.num_rows)
        self.table = table.select(self.columns)

    def __len__(self) -> int:
        return self.n

    def fields(self) -> list[str]:
        return sorted(self.names)

    def read(self, lo: int, hi: int) -> list[dict[str, Any]]:
        hi = min(hi, self.n)
        if not self.columns:  # none of the fields exists: rows without them, for the message
            return [{} for _ in range(max(0, hi - lo))]
        return self.table.slice(lo, max(0, hi - lo)).to_pylist()

    def take(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        return self.table.take(list(indices)).to_pylist() if self.columns else [{} for _ in indices]


class _ListRows:
    """Records held in memory (``.csv``)."""

    def __init__(self, records: list[dict[str, Any]], names: list[str]):
        self.records, self.names = records, names

    def __len__(self) -> int:
        return len(self.records)

    def fields(self) -> list[str]:
        return sorted(k for k in (self.records[0] if self.records else {}) if k is not None) or sorted(self.names)

    def read(self, lo: int, hi: int) -> list[dict[str, Any]]:
        return self.records[lo:hi]

    def take(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        return [self.records[i] for i in indices]


class _ConcatRows:
    """The rows of several data files read as one dataset: those of the first file, then of the second, ..."""

    def __init__(self, parts: list[Any]):
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])  # [n_files + 1] first row of each file, then n

    def __len__(self) -> int:
        return int(self.starts[-1])

    def fields(self) -> list[str]:
        return self.parts[0].fields()

    def read(self, lo: int, hi: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for part, start in zip(self.parts, self.starts[:-1].tolist()):
            a, b = max(lo, start), min(hi, start + len(part))
            if a < b:
                out += part.read(a - start, b - start)
        return out

    def take(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        where = np.searchsorted(self.starts, np.asarray(list(indices), dtype=np.int64), side="right") - 1
        return [self.parts[f].take([int(i) - int(self.starts[f])])[0] for i, f in zip(indices, where.tolist())]


def _arrow_table(path: Path, key: str, needed: list[str]) -> tuple[Any, list[str]]:
    """The columns ``needed`` (those present) of a datasets folder, ``.parquet`` or ``.arrow`` file (memory-mapped:
    rows are paged in as they are read), and the names of all its columns.

    Raises:
        DataError: pyarrow missing, a ``DatasetDict`` folder (names its splits), or an unreadable file.
    """
    try:
        import pyarrow as pa
        import pyarrow.ipc as ipc
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{key}: reading {path} needs pyarrow: pip install pyarrow (or datasets)") from None
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
            raise DataError(f"{key}: {path} holds the splits {splits} (a DatasetDict); set path to one of them, "
                            f"e.g. {path / (splits[0] if splits else 'train')}")
        try:
            state = json.loads((path / "state.json").read_text(encoding="utf-8"))
            files = [path / f["filename"] for f in state["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{key}: {path} is not a Hugging Face datasets save_to_disk folder "
                            f"(no readable state.json: {e})") from None
        return _concat_tables(files, key, needed, str(path))
    try:
        if path.suffix.lower() == ".parquet":
            names = list(pq.read_schema(path).names)
            table = pq.read_table(path, columns=[c for c in dict.fromkeys(needed) if c in names], memory_map=True)
            return table, names
        source = pa.memory_map(str(path))
        try:
            table = ipc.open_stream(source).read_all()  # what datasets writes
        except Exception:  # noqa: BLE001  (the other Arrow IPC layout)
            table = ipc.open_file(pa.memory_map(str(path))).read_all()
        return table, list(table.column_names)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{key}: cannot read {path}: {e.__class__.__name__}: {e}") from None


def _concat_tables(files: Sequence[Path], key: str, needed: list[str], where: str) -> tuple[Any, list[str]]:
    """The columns ``needed`` of several ``.parquet`` / ``.arrow`` files (shards of one table) joined in order,
    and the names of the first one's columns (raises as :func:`_arrow_table`; ``where`` names them in messages)."""
    import pyarrow as pa  # _arrow_table said how to install it

    parts = [_arrow_table(f, key, needed) for f in files]
    if not parts:
        raise DataError(f"{key}: {where} has no rows; it needs at least one text")
    names = parts[0][1]
    keep = [c for c in dict.fromkeys(needed) if c in names]
    try:  # without any needed column, a column of nulls keeps each part's row count (for the message)
        return pa.concat_tables([t.select(keep) if keep else pa.table({"row": pa.nulls(t.num_rows)})
                                 for t, _ in parts]), names
    except Exception as e:  # noqa: BLE001  (files with different columns)
        raise DataError(f"{key}: the files of {where} do not hold the same columns: {e}") from None


def data_files(path: str | Path | Sequence[str | Path], *, key: str = "data.train") -> list[Path]:
    """The local files (or folder) a data path names: ``[Path(path)]``, or for a Hugging Face Hub dataset
    ``hf://datasets/ORG/NAME[@REVISION][/PATH]`` the files picked in its snapshot in the Hugging Face cache
    (:func:`trakcli.models.hub.resolve_hub_dataset`, which raises a DataError when they cannot be had); for a
    list of paths, the files of each in order."""
    if isinstance(path, (list, tuple)):
        return [f for p in path for f in data_files(p, key=key)]
    if is_hub_url(path):
        return resolve_hub_dataset(str(path), key=key)
    return [Path(path)]


def open_rows(
    path: Path | Sequence[Path], key: str, needed: list[str], *, where: str | None = None,
) -> _JsonlRows | _TableRows | _ListRows:
    """The rows of a data file or folder, of several ``.parquet`` / ``.arrow`` shards read as one table, or
    of several files of any kind read one after the other (:class:`_ConcatRows`)."""
    if not isinstance(path, Path):
        paths = list(path)
        if len(paths) != 1:
            if all(p.suffix.lower() in (".parquet", ".arrow") for p in paths):
                return _TableRows(*_concat_tables(paths, key, needed, where or str(paths[0].parent)), needed)
            return _ConcatRows([open_rows(p, key, needed) for p in paths])
        path = paths[0]
    suffix = path.suffix.lower()
    if path.is_dir() or suffix in (".parquet", ".arrow"):
        return _TableRows(*_arrow_table(path, key, needed), needed)
    if suffix == ".jsonl":
        return _JsonlRows(path, key)
    if suffix == ".csv":
        try:
            with open(path, encoding="utf-8", newline="") as f:
                reader = csv.DictReader(f)
                records = list(reader)
                return _ListRows(records, list(reader.fieldnames or []))
        except (OSError, UnicodeDecodeError, csv.Error) as e:
            raise DataError(f"{key}: cannot read {path}: {e}") from None
    raise DataError(f"{key}: text data file {path} has suffix {suffix!r}; use .jsonl or .csv "
                    "(or .parquet, .arrow, a datasets folder)")


# --- checking values --------------------------------------------------------------------------------


def int_label(value: Any, row: int, field: str, key: str) -> int:
    try:
        f = float(value)
        if f == int(f) and int(f) >= 0:
            return int(f)
    except (TypeError, ValueError, OverflowError):
        pass
    raise DataError(f"{key}: row {row} has {field}={value!r}; labels must be integer class indices >= 0 (map names to "
                    "0, 1, ...)")


def _cell(value: Any) -> Any:
    """A value as read, or for ``.csv`` cells the JSON its text holds."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            pass
    return value


def _shown(value: Any, limit: int) -> str:
    return repr(value) if len(repr(value)) <= limit else repr(value)[: limit - 3] + "..."


def int_list(value: Any, row: int, field: str, key: str, what: str) -> list[int]:
    """A list of integers (a list, array, or for ``.csv`` cells its JSON text)."""
    value = _cell(value)
    arr = np.asarray(value) if isinstance(value, (list, tuple, np.ndarray)) else None
    if arr is not None and arr.ndim == 1 and arr.size and (
            arr.dtype.kind in "iu" or arr.dtype.kind == "f" and np.all(arr == np.round(arr))):
        return arr.astype(np.int64).tolist()
    raise DataError(f"{key}: row {row} has {field}={_shown(value, 60)}; {what} must be a non-empty list of integers")


def chat_messages(value: Any, row: int, field: str, key: str) -> list[dict[str, Any]]:
    """A conversation: a non-empty list of ``{role, content}`` dicts with at least one assistant turn."""
    value = _cell(value)
    ok = isinstance(value, (list, tuple)) and len(value) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value
    )
    if not ok:
        raise DataError(f"{key}: row {row} has {field}={_shown(value, 80)}; messages must be a non-empty list of "
                        '{"role": ..., "content": ...} objects')
    if not any(m["role"] == "assistant" for m in value):
        roles = [m["role"] for m in value]
        raise DataError(f"{key}: row {row} has no assistant turn (roles {roles}); the assistant turns are the "
                        "targets of messages data, so every conversation needs one")
    return [{k: v for k, v in m.items() if v is not None or k == "content"} for m in value]


def shorten(text: str, max_chars: int | None) -> str:
    text = " ".join(text.split())
    if max_chars is not None and len(text) > max_chars:
        return text[: max(1, max_chars - 1)] + "…"
    return text


def message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        return " ".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def field_values(path: str | Path, field: str, *, key: str = "data.target", block: int = 4096) -> list[Any]:
    """The value of ``field`` in every row of a text data file, in row order (None where a row lacks it), read
    ``block`` rows at a time: extra per-row fields the model never sees (the source documents of a query).

    Raises:
        DataError: the file cannot be read (names ``key`` and the file).
    """
    rows = open_rows(data_files(path, key=key), key, [field], where=str(path))
    out: list[Any] = []
    for lo in range(0, len(rows), block):
        out += [rec.get(field) for rec in rows.read(lo, min(lo + block, len(rows)))]
    return out


