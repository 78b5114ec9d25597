"""Pictures of TRAK results: targets beside their proponents and opponents, and sweep curves.

matplotlib is imported inside the drawing functions (``import trakcli`` stays
fast) and drawn off-screen with its non-interactive Agg canvas: no window, no
pyplot global state, safe in a headless job. A figure is written as ``.png``,
``.pdf`` or ``.svg``, chosen by the path's suffix.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from trakcli.errors import DataError, UsageError

#: File formats the plots are written in (matplotlib's own backends, no extra dependency).
PLOT_SUFFIXES = (".png", ".pdf", ".svg")

_PRO_COLOR = "#1a7f37"  # proponents: green
_OPP_COLOR = "#c62828"  # opponents: red
_PRO_FILL = "#e8f5e9"
_OPP_FILL = "#fdecea"
_TARGET_COLOR = "#1f4e9a"


def check_plot_path(path: str | Path, flag: str = "plot path") -> Path:
    """Check that a figure can be written to ``path``, before any work is done.

    Args:
        path: the file to write; its suffix picks the format (``.png``, ``.pdf``, ``.svg``).
        flag: how the path is named in messages (the CLI passes ``"--plot"``).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        UsageError: unknown suffix, missing parent directory, a directory at
            ``path``, or a path the file system refuses (e.g. a name too long).
    """
    path = Path(path)
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(
            f"{flag} {path}: unknown format {path.suffix or '(no suffix)'!r}; use a "
            + " / ".join(PLOT_SUFFIXES) + " path"
        )
    try:
        if not path.parent.is_dir():
            raise UsageError(
                f"{flag} {path}: directory {path.parent} does not exist; create it or choose another path"
            )
        if path.is_dir():
            raise UsageError(f"{flag} {path} is a directory; give a file name such as {path / 'top.png'}")
    except OSError as e:  # e.g. a name too long for the file system
        raise UsageError(f"{flag} {path}: {e.strerror or e}; choose another path") from None
    return path


def top_indices(row: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The train indices a target's picture shows: its top-``k`` proponents and opponents.

    Proponents are the ``k`` highest scores, highest first; opponents the ``k``
    lowest, lowest first (``np.argsort(row, kind="stable")`` read from either
    end). Non-finite scores (NaN, ±inf) are left out of both lists. With fewer
    than ``2k`` train examples the two lists overlap.

    Args:
        row: ``[n_train]`` scores of one target (numpy array or CPU tensor, any float dtype).
        k: how many of each; at least 1.

    Returns:
        ``(proponents, opponents)``, two int64 arrays of at most ``k`` train indices.

    Raises:
        UsageError: ``k < 1`` or ``row`` is not 1-D.
    """
    row = _as_numpy(row)
    if row.ndim != 1:
        raise UsageError(f"top_indices: a target's scores must be 1-D [n_train], got shape {list(row.shape)}")
    if k < 1:
        raise UsageError(f"top_indices: k={k}; show at least 1 proponent and opponent")
    valid = np.flatnonzero(np.isfinite(row))
    order = valid[np.argsort(row[valid], kind="stable")]  # ascending score
    return order[::-1][:k].astype(np.int64), order[:k].astype(np.int64)


def image_shape_of(dataset: Any) -> tuple[int, ...] | None:
    """The per-example image shape of a dataset, or ``None`` if it does not hold images.

    A dataset holds images when it declares an ``image_shape`` attribute
    (``(H, W)`` or ``(C, H, W)``, e.g. the flat digits declare ``(8, 8)``), or
    when its ``inputs`` tensor has shape ``[n, H, W]`` or ``[n, C, H, W]`` with
    ``C`` in 1 or 3 (channels first, as torch models take them). Text (a dict
    of token tensors) and tabular data (``[n, d]``) are not images.

    Args:
        dataset: an object with ``inputs`` (``[n, ...]`` tensor/array or a dict
            of tensors), such as :class:`trakcli.data.TensorDataset`.

    Returns:
        ``(H, W)``, ``(C, H, W)`` or ``None``.

    Raises:
        DataError: a declared ``image_shape`` that is malformed or does not hold
            as many values as one row of ``inputs``.
    """
    inputs = getattr(dataset, "inputs", None)
    if inputs is None or isinstance(inputs, Mapping):
        return None
    shape = tuple(int(d) for d in inputs.shape[1:])
    declared = getattr(dataset, "image_shape", None)
    if declared is not None:
        declared = tuple(int(d) for d in declared)
        ok = len(declared) == 2 or (len(declared) == 3 and declared[0] in (1, 3))
        if not ok or min(declared) < 1:
            raise DataError(
                f"{getattr(dataset, 'name', 'dataset')}: image_shape {list(declared)} is not (H, W) or (C, H, W) "
                "with C = 1 or 3"
            )
        if math.prod(declared) != math.prod(shape):
            raise DataError(
                f"{getattr(dataset, 'name', 'dataset')}: image_shape {list(declared)} holds "
                f"{math.prod(declared)} values but each input has shape {list(shape)} ({math.prod(shape)} values)"
            )
        return declared
    if len(shape) == 2 or (len(shape) == 3 and shape[0] in (1, 3)):
        return shape
    return None


class DecodedTexts(Sequence[str]):
    """The texts of a tokenized dataset, decoded one row at a time when a plot shows it.

    A plot shows a few dozen examples of a possibly large dataset, so nothing
    is decoded up front. The text is the tokenizer's decoding with special
    tokens (padding included) dropped, so it may differ from the file in case
    or spacing (e.g. an uncased tokenizer lowercases).

    Args:
        input_ids: ``[n, L]`` int64 token ids (:func:`trakcli.data.text.load_text`).
        tokenizer: a Hugging Face tokenizer with ``decode``.
    """

    def __init__(self, input_ids: Any, tokenizer: Any):
        self.input_ids = input_ids
        self.tokenizer = tokenizer

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        ids = _as_numpy(self.input_ids[int(i)]).tolist()
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def plot_top(
    path: str | Path,
    scores: Any,
    train: Any,
    target: Any,
    *,
    target_ids: Iterable[int] | None = None,
    top_k: int = 5,
    train_texts: Sequence[str] | None = None,
    target_texts: Sequence[str] | None = None,
    class_names: Sequence[str] | None = None,
    title: str | None = None,
    cmap: str = "gray",
    dpi: int = 100,
) -> Path:
    """Draw targets beside their top proponents and opponents, and write the figure.

    Image data (see :func:`image_shape_of`): one row per target, the target
    image (titled with its index and label) then, on a green panel, its
    ``top_k`` proponents (highest scores first) and, on a red panel, its
    ``top_k`` opponents (lowest scores first), each titled with train index,
    label and score. One channel is drawn with ``cmap``; all images share one
    intensity range. Other data (text, tabular): one table per target listing
    the proponents and opponents (index, label, score and, given texts, the
    text truncated to fit).

    Which examples are shown is :func:`top_indices` of each target's row.

    Args:
        path: file to write, ``.png`` / ``.pdf`` / ``.svg``.
        scores: ``[n, n_train]`` float scores (numpy array or tensor), row ``t``
            for target ``t`` of ``target``; may hold only the first rows
            (e.g. :meth:`trakcli.pipeline.ScoreResult.head`).
        train: the train dataset (``inputs``, ``labels [n_train]``; e.g. a
            :class:`trakcli.data.TensorDataset`).
        target: the target dataset, same kind of inputs as ``train``.
        target_ids: which targets to draw, in order (indices into the rows of
            ``scores``); default: the first ``min(3, n)``.
        top_k: proponents and opponents shown per target.
        train_texts, target_texts: the text of each example (text data), shown
            in the table; ``None``: indices only.
        class_names: names of the labels (``class_names[label]``); default: the label number.
        title: figure title; default: a description of what is shown.
        cmap: matplotlib colormap for one-channel images.
        dpi: resolution of raster output (pixels per inch).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        UsageError: bad path or suffix (see :func:`check_plot_path`), the file
            cannot be written, ``top_k < 1``, or a target id outside ``scores``/``target``.
        DataError: ``scores`` does not have one column per train example, or
            the texts / class names do not match the datasets.
    """
    path = check_plot_path(path)
    scores = _as_numpy(scores)
    if scores.ndim != 2 or scores.shape[1] != len(train.labels):
        raise DataError(
            f"scores have shape {list(scores.shape)} but there are {len(train.labels)} train examples; "
            "pass the [n_target, n_train] scores of this train set"
        )
    if top_k < 1:
        raise UsageError(f"top_k={top_k}; show at least 1 proponent and opponent per target")
    ids = list(range(min(3, scores.shape[0]))) if target_ids is None else [int(t) for t in target_ids]
    if not ids:
        raise UsageError("no targets to draw: target_ids is empty (or scores has no rows)")
    bad = [t for t in ids if not 0 <= t < min(scores.shape[0], len(target.labels))]
    if bad:
        raise UsageError(
            f"target ids {bad[:5]} are out of range: scores has {scores.shape[0]} rows and the target set "
            f"{len(target.labels)} examples"
        )
    for name, texts, ds in (("train_texts", train_texts, train), ("target_texts", target_texts, target)):
        if texts is not None and len(texts) != len(ds.labels):
            raise DataError(f"{name} has {len(texts)} entries but the dataset has {len(ds.labels)} examples")
    train_y, target_y = _as_numpy(train.labels), _as_numpy(target.labels)
    if class_names is not None:
        top = int(max(train_y.max(initial=0), target_y.max(initial=0)))
        if top >= len(class_names):
            raise DataError(f"class_names has {len(class_names)} names but the labels go up to {top}")

    def label(y: Any) -> str:
        return str(class_names[int(y)]) if class_names is not None else str(int(y))

    picks = [(t, *top_indices(scores[t], top_k)) for t in ids]
    k = max(max(len(p), len(o)) for _, p, o in picks)
    if k == 0:
        raise DataError(f"targets {ids} have no finite scores; nothing to draw")
    title = title or (
        f"TRAK attribution: top {k} proponents (highest scores) and opponents (lowest scores) "
        f"of {len(ids)} target{'s' if len(ids) > 1 else ''}"
    )
    tr_shape, ta_shape = image_shape_of(train), image_shape_of(target)
    if tr_shape is not None and tr_shape == ta_shape:
        fig = _image_figure(scores, train, target, tr_shape, picks, k, label, title, cmap)
    else:
        fig = _table_figure(scores, train_y, target_y, picks, k, label, title, train_texts, target_texts)
    _save(fig, path, dpi)
    return path


def _image_figure(scores, train, target, shape, picks, k, label, title, cmap):
    n_rows = len(picks)
    tr_x, ta_x = _as_numpy(train.inputs), _as_numpy(target.inputs)
    tr_y, ta_y = _as_numpy(train.labels), _as_numpy(target.labels)
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
    fig = _new_figure(figsize=(cell_w * (1 + 2 * k) + 0.9, cell_h * n_rows + 0.75), layout="constrained")
    fig.get_layout_engine().set(w_pad=0.04, h_pad=0.04, wspace=0.03, hspace=0.05)
    fig.suptitle(title, fontsize=10)
    sub_t, sub_p, sub_o = fig.subfigures(1, 3, width_ratios=[1.15, k, k], wspace=0.02)
    panels = (
        (sub_t, "target", _TARGET_COLOR, "white"),
        (sub_p, "proponents: highest scores", _PRO_COLOR, _PRO_FILL),
        (sub_o, "opponents: lowest scores", _OPP_COLOR, _OPP_FILL),
    )
    axes = {}
    for sub, head, color, fill in panels:
        sub.set_facecolor(fill)
        sub.suptitle(head, fontsize=10, color=color, fontweight="bold")
        ncols = 1 if sub is sub_t else k
        axes[head] = np.asarray(sub.subplots(n_rows, ncols, squeeze=False))
    ax_t, ax_p, ax_o = (axes[h] for _, h, _, _ in panels)

    def caption(i: int, t: int) -> str:
        return _escape(f"#{i} label {label(tr_y[i])}\n{scores[t, i]:+.3g}")

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
        draw(ax_t[r, 0], ta_x[t], _escape(f"target #{t}\nlabel {label(ta_y[t])}"), _TARGET_COLOR)
        for grid, idx, color in ((ax_p, pro, _PRO_COLOR), (ax_o, opp, _OPP_COLOR)):
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
    fig = _new_figure(figsize=(width, block_h * n + 0.5), layout="constrained")
    fig.suptitle(title, fontsize=10)
    axes = np.asarray(fig.subplots(n, 1, squeeze=False))[:, 0]
    tables = []
    cols = ["proponent", "label", "score"] + (["text"] if with_text else [])
    widths = [0.08, 0.06, 0.08, 0.28] if with_text else [0.16, 0.12, 0.22]
    for ax, (t, pro, opp) in zip(axes, picks):
        ax.set_axis_off()
        head = f"target #{t}, label {label(target_y[t])}"
        if target_texts is not None:
            head += ": " + _short(target_texts[t], 110)
        ax.set_title(_escape(head), fontsize=9, loc="left", color=_TARGET_COLOR, fontweight="bold")
        cells, colors = [], []
        for c in range(k):
            row, fill = [], []
            for idx, fc in ((pro, _PRO_FILL), (opp, _OPP_FILL)):
                if c < len(idx):
                    i = int(idx[c])
                    part = [f"#{i}", label(train_y[i]), f"{scores[t, i]:+.4g}"]
                    if with_text:
                        part.append(_escape(_short(train_texts[i], 200)))  # cut to the cell in _fit_cells
                else:
                    part = [""] * len(cols)
                row += part
                fill += [fc] * len(cols)
            cells.append(row)
            colors.append(fill)
        table = ax.table(
            cellText=cells,
            colLabels=cols + [c.replace("proponent", "opponent") for c in cols],
            cellColours=colors,
            colColours=[_PRO_FILL] * len(cols) + [_OPP_FILL] * len(cols),
            colWidths=widths * 2,
            cellLoc="left",
            bbox=[0.0, 0.0, 1.0, 1.0],
        )
        table.auto_set_font_size(False)
        table.set_fontsize(8)
        for (r, c), cell in table.get_celld().items():
            cell.set_edgecolor("#bbbbbb")
            cell.PAD = 0.03  # fraction of the cell width left blank on each side
            if r == 0:
                cell.get_text().set_fontweight("bold")
                cell.get_text().set_color(_PRO_COLOR if c < len(cols) else _OPP_COLOR)
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


def plot_sweep(
    path: str | Path,
    rows: Sequence[Mapping[str, Any]],
    *,
    default: Mapping[str, Any] | None = None,
    title: str | None = None,
    dpi: int = 100,
) -> Path:
    """Draw the curves of an LDS sweep over proj_dim, checkpoints and lambda, and write the figure.

    Three panels, each point with its 95% bootstrap interval as an error bar:

    1. LDS against ``proj_dim`` (log2 axis), one line per number of
       checkpoints, each point at the best lambda of that (proj_dim, checkpoints) pair;
    2. LDS against the number of checkpoints, one line per ``proj_dim``, best lambda per point;
    3. LDS against ``lambda_rel`` (log axis), one line per ``proj_dim``, at the
       largest number of checkpoints of the sweep (against the absolute
       ``lambda_reg`` if no row has a ``lambda_rel``).

    The best row of the whole sweep is marked with a gold star, the
    ``default`` settings (if they are among the rows) with a black diamond;
    both are described in the title and marked on each panel they fall on.

    Args:
        path: file to write, ``.png`` / ``.pdf`` / ``.svg``.
        rows: one dict per evaluated setting with ``proj_dim`` (int),
            ``n_checkpoints`` (int), ``lambda_rel`` (float or None when an
            absolute lambda was used), ``lambda_reg`` (float or None), ``lds``
            (float, the linear datamodeling score) and ``ci_low``, ``ci_high``
            (floats, 95% bootstrap interval; None: no error bar).
        default: the default settings, a dict with ``proj_dim``,
            ``n_checkpoints``, ``lambda_rel`` (and optionally ``lambda_reg``).
        title: figure title; default: names the best setting.
        dpi: resolution of raster output.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        UsageError: bad path or suffix, the file cannot be written, no rows, or
            a row missing a key or with a non-finite ``lds``.
    """
    path = check_plot_path(path)
    pts = _sweep_points(rows)
    best = max(pts, key=lambda p: p["lds"])
    dflt = _find_default(pts, default) if default is not None else None
    max_m = max(p["n_checkpoints"] for p in pts)
    use_rel = any(p["lambda_rel"] is not None for p in pts)
    lam_key = "lambda_rel" if use_rel else "lambda_reg"

    fig = _new_figure(figsize=(15.0, 5.2), layout="constrained")
    if title is None:
        title = f"LDS sweep (error bars: 95% bootstrap interval)\n★ best: {_describe(best)}"
        if dflt is not None:
            title += f"     ◇ default: {_describe(dflt)}"
    fig.suptitle(title, fontsize=10.5)
    ax_d, ax_m, ax_l = fig.subplots(1, 3)

    # panels 1 and 2: best lambda for each (proj_dim, n_checkpoints)
    best_at: dict[tuple[int, int], dict] = {}
    for p in pts:
        key = (p["proj_dim"], p["n_checkpoints"])
        if key not in best_at or p["lds"] > best_at[key]["lds"]:
            best_at[key] = p
    dims = sorted({d for d, _ in best_at})
    ms = sorted({m for _, m in best_at})
    for i, m in enumerate(ms):
        line = [best_at[(d, m)] for d in dims if (d, m) in best_at]
        _curve(ax_d, [p["proj_dim"] for p in line], line, f"{m} checkpoint{'s' if m > 1 else ''}", _shade(i, len(ms)))
    for i, d in enumerate(dims):
        line = [best_at[(d, m)] for m in ms if (d, m) in best_at]
        _curve(ax_m, [p["n_checkpoints"] for p in line], line, f"proj_dim {d}", _shade(i, len(dims)))
    ax_d.set_xscale("log", base=2)
    _int_ticks(ax_d, dims)
    _int_ticks(ax_m, ms)
    ax_d.set(xlabel="proj_dim", ylabel="LDS", title="LDS vs proj_dim (best λ per point)")
    ax_m.set(xlabel="checkpoints (models ensembled)", ylabel="LDS", title="LDS vs checkpoints (best λ per point)")

    # panel 3: lambda at the largest number of checkpoints
    at_max = [p for p in pts if p["n_checkpoints"] == max_m and p[lam_key] is not None]
    lam_dims = sorted({p["proj_dim"] for p in at_max})
    for i, d in enumerate(lam_dims):
        line = sorted((p for p in at_max if p["proj_dim"] == d), key=lambda p: p[lam_key])
        _curve(ax_l, [p[lam_key] for p in line], line, f"proj_dim {d}", _shade(dims.index(d), len(dims)))
    if at_max and min(p[lam_key] for p in at_max) > 0:
        ax_l.set_xscale("log")
    ax_l.set(
        xlabel="lambda_rel (ridge / mean squared feature norm)" if use_rel else "lambda_reg (absolute ridge)",
        ylabel="LDS",
        title=f"LDS vs λ at {max_m} checkpoint{'s' if max_m > 1 else ''}",
    )

    # the best and default settings, where they belong on each panel's x axis
    for ax, xkey in ((ax_d, "proj_dim"), (ax_m, "n_checkpoints"), (ax_l, lam_key)):
        marks = (
            (best, dict(marker="*", s=260, color="gold", edgecolors="black", zorder=6)),
            (dflt, dict(marker="D", s=70, facecolors="none", edgecolors="black", linewidths=1.6, zorder=7)),
        )
        for p, style in marks:
            if p is None or p[xkey] is None or (ax is ax_l and p["n_checkpoints"] != max_m):
                continue
            ax.scatter([p[xkey]], [p["lds"]], label="best" if p is best else "default", **style)
        ax.grid(True, alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=min(3, len(handles)),
                      frameon=False)
        else:
            ax.text(0.5, 0.5, "no points", ha="center", va="center", transform=ax.transAxes, color="gray")
    _save(fig, path, dpi)
    return path


def _sweep_points(rows: Sequence[Mapping[str, Any]]) -> list[dict]:
    if not rows:
        raise UsageError("plot_sweep: no rows to draw; the sweep produced no results")
    pts = []
    for n, r in enumerate(rows):
        missing = [k for k in ("proj_dim", "n_checkpoints", "lds") if k not in r]
        if missing:
            raise UsageError(
                f"plot_sweep: rows[{n}] has no {', '.join(missing)}; each row needs proj_dim, n_checkpoints, "
                "lambda_rel or lambda_reg, lds, ci_low, ci_high"
            )
        lds = float(r["lds"])
        if not math.isfinite(lds):
            raise UsageError(f"plot_sweep: rows[{n}] has lds={r['lds']!r}; it must be a finite number")
        opt = lambda key: None if r.get(key) is None else float(r[key])  # noqa: E731
        pts.append({
            "proj_dim": int(r["proj_dim"]), "n_checkpoints": int(r["n_checkpoints"]),
            "lambda_rel": opt("lambda_rel"), "lambda_reg": opt("lambda_reg"),
            "lds": lds, "ci_low": opt("ci_low"), "ci_high": opt("ci_high"),
        })
    return pts


def _find_default(pts: list[dict], default: Mapping[str, Any]) -> dict | None:
    """The row of the default settings: same proj_dim and checkpoints, and the same lambda_rel
    (or, if the default gives no lambda_rel, the same absolute lambda_reg)."""
    key = "lambda_rel" if default.get("lambda_rel") is not None else "lambda_reg"
    want = default.get(key)
    for p in pts:
        if p["proj_dim"] != int(default.get("proj_dim", -1)):
            continue
        if p["n_checkpoints"] != int(default.get("n_checkpoints", -1)):
            continue
        have = p[key]
        if (want is None and have is None) or (
            want is not None and have is not None and math.isclose(have, float(want), rel_tol=1e-6)
        ):
            return p
    return None


def _describe(p: Mapping[str, Any]) -> str:
    lam = f"λ_rel={p['lambda_rel']:.3g}" if p.get("lambda_rel") is not None else (
        f"λ={p['lambda_reg']:.3g}" if p.get("lambda_reg") is not None else "λ default")
    return f"LDS {p['lds']:.3f} at proj_dim={p['proj_dim']}, {p['n_checkpoints']} ckpts, {lam}"


def _curve(ax: Any, x: list, line: list[dict], label: str, color: Any) -> None:
    y = np.array([p["lds"] for p in line])
    lo = np.array([p["ci_low"] if p["ci_low"] is not None else p["lds"] for p in line])
    hi = np.array([p["ci_high"] if p["ci_high"] is not None else p["lds"] for p in line])
    yerr = np.vstack([np.clip(y - lo, 0, None), np.clip(hi - y, 0, None)])
    ax.errorbar(x, y, yerr=yerr, marker="o", ms=4, capsize=3, lw=1.5, color=color, label=label)


def _shade(i: int, n: int) -> Any:
    from matplotlib import colormaps

    return colormaps["viridis"](0.85 * i / max(n - 1, 1))


def _int_ticks(ax: Any, values: list[int]) -> None:
    if values:
        ax.minorticks_off()
        ax.set_xticks(values)
        ax.set_xticklabels([str(v) for v in values])


def _new_figure(**kwargs: Any) -> Any:
    """A matplotlib Figure on its own off-screen Agg canvas (no pyplot, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: Path, dpi: int) -> None:
    try:
        fig.savefig(path, dpi=dpi, format=path.suffix.lower().lstrip("."), facecolor="white")
    except OSError as e:
        raise UsageError(f"cannot write the plot to {path}: {e.strerror or e}; choose a writable path") from None


def _as_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _short(text: str, n: int) -> str:
    text = " ".join(str(text).split())  # newlines and runs of spaces -> one space
    return text if len(text) <= n else text[: n - 1].rstrip() + "…"


def _escape(text: str) -> str:
    return text.replace("$", r"\$")  # matplotlib reads $...$ as math
