"""Progress reporting without a UI dependency.

Library functions take a :class:`Reporter`; the CLI passes one that draws rich
progress bars on stderr, tests get the silent default, and the Python API
(:class:`trakcli.Attributor`) a :class:`StderrReporter`: a line rewritten in place on a
terminal, rate-limited plain lines on anything else (a log file, a batch job's output).
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
    """A task shown as ``description: done/total  fields``.

    On a terminal one line is rewritten in place, at most every ``interval`` s. Elsewhere
    (``reporter.lines``) whole lines are printed: one when the task starts, one at each further
    tenth of the work or after ``every`` s without one (never two within ``min_gap`` s), and one
    when it ends.
    """

    def __init__(self, reporter: "StderrReporter", description: str, total: int):
        self.reporter, self.description, self.total = reporter, description, total
        self.done, self.fields, self.shown = 0, {}, 0.0
        self.tenth, self.printed = -1, None  # lines: the tenth of the work and (done, fields) last printed

    def advance(self, n: int = 1) -> None:
        self.done += n
        self.show(self.done >= self.total and not self.reporter.lines)

    def update(self, **fields: Field) -> None:
        self.fields.update(fields)
        self.show(False)

    def show(self, force: bool) -> None:
        now = time.monotonic()
        extra = format_fields(self.fields)
        if not self.reporter.lines:
            if force or now - self.shown >= self.reporter.interval:
                self.shown = now
                self.reporter.stream.write(
                    f"\r{self.description}: {self.done}/{self.total}{'  ' + extra if extra else ''}"
                )
                self.reporter.stream.flush()
            return
        tenth = 10 * self.done // self.total if self.total > 0 else 0
        since = now - self.shown
        due = force or since >= self.reporter.every or (tenth > self.tenth and since >= self.reporter.min_gap)
        state = (self.done, extra)
        if not due or state == self.printed:
            return
        self.shown, self.tenth, self.printed = now, tenth, state
        pct = f" ({100 * self.done // self.total}%)" if self.total > 0 else ""
        self.reporter.stream.write(f"{self.description}: {self.done}/{self.total}{pct}{'  ' + extra if extra else ''}\n")
        self.reporter.stream.flush()


class StderrReporter(Reporter):
    """Plain progress without a UI dependency: a task's line, and messages.

    What :class:`trakcli.Attributor` reports with by default (the CLI draws rich progress bars
    instead). On a terminal each task has one line, rewritten in place; on anything else (a log
    file, a notebook, a batch job's output) each task prints whole lines, rate-limited: one when
    it starts, one at each further tenth of the work or after ``every`` seconds without one, and
    one when it ends, e.g. ``featurize model 0: 3200/16000 (20%)``.

    Args:
        stream: where to write (default: ``sys.stderr``).
        interval: seconds between redraws of a task's line on a terminal.
        lines: print whole lines (True) or rewrite one line (False); None: lines unless ``stream`` is a terminal.
        every: seconds after which a task prints a line even if it has not reached its next tenth (lines only).
        min_gap: fewest seconds between two lines of a task, except its first and last (lines only).
    """

    def __init__(self, stream: IO[str] | None = None, interval: float = 0.5, *, lines: bool | None = None,
                 every: float = 30.0, min_gap: float = 1.0):
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        if lines is None:
            isatty = getattr(self.stream, "isatty", None)
            lines = not (callable(isatty) and isatty())
        self.lines, self.every, self.min_gap = lines, every, min_gap

    @contextmanager
    def task(self, description: str, total: int) -> Iterator[Task]:
        task = _LineTask(self, description, total)
        task.show(True)
        try:
            yield task
        finally:
            if self.lines:
                task.show(True)  # the last line, unless the one printed says it already
            else:
                self.stream.write("\n")
                self.stream.flush()

    def info(self, message: str) -> None:
        self.stream.write(message + "\n")
        self.stream.flush()


def default_reporter() -> Reporter:
    """A :class:`StderrReporter` on ``sys.stderr``: a line rewritten in place on a terminal, else rate-limited
    plain lines."""
    return StderrReporter()
