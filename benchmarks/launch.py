"""Run a benchmark's command and measure its own wall time and peak resident memory.

A process forked from a benchmark counts the benchmark's resident memory at the fork in its own peak
RSS (``ru_maxrss``): Linux copies the memory map's high-water mark into the child. A benchmark that
holds gigabytes (a 10^7-row corpus it wrote, a loaded model) would report them as its command's peak.
:func:`run_measured` starts a small launcher (:data:`LAUNCHER`, a fresh interpreter) that forks the
command, so the measured peak is the command's own.

    from benchmarks.launch import run_measured
    got = run_measured(["trak", "score", "run.yaml"], cwd=work, timeout=600)
    got["seconds"], got["peak_rss_gib"], got["exit"], got["timed_out"]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

#: ``python -c LAUNCHER RESULT TIMEOUT CMD...``: runs CMD as its child in the child's own process group,
#: kills that group after TIMEOUT seconds (empty: no limit), and writes ``{"seconds", "maxrss_kib", "exit",
#: "timed_out"}`` to the file RESULT (the command's stdout and stderr stay the command's).
LAUNCHER = """
import json, os, signal, sys, time
result, limit, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.setpgid(0, 0)
    os.execvp(cmd[0], cmd)
timed_out = False
while True:
    done, status, usage = os.wait4(pid, os.WNOHANG)
    if done:
        break
    if limit and time.perf_counter() - t0 > float(limit):
        timed_out = True
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        done, status, usage = os.wait4(pid, 0)
        break
    time.sleep(0.05)
seconds = time.perf_counter() - t0
with open(result, "w") as f:
    json.dump({"seconds": seconds, "maxrss_kib": usage.ru_maxrss, "exit": os.waitstatus_to_exitcode(status),
               "timed_out": timed_out}, f)
"""


def run_measured(cmd: list[str], *, cwd: str | Path, stdout: IO[str] | None = None,
                 env: dict[str, str] | None = None, timeout: float | None = None) -> dict[str, Any]:
    """Run ``cmd`` under :data:`LAUNCHER`: its wall seconds (start-up included), peak RSS and exit code.

    Args:
        cmd: the command and its arguments.
        cwd: its working directory.
        stdout: a text file that gets the command's stdout and stderr together; None captures both
            (returned as ``stdout`` and ``stderr``).
        env: its environment (default this process's).
        timeout: seconds after which the command and every process of its group are killed; the
            result then says ``timed_out`` and its seconds are a lower bound.

    Returns:
        ``seconds`` (float, wall), ``peak_rss_gib`` (float, GiB, the command's own), ``exit`` (int, the
        command's exit code; negative: killed by that signal), ``timed_out`` (bool), and with
        ``stdout=None`` the captured ``stdout`` and ``stderr`` (str).

    Raises:
        RuntimeError: the launcher itself failed (its stderr).
    """
    fd, result = tempfile.mkstemp(prefix="launch-", suffix=".json")
    os.close(fd)
    try:
        limit = "" if timeout is None else str(float(timeout))
        argv = [sys.executable, "-c", LAUNCHER, result, limit, *cmd]
        if stdout is None:
            proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
            captured = {"stdout": proc.stdout, "stderr": proc.stderr}
        else:
            proc = subprocess.run(argv, cwd=cwd, env=env, stdout=stdout, stderr=subprocess.STDOUT, text=True)
            captured = {}
        text = Path(result).read_text()
        if not text:
            raise RuntimeError(f"the launcher of {cmd[0]} failed ({proc.returncode}): {captured.get('stderr', '')[-800:]}")
        got = json.loads(text)
    finally:
        os.unlink(result)
    return {"seconds": got["seconds"], "peak_rss_gib": got["maxrss_kib"] / 2**20, "exit": got["exit"],
            "timed_out": got["timed_out"], **captured}


def trak_command(hint: str = "") -> list[str]:
    """The ``trak`` console script of this interpreter's environment (what a user types); exits naming the fix
    (and ``hint``) when there is none."""
    exe = Path(sys.executable).parent / "trak"
    if not exe.exists():
        raise SystemExit(f"no `trak` script next to {sys.executable}; install trakcli in this environment{hint}")
    return [str(exe)]
