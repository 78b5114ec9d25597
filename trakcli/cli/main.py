"""The ``trak`` command: one typer app, one module per command."""

from __future__ import annotations


import typer

from trakcli import __version__
from trakcli.cli import featurize, init, inspect, optimize, report, score, select
from trakcli.cli.eval import eval_app
from trakcli.cli.help import TrakCommand, TrakGroup

app = typer.Typer(name="trak",
                  help="Gradient-based data attribution (TRAK): which training examples drove a prediction.",
                  no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False, cls=TrakGroup)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"trakcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version and exit."),
) -> None:
    """trakcli: optimize -> featurize -> score, driven by YAML configs (trak init --list shows the examples)."""


for command in (init.init, optimize.optimize, featurize.featurize, score.score, select.select, report.report,
                inspect.inspect, inspect.export):
    app.command(command.__name__, cls=TrakCommand)(command)
app.add_typer(eval_app, name="eval", cls=TrakGroup, help="Measure the scores: counterfactual retraining (LDS), fact tracing (recall).")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
