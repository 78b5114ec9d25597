"""Run indexed tasks in spawned worker processes; the calling process gets every result and writes it.

Used by `trak eval`'s retraining (:func:`trakcli.evaluation.retrain.run_models`) with ``--workers N``; the
caller stays the only writer of the store. What the pool guarantees, and why it is not
:mod:`concurrent.futures` or ``multiprocessing.Pool`` (both checked on Python 3.11):

- a worker exits as soon as its parent process is gone (``kill -9`` of the parent leaves no orphan training on): a
  watchdog thread waits on the parent's sentinel;
- workers ignore SIGINT; on Ctrl-C, on a task's error or when a worker dies, the others are terminated at once.
  ``ProcessPoolExecutor`` cannot stop a running task before Python 3.14 (``terminate_workers``): its shutdown, and
  the interpreter's exit, wait for the tasks in flight (minutes of training);
- a worker that dies (killed, out of memory) is reported with its exit code. ``multiprocessing.Pool`` replaces a
  dead worker and never returns its task: the caller waits forever;
- a task's exception reaches the caller as its message (a :class:`TrakError`)
  or its type, message and the worker's traceback (anything else).

A worker treats the warnings of other libraries as its parent does: when the parent runs inside
:func:`trakcli.library_warnings.library_warnings_to_log` (every `trak` command), so does the worker,
and torch's or numpy's warnings go to its debug log instead of the terminal they share.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from contextlib import nullcontext
from typing import Any, Callable

from trakcli.errors import TrakError
from trakcli.library_warnings import library_warnings_to_log, routing


class WorkerLost(Exception):
    """A worker process exited before the tasks were done (killed, out of memory).

    Attributes:
        exitcode: the exit code of the first dead worker (negative: the signal
            that killed it; 0: all workers exited normally with tasks left).
        unfinished: the task indices whose results never arrived, sorted.
    """

    def __init__(self, exitcode: int, unfinished: list[int]):
        super().__init__(f"a worker process exited (exit code {exitcode}) with tasks {unfinished[:10]} unfinished")
        self.exitcode = exitcode
        self.unfinished = unfinished


def _exit_with_parent() -> None:
    """In a worker: exit as soon as the parent process is gone (killed), so no orphan works on."""
    from multiprocessing.connection import wait

    parent = mp.parent_process()
    if parent is None:
        return
    wait([parent.sentinel])
    os._exit(1)


def _describe(e: BaseException) -> str:
    """A worker's exception as the caller shows it: a TrakError's message, else its type, message and traceback
    (called inside the ``except`` block)."""
    if isinstance(e, TrakError):
        return str(e)
    return f"{e.__class__.__name__}: {e}\n{traceback.format_exc().rstrip()}"


def _worker_main(setup: Callable[[Any], Any], setup_arg: Any, task: Callable[[Any, int], Any], tasks: Any,
                 results: Any, library_warnings: bool = False) -> None:
    """A worker: ``state = setup(setup_arg)``, then ``task(state, k)`` for each ``k`` of ``tasks`` until ``None``,
    putting ``("ok", k, result)`` or, at its first error, ``("error", k, message)`` on ``results`` (``k = -1``:
    the setup failed). ``library_warnings``: other libraries' warnings go to the debug log."""
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it terminates the workers
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    k = -1
    with library_warnings_to_log() if library_warnings else nullcontext():
        try:
            state = setup(setup_arg)
            while (k := tasks.get()) is not None:
                results.put(("ok", k, task(state, k)))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            results.put(("error", k, _describe(e)))


def run_in_workers(items: list[int], *, workers: int, setup: Callable[[Any], Any], setup_arg: Any,
                   task: Callable[[Any, int], Any], on_result: Callable[[int, Any], None],
                   describe: Callable[[int], str], name: str = "trak-worker") -> None:
    """Run ``task(state, k)`` for every ``k`` of ``items`` (each once) in ``workers`` spawned processes.

    Each worker runs ``state = setup(setup_arg)`` once (module-level functions and a picklable argument), then
    the tasks it takes from a shared queue; each result is pickled back and ``on_result(k, result)`` called in
    this process, in the order they finish. The workers (named ``<name>-<i>``) are terminated when this function
    leaves: after the last result, on an error, or on Ctrl-C. They route the warnings of other libraries as this
    process does now (:func:`trakcli.library_warnings.routing`). ``describe(k)`` names task ``k`` in messages.

    Raises:
        TrakError: ``setup`` or a task raised (``"<describe(k)> failed in a
            worker process: <message>"``: a TrakError's message, else the type, message and traceback).
        WorkerLost: a worker process exited with tasks unfinished.
        Whatever ``on_result`` raises.
    """
    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    for k in items:
        tasks.put(k)
    for _ in range(workers):
        tasks.put(None)
    procs = [
        ctx.Process(target=_worker_main, args=(setup, setup_arg, task, tasks, results, routing()), name=f"{name}-{i}",
                    daemon=True)
        for i in range(workers)
    ]
    remaining = set(items)
    try:
        for p in procs:
            p.start()
        while remaining:
            try:
                kind, k, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or all(p.exitcode is not None for p in procs):
                    raise WorkerLost(dead[0].exitcode if dead else 0, sorted(remaining)) from None
                continue
            if kind == "error":
                which = describe(k) if k >= 0 else "starting a worker"
                raise TrakError(f"{which} failed in a worker process: {payload}")
            on_result(k, payload)
            remaining.discard(k)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        tasks.cancel_join_thread()
        results.cancel_join_thread()
        tasks.close()
        results.close()
