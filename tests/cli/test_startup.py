"""Start-up: each command imports only what it uses.

Every command runs in a fresh Python process; at exit it prints which of the
heavy optional modules it imported. Timings belong in scripts/, not here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
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


def test_bundled_digits_import_sklearn_once_then_read_the_cached_split(tmp_path):
    code = """
import json, sys
from trakcli.data.digits import load_digits_split
x_tr, y_tr, x_ta, y_ta = load_digits_split()
print(json.dumps({"sklearn": "sklearn" in sys.modules, "sums": [float(x_tr.sum()), int(y_tr.sum()), float(x_ta.sum()),
                  int(y_ta.sum())], "shapes": [list(t.shape) for t in (x_tr, y_tr, x_ta, y_ta)]}))
"""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    runs = [
        json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                  check=True, timeout=300).stdout)
        for _ in range(2)
    ]
    assert [r["sklearn"] for r in runs] == [True, False]
    assert runs[0]["sums"] == runs[1]["sums"] and runs[0]["shapes"] == [[1437, 64], [1437], [360, 64], [360]]
    assert len(list((tmp_path / "cache" / "trakcli").glob("digits-split-sklearn*.npz"))) == 1


@pytest.mark.parametrize("damage", ["truncated", "not a zip"])
def test_a_damaged_digits_cache_is_recomputed(tmp_path, monkeypatch, damage):
    from trakcli.data import digits

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = digits.load_digits_split()
    (path,) = (tmp_path / "trakcli").glob("*.npz")
    good = path.read_bytes()
    path.write_bytes(good[:200] if damage == "truncated" else b"garbage")
    again = digits.load_digits_split()
    assert all(a.equal(b) for a, b in zip(first, again))
    assert path.read_bytes() == good


def test_fresh_featurize_and_score_take_per_example_gradients_without_torch_dynamo(user_project):
    # gradient_method auto: the MLP's per-example gradients come from layer hooks, no torch.func / torch._dynamo
    assert loaded_by(user_project, "featurize", "run.yaml", "-q") == ["torch"]
    assert loaded_by(user_project, "score", "run.yaml", "-q") == ["torch"]  # target features, kernel, scores
    # the check can fail: vmap imports torch._dynamo on its first call
    vmap = ["store.path=out/vmap.zarr", "gradient_method=vmap"]
    assert loaded_by(user_project, "featurize", "run.yaml", "-q", *vmap) == ["torch._dynamo", "torch"]
