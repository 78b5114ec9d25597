"""Text datasets: ``.jsonl`` / ``.csv`` / ``.parquet`` / ``.arrow`` files or a Hugging Face datasets
``save_to_disk`` folder, tokenized by a local Hugging Face tokenizer."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import torch

from trakcli.errors import DataError, ModelError
from trakcli.models.hf import import_transformers, resolve_hf_path


def _read_arrow(path: Path, key: str) -> list[dict[str, Any]]:
    """Rows of a Hugging Face datasets folder (``save_to_disk``), a ``.parquet`` or an ``.arrow`` file (via pyarrow).

    Raises:
        DataError: pyarrow missing, a ``DatasetDict`` folder (names its splits), or an unreadable file.
    """
    try:
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
        return [row for f in files for row in _read_arrow(f, key)]
    try:
        if path.suffix.lower() == ".parquet":
            return pq.read_table(path).to_pylist()
        try:
            with ipc.open_stream(path) as reader:  # what datasets writes
                return reader.read_all().to_pylist()
        except Exception:  # noqa: BLE001  (the other Arrow IPC layout)
            with ipc.open_file(path) as reader:
                return reader.read_all().to_pylist()
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{key}: cannot read {path}: {e.__class__.__name__}: {e}") from None


def _read_records(path: Path, key: str) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if path.is_dir() or suffix in (".parquet", ".arrow"):
        return _read_arrow(path, key)
    try:
        if suffix == ".jsonl":
            records = []
            with open(path, encoding="utf-8") as f:
                for i, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{key}: {path} line {i} is not valid JSON ({e.msg})") from None
                    if not isinstance(rec, dict):
                        raise DataError(f"{key}: {path} line {i} is a {type(rec).__name__}, not a JSON object")
                    records.append(rec)
            return records
        if suffix == ".csv":
            with open(path, encoding="utf-8", newline="") as f:
                return list(csv.DictReader(f))
    except DataError:
        raise
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{key}: cannot read {path}: {e}") from None
    raise DataError(f"{key}: text data file {path} has suffix {suffix!r}; use .jsonl or .csv")


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


def load_tokenizer(spec: str, *, key: str = "data.train.tokenizer") -> Any:
    """A tokenizer from a local directory (see :func:`trakcli.models.hf.resolve_hf_path`), padding on the right.

    A tokenizer without a pad token (GPT-2) pads with its end-of-sequence token.

    Raises:
        DataError: transformers missing, or no tokenizer in the directory.
    """
    try:
        tf = import_transformers()
        path = resolve_hf_path(spec)
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


def load_text(
    path: Path, text: str, labels: str | None, tokenizer: str, max_length: int, *, key: str = "data.train",
    text_pair: str | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, str]:
    """Read and tokenize a ``.jsonl`` / ``.csv`` text dataset.

    Each text is truncated to ``max_length`` tokens and padded on the right to
    the longest text of the file (at most ``max_length``), so the tensors do not
    depend on the batch size.

    Args:
        path: the file; ``.jsonl`` holds one JSON object per line, ``.csv`` a header row.
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
    records = _read_records(path, key)
    if not records:
        raise DataError(f"{key}: {path} has no rows; it needs at least one text")
    for field in [text] + ([text_pair] if text_pair else []) + ([labels] if labels else []):
        bad = [i for i, r in enumerate(records) if r.get(field) is None]
        if bad:
            raise DataError(
                f"{key}: rows {bad[:5]} of {path} have no field {field!r}; the first row's fields are "
                f"{sorted(records[0])}"
            )
    texts = [str(r[text]) for r in records]
    y = [_int_label(r[labels], i, labels, key) for i, r in enumerate(records)] if labels else [0] * len(texts)
    tok = load_tokenizer(tokenizer, key=f"{key}.tokenizer")
    pairs = [str(r[text_pair]) for r in records] if text_pair else None
    enc = tok(texts, pairs, padding="longest", truncation=True, max_length=max_length, return_tensors="pt")
    names = ("input_ids", "attention_mask") + (("token_type_ids",) if text_pair and "token_type_ids" in enc else ())
    inputs = {k: enc[k].to(torch.int64).contiguous() for k in names}
    return inputs, torch.tensor(y, dtype=torch.int64), f"{path}[{text}{',' + text_pair if text_pair else ''}]"
