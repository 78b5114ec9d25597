"""A damaged or half-made store: what the store's records imply is checked, and every crash state has a way on.

Each test leaves a store as a lost file, a deleted folder or a run killed at a
chosen point leaves it, then checks that `trak inspect --verify` and `trak
export` refuse what is missing (message, exit code), and that the same command
rerun (or the one the message names) completes with the result bit for bit
equal to an undisturbed run's.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import zarr

from projects import assert_same_store, make_project, msg, run
from trakcli.store import SCHEMA_VERSION

STORE = Path("out") / "attrib.zarr"


def clean_failure(res, code: int = 1) -> str:
    assert res.returncode == code, res.stderr
    assert "Traceback" not in res.stderr
    return msg(res)


# --- verification against what the store's records imply ---------------------------------------------------------


@pytest.mark.parametrize(
    "lost, said",
    [
        ("train/1/features/zarr.json", "store array train/1/features has lost its metadata (zarr.json)"),
        ("train/1/features", "store array train/1/features is missing"),
        ("train/0/out_to_loss", "store array train/0/out_to_loss is missing"),
        ("train/1/done", "store array train/1/done is missing"),
    ],
)
def test_lost_train_array_fails_inspect_and_plain_featurize_repairs_it(project, finished, lost, said):
    path = project / STORE / lost
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    for args in (["inspect", str(STORE), "--verify"], ["inspect", str(STORE)]):
        text = clean_failure(run(project, *args))
        assert said in text and "rerun `trak featurize CONFIG --verify`, which recomputes it" in text
    res = run(project, "featurize", "run.yaml")
    assert res.returncode == 0, res.stderr
    assert "nothing to do" not in msg(res) or "re-created over its chunk files" in msg(res)
    res = run(project, "inspect", str(STORE), "--verify")
    assert res.returncode == 0, res.stderr
    assert_same_store(project / STORE, finished / STORE)


def test_lost_features_metadata_is_noticed_by_plain_featurize(project):
    (project / STORE / "train" / "1" / "features" / "zarr.json").unlink()
    res = run(project, "score", "run.yaml", "score.experiment=other")  # reading it names the command that repairs it
    assert res.returncode == 1 and "store array train/1/features is missing (or its zarr.json metadata was deleted); " \
        "rerun `trak featurize CONFIG`" in msg(res), msg(res)
    res = run(project, "featurize", "run.yaml")
    assert res.returncode == 0, res.stderr
    assert "train/1/features: its metadata (zarr.json) was missing; re-created over its chunk files" in msg(res)
    shutil.rmtree(project / STORE / "train" / "1" / "features")
    res = run(project, "featurize", "run.yaml")
    assert res.returncode == 0, res.stderr
    assert "done chunks [0, 1, 2, 3, 4, 5, 6, 7, 8, 9] without their files are recomputed" in msg(res)
    assert "computed 15/30 chunks" in msg(res)


def test_deleted_train_group_of_a_scored_store_is_refused_by_inspect_and_export(project, finished):
    shutil.rmtree(project / STORE / "train" / "1")
    text = clean_failure(run(project, "inspect", str(STORE), "--verify"))
    assert "store group train/1 is missing; rerun `trak featurize CONFIG --verify`" in text
    text = clean_failure(run(project, "export", str(STORE), "--out", "s.npy"))
    assert ("scores/default in out/attrib.zarr was made with the train features of model_id 1, but store group "
            "train/1 is missing; rerun `trak featurize CONFIG --verify`") in text
    assert not (project / "s.npy").exists()
    assert run(project, "featurize", "run.yaml", "-q").returncode == 0
    assert run(project, "inspect", str(STORE), "--verify").returncode == 0
    assert_same_store(project / STORE, finished / STORE)  # the same checkpoint gives the same features


def test_train_group_without_its_metadata_is_recomputed(project, finished):
    (project / STORE / "train" / "0" / "zarr.json").unlink()  # its checkpoint's sha256 is lost with it
    text = clean_failure(run(project, "inspect", str(STORE)))
    assert "store group train/0 has lost its metadata (zarr.json)" in text
    res = run(project, "featurize", "run.yaml")
    assert res.returncode == 0, res.stderr
    assert "train/0: its metadata (zarr.json) was missing; it is recomputed" in msg(res)
    assert run(project, "inspect", str(STORE), "--verify").returncode == 0
    assert_same_store(project / STORE, finished / STORE)


def test_experiment_made_from_other_train_features_is_refused(project):
    g = zarr.open_group(str(project / STORE / "train" / "1"), mode="r+")
    g.attrs["sha256"] = "0" * 64
    text = clean_failure(run(project, "export", str(STORE), "--out", "s.npy"))
    assert "was made from checkpoint sha256" in text and "but train/1 holds the features of sha256 000000000000" in text
    text = clean_failure(run(project, "inspect", str(STORE)))
    assert "scores/default was made from checkpoint sha256" in text


# --- crash states ------------------------------------------------------------------------------------------------


def test_root_created_without_attributes_is_completed_by_the_rerun(project, finished):
    shutil.rmtree(project / STORE)
    (project / STORE).mkdir()
    (project / STORE / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    text = clean_failure(run(project, "inspect", str(STORE)))
    assert ("store out/attrib.zarr is incomplete: its creation was interrupted before its attributes were written; "
            "rerun `trak featurize CONFIG`, which creates it") in text
    for cmd in (["featurize", "run.yaml", "-q"], ["score", "run.yaml", "-q"]):
        res = run(project, *cmd)
        assert res.returncode == 0, res.stderr
    assert_same_store(project / STORE, finished / STORE)


def test_new_store_root_is_written_with_its_attributes_in_one_write(tmp_path):
    root = make_project(tmp_path / "p", n_models=1)
    writes = []
    real = zarr.storage.LocalStore.set

    async def spy(self, key, value):
        if key == "zarr.json":
            writes.append(json.loads(value.to_bytes()).get("attributes", {}))
        return await real(self, key, value)

    zarr.storage.LocalStore.set = spy
    try:
        assert run(root, "featurize", "run.yaml", "-q").returncode == 0
    finally:
        zarr.storage.LocalStore.set = real
    assert writes and writes[0].get("schema_version") == SCHEMA_VERSION and "identity" in writes[0]


def test_overwrite_killed_while_deleting_leaves_a_store_or_nothing(project, finished):
    # the old store is moved aside before it is deleted: a kill leaves this beside an absent store
    os.replace(project / STORE, project / "out" / ".attrib.zarr.deleting")
    shutil.rmtree(project / "out" / ".attrib.zarr.deleting" / "scores")
    res = run(project, "featurize", "run.yaml", "-q")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in (project / "out").iterdir()) == ["attrib.zarr", "attrib.zarr.hashes.json"]


def test_store_left_with_only_its_groups_names_the_repair_and_overwrite_gets_past(project, finished):
    (project / STORE / "zarr.json").unlink()  # a deletion killed after the root's metadata went
    shutil.rmtree(project / STORE / "scores")
    shutil.rmtree(project / STORE / "targets")
    for args in (["featurize", "run.yaml"], ["score", "run.yaml"], ["inspect", str(STORE)]):
        text = clean_failure(run(project, *args))
        assert ("out/attrib.zarr holds store groups" in text and "but no root metadata (zarr.json)" in text
                and "rerun `trak featurize CONFIG --overwrite` to start over" in text), args
    for cmd in (["featurize", "run.yaml", "--overwrite", "-q"], ["score", "run.yaml", "-q"]):
        res = run(project, *cmd)
        assert res.returncode == 0, res.stderr
    assert_same_store(project / STORE, finished / STORE)


@pytest.mark.parametrize("kind", ["targets", "scores"])
def test_experiment_group_without_its_settings_is_recomputed_by_the_rerun(project, finished, kind):
    shutil.rmtree(project / STORE / kind / "default")  # a run killed just after creating the group
    zarr.open_group(str(project / STORE), mode="r+").create_group(f"{kind}/default")
    text = clean_failure(run(project, "inspect", str(STORE)))
    assert f"store group {kind}/default records no checkpoints (its creation was interrupted)" in text
    res = run(project, "score", "run.yaml")
    assert res.returncode == 0, res.stderr
    assert f"{kind}/default: its settings were never recorded (an interrupted run); it is recomputed" in msg(res)
    assert_same_store(project / STORE, finished / STORE)


def test_truncated_checkpoint_then_the_corrected_file_is_taken(tmp_path, finished):
    root = make_project(tmp_path / "p", n_models=2)
    ckpt = root / "ckpts" / "model_1.pt"
    good = ckpt.read_bytes()
    ckpt.write_bytes(good[: len(good) // 2])
    text = clean_failure(run(root, "featurize", "run.yaml"))
    assert "model_1.pt" in text
    ckpt.write_bytes(good)
    res = run(root, "featurize", "run.yaml")
    assert res.returncode == 0, res.stderr
    assert "model_id 1: no features were computed from ckpts/model_1.pt" in msg(res)
    assert run(root, "score", "run.yaml", "-q").returncode == 0
    assert_same_store(root / STORE, finished / STORE)


def test_overwrite_refuses_a_regular_file_at_the_store_path(tmp_path):
    root = make_project(tmp_path / "p", n_models=1)
    (root / "out").mkdir()
    (root / STORE).write_text("my notes")
    text = clean_failure(run(root, "featurize", "run.yaml", "--overwrite"))
    assert "refusing to --overwrite out/attrib.zarr: it is a file, not a Zarr store" in text
    assert (root / STORE).read_text() == "my notes"


# --- what another batch size promises ------------------------------------------------------------------------------


def test_another_batch_size_agrees_to_float32_rounding_and_the_same_one_bit_for_bit(tmp_path, finished):
    import numpy as np

    from projects import arrays

    root = make_project(tmp_path / "p", n_models=2)
    for cmd in (["featurize", "run.yaml", "-q", "data.batch_size=7"], ["score", "run.yaml", "-q", "data.batch_size=7"]):
        res = run(root, *cmd)
        assert res.returncode == 0, res.stderr
    a, b = arrays(root / STORE), arrays(finished / STORE)
    assert sorted(a) == sorted(b)
    for name in a:
        if name.endswith("done"):
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        else:  # the documented promise: float32 rounding of the matrix products (a relative 5e-7 at most here)
            np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-6 * np.abs(b[name]).max(), err_msg=name)
    again = make_project(tmp_path / "q", n_models=2)
    for cmd in (["featurize", "run.yaml", "-q"], ["score", "run.yaml", "-q"]):
        assert run(again, *cmd).returncode == 0
    assert_same_store(again / STORE, finished / STORE)
