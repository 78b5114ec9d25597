"""Progress reporting without a UI dependency.

Library functions take a :class:`Reporter`; the CLI passes one that draws rich
progress bars on stderr, tests get the silent default, and the Python API
(:class:`trakcli.Attributor`) a :class:`StderrReporter` when stderr is a terminal.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import IO, Iterator, Union

Field = Union[float, int, str]
"""A live value shown beside a progress bar (floats are shown with 4 significant digits)."""


class Task:
    """A running unit of work with a known total; the silent default ignores everything."""

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more steps as done."""

    def update(self, **fields: Field) -> None:
        """Show live values beside the bar, e.g. ``task.update(loss=0.31, acc=0.92)``.

        A field keeps its value until the next call that names it; fields show in
        the order they were first given.
        """


class Reporter:
    """Silent reporter; subclasses draw progress bars and print messages."""

    @contextmanager
    def task(self, description: str, total: int) -> Iterator[Task]:
        """A task of ``total`` steps; call ``advance`` (and ``update``) on what it yields."""
        yield Task()

    def info(self, message: str) -> None:
        """A one-line human message (stderr in the CLI)."""


def format_fields(fields: dict[str, Field]) -> str:
    """``{"loss": 0.31234, "acc": 0.9}`` -> ``"loss 0.3123  acc 0.9"`` (what a progress bar shows)."""
    return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())


NULL_REPORTER = Reporter()


class _LineTask(Task):
    """A task that rewrites one stderr line (``description: done/total  fields``), at most every ``interval`` s."""

    def __init__(self, reporter: "StderrReporter", description: str, total: int):
        self.reporter, self.description, self.total = reporter, description, total
        self.done, self.fields, self.shown = 0, {}, 0.0

    def advance(self, n: int = 1) -> None:
        self.done += n
        self.show(self.done >= self.total)

    def update(self, **fields: Field) -> None:
        self.fields.update(fields)
        self.show(False)

    def show(self, force: bool) -> None:
        now = time.monotonic()
        if force or now - self.shown >= self.reporter.interval:
            self.shown = now
            extra = format_fields(self.fields)
            self.reporter.stream.write(f"\r{self.description}: {self.done}/{self.total}{'  ' + extra if extra else ''}")
            self.reporter.stream.flush()


class StderrReporter(Reporter):
    """Plain progress on a terminal: one line per task, rewritten in place, and messages.

    What :class:`trakcli.Attributor` reports with by default when stderr is a terminal
    (the CLI draws rich progress bars instead).

    Args:
        stream: where to write (default: ``sys.stderr``).
        interval: seconds between redraws of a task's line.
    """

    def __init__(self, stream: IO[str] | None = None, interval: float = 0.5):
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval

    @contextmanager
    def task(self, description: str, total: int) -> Iterator[Task]:
        task = _LineTask(self, description, total)
        task.show(True)
        try:
            yield task
        finally:
            self.stream.write("\n")
            self.stream.flush()

    def info(self, message: str) -> None:
        self.stream.write(message + "\n")
        self.stream.flush()


def default_reporter() -> Reporter:
    """:class:`StderrReporter` when stderr is a terminal, else the silent :data:`NULL_REPORTER`."""
    isatty = getattr(sys.stderr, "isatty", None)
    return StderrReporter() if callable(isatty) and isatty() else NULL_REPORTER
