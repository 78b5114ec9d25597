"""The store on S3: the same promises as a local folder, against a real S3 service (SeaweedFS on 127.0.0.1).

Resume after kill -9, the lock (a conditional PUT), verify and repair, top-k,
torchrun, inspect and export, each checked against an uninterrupted local store
of the same project; and the URLs the store cannot open, refused with one message.
The `trak` CLI runs for real (in process or in subprocesses); nothing is mocked.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from projects import (
    CHUNK, N_TARGET, N_TRAIN, arrays, free_port, kill_at, kill_tree, make_project, msg, run, run_subprocess,
    s3_arrays, set_store,
)

K = 5  # top-k of the top-k tests


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory) -> Path:
    """An uninterrupted featurize + score (full matrix and top-k) of the project into a local folder."""
    root = make_project(tmp_path_factory.mktemp("ref"))
    for cmd in (["featurize", "run.yaml", "-q"], ["score", "run.yaml", "-q"],
                ["score", "run.yaml", "-q", f"score.top_k={K}", "score.experiment=top"]):
        res = run(root, *cmd)
        assert res.returncode == 0, res.stderr
    return root


def _same_as_local(url: str, reference: Path, prefixes: tuple[str, ...] = ("",)) -> None:
    """The arrays of the S3 store equal the local reference's, bit for bit (those under ``prefixes``)."""
    remote = s3_arrays(url)
    local = arrays(reference / "out" / "attrib.zarr")
    names = sorted(n for n in local if n.startswith(prefixes))
    assert names and sorted(n for n in remote if n.startswith(prefixes)) == names
    for name in names:
        assert remote[name].dtype == local[name].dtype, name
        np.testing.assert_array_equal(remote[name], local[name], err_msg=name)


def test_kill_anywhere_then_resume_on_s3_gives_the_local_store(tmp_path, s3, local_reference):
    root = make_project(tmp_path / "p")
    url = s3.url()
    set_store(root, url)
    log = tmp_path / "events.log"
    kills = sum(kill_at(root, ["featurize", "run.yaml", "-q"], log, n) for n in (3, 17, 33))
    assert kills == 3
    res = run_subprocess(root, "featurize", "run.yaml", "-q", env={"TRAK_EVENT_LOG": str(log)})
    assert res.returncode == 0, res.stderr
    total = 3 * (N_TRAIN // CHUNK)
    starts = log.read_text().count("start featurize")
    assert total <= starts <= total + kills, starts  # only the chunks the kills interrupted were done again
    assert not s3.fs.exists(url[len("s3://"):] + ".lock")  # the stale lock was taken over, then released
    slog = tmp_path / "score.log"
    assert kill_at(root, ["score", "run.yaml", "-q"], slog, 10)
    res = run(root, "score", "run.yaml", "-q")
    assert res.returncode == 0, res.stderr
    _same_as_local(url, local_reference, ("train/", "targets/default/", "scores/default/"))
    # nothing is written beside the project: the store lives in the bucket only
    assert not (root / "out").exists() and not (root / "s3:").exists()


def test_lock_refuses_a_second_run_and_a_stale_lock_is_taken_over(tmp_path, s3):
    root = make_project(tmp_path / "p", n_models=1)
    url = s3.url()
    set_store(root, url)
    sleeper = subprocess.Popen(["sleep", "60"])
    lock = url[len("s3://"):] + ".lock"
    try:
        s3.fs.pipe_file(lock, json.dumps({"host": socket.gethostname(), "pid": sleeper.pid, "started": 0}).encode())
        res = run(root, "featurize", "run.yaml")
        assert res.returncode == 1
        assert f"in use by another run (host {socket.gethostname()}, pid {sleeper.pid})" in msg(res)
        assert f"delete {url}.lock" in msg(res)
        assert s3.fs.exists(lock)  # the other run's lock is untouched
    finally:
        sleeper.kill()
        sleeper.wait()
    res = run(root, "featurize", "run.yaml")
    assert res.returncode == 0, res.stderr
    assert f"took over a stale lock of a run that is gone (host {socket.gethostname()}, pid {sleeper.pid})" in msg(res)
    assert not s3.fs.exists(lock)


def test_the_lock_is_a_conditional_put(s3):
    from trakcli.store.location import create_exclusive, store_location

    lock = store_location(s3.url("x.zarr")).with_name("x.zarr.lock")
    assert create_exclusive(lock, b"first")
    assert not create_exclusive(lock, b"second")  # 412 Precondition Failed: the key exists
    assert lock.read_bytes() == b"first"


def test_verify_repairs_a_corrupt_and_a_lost_chunk_on_s3(tmp_path, s3, local_reference):
    root = make_project(tmp_path / "p")
    url = s3.url()
    set_store(root, url)
    assert run(root, "featurize", "run.yaml", "-q").returncode == 0
    key = url[len("s3://"):]
    chunk = f"{key}/train/1/features/c/3/0"
    data = bytearray(s3.fs.cat_file(chunk))
    data[len(data) // 2] ^= 0xFF
    s3.fs.pipe_file(chunk, bytes(data))
    res = run(root, "score", "run.yaml")
    assert res.returncode == 1
    assert "store array train/1/features chunk 3 (entries 120:160 along axis 0) is corrupt or truncated" in msg(res)
    assert "trak featurize CONFIG --verify" in msg(res)
    s3.fs.rm(f"{key}/train/2/out_to_loss/c/7")  # lost: zarr alone would read zeros
    res = run(root, "featurize", "run.yaml", "--verify")
    assert res.returncode == 0, res.stderr
    assert "model 1: chunks [3] failed their checksum" in msg(res)
    assert "model 2: chunks [7] failed their checksum or are missing" in msg(res)
    assert run(root, "score", "run.yaml", "-q").returncode == 0
    _same_as_local(url, local_reference, ("train/", "targets/default/", "scores/default/"))


def test_top_k_killed_and_resumed_on_s3_equals_the_local_top_k(tmp_path, s3, local_reference):
    root = make_project(tmp_path / "p")
    url = s3.url()
    set_store(root, url)
    assert run(root, "featurize", "run.yaml", "-q").returncode == 0
    log = tmp_path / "events.log"
    args = ["score", "run.yaml", "-q", f"score.top_k={K}", "score.experiment=top"]
    assert kill_at(root, args, log, 13)  # 9 target chunks, then inside the top-k segments
    assert "start top-k segment" in log.read_text()
    res = run(root, *args)
    assert res.returncode == 0, res.stderr
    _same_as_local(url, local_reference, ("scores/top", "targets/top"))


def test_two_stage_top_k_on_s3_equals_the_local_one(tmp_path, s3):
    # the one-pass scan reads the codes and the float copy through zarr on S3, from their chunk files locally
    local = make_project(tmp_path / "local")
    remote = make_project(tmp_path / "remote")
    url = s3.url()
    set_store(remote, url)
    args = ["run.yaml", "-q", "store.dtype=int8", f"score.top_k={K}", "score.experiment=top"]
    for root in (local, remote):
        for cmd in ("featurize", "score"):
            res = run(root, cmd, *args, *(["score.rerank=scan"] if cmd == "score" else []))
            assert res.returncode == 0, res.stderr
    got = {n: a for n, a in s3_arrays(url).items() if n.startswith("scores/top/top_k/")}
    want = arrays(local / "out" / "attrib.zarr")
    assert sorted(got) == [f"scores/top/top_k/{n}" for n in
                           ("done", "opponent_scores", "opponents", "proponent_scores", "proponents")]
    for name, arr in got.items():
        np.testing.assert_array_equal(arr, want[name], err_msg=name)


def test_torchrun_two_ranks_on_s3_write_the_local_store(tmp_path, s3, local_reference):
    root = make_project(tmp_path / "p")
    url = s3.url()
    set_store(root, url)
    for cmd in ("featurize", "score"):
        res = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
             "-m", "trakcli.cli.main", cmd, "run.yaml", "-q"],
            cwd=root, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert res.returncode == 0, res.stderr[-3000:]
    _same_as_local(url, local_reference, ("train/", "targets/default/", "scores/default/"))


def test_inspect_export_and_overwrite_on_s3(tmp_path, s3, local_reference):
    root = make_project(tmp_path / "p", n_models=1)
    url = s3.url()
    set_store(root, url)
    assert run(root, "featurize", "run.yaml", "-q").returncode == 0
    res = run(root, "inspect", url, "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["store"] == url and [t["rows_done"] for t in info["train"]] == [N_TRAIN]
    assert info["bytes_on_disk"] > 0
    out = tmp_path / "f.npy"
    res = run(root, "export", url, "--what", "features", "--model-id", "0", "--out", str(out))
    assert res.returncode == 0, res.stderr
    np.testing.assert_array_equal(np.load(out), arrays(local_reference / "out" / "attrib.zarr")["train/0/features"])
    res = run(root, "featurize", "run.yaml", "-q", "projector.proj_dim=16")
    assert res.returncode == 1 and "--overwrite" in msg(res)
    res = run(root, "featurize", "run.yaml", "-q", "projector.proj_dim=16", "--overwrite")
    assert res.returncode == 0, res.stderr
    assert s3_arrays(url)["train/0/features"].shape == (N_TRAIN, 16)
    assert N_TARGET > 0


def test_urls_the_store_cannot_open_are_refused_with_one_message(tmp_path, s3):
    root = make_project(tmp_path / "p", n_models=1)
    cases = {
        "nope://bucket/a.zarr": "has the scheme 'nope', which no file system opens",
        f"s3://{s3.BUCKET}": "names a bucket, not a store in it",
        "s3://no-such-bucket/a.zarr": "bucket 'no-such-bucket' of store.path s3://no-such-bucket/a.zarr does not exist",
        f"s3:/{s3.BUCKET}/a.zarr": f"reads as a s3:// URL missing a slash; write s3://{s3.BUCKET}/a.zarr",
        f"s3://{s3.BUCKET}/../a.zarr": "has an empty, '.' or '..' part",
        "s3://Not_A_Bucket!/a.zarr": "'Not_A_Bucket!' is not a valid bucket name",
    }
    if importlib.util.find_spec("gcsfs") is None:  # a scheme fsspec knows whose package is missing
        cases["gs://bucket/a.zarr"] = "store.path 'gs://bucket/a.zarr' needs gcsfs, which is not installed: pip install gcsfs"
    for url, words in cases.items():
        res = run(root, "featurize", "run.yaml", f"store.path={url}")
        assert res.returncode == 1, url
        assert words in msg(res) and "Traceback" not in res.stderr, (url, res.stderr)
    # no endpoint answers: one message naming the endpoint and the variable that sets it
    port = free_port()
    res = run_subprocess(root, "featurize", "run.yaml", f"store.path=s3://{s3.BUCKET}/a.zarr",
                         env={"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"})
    assert res.returncode == 1
    one = " ".join(res.stderr.split())
    assert f"cannot reach the object store of store.path s3://{s3.BUCKET}/a.zarr at http://127.0.0.1:{port}" in one
    assert "AWS_ENDPOINT_URL" in one and "Traceback" not in res.stderr
    assert not (root / "s3:").exists() and not (root / "nope:").exists()  # never taken as a local path


def test_storage_options_in_the_config_reach_the_service_and_are_never_written(tmp_path, s3, monkeypatch):
    root = make_project(tmp_path / "p", n_models=1)
    url = s3.url()
    set_store(root, url)
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    res = run(root, "featurize", "run.yaml", "-q", f"store.storage_options.endpoint_url={s3.endpoint}",
              "store.storage_options.secret=hunter2")
    assert res.returncode == 1 and "credentials for store.path" in msg(res) and "hunter2" not in msg(res)
    res = run(root, "featurize", "run.yaml", "-q", f"store.storage_options.endpoint_url={s3.endpoint}",
              "store.storage_options.key=trak", "store.storage_options.secret=hunter2")
    assert res.returncode == 0, res.stderr
    res = run(root, "featurize", "run.yaml", "--print-config", "store.storage_options.secret=hunter2")
    assert "hunter2" not in res.stdout and "***" in res.stdout
    attrs = s3.fs.cat_file(url[len("s3://"):] + "/zarr.json").decode()
    assert "hunter2" not in attrs and s3.endpoint in attrs


def test_two_nodes_over_s3_one_killed_and_restarted_write_the_store_of_one_process(tmp_path, s3, local_reference):
    """torchrun --nnodes 2 (c10d rendezvous on 127.0.0.1), each node in a folder of its own (no shared file
    system): node 1 dies mid-run with its workers, torchrun restarts node 0's ranks, node 1 comes back, and the
    store on S3 is the one a single process writes."""
    nodes = [make_project(tmp_path / f"node{i}") for i in range(2)]
    url = s3.url()
    for node in nodes:
        set_store(node, url)
    port = free_port()

    def start(i: int, log: Path) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "trak-two-nodes",
             "--max-restarts", "3", "--monitor-interval", "1", "-m", "trakcli.cli.main", "featurize", "run.yaml", "-q"],
            cwd=nodes[i], stdout=subprocess.DEVNULL, stderr=(tmp_path / f"{log.name}.err").open("w"),
            env={**os.environ, "TRAK_EVENT_LOG": str(log), "OMP_NUM_THREADS": "1",
                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        )

    first = start(0, tmp_path / "node0.log")
    time.sleep(1)  # node 0 hosts the rendezvous
    second = start(1, tmp_path / "node1.log")
    log = tmp_path / "node1.log"
    deadline = time.time() + 180
    while (not log.exists() or log.read_text().count("start featurize") < 6) and time.time() < deadline:
        assert second.poll() is None and first.poll() is None, (tmp_path / "node1.log.err").read_text()[-3000:]
        time.sleep(0.01)
    kill_tree(second.pid)
    second.wait()
    assert first.poll() is None  # node 0 lives on: torchrun restarts its ranks and waits for node 1
    again = start(1, tmp_path / "node1-again.log")
    for proc, name in ((first, "node0.log"), (again, "node1-again.log")):
        assert proc.wait(timeout=300) == 0, (tmp_path / f"{name}.err").read_text()[-3000:]
    assert "start featurize" in (tmp_path / "node1-again.log").read_text()
    remote = s3_arrays(url)
    local = arrays(local_reference / "out" / "attrib.zarr")
    names = sorted(n for n in local if n.startswith("train/"))
    assert sorted(n for n in remote if n.startswith("train/")) == names
    for name in names:
        np.testing.assert_allclose(remote[name], local[name], rtol=1e-6, atol=0, err_msg=name)


def _grow(root: Path, n_more: int = 60) -> None:
    """Append ``n_more`` seeded rows to the project's train data (10% of N_TRAIN)."""
    import torch

    data = torch.load(root / "ckpts" / "data.pt")
    g = torch.Generator().manual_seed(7)
    data["x_train"] = torch.cat([data["x_train"], torch.randn(n_more, 6, generator=g)])
    data["y_train"] = torch.cat([data["y_train"], torch.randint(0, 3, (n_more,), generator=g)])
    torch.save(data, root / "ckpts" / "data.pt")


def test_rows_appended_to_a_store_on_s3_are_featurized_alone(tmp_path, s3):
    root = make_project(tmp_path / "p")
    url = s3.url()
    set_store(root, url)
    assert run(root, "featurize", "run.yaml", "-q").returncode == 0
    key = url[len("s3://"):]
    old = {f: s3.fs.info(f)["ETag"] for f in s3.fs.find(f"{key}/train") if "/features/c/" in f}
    assert len(old) == 3 * (N_TRAIN // CHUNK)
    _grow(root)
    res = run(root, "featurize", "run.yaml")
    assert res.returncode == 0, res.stderr
    assert "appending 60 train rows to the 600 of store" in msg(res) and "computed 6/51 chunks" in msg(res)
    now = {f: s3.fs.info(f)["ETag"] for f in s3.fs.find(f"{key}/train") if "/features/c/" in f}
    assert {f: now[f] for f in old} == old  # no old chunk was written again
    assert len(now) == 3 * -(-(N_TRAIN + 60) // CHUNK)  # 15 full chunks, a 16th full and a 17th half
    assert run(root, "score", "run.yaml", "-q").returncode == 0
    once = make_project(tmp_path / "once")
    _grow(once)
    for cmd in ("featurize", "score"):
        assert run(once, cmd, "run.yaml", "-q").returncode == 0
    remote, local = s3_arrays(url), arrays(once / "out" / "attrib.zarr")
    np.testing.assert_allclose(remote["scores/default/scores"], local["scores/default/scores"], rtol=1e-5, atol=1e-7)
    for m in range(3):
        np.testing.assert_array_equal(remote[f"train/{m}/features"], local[f"train/{m}/features"])


def test_a_chunk_read_from_s3_is_one_request(tmp_path, s3):
    # s3fs asks for an object's size (a HEAD) before every GET unless max_concurrency is 1; a store's chunk
    # objects are a few MB, under the size s3fs splits a download at, so the store turns it off
    import zarr

    from trakcli.store.location import store_location, zarr_store

    root = make_project(tmp_path / "p")
    url = s3.url()
    set_store(root, url)
    assert run(root, "featurize", "run.yaml", "-q").returncode == 0
    store = zarr_store(store_location(url), read_only=True)
    calls: list[str] = []
    call_s3 = store.fs._call_s3

    async def counted(method, *args, **kwargs):
        calls.append(method)
        return await call_s3(method, *args, **kwargs)

    store.fs._call_s3 = counted
    group = zarr.open_group(store=store, mode="r")
    arr = group[_feature_arrays(group)[0]]
    np.asarray(arr[:])
    n_chunks = -(-arr.shape[0] // arr.chunks[0])
    assert n_chunks > 1 and calls.count("get_object") >= n_chunks
    assert "head_object" not in calls


def _feature_arrays(group) -> list[str]:
    """The paths of the train features arrays under ``train/``."""
    return [f"train/{m}/features" for m in group["train"].group_keys() if "features" in group[f"train/{m}"]]


def test_storage_options_override_the_store_s_s3_defaults():
    from trakcli.store.location import s3_options

    assert s3_options()["max_concurrency"] == 1
    assert s3_options({"max_concurrency": 8})["max_concurrency"] == 8
    assert s3_options()["config_kwargs"] == {"response_checksum_validation": "when_required"}
    given = s3_options({"config_kwargs": {"response_checksum_validation": "when_supported", "connect_timeout": 5}})
    assert given["config_kwargs"] == {"response_checksum_validation": "when_supported", "connect_timeout": 5}
