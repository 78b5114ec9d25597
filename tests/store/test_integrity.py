"""Fault injection on a finished store and on the files trakcli writes: store integrity.

Each test damages one thing the way a disk, a copy or a user does (a chunk file
deleted or flipped, a garbage zarr.json, a full disk, a directory where the lock
goes), then checks the message, the exit code, and that nothing already computed
was lost: the other store arrays and any previous output file stay byte-identical.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import zarr

from projects import CHUNK, N_TRAIN, assert_same_store, limit_file_size, msg, run, trak_cmd

STORE = Path("out") / "attrib.zarr"


def flip(path: Path) -> None:
    """Flip one byte in the middle of a chunk file (a bit rot the checksum catches)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def files_except(root: Path, *arrays: str) -> dict[str, bytes]:
    """Every file of the store (path -> bytes) outside the given arrays: what must stay byte-identical."""
    store = root / STORE
    return {
        str(f.relative_to(store)): f.read_bytes()
        for f in sorted(store.rglob("*"))
        if f.is_file() and not any(f.relative_to(store).as_posix().startswith(a + "/") for a in arrays)
    }


def test_deleted_train_chunk_is_corrupt_everywhere_and_verify_then_score_restores_it(project, finished):
    chunk = project / STORE / "train" / "1" / "features" / "c" / "4" / "0"
    chunk.unlink()  # a lost file reads as zeros in zarr: it must never be used
    before = files_except(project, "train/1/features")

    res = run(project, "score", "run.yaml", "--verify")
    assert res.returncode == 1
    assert "train features of model_id 1 (train/1/features): chunks [4] are missing or corrupt" in msg(res)
    assert "run `trak featurize CONFIG --verify` to recompute them" in msg(res)
    assert "Traceback" not in res.stderr

    res = run(project, "inspect", str(STORE), "--json")
    assert res.returncode == 1
    info = json.loads(res.stdout)
    assert [t["rows_done"] for t in info["train"]] == [N_TRAIN, N_TRAIN - CHUNK]  # not reported complete
    assert [(d["array"], d["chunks"]) for d in info["corrupt"]] == [("train/1/features", [4])]
    assert "trak featurize CONFIG --verify" in info["corrupt"][0]["repair"]
    assert "store array train/1/features: missing chunks [4]" in msg(res)
    assert files_except(project, "train/1/features") == before  # nothing else touched

    res = run(project, "featurize", "run.yaml", "--verify")
    assert res.returncode == 0, res.stderr
    assert "model 1: chunks [4] failed their checksum or are missing; recomputed" in msg(res)
    assert run(project, "score", "run.yaml", "-q").returncode == 0
    assert_same_store(project / STORE, finished / STORE)  # scores bit-identical to the clean run's


@pytest.mark.parametrize(
    "chunk",
    [
        "train/0/out_to_loss/c/7",
        "train/1/done/c/2",
        "train/0/nonfinite/c/3",
        "train/1/kernel/c/0/0",
        "targets/default/0/features/c/1/0",
        "targets/default/1/done/c/0",
        "scores/default/scores/c/0/5",
        "scores/default/done/c/9",
    ],
)
def test_any_deleted_chunk_then_featurize_verify_and_score_gives_the_clean_scores(project, finished, chunk):
    (project / STORE / chunk).unlink()
    assert run(project, "featurize", "run.yaml", "--verify", "-q").returncode == 0
    res = run(project, "score", "run.yaml", "-q")
    assert res.returncode == 0, res.stderr
    assert_same_store(project / STORE, finished / STORE)


def test_plain_score_rebuilds_a_corrupt_kernel_and_says_so(project, finished):
    flip(project / STORE / "train" / "1" / "kernel" / "c" / "0" / "0")
    res = run(project, "export", str(STORE), "--what", "train/1/kernel", "--out", "k.npy")
    assert res.returncode == 1 and "rerun `trak score CONFIG`, which rebuilds the kernel" in msg(res)
    res = run(project, "score", "run.yaml")
    assert res.returncode == 0, res.stderr
    assert "model_id 1: the stored kernel was corrupt or missing; it is rebuilt" in msg(res)
    assert_same_store(project / STORE, finished / STORE)


def test_plain_score_recomputes_corrupt_target_features_and_scores(project, finished):
    flip(project / STORE / "targets" / "default" / "0" / "features" / "c" / "2" / "0")
    flip(project / STORE / "scores" / "default" / "scores" / "c" / "0" / "11")
    res = run(project, "score", "run.yaml")
    assert res.returncode == 0, res.stderr
    assert "model 0: target feature chunks [2] were missing or corrupt; recomputed" in msg(res)
    assert "score column blocks [11] were missing or corrupt; recomputed" in msg(res)
    assert_same_store(project / STORE, finished / STORE)


def test_garbage_array_metadata_is_reported_then_repaired(project, finished):
    meta = project / STORE / "train" / "1" / "features" / "zarr.json"
    meta.write_text("garbage")
    for args in (["score", "run.yaml"], ["inspect", str(STORE)]):
        res = run(project, *args)
        assert res.returncode == 1, args
        assert "store metadata train/1/features/zarr.json is unreadable" in msg(res), args
        assert "rerun `trak featurize CONFIG --verify`" in msg(res) and "Traceback" not in res.stderr
    res = run(project, "featurize", "run.yaml", "--verify")
    assert res.returncode == 0, res.stderr
    assert msg(res).count("train/1/features: its metadata (zarr.json) was unreadable; re-created") == 1
    assert "nothing to do" in msg(res)  # every chunk was kept and passed its checksum
    # derived arrays' metadata: plain `trak score` rebuilds them
    (project / STORE / "scores" / "default" / "scores" / "zarr.json").write_text("{}")
    res = run(project, "score", "run.yaml")
    assert res.returncode == 0, res.stderr
    assert "scores/default/scores: its metadata (zarr.json) was unreadable" in msg(res)
    assert_same_store(project / STORE, finished / STORE)


def test_inspect_verify_reads_every_chunk_and_reports_the_corrupt_ones(project, finished):
    res = run(finished, "inspect", str(STORE), "--verify")
    assert res.returncode == 0, res.stderr
    assert "verified: every done chunk is present and passes its checksum" in msg(res)
    flip(project / STORE / "train" / "0" / "features" / "c" / "3" / "0")
    flip(project / STORE / "scores" / "default" / "scores" / "c" / "0" / "6")
    before = files_except(project, "train/0/features", "scores/default/scores")
    assert run(project, "inspect", str(STORE)).returncode == 0  # files all there: only --verify reads them
    res = run(project, "inspect", str(STORE), "--verify", "--json")
    assert res.returncode == 1
    info = json.loads(res.stdout)
    assert [(d["array"], d["chunks"]) for d in info["corrupt"]] == [
        ("train/0/features", [3]), ("scores/default/scores", [6])
    ]
    assert info["train"][0]["rows_done"] == N_TRAIN - CHUNK and info["scores"]["default"]["chunks_done"] == 14
    assert "has 2 damaged arrays (every chunk read): train/0/features, scores/default/scores" in msg(res)
    assert "rerun `trak score CONFIG`, which recomputes it" in msg(res)
    assert files_except(project, "train/0/features", "scores/default/scores") == before


def test_export_refuses_unfinished_arrays_and_keeps_the_previous_file(project):
    out = project / "s.npy"
    assert run(project, "export", str(STORE), "--out", str(out)).returncode == 0
    good = out.read_bytes()
    g = zarr.open_group(str(project / STORE), mode="r+")
    g["scores/default/done"][[3, 8]] = 0  # as left by a killed `trak score`
    g["train/1/done"][0] = 0
    res = run(project, "export", str(STORE), "--out", str(out))
    assert res.returncode == 1
    assert "store array scores/default/scores in out/attrib.zarr is unfinished: 2 of 15 column blocks are not " \
           "computed yet (3, 8); run `trak score CONFIG` to finish them" in msg(res)
    res = run(project, "export", str(STORE), "--what", "features", "-m", "1", "--out", str(out))
    assert res.returncode == 1 and "1 of 15 row chunks" in msg(res) and "run `trak featurize CONFIG`" in msg(res)
    assert out.read_bytes() == good
    assert sorted(p.name for p in project.iterdir()) == ["ckpts", "my_model.py", "out", "run.yaml", "s.npy"]


def test_failing_export_and_score_out_keep_the_previous_file_without_traceback(project):
    out = project / "s.npy"
    out.write_bytes(b"previous results")
    # a full disk while `trak score --out` writes (the scores are 90 x 600 float32, 216 KB)
    res = subprocess.run(
        trak_cmd("score", "run.yaml", "-q", "--out", "s.npy"), cwd=project, capture_output=True, text=True,
        timeout=300, preexec_fn=limit_file_size(100_000),
    )
    assert res.returncode == 1
    assert "cannot write s.npy" in msg(res) and "s.npy is unchanged" in msg(res)
    # a corrupt chunk met halfway through an export
    flip(project / STORE / "scores" / "default" / "scores" / "c" / "0" / "12")
    res = subprocess.run(trak_cmd("export", str(STORE), "--out", "s.npy"), cwd=project, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 1
    assert "store array scores/default/scores chunk (0, 12) (entries [0:90, 480:520]) is corrupt" in msg(res)
    assert "s.npy is unchanged" in msg(res)
    for noise in ("Traceback", "Task was destroyed", "Event loop is closed", "Exception ignored"):
        assert noise not in res.stderr
    assert out.read_bytes() == b"previous results"
    assert [p.name for p in project.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_lock_path_that_is_a_directory(project):
    lock = project / "out" / "attrib.zarr.lock"
    lock.mkdir()
    (lock / "keep").write_text("x")
    res = run(project, "featurize", "run.yaml")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "the lock path out/attrib.zarr.lock of store out/attrib.zarr is a directory, not a lock file" in msg(res)
    assert (lock / "keep").read_text() == "x"


def test_atomic_write_leaves_the_old_file_on_failure(tmp_path):
    from trakcli.files import atomic_open, atomic_path, write_text

    path = tmp_path / "report.json"
    write_text(path, "old")
    with pytest.raises(RuntimeError):
        with atomic_open(path, "w") as f:
            f.write("half of the new")
            raise RuntimeError("disk full")
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(path) as tmp:
            tmp.write_text("new")
            raise KeyboardInterrupt
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.json"]
    with atomic_path(tmp_path / "plot.png") as tmp:
        assert tmp.suffix == ".png" and tmp.parent == tmp_path  # the format stays readable from the name
        tmp.write_bytes(b"png")
    write_text(path, "new")
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["plot.png", "report.json"]
