"""`trak featurize` on a finished store, and the first batch of a new one.

A rerun on a finished store has nothing to do and changes no byte of it; on a
damaged store, or with other settings, it resumes, repairs or refuses with the
command that fixes it, and changes only what it repairs. A new store's first
batch is computed once, and one that fails leaves no store.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
import zarr

from trakcli.jobs.setup import JobSetup

from projects import make_project, run, tiny_model, write_config
from projects import invoke as trak

featurize_job = importlib.import_module("trakcli.jobs.featurize")  # the module (trakcli.jobs.featurize is the function)
STORE = Path("out") / "attrib.zarr"
FIRST_BATCH = featurize_job.first_batch


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A project whose train features are finished (2 checkpoints, 15 chunks each)."""
    root = make_project(tmp_path_factory.mktemp("finished"), n_models=2)
    res = run(root, "featurize", "run.yaml", "-q")
    assert res.returncode == 0, res.stderr
    return root


def store_files(root: Path) -> dict[str, bytes]:
    """Every file of the project's store: relative path -> bytes."""
    store = root / STORE
    return {str(f.relative_to(store)): f.read_bytes() for f in sorted(store.rglob("*")) if f.is_file()}


def test_finished_store_is_recognized_and_a_rerun_changes_nothing(finished):
    code = (
        "import runpy, sys\n"
        "sys.argv = ['trak', 'featurize', 'run.yaml']\n"
        "try:\n    runpy.run_module('trakcli.cli.main', run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
    )
    before = store_files(finished)
    res = subprocess.run([sys.executable, "-c", code], cwd=finished, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "COLUMNS": "200"})
    assert res.returncode == 0, res.stderr
    assert "nothing to do: out/attrib.zarr already holds features of all 2 checkpoints (600 train rows, proj_dim 32)" \
        in res.stderr
    assert store_files(finished) == before


def test_a_finished_pass_marks_its_flags_and_an_append_or_verify_drops_the_mark(tmp_path, finished):
    import shutil as _shutil

    root = tmp_path / "p"
    _shutil.copytree(finished, root)
    done = [zarr.open_group(str(root / STORE), mode="r")[f"train/{m}/done"] for m in (0, 1)]
    assert [d.attrs.get("all_done") for d in done] == [15, 15]
    flags = sorted((root / STORE / "train/0/done/c").iterdir())
    for f in flags:
        f.unlink()  # every flag of model 0 lost: a reader trusts the mark, the next featurize recomputes
    res = run(root, "score", "run.yaml", "-q")
    assert res.returncode == 0, res.stderr
    res = run(root, "featurize", "run.yaml", "--verify", "-q")
    assert res.returncode == 0, res.stderr
    assert len(list((root / STORE / "train/0/done/c").iterdir())) == len(flags)
    assert zarr.open_group(str(root / STORE), mode="r")["train/0/done"].attrs.get("all_done") == 15  # marked again


IMPORTED = """
import json, runpy, sys
sys.argv = ["trak", *json.loads(sys.argv[1])]
try:
    runpy.run_module("trakcli.cli.main", run_name="__main__")
except SystemExit as e:
    assert e.code in (0, None), e.code
print(json.dumps(sorted(sys.modules)))
"""


def imported_by(cwd: Path, *args: str) -> set[str]:
    """Every module `trak ARGS` imports in a fresh process."""
    res = subprocess.run([sys.executable, "-c", IMPORTED, json.dumps(list(args))], cwd=cwd, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return set(json.loads(res.stdout.strip().splitlines()[-1]))


def test_help_and_inspect_build_no_config_schema(finished):
    """The config schema (pydantic models) and yaml are imported by commands that read a config, not by these."""
    helped = imported_by(finished, "--help")
    assert not helped & {"pydantic", "yaml", "zarr", "torch", "trakcli.config.schema", "trakcli.store.store"}
    inspected = imported_by(finished, "inspect", str(STORE))
    assert "zarr" in inspected and not inspected & {"torch", "trakcli.config.schema", "trakcli.config.load"}
    featurized = imported_by(finished, "featurize", "run.yaml", "-q")
    assert "trakcli.config.schema" in featurized and "torch" in featurized


def _rewrite(path: Path, edit) -> None:
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _unset_flag(root: Path) -> None:
    zarr.open_group(str(root / STORE), mode="r+")["train/1/done"][5] = 0  # a chunk a kill left undone


def _other_checkpoint(root: Path) -> None:
    torch.save(tiny_model(hidden=32, seed=7).state_dict(), root / "ckpts" / "model_1.pt")


def _eval_kept(root: Path) -> None:
    zarr.open_group(str(root / "out" / ".attrib.zarr.eval-kept"), mode="w", zarr_format=3).attrs["x"] = 1


NOTHING = "nothing to do: out/attrib.zarr already holds features of all 2 checkpoints (600 train rows, proj_dim 32)"
REDONE = "featurized 2 checkpoints x 600 train rows (grad_dim 323 -> proj_dim 32); computed 1/30 chunks"
VERIFY = "rerun `trak featurize CONFIG --verify`, which recomputes it"
OVERWRITE = "rerun with --overwrite to start over"

#: damage -> (what it does to a copy of the finished project, overrides of the rerun,
#: the rerun's exit code, a part of its message, the store files it may and must change (by prefix))
DAMAGES = {
    "finished": (lambda root: None, [], 0, NOTHING, ()),
    "deleted done flag": (lambda root: (root / STORE / "train/1/done/c/2").unlink(), [], 0, REDONE,
                          ("train/1/done/c/2",)),
    "flipped done flag": (lambda root: _flip(root / STORE / "train/0/done/c/14"), [], 0, REDONE,
                          ("train/0/done/c/14",)),
    "unset done flag": (_unset_flag, [], 0, REDONE, ("train/1/done/c/5",)),
    # a plain run does not read feature chunks: --verify finds a lost one
    "deleted feature chunk": (lambda root: (root / STORE / "train/0/features/c/3/0").unlink(), [], 0, NOTHING, ()),
    "garbage array metadata": (lambda root: (root / STORE / "train/1/features/zarr.json").write_text("garbage"), [],
                               1, f"store metadata train/1/features/zarr.json is unreadable (JSONDecodeError: "
                               f"Expecting value: line 1 column 1 (char 0)); {VERIFY}", ()),
    "empty done metadata": (lambda root: (root / STORE / "train/0/done/zarr.json").write_text("{}"), [], 1,
                            "store metadata train/0/done/zarr.json is unreadable", ()),
    "garbage group metadata": (lambda root: (root / STORE / "train/1/zarr.json").write_text("garbage"), [], 1,
                               "store metadata train/1/zarr.json is unreadable", ()),
    "garbage train metadata": (lambda root: (root / STORE / "train/zarr.json").write_text("[1, 2"), [], 0, NOTHING,
                               ()),
    "garbage root metadata": (lambda root: (root / STORE / "zarr.json").write_text("garbage"), [], 1,
                              "its metadata out/attrib.zarr/zarr.json is unreadable (JSONDecodeError: Expecting value: "
                              "line 1 column 1 (char 0)); the store's identity is lost: rerun `trak featurize CONFIG "
                              "--overwrite` to start over", ()),
    "other schema version": (
        lambda root: _rewrite(root / STORE / "zarr.json", lambda m: m["attributes"].update(schema_version=1)), [], 1,
        "store out/attrib.zarr has schema_version 1, this trakcli (0.1.0) reads schema_version 2", (),
    ),
    "store without layout": (
        lambda root: _rewrite(root / STORE / "zarr.json", lambda m: m["attributes"].pop("layout")), [], 1,
        f"proj_dim: store has <unset>, this run has 32 {OVERWRITE}", (),
    ),
    "train group without sha256": (  # the checkpoint's sha256 is recorded again
        lambda root: _rewrite(root / STORE / "train/0/zarr.json", lambda m: m["attributes"].pop("sha256")), [], 0,
        NOTHING, ("train/0/zarr.json",),
    ),
    "other shape": (
        lambda root: _rewrite(root / STORE / "train/0/out_to_loss/zarr.json", lambda m: m.update(shape=[599])), [],
        1, f"store array train/0/out_to_loss has shape [599], this run needs [600]; {OVERWRITE}", (),
    ),
    "other checkpoint": (_other_checkpoint, [], 1, "model_id 1: the store's features come from ckpts/model_1.pt", ()),
    "other proj_dim": (lambda root: None, ["projector.proj_dim=16"], 1,
                       f"projector.proj_dim: store has 32, this run has 16 {OVERWRITE}", ()),
    "other chunk_rows": (lambda root: None, ["store.chunk_rows=50"], 1,
                         f"storage.chunk_rows: store has 40, this run has 50 {OVERWRITE}", ()),
    "third checkpoint": (
        lambda root: torch.save(tiny_model(hidden=32, seed=2).state_dict(), root / "ckpts" / "model_2.pt"), [], 0,
        "featurized 3 checkpoints x 600 train rows (grad_dim 323 -> proj_dim 32); computed 15/45 chunks; made 1 "
        "kernels", ("train/2/",),
    ),
    "eval group kept by an interrupted overwrite": (_eval_kept, [], 0, NOTHING, ("eval/",)),
    "deleted kernel": (lambda root: shutil.rmtree(root / STORE / "train/1/kernel"), [], 0, f"{NOTHING}; made 1 kernels",
                       ("train/1/kernel/",)),
    "kernel of another ridge": (lambda root: None, ["score.lambda_rel=2.0"], 0, f"{NOTHING}; made 2 kernels",
                                ("train/0/kernel/", "train/1/kernel/")),
    "garbage kernel metadata": (lambda root: (root / STORE / "train/0/kernel/zarr.json").write_text("garbage"), [], 0,
                                f"model_id 0: the stored kernel was corrupt or missing; it is rebuilt {NOTHING}; "
                                "made 1 kernels", ("train/0/kernel/zarr.json",)),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_rerun_on_a_finished_or_damaged_store(tmp_path, finished, damage):
    """A finished store is left alone; a damaged one is resumed, repaired or refused, touching only the damage."""
    do, overrides, code, message, changes = DAMAGES[damage]
    root = tmp_path / "p"
    shutil.copytree(finished, root)
    do(root)
    before = store_files(root)
    res = run(root, "featurize", "run.yaml", *overrides)
    text = " ".join(res.stderr.split())
    assert res.returncode == code, text
    assert message in text
    after = store_files(root)
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert all(k.startswith(changes) for k in changed), sorted(changed)
    assert all(any(k.startswith(prefix) for k in changed) for prefix in changes), sorted(changed)
    if code == 0 and message.startswith(NOTHING):
        assert "featurized" not in text


def _counting(monkeypatch) -> list[tuple[int, int, int]]:
    """Record ``(model_id, row_offset, n)`` of every batch the featurizer computes."""
    calls: list[tuple[int, int, int]] = []
    original = JobSetup.features

    def features(self, inputs, labels, model_id, row_offset):
        calls.append((model_id, row_offset, len(labels)))
        return original(self, inputs, labels, model_id, row_offset)

    monkeypatch.setattr(JobSetup, "features", features)
    return calls


@pytest.mark.parametrize(("chunk_rows", "batch_size"), [(16, 8), (8, 16), (16, 5)])
def test_first_batch_is_computed_once_and_the_store_is_the_same(user_project, monkeypatch, chunk_rows, batch_size):
    write_config(user_project / "run.yaml", {
        **yaml.safe_load((user_project / "run.yaml").read_text()),
        "store": {"path": "out/attrib.zarr", "chunk_rows": chunk_rows},
    })
    overrides = [f"data.batch_size={batch_size}"]
    # every batch of the row loop, in order, for the 2 checkpoints and 40 rows
    batches = [
        (m, lo, min(lo + batch_size, hi) - lo)
        for m in range(2) for c0 in range(0, 40, chunk_rows) for hi in [min(c0 + chunk_rows, 40)]
        for lo in range(c0, hi, batch_size)
    ]

    calls = _counting(monkeypatch)
    res = run(user_project, "featurize", "run.yaml", *overrides)
    assert res.returncode == 0, res.stderr
    assert calls == batches  # the first batch (model 0, rows 0:n) once, by first_batch, then reused
    reused = store_files(user_project)

    calls.clear()
    res = run(user_project, "featurize", "run.yaml", "--overwrite", *overrides)
    assert res.returncode == 0, res.stderr
    assert calls == batches and store_files(user_project).keys() == reused.keys()

    # the same run computing the first batch twice (first_batch's features not handed on) writes the same arrays
    monkeypatch.setattr(featurize_job, "first_batch", lambda *a, **k: (FIRST_BATCH(*a, **k), None)[1])
    calls.clear()
    res = run(user_project, "featurize", "run.yaml", "--overwrite", *overrides)
    assert res.returncode == 0, res.stderr
    assert calls == batches[:1] + batches
    twice = store_files(user_project)
    assert {k: v for k, v in twice.items() if k != "zarr.json"} == {k: v for k, v in reused.items() if k != "zarr.json"}
    root = zarr.open_group(str(user_project / STORE), mode="r")
    for m in range(2):
        assert np.isfinite(np.asarray(root[f"train/{m}/features"][:])).all()


def test_a_first_batch_error_leaves_no_store(user_project):
    cfg = yaml.safe_load(Path("run.yaml").read_text())
    cfg["model"]["kwargs"] = {"in_dim": 5}  # the data has 6 features
    write_config(Path("bad.yaml"), cfg)
    res = trak("featurize", "bad.yaml")
    assert res.exit_code == 1
    assert not Path("out/attrib.zarr").exists()
    res = trak("featurize", "run.yaml")  # the fixed config needs no --overwrite
    assert res.exit_code == 0, res.stderr
