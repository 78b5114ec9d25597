"""Targets beside their top proponents and opponents: images in a grid, other data in tables."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from trakcli.errors import ArgumentError, DataError
from trakcli.plots.common import (OPP_COLOR, OPP_FILL, PRO_COLOR, PRO_FILL, TARGET_COLOR, as_numpy, check_plot_path,
                                  escape_math, new_figure, save_figure, shorten)


def top_indices(row: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The train indices a target's picture shows: its top-``k`` proponents and opponents.

    Proponents are the ``k`` highest positive scores, highest first; opponents the ``k`` lowest negative
    scores, lowest first (a stable argsort read from either end), so either list may be shorter than ``k``.
    Non-finite scores are left out.

    Args:
        row: ``[n_train]`` scores of one target (numpy array or CPU tensor, any float dtype).
        k: how many of each; at least 1.

    Returns:
        ``(proponents, opponents)``, two int64 arrays of at most ``k`` train indices.

    Raises:
        ArgumentError: ``k < 1`` or ``row`` is not 1-D.
    """
    row = as_numpy(row)
    if row.ndim != 1:
        raise ArgumentError(f"top_indices: a target's scores must be 1-D [n_train], got shape {list(row.shape)}")
    if k < 1:
        raise ArgumentError(f"top_indices: k={k}; show at least 1 proponent and opponent")
    valid = np.flatnonzero(np.isfinite(row))
    order = valid[np.argsort(row[valid], kind="stable")]  # ascending score
    pro, opp = order[::-1][:k], order[:k]
    return pro[row[pro] > 0].astype(np.int64), opp[row[opp] < 0].astype(np.int64)


def image_shape_of(dataset: Any) -> tuple[int, ...] | None:
    """The per-example image shape ``(H, W)`` / ``(C, H, W)`` of a dataset (``inputs``), or ``None``: not images.

    A dataset holds images when it declares an ``image_shape`` (the flat digits: ``(8, 8)``), or when its
    ``inputs`` have shape ``[n, H, W]`` or ``[n, C, H, W]`` with ``C`` in 1 or 3.

    Raises:
        DataError: a declared ``image_shape`` that is malformed or does not hold one row of ``inputs``.
    """
    if callable(getattr(dataset, "texts", None)):  # text data (read lazily: never load its inputs here)
        return None
    inputs = getattr(dataset, "inputs", None)
    if inputs is None or isinstance(inputs, Mapping):
        return None
    shape = tuple(int(d) for d in inputs.shape[1:])
    declared = getattr(dataset, "image_shape", None)
    if declared is not None:
        declared = tuple(int(d) for d in declared)
        ok = len(declared) == 2 or (len(declared) == 3 and declared[0] in (1, 3))
        if not ok or min(declared) < 1:
            raise DataError(f"{getattr(dataset, 'name', 'dataset')}: image_shape {list(declared)} is not (H, W) or "
                            "(C, H, W) with C = 1 or 3")
        if math.prod(declared) != math.prod(shape):
            raise DataError(f"{getattr(dataset, 'name', 'dataset')}: image_shape {list(declared)} holds "
                            f"{math.prod(declared)} values but each input has shape {list(shape)} "
                            f"({math.prod(shape)} values)")
        return declared
    if len(shape) == 2 or (len(shape) == 3 and shape[0] in (1, 3)):
        return shape
    return None


class DecodedTexts(Sequence[str]):
    """The texts of tokenized rows (``input_ids`` ``[n, L]``), decoded by ``tokenizer`` one row at a time when a
    plot shows it, special tokens dropped (so case or spacing may differ from the file)."""

    def __init__(self, input_ids: Any, tokenizer: Any):
        self.input_ids = input_ids
        self.tokenizer = tokenizer

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        ids = as_numpy(self.input_ids[int(i)]).tolist()
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class RowTexts(Sequence[str]):
    """Short renderings of a text dataset's rows (``dataset.texts(indices)``), read when a table or plot shows
    them."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self.dataset.texts(list(range(*i.indices(len(self)))))
        return self.dataset.texts([int(i)])[0]


def plot_top(
    path: str | Path, scores: Any, train: Any, target: Any, *, target_ids: Iterable[int] | None = None,
    top_k: int = 5, train_texts: Sequence[str] | None = None, target_texts: Sequence[str] | None = None,
    class_names: Sequence[str] | None = None, title: str | None = None, cmap: str = "gray", dpi: int = 100,
) -> Path:
    """Draw targets beside their top proponents and opponents (:func:`top_indices`), and write the figure.

    Image data (:func:`image_shape_of`): one row per target, the target image, then its ``top_k`` proponents on a green
    panel and opponents on a red one, each titled with train index, label and score (one channel drawn with ``cmap``,
    one intensity range). Other data: one table per target (index, label, score and, given texts, the text cut to fit).

    Args:
        path: file to write, ``.png`` / ``.pdf`` / ``.svg``.
        scores: ``[n, n_train]`` float scores (numpy array or tensor), row ``t`` for target ``t``; may hold
            only the first rows.
        train, target: the datasets (``inputs``, ``labels``), the same kind of inputs.
        target_ids: which targets to draw, in order; default: the first ``min(3, n)``.
        top_k: proponents and opponents shown per target.
        train_texts, target_texts: the text of each example (text data); ``None``: indices only.
        class_names: names of the labels; default: the label number.
        title: figure title; default: a description of what is shown.
        cmap: matplotlib colormap for one-channel images.
        dpi: resolution of raster output.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ArgumentError: bad path or suffix, the file cannot be written, ``top_k < 1``, or a target id out of range.
        DataError: ``scores`` without one column per train example, or texts / class names that do not match.
    """
    path = check_plot_path(path)
    scores = as_numpy(scores)
    if scores.ndim != 2 or scores.shape[1] != len(train.labels):
        raise DataError(f"scores have shape {list(scores.shape)} but there are {len(train.labels)} train examples; "
                        "pass the [n_target, n_train] scores of this train set")
    if top_k < 1:
        raise ArgumentError(f"top_k={top_k}; show at least 1 proponent and opponent per target")
    ids = list(range(min(3, scores.shape[0]))) if target_ids is None else [int(t) for t in target_ids]
    if not ids:
        raise ArgumentError("no targets to draw: target_ids is empty (or scores has no rows)")
    bad = [t for t in ids if not 0 <= t < min(scores.shape[0], len(target.labels))]
    if bad:
        raise ArgumentError(f"target ids {bad[:5]} are out of range: scores has {scores.shape[0]} rows and the target "
                            f"set {len(target.labels)} examples")
    for name, texts, ds in (("train_texts", train_texts, train), ("target_texts", target_texts, target)):
        if texts is not None and len(texts) != len(ds.labels):
            raise DataError(f"{name} has {len(texts)} entries but the dataset has {len(ds.labels)} examples")
    train_y, target_y = as_numpy(train.labels), as_numpy(target.labels)
    if class_names is not None:
        top = int(max(train_y.max(initial=0), target_y.max(initial=0)))
        if top >= len(class_names):
            raise DataError(f"class_names has {len(class_names)} names but the labels go up to {top}")

    classes = not getattr(train, "per_token_labels", False)  # language-model data has no class to show

    def label(y: Any) -> str:
        if not classes:
            return ""
        return str(class_names[int(y)]) if class_names is not None else str(int(y))

    picks = [(t, *top_indices(scores[t], top_k)) for t in ids]
    k = max(max(len(p), len(o)) for _, p, o in picks)
    if k == 0:
        raise DataError(f"targets {ids} have no finite nonzero scores; nothing to draw")
    title = title or (f"TRAK attribution: top {k} proponents (highest scores) and opponents (lowest scores) "
                      f"of {len(ids)} target{'s' if len(ids) > 1 else ''}")
    tr_shape, ta_shape = image_shape_of(train), image_shape_of(target)
    if tr_shape is not None and tr_shape == ta_shape:
        fig = _image_figure(scores, train, target, tr_shape, picks, k, label, title, cmap)
    else:
        fig = _table_figure(scores, train_y, target_y, picks, k, label, title, train_texts, target_texts)
    save_figure(fig, path, dpi)
    return path


def _image_figure(scores, train, target, shape, picks, k, label, title, cmap):
    n_rows = len(picks)
    tr_x, ta_x = as_numpy(train.inputs), as_numpy(target.inputs)
    tr_y, ta_y = as_numpy(train.labels), as_numpy(target.labels)
    shown = [ta_x[[t for t, _, _ in picks]]] + [tr_x[np.concatenate([p, o])] for _, p, o in picks]
    lo = min(float(a.min()) for a in shown)
    hi = max(float(a.max()) for a in shown)
    span = hi - lo if hi > lo else 1.0

    def image(x: np.ndarray) -> np.ndarray:
        img = ((x.reshape(shape).astype(np.float64) - lo) / span).clip(0.0, 1.0)
        if len(shape) == 3:
            img = img[0] if shape[0] == 1 else img.transpose(1, 2, 0)  # [C, H, W] -> [H, W, C]
        return img

    cell_w, cell_h = 1.05, 1.45  # inches per image, with its two title lines
    fig = new_figure(figsize=(cell_w * (1 + 2 * k) + 0.9, cell_h * n_rows + 0.75), layout="constrained")
    fig.get_layout_engine().set(w_pad=0.04, h_pad=0.04, wspace=0.03, hspace=0.05)
    fig.suptitle(title, fontsize=10)
    sub_t, sub_p, sub_o = fig.subfigures(1, 3, width_ratios=[1.15, k, k], wspace=0.02)
    grids = []
    for sub, head, color, fill in ((sub_t, "target", TARGET_COLOR, "white"),
                                   (sub_p, "proponents: highest scores", PRO_COLOR, PRO_FILL),
                                   (sub_o, "opponents: lowest scores", OPP_COLOR, OPP_FILL)):
        sub.set_facecolor(fill)
        sub.suptitle(head, fontsize=10, color=color, fontweight="bold")
        grids.append(np.asarray(sub.subplots(n_rows, 1 if sub is sub_t else k, squeeze=False)))
    ax_t, ax_p, ax_o = grids

    def caption(i: int, t: int) -> str:
        return escape_math(f"#{i} label {label(tr_y[i])}\n{scores[t, i]:+.3g}")

    # long indices or class names: a smaller font rather than titles running into each other
    longest = max(len(line) for t, p, o in picks for i in (*p, *o) for line in caption(int(i), t).split("\n"))
    fontsize = max(5.0, min(8.0, 72 * cell_w * 0.95 / (0.6 * longest)))  # ~0.6 em per character

    def draw(ax, x, text, color):
        img = image(x)
        ax.imshow(img, cmap=cmap if img.ndim == 2 else None, vmin=0.0, vmax=1.0, interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        for spine in ax.spines.values():
            spine.set_edgecolor(color)
            spine.set_linewidth(2.0)
        ax.set_title(text, fontsize=fontsize, color="black", pad=3, linespacing=1.15)

    for r, (t, pro, opp) in enumerate(picks):
        draw(ax_t[r, 0], ta_x[t], escape_math(f"target #{t}\nlabel {label(ta_y[t])}"), TARGET_COLOR)
        for grid, idx, color in ((ax_p, pro, PRO_COLOR), (ax_o, opp, OPP_COLOR)):
            for c in range(k):
                ax = grid[r, c]
                if c >= len(idx):
                    ax.set_axis_off()
                    continue
                i = int(idx[c])
                draw(ax, tr_x[i], caption(i, t), color)
    return fig


def _table_figure(scores, train_y, target_y, picks, k, label, title, train_texts, target_texts):
    with_text = train_texts is not None
    n = len(picks)
    row_h = 0.24  # inches per table row
    block_h = row_h * (k + 1) + 0.45  # rows + header + the target's title line
    width = 13.0 if with_text else 7.5
    fig = new_figure(figsize=(width, block_h * n + 0.5), layout="constrained")
    fig.suptitle(title, fontsize=10)
    axes = np.asarray(fig.subplots(n, 1, squeeze=False))[:, 0]
    tables = []
    cols = ["proponent", "label", "score"] + (["text"] if with_text else [])
    widths = [0.08, 0.06, 0.08, 0.28] if with_text else [0.16, 0.12, 0.22]
    fills = [PRO_FILL] * len(cols) + [OPP_FILL] * len(cols)
    for ax, (t, pro, opp) in zip(axes, picks):
        ax.set_axis_off()
        head = f"target #{t}" + (f", label {label(target_y[t])}" if label(target_y[t]) else "")
        if target_texts is not None:
            head += ": " + shorten(target_texts[t], 110)
        ax.set_title(escape_math(head), fontsize=9, loc="left", color=TARGET_COLOR, fontweight="bold")
        cells = []
        for c in range(k):
            row = []
            for idx in (pro, opp):
                if c < len(idx):
                    i = int(idx[c])
                    part = [f"#{i}", label(train_y[i]), f"{scores[t, i]:+.4g}"]
                    if with_text:
                        part.append(escape_math(shorten(train_texts[i], 200)))  # cut to the cell in _fit_cells
                else:
                    part = [""] * len(cols)
                row += part
            cells.append(row)
        table = ax.table(cellText=cells, colLabels=cols + [c.replace("proponent", "opponent") for c in cols],
                         cellColours=[fills] * k, colColours=fills, colWidths=widths * 2, cellLoc="left",
                         bbox=[0.0, 0.0, 1.0, 1.0])
        table.auto_set_font_size(False)
        table.set_fontsize(8)
        for (r, c), cell in table.get_celld().items():
            cell.set_edgecolor("#bbbbbb")
            cell.PAD = 0.03  # fraction of the cell width left blank on each side
            if r == 0:
                cell.get_text().set_fontweight("bold")
                cell.get_text().set_color(PRO_COLOR if c < len(cols) else OPP_COLOR)
        tables.append(table)
    _fit_cells(fig, tables)
    return fig


def _fit_cells(fig: Any, tables: list) -> None:
    """Shorten (with an ellipsis) every table cell text wider than its cell, measured as drawn."""
    fig.draw_without_rendering()  # run the layout so cells have their final sizes
    renderer = fig.canvas.get_renderer()
    for table in tables:
        for cell in table.get_celld().values():
            text = cell.get_text()
            full = text.get_text()
            room = cell.get_window_extent(renderer).width * (1 - 2 * cell.PAD)
            if text.get_window_extent(renderer).width <= room:
                continue
            lo, hi = 0, len(full)  # longest prefix that fits, by bisection
            while lo < hi:
                mid = (lo + hi + 1) // 2
                text.set_text(full[:mid].rstrip().rstrip("\\") + "…")
                if text.get_window_extent(renderer).width <= room:
                    lo = mid
                else:
                    hi = mid - 1
            text.set_text(full[:lo].rstrip().rstrip("\\") + "…")
