"""The answer of an experiment: per target, its top proponents and opponents with scores, texts and tokens.

One record per target, the same for ``trak score --out answers.jsonl``, ``trak report`` and the Python API::

    {"target": 0, "text": "...",                       # text data: a short rendering of the target
     "proponents": [{"train": 17, "score": 3.2, "text": "...",
                     "target_tokens": [["▁Paris", 0.8], ["!", -0.01], ...],   # with score.per_token
                     "document_tokens": [["The", null], ["▁capital", 0.4], ...]}, ...],
     "opponents": [...]}

``target_tokens`` lists every token of the target and ``document_tokens`` every token of the train
document, as ``[token text, contribution]``; the contribution is the share of the document's score
that the token's next-token term carries (:mod:`trakcli.jobs.per_token`), ``null`` for a token that
is not a target of the loss (a prompt, a user turn). Over the target tokens the contributions sum to
the document's score.

Proponents are documents of positive score and opponents of negative score: the stored top-k's
lowest K of a small training set may include positive scores, which are not listed as opponents.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np

#: ``(target, side, rank, train row) -> {"target_tokens": ..., "document_tokens": ...}`` of one top document, or None.
TokenFields = Callable[[int, str, int, int], dict[str, Any] | None]


def answer_records(res: Any, k: int, target_texts: Any = None, train_texts: Any = None, block: int = 1024,
                   tokens: TokenFields | None = None) -> Iterator[dict[str, Any]]:
    """Yield one record per target (module docstring), ``block`` targets read at a time.

    Args:
        res: a :class:`~trakcli.jobs.score.ScoreResult`.
        k: documents per side when the experiment has only the full matrix (``score.show_top``);
            with ``score.top_k`` all K are given.
        target_texts, train_texts: indexable renderings of the rows (text data), or None.
        block: targets read from the store at once.
        tokens: per-token fields of a top document (``score.per_token``), or None.
    """
    from trakcli.plots import top_indices

    for lo in range(0, res.n_target, block):
        hi = min(lo + block, res.n_target)
        if res.top_k:
            top = res.top(lo, hi)
            sides = [(top["proponents"][r], top["proponent_scores"][r], top["opponents"][r],
                      top["opponent_scores"][r]) for r in range(hi - lo)]
        else:
            sides = []
            for row in res.rows(lo, hi):
                pro, opp = top_indices(row, k)
                sides.append((pro, row[pro], opp, row[opp]))
        for r, (pro, pro_s, opp, opp_s) in enumerate(sides):
            t = lo + r
            line: dict[str, Any] = {"target": t}
            if target_texts is not None:
                line["text"] = target_texts[t]
            for side, idx, vals in (("proponents", pro, pro_s), ("opponents", opp, opp_s)):
                line[side] = []
                for rank, (i, v) in enumerate(zip(idx, vals)):
                    if not (v > 0 if side == "proponents" else v < 0):  # the stored K lowest may be positive
                        continue
                    entry = answer_entry(i, v, train_texts)
                    extra = tokens(t, side, rank, int(i)) if tokens is not None else None
                    if extra:
                        entry.update(extra)
                    line[side].append(entry)
            yield line


def answer_entry(i: Any, score: Any, texts: Any) -> dict[str, Any]:
    """One proponent or opponent: its train index, score and (text data) text."""
    entry: dict[str, Any] = {"train": int(i), "score": float(score)}
    if texts is not None:
        entry["text"] = texts[int(i)]
    return entry


def token_fields(res: Any, target: Any, train: Any, block: int = 64) -> TokenFields:
    """The per-token fields of the answers (``score.per_token``): ``(target, side, rank, train row) -> {...}``.

    Reads the stored per-token scores (:meth:`~trakcli.jobs.score.ScoreResult.tokens`) ``block`` targets
    at a time and renders each sequence's tokens with its dataset's tokenizer (the ids without one).

    Args:
        res: the :class:`~trakcli.jobs.score.ScoreResult` (with ``per_token``).
        target, train: the target and train datasets (token data).
        block: targets read at once.
    """
    cache: dict[str, Any] = {"lo": -1, "hi": -1}
    texts: dict[tuple[int, int], list[str]] = {}

    def tokens_of(ds: Any, which: int, i: int) -> list[str]:
        key = (which, i)
        if key not in texts:
            if len(texts) > 4096:
                texts.clear()
            texts[key] = token_texts(ds, i)
        return texts[key]

    def fields(t: int, side: str, rank: int, doc: int) -> dict[str, Any]:
        if not cache["lo"] <= t < cache["hi"]:
            cache["lo"], cache["hi"] = t, min(t + block, res.n_target)
            cache.update(res.tokens(cache["lo"], cache["hi"]))
        r, s = t - cache["lo"], SIDES.index(side)
        return {
            "target_tokens": _pairs(tokens_of(target, 0, t), cache["target_tokens"][r, s, rank]),
            "document_tokens": _pairs(tokens_of(train, 1, doc), cache["document_tokens"][r, s, rank]),
        }

    return fields


#: The sides of an answer, in the order of the per-token arrays' second axis.
SIDES = ("proponents", "opponents")


def _pairs(tokens: list[str], values: np.ndarray) -> list[list[Any]]:
    """``[[token text, contribution or None], ...]`` of one sequence (NaN: not a target of the loss)."""
    return [[tok, None if i >= len(values) or not np.isfinite(values[i]) else float(values[i])]
            for i, tok in enumerate(tokens)]


def token_texts(ds: Any, i: int) -> list[str]:
    """The text of each token of row ``i`` of a token dataset, as the model sees them (padding left out).

    Token ``i``'s text is what it adds to the decoded prefix (``decode(ids[:i + 1])`` less
    ``decode(ids[:i])``), so the texts joined give the row's decoded text and a character that
    byte-level BPE splits over several tokens shows whole at the token that completes it (the
    others show ``""``); the token ids as text without a tokenizer.
    """
    _, x, _ = next(iter(ds.batches_of([i], 1)))
    ids = x["input_ids"][0]
    mask = x.get("attention_mask")
    if mask is not None:
        ids = ids[: int(mask[0].sum())]
    tok = getattr(ds, "tokenizer", None)
    if tok is None:
        return [str(int(v)) for v in ids]
    ids = [int(v) for v in ids]
    # a prefix ending inside a character decodes to U+FFFD there: it is left to the token that completes it
    prefixes = [p.rstrip("\ufffd") for p in tok.batch_decode([ids[:i] for i in range(len(ids) + 1)])]
    return [b[len(a):] if b.startswith(a) else tok.decode([ids[i]]) for i, (a, b) in
            enumerate(zip(prefixes, prefixes[1:]))]
