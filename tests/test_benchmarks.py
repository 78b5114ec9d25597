"""The repository's `benchmarks` and `examples` packages: how their modules import each other and run.

A benchmark or an example command runs as a module (``python -m benchmarks.bench_topk`` from the repository
root) or as a file (``python benchmarks/bench_topk.py`` from anywhere); both import the other modules of the
two packages by their package names.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from projects import ROOT

PACKAGES = ("benchmarks", "examples")
FILES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).glob("*.py"))
SIBLINGS = {p.stem for p in FILES} | {"gen_docs"}
#: The two lines a module of these packages starts with when it imports a sibling: run as a file, the
#: repository root goes on sys.path, as running it with -m from the root has it.
GUARD = ("if not __package__:  # run as a file, not with -m: put the repository root on sys.path\n"
         "    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))\n")


def _imported(path) -> list[str]:
    """The modules ``path`` imports, module-level or inside a function."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def test_the_packages_hold_their_modules():
    names = {p.relative_to(ROOT).as_posix() for p in FILES}
    assert {"benchmarks/__init__.py", "benchmarks/benchjson.py", "benchmarks/bench_topk.py",
            "examples/__init__.py", "examples/bbc_docs.py", "examples/plant_facts.py"} <= names
    assert sorted(p.name for p in (ROOT / "scripts").iterdir()) == ["_env.sh", "quickstart.sh", "test.sh"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_module_imports_its_siblings_by_package_and_only_the_guard_touches_sys_path(path):
    source = path.read_text()
    bare = [m for m in _imported(path) if m.split(".")[0] in SIBLINGS]
    assert bare == [], f"import these as benchmarks.NAME or examples.NAME: {bare}"
    local = [m for m in _imported(path) if m.split(".")[0] in PACKAGES]
    if local:
        assert GUARD in source, "a module that imports a sibling starts with the shared guard"
    inserts = source.count("sys.path.insert(")
    allowed = source.count(GUARD) + (2 if path.name == "benchjson.py" else 0)  # benchjson: trakcli of the checkout
    assert inserts == allowed, "sys.path is changed only by the shared guard"


@pytest.mark.parametrize("module", ["benchmarks.bench_object_store", "examples.plant_facts"])
def test_a_module_that_imports_its_siblings_runs_as_a_module_and_as_a_file(module, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the guard alone finds the packages
    as_module = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=env,
                               capture_output=True, text=True)
    assert as_module.returncode == 0, as_module.stderr
    as_file = subprocess.run([sys.executable, str(ROOT / f"{module.replace('.', '/')}.py"), "--help"],
                             cwd=tmp_path, env=env, capture_output=True, text=True)
    assert as_file.returncode == 0, as_file.stderr
    for out in (as_module.stdout, as_file.stdout):
        assert out.startswith("usage:") and "--help" in out


def test_run_measured_reports_the_commands_own_peak_rss_its_exit_and_kills_its_group_on_timeout(tmp_path):
    from benchmarks.launch import run_measured

    held = bytearray(400 * 2**20)  # this process holds 400 MiB, which a directly forked child would count
    held[::4096] = b"x" * len(held[::4096])
    small = run_measured([sys.executable, "-c", "print('hi')"], cwd=tmp_path)
    assert small["exit"] == 0 and small["stdout"].strip() == "hi" and not small["timed_out"]
    assert small["peak_rss_gib"] < 0.2
    big = run_measured([sys.executable, "-c", "b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096])"],
                       cwd=tmp_path)
    assert 0.25 < big["peak_rss_gib"] < 0.5
    assert run_measured([sys.executable, "-c", "raise SystemExit(3)"], cwd=tmp_path)["exit"] == 3
    marker = tmp_path / "grandchild"
    with open(tmp_path / "log", "w") as log:
        got = run_measured(["sh", "-c", f"(sleep 3; touch {marker}) & sleep 30"], cwd=tmp_path, stdout=log,
                           timeout=1)
    assert got["timed_out"] and got["seconds"] < 10
    import time

    time.sleep(3.5)
    assert not marker.exists(), "the command's background child outlived the timeout"
    del held
