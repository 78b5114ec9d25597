"""`trak score CONFIG`: featurize targets, finalize kernels, write scores; show proponents/opponents."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional, Sequence

import typer
from rich.table import Table

from trakcli.cli.common import (
    ConfigArg, OverridesArg, OverwriteOpt, PrintConfigOpt, QuietOpt, RichReporter, SkipNonfiniteOpt, VerifyOpt,
    err_console, handle_errors, heavy_imports, load,
)
from trakcli.errors import UsageError

if TYPE_CHECKING:
    import numpy as np

EXPORT_SUFFIXES = (".npy", ".csv")


def check_out(out: Path | None, flag: str = "--out") -> None:
    """Validate an export path before any work is done (exit 2 on a bad one)."""
    if out is None:
        return
    if out.suffix.lower() not in EXPORT_SUFFIXES:
        raise UsageError(f"{flag} {out}: unknown format {out.suffix or '(no suffix)'!r}; use a .npy or .csv path")
    if not out.parent.exists():
        raise UsageError(f"{flag} {out}: directory {out.parent} does not exist; create it or choose another path")


def _short(text: str, width: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def scores_table(
    res, scores: np.ndarray, top_k: int, target_texts: Sequence[str] | None = None, labels: bool = True,
    train_texts: Sequence[str] | None = None,
) -> Table:
    """The table of each shown target's top proponents and opponents.

    Args:
        res: the :class:`~trakcli.jobs.score.ScoreResult` (experiment, labels).
        scores: ``[n_shown, n_train]`` float32, the first targets' scores.
        top_k: train examples per side.
        target_texts: the shown targets' texts (text data): a text column.
        labels: show labels (False for language-model data, whose per-token labels are not classes).
        train_texts: the train examples' texts (text data): an excerpt after each proponent and opponent.
    """
    from trakcli.plots import top_indices

    table = Table(title=f"TRAK scores, experiment {res.experiment!r}: top {top_k} proponents and opponents")
    table.add_column("target", justify="right")
    if labels:
        table.add_column("label", justify="right")
    if target_texts is not None:
        table.add_column("text", max_width=40)
    what = "train index (label) score" if labels else "train index score"
    table.add_column(f"proponents: {what}")
    table.add_column(f"opponents: {what}")
    k = min(top_k, scores.shape[1])
    for t, row in enumerate(scores):
        pro, opp = top_indices(row, k)
        fmt = lambda idx: "\n".join(  # noqa: E731
            (f"{i} ({res.train_labels[i]}) {row[i]:+.4g}" if labels else f"{i} {row[i]:+.4g}")
            + (f" {_short(train_texts[i], 48)}" if train_texts is not None else "") for i in idx
        )
        cells = [str(t)] + ([str(res.target_labels[t])] if labels else [])
        cells += [_short(target_texts[t])] if target_texts is not None else []
        table.add_row(*cells, fmt(pro), fmt(opp))
    return table


def _json(res, scores: np.ndarray, top_k: int, out: Path | None, plot: Path | None,
          train_texts: Sequence[str] | None = None) -> dict[str, Any]:
    """What ``--json`` prints: the run's shape, store, λ per checkpoint and the shown targets' top train indices."""
    from trakcli.plots import top_indices

    k = min(top_k, scores.shape[1])
    top = []
    for t, row in enumerate(scores):
        pro, opp = top_indices(row, k)
        top.append({
            "target": t,
            "proponents": [_entry(i, row, train_texts) for i in pro],
            "opponents": [_entry(i, row, train_texts) for i in opp],
        })
    return {
        "store": str(res.store), "experiment": res.experiment, "n_target": res.n_target, "n_train": res.n_train,
        "lambda_reg": [float(v) for v in res.lambdas], "scores": f"scores/{res.experiment}/scores",
        "exported": str(out) if out else None, "plot": str(plot) if plot else None, "top": top,
    }


def _entry(i: int, row: np.ndarray, texts: Sequence[str] | None) -> dict[str, Any]:
    """One proponent or opponent of ``--json``: its train index, score and (text data) text."""
    entry: dict[str, Any] = {"train": int(i), "score": float(row[i])}
    if texts is not None:
        entry["text"] = texts[int(i)]
    return entry


@handle_errors
def score(
    config: ConfigArg,
    overrides: OverridesArg = None,
    out: Annotated[
        Optional[Path], typer.Option("--out", "-o", help="Also export the scores to this .npy or .csv file.")
    ] = None,
    plot: Annotated[
        Optional[Path],
        typer.Option(
            "--plot",
            help="Also draw the first score.show_targets targets beside their score.top_k proponents and "
            "opponents (images; a table for other data) to this .png, .pdf or .svg file.",
        ),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the result (store, shape, the shown targets' top train indices) "
                           "as JSON on stdout.")
    ] = False,
    print_config: PrintConfigOpt = False,
    overwrite: OverwriteOpt = False,
    quiet: QuietOpt = False,
    skip_nonfinite: SkipNonfiniteOpt = False,
    verify: VerifyOpt = False,
) -> None:
    """Score every target against every train example; writes the n_target x n_train scores to the store."""
    check_out(out)
    if plot is not None:
        from trakcli.plots import check_plot_path

        check_plot_path(plot, "--plot")
    cfg = load(config, overrides, print_config)
    if plot is not None and cfg.score.show_targets == 0:
        raise UsageError("--plot draws the first score.show_targets targets, which is 0; add score.show_targets=3")
    with heavy_imports():  # after the config is valid: importing torch is slow
        from trakcli.jobs.score import score as run
    from trakcli.distributed import init_from_env
    from trakcli.store import Store

    res = run(
        cfg, overwrite=overwrite, skip_nonfinite=skip_nonfinite, verify=verify, reporter=RichReporter(quiet)
    )
    if not init_from_env().is_main:
        return
    if out is not None:
        Store.open_existing(res.store, mode="r").export(f"scores/{res.experiment}/scores", out)
    if plot is not None:
        _plot(cfg, res, plot)
    if json_out:
        head = res.head(cfg.score.show_targets)
        from trakcli.data.load import load_dataset

        train = load_dataset(cfg.data.train, key="data.train")
        texts = _texts(cfg.data.train, train, "data.train")
        sys.stdout.write(json.dumps(_json(res, head, cfg.score.top_k, out, plot, texts), indent=2) + "\n")
    if quiet:
        return
    if cfg.score.show_targets:
        head = res.head(cfg.score.show_targets)
        from trakcli.data.load import load_dataset

        train = load_dataset(cfg.data.train, key="data.train")
        texts = _target_texts(cfg, len(head))
        err_console.print(scores_table(res, head, cfg.score.top_k, texts, labels=not _per_token(train),
                                       train_texts=_texts(cfg.data.train, train, "data.train")))
    lam = ", ".join(f"{v:.3g}" for v in res.lambdas)
    err_console.print(
        f"[green]scores[/] [{res.n_target}, {res.n_train}] -> {res.store} (scores/{res.experiment})"
        f"; lambda_reg per checkpoint: {lam}" + (f"; exported to {out}" if out else "")
        + (f"; plot: {plot}" if plot else "")
    )


def _per_token(ds) -> bool:
    """Whether a dataset's labels are per-token (language-model data), not classes."""
    return bool(getattr(ds, "per_token_labels", False)) or getattr(ds, "labels", None) is not None and ds.labels.ndim == 2


def _plot(cfg, res, path: Path) -> None:
    """Draw the first score.show_targets targets with their proponents and opponents (trakcli.plots)."""
    from trakcli import plots
    from trakcli.data.load import load_dataset

    n = min(cfg.score.show_targets, res.n_target)
    train = load_dataset(cfg.data.train, key="data.train")
    target = load_dataset(cfg.data.target, key="data.target")
    plots.plot_top(
        path, res.head(n), train, target, target_ids=range(n), top_k=cfg.score.top_k,
        train_texts=_texts(cfg.data.train, train, "data.train"),
        target_texts=_texts(cfg.data.target, target, "data.target"),
    )


def _target_texts(cfg, n: int) -> list[str] | None:
    """The first ``n`` target texts (text data: the text, prompt → completion, ...); None for other data."""
    from trakcli.data.load import load_dataset

    texts = _texts(cfg.data.target, load_dataset(cfg.data.target, key="data.target"), "data.target")
    return None if texts is None else [texts[i] for i in range(min(n, len(texts)))]


def _texts(ds_cfg, ds, key: str):
    """Short renderings of a text dataset's rows, read when shown (:class:`trakcli.plots.RowTexts`); None for
    other data."""
    if not callable(getattr(ds, "texts", None)):
        return None
    from trakcli.plots import RowTexts

    return RowTexts(ds)
