"""`trak report CONFIG --out report.html`: one self-contained HTML page of a scored experiment's answers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from trakcli.cli.common import (
    ConfigArg, OverridesArg, PrintConfigOpt, QuietOpt, RichReporter, err_console, handle_errors, load,
)
from trakcli.cli.score import _target_overrides, check_out

REPORT_SUFFIXES = (".html", ".htm")


@handle_errors
def report(
    config: ConfigArg,
    out: Annotated[
        Path,
        typer.Option("--out", "-o", help="The .html file to write: one page, opened from the file in any browser "
                     "(no server, no network).", show_default=False),
    ],
    overrides: OverridesArg = None,
    experiment: Annotated[
        Optional[str],
        typer.Option("--experiment", "-e", help="The experiment to show (default: score.experiment).",
                     show_default=False),
    ] = None,
    targets: Annotated[
        Optional[str],  # not a Path, which would make hf://datasets/... hf:/datasets/...
        typer.Option("--targets", "-t", help="The targets file `trak score --targets` scored (its experiment is "
                     "named after the file unless score.experiment or --experiment is given).", show_default=False),
    ] = None,
    print_config: PrintConfigOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Write one HTML page of an experiment's answers: per target its top proponents and opponents (score.show_top
    a side) with their scores, texts or pictures, and per-token contributions when score.per_token ran. Reads what
    `trak score CONFIG` stored; computes nothing."""
    check_out(out, suffixes=REPORT_SUFFIXES)
    reporter = RichReporter(quiet)
    reporter.phase("reading the config, importing torch …")  # the first line, before the slow imports
    overrides = list(overrides or [])
    if targets is not None:
        overrides += _target_overrides(load(config, overrides, False), targets)
    if experiment is not None:
        overrides.append(f"score.experiment={experiment}")
    cfg = load(config, overrides, print_config)
    from trakcli.evaluation.scores import check_experiment_data, dataset
    from trakcli.report import experiment_page, write_page
    from trakcli.store import Store
    from trakcli.store.integrity import node
    from trakcli.errors import ConfigError, StoreError

    exp = cfg.score.experiment
    path = cfg.store.location
    if not path.exists():
        raise StoreError(f"store {path} does not exist; run `trak featurize CONFIG` and `trak score CONFIG` first")
    reporter.phase(f"reading {path} and the data …")
    store = Store.open_existing(path, mode="r")
    if cfg.data.target is None:
        raise ConfigError("data.target: unset, so there are no targets to show; give data.target (or --targets FILE) "
                          "as `trak score CONFIG` ran with")
    train, target = dataset(cfg), dataset(cfg, "target")
    group = node(store.root, f"scores/{exp}")
    if group is not None:  # the texts and pictures shown must be the rows that were scored
        check_experiment_data(cfg, store, dict(group.attrs), train)
    title = f"{config.stem}: experiment {exp!r}"
    with reporter.phase(f"writing the page of experiment {exp!r} …"):
        page, n = experiment_page(store, exp, cfg.score.show_top, train=train, target=target, title=title)
        write_page(out, page)
    if not quiet:
        err_console.print(f"report of {n} targets -> {out}", highlight=False)
