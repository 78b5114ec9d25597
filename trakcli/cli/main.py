"""The ``trak`` command: one typer app, one module per command."""

from __future__ import annotations


import typer

from trakcli import __version__
from trakcli.cli import featurize as _featurize
from trakcli.cli import init as _init
from trakcli.cli import inspect as _inspect
from trakcli.cli import optimize as _optimize
from trakcli.cli import report as _report
from trakcli.cli import score as _score
from trakcli.cli import select as _select
from trakcli.cli.eval import eval_app
from trakcli.cli.help import TrakCommand, TrakGroup
from trakcli.cli import sweep as _sweep

app = typer.Typer(
    name="trak",
    help="Gradient-based data attribution (TRAK): which training examples drove a prediction.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    cls=TrakGroup,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"trakcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version and exit."),
) -> None:
    """trakcli: optimize -> featurize -> score, driven by YAML configs (trak init --list shows the examples)."""


app.command("init", cls=TrakCommand)(_init.init)
app.command("optimize", cls=TrakCommand)(_optimize.optimize)
app.command("featurize", cls=TrakCommand)(_featurize.featurize)
app.command("score", cls=TrakCommand)(_score.score)
app.command("select", cls=TrakCommand)(_select.select)
app.command("report", cls=TrakCommand)(_report.report)
app.command("inspect", cls=TrakCommand)(_inspect.inspect)
app.command("export", cls=TrakCommand)(_inspect.export)
eval_app.command("sweep", cls=TrakCommand)(_sweep.sweep)
app.add_typer(eval_app, name="eval", cls=TrakGroup, help="Measure the scores: counterfactual retraining (LDS), fact tracing (recall).")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
