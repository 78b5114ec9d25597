"""Start-up: each command imports only what it uses.

Every command runs in a fresh Python process; at exit it prints which of the
heavy optional modules it imported. Timings belong in benchmarks/, not here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from trakcli.cli.main import app

HEAVY = ["sklearn", "scipy", "matplotlib", "transformers", "torch._dynamo", "torch"]

RUN = """
import json, runpy, sys
sys.argv = ["trak", *json.loads(sys.argv[1])]
try:
    runpy.run_module("trakcli.cli.main", run_name="__main__")
except SystemExit as e:
    code = e.code
else:
    code = 0
print(json.dumps({"code": code, "loaded": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def run_trak(cwd: Path, *args: str, env: dict | None = None) -> dict:
    """`trak ARGS` in a fresh process (asserting it succeeds): the HEAVY modules it imported (``loaded``)."""
    res = subprocess.run(
        [sys.executable, "-c", RUN, json.dumps(list(args))], cwd=cwd, capture_output=True, text=True, timeout=300,
        env={**os.environ, **(env or {})},
    )
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["code"] in (0, None), res.stderr
    return out


def loaded_by(cwd: Path, *args: str, env: dict | None = None) -> list[str]:
    """The HEAVY modules `trak ARGS` imports in a fresh process (asserting it succeeds)."""
    return run_trak(cwd, *args, env=env)["loaded"]


def test_help_imports_neither_torch_nor_optional_libraries(tmp_path):
    assert loaded_by(tmp_path, "--help") == []
    assert loaded_by(tmp_path, "score", "--help") == []


def test_inspect_and_noop_featurize_and_score_import_only_what_they_use(user_project):
    runner = CliRunner()
    for cmd in ("featurize", "score"):
        res = runner.invoke(app, [cmd, "run.yaml", "-q"])
        assert res.exit_code == 0, res.stderr
    assert loaded_by(user_project, "inspect", "out/attrib.zarr") == []  # no torch either
    assert loaded_by(user_project, "featurize", "run.yaml", "-q") == ["torch"]  # a finished store: nothing to do
    assert loaded_by(user_project, "score", "run.yaml", "-q") == ["torch"]


def test_fresh_featurize_and_score_take_per_example_gradients_without_torch_dynamo(user_project):
    # gradient_method auto: the MLP's per-example gradients come from layer hooks, no torch.func / torch._dynamo
    assert loaded_by(user_project, "featurize", "run.yaml", "-q") == ["torch"]
    assert loaded_by(user_project, "score", "run.yaml", "-q") == ["torch"]  # target features, kernel, scores
    # the check can fail: vmap imports torch._dynamo on its first call
    vmap = ["store.path=out/vmap.zarr", "gradient_method=vmap"]
    assert loaded_by(user_project, "featurize", "run.yaml", "-q", *vmap) == ["torch._dynamo", "torch"]
