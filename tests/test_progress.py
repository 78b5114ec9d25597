"""trakcli.progress: the plain reporter on a terminal (one line rewritten in place) and elsewhere (rate-limited lines),
the time left measured after a task's first step, and the lines of slow phases."""

from __future__ import annotations

import io
import threading

import pytest

from trakcli.progress import NULL_REPORTER, Estimate, StderrReporter, default_reporter, end_phases


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
    # 2 steps a second after the first: (100 - n) / 2 seconds left
    assert log.getvalue().splitlines() == (
        ["featurize model 0: 0/100 (0%)"]
        + [f"featurize model 0: {n}/100 ({n}%), ~{(100 - n) // 2}s left" for n in range(10, 100, 10)]
        + ["featurize model 0: 100/100 (100%)"]
    )


def test_a_slow_task_prints_a_line_every_30_seconds_between_tenths(clock):
    log = io.StringIO()
    reporter = StderrReporter(log)
    with reporter.task("featurize model 0", 1000) as task:
        for _ in range(10):
            clock.now += 10.0  # one step of 10 s: a tenth of the work takes 1000 s
            task.advance()
            task.update(loss=0.5)
    assert log.getvalue().splitlines() == [  # 10 s a step: 997 steps left are 9970 s
        "featurize model 0: 0/1000 (0%)", "featurize model 0: 3/1000 (0%), ~2h46m left  loss 0.5",
        "featurize model 0: 6/1000 (0%), ~2h45m left  loss 0.5", "featurize model 0: 9/1000 (0%), ~2h45m left  loss 0.5",
        "featurize model 0: 10/1000 (1%), ~2h45m left  loss 0.5",  # the last, when the task ends
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
    # the time left once a step after the first is timed; a shorter line first clears the longer one drawn
    assert term.getvalue() == ("\rscore: 0/4\rscore: 1/4\rscore: 2/4, ~2s left\rscore: 3/4, ~1s left"
                               f"\r{' ' * len('score: 2/4, ~2s left')}\rscore: 4/4\n")


def test_the_default_reporter_follows_stderr(monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert default_reporter().lines
    monkeypatch.setattr("sys.stderr", Terminal())
    assert not default_reporter().lines


# --- the time left ---------------------------------------------------------------------------------------------------


def test_the_time_left_is_not_extrapolated_from_a_slow_first_step(clock):
    est = Estimate(100)
    assert est.left() is None
    clock.now += 600.0  # the first step: a model loaded, a worker started
    est.advance()
    assert est.left() is None  # one step says nothing of the rate
    for _ in range(9):
        clock.now += 1.0
        est.advance()
    assert est.rate() == pytest.approx(1.0)
    assert est.left() == pytest.approx(90.0)  # not 90 * 609 / 10 s


def test_warm_up_may_span_several_steps(clock):
    est = Estimate(20)
    clock.now += 60.0
    for _ in range(4):  # four workers' first models arrive together, each after its start-up
        clock.now += 0.1
        est.advance()
    est.warmed_up()
    assert est.left() is None
    for _ in range(4):
        clock.now += 2.0
        est.advance()
    assert est.left() == pytest.approx(12 * 2.0)  # 0.5 models a second: the rate after the warm-up only


def test_a_log_line_of_the_cli_estimates_from_the_steps_after_the_first(clock, monkeypatch):
    from rich.console import Console

    from trakcli.cli import common

    buf = io.StringIO()
    monkeypatch.setattr(common, "err_console", Console(file=buf, width=200))  # no terminal: log lines
    monkeypatch.setattr(common, "LOG_FIRST", 0.0)
    with common.RichReporter().task("retrain", 50) as task:
        clock.now += 300.0  # a cold first model
        task.advance()
        for _ in range(9):
            clock.now += 2.0
            task.advance()
    lines = buf.getvalue().splitlines()
    assert lines[0] == "retrain: 1/50 (2%), 5m00s elapsed", lines  # no estimate from the first model alone
    assert lines[-1] == "retrain: 10/50 (20%), 5m18s elapsed, ~1m20s left", lines  # 40 models at 2 s


def test_the_cli_bar_shows_the_time_left_after_the_first_step(clock, monkeypatch):
    from rich.console import Console

    from trakcli.cli import common

    buf = io.StringIO()
    monkeypatch.setattr(common, "err_console", Console(file=buf, force_terminal=True, width=160))
    with common.RichReporter().task("retrain", 50) as task:
        clock.now += 300.0
        task.advance()
        assert task.estimate.left() is None
        for _ in range(9):
            clock.now += 2.0
            task.advance()
        task.progress.refresh()
    out = buf.getvalue()
    assert "~1m20s left" in out and "h" not in out.split("left")[0][-8:], out


# --- phases --------------------------------------------------------------------------------------------------------


def test_a_phase_prints_its_line_once_it_has_run_the_delay():
    log = io.StringIO()
    reporter = StderrReporter(log, phase_delay=0.01)
    written = threading.Event()
    write = reporter.phases.write
    reporter.phases.write = lambda line: (write(line), written.set())
    reporter.phase("loading model gpt2 …")
    assert written.wait(30), "the phase's line never came"
    with reporter.task("score", 1) as task:
        task.advance()
    assert log.getvalue().splitlines()[0] == "loading model gpt2 …"


def test_a_quick_phase_prints_nothing():
    log = io.StringIO()
    reporter = StderrReporter(log, phase_delay=3600.0)
    with reporter.phase("hashing checkpoints …"):
        pass
    reporter.phase("loading data.train …")
    reporter.info("done")  # a message ends the phase
    reporter.phase("writing the manifest …")
    end_phases()  # what the CLI does when a command ends
    assert log.getvalue() == "done\n"
    assert reporter.phases.timer is None


def test_phases_without_delay_print_at_once_in_order():
    log = io.StringIO()
    reporter = StderrReporter(log, phase_delay=0)
    reporter.phase("importing torch …")
    with reporter.phase("converting checkpoint …"):
        log.write("converted\n")
    with reporter.task("featurize model 0", 2) as task:
        task.advance(2)
    assert log.getvalue().splitlines() == [
        "importing torch …", "converting checkpoint …", "converted", "featurize model 0: 0/2 (0%)",
        "featurize model 0: 2/2 (100%)",
    ]


def test_the_silent_reporter_takes_phases():
    with NULL_REPORTER.phase("anything …"):
        pass
    NULL_REPORTER.phase("more …")


def test_the_models_log_of_a_download_or_conversion_is_a_phase_line_of_the_command(tmp_path, monkeypatch):
    """trakcli.models logs "converting ... (once)" at INFO; during a command it is a phase line, and -q keeps quiet."""
    from projects import MODEL_FILE, make_project, run

    root = make_project(tmp_path / "p", n_models=1)
    (root / "my_model.py").write_text(MODEL_FILE.replace(
        "    return nn.Sequential",
        "    import logging\n    logging.getLogger('trakcli.models').info('converting x.gguf')\n    return nn.Sequential"))
    monkeypatch.setenv("TRAK_PHASE_DELAY", "0")
    res = run(root, "featurize", "run.yaml")
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert lines.index("converting x.gguf …") == lines.index("loading the model my_model.py:make_model …") + 1
    res = run(root, "featurize", "run.yaml", "-q", "--overwrite")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    import logging

    assert not logging.getLogger("trakcli.models").handlers  # the command's handler is gone with it
