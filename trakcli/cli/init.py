"""`trak init NAME [PATH]`: copy a shipped example config, with its comments, to start a run from (like `tune cp`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from trakcli.cli.common import err_console, handle_errors
from trakcli.errors import UsageError


@handle_errors
def init(
    name: Annotated[
        Optional[str], typer.Argument(help="Example config to copy, e.g. digits (see --list).", show_default=False)
    ] = None,
    path: Annotated[
        Optional[Path],
        typer.Argument(help="Where to write it (a file, or a directory); default ./NAME.yaml.", show_default=False),
    ] = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite an existing file.")] = False,
    list_: Annotated[bool, typer.Option("--list", help="List the shipped example configs and exit.")] = False,
) -> None:
    """Write a commented example config to edit (trak init digits run.yaml); --list shows them."""
    from trakcli.config.examples import example_configs, write_example_config

    if list_:
        for stem, summary in example_configs().items():
            typer.echo(f"{stem:<20} {summary}")
        return
    if name is None:
        raise UsageError(f"name an example config: {', '.join(example_configs())} (trak init --list)")
    dest = write_example_config(name, path, force=force)
    err_console.print(f"[green]wrote[/] {dest}; edit it, then: trak featurize {dest}", highlight=False)
