"""Progress reporting without a UI dependency.

Library functions take a :class:`Reporter`: the CLI's draws rich progress bars, tests get the silent
default, the Python API a :class:`StderrReporter`. Three kinds of report: a *task* (a known number of
steps, with the time left from :class:`Estimate`), a *phase* (a slow step without a bar: one line once it
has run :data:`PHASE_DELAY` seconds) and a one-line *message* (``info``).
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import IO, Any, Callable, Iterator, Union

Field = Union[float, int, str]
"""A live value shown beside a progress bar (floats are shown with 4 significant digits)."""


#: Seconds a phase (:meth:`Reporter.phase`) runs before its line is printed; a quicker step prints nothing.
PHASE_DELAY = 2.0


class Task:
    """A running unit of work with a known total; the silent default ignores everything."""

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more steps as done."""

    def warmed_up(self) -> None:
        """Say that the steps done so far were warm-up: the time left is estimated from the later steps only
        (without a call, the first step counts as warm-up)."""

    def update(self, **fields: Field) -> None:
        """Show live values beside the bar, e.g. ``task.update(loss=0.31, acc=0.92)``; each keeps its value until
        a call names it again."""


class Reporter:
    """Silent reporter; subclasses draw progress bars and print messages."""

    @contextmanager
    def task(self, description: str, total: int) -> Iterator[Task]:
        """A task of ``total`` steps; call ``advance`` (and ``update``) on what it yields."""
        yield Task()

    def info(self, message: str) -> None:
        """A one-line human message (stderr in the CLI)."""

    def phase(self, message: str) -> AbstractContextManager[Any]:
        """Say that a slow step without a progress bar begins, e.g. ``"loading model gpt2 …"``.

        Reporters that print show ``message`` once the step has run :data:`PHASE_DELAY` seconds. The phase
        ends at the reporter's next phase, task or message, or at the exit of the returned context manager.
        """
        return nullcontext()


def format_duration(seconds: float) -> str:
    """``"42s"``, ``"3m05s"`` or ``"2h07m"`` (``seconds`` rounded to whole seconds)."""
    s = int(round(seconds))
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


class Estimate:
    """The time left of a task of ``total`` steps, from its rate after warm-up.

    The first step is often far slower than the others (a model loaded, a worker started), so the rate
    is measured from the end of the first :meth:`advance` (or of the last :meth:`warmed_up`) to the
    latest advance; there is no estimate before a step after that point. ``clock``: monotonic seconds.
    """

    def __init__(self, total: int, clock: Callable[[], float] | None = None):
        self.total = total
        self.clock = clock if clock is not None else time.monotonic
        self.done = 0
        self.mark: tuple[float, int] | None = None  # (time, steps done) when the warm-up ended
        self.last = 0.0  # time of the latest advance

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more steps as done (the first call ends the warm-up)."""
        self.done += n
        self.last = self.clock()
        if self.mark is None:
            self.mark = (self.last, self.done)

    def warmed_up(self) -> None:
        """Measure the rate from now on: the steps done so far were warm-up."""
        self.mark = (self.clock(), self.done)

    def rate(self) -> float | None:
        """Steps per second after the warm-up, or None before a step was done after it."""
        if self.mark is None or self.done <= self.mark[1] or self.last <= self.mark[0]:
            return None
        return (self.done - self.mark[1]) / (self.last - self.mark[0])

    def left(self) -> float | None:
        """Seconds left at the measured rate (0 when done), or None while there is no rate yet."""
        if self.done >= self.total:
            return 0.0
        rate = self.rate()
        return None if rate is None else (self.total - self.done) / rate


#: Every :class:`PhaseLines` with a line pending, so :func:`end_phases` can end them all.
_LIVE: "weakref.WeakSet[PhaseLines]" = weakref.WeakSet()


class PhaseLines:
    """The phases of one reporter: a phase's line is written (by ``write``, from a timer thread under a lock)
    once it has run ``delay`` seconds (0: at once); a phase ended before never writes it."""

    def __init__(self, write: Callable[[str], None], delay: float = PHASE_DELAY):
        self.write, self.delay = write, delay
        self.lock = threading.Lock()
        self.timer: threading.Timer | None = None
        self.serial = 0  # the current phase

    def begin(self, message: str) -> AbstractContextManager[Any]:
        """Start a phase (ending the current one); returns a context manager that ends it at its exit."""
        with self.lock:
            self._cancel()
            self.serial += 1
            serial = self.serial
            if self.delay <= 0:
                self.write(message)
            else:
                self.timer = threading.Timer(self.delay, self._due, (serial, message))
                self.timer.daemon = True
                _LIVE.add(self)
                self.timer.start()
        ends = ExitStack()
        ends.callback(self.end, serial)
        return ends

    def end(self, serial: int | None = None) -> None:
        """End the current phase (or phase ``serial``, if it is still the current one)."""
        with self.lock:
            if serial is None or serial == self.serial:
                self._cancel()

    def _cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _due(self, serial: int, message: str) -> None:
        with self.lock:
            if serial != self.serial or self.timer is None:
                return  # ended meanwhile
            self.timer = None
            self.write(message)


def end_phases() -> None:
    """End every reporter's current phase (the CLI calls it when a command ends: no line comes after)."""
    for lines in list(_LIVE):
        lines.end()


def format_fields(fields: dict[str, Field]) -> str:
    """``{"loss": 0.31234, "acc": 0.9}`` -> ``"loss 0.3123  acc 0.9"`` (what a progress bar shows)."""
    return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())


NULL_REPORTER = Reporter()


class _LineTask(Task):
    """A task shown as ``description: done/total  fields`` (see :class:`StderrReporter`)."""

    def __init__(self, reporter: "StderrReporter", description: str, total: int):
        self.reporter, self.description, self.total = reporter, description, total
        self.done, self.fields, self.shown = 0, {}, 0.0
        self.tenth, self.printed = -1, None  # lines: the tenth of the work and (done, fields) last printed
        self.estimate = Estimate(total)
        self.width = 0  # terminal: the longest line drawn, cleared before a shorter one

    def advance(self, n: int = 1) -> None:
        self.done += n
        self.estimate.advance(n)
        self.show(self.done >= self.total and not self.reporter.lines)

    def warmed_up(self) -> None:
        self.estimate.warmed_up()

    def update(self, **fields: Field) -> None:
        self.fields.update(fields)
        self.show(False)

    def show(self, force: bool) -> None:
        now = time.monotonic()
        extra = format_fields(self.fields)
        left = self.estimate.left() if 0 < self.done < self.total else None
        eta = f", ~{format_duration(left)} left" if left is not None else ""
        tail = f"{eta}{'  ' + extra if extra else ''}"
        if not self.reporter.lines:
            if force or now - self.shown >= self.reporter.interval:
                self.shown = now
                line = f"{self.description}: {self.done}/{self.total}{tail}"
                clear = f"\r{' ' * self.width}" if len(line) < self.width else ""  # the longer line drawn before
                self.width = max(self.width, len(line))
                self.reporter.stream.write(f"{clear}\r{line}")
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
        self.reporter.stream.write(f"{self.description}: {self.done}/{self.total}{pct}{tail}\n")
        self.reporter.stream.flush()


class StderrReporter(Reporter):
    """Plain progress without a UI dependency, :class:`trakcli.Attributor`'s default.

    On a terminal each task has one line, rewritten in place; elsewhere (a log file, a notebook) each task
    prints whole lines: when it starts, at each further tenth of the work or after ``every`` seconds without
    one, and when it ends, e.g. ``featurize model 0: 3200/16000 (20%), ~4m10s left``.

    Args:
        stream: where to write (default: ``sys.stderr``).
        interval: seconds between redraws of a task's line on a terminal.
        lines: print whole lines (True) or rewrite one line (False); None: lines unless ``stream`` is a terminal.
        every: seconds after which a task prints a line even if it has not reached its next tenth (lines only).
        min_gap: fewest seconds between two lines of a task, except its first and last (lines only).
        phase_delay: seconds a phase runs before its message is printed (0: at once).
    """

    def __init__(self, stream: IO[str] | None = None, interval: float = 0.5, *, lines: bool | None = None,
                 every: float = 30.0, min_gap: float = 1.0, phase_delay: float = PHASE_DELAY):
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        if lines is None:
            isatty = getattr(self.stream, "isatty", None)
            lines = not (callable(isatty) and isatty())
        self.lines, self.every, self.min_gap = lines, every, min_gap
        self.phases = PhaseLines(self._line, phase_delay)

    def _line(self, message: str) -> None:
        self.stream.write(message + "\n")
        self.stream.flush()

    def phase(self, message: str) -> AbstractContextManager[Any]:
        return self.phases.begin(message)

    @contextmanager
    def task(self, description: str, total: int) -> Iterator[Task]:
        self.phases.end()
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
        self.phases.end()
        self._line(message)


def default_reporter() -> Reporter:
    """A :class:`StderrReporter` on ``sys.stderr``."""
    return StderrReporter()
