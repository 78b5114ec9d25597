"""`trak featurize` on a finished store, and the first batch of a new one.

A finished store is recognized from its metadata files without importing zarr
(trakcli.store.finished). That answer is only a shortcut: for every store
below (finished, damaged, or made with other settings) the run with the
shortcut gives the same exit code, messages and store bytes as the run that
opens the store through zarr. A new store's first batch is computed once, and one that fails leaves no store.
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
from zarr.codecs import Crc32cCodec

from trakcli.jobs.setup import JobSetup
from trakcli.store import StoreLayout, train_finished
from trakcli.store.finished import DONE_CHUNK, DONE_META

from projects import CHUNK, N_TRAIN, make_project, run, tiny_model, write_config
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


def test_a_done_flag_file_is_the_bytes_zarr_writes(tmp_path):
    arr = zarr.create_array(str(tmp_path / "done"), shape=(3,), chunks=(1,), dtype="uint8", fill_value=0,
                            compressors=[Crc32cCodec()], zarr_format=3)
    arr[1] = 1
    assert (tmp_path / "done" / "c" / "1").read_bytes() == DONE_CHUNK
    meta = json.loads((tmp_path / "done" / "zarr.json").read_text())
    assert {k: meta[k] for k in DONE_META} == DONE_META


def test_finished_store_is_recognized_and_a_rerun_imports_no_zarr(finished):
    layout = StoreLayout(N_TRAIN, 32, CHUNK)
    kernel = json.loads((finished / STORE / "train/0/kernel/zarr.json").read_text())["attributes"]["settings"]
    identity = json.loads((finished / STORE / "zarr.json").read_text())["attributes"]["identity"]
    shas = [json.loads((finished / STORE / "train" / str(m) / "zarr.json").read_text())["attributes"]["sha256"]
            for m in range(2)]
    assert train_finished(finished / STORE, identity, layout, shas)
    assert train_finished(finished / STORE, identity, layout, shas, kernel)
    assert not train_finished(finished / STORE, identity, layout, shas, {**kernel, "lambda_rel": 2.0})
    assert not train_finished(finished / STORE, identity, layout, shas + ["0" * 64])  # a third checkpoint
    assert not train_finished(finished / STORE, identity, StoreLayout(N_TRAIN, 16, CHUNK), shas)
    assert not train_finished(finished / STORE, {**identity, "grad_dim": 1}, layout, shas)

    code = (
        "import runpy, sys\n"
        "sys.argv = ['trak', 'featurize', 'run.yaml']\n"
        "try:\n    runpy.run_module('trakcli.cli.main', run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "print('zarr' in sys.modules)\n"
    )
    before = store_files(finished)
    res = subprocess.run([sys.executable, "-c", code], cwd=finished, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "COLUMNS": "200"})
    assert res.stdout.strip() == "False", res.stderr
    assert "nothing to do: out/attrib.zarr already holds features of all 2 checkpoints (600 train rows, proj_dim 32)" \
        in res.stderr
    assert store_files(finished) == before


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
    assert "trakcli.config.schema" in featurized and "torch" in featurized and "zarr" not in featurized


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


DAMAGES = {
    "finished": (lambda root: None, []),
    "deleted done flag": (lambda root: (root / STORE / "train/1/done/c/2").unlink(), []),
    "flipped done flag": (lambda root: _flip(root / STORE / "train/0/done/c/14"), []),
    "unset done flag": (_unset_flag, []),
    "deleted feature chunk": (lambda root: (root / STORE / "train/0/features/c/3/0").unlink(), []),
    "garbage array metadata": (lambda root: (root / STORE / "train/1/features/zarr.json").write_text("garbage"), []),
    "empty done metadata": (lambda root: (root / STORE / "train/0/done/zarr.json").write_text("{}"), []),
    "garbage group metadata": (lambda root: (root / STORE / "train/1/zarr.json").write_text("garbage"), []),
    "garbage train metadata": (lambda root: (root / STORE / "train/zarr.json").write_text("[1, 2"), []),
    "garbage root metadata": (lambda root: (root / STORE / "zarr.json").write_text("garbage"), []),
    "other schema version": (
        lambda root: _rewrite(root / STORE / "zarr.json", lambda m: m["attributes"].update(schema_version=1)), []
    ),
    "store without layout": (
        lambda root: _rewrite(root / STORE / "zarr.json", lambda m: m["attributes"].pop("layout")), []
    ),
    "train group without sha256": (
        lambda root: _rewrite(root / STORE / "train/0/zarr.json", lambda m: m["attributes"].pop("sha256")), []
    ),
    "other shape": (
        lambda root: _rewrite(root / STORE / "train/0/out_to_loss/zarr.json", lambda m: m.update(shape=[599])), []
    ),
    "other checkpoint": (_other_checkpoint, []),
    "other proj_dim": (lambda root: None, ["projector.proj_dim=16"]),
    "other chunk_rows": (lambda root: None, ["store.chunk_rows=50"]),
    "third checkpoint": (
        lambda root: torch.save(tiny_model(hidden=32, seed=2).state_dict(), root / "ckpts" / "model_2.pt"), []
    ),
    "eval group kept by an interrupted overwrite": (_eval_kept, []),
    "deleted kernel": (lambda root: shutil.rmtree(root / STORE / "train/1/kernel"), []),
    "kernel of another ridge": (lambda root: None, ["score.lambda_rel=2.0"]),
    "garbage kernel metadata": (lambda root: (root / STORE / "train/0/kernel/zarr.json").write_text("garbage"), []),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_the_shortcut_changes_nothing_but_speed(tmp_path, finished, monkeypatch, damage):
    """With and without the zarr-free finished check: same exit code, messages and store bytes."""
    do, overrides = DAMAGES[damage]
    answers: list[bool] = []

    def spy(*args, **kwargs):
        answers.append(train_finished(*args, **kwargs))
        return answers[-1]

    results = {}
    for variant in ("shortcut", "zarr"):
        root = tmp_path / variant
        shutil.copytree(finished, root)
        do(root)
        monkeypatch.setattr(featurize_job, "train_finished", spy if variant == "shortcut" else lambda *a, **k: False)
        res = run(root, "featurize", "run.yaml", *overrides)
        results[variant] = (res.returncode, " ".join(res.stderr.split()), store_files(root))
    assert results["shortcut"][:2] == results["zarr"][:2]
    assert results["shortcut"][2] == results["zarr"][2]
    # the shortcut answers only for a store the zarr path leaves alone
    assert answers == ([True] if damage in ("finished", "deleted feature chunk") else [False] * len(answers))
    if answers == [True]:
        assert "nothing to do" in results["zarr"][1]


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
