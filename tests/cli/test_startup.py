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


#: `trak ARGS` in a fresh process that writes "(torch is imported)" on stderr when torch's import begins.
WATCHED = """
import importlib.abc, runpy, sys

class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.stderr.write("(torch is imported)\\n")
            sys.stderr.flush()
            sys.meta_path.remove(self)
        return None

sys.meta_path.insert(0, Watch())
sys.argv = ["trak", *sys.argv[1:]]
runpy.run_module("trakcli.cli.main", run_name="__main__")
"""


def _watched(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`trak ARGS` under WATCHED, each phase line printed as its phase begins (TRAK_PHASE_DELAY=0)."""
    return subprocess.run([sys.executable, "-c", WATCHED, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TRAK_PHASE_DELAY": "0"})


def test_featurize_says_what_it_does_before_torch_and_before_each_slow_step(tmp_path):
    from projects import MODEL_FILE, make_project

    root = make_project(tmp_path / "p", n_models=1)
    (root / "my_model.py").write_text(MODEL_FILE.replace(
        "    return nn.Sequential", "    import sys\n    sys.stderr.write('(make_model runs)\\n')\n    return nn.Sequential"))
    res = _watched(root, "featurize", "run.yaml")
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert lines[:2] == ["reading the config, importing torch …", "(torch is imported)"], res.stderr  # the first line, before torch
    order = ["loading data.train …", "loading the model my_model.py:make_model …", "(make_model runs)",
             "loading checkpoint 0 (ckpts/model_0.pt) …", "the first batch: reading it and its per-example gradients …"]
    assert all(line in lines for line in order), res.stderr
    assert [lines.index(line) for line in order] == sorted(lines.index(line) for line in order), res.stderr
    assert lines.index(order[1]) + 1 == lines.index(order[2])  # said as the model is built, not after
    assert lines[-1].startswith("featurized"), res.stderr
    # -q: quiet as before
    quiet = _watched(root, "featurize", "run.yaml", "-q", "--overwrite")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr.splitlines() == ["(torch is imported)", "(make_model runs)"]


def test_a_quick_failing_command_prints_its_error_alone(user_project):
    # the default delay: a phase line comes only once its step has run a while, so a config mistake found at
    # once is the only line
    res = subprocess.run([sys.executable, "-m", "trakcli.cli.main", "featurize", "run.yaml", "grad_wrt=[nope.*]"],
                         cwd=user_project, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRAK_PHASE_DELAY": "3600"})
    assert res.returncode == 1
    assert res.stderr.startswith("error:") and "…" not in res.stderr, res.stderr
