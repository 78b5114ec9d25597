"""`trak score CONFIG`: featurize targets, finalize kernels, write scores; show proponents/opponents."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer
from rich.table import Table

from trakcli.cli.common import (
    ConfigArg, OverridesArg, OverwriteOpt, PrintConfigOpt, QuietOpt, RichReporter, err_console, handle_errors, load,
)
from trakcli.errors import UsageError

EXPORT_SUFFIXES = (".npy", ".csv")


def _check_out(out: Path | None) -> None:
    if out is None:
        return
    if out.suffix.lower() not in EXPORT_SUFFIXES:
        raise UsageError(f"--out {out}: unknown format {out.suffix or '(no suffix)'!r}; use a .npy or .csv path")
    if not out.parent.exists():
        raise UsageError(f"--out {out}: directory {out.parent} does not exist; create it or choose another path")


def export_matrix(matrix: np.ndarray, out: Path) -> None:
    """Write a 2-D float32 array as .npy or .csv (rows = targets, columns = train examples)."""
    if out.suffix.lower() == ".npy":
        np.save(out, matrix.astype(np.float32, copy=False))
    else:
        np.savetxt(out, matrix, delimiter=",", fmt="%.7g")


def _table(res, top_k: int, n_show: int) -> Table:
    table = Table(title=f"TRAK scores, experiment {res.experiment!r}: top {top_k} proponents and opponents")
    table.add_column("target", justify="right")
    table.add_column("label", justify="right")
    table.add_column("proponents: train index (label) score")
    table.add_column("opponents: train index (label) score")
    k = min(top_k, res.scores.shape[1])
    for t in range(min(n_show, res.scores.shape[0])):
        row = res.scores[t]
        order = np.argsort(row, kind="stable")
        pro, opp = order[::-1][:k], order[:k]
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
    print_config: PrintConfigOpt = False,
    overwrite: OverwriteOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Score every target against every train example; writes [n_target, n_train] scores to the store."""
    _check_out(out)
    cfg = load(config, overrides, print_config)
    from trakcli import pipeline  # imported after the config is valid: torch import is slow
    res = pipeline.score(cfg, overwrite=overwrite, reporter=RichReporter(quiet))
    if out is not None:
        export_matrix(res.scores, out)
    if quiet:
        return
    if cfg.score.show_targets:
        err_console.print(_table(res, cfg.score.top_k, cfg.score.show_targets))
    lam = ", ".join(f"{v:.3g}" for v in res.lambdas)
    err_console.print(
        f"[green]scores[/] [{res.scores.shape[0]}, {res.scores.shape[1]}] -> {res.store} (scores/{res.experiment})"
        f"; lambda_reg per checkpoint: {lam}" + (f"; exported to {out}" if out else "")
    )
