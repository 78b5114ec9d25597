"""Helpers shared by the test modules: a small project on disk, the `trak` CLI in process or in a
subprocess, kills at test events, free ports, and store comparison. Not a test module.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zarr
from typer.testing import CliRunner

from trakcli.cli.main import app
from conftest import MODEL_FILE, tiny_model, write_config

N_TRAIN, N_TARGET, CHUNK = 600, 90, 40  # 15 train chunks per checkpoint, 3 target chunks


def make_project(root: Path, n_models: int = 3) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "my_model.py").write_text(MODEL_FILE)
    (root / "ckpts").mkdir(exist_ok=True)
    for i in range(n_models):
        torch.save(tiny_model(hidden=32, seed=i).state_dict(), root / "ckpts" / f"model_{i}.pt")
    g = torch.Generator().manual_seed(0)
    torch.save(
        {
            "x_train": torch.randn(N_TRAIN, 6, generator=g),
            "y_train": torch.randint(0, 3, (N_TRAIN,), generator=g),
            "x_target": torch.randn(N_TARGET, 6, generator=g),
            "y_target": torch.randint(0, 3, (N_TARGET,), generator=g),
        },
        root / "ckpts" / "data.pt",
    )
    write_config(
        root / "run.yaml",
        {
            "model": {"entrypoint": "my_model.py:make_model", "kwargs": {"hidden": 32}},
            "checkpoints": "ckpts/model_*.pt",
            "data": {
                "train": {"path": "ckpts/data.pt", "inputs": "x_train", "labels": "y_train"},
                "target": {"path": "ckpts/data.pt", "inputs": "x_target", "labels": "y_target"},
                "batch_size": 16,
            },
            "projector": {"kind": "rademacher", "proj_dim": 32, "seed": 0},
            "store": {"path": "out/attrib.zarr", "chunk_rows": CHUNK},
            "num_threads": 1,
        },
    )
    return root


def msg(res) -> str:
    """stderr on one line (rich wraps long messages)."""
    return " ".join(res.stderr.split())


def trak_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "trakcli.cli.main", *args]


def run_subprocess(cwd: Path, *args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """`trak ARGS` in a fresh Python process (for kills, rlimits, torchrun)."""
    return subprocess.run(
        trak_cmd(*args), cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=300, **kw
    )


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def run(cwd: Path, *args: str) -> Result:
    """`trak ARGS` in this process through typer's CliRunner, in directory cwd."""
    old = os.getcwd()
    os.chdir(cwd)
    try:
        res = CliRunner().invoke(app, list(args))
    finally:
        os.chdir(old)
    return Result(res.exit_code, res.stdout, res.stderr)


def arrays(store: Path) -> dict[str, np.ndarray]:
    root = zarr.open_group(str(store), mode="r")
    out = {}

    def walk(group, prefix=""):
        for name, arr in group.arrays():
            out[prefix + name] = np.asarray(arr[:])
        for name, sub in group.groups():
            walk(sub, prefix + name + "/")

    walk(root)
    return out


def assert_same_store(a: Path, b: Path) -> None:
    xa, xb = arrays(a), arrays(b)
    assert sorted(xa) == sorted(xb)
    for name in xa:
        assert xa[name].dtype == xb[name].dtype, name
        np.testing.assert_array_equal(xa[name], xb[name], err_msg=name)


def kill_at(cwd: Path, args: list[str], log: Path, n_events: int) -> bool:
    """Start the command, SIGKILL it once the event log holds n_events 'start' lines. True if killed."""
    proc = subprocess.Popen(
        trak_cmd(*args), cwd=cwd, env={**os.environ, "TRAK_EVENT_LOG": str(log)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline:
        starts = log.read_text().count("start") if log.exists() else 0
        if starts >= n_events:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.002)
    proc.wait()
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def invoke(*args, env: dict | None = None):
    """`trak ARGS` in process through typer's CliRunner, in the current directory (its result, whatever the exit code)."""
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def trak(*args):
    """Run `trak ARGS` in process; it must succeed (its result, for stderr)."""
    res = invoke(*args)
    assert res.exit_code == 0, res.stderr
    return res
