"""One self-contained HTML page of an experiment's answers: :func:`render_report`.

The page embeds the answers once as JSON (``<script type="application/json">``) and draws only the
query on screen with its own inline script and style: no network, no server, no library; it works
opened from a file. Texts reach the page through ``textContent`` only, so no text can become markup.

What is embedded, deduplicated (a train document that answers many queries is stored once)::

    {"title": ..., "about": ..., "k": 5, "image": {"shape": [C, H, W]} | null,
     "queries": [{"t": 0, "text": "...", "label": 7, "img": "<base64 uint8>",
                  "tok": ["Question", ":", ...],               # the target's tokens (per-token answers)
                  "p": [{"d": 17, "s": 3.2, "tc": [null, 0.8, ...], "dc": [null, 0.4, ...]}, ...],
                  "o": [...]}],
     "docs": {"17": {"text": "...", "label": 4, "img": "<base64>", "tok": ["The", " capital", ...]}}}

``tc`` / ``dc`` are one proponent's or opponent's contributions over the target's and the document's
tokens (``null``: not a target of the loss), rounded to 4 significant digits.

The page's template, style and script are the package's files ``page.html``, ``page.css`` and ``page.js``;
the script draws the list of targets (100 a page) and the selected one, with the colours of :mod:`trakcli.plots`.
"""

from __future__ import annotations

import base64
import html
import json
import math
from functools import cache
from importlib import resources
from typing import Any, Iterable, Mapping

import numpy as np

from trakcli.errors import ArgumentError, DataError
from trakcli.plots.common import as_numpy

#: The sides of an answer and their keys in the embedded data.
SIDES = (("proponents", "p"), ("opponents", "o"))


def render_report(
    records: Iterable[Mapping[str, Any]],
    *,
    title: str,
    images: tuple[Any, Any] | None = None,
    about: str = "",
    scale: str = "",
) -> str:
    """The HTML page of an experiment's answers, one record per target (:mod:`trakcli.answers`).

    For each target the page shows its text (or picture), its proponents and opponents with their scores, and each
    document's text (or picture). With per-token answers (``target_tokens`` and ``document_tokens`` of an entry,
    ``score.per_token``) a document's tokens are shaded by their contribution to its score, green for positive and red
    for negative, the intensity scaled to the document's largest absolute contribution; hovering a token shows its
    value, and tokens that are not targets of the loss (a prompt) are grey. The target's tokens are shaded by the sum of
    the shown proponents' contributions, or by one document's after a click on it. A search box filters the targets by
    index (``17``), text or label (``label:7``); ``j``/``k`` or the arrow keys move through them, ``/`` focuses the
    search.

    Args:
        records: answer records ``{"target", "text"?, "label"?, "proponents": [{"train", "score",
            "text"?, "label"?, "target_tokens"?, "document_tokens"?}, ...], "opponents": [...]}``
            (``label``: a class to show beside the index).
        title: the page's title and heading.
        images: image data: ``(train_images, target_images)``, each ``[n, H, W]`` or ``[n, C, H, W]``
            (C = 1 or 3; numpy arrays or CPU tensors, any real dtype), row ``i`` the picture of index
            ``i``. All pictures of the page share one intensity range (as :func:`trakcli.plots.plot_top`).
        about: a line under the heading (the experiment, the store, ...).
        scale: what a score is, its units and size (:func:`trakcli.answers.score_meaning`), shown under
            ``about``; empty: not shown.

    Returns:
        The page, a ``str`` (UTF-8 when written).

    Raises:
        ArgumentError: a record without ``target``, ``proponents`` or ``opponents``.
        DataError: images that are not ``[n, H, W]`` / ``[n, C, H, W]``, or an index outside them.
    """
    queries: list[dict[str, Any]] = []
    docs: dict[int, dict[str, Any]] = {}
    k = 0
    for record in records:
        q, used = _query(record, docs)
        queries.append(q)
        k = max(k, used)
    image = _embed_images(images, queries, docs) if images is not None else None
    data = {"title": title, "about": about, "k": k, "image": image, "queries": queries,
            "docs": {str(d): v for d, v in docs.items()}}
    scale_line = f'<p class="about scale">{html.escape(scale)}</p>' if scale else ""
    return _asset("page.html").format(title=html.escape(title), about=html.escape(about), scale=scale_line,
                                      style=_asset("page.css"), script=_asset("page.js"), data=embed_json(data))


@cache
def _asset(name: str) -> str:
    return resources.files("trakcli.report").joinpath(name).read_text(encoding="utf-8")


def embed_json(data: Any) -> str:
    """``data`` (finite numbers only) as JSON safe inside ``<script type="application/json">``: ``<``, ``>``, ``&``,
    U+2028 and U+2029 escaped, so no text can close the element or open a comment."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    for raw, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                         ("\u2029", "\\u2029")):
        text = text.replace(raw, escaped)
    return text


def _number(v: Any) -> float | None:
    """A score or contribution for the page: 4 significant digits, None if missing or not finite."""
    if v is None:
        return None
    v = float(v)
    return float(f"{v:.4g}") if math.isfinite(v) else None


def _label(v: Any) -> Any:
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    return str(v)


def _tokens(pairs: Any, where: str) -> tuple[list[str], list[float | None]]:
    """``[[text, contribution or None], ...]`` -> (texts, contributions)."""
    texts, values = [], []
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ArgumentError(f"{where}: each token must be [token text, contribution or null], got {pair!r}")
        texts.append(str(pair[0]))
        values.append(_number(pair[1]))
    return texts, values


def _query(record: Mapping[str, Any], docs: dict[int, dict[str, Any]]) -> tuple[dict[str, Any], int]:
    """One record in the page's form (its documents' texts and tokens moved to ``docs``); the most entries of a side."""
    missing = [key for key in ("target", "proponents", "opponents") if key not in record]
    if missing:
        raise ArgumentError(f"an answer record lacks {', '.join(missing)}: give the records of trakcli.answers "
                            f"(keys target, proponents, opponents), got keys {sorted(record)}")
    t = int(record["target"])
    q: dict[str, Any] = {"t": t}
    if record.get("text") is not None:
        q["text"] = str(record["text"])
    if record.get("label") is not None:
        q["label"] = _label(record["label"])
    most = 0
    for side, key in SIDES:
        entries = []
        for entry in record[side]:
            d = int(entry["train"])
            doc = docs.setdefault(d, {})
            e: dict[str, Any] = {"d": d, "s": _number(entry.get("score"))}
            if entry.get("text") is not None and "text" not in doc:
                doc["text"] = str(entry["text"])
            if entry.get("label") is not None and "label" not in doc:
                doc["label"] = _label(entry["label"])
            for field, owner, values, own in (("target_tokens", q, "tc", "tt"), ("document_tokens", doc, "dc", "dt")):
                if entry.get(field) is not None:
                    texts, e[values] = _tokens(entry[field], f"target {t}, {side}, train {d}: {field}")
                    if owner.setdefault("tok", texts) != texts:  # not expected: a sequence's tokens are the same
                        e[own] = texts
            entries.append(e)
        q[key] = entries
        most = max(most, len(entries))
    return q, most


def _image_rows(x: Any, what: str) -> np.ndarray:
    """``[n, C, H, W]`` float64 of ``[n, H, W]`` / ``[n, C, H, W]`` images."""
    a = as_numpy(x)
    if a.ndim == 3:
        a = a[:, None]
    if a.ndim != 4 or a.shape[1] not in (1, 3) or not np.issubdtype(a.dtype, np.number):
        raise DataError(f"{what}: images must be [n, H, W] or [n, C, H, W] with C = 1 or 3 (real numbers), got "
                        f"shape {list(np.shape(x))} of {a.dtype}")
    return a


def _embed_images(images: tuple[Any, Any], queries: list[dict[str, Any]], docs: dict[int, dict[str, Any]]) -> dict:
    """Put each shown picture into its query or document as base64 uint8 bytes ``[C, H, W]``; the shape."""
    if not isinstance(images, (tuple, list)) or len(images) != 2:
        raise DataError("images: give (train_images, target_images), each [n, H, W] or [n, C, H, W]")
    train, target = _image_rows(images[0], "train images"), _image_rows(images[1], "target images")
    if train.shape[1:] != target.shape[1:]:
        raise DataError(f"train images have shape {list(train.shape[1:])} but target images "
                        f"{list(target.shape[1:])}; give pictures of one shape")
    t_idx = np.array([q["t"] for q in queries], dtype=np.int64)
    d_idx = np.array(sorted(docs), dtype=np.int64)
    for idx, a, what in ((t_idx, target, "target"), (d_idx, train, "train")):
        bad = idx[(idx < 0) | (idx >= len(a))]
        if bad.size:
            raise DataError(f"{what} indices {bad[:5].tolist()} are outside the {len(a)} {what} images")
    shown_t, shown_d = target[t_idx].astype(np.float64), train[d_idx].astype(np.float64)
    finite = [v[np.isfinite(v)] for v in (shown_t, shown_d) if v.size]
    values = np.concatenate([v.ravel() for v in finite]) if finite else np.zeros(1)
    lo, hi = (float(values.min()), float(values.max())) if values.size else (0.0, 1.0)
    scale = 255.0 / (hi - lo) if hi > lo else 0.0

    def encode(img: np.ndarray) -> str:
        v = np.nan_to_num(img, nan=lo, posinf=hi, neginf=lo)
        u8 = np.clip(np.rint((v - lo) * scale) if scale else np.full(v.shape, 128.0), 0, 255).astype(np.uint8)
        return base64.b64encode(u8.tobytes()).decode("ascii")

    for q, img in zip(queries, shown_t):
        q["img"] = encode(img)
    for d, img in zip(d_idx, shown_d):
        docs[int(d)]["img"] = encode(img)
    return {"shape": [int(s) for s in train.shape[1:]]}
