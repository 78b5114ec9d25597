"""`trak score CONFIG`: featurize targets, finalize kernels, write scores; show proponents/opponents."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer
from rich.table import Table

from trakcli.cli.common import (
    ConfigArg, OverridesArg, OverwriteOpt, PrintConfigOpt, QuietOpt, RichReporter, SkipNonfiniteOpt, VerifyOpt,
    err_console, handle_errors, load,
)
from trakcli.errors import UsageError
from trakcli.plots import check_plot_path, top_indices

EXPORT_SUFFIXES = (".npy", ".csv")


def check_out(out: Path | None, flag: str = "--out") -> None:
    """Validate an export path before any work is done (exit 2 on a bad one)."""
    if out is None:
        return
    if out.suffix.lower() not in EXPORT_SUFFIXES:
        raise UsageError(f"{flag} {out}: unknown format {out.suffix or '(no suffix)'!r}; use a .npy or .csv path")
    if not out.parent.exists():
        raise UsageError(f"{flag} {out}: directory {out.parent} does not exist; create it or choose another path")


def _table(res, scores: np.ndarray, top_k: int) -> Table:
    table = Table(title=f"TRAK scores, experiment {res.experiment!r}: top {top_k} proponents and opponents")
    table.add_column("target", justify="right")
    table.add_column("label", justify="right")
    table.add_column("proponents: train index (label) score")
    table.add_column("opponents: train index (label) score")
    k = min(top_k, scores.shape[1])
    for t, row in enumerate(scores):
        pro, opp = top_indices(row, k)
        fmt = lambda idx: "\n".join(f"{i} ({res.train_labels[i]}) {row[i]:+.4g}" for i in idx)  # noqa: E731
        table.add_row(str(t), str(res.target_labels[t]), fmt(pro), fmt(opp))
    return table


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
    print_config: PrintConfigOpt = False,
    overwrite: OverwriteOpt = False,
    quiet: QuietOpt = False,
    skip_nonfinite: SkipNonfiniteOpt = False,
    verify: VerifyOpt = False,
) -> None:
    """Score every target against every train example; writes [n_target, n_train] scores to the store."""
    check_out(out)
    if plot is not None:
        check_plot_path(plot, "--plot")
    cfg = load(config, overrides, print_config)
    if plot is not None and cfg.score.show_targets == 0:
        raise UsageError("--plot draws the first score.show_targets targets, which is 0; add score.show_targets=3")
    from trakcli.jobs.score import score as run  # imported after the config is valid: torch import is slow
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
    if quiet:
        return
    if cfg.score.show_targets:
        err_console.print(_table(res, res.head(cfg.score.show_targets), cfg.score.top_k))
    lam = ", ".join(f"{v:.3g}" for v in res.lambdas)
    err_console.print(
        f"[green]scores[/] [{res.n_target}, {res.n_train}] -> {res.store} (scores/{res.experiment})"
        f"; lambda_reg per checkpoint: {lam}" + (f"; exported to {out}" if out else "")
        + (f"; plot: {plot}" if plot else "")
    )


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


def _texts(ds_cfg, ds, key: str):
    """The texts of a text dataset, decoded from its tokens when shown; None for other data."""
    if ds_cfg.text is None or not isinstance(ds.inputs, dict):
        return None
    from trakcli.data.text import load_tokenizer
    from trakcli.plots import DecodedTexts

    return DecodedTexts(ds.inputs["input_ids"], load_tokenizer(ds_cfg.tokenizer, key=f"{key}.tokenizer"))
