"""What a report shows, read from the store (nothing is computed): an experiment's stored answers
(:func:`trakcli.answers.answer_records`) with its rows' texts, pictures, labels."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from trakcli.answers import TokenFields, answer_records, ridge_meaning, score_meaning, token_fields
from trakcli.errors import DataError, StoreError
from trakcli.jobs.score import ScoreResult
from trakcli.plots import image_shape_of
from trakcli.plots.common import as_numpy
from trakcli.report.html import render_report
from trakcli.store import Store
from trakcli.store.integrity import keys, node

#: Characters of a row's text the page holds (whitespace collapsed); a document's full text up to this.
TEXT_CHARS = 4000


@dataclass
class Rows:
    """How the page shows the rows of one dataset: ``texts(indices)``, pictures ``[n, H, W]`` / ``[n, C, H, W]``,
    ``[n]`` class labels, the text dataset whose tokens per-token answers decode, the number of rows (None each:
    not shown)."""

    texts: Callable[[list[int]], list[str]] | None = None
    images: Any = None
    labels: np.ndarray | None = None
    tokens: Any = None
    n: int | None = None


def rows_of(data: Any) -> Rows:
    """The :class:`Rows` of a dataset, a list of texts, or pictures ``[n, H, W]`` / ``[n, C, H, W]`` (None: none)."""
    if data is None:
        return Rows()
    if callable(getattr(data, "texts", None)):  # text data: read per row when shown
        return Rows(texts=lambda idx: data.texts(idx, max_chars=TEXT_CHARS), labels=_class_labels(data), tokens=data,
                    n=len(data))
    if hasattr(data, "inputs"):  # a TensorDataset
        shape = image_shape_of(data)
        images = None
        if shape is not None:
            x = as_numpy(data.inputs)
            images = x.reshape(len(x), *shape)
        return Rows(images=images, labels=_class_labels(data), n=len(data))
    if isinstance(data, (list, tuple)) and all(isinstance(t, str) for t in data):
        texts = list(data)
        return Rows(texts=lambda idx: [texts[i] for i in idx], n=len(texts))
    x = as_numpy(data)
    if x.ndim in (3, 4):
        return Rows(images=x, n=len(x))
    raise DataError(f"cannot show rows of {type(data).__name__} with shape {list(x.shape)}: give a dataset, a list "
                    "of texts, or pictures [n, H, W] / [n, C, H, W]")


def _class_labels(ds: Any) -> np.ndarray | None:
    """A dataset's ``[n]`` class labels, None for language-model data (per-token labels are not classes)."""
    if getattr(ds, "per_token_labels", False):
        return None
    labels = getattr(ds, "labels", None)
    if labels is None:
        return None
    labels = as_numpy(labels)
    return labels if labels.ndim == 1 else None


def stored_result(store: Store, experiment: str, fix: str = "`trak score CONFIG`") -> ScoreResult:
    """The finished answers of ``experiment`` in ``store`` as a :class:`~trakcli.jobs.score.ScoreResult`: its top-k
    (with per-token scores, if any), else its full matrix; labels and λ left empty.

    Raises:
        StoreError: the experiment has neither a top-k nor a score matrix, or an unfinished one (naming ``fix``,
            the command that computes it).
    """
    group = node(store.root, f"scores/{experiment}")
    top = None if group is None else node(group, "top_k")
    full = None if group is None else node(group, "scores")
    if top is None and full is None:
        scores = node(store.root, "scores")
        have = sorted(keys(scores)) if scores is not None else []
        listed = f"; it holds {', '.join(map(repr, have))}" if have else ""
        raise StoreError(f"store {store.path} holds no scores of experiment {experiment!r} (score.experiment)"
                         f"{listed}; run {fix} first")
    name = f"scores/{experiment}/top_k" if top is not None else f"scores/{experiment}"
    _check_finished(store, name, experiment, fix)
    per_token = top is not None and node(group, "per_token") is not None
    if per_token:
        _check_finished(store, f"scores/{experiment}/per_token", experiment, fix)
    if top is not None:
        n_target, k = (int(d) for d in top["proponents"].shape)
    else:
        n_target = int(full.shape[0])
        k = None
    n_train = int(full.shape[1]) if full is not None else int(store.layout.n_train)
    empty = np.zeros(0, dtype=np.int64)
    return ScoreResult(store=store.path, experiment=experiment, n_target=n_target, n_train=n_train, lambdas=[],
                       train_labels=empty, target_labels=empty, top_k=k, full=full is not None, per_token=per_token)


def _check_finished(store: Store, group: str, experiment: str, fix: str) -> None:
    flags = store.read(f"{group}/done")
    pending = int((np.asarray(flags) == 0).sum())
    if pending:
        raise StoreError(f"the scores of experiment {experiment!r} in {store.path} are unfinished ({group}: {pending} "
                         f"of {flags.size} chunks not computed yet); run {fix} to finish them")


def report_records(res: ScoreResult, k: int, train: Rows, target: Rows) -> list[dict[str, Any]]:
    """The answer records of every target with ``k`` documents a side, their texts and labels, and the per-token
    fields when the experiment has them."""
    tokens: TokenFields | None = None
    if res.per_token and train.tokens is not None and target.tokens is not None:
        fields = token_fields(res, target.tokens, train.tokens)
        tokens = lambda t, side, rank, doc: fields(t, side, rank, doc) if rank < k else None  # noqa: E731
    records = []
    for record in answer_records(res, k, tokens=tokens):
        for side in ("proponents", "opponents"):
            record[side] = record[side][:k]
        records.append(record)
    _fill(records, "target", lambda r: [r], target)
    _fill(records, "train", lambda r: r["proponents"] + r["opponents"], train)
    return records


def _fill(records: list[dict[str, Any]], key: str, entries: Callable[[dict], list[dict]], rows: Rows) -> None:
    """Put each entry's ``text`` and ``label`` (row ``entry[key]`` of ``rows``) into it."""
    if rows.texts is None and rows.labels is None:
        return
    wanted = sorted({int(e[key]) for r in records for e in entries(r)})
    texts: dict[int, str] = {}
    if rows.texts is not None:
        for lo in range(0, len(wanted), 4096):
            part = wanted[lo:lo + 4096]
            texts.update(zip(part, rows.texts(part)))
    for r in records:
        for e in entries(r):
            i = int(e[key])
            if i in texts:
                e["text"] = texts[i]
            if rows.labels is not None and i < len(rows.labels):
                e["label"] = rows.labels[i].item()


def experiment_page(
    store: Store, experiment: str, k: int, *, train: Any = None, target: Any = None, title: str | None = None,
    about: str | None = None, fix: str = "`trak score CONFIG`",
) -> tuple[str, int]:
    """The report page of a stored experiment (``k`` documents a side, the rows shown as :func:`rows_of` of
    ``train`` and ``target``) and its number of targets.

    Raises:
        StoreError: as :func:`stored_result`; DataError: rows that do not match the experiment's shape.
    """
    res = stored_result(store, experiment, fix)
    train_rows, target_rows = rows_of(train), rows_of(target)
    for name, rows, n in (("train", train_rows, res.n_train), ("target", target_rows, res.n_target)):
        if rows.n is not None and rows.n != n:
            raise DataError(f"{rows.n} {name} rows given, but experiment {experiment!r} has {n} {name} rows; give the "
                            "rows it was scored with")
    shown = min(k, res.top_k) if res.top_k else min(k, res.n_train)
    records = report_records(res, shown, train_rows, target_rows)
    both = train_rows.images is not None and target_rows.images is not None
    images = (train_rows.images, target_rows.images) if both else None
    stored = f"top {res.top_k} kept" if res.top_k else "full score matrix"
    about = about if about is not None else (
        f"store {store.path} · {res.n_target} targets, {res.n_train} train rows · top {shown} proponents and "
        f"opponents of each ({stored})" + (" · per-token contributions" if res.per_token else ""))
    page = render_report(records, title=title or f"Experiment {experiment!r}: proponents and opponents",
                         images=images, about=about, scale=scale_of(store, experiment, res.per_token))
    return page, res.n_target


def scale_of(store: Store, experiment: str, per_token: bool = False) -> str:
    """What a score of ``experiment`` is (:func:`~trakcli.answers.score_meaning`), with TRAK's ridges."""
    group = node(store.root, f"scores/{experiment}")
    settings = dict(group.attrs) if group is not None else {}
    identity = store.identity
    text = score_meaning(identity, settings, per_token=per_token)
    if (identity.get("curvature") or {}).get("kind") or settings.get("normalize") == "unit":
        return text
    lambdas = []
    for m in range(len(settings.get("checkpoints") or [])):
        kernel = node(store.root, f"train/{m}/kernel")
        lam = None if kernel is None else kernel.attrs.get("lambda_reg")
        made = {} if kernel is None else dict(kernel.attrs.get("settings") or {})
        if not isinstance(lam, (int, float)) or any(made.get(k) != settings.get(k) for k in ("lambda_reg", "lambda_rel")):
            return text  # no kernel, or one of another ridge: the ridge is not said
        lambdas.append(float(lam))
    if lambdas:
        text += " Ridge " + ridge_meaning(lambdas, settings.get("lambda_rel"), settings.get("lambda_reg")) + "."
    return text


def write_page(path: str | Path, page: str) -> Path:
    """Write a page atomically (:mod:`trakcli.files`): the old file stays whole if the write fails."""
    from trakcli.files import atomic_open

    path = Path(path)
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path

