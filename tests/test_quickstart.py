"""scripts/quickstart.sh with config overrides, run with a stub `trak` that records each command's arguments.

The stub replaces the environment setup (scripts/_env.sh) too, so the test installs and trains nothing; the
arguments each command would get are then loaded against configs/digits.yaml as the real CLI loads them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from trakcli.config import load_config

ROOT = Path(__file__).resolve().parent.parent

STUB_ENV = """set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PATH="$ROOT/bin:$PATH"
"""

STUB_TRAK = """#!/usr/bin/env bash
# one line per call: the command, then its arguments separated by tabs
(IFS=$'\\t'; printf '%s\\n' "$*") >> "$(dirname "$0")/../calls.tsv"
"""


def run_quickstart(tmp_path: Path, *args: str) -> dict[str, list[str]]:
    """Run a copy of the quickstart in ``tmp_path`` with a stub trak; the arguments of each command, by name."""
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "quickstart.sh", tmp_path / "scripts" / "quickstart.sh")
    (tmp_path / "scripts" / "_env.sh").write_text(STUB_ENV)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "trak").write_text(STUB_TRAK)
    os.chmod(tmp_path / "bin" / "trak", 0o755)
    subprocess.run(["bash", str(tmp_path / "scripts" / "quickstart.sh"), *args], check=True, cwd=tmp_path,
                   capture_output=True, text=True)
    calls = {}
    for line in (tmp_path / "calls.tsv").read_text().splitlines():
        fields = line.split("\t")
        name = fields[0] if fields[0] != "eval" else f"eval {fields[1]}"
        rest = fields[1:] if fields[0] != "eval" else fields[2:]
        assert rest[0] == "configs/digits.yaml"
        calls[name] = rest[1:]
    assert list(calls) == ["optimize", "featurize", "score", "report", "eval lds"]
    return calls


def overrides(args: list[str]) -> list[str]:
    """The key=value arguments of a command (its options and their values left out)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a.startswith("--"):
            skip = a in ("--out", "--plot", "--workers")
        else:
            out.append(a)
    return out


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_without_arguments_the_quickstart_writes_runs_digits(tmp_path):
    calls = run_quickstart(tmp_path)
    assert calls["optimize"] == []
    assert calls["featurize"] == []
    assert option(calls["score"], "--out") == "runs/digits/scores.npy"
    assert option(calls["score"], "--plot") == "runs/digits/top.png"
    assert option(calls["eval lds"], "--out") == "runs/digits/lds.json"


def test_a_projector_override_gets_its_own_store_and_outputs_and_does_not_reach_optimize(tmp_path):
    calls = run_quickstart(tmp_path, "projector.proj_dim=2048")
    out = "runs/digits-projector.proj_dim=2048"
    assert calls["optimize"] == []  # the checkpoints of runs/digits/ckpts are shared
    for name in ("featurize", "score", "report", "eval lds"):
        cfg = load_config(ROOT / "configs" / "digits.yaml", overrides(calls[name]))
        assert cfg.projector.proj_dim == 2048
        assert Path(cfg.store.path) == Path(out) / "attrib.zarr"
        assert Path(str(cfg.checkpoints)) == Path("runs/digits/ckpts/manifest.json")
    assert option(calls["score"], "--out") == f"{out}/scores.npy"
    assert option(calls["score"], "--plot") == f"{out}/top.png"
    assert option(calls["report"], "--out") == f"{out}/report.html"
    assert option(calls["eval lds"], "--out") == f"{out}/lds.json"
    assert (tmp_path / out).is_dir()


def test_a_training_override_reaches_optimize_and_trains_its_own_checkpoints(tmp_path):
    calls = run_quickstart(tmp_path, "optimize.epochs=5", "score.lambda_rel=0.3", "num_threads=2")
    out = "runs/digits-optimize.epochs=5_score.lambda_rel=0.3_num_threads=2"
    cfg = load_config(ROOT / "configs" / "digits.yaml", overrides(calls["optimize"]))
    assert cfg.recipe.epochs == 5
    assert Path(cfg.recipe.out_dir) == Path(out) / "ckpts"
    assert cfg.num_threads == 2
    assert not any(a.startswith("score.") for a in calls["optimize"])  # a scoring key does not reach optimize
    for name in ("featurize", "score", "report", "eval lds"):
        cfg = load_config(ROOT / "configs" / "digits.yaml", overrides(calls[name]))
        assert Path(str(cfg.checkpoints)) == Path(out) / "ckpts" / "manifest.json"
        assert Path(cfg.store.path) == Path(out) / "attrib.zarr"
        assert cfg.score.lambda_rel == 0.3


def test_a_store_path_given_on_the_command_line_wins(tmp_path):
    calls = run_quickstart(tmp_path, "store.path=elsewhere/attrib.zarr")
    cfg = load_config(ROOT / "configs" / "digits.yaml", overrides(calls["featurize"]))
    assert Path(cfg.store.path) == Path("elsewhere/attrib.zarr")
