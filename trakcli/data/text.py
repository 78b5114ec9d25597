"""Text and language-model data, read and tokenized lazily: :class:`TextDataset`.

The rows of ``.jsonl``, ``.csv``, ``.parquet`` and ``.arrow`` files, datasets folders and Hub datasets
(:mod:`trakcli.data.sources`) name their fields in one of these ways:

* ``text`` + ``labels``: text classification; the text (with ``text_pair``, the
  tokenizer's pair) is the input, the label a class index (labels ``[b]``).
* ``text``: language modeling; every real token is a target.
* ``prompt`` + ``completion``: the prompt's tokens (with the tokenizer's special tokens), then the completion's
  (without), then the end-of-sequence token; the completion and the end-of-sequence token are the targets.
* ``messages``: a list of ``{role, content}`` rendered by the tokenizer's chat
  template; the tokens of the assistant turns are the targets.
* ``input_ids`` (+ ``labels``): pre-tokenized ids, with per-token labels or every token a target.

Per-token labels follow the convention of transformers, TRL and Bergson: they are *unshifted*,
``labels[t] = input_ids[t]`` where token ``t`` is a target and ``-100`` elsewhere (padding included); the model's
prediction at ``t - 1`` is scored against ``labels[t]``.

The train and target data may have different ``max_length``: every gradient is one example's
(:func:`~trakcli.data.load.check_target_inputs`). Memory does not grow with ``n x max_length``: rows
are read and tokenized when a batch needs them and padded to the batch's own longest row.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from trakcli.data.sources import chat_messages, data_files, int_label, int_list, message_text, open_rows, shorten
from trakcli.data.tensors import cut_batches, fingerprint_rows
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


#: One tokenized row: (input_ids, token_type_ids or None, label: class index or per-token labels).
_Row = tuple[list[int], "list[int] | None", "int | list[int]"]


class TextDataset:
    """Text or language-model data, read and tokenized as batches need it (the interface of
    :class:`~trakcli.data.tensors.TensorDataset` that featurize and score use).

    Exactly one of ``text``, ``prompt`` + ``completion``, ``messages`` or ``input_ids`` names the data (see the module
    docstring). The first :data:`CHECKED_ROWS` rows are read and tokenized when the dataset is built, so a wrong field
    name, a missing chat template or a bad label fails at once; later rows are checked when they are read.

    Args:
        path: a data file or folder, or a Hub dataset URL (:func:`~trakcli.data.sources.data_files`); or a
            list of them, whose rows are read one file after the other.
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
        name: human-readable origin (``"file.jsonl[text]"``).
        kind: ``"text"``, ``"prompt"``, ``"messages"`` or ``"input_ids"``.
        per_token_labels: whether :meth:`batches` yields per-token labels ``[b, L_b]``
            (language modeling) rather than class indices ``[b]`` (text classification).
        input_keys: the keys of the inputs dict, sorted; ``pad_token_id``: the id padding is filled with.

    Raises:
        DataError: unreadable file, no rows, missing fields (naming the rows and the fields
            there are), bad labels, a tokenizer that is missing or has no chat template, or a Hub
            dataset that cannot be had (:func:`~trakcli.data.sources.data_files`).
    """

    def __init__(
        self, path: str | Path | Sequence[str | Path], *, text: str | None = None, text_pair: str | None = None,
        labels: str | None = None, prompt: str | None = None, completion: str | None = None,
        messages: str | None = None, input_ids: str | None = None, tokenizer: Any = None,
        max_length: int | None = 128, key: str = "data.train",
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
        named = {"text": [text, text_pair], "prompt": [prompt, completion], "messages": [messages],
                 "input_ids": [input_ids]}[self.kind]
        self.fields: list[str] = [f for f in named + [labels] if f is not None]  # must be present in every row

        if isinstance(tokenizer, (str, Path)):
            tokenizer = load_tokenizer(str(tokenizer), key=f"{key}.tokenizer")
        if tokenizer is None and self.kind != "input_ids":
            raise DataError(f"{key}.tokenizer: {_KIND_NAMES[self.kind]} data need a tokenizer (a local Hugging Face "
                            "directory); set tokenizer, or use model.entrypoint 'hf:DIR'")
        self.tokenizer = tokenizer
        if self.kind == "messages" and not getattr(tokenizer, "chat_template", None):
            where = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
            raise DataError(f"{key}.tokenizer: the tokenizer in {where} has no chat template, which messages data need "
                            "to render conversations; set tokenizer to a folder whose tokenizer_config.json has a "
                            "chat_template (e.g. the instruct model's), or give the data as prompt + completion")
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else 0
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        pairs = self.kind == "text" and text_pair is not None and (
            "token_type_ids" in getattr(tokenizer, "model_input_names", ()))
        self.input_keys: tuple[str, ...] = ("attention_mask", "input_ids") + (("token_type_ids",) if pairs else ())
        self.name = f"{self.source}[{','.join(f for f in named if f is not None)}]"

        self._rows = open_rows(data_files(path, key=key), key, self.fields, where=self.source)
        if not len(self._rows):
            raise DataError(f"{key}: {self.source} has no rows; it needs at least one text")
        self._labels: torch.Tensor | None = None
        self._fingerprint: dict[str, Any] | None = None
        self._padded: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None
        self._longest: int | None = None
        limit = getattr(tokenizer, "model_max_length", None)
        #: Most tokens a row may have with ``max_length`` None: the tokenizer's ``model_max_length``, if real.
        self.length_limit: int | None = int(limit) if isinstance(limit, int) and 0 < limit < NO_LENGTH_LIMIT else None
        self._encode(range(min(CHECKED_ROWS, len(self))))

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"TextDataset({self.name}, n={len(self)}, kind={self.kind}, max_length={self.max_length})"

    # --- rows -> values -> tokens ---------------------------------------------------------------------

    def _read(self, idx: Sequence[int]) -> list[dict[str, Any]]:
        """The raw rows ``idx`` (a ``range`` read as one slice)."""
        if isinstance(idx, range) and idx.step == 1:
            return self._rows.read(idx.start, idx.stop)
        return self._rows.take(idx)

    def _values(self, idx: Sequence[int]) -> list[Any]:
        """The checked, JSON-able values of the named fields of the rows ``idx`` (what the fingerprint hashes).

        Raises:
            DataError: a row lacks a field (``None`` counts as missing), or a value is malformed.
        """
        rows = self._read(idx)
        for field in self.fields:
            bad = [idx[i] for i, r in enumerate(rows) if r.get(field) is None]
            if bad:
                raise DataError(f"{self.key}: rows {bad[:5]} of {self.source} have no field {field!r}; the first row's "
                                f"fields are {self._rows.fields()}")
        key, out = self.key, []
        for row, r in zip(idx, rows):
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
                        raise DataError(f"{key}: row {row} has {len(ids)} {self.input_ids_field!r} but {len(labels)} "
                                        f"{self.label_field!r}; per-token labels need one per token (-100: not a "
                                        "target)")
                    if any(v < 0 and v != IGNORE_INDEX for v in labels):
                        raise DataError(f"{key}: row {row} has {self.label_field!r} values below 0 other than "
                                        f"{IGNORE_INDEX}; per-token labels are token ids or {IGNORE_INDEX} (not a "
                                        "target)")
                out.append([ids, labels])
        return out

    def _encode(self, idx: Sequence[int]) -> list[_Row]:
        """The rows ``idx`` tokenized and cut to ``max_length``: ``(input_ids, token_type_ids, label)``; with
        ``max_length`` None a row longer than :attr:`length_limit` is refused, naming it and the fix."""
        encoded = self._encode_values(self._values(idx), idx)
        if self.max_length is None and self.length_limit is not None:
            for row, (ids, _, _) in zip(idx, encoded):
                if len(ids) > self.length_limit:
                    raise DataError(f"{self.key}: row {row} of {self.source} has {len(ids)} tokens, more than the "
                                    f"{self.length_limit} its model takes (the tokenizer's model_max_length); set "
                                    f"{self.key}.max_length (e.g. {self.length_limit}) to cut longer rows")
        return encoded

    def _windows(self, idx: Sequence[int]) -> Iterator[Sequence[int]]:
        """``idx`` in parts of :data:`WINDOW_ROWS` rows (ranges stay ranges)."""
        for lo in range(0, len(idx), WINDOW_ROWS):
            yield idx[lo : lo + WINDOW_ROWS]

    def _encoded(self, idx: Sequence[int]) -> Iterator[_Row]:
        """The rows ``idx`` tokenized, :data:`WINDOW_ROWS` at a time as they are consumed."""
        for part in self._windows(idx):
            yield from self._encode(part)

    def _encode_values(self, values: list[Any], idx: Sequence[int]) -> list[_Row]:
        """Checked values (:meth:`_values`) of the rows ``idx`` tokenized and cut to ``max_length``."""
        if not values:
            return []
        tok, ml = self.tokenizer, self.max_length
        if self.kind == "text":
            texts = [v[0] for v in values]
            pairs = [v[1] for v in values] if self.text_pair else None
            enc = tok(texts, pairs, truncation=ml is not None, max_length=ml)
            ids = [list(x) for x in enc["input_ids"]]
            tts = enc["token_type_ids"] if "token_type_ids" in self.input_keys else [None] * len(ids)
            return [(i, t, v[2] if self.label_field else list(i)) for i, t, v in zip(ids, tts, values)]
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
            return self._encode_chats(values, idx)
        return [(ids[:ml], None, (labels if labels is not None else ids)[:ml]) for ids, labels in values]

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
                try:
                    out = self.tokenizer.apply_chat_template(msgs[:k], tokenize=False, add_generation_prompt=generation)
                except Exception as e:  # noqa: BLE001  (jinja errors: roles that must alternate, ...)
                    raise DataError(f"{self.key}: row {row} of {self.source}: the chat template cannot render the "
                                    f"conversation: {e.__class__.__name__}: {e}") from None
                memo[(k, generation)] = len(texts)
                texts.append(out if isinstance(out, str) else str(out))
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

    def _encode_chats(self, chats: list[list[dict[str, Any]]], idx: Sequence[int]) -> list[_Row]:
        """Conversations rendered by the chat template; targets: the tokens of each assistant turn.

        Most chat templates mark no assistant spans (``{% generation %}``), so the span of assistant turn ``i`` is found
        by rendering: the tokens of ``messages[:i]`` with the generation prompt are a prefix of those of
        ``messages[:i + 1]``, which are a prefix of the whole conversation's; the tokens in between are the turn (its
        end-of-turn tokens included).
        """
        texts: list[str] = []
        plans = [self._plan_chat(msgs, row, texts) for row, msgs in zip(idx, chats)]
        tokens = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        out = []
        for row, (full_id, spans) in zip(idx, plans):
            ids = list(tokens[full_id])
            labels = [IGNORE_INDEX] * len(ids)
            for pre_id, upto_id, turn in spans:
                pre, upto = tokens[pre_id], tokens[upto_id]
                checks = ((pre, upto, f"the turns before assistant turn {turn} (with the generation prompt)"),
                          (upto, ids, f"the turns up to assistant turn {turn}"))
                for shorter, longer, what in checks:
                    if list(longer[: len(shorter)]) != list(shorter):
                        raise DataError(f"{self.key}: row {row} of {self.source}: the chat template renders {what} "
                                        "as tokens that do not start the longer conversation, so the assistant tokens "
                                        "cannot be found; use a tokenizer whose chat template renders earlier turns "
                                        "the same whatever follows (or give the data as prompt + completion)")
                labels[len(pre): len(upto)] = ids[len(pre): len(upto)]
            out.append((ids[: self.max_length], None, labels[: self.max_length]))
        return out

    def _collate(self, rows: list[_Row]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Rows padded on the right to their longest: ``({input_ids, attention_mask[, token_type_ids]}: [b, L_b]
        int64, labels [b] or [b, L_b] int64)``; padding has attention 0 and label -100."""
        width = max(1, max(len(r[0]) for r in rows))

        def pad(seqs: list[list[int]], value: int) -> torch.Tensor:
            out = torch.full((len(seqs), width), value, dtype=torch.int64)
            for i, seq in enumerate(seqs):
                out[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.int64)
            return out

        inputs = {"input_ids": pad([r[0] for r in rows], self.pad_token_id),
                  "attention_mask": pad([[1] * len(r[0]) for r in rows], 0)}
        if "token_type_ids" in self.input_keys:
            inputs["token_type_ids"] = pad([r[1] or [] for r in rows], 0)
        if self.per_token_labels:
            return inputs, pad([r[2] for r in rows], IGNORE_INDEX)
        return inputs, torch.tensor([r[2] for r in rows], dtype=torch.int64)

    # --- the TensorDataset interface ------------------------------------------------------------------

    def batches(
        self, start: int, stop: int, batch_size: int, max_tokens: int | None = None
    ) -> Iterator[tuple[int, dict[str, torch.Tensor], torch.Tensor]]:
        """Rows ``[start, stop)`` (``0 <= start <= stop <= len(self)``) read, tokenized and cut into consecutive
        batches, :data:`WINDOW_ROWS` rows at a time as the batches are consumed.

        Each batch holds at most ``batch_size`` rows and, with ``max_tokens`` (``data.batch_tokens``), at
        most ``max_tokens`` padded tokens (:func:`~trakcli.data.tensors.cut_batches`, greedy: every row's
        tensors are the same however ``[start, stop)`` is split).

        Yields:
            ``(row_offset, inputs, labels)``: the index of the batch's first row;
            ``{"input_ids", "attention_mask"(, "token_type_ids" for pairs)}`` each ``[b, L_b]`` int64 on the CPU,
            right-padded to the batch's longest row ``L_b``; labels ``[b]`` int64 class indices (text classification) or
            ``[b, L_b]`` int64 per-token labels, unshifted, -100 where a token is not a target and at padding.

        Raises:
            DataError: a row that cannot be read or tokenized (naming it).
            ValueError: rows out of range or bounds below 1.
        """
        if not 0 <= start <= stop <= len(self):
            raise ValueError(f"rows [{start}, {stop}) are not within the {len(self)} rows of {self.name}")
        offset = start
        for size, inputs, labels in self._batches(range(start, stop), batch_size, max_tokens):
            yield offset, inputs, labels
            offset += size

    def batches_of(
        self, indices: Sequence[int], batch_size: int, max_tokens: int | None = None
    ) -> Iterator[tuple[int, dict[str, torch.Tensor], torch.Tensor]]:
        """The rows ``indices``, in that order (a shuffled epoch, a subset), cut into batches as :meth:`batches`
        cuts its rows.

        Yields:
            ``(rows, inputs, labels)``: the number of rows of the batch (the next ``rows``
            entries of ``indices``), and its tensors as :meth:`batches` gives them.

        Raises:
            DataError: a row that cannot be read or tokenized (naming it).
            ValueError: indices outside ``[0, len(self))`` or bounds below 1.
        """
        yield from self._batches(self._checked(indices, ValueError), batch_size, max_tokens)

    def _batches(self, idx: Sequence[int], batch_size: int, max_tokens: int | None
                 ) -> Iterator[tuple[int, dict[str, torch.Tensor], torch.Tensor]]:
        if batch_size < 1 or (max_tokens is not None and max_tokens < 1):
            raise ValueError(f"batch_size {batch_size} and max_tokens {max_tokens} must be at least 1")
        for rows in cut_batches(self._encoded(idx), batch_size, max_tokens, length=lambda r: len(r[0])):
            yield len(rows), *self._collate(rows)

    def _checked(self, indices: Sequence[int], error: type[Exception]) -> list[int]:
        """``indices`` as ints, each in ``[0, len(self))``, else ``error`` naming the first bad ones."""
        idx = [int(i) for i in indices]
        bad = [i for i in idx if not 0 <= i < len(self)]
        if bad:
            raise error(f"{self.key}: rows {bad[:5]} are not among the {len(self)} rows of {self.source}")
        return idx

    def token_lengths(self, indices: Sequence[int]) -> list[int]:
        """Tokens of each of the rows ``indices`` (after cutting to ``max_length``); raises as :meth:`batches_of`."""
        return [len(r[0]) for r in self._encoded(self._checked(indices, ValueError))]

    def longest(self) -> int:
        """Tokens of the longest row (after cutting to ``max_length``; one pass over every row, then kept): the
        width of per-token arrays when ``max_length`` is None. Raises as :meth:`batches`."""
        if self._longest is None:
            self._longest = max(len(r[0]) for r in self._encoded(range(len(self))))
        return self._longest

    @property
    def labels(self) -> torch.Tensor:
        """``[n]`` int64: the class labels of text classification (every row is read once, then kept);
        zeros for language-model data (a placeholder for tables: their labels are per token)."""
        if self._labels is None:
            if self.per_token_labels:
                self._labels = torch.zeros(len(self), dtype=torch.int64)
            else:
                ys = [v[2] for part in self._windows(range(len(self))) for v in self._values(part)]
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
            self._padded = self._collate(list(self._encoded(range(len(self)))))
        return self._padded

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        """Every row tokenized and padded to the longest: ``{"input_ids", "attention_mask"(, "token_type_ids")}``
        ``[n, L]`` int64. Loads the whole dataset (see :meth:`padded`); featurize and score use :meth:`batches`."""
        return self.padded()[0]

    def fingerprint(self, n: int | None = None) -> dict[str, Any]:
        """``n``, ``input_shape`` (``[max_length]`` per input key, ``[None]`` without a cut), ``input_dtype`` and
        a sha256 of the data.

        The sha256 covers the named fields' values of every row in order (streamed, not tokenized; the
        same rows give the same hash from any file format), the field names, ``max_length``, the
        tokenization version, the pad / end-of-sequence ids and the bytes of the tokenizer's files
        (:func:`~trakcli.models.hf.tokenizer_files`). Computed once per dataset object (one pass over the
        file, which also checks every row). With ``n`` (``0 < n <= len(self)``), of the first ``n`` rows
        only: what a file holding just those rows gives (how an appended store proves its old rows unchanged).

        Raises:
            DataError: a row that cannot be read or lacks a field; ``n`` is not a row count of the data.
        """
        n = fingerprint_rows(n, len(self), f"{self.key} ({self.source})")
        if n != len(self):
            return self._hash_rows(n)
        if self._fingerprint is None:
            self._fingerprint = self._hash_rows(len(self))
        return dict(self._fingerprint)

    def _hash_rows(self, n: int) -> dict[str, Any]:
        """The fingerprint of the first ``n`` rows (:meth:`fingerprint`)."""
        h = hashlib.sha256()
        settings = {"version": TOKENIZATION_VERSION, "kind": self.kind, "max_length": self.max_length,
                    "fields": {"text": self.text, "text_pair": self.text_pair, "labels": self.label_field,
                               "prompt": self.prompt, "completion": self.completion, "messages": self.messages,
                               "input_ids": self.input_ids_field},
                    "pad_token_id": self.pad_token_id, "eos_token_id": self.eos_token_id,
                    "input_keys": list(self.input_keys)}
        h.update(json.dumps(settings, sort_keys=True).encode())
        if self.tokenizer is not None:
            folder = Path(str(self.tokenizer.name_or_path))
            for f in tokenizer_files(self.tokenizer):
                h.update(f"\0{f.relative_to(folder).as_posix()}\0".encode())
                with open(f, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        h.update(block)
        for part in self._windows(range(n)):
            for v in self._values(part):
                h.update(json.dumps(v, ensure_ascii=False, sort_keys=True).encode())
                h.update(b"\n")
        return {"n": n, "input_shape": {k: [self.max_length] for k in self.input_keys},
                "input_dtype": {k: "int64" for k in self.input_keys}, "sha256": h.hexdigest()}

    def texts(self, indices: Sequence[int], *, max_chars: int | None = 200) -> list[str]:
        """Short human-readable renderings of the rows ``indices``, for tables.

        The text (``"text / pair"`` for pairs); ``"prompt → completion"``; for messages the last user turn before the
        last assistant turn ``"user → assistant"``; for ``input_ids`` the decoded tokens (the ids without a tokenizer).
        Whitespace is collapsed and each rendering cut to ``max_chars`` characters (``None``: whole).

        Raises:
            DataError: an index out of range, a row that cannot be read or lacks a field.
        """
        out = []
        for v in self._values(self._checked(indices, DataError)):
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

