"""Shared pieces of the CLI: error handling, config loading, rich progress on stderr.

Every command module imports this one, and ``trak --help`` imports every command
module: what only a running command needs (the config schema and pydantic, yaml,
rich's progress bars) is imported where it is used.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape

from trakcli.errors import TrakError
from trakcli.library_warnings import library_warnings_to_log
from trakcli.progress import (
    PHASE_DELAY, Estimate, Field, PhaseLines, Reporter, Task, end_phases, format_duration, format_fields,
)

if TYPE_CHECKING:
    from rich.progress import Progress

    from trakcli.config import Config

err_console = Console(stderr=True, soft_wrap=True)

# Annotated parameter types shared by the commands
ConfigArg = Annotated[
    Path, typer.Argument(help="YAML config file (`trak init NAME` writes an example).", show_default=False)
]
OverridesArg = Annotated[
    Optional[list[str]],
    typer.Argument(help="key=value overrides, e.g. projector.proj_dim=512 data.batch_size=64.", show_default=False),
]
PrintConfigOpt = Annotated[bool, typer.Option("--print-config", help="Print the resolved config (YAML) and exit.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Discard what the store holds for this run and start over.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or messages on stderr.")]
SkipNonfiniteOpt = Annotated[
    bool,
    typer.Option("--skip-nonfinite",
                 help="Record examples with NaN/inf gradients and give them zero features instead of stopping."),
]
VerifyOpt = Annotated[
    bool, typer.Option("--verify", help="Check every stored chunk's checksum and recompute corrupt ones.")
]


#: What to change when a run does not fit in memory (the keys that size its arrays).
OUT_OF_MEMORY_FIX = "lower projector.proj_dim, data.batch_size, data.grad_memory_mb or store.chunk_rows"


def _out_of_memory(e: BaseException) -> bool:
    """A ``MemoryError`` or torch's ``OutOfMemoryError`` (CUDA), without importing torch."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return isinstance(e, MemoryError) or (oom is not None and isinstance(e, oom))


def _print_error(message: str) -> None:
    first, _, rest = message.partition("\n")
    err_console.print(f"[bold red]error:[/] [red]{escape(first)}[/]", highlight=False, soft_wrap=True)
    if rest:
        err_console.print(escape(rest), highlight=False, soft_wrap=True)


#: The logger whose INFO records (a model downloaded from the Hub, a GGUF file converted) start a phase line.
PHASE_LOGGER = "trakcli.models"

_reporter: RichReporter | None = None  # the running command's reporter (the last one it made)


class _PhaseHandler(logging.Handler):
    """A log record of :data:`PHASE_LOGGER` at INFO or above becomes a phase of the command's reporter."""

    def emit(self, record: logging.LogRecord) -> None:
        if _reporter is not None:
            _reporter.phase(f"{record.getMessage()} …")


@contextmanager
def _phases_of_library_logs() -> Iterator[None]:
    """During a command: the INFO records of :data:`PHASE_LOGGER` are phases (:class:`RichReporter`), and no
    phase line is printed after the command ends."""
    global _reporter
    handler, logger = _PhaseHandler(logging.INFO), logging.getLogger(PHASE_LOGGER)
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        end_phases()  # a phase line still pending would come after the command's last line
        _reporter = None
        logger.removeHandler(handler)
        logger.setLevel(level)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a TrakError into a red message on stderr and its exit code (TRAK_DEBUG=1: traceback).

    Running out of memory (``MemoryError``, torch's ``OutOfMemoryError``) is reported the same way, exit code 1,
    with the config keys that size the arrays. Warnings of other libraries go to the debug log
    (:func:`library_warnings_to_log`); :func:`_phases_of_library_logs` runs around the command.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with library_warnings_to_log(), _phases_of_library_logs():
                return fn(*args, **kwargs)
        except TrakError as e:
            if os.environ.get("TRAK_DEBUG"):
                raise
            _print_error(str(e))
            raise typer.Exit(e.exit_code) from None
        except Exception as e:
            if not _out_of_memory(e) or os.environ.get("TRAK_DEBUG"):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            _print_error(f"out of memory: {first}; {OUT_OF_MEMORY_FIX}")
            raise typer.Exit(1) from None
        except KeyboardInterrupt as e:
            kept = "".join(f"{note}; " for note in getattr(e, "__notes__", []))  # what the job kept, e.g. featurize's rows
            err_console.print(f"[yellow]interrupted; {escape(kept)}rerun the same command to resume[/]")
            raise typer.Exit(130) from None

    return wrapper


def load(config: Path, overrides: list[str] | None, print_config: bool) -> Config:
    """Load and validate the config; with ``--print-config`` print it to stdout and exit 0."""
    from trakcli.config import load_config

    cfg = load_config(config, overrides or [])
    if print_config:
        import yaml

        sys.stdout.write(yaml.safe_dump(cfg.resolved(), sort_keys=False))
        raise typer.Exit(0)
    return cfg


class _CliTask(Task):
    """A task's steps, time left (:class:`~trakcli.progress.Estimate`) and live fields, drawn by :meth:`show`."""

    def __init__(self, total: int, clock: Any = None):
        self.total, self.done, self.fields = total, 0, {}
        self.estimate = Estimate(total, clock)

    def advance(self, n: int = 1) -> None:
        self.done += n
        self.estimate.advance(n)
        self.show(n)

    def warmed_up(self) -> None:
        self.estimate.warmed_up()

    def update(self, **fields: Field) -> None:
        self.fields.update(fields)
        self.show(0)

    def show(self, advanced: int) -> None:
        raise NotImplementedError


class _RichTask(_CliTask):
    def __init__(self, progress: Progress, description: str, total: int):
        super().__init__(total)
        self.progress = progress
        self.task_id = progress.add_task(description, total=total, status="", estimate=self.estimate)

    def show(self, advanced: int) -> None:
        self.progress.update(self.task_id, advance=advanced, status=format_fields(self.fields))


#: Seconds a task runs before its first progress line when stderr is not a terminal (a log file, a batch
#: job's output), and between later lines; ``TRAK_PROGRESS_INTERVAL`` sets the second.
LOG_FIRST, LOG_EVERY = 10.0, 60.0


class _LogTask(_CliTask):
    """Progress as plain log lines (``description: done/total (pct), elapsed, ~left  fields``) for a non-terminal.

    A task done within ``LOG_FIRST`` seconds prints nothing; a longer one prints a line then, every
    ``every`` seconds after, and one when it ends. The time left is :class:`~trakcli.progress.Estimate`'s:
    measured after the first step, never extrapolated from it.
    """

    def __init__(self, description: str, total: int, every: float):
        import time

        self.clock = time.monotonic
        super().__init__(total, self.clock)
        self.description, self.every = description, every
        self.start = self.clock()
        self.next, self.printed = self.start + LOG_FIRST, None  # printed: the (done, fields) last shown

    def show(self, advanced: int = 0, final: bool = False) -> None:
        now = self.clock()
        state = (self.done, format_fields(self.fields))
        if not (now >= self.next or (final and self.printed and state != self.printed)):
            return
        self.next, self.printed = now + self.every, state
        elapsed = now - self.start
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        estimate = self.estimate.left() if 0 < self.done < self.total else None
        left = f", ~{format_duration(estimate)} left" if estimate is not None else ""
        extra = format_fields(self.fields)
        err_console.print(f"{self.description}: {self.done}/{self.total}{pct}, {format_duration(elapsed)} elapsed{left}"
                          + (f"  {extra}" if extra else ""), highlight=False, markup=False)


def _env_seconds(name: str, default: float) -> float:
    """Seconds from the environment variable ``name``, else (unset or not a number) ``default``."""
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def _time_left_column() -> Any:
    """A rich progress column of :class:`~trakcli.progress.Estimate`'s time left (``~1m05s left``; blank
    until the rate after the first step is known)."""
    from rich.progress import ProgressColumn
    from rich.table import Column
    from rich.text import Text

    class TimeLeft(ProgressColumn):
        def __init__(self) -> None:
            super().__init__(table_column=Column(no_wrap=True))

        def render(self, task: Any) -> Text:
            estimate = task.fields.get("estimate")
            left = estimate.left() if estimate is not None and not task.finished else None
            return Text(f"~{format_duration(left)} left" if left is not None else "", style="progress.remaining")

    return TimeLeft()


class RichReporter(Reporter):
    """Progress bars and messages on stderr (log lines when stderr is no terminal); silent with ``quiet``.

    A phase (:meth:`~trakcli.progress.Reporter.phase`) prints its message, dimmed, once it has run
    ``TRAK_PHASE_DELAY`` seconds (default :data:`~trakcli.progress.PHASE_DELAY`).
    """

    def __init__(self, quiet: bool = False):
        global _reporter
        self.quiet = quiet
        self.phases = PhaseLines(self._phase_line, max(0.0, _env_seconds("TRAK_PHASE_DELAY", PHASE_DELAY)))
        _reporter = self  # the command's: library log records that start a phase go to it

    @staticmethod
    def _phase_line(message: str) -> None:
        err_console.print(f"[dim]{escape(message)}[/]", highlight=False)

    def phase(self, message: str) -> Any:
        if self.quiet:
            return super().phase(message)
        return self.phases.begin(message)

    @contextmanager
    def task(self, description: str, total: int) -> Iterator[Task]:
        if self.quiet:
            yield Task()
            return
        self.phases.end()
        if not err_console.is_terminal:
            task = _LogTask(description, total, max(_env_seconds("TRAK_PROGRESS_INTERVAL", LOG_EVERY), 1.0))
            yield task
            task.show(final=True)
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.table import Column

        # the live values of Task.update (loss, accuracy, ...) take the width left over and are cut
        # with an ellipsis on a narrow terminal; the other columns keep theirs, the bar shrinks to 10
        fixed = lambda: Column(no_wrap=True)  # noqa: E731
        progress = Progress(
            TextColumn("[bold]{task.description}", table_column=fixed()),
            BarColumn(bar_width=max(10, min(40, err_console.width - 100)), table_column=fixed()),
            MofNCompleteColumn(table_column=fixed()),
            TimeElapsedColumn(table_column=fixed()),
            _time_left_column(),
            TextColumn("{task.fields[status]}", markup=False,
                       table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
            console=err_console, transient=True, expand=True,
        )
        with progress:
            yield _RichTask(progress, description, total)

    def info(self, message: str) -> None:
        if not self.quiet:
            self.phases.end()
            err_console.print(escape(message), highlight=False)
