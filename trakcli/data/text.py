"""Text and language-model data, read and tokenized lazily: :class:`TextDataset`.

Sources: a ``.jsonl`` file (one JSON object per line), a ``.csv`` file (a header
row), a ``.parquet`` or ``.arrow`` file, or a Hugging Face datasets
``save_to_disk`` folder; or any of them on the Hugging Face Hub,
``hf://datasets/ORG/NAME[@REVISION][/PATH]`` (:func:`data_files`; several
``.parquet`` / ``.arrow`` shards are read as one table). Rows name their fields
in one of four ways:

* ``text`` + ``labels``: text classification; the text (with ``text_pair``, the
  tokenizer's pair) is the input, the label a class index (labels ``[b]``).
* ``text``: language modeling; every real token is a target.
* ``prompt`` + ``completion``: the prompt's tokens (with the tokenizer's special
  tokens), then the completion's (without), then the end-of-sequence token; the
  completion and the end-of-sequence token are the targets.
* ``messages``: a list of ``{role, content}`` rendered by the tokenizer's chat
  template; the tokens of the assistant turns are the targets.
* ``input_ids`` (+ ``labels``): pre-tokenized ids, with per-token labels or every
  token a target.

Per-token labels follow the convention of transformers, TRL and Bergson: they are
*unshifted*, ``labels[t] = input_ids[t]`` where token ``t`` is a target and ``-100``
elsewhere (padding included); the model's prediction at ``t - 1`` is scored against
``labels[t]``.

``max_length`` cuts each row on the right; ``None`` keeps every row whole (each row its own length,
up to what the tokenizer says its model takes). The train and target data may have different
``max_length``: every gradient is one example's, so a short query and long training documents
are scored together (:func:`check_target_inputs`).

Memory does not grow with ``n x max_length``: a ``.jsonl`` file is held as the
byte offsets of its lines (``[n]`` int64, from one streaming pass), Arrow and
Parquet data as a (memory-mapped where possible) columnar table with only the
fields read, a ``.csv`` file as its records. Rows are read and tokenized when a
batch needs them and padded to the batch's own longest row.
"""

from __future__ import annotations

import csv
import hashlib
import json
from array import array
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from trakcli.data.tensors import batch_fits
from trakcli.errors import DataError, ModelError, StoreError
from trakcli.labels import IGNORE_INDEX
from trakcli.models.hf import import_transformers, resolve_hf_path
from trakcli.models.hub import is_hub_url, resolve_hub_dataset

#: Rows read and tokenized at once inside :meth:`TextDataset.batches` (bounds the memory of one call).
WINDOW_ROWS = 1024

#: Rows checked when a :class:`TextDataset` is built, so a wrong field name fails at once.
CHECKED_ROWS = 8

#: Bumped when the tokens or labels made from the same rows change (part of the fingerprint).
TOKENIZATION_VERSION = 1

#: Files of a tokenizer directory that fix its tokenization (hashed by :meth:`TextDataset.fingerprint`).
_TOKENIZER_PREFIXES = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens", "chat_template",
                       "spiece", "sentencepiece", "spm")
_TOKENIZER_SUFFIXES = (".model", ".tiktoken", ".jinja")

#: Tokenizers without a real length limit report this many tokens or more as ``model_max_length``.
NO_LENGTH_LIMIT = 10**9

#: How each kind of data is named in messages.
_KIND_NAMES = {"text": "text", "prompt": "prompt + completion", "messages": "messages", "input_ids": "input_ids"}


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
            where = f"{self.key}: {self.path} line {self._line_number(row)}"
            raise DataError(f"{where} is not valid JSON ({e.msg})") from None
        except UnicodeDecodeError as e:
            where = f"{self.key}: {self.path} line {self._line_number(row)}"
            raise DataError(f"{where} is not UTF-8 ({e.reason})") from None
        if not isinstance(rec, dict):
            raise DataError(f"{self.key}: {self.path} line {self._line_number(row)} is a {type(rec).__name__}, "
                            "not a JSON object")
        return rec

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
    """The columns ``needed`` (those present) of a datasets folder, ``.parquet`` or ``.arrow`` file, and the
    names of all its columns.

    Arrow files are memory-mapped (datasets writes them uncompressed), so their rows are
    paged in as they are read.

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
    """The local files (or folder) a data path names: ``[Path(path)]``, or for a Hugging Face Hub
    dataset ``hf://datasets/ORG/NAME[@REVISION][/PATH]`` the files picked in its snapshot in the
    Hugging Face cache (downloaded first unless ``HF_HUB_OFFLINE`` is set; which files:
    :func:`trakcli.models.hub.dataset_files`); for a list of paths, the files of each in order.

    Raises:
        DataError: a Hub URL that is malformed, names no usable files, or can neither be downloaded
            nor found in the cache (naming the repository, the cache folder and the fixes).
    """
    if isinstance(path, (list, tuple)):
        return [f for p in path for f in data_files(p, key=key)]
    if is_hub_url(path):
        return resolve_hub_dataset(str(path), key=key)
    return [Path(path)]


def _open_rows(
    path: Path | Sequence[Path], key: str, needed: list[str], *, where: str | None = None,
) -> _JsonlRows | _TableRows | _ListRows:
    """The rows of a data file or folder, of several ``.parquet`` / ``.arrow`` shards read as one table, or
    of several files of any kind read one after the other (:class:`_ConcatRows`)."""
    if not isinstance(path, Path):
        paths = list(path)
        if len(paths) != 1:
            if all(p.suffix.lower() in (".parquet", ".arrow") for p in paths):
                return _TableRows(*_concat_tables(paths, key, needed, where or str(paths[0].parent)), needed)
            return _ConcatRows([_open_rows(p, key, needed) for p in paths])
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


def _int_label(value: Any, row: int, field: str, key: str) -> int:
    try:
        f = float(value)
        if f == int(f) and int(f) >= 0:
            return int(f)
    except (TypeError, ValueError, OverflowError):
        pass
    raise DataError(
        f"{key}: row {row} has {field}={value!r}; labels must be integer class indices >= 0 (map names to 0, 1, ...)"
    )


def _int_list(value: Any, row: int, field: str, key: str, what: str) -> list[int]:
    """A list of integers (a list, array, or for ``.csv`` cells its JSON text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    arr = np.asarray(value) if isinstance(value, (list, tuple, np.ndarray)) else None
    if arr is not None and arr.ndim == 1 and arr.size and arr.dtype.kind in "iu":
        return arr.astype(np.int64).tolist()
    if arr is not None and arr.ndim == 1 and arr.size and arr.dtype.kind == "f" and np.all(arr == np.round(arr)):
        return arr.astype(np.int64).tolist()
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise DataError(f"{key}: row {row} has {field}={shown}; {what} must be a non-empty list of integers")


def _messages(value: Any, row: int, field: str, key: str) -> list[dict[str, Any]]:
    """A conversation: a non-empty list of ``{role, content}`` dicts with at least one assistant turn."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    ok = isinstance(value, (list, tuple)) and len(value) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value
    )
    if not ok:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise DataError(f"{key}: row {row} has {field}={shown}; messages must be a non-empty list of "
                        '{"role": ..., "content": ...} objects')
    if not any(m["role"] == "assistant" for m in value):
        roles = [m["role"] for m in value]
        raise DataError(f"{key}: row {row} has no assistant turn (roles {roles}); the assistant turns are the "
                        "targets of messages data, so every conversation needs one")
    return [{k: v for k, v in m.items() if v is not None or k == "content"} for m in value]


def _shorten(text: str, max_chars: int | None) -> str:
    text = " ".join(text.split())
    if max_chars is not None and len(text) > max_chars:
        return text[: max(1, max_chars - 1)] + "…"
    return text


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        return " ".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


# --- the tokenizer ----------------------------------------------------------------------------------


def load_tokenizer(spec: str, *, key: str = "data.train.tokenizer") -> Any:
    """A tokenizer from a local directory (see :func:`trakcli.models.hf.resolve_hf_path`), padding on the right.

    A tokenizer without a pad token (GPT-2) pads with its end-of-sequence token.

    Raises:
        DataError: transformers missing, or no tokenizer in the directory.
    """
    try:
        tf = import_transformers()
        path = resolve_hf_path(spec, need="tokenizer")
    except ModelError as e:
        raise DataError(f"{key}: {e}") from None
    try:
        tok = tf.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{key}: no tokenizer can be loaded from {path}: {e.__class__.__name__}: {e}") from None
    tok.padding_side = "right"
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise DataError(f"{key}: the tokenizer in {path} has neither a pad nor an end-of-sequence token")
        tok.pad_token = tok.eos_token
    return tok


def _tokenizer_files(tokenizer: Any) -> list[Path]:
    """The files of the tokenizer's directory that fix its tokenization, sorted by name."""
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    if not folder.is_dir():
        return []
    files = [p for p in folder.rglob("*") if p.is_file() and (
        p.name.lower().startswith(_TOKENIZER_PREFIXES) or p.suffix.lower() in _TOKENIZER_SUFFIXES
        or p.parent.name == "additional_chat_templates")]
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


# --- the dataset ------------------------------------------------------------------------------------


def _row_number(lo: int | Sequence[int], i: int) -> int:
    """The dataset index of the ``i``-th row read: ``lo + i`` for consecutive rows, else ``lo[i]``."""
    return lo + i if isinstance(lo, int) else int(lo[i])


def _cut(windows: Iterable[list[Any]], batch_size: int, max_tokens: int | None) -> Iterator[list[Any]]:
    """Tokenized rows (``row[0]`` the ids) cut greedily into batches (:func:`~trakcli.data.tensors.batch_fits`)."""
    batch: list[Any] = []
    longest = 1
    for window in windows:
        for row in window:
            grown = max(longest, len(row[0]))
            if batch and not batch_fits(len(batch) + 1, grown, batch_size, max_tokens):
                yield batch
                batch, grown = [], max(1, len(row[0]))
            batch.append(row)
            longest = grown
    if batch:
        yield batch


#: One tokenized row: (input_ids, token_type_ids or None, label: class index or per-token labels).
_Row = tuple[list[int], "list[int] | None", "int | list[int]"]


class TextDataset:
    """Text or language-model data, read and tokenized as batches need it (the interface of
    :class:`~trakcli.data.tensors.TensorDataset` that featurize and score use).

    Exactly one of ``text``, ``prompt`` + ``completion``, ``messages`` or ``input_ids``
    names the data (see the module docstring). The first :data:`CHECKED_ROWS` rows are
    read and tokenized when the dataset is built, so a wrong field name, a missing chat
    template or a bad label fails at once; later rows are checked when they are read.

    Args:
        path: a ``.jsonl`` / ``.csv`` / ``.parquet`` / ``.arrow`` file or a datasets ``save_to_disk`` folder,
            or a Hub dataset ``hf://datasets/ORG/NAME[@REVISION][/PATH]`` (:func:`data_files`); or a list of
            them, whose rows are read one file after the other.
        text, text_pair, labels, prompt, completion, messages, input_ids: field names
            (as :class:`trakcli.config.DatasetConfig`).
        tokenizer: a tokenizer directory (:func:`load_tokenizer`) or a loaded tokenizer; optional
            for ``input_ids`` only (padding with id 0, texts shown as ids).
        max_length: most tokens per row; longer rows are cut on the right. ``None``: no cut, each row
            keeps all its tokens; a row longer than the tokenizer's ``model_max_length`` (the
            positions its model has) is then a :class:`DataError` naming it.
        key: the dotted config key, used in error messages.

    Attributes:
        source: the path as given (a Hub URL unchanged), as messages name it.
        path: the local file or folder read (for a Hub dataset, in the Hugging Face cache; the
            first of several shards).
        name: human-readable origin (``"file.jsonl[text]"``).
        kind: ``"text"``, ``"prompt"``, ``"messages"`` or ``"input_ids"``.
        per_token_labels: whether :meth:`batches` yields per-token labels ``[b, L_b]``
            (language modeling) rather than class indices ``[b]`` (text classification).
        input_keys: the keys of the inputs dict, sorted.
        pad_token_id: the id padding is filled with.
        tokenizer: the tokenizer, or ``None``.
        image_shape: always ``None`` (not images).

    Raises:
        DataError: unreadable file, no rows, missing fields (naming the rows and the fields
            there are), bad labels, a tokenizer that is missing or has no chat template, or a Hub
            dataset that cannot be had (:func:`data_files`).
    """

    image_shape = None

    def __init__(
        self,
        path: str | Path | Sequence[str | Path],
        *,
        text: str | None = None,
        text_pair: str | None = None,
        labels: str | None = None,
        prompt: str | None = None,
        completion: str | None = None,
        messages: str | None = None,
        input_ids: str | None = None,
        tokenizer: Any = None,
        max_length: int | None = 128,
        key: str = "data.train",
    ):
        if isinstance(path, (list, tuple)):  # several files, read one after the other
            self.source = ", ".join(p if is_hub_url(p) else str(Path(p)) for p in path)
        else:
            self.source = path if is_hub_url(path) else str(Path(path))
        self.key = key
        self.max_length: int | None = None if max_length is None else int(max_length)
        given = {"text": text, "prompt": prompt if prompt is not None else completion,
                 "messages": messages, "input_ids": input_ids}
        kinds = [k for k, v in given.items() if v is not None]
        if len(kinds) != 1:
            raise DataError(f"{key}: give exactly one of text, prompt + completion, messages or input_ids "
                            f"(got {', '.join(kinds) or 'none'})")
        self.kind = kinds[0]
        if self.kind == "prompt" and (prompt is None or completion is None):
            raise DataError(f"{key}: prompt + completion data need both fields")
        if text_pair is not None and self.kind != "text":
            raise DataError(f"{key}: text_pair is the second text of `text`")
        if labels is not None and self.kind in ("prompt", "messages"):
            raise DataError(f"{key}: labels are not read with {_KIND_NAMES[self.kind]} data")
        if self.max_length is not None and self.max_length < 1:
            raise DataError(f"{key}.max_length: {max_length}; it must be at least 1 (or null: no cut)")
        self.text, self.text_pair, self.label_field = text, text_pair, labels
        self.prompt, self.completion, self.messages, self.input_ids_field = prompt, completion, messages, input_ids
        self.per_token_labels = not (self.kind == "text" and labels is not None)
        fields = {"text": [text, text_pair], "prompt": [prompt, completion], "messages": [messages],
                  "input_ids": [input_ids]}[self.kind] + [labels]
        self.fields: list[str] = [f for f in fields if f is not None]  # must be present in every row

        if isinstance(tokenizer, (str, Path)):
            tokenizer = load_tokenizer(str(tokenizer), key=f"{key}.tokenizer")
        if tokenizer is None and self.kind != "input_ids":
            raise DataError(f"{key}.tokenizer: {_KIND_NAMES[self.kind]} data need a tokenizer (a local Hugging Face "
                            "directory); set tokenizer, or use model.entrypoint 'hf:DIR'")
        self.tokenizer = tokenizer
        if self.kind == "messages" and not getattr(tokenizer, "chat_template", None):
            where = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
            raise DataError(
                f"{key}.tokenizer: the tokenizer in {where} has no chat template, which messages data need to "
                "render conversations; set tokenizer to a folder whose tokenizer_config.json has a chat_template "
                "(e.g. the instruct model's), or give the data as prompt + completion"
            )
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad_token_id = int(pad) if pad is not None else 0
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        pairs = self.kind == "text" and text_pair is not None and tokenizer is not None and (
            "token_type_ids" in getattr(tokenizer, "model_input_names", ()))
        self.input_keys: tuple[str, ...] = ("attention_mask", "input_ids") + (("token_type_ids",) if pairs else ())
        detail = {"text": f"{text}{',' + text_pair if text_pair else ''}", "prompt": f"{prompt},{completion}",
                  "messages": messages, "input_ids": input_ids}[self.kind]
        self.name = f"{self.source}[{detail}]"

        files = data_files(path, key=key)
        self.path = files[0]
        self._rows = _open_rows(files, key, self.fields, where=self.source)
        if not len(self._rows):
            raise DataError(f"{key}: {self.source} has no rows; it needs at least one text")
        self._labels: torch.Tensor | None = None
        self._fingerprint: dict[str, Any] | None = None
        self._padded: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None
        self._longest: int | None = None
        limit = getattr(tokenizer, "model_max_length", None) if tokenizer is not None else None
        #: Most tokens a row may have with ``max_length`` None: the tokenizer's ``model_max_length``, if real.
        self.length_limit: int | None = int(limit) if isinstance(limit, int) and 0 < limit < NO_LENGTH_LIMIT else None
        self._encode(self._rows.read(0, min(CHECKED_ROWS, len(self))), 0)

    @classmethod
    def from_config(cls, cfg: Any, *, key: str = "data.train") -> "TextDataset":
        """The dataset of a :class:`trakcli.config.DatasetConfig` section with ``text``, ``prompt``,
        ``messages`` or ``input_ids`` (raises as the constructor)."""
        if cfg.path is None:
            raise DataError(f"{key}: a text dataset needs `path`")
        return cls(
            cfg.path, text=cfg.text, text_pair=cfg.text_pair, labels=cfg.labels, prompt=cfg.prompt,
            completion=cfg.completion, messages=cfg.messages, input_ids=cfg.input_ids, tokenizer=cfg.tokenizer,
            max_length=cfg.max_length, key=key,
        )

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"TextDataset({self.name}, n={len(self)}, kind={self.kind}, max_length={self.max_length})"

    # --- rows -> values -> tokens ---------------------------------------------------------------------

    def _values(self, rows: list[dict[str, Any]], lo: int | Sequence[int]) -> list[Any]:
        """The checked, JSON-able values of the named fields of rows ``lo, lo + 1, ...`` (what the fingerprint hashes);
        ``lo`` may also be the rows' indices, one per row (rows read out of order).

        Raises:
            DataError: a row lacks a field (``None`` counts as missing), or a value is malformed.
        """
        for field in self.fields:
            bad = [_row_number(lo, i) for i, r in enumerate(rows) if r.get(field) is None]
            if bad:
                raise DataError(
                    f"{self.key}: rows {bad[:5]} of {self.source} have no field {field!r}; the first row's fields are "
                    f"{self._rows.fields()}"
                )
        key, out = self.key, []
        for i, r in enumerate(rows):
            row = _row_number(lo, i)
            if self.kind == "text":
                label = _int_label(r[self.label_field], row, self.label_field, key) if self.label_field else None
                out.append([str(r[self.text]), str(r[self.text_pair]) if self.text_pair else None, label])
            elif self.kind == "prompt":
                out.append([str(r[self.prompt]), str(r[self.completion])])
            elif self.kind == "messages":
                out.append(_messages(r[self.messages], row, self.messages, key))
            else:
                ids = _int_list(r[self.input_ids_field], row, self.input_ids_field, key, "input_ids")
                if min(ids) < 0:
                    raise DataError(f"{key}: row {row} has negative token ids in {self.input_ids_field!r}")
                labels = None
                if self.label_field:
                    labels = _int_list(r[self.label_field], row, self.label_field, key, "per-token labels")
                    if len(labels) != len(ids):
                        raise DataError(
                            f"{key}: row {row} has {len(ids)} {self.input_ids_field!r} but {len(labels)} "
                            f"{self.label_field!r}; per-token labels need one per token (-100: not a target)"
                        )
                    if any(v < 0 and v != IGNORE_INDEX for v in labels):
                        raise DataError(
                            f"{key}: row {row} has {self.label_field!r} values below 0 other than {IGNORE_INDEX}; "
                            f"per-token labels are token ids or {IGNORE_INDEX} (not a target)"
                        )
                out.append([ids, labels])
        return out

    def _encode(self, rows: list[dict[str, Any]], lo: int | Sequence[int]) -> list[_Row]:
        """Rows ``lo, lo + 1, ...`` (or the rows of the indices ``lo``) tokenized and cut to ``max_length``:
        ``(input_ids, token_type_ids, label)``."""
        return self._check_lengths(self._encode_values(self._values(rows, lo), lo), lo)

    def _check_lengths(self, encoded: list[_Row], lo: int | Sequence[int]) -> list[_Row]:
        """Rows of ``max_length`` None longer than :attr:`length_limit` refused, naming the first and the fix."""
        if self.max_length is None and self.length_limit is not None:
            for i, row in enumerate(encoded):
                if len(row[0]) > self.length_limit:
                    raise DataError(
                        f"{self.key}: row {_row_number(lo, i)} of {self.source} has {len(row[0])} tokens, more than "
                        f"the {self.length_limit} its model takes (the tokenizer's model_max_length); set "
                        f"{self.key}.max_length (e.g. {self.length_limit}) to cut longer rows"
                    )
        return encoded

    def _encode_values(self, values: list[Any], lo: int | Sequence[int]) -> list[_Row]:
        """Checked values (:meth:`_values`) of rows ``lo, lo + 1, ...`` tokenized and cut to ``max_length``."""
        if not values:
            return []
        tok, ml = self.tokenizer, self.max_length
        if self.kind == "text":
            texts = [v[0] for v in values]
            pairs = [v[1] for v in values] if self.text_pair else None
            enc = tok(texts, pairs, truncation=ml is not None, max_length=ml)
            ids = [list(x) for x in enc["input_ids"]]
            tts = enc["token_type_ids"] if "token_type_ids" in self.input_keys else [None] * len(ids)
            if self.label_field:
                return [(i, t, v[2]) for i, t, v in zip(ids, tts, values)]
            return [(i, t, list(i)) for i, t in zip(ids, tts)]
        if self.kind == "prompt":
            p_ids = tok([v[0] for v in values], add_special_tokens=True)["input_ids"]
            c_ids = tok([v[1] for v in values], add_special_tokens=False)["input_ids"]
            out = []
            for p, c in zip(p_ids, c_ids):
                c = list(c)
                if self.eos_token_id is not None and (not c or c[-1] != self.eos_token_id):
                    c.append(int(self.eos_token_id))
                out.append(((list(p) + c)[:ml], None, ([IGNORE_INDEX] * len(p) + c)[:ml]))
            return out
        if self.kind == "messages":
            return self._encode_chats(values, lo)
        return [(ids[:ml], None, (labels if labels is not None else ids)[:ml]) for ids, labels in values]

    def _render(self, messages: list[dict[str, Any]], generation: bool, row: int) -> str:
        try:
            out = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        except Exception as e:  # noqa: BLE001  (jinja errors: roles that must alternate, ...)
            raise DataError(f"{self.key}: row {row} of {self.source}: the chat template cannot render the "
                            f"conversation: {e.__class__.__name__}: {e}") from None
        return out if isinstance(out, str) else str(out)

    def _plan_chat(
        self, msgs: list[dict[str, Any]], row: int, texts: list[str]
    ) -> tuple[int, list[tuple[int, int, int]]]:
        """Render one conversation's texts into ``texts``: the whole conversation and, per assistant turn
        ``i``, ``messages[:i]`` with the generation prompt and ``messages[:i + 1]`` (each rendering once).

        Returns:
            ``(index of the whole conversation, [(index of the prefix, index of the prefix + turn, i)]))``.
        """
        memo: dict[tuple[int, bool], int] = {}

        def text_id(k: int, generation: bool) -> int:
            if (k, generation) not in memo:
                memo[(k, generation)] = len(texts)
                texts.append(self._render(msgs[:k], generation, row))
            return memo[(k, generation)]

        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            if i == 0:
                raise DataError(f"{self.key}: row {row} of {self.source} starts with an assistant turn; the "
                                "chat template renders a turn after the ones before it, so put a system or "
                                "user turn first")
            spans.append((text_id(i, True), text_id(i + 1, False), i))
        return text_id(len(msgs), False), spans

    def _encode_chats(self, chats: list[list[dict[str, Any]]], lo: int | Sequence[int]) -> list[_Row]:
        """Conversations rendered by the chat template; targets: the tokens of each assistant turn.

        Most chat templates mark no assistant spans (``{% generation %}``), so the span of
        assistant turn ``i`` is found by rendering: the tokens of ``messages[:i]`` with the
        generation prompt are a prefix of those of ``messages[:i + 1]``, which are a prefix of
        the whole conversation's; the tokens in between are the turn (its end-of-turn tokens
        included).
        """
        texts: list[str] = []
        plans = [self._plan_chat(msgs, _row_number(lo, j), texts) for j, msgs in enumerate(chats)]
        tokens = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        out = []
        for j, (full_id, spans) in enumerate(plans):
            ids = list(tokens[full_id])
            labels = [IGNORE_INDEX] * len(ids)
            for pre_id, upto_id, turn in spans:
                pre, upto = tokens[pre_id], tokens[upto_id]
                checks = (
                    (pre, upto, f"the turns before assistant turn {turn} (with the generation prompt)"),
                    (upto, ids, f"the turns up to assistant turn {turn}"),
                )
                for shorter, longer, what in checks:
                    if list(longer[: len(shorter)]) != list(shorter):
                        raise DataError(
                            f"{self.key}: row {_row_number(lo, j)} of {self.source}: the chat template renders {what} as tokens "
                            "that do not start the longer conversation, so the assistant tokens cannot be found; "
                            "use a tokenizer whose chat template renders earlier turns the same whatever follows "
                            "(or give the data as prompt + completion)"
                        )
                labels[len(pre): len(upto)] = ids[len(pre): len(upto)]
            out.append((ids[: self.max_length], None, labels[: self.max_length]))
        return out

    def _collate(self, rows: list[_Row]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Rows padded on the right to their longest: ``({input_ids, attention_mask[, token_type_ids]}: [b, L_b]
        int64, labels [b] or [b, L_b] int64)``; padding has attention 0 and label -100."""
        b, width = len(rows), max(1, max(len(r[0]) for r in rows))
        ids = torch.full((b, width), self.pad_token_id, dtype=torch.int64)
        am = torch.zeros((b, width), dtype=torch.int64)
        tt = torch.zeros((b, width), dtype=torch.int64) if "token_type_ids" in self.input_keys else None
        labels = torch.full((b, width), IGNORE_INDEX, dtype=torch.int64) if self.per_token_labels else None
        for i, (row_ids, row_tt, row_y) in enumerate(rows):
            n = len(row_ids)
            ids[i, :n] = torch.as_tensor(row_ids, dtype=torch.int64)
            am[i, :n] = 1
            if tt is not None and row_tt is not None:
                tt[i, :n] = torch.as_tensor(row_tt, dtype=torch.int64)
            if labels is not None:
                labels[i, :n] = torch.as_tensor(row_y, dtype=torch.int64)
        inputs = {"input_ids": ids, "attention_mask": am}
        if tt is not None:
            inputs["token_type_ids"] = tt
        if labels is None:
            labels = torch.tensor([r[2] for r in rows], dtype=torch.int64)
        return inputs, labels

    def _windows(self, start: int, stop: int) -> Iterator[list[_Row]]:
        for lo in range(start, stop, WINDOW_ROWS):
            yield self._encode(self._rows.read(lo, min(lo + WINDOW_ROWS, stop)), lo)

    # --- the TensorDataset interface ------------------------------------------------------------------

    def batches(
        self, start: int, stop: int, batch_size: int, max_tokens: int | None = None
    ) -> Iterator[tuple[int, dict[str, torch.Tensor], torch.Tensor]]:
        """Rows ``[start, stop)`` read, tokenized and cut into consecutive batches.

        Rows are read and tokenized :data:`WINDOW_ROWS` at a time as the batches are
        consumed (never the whole range at once). Each batch holds at most ``batch_size``
        rows and, with ``max_tokens``, at most ``max_tokens`` padded tokens (rows x its
        longest row; a single longer row is a batch of its own); the cut is greedy, so the
        batches depend on ``start`` and the bounds only, and every row's tensors are the
        same however ``[start, stop)`` is split.

        Args:
            start, stop: the rows, ``0 <= start <= stop <= len(self)``.
            batch_size: most rows per batch (>= 1).
            max_tokens: most padded tokens per batch (``data.batch_tokens``); ``None``: rows only.

        Yields:
            ``(row_offset, inputs, labels)``: the index of the batch's first row;
            ``{"input_ids", "attention_mask"(, "token_type_ids" for pairs)}`` each ``[b, L_b]``
            int64 on the CPU, right-padded to the batch's longest row ``L_b``; labels ``[b]``
            int64 class indices (text classification) or ``[b, L_b]`` int64 per-token labels,
            unshifted, -100 where a token is not a target and at padding.

        Raises:
            DataError: a row that cannot be read or tokenized (naming it).
            ValueError: rows out of range or bounds below 1.
        """
        if not 0 <= start <= stop <= len(self):
            raise ValueError(f"rows [{start}, {stop}) are not within the {len(self)} rows of {self.name}")
        if batch_size < 1 or (max_tokens is not None and max_tokens < 1):
            raise ValueError(f"batch_size {batch_size} and max_tokens {max_tokens} must be at least 1")
        offset = start
        for rows in _cut(self._windows(start, stop), batch_size, max_tokens):
            yield offset, *self._collate(rows)
            offset += len(rows)

    def batches_of(
        self, indices: Sequence[int], batch_size: int, max_tokens: int | None = None
    ) -> Iterator[tuple[int, dict[str, torch.Tensor], torch.Tensor]]:
        """The rows ``indices``, in that order (a shuffled epoch, a subset), read, tokenized and cut into batches.

        Like :meth:`batches` with the rows taken by index: read and tokenized
        :data:`WINDOW_ROWS` at a time, cut greedily into batches of at most ``batch_size``
        rows and ``max_tokens`` padded tokens, each padded to its own longest row.

        Args:
            indices: row indices, each in ``[0, len(self))``.
            batch_size: most rows per batch (>= 1).
            max_tokens: most padded tokens per batch; ``None``: rows only.

        Yields:
            ``(rows, inputs, labels)``: the number of rows of the batch (the next ``rows``
            entries of ``indices``), and its tensors as :meth:`batches` gives them.

        Raises:
            DataError: a row that cannot be read or tokenized (naming it).
            ValueError: bounds below 1.
        """
        if batch_size < 1 or (max_tokens is not None and max_tokens < 1):
            raise ValueError(f"batch_size {batch_size} and max_tokens {max_tokens} must be at least 1")
        for rows in _cut(self._windows_of(indices), batch_size, max_tokens):
            yield len(rows), *self._collate(rows)

    def token_lengths(self, indices: Sequence[int]) -> list[int]:
        """Tokens of each of the rows ``indices`` (after cutting to ``max_length``), read :data:`WINDOW_ROWS` at a time.

        Raises:
            DataError: a row that cannot be read or tokenized (naming it).
        """
        return [len(r[0]) for window in self._windows_of(indices) for r in window]

    def longest(self) -> int:
        """Tokens of the longest row (after cutting to ``max_length``): one pass over every row, then kept.

        The width of per-token arrays when ``max_length`` is None (:func:`sequence_width`).

        Raises:
            DataError: a row that cannot be read or tokenized (naming it).
        """
        if self._longest is None:
            self._longest = max(len(r[0]) for window in self._windows(0, len(self)) for r in window)
        return self._longest

    def _windows_of(self, indices: Sequence[int]) -> Iterator[list[_Row]]:
        idx = [int(i) for i in indices]
        bad = [i for i in idx if not 0 <= i < len(self)]
        if bad:
            raise ValueError(f"rows {bad[:5]} are not among the {len(self)} rows of {self.name}")
        for lo in range(0, len(idx), WINDOW_ROWS):
            part = idx[lo : lo + WINDOW_ROWS]
            yield self._encode(self._rows.take(part), part)

    @property
    def labels(self) -> torch.Tensor:
        """``[n]`` int64: the class labels of text classification (every row is read once, then kept);
        zeros for language-model data (a placeholder for tables: their labels are per token)."""
        if self._labels is None:
            if self.per_token_labels:
                self._labels = torch.zeros(len(self), dtype=torch.int64)
            else:
                ys: list[int] = []
                for lo in range(0, len(self), WINDOW_ROWS):
                    ys += [v[2] for v in self._values(self._rows.read(lo, min(lo + WINDOW_ROWS, len(self))), lo)]
                self._labels = torch.tensor(ys, dtype=torch.int64)
        return self._labels

    def padded(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Every row tokenized and padded to the longest row: LOADS THE WHOLE DATASET (kept after the first call).

        For the training recipes that need all rows at once (`trak optimize`, retraining);
        featurize and score use :meth:`batches`.

        Returns:
            ``(inputs, labels)``: ``{"input_ids", "attention_mask"(, "token_type_ids")}`` each
            ``[n, L]`` int64 with ``L <= max_length``; labels ``[n]`` class indices or ``[n, L]``
            per-token labels (-100: not a target, padding included).
        """
        if self._padded is None:
            rows = [r for window in self._windows(0, len(self)) for r in window]
            self._padded = self._collate(rows)
        return self._padded

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        """Every row tokenized and padded to the longest: ``{"input_ids", "attention_mask"(, "token_type_ids")}``
        ``[n, L]`` int64. Loads the whole dataset (see :meth:`padded`); featurize and score use :meth:`batches`."""
        return self.padded()[0]

    def fingerprint(self, n: int | None = None) -> dict[str, Any]:
        """``n``, ``input_shape`` (``[max_length]`` per input key, ``[None]`` without a cut), ``input_dtype`` and
        a sha256 of the data.

        The sha256 covers the named fields' values of every row in order (streamed, not
        tokenized; the same rows give the same hash from a ``.jsonl``, ``.csv`` or
        Parquet file), the field names, ``max_length``, the tokenization version, the
        pad / end-of-sequence ids and the bytes of the tokenizer's files (vocabulary,
        ``tokenizer.json``, ``tokenizer_config.json``, special tokens, chat template). A
        change to any value of the data or to the tokenization changes it. Computed
        once per dataset object (one pass over the file, which also checks every row).

        Args:
            n: fingerprint only the first ``n`` rows (``0 < n <= len(self)``; None: every row): what
                a file holding just those rows gives, which is how an appended store proves its old
                rows unchanged (:mod:`trakcli.store.append`). One more pass over those rows.

        Raises:
            DataError: a row that cannot be read or lacks a field; ``n`` is not a row count of the data.
        """
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= len(self)):
            raise DataError(f"{self.key}: cannot fingerprint the first {n!r} rows of the {len(self)} of {self.source}")
        if n is not None and n != len(self):
            return self._hash_rows(n)
        if self._fingerprint is None:
            self._fingerprint = self._hash_rows(len(self))
        return dict(self._fingerprint)

    def _hash_rows(self, n: int) -> dict[str, Any]:
        """The fingerprint of the first ``n`` rows (:meth:`fingerprint`)."""
        h = hashlib.sha256()
        settings = {
            "version": TOKENIZATION_VERSION, "kind": self.kind, "max_length": self.max_length,
            "fields": {"text": self.text, "text_pair": self.text_pair, "labels": self.label_field,
                       "prompt": self.prompt, "completion": self.completion, "messages": self.messages,
                       "input_ids": self.input_ids_field},
            "pad_token_id": self.pad_token_id, "eos_token_id": self.eos_token_id,
            "input_keys": list(self.input_keys),
        }
        h.update(json.dumps(settings, sort_keys=True).encode())
        if self.tokenizer is not None:
            folder = Path(str(self.tokenizer.name_or_path))
            for f in _tokenizer_files(self.tokenizer):
                h.update(f"\0{f.relative_to(folder).as_posix()}\0".encode())
                with open(f, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        h.update(block)
        for lo in range(0, n, WINDOW_ROWS):
            for v in self._values(self._rows.read(lo, min(lo + WINDOW_ROWS, n)), lo):
                h.update(json.dumps(v, ensure_ascii=False, sort_keys=True).encode())
                h.update(b"\n")
        return {
            "n": n,
            "input_shape": {k: [self.max_length] for k in self.input_keys},
            "input_dtype": {k: "int64" for k in self.input_keys},
            "sha256": h.hexdigest(),
        }

    def texts(self, indices: Sequence[int], *, max_chars: int | None = 200) -> list[str]:
        """Short human-readable renderings of rows, for tables.

        The text (``"text / pair"`` for pairs); ``"prompt → completion"``; for messages the
        last user turn before the last assistant turn ``"user → assistant"``; for
        ``input_ids`` the decoded tokens (the ids without a tokenizer). Whitespace is
        collapsed and each rendering cut to ``max_chars`` characters (``None``: whole).

        Args:
            indices: row indices, ``0 <= i < len(self)``.

        Raises:
            DataError: a row that cannot be read or lacks a field.
        """
        idx = [int(i) for i in indices]
        bad = [i for i in idx if not 0 <= i < len(self)]
        if bad:
            raise DataError(f"{self.key}: rows {bad[:5]} are not among the {len(self)} rows of {self.source}")
        out = []
        for i, r in zip(idx, self._rows.take(idx)):
            v = self._values([r], i)[0]
            if self.kind == "text":
                s = v[0] if v[1] is None else f"{v[0]} / {v[1]}"
            elif self.kind == "prompt":
                s = f"{v[0]} → {v[1]}"
            elif self.kind == "messages":
                last = max(k for k, m in enumerate(v) if m["role"] == "assistant")
                users = [m for m in v[:last] if m["role"] == "user"]
                reply = _message_text(v[last].get("content"))
                s = f"{_message_text(users[-1].get('content'))} → {reply}" if users else reply
            elif self.tokenizer is not None:
                s = self.tokenizer.decode(v[0][: self.max_length], skip_special_tokens=True)
            else:
                s = " ".join(str(t) for t in v[0][: self.max_length])
            out.append(_shorten(s, max_chars))
        return out


def field_values(path: str | Path, field: str, *, key: str = "data.target", block: int = 4096) -> list[Any]:
    """The value of ``field`` in every row of a text data file, in row order (None where a row lacks it).

    Reads ``.jsonl`` / ``.csv`` / ``.parquet`` / ``.arrow`` files, datasets folders and Hub
    datasets as :class:`TextDataset` does, ``block`` rows at a time; for extra per-row fields the model
    never sees (e.g. the source documents of a fact-tracing query).

    Raises:
        DataError: the file cannot be read (names ``key`` and the file).
    """
    rows = _open_rows(data_files(path, key=key), key, [field], where=str(path))
    out: list[Any] = []
    for lo in range(0, len(rows), block):
        out += [rec.get(field) for rec in rows.read(lo, min(lo + block, len(rows)))]
    return out


def sequence_width(data: Any) -> int:
    """Most tokens a row of token data has: ``max_length`` for text data (with ``max_length`` None the
    longest row, :meth:`TextDataset.longest`), ``L`` for ``[n, L]`` tensors of ``input_ids``; 0 for data
    without tokens."""
    if isinstance(data, TextDataset):
        return data.max_length if data.max_length is not None else data.longest()
    inputs = getattr(data, "inputs", None)
    if isinstance(inputs, dict) and "input_ids" in inputs and getattr(inputs["input_ids"], "ndim", 0) == 2:
        return int(inputs["input_ids"].shape[1])
    return int(getattr(data, "max_length", 0) or 0)


def check_target_inputs(target: dict[str, Any], train: dict[str, Any]) -> None:
    """Refuse targets whose inputs are not of the train data's kind, from the two fingerprints
    (:meth:`TextDataset.fingerprint`, :meth:`~trakcli.data.tensors.TensorDataset.fingerprint`).

    Token data (inputs a dict holding ``input_ids``) must have the same input keys and dtypes; the
    sequence lengths may differ (``data.target.max_length`` need not be ``data.train.max_length``, and
    either may be None), since every gradient, and so every feature, is one example's. Other data
    must have the same per-example shape and dtype.

    Args:
        target: the target data's fingerprint; train: the train data's (the store's ``train_data``).

    Raises:
        StoreError: inputs of another kind, naming both and the fix.
    """
    t_shape, s_shape = target.get("input_shape"), train.get("input_shape")
    t_type, s_type = target.get("input_dtype"), train.get("input_dtype")
    tokens = all(isinstance(v, dict) and "input_ids" in v for v in (t_shape, s_shape))
    if tokens and (sorted(t_shape) != sorted(s_shape) or t_type != s_type):
        raise StoreError(
            f"data.target inputs are {sorted(t_shape)} of dtypes {t_type} but the train inputs are {sorted(s_shape)} "
            f"of dtypes {s_type}; give targets of the train data's kind (the same fields, e.g. text_pair on both "
            "or on neither)"
        )
    if not tokens and (t_shape != s_shape or t_type != s_type):
        raise StoreError(
            f"data.target inputs have shape {t_shape} ({t_type}) per example but the train inputs have {s_shape} "
            f"({s_type}); targets must be examples of the train data's kind"
        )


def load_text(
    path: Path, text: str, labels: str | None, tokenizer: str, max_length: int, *, key: str = "data.train",
    text_pair: str | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, str]:
    """Read and tokenize a whole text dataset at once (:class:`TextDataset` reads it lazily).

    Each text is truncated to ``max_length`` tokens and padded on the right to
    the longest text of the file (at most ``max_length``).

    Args:
        path: the file; ``.jsonl`` holds one JSON object per line, ``.csv`` a header row
            (or ``.parquet``, ``.arrow``, a datasets folder).
        text: the field holding the text.
        labels: the field holding integer class labels; ``None`` (language
            modeling): all labels 0.
        tokenizer: tokenizer directory (see :func:`load_tokenizer`).
        max_length: most tokens per text (per pair with ``text_pair``).
        text_pair: the field holding the second text of each pair (sentence pairs), tokenized
            together with ``text`` as the tokenizer's pair (``[CLS] a [SEP] b [SEP]`` for BERT).

    Returns:
        ``({"input_ids": [n, L] int64, "attention_mask": [n, L] int64}, labels [n] int64, name)``
        with ``L <= max_length``; pairs also give ``token_type_ids [n, L]`` int64 when the
        tokenizer makes them (0 for the first text, 1 for the second).

    Raises:
        DataError: unreadable file, missing fields (naming the rows and the fields
            there are), empty file, non-integer labels, or no tokenizer.
    """
    ds = TextDataset(path, text=text, text_pair=text_pair, labels=labels, tokenizer=tokenizer,
                     max_length=max_length, key=key)
    return ds.inputs, ds.labels, ds.name
