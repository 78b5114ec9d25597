"""trakcli.progress: the plain reporter on a terminal (one line rewritten in place) and elsewhere (rate-limited lines)."""

from __future__ import annotations

import io

import pytest

from trakcli.progress import StderrReporter, default_reporter


class Clock:
    """time.monotonic for trakcli.progress, moved by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr("trakcli.progress.time.monotonic", c)
    return c


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_stream_that_is_no_terminal_gets_lines_at_each_tenth(clock):
    log = io.StringIO()
    reporter = StderrReporter(log)
    assert reporter.lines
    with reporter.task("featurize model 0", 100) as task:
        for _ in range(100):
            clock.now += 0.5  # 50 s in all: the tenths, not the 30 s, set the lines
            task.advance()
    assert "\r" not in log.getvalue()
    assert log.getvalue().splitlines() == [f"featurize model 0: {n}/100 ({n}%)" for n in range(0, 101, 10)]


def test_a_slow_task_prints_a_line_every_30_seconds_between_tenths(clock):
    log = io.StringIO()
    reporter = StderrReporter(log)
    with reporter.task("featurize model 0", 1000) as task:
        for _ in range(10):
            clock.now += 10.0  # one step of 10 s: a tenth of the work takes 1000 s
            task.advance()
            task.update(loss=0.5)
    assert log.getvalue().splitlines() == [
        "featurize model 0: 0/1000 (0%)", "featurize model 0: 3/1000 (0%)  loss 0.5",
        "featurize model 0: 6/1000 (0%)  loss 0.5", "featurize model 0: 9/1000 (0%)  loss 0.5",
        "featurize model 0: 10/1000 (1%)  loss 0.5",  # the last, when the task ends
    ]


def test_a_quick_task_prints_its_start_and_end_only(clock):
    log = io.StringIO()
    reporter = StderrReporter(log)
    with reporter.task("score", 40) as task:
        for _ in range(40):
            task.advance()  # no time passes: the tenths come within min_gap of each other
    reporter.info("done")
    assert log.getvalue().splitlines() == ["score: 0/40 (0%)", "score: 40/40 (100%)", "done"]


def test_a_terminal_gets_one_line_rewritten_in_place(clock):
    term = Terminal()
    reporter = StderrReporter(term)
    assert not reporter.lines
    with reporter.task("score", 4) as task:
        for _ in range(4):
            clock.now += 1.0
            task.advance()
    assert term.getvalue() == "\rscore: 0/4\rscore: 1/4\rscore: 2/4\rscore: 3/4\rscore: 4/4\n"


def test_the_default_reporter_follows_stderr(monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert default_reporter().lines
    monkeypatch.setattr("sys.stderr", Terminal())
    assert not default_reporter().lines
