"""Text and language-model data, read and tokenized lazily: :class:`TextDataset`.

Sources: a ``.jsonl`` file (one JSON object per line), a ``.csv`` file (a header
row), a ``.parquet`` or ``.arrow`` file, or a Hugging Face datasets
``save_to_disk`` folder; or any of them on the Hugging Face Hub,
``hf://datasets/ORG/NAME[@REVISION][/PATH]`` (:func:`~trakcli.data.sources.data_files`; several
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
are scored together (:func:`~trakcli.data.load.check_target_inputs`).

Memory does not grow with ``n x max_length``: a ``.jsonl`` file is held as the
byte offsets of its lines (``[n]`` int64, from one streaming pass), Arrow and
Parquet data as a (memory-mapped where possible) columnar table with only the
fields read, a ``.csv`` file as its records. Rows are read and tokenized when a
batch needs them and padded to the batch's own longest row.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch

from trakcli.data.sources import (
    chat_messages, data_files, int_label, int_list, message_text, open_rows, shorten,
)
from trakcli.data.tensors import batch_fits
from trakcli.errors import DataError
from trakcli.labels import IGNORE_INDEX
from trakcli.models.hf import load_tokenizer, tokenizer_files
from trakcli.models.hub import is_hub_url

#: Rows read and tokenized at once inside :meth:`TextDataset.batches` (bounds the memory of one call).
WINDOW_ROWS = 1024

#: Rows checked when a :class:`TextDataset` is built, so a wrong field name fails at once.
CHECKED_ROWS = 8

#: Bumped when the tokens or labels made from the same rows change (part of the fingerprint).
TOKENIZATION_VERSION = 1

#: Tokenizers without a real length limit report this many tokens or more as ``model_max_length``.
NO_LENGTH_LIMIT = 10**9

#: How each kind of data is named in messages.
_KIND_NAMES = {"text": "text", "prompt": "prompt + completion", "messages": "messages", "input_ids": "input_ids"}


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
            or a Hub dataset ``hf://datasets/ORG/NAME[@REVISION][/PATH]`` (:func:`~trakcli.data.sources.data_files`); or a list of
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
            dataset that cannot be had (:func:`~trakcli.data.sources.data_files`).
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
        self._rows = open_rows(files, key, self.fields, where=self.source)
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
                label = int_label(r[self.label_field], row, self.label_field, key) if self.label_field else None
                out.append([str(r[self.text]), str(r[self.text_pair]) if self.text_pair else None, label])
            elif self.kind == "prompt":
                out.append([str(r[self.prompt]), str(r[self.completion])])
            elif self.kind == "messages":
                out.append(chat_messages(r[self.messages], row, self.messages, key))
            else:
                ids = int_list(r[self.input_ids_field], row, self.input_ids_field, key, "input_ids")
                if min(ids) < 0:
                    raise DataError(f"{key}: row {row} has negative token ids in {self.input_ids_field!r}")
                labels = None
                if self.label_field:
                    labels = int_list(r[self.label_field], row, self.label_field, key, "per-token labels")
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

        The width of per-token arrays when ``max_length`` is None (:func:`~trakcli.data.load.sequence_width`).

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
            for f in tokenizer_files(self.tokenizer):
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
                reply = message_text(v[last].get("content"))
                s = f"{message_text(users[-1].get('content'))} → {reply}" if users else reply
            elif self.tokenizer is not None:
                s = self.tokenizer.decode(v[0][: self.max_length], skip_special_tokens=True)
            else:
                s = " ".join(str(t) for t in v[0][: self.max_length])
            out.append(shorten(s, max_chars))
        return out


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
