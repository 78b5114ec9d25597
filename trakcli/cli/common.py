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
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape

from trakcli.errors import TrakError, in_library
from trakcli.progress import Field, Reporter, Task, format_fields

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
    typer.Option(
        "--skip-nonfinite",
        help="Record examples with NaN/inf gradients and give them zero features instead of stopping.",
    ),
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


#: Where the warnings of other libraries go during a command (:func:`library_warnings_to_log`), at debug level.
warnings_log = logging.getLogger("trakcli.warnings")

#: The files of the ``warnings`` machinery, whose frames are skipped when looking for the code that issued a warning.
_WARNING_FILES = {os.path.realpath(f) for f in (warnings.__file__, getattr(sys.modules.get("_py_warnings"), "__file__", None))
                  if f}


def _issued_by_library(filename: str) -> bool:
    """Whether the warning being shown was issued by a library (torch, transformers, peft, numpy, ...).

    Called inside ``warnings.showwarning``, while the code that warned is still on the stack: its frame is
    the first one outside the ``warnings`` module. A library issued it when that frame is a library's, or
    the warning's own ``filename`` is (whatever ``stacklevel`` it chose), or when the frame (trakcli's or
    the user's) never calls ``warnings.warn`` itself: then a C extension warned (torch's C++ ``TORCH_WARN``)
    inside an operation that frame ran.
    """
    if in_library(filename):
        return True
    frame = sys._getframe(2)  # the caller of showwarning (below: the frame that warned)
    while frame is not None and os.path.realpath(frame.f_code.co_filename) in _WARNING_FILES:
        frame = frame.f_back
    if frame is None:
        return False
    code = frame.f_code
    return in_library(code.co_filename) or not {"warn", "warn_explicit"} & set(code.co_names)


@contextmanager
def library_warnings_to_log() -> Iterator[None]:
    """During a command, the Python warnings of other libraries go to :data:`warnings_log` at debug level.

    peft's ``UserWarning: fan_in_fan_out is set to False ...``, transformers' and torch's deprecations
    say nothing a ``trak`` user can act on; warnings that trakcli's or the user's own code issues
    (``warnings.warn`` in a model file) still reach stderr. ``TRAK_DEBUG=1`` shows every warning, as
    Python does; a ``logging`` handler at DEBUG on ``trakcli.warnings`` receives them too.
    """
    if os.environ.get("TRAK_DEBUG"):
        yield
        return
    shown = warnings.showwarning

    def show(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        if _issued_by_library(filename):
            warnings_log.debug("%s:%s: %s: %s", filename, lineno, category.__name__, message)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        if warnings.showwarning is show:  # a nested catch_warnings restored it already otherwise
            warnings.showwarning = shown


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a TrakError into a red message on stderr and its exit code (TRAK_DEBUG=1: traceback).

    Running out of memory (``MemoryError``, torch's ``OutOfMemoryError``) is reported
    the same way, exit code 1, with the config keys that size the arrays. Warnings of
    other libraries go to the debug log (:func:`library_warnings_to_log`).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with library_warnings_to_log():
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


class _RichTask(Task):
    def __init__(self, progress: Progress, task_id: Any):
        self.progress, self.task_id = progress, task_id
        self.fields: dict[str, Field] = {}

    def advance(self, n: int = 1) -> None:
        self.progress.advance(self.task_id, n)

    def update(self, **fields: Field) -> None:
        self.fields.update(fields)
        self.progress.update(self.task_id, status=format_fields(self.fields))


#: Seconds a task runs before its first progress line when stderr is not a terminal (a log file, a batch
#: job's output), and between later lines; ``TRAK_PROGRESS_INTERVAL`` sets the second.
LOG_FIRST, LOG_EVERY = 10.0, 60.0


class _LogTask(Task):
    """Progress as plain log lines (``description: done/total (pct), elapsed, ~left  fields``) for a non-terminal.

    A task done within ``LOG_FIRST`` seconds prints nothing; a longer one prints a line then, every
    ``every`` seconds after, and one when it ends.
    """

    def __init__(self, description: str, total: int, every: float):
        import time

        self.clock = time.monotonic
        self.description, self.total, self.every = description, total, every
        self.done, self.fields = 0, {}
        self.start = self.clock()
        self.next, self.printed = self.start + LOG_FIRST, None  # printed: the (done, fields) last shown

    def advance(self, n: int = 1) -> None:
        self.done += n
        self.maybe_print()

    def update(self, **fields: Field) -> None:
        self.fields.update(fields)
        self.maybe_print()

    def maybe_print(self, final: bool = False) -> None:
        now = self.clock()
        state = (self.done, format_fields(self.fields))
        if not (now >= self.next or (final and self.printed and state != self.printed)):
            return
        self.next, self.printed = now + self.every, state
        elapsed = now - self.start
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        left = (f", ~{_duration(elapsed * (self.total - self.done) / self.done)} left"
                if 0 < self.done < self.total else "")
        extra = format_fields(self.fields)
        err_console.print(f"{self.description}: {self.done}/{self.total}{pct}, {_duration(elapsed)} elapsed{left}"
                          + (f"  {extra}" if extra else ""), highlight=False, markup=False)


def _duration(seconds: float) -> str:
    """``"42s"``, ``"3m05s"`` or ``"2h07m"``."""
    s = int(round(seconds))
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


class RichReporter(Reporter):
    """Progress bars and messages on stderr (log lines when stderr is no terminal); silent with ``quiet``."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet

    @contextmanager
    def task(self, description: str, total: int) -> Iterator[Task]:
        if self.quiet:
            yield Task()
            return
        if not err_console.is_terminal:
            try:
                every = float(os.environ.get("TRAK_PROGRESS_INTERVAL", LOG_EVERY))
            except ValueError:
                every = LOG_EVERY
            task = _LogTask(description, total, max(every, 1.0))
            yield task
            task.maybe_print(final=True)
            return
        from rich.progress import (
            BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
        )
        from rich.table import Column

        # the live values of Task.update (loss, accuracy, ...) take the width left over and are cut
        # with an ellipsis on a narrow terminal; the other columns keep theirs, the bar shrinks to 10
        fixed = lambda: Column(no_wrap=True)  # noqa: E731
        progress = Progress(
            TextColumn("[bold]{task.description}", table_column=fixed()),
            BarColumn(bar_width=max(10, min(40, err_console.width - 100)), table_column=fixed()),
            MofNCompleteColumn(table_column=fixed()),
            TimeElapsedColumn(table_column=fixed()),
            TimeRemainingColumn(table_column=fixed()),
            TextColumn(
                "{task.fields[status]}", markup=False,
                table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis"),
            ),
            console=err_console,
            transient=True,
            expand=True,
        )
        with progress:
            yield _RichTask(progress, progress.add_task(description, total=total, status=""))

    def info(self, message: str) -> None:
        if not self.quiet:
            err_console.print(escape(message), highlight=False)
