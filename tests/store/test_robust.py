"""The store under stress: kill -9 and resume, two processes, locks, corruption, failing writes.

These run the real `trak` CLI in subprocesses; nothing is mocked.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from projects import (
    CHUNK, N_TARGET, N_TRAIN, arrays, assert_same_store, free_port, kill_at, limit_file_size, make_project, run,
    run_subprocess, tiny_model, trak_cmd,
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted featurize + score of the project."""
    root = make_project(tmp_path_factory.mktemp("ref"))
    for cmd in (["featurize", "run.yaml", "-q"], ["score", "run.yaml", "-q"]):
        res = run(root, *cmd)
        assert res.returncode == 0, res.stderr
    return root


def test_kill_anywhere_then_resume_gives_identical_store(tmp_path, reference):
    root = make_project(tmp_path / "p")
    log = tmp_path / "events.log"
    kills = 0
    total = 3 * (N_TRAIN // CHUNK)  # 45 train chunks
    for n in (2, 9, 17, 26, 40):  # five kill points spread over the run, resumed each time
        kills += kill_at(root, ["featurize", "run.yaml", "-q"], log, n)
    assert kills == 5
    res = run_subprocess(root, "featurize", "run.yaml", "-q", env={"TRAK_EVENT_LOG": str(log)})
    assert res.returncode == 0, res.stderr
    # nothing lost to the kills beyond the chunk each one interrupted
    starts = log.read_text().count("start featurize")
    assert total <= starts <= total + kills, starts
    # the stale lock of the last killed run was taken over, and released at the end
    assert not (root / "out" / "attrib.zarr.lock").exists()

    # kill score in its three phases: target features, kernels, score blocks
    slog = tmp_path / "score.log"
    for n in (2, 10, 14):
        kill_at(root, ["score", "run.yaml", "-q"], slog, n)
    res = run(root, "score", "run.yaml", "-q")
    assert res.returncode == 0, res.stderr
    assert_same_store(root / "out" / "attrib.zarr", reference / "out" / "attrib.zarr")


def test_resume_with_other_batch_size_matches(tmp_path, reference):
    root = make_project(tmp_path / "p")
    log = tmp_path / "events.log"
    assert kill_at(root, ["featurize", "run.yaml", "-q"], log, 20)
    res = run(root, "featurize", "run.yaml", "data.batch_size=7", "-q")
    assert res.returncode == 0, res.stderr
    a = arrays(root / "out" / "attrib.zarr")
    b = arrays(reference / "out" / "attrib.zarr")
    for name in a:
        if name.startswith("train/"):
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_torchrun_two_processes_equal_single_process(tmp_path, reference):
    root = make_project(tmp_path / "p")
    for cmd in ("featurize", "score"):
        res = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
             "-m", "trakcli.cli.main", cmd, "run.yaml", "-q"],
            cwd=root, capture_output=True, text=True, timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert res.returncode == 0, res.stderr[-3000:]
    assert_same_store(root / "out" / "attrib.zarr", reference / "out" / "attrib.zarr")


def test_second_run_on_store_in_use_refuses_naming_host_and_pid(tmp_path):
    root = make_project(tmp_path / "p", n_models=1)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (root / "out").mkdir()
        lock = root / "out" / "attrib.zarr.lock"
        lock.write_text(json.dumps({"host": socket.gethostname(), "pid": sleeper.pid, "started": 0}))
        res = run(root, "featurize", "run.yaml")
        assert res.returncode == 1
        msg = " ".join(res.stderr.split())
        assert f"in use by another run (host {socket.gethostname()}, pid {sleeper.pid})" in msg
        assert lock.exists()  # the other run's lock is untouched
    finally:
        sleeper.kill()
        sleeper.wait()
    # the holder is gone now: its lock is stale and taken over
    res = run(root, "featurize", "run.yaml")
    assert res.returncode == 0, res.stderr
    assert f"took over a stale lock of a run that is gone (host {socket.gethostname()}, pid {sleeper.pid})" in " ".join(
        res.stderr.split()
    )


def test_failing_writes_keep_store_consistent_and_resumable(tmp_path, reference):
    root = make_project(tmp_path / "p")
    # a file size limit between the largest zarr metadata (the root's, with the resolved config, ~4.8 KB) and the
    # smallest feature chunk: uncompressed here (store.compressor=none: 40 x 32 floats, 5,120 bytes and a checksum),
    # so that its size does not hang on how well the features compress (the values equal the reference's)
    ref = reference / "out" / "attrib.zarr"
    meta = max(f.stat().st_size for f in ref.rglob("zarr.json"))
    chunk = 40 * 32 * 4
    assert meta < chunk, (meta, chunk)
    res = subprocess.run(
        trak_cmd("featurize", "run.yaml", "store.compressor=none"), cwd=root, capture_output=True, text=True,
        timeout=300, preexec_fn=limit_file_size((meta + chunk) // 2),
    )
    assert res.returncode == 1
    msg = " ".join(res.stderr.split())
    assert "writing chunk 0 (0:40) of train/0/features failed" in msg and "rerun the same command to resume" in msg
    assert "Traceback" not in res.stderr
    assert run(root, "featurize", "run.yaml", "-q", "store.compressor=none").returncode == 0
    assert run(root, "score", "run.yaml", "-q", "store.compressor=none").returncode == 0
    assert_same_store(root / "out" / "attrib.zarr", reference / "out" / "attrib.zarr")


def test_corrupt_and_truncated_chunks_are_reported_and_repaired(tmp_path, reference):
    root = make_project(tmp_path / "p")
    shutil.copytree(reference / "out", root / "out")
    chunk = root / "out" / "attrib.zarr" / "train" / "1" / "features" / "c" / "3" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    res = run(root, "score", "run.yaml", "--overwrite")
    assert res.returncode == 1
    msg = " ".join(res.stderr.split())
    assert "store array train/1/features chunk 3 (entries 120:160 along axis 0) is corrupt or truncated" in msg
    assert "trak featurize CONFIG --verify" in msg
    tchunk = root / "out" / "attrib.zarr" / "train" / "2" / "out_to_loss" / "c" / "7"
    tchunk.write_bytes(tchunk.read_bytes()[:5])  # truncated
    res = run(root, "featurize", "run.yaml", "--verify")
    assert res.returncode == 0, res.stderr
    assert "model 1: chunks [3] failed their checksum" in " ".join(res.stderr.split())
    assert "model 2: chunks [7] failed their checksum" in " ".join(res.stderr.split())
    assert run(root, "score", "run.yaml", "--overwrite", "-q").returncode == 0
    assert_same_store(root / "out" / "attrib.zarr", reference / "out" / "attrib.zarr")


def test_store_path_that_cannot_be_written(user_project):
    Path("afile").write_text("x")
    res = run(user_project, "featurize", "run.yaml", "store.path=afile/s.zarr")
    assert res.returncode == 1
    assert "cannot create the store at afile/s.zarr: afile is a file, not a directory" in " ".join(res.stderr.split())


def test_targets_and_checkpoints_must_match_the_train_features(tmp_path):
    root = make_project(tmp_path / "p", n_models=2)
    assert run(root, "featurize", "run.yaml", "-q").returncode == 0
    torch.save(tiny_model(hidden=32, seed=9).state_dict(), root / "ckpts" / "model_2.pt")
    res = run(root, "score", "run.yaml")
    assert res.returncode == 1
    msg = " ".join(res.stderr.split())
    assert "no train features for model_ids [2]" in msg and "model_ids [0, 1]" in msg
    # scoring an experiment again with different target rows refuses and names what changed
    (root / "ckpts" / "model_2.pt").unlink()
    assert run(root, "score", "run.yaml", "-q").returncode == 0
    res = run(root, "score", "run.yaml", "data.target.inputs=x_train", "data.target.labels=y_train")
    assert res.returncode == 1
    assert "target_data.n: store has 90, this run has 600" in " ".join(res.stderr.split())


def test_skip_nonfinite_records_and_skips(tmp_path):
    root = make_project(tmp_path / "p", n_models=1)
    data = torch.load(root / "ckpts" / "data.pt")
    data["x_train"][[5, 77]] = float("nan")
    torch.save(data, root / "ckpts" / "data.pt")
    res = run(root, "featurize", "run.yaml")
    assert res.returncode == 1 and "non-finite gradients for examples [5]" in res.stderr
    res = run(root, "featurize", "run.yaml", "--skip-nonfinite")
    assert res.returncode == 0, res.stderr
    assert "skipped 2 examples with non-finite gradients: [5, 77]" in " ".join(res.stderr.split())
    root_g = zarr.open_group(str(root / "out" / "attrib.zarr"), mode="r")
    assert np.flatnonzero(np.asarray(root_g["train/0/nonfinite"][:])).tolist() == [5, 77]
    assert not np.asarray(root_g["train/0/features"][[5, 77]]).any()
    assert run(root, "score", "run.yaml", "-q", "--out", "s.npy").returncode == 0
    s = np.load(root / "s.npy")
    assert np.isfinite(s).all() and not s[:, [5, 77]].any()
    info = json.loads(run(root, "inspect", "out/attrib.zarr", "--json").stdout)
    assert info["train"][0]["nonfinite_skipped"] == 2


def test_float16_storage_and_no_compression(tmp_path, reference):
    root = make_project(tmp_path / "p")
    res = run(root, "featurize", "run.yaml", "store.dtype=float16", "store.compressor=none", "-q")
    assert res.returncode == 0, res.stderr
    assert run(root, "score", "run.yaml", "store.dtype=float16", "store.compressor=none", "-q").returncode == 0
    g = zarr.open_group(str(root / "out" / "attrib.zarr"), mode="r")
    assert g["train/0/features"].dtype == np.float16
    ref = zarr.open_group(str(reference / "out" / "attrib.zarr"), mode="r")
    a, b = np.asarray(g["scores/default/scores"][:]), np.asarray(ref["scores/default/scores"][:])
    assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.999


def test_inspect_and_export(tmp_path, reference):
    res = run(reference, "inspect", "out/attrib.zarr", "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["identity"]["projector"]["proj_dim"] == 32
    assert info["identity"]["train_data"]["n"] == N_TRAIN and len(info["identity"]["train_data"]["sha256"]) == 64
    assert [t["rows_done"] for t in info["train"]] == [N_TRAIN] * 3
    assert all(len(t["sha256"]) == 64 and t["kernel"]["lambda_reg"] > 0 for t in info["train"])
    assert info["scores"]["default"]["shape"] == [N_TARGET, N_TRAIN]
    res = run(reference, "inspect", "out/attrib.zarr")
    assert res.returncode == 0 and "1/1" not in res.stderr and f"{N_TRAIN}/{N_TRAIN}" in res.stderr
    out = tmp_path / "f.npy"
    res = run(reference, "export", "out/attrib.zarr", "--what", "features", "--model-id", "2", "--out", str(out))
    assert res.returncode == 0, res.stderr
    feats = np.load(out)
    g = zarr.open_group(str(reference / "out" / "attrib.zarr"), mode="r")
    np.testing.assert_array_equal(feats, np.asarray(g["train/2/features"][:]))
    res = run(reference, "export", "out/attrib.zarr", "--out", str(tmp_path / "s.csv"))
    assert res.returncode == 0
    np.testing.assert_allclose(np.loadtxt(tmp_path / "s.csv", delimiter=","),
                               np.asarray(g["scores/default/scores"][:]), rtol=1e-6)
    res = run(reference, "export", "out/attrib.zarr", "--what", "train/9/features", "--out", str(out))
    assert res.returncode == 1 and "has no array 'train/9/features'" in res.stderr
    res = run(reference, "inspect", "nowhere.zarr")
    assert res.returncode == 1 and "no trakcli store at nowhere.zarr" in res.stderr


def test_layout_is_recorded_and_a_store_of_another_schema_version_is_refused(tmp_path):
    from trakcli.store import SCHEMA_VERSION

    root = make_project(tmp_path / "p")
    assert run(root, "featurize", "run.yaml", "-q").returncode == 0
    path = root / "out" / "attrib.zarr"
    layout = {"n_train": N_TRAIN, "proj_dim": 32, "chunk_rows": CHUNK, "dtype": "float32", "compressor": "zstd"}
    attrs = dict(zarr.open_group(str(path), mode="r").attrs)
    assert attrs["layout"] == layout and attrs["schema_version"] == SCHEMA_VERSION
    zarr.open_group(str(path), mode="r+").attrs["schema_version"] = SCHEMA_VERSION - 1
    refusal = (f"has schema_version {SCHEMA_VERSION - 1}, this trakcli", f"reads schema_version {SCHEMA_VERSION}; "
               "re-featurize it: `trak featurize CONFIG --overwrite`")
    for cmd in (["featurize", "run.yaml", "-q"], ["score", "run.yaml", "-q"], ["inspect", "out/attrib.zarr"]):
        res = run(root, *cmd)
        assert res.returncode == 1 and all(part in res.stderr for part in refusal), (cmd, res.stderr)
    assert run(root, "featurize", "run.yaml", "-q", "--overwrite").returncode == 0
    assert dict(zarr.open_group(str(path), mode="r").attrs)["schema_version"] == SCHEMA_VERSION


def test_store_is_told_its_layout_and_refuses_another(tmp_path):
    from trakcli.errors import StoreError, StoreMismatchError
    from trakcli.store import Store, StoreLayout

    identity = {"train_data": {"n": 999}, "projector": {"proj_dim": 999}}  # never read for shapes
    store = Store.create_or_check(tmp_path / "s.zarr", identity, {}, layout=StoreLayout(50, 8, 16))
    rows = store.train(0, "m0.pt", "0" * 64)
    assert rows.data["features"].shape == (50, 8) and rows.n_chunks == 4
    assert store.scores("e", 3, {"lambda_reg": 1.0}).data["scores"].shape == (3, 50)
    again = Store.create_or_check(tmp_path / "s.zarr", identity, {}, layout=StoreLayout(50, 8, 16), create=False)
    assert again.train(0, create=False).data["features"].shape == (50, 8)
    with pytest.raises(StoreMismatchError, match="n_train: store has 50, this run has 60"):
        Store.create_or_check(tmp_path / "s.zarr", identity, {}, layout=StoreLayout(60, 8, 16))
    with pytest.raises(StoreError, match="compressor 'lz4' is not one of zstd, blosc, none"):
        StoreLayout(50, 8, 16, compressor="lz4")


def test_scoring_after_a_checkpoint_changed_names_the_fixes_that_work(user_project):
    from projects import tiny_model

    assert run(user_project, "featurize", "run.yaml", "-q").returncode == 0
    torch.save(tiny_model(seed=7).state_dict(), user_project / "ckpts" / "model_1.pt")  # retrained in place
    for args in (["score", "run.yaml"], ["score", "run.yaml", "--overwrite"]):  # --overwrite of score cannot help
        res = run(user_project, *args)
        msg = " ".join(res.stderr.split())
        assert res.returncode == 1 and "model_id 1: the store's features come from" in msg, msg
        assert "trak featurize CONFIG --overwrite" in msg and "rerun with --overwrite" not in msg
    res = run(user_project, "featurize", "run.yaml")  # featurize itself starts over with --overwrite
    assert res.returncode == 1 and "rerun with --overwrite to start over" in " ".join(res.stderr.split())
    assert run(user_project, "featurize", "run.yaml", "-q", "--overwrite").returncode == 0
    assert run(user_project, "score", "run.yaml", "-q").returncode == 0


def test_a_missing_array_names_trak_featurize_and_rank_0_only_for_a_distributed_reader(tmp_path):
    from trakcli.errors import StoreError
    from trakcli.store import Store, StoreLayout

    identity = {"train_data": {"n": 50}}
    store = Store.create_or_check(tmp_path / "s.zarr", identity, {}, layout=StoreLayout(50, 8, 16))
    store.train(0, "m0.pt", "0" * 64)
    (tmp_path / "s.zarr" / "train" / "0" / "features" / "zarr.json").unlink()
    reader = Store.create_or_check(tmp_path / "s.zarr", identity, {}, layout=StoreLayout(50, 8, 16), create=False)
    with pytest.raises(StoreError) as single:
        reader.train(0, create=False)
    msg = " ".join(str(single.value).split())
    assert "store array train/0/features is missing (or its zarr.json metadata was deleted); " \
        "rerun `trak featurize CONFIG`, which re-creates it" in msg
    assert "rank 0" not in msg and "torchrun" not in msg
    reader.distributed = True  # a rank > 0 of a distributed featurize
    with pytest.raises(StoreError, match="rank 0 creates it before the other ranks read it"):
        reader.train(0, create=False)
