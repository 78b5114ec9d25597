"""Partial progress inside a chunk (`train/<m>/rows_done`): a featurize killed or interrupted inside a chunk keeps the
rows it finished, the rerun computes only the others, and the store equals an uninterrupted run's, bit for bit.

Events (``$TRAK_EVENT_LOG``) tell which batches each run computed: ``batch featurize <m> <chunk> <lo> <hi>`` per
batch, ``partial ... <rows>`` after each save of a chunk's rows, ``resume ... <rows>`` when a chunk starts after
saved rows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from projects import (
    assert_same_store, kill_at_line, make_project, msg, run, run_subprocess, s3_arrays, set_store, tiny_lm_project,
    tiny_model, token_rows,
)

STORE = Path("out") / "attrib.zarr"
BIG_CHUNK = ["store.chunk_rows=400"]  # 600 rows: chunks [0, 400) and [400, 600), batches of 16 rows


def _events(log: Path, kind: str, model_id: int = 0) -> list[list[int]]:
    """The integers of the events ``<kind> featurize <model_id> ...`` in order."""
    out = []
    for line in log.read_text().splitlines():
        word, label, m, *rest = line.split()
        if word == kind and label == "featurize" and int(m) == model_id:
            out.append([int(v) for v in rest])
    return out


def _inspect(root: Path, store: Path | str = STORE) -> list[dict]:
    res = run(root, "inspect", str(store), "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["train"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted featurize of the project (2 checkpoints) in chunks of 400 rows."""
    root = make_project(tmp_path_factory.mktemp("ref"), n_models=2)
    res = run(root, "featurize", "run.yaml", "-q", *BIG_CHUNK)
    assert res.returncode == 0, res.stderr
    return root


def test_killed_inside_the_first_chunk_resumes_after_the_saved_rows(tmp_path, reference):
    root = make_project(tmp_path / "p", n_models=2)
    args = ["featurize", "run.yaml", "-q", *BIG_CHUNK, "store.save_every_s=0"]  # a save after every batch
    log = tmp_path / "events.log"
    kill_at_line(root, args, log, "partial featurize 0 0 48")
    assert "done featurize 0 0" not in log.read_text()  # killed inside chunk 0 (400 rows, 25 batches)
    saved = int(np.asarray(zarr.open_group(str(root / STORE), mode="r")["train/0/rows_done"][0]))
    assert saved >= 48 and saved % 16 == 0
    entry = _inspect(root)[0]
    assert entry["rows_done"] == 0 and entry["rows_partial"] == saved  # no chunk done, the saved rows kept
    res = run(root, "inspect", str(STORE))
    assert f"{saved}/600" in res.stderr and "partial" in res.stderr  # the table (its cells wrap)

    log.unlink()
    res = run_subprocess(root, *args, env={"TRAK_EVENT_LOG": str(log)})
    assert res.returncode == 0, res.stderr
    assert _events(log, "resume") == [[0, saved]]
    batches = [b for b in _events(log, "batch") if b[0] == 0]
    assert batches[0] == [0, saved, saved + 16]  # the rerun starts at the first row not saved
    assert sum(hi - lo for _, lo, hi in batches) == 400 - saved  # and computes only the rest of chunk 0
    assert_same_store(root / STORE, reference / STORE)  # the counts are cleared once chunks are done


def test_killed_again_after_a_resume_loses_nothing_saved(tmp_path, reference):
    root = make_project(tmp_path / "p", n_models=2)
    args = ["featurize", "run.yaml", "-q", *BIG_CHUNK, "store.save_every_s=0"]
    log = tmp_path / "events.log"
    kill_at_line(root, args, log, "partial featurize 0 0 32")
    first = int(np.asarray(zarr.open_group(str(root / STORE), mode="r")["train/0/rows_done"][0]))
    log.unlink()
    kill_at_line(root, args, log, f"partial featurize 0 0 {first + 32}")  # the resumed run, killed in turn
    assert _events(log, "resume") == [[0, first]]
    second = int(np.asarray(zarr.open_group(str(root / STORE), mode="r")["train/0/rows_done"][0]))
    assert second >= first + 32
    log.unlink()
    res = run_subprocess(root, *args, env={"TRAK_EVENT_LOG": str(log)})
    assert res.returncode == 0, res.stderr
    assert _events(log, "resume") == [[0, second]]
    assert_same_store(root / STORE, reference / STORE)


def _interrupt_at(monkeypatch, call: int) -> list[tuple[int, int]]:
    """Make the featurizer raise KeyboardInterrupt (Ctrl-C) at its ``call``-th batch; returns the (model_id,
    row_offset) of every batch computed."""
    from trakcli.jobs import setup

    calls: list[tuple[int, int]] = []
    real = setup.JobSetup.features

    def features(self, inputs, labels, model_id, row_offset):
        calls.append((model_id, row_offset))
        if len(calls) == call:
            raise KeyboardInterrupt
        return real(self, inputs, labels, model_id, row_offset)

    monkeypatch.setattr(setup.JobSetup, "features", features)
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_ctrl_c_saves_the_finished_batches_and_says_how_many_rows_are_kept(tmp_path, monkeypatch, dtype):
    once, root = (make_project(tmp_path / name, n_models=2) for name in ("once", "p"))
    args = ["featurize", "run.yaml", *BIG_CHUNK, f"store.dtype={dtype}"]  # no timed save: the default 30 s
    assert run(once, *args, "-q").returncode == 0
    # the first batch is computed before the store exists and reused; Ctrl-C in the 4th: rows 0-47 are finished
    calls = _interrupt_at(monkeypatch, 4)
    res = run(root, *args)
    assert res.returncode == 130
    assert "interrupted; 48 of 600 train rows of model 0 are stored; rerun the same command to resume" in msg(res)
    assert _inspect(root)[0]["rows_partial"] == 48
    monkeypatch.undo()

    calls = _interrupt_at(monkeypatch, 0)  # counts, never interrupts
    assert run(root, *args, "-q").returncode == 0
    assert calls[0] == (0, 48) and all(off >= 48 for m, off in calls if m == 0)
    assert len(calls) == 2 * 38 - 3  # 25 + 13 batches per checkpoint, less the 3 kept
    assert_same_store(root / STORE, once / STORE)


def test_ctrl_c_in_a_later_checkpoint_names_it(tmp_path, monkeypatch):
    root = make_project(tmp_path / "p", n_models=2)
    _interrupt_at(monkeypatch, 1 + 38 + 2)  # the first batch, checkpoint 0's 37 others, 2 of checkpoint 1
    res = run(root, "featurize", "run.yaml", *BIG_CHUNK)
    assert res.returncode == 130
    assert "interrupted; 32 of 600 train rows of model 1 are stored (model 0 is complete)" in msg(res)


def test_saved_rows_that_fail_their_checksum_are_computed_again(tmp_path, monkeypatch, reference):
    root = make_project(tmp_path / "p", n_models=2)
    _interrupt_at(monkeypatch, 4)
    assert run(root, "featurize", "run.yaml", *BIG_CHUNK).returncode == 130
    monkeypatch.undo()
    chunk = root / STORE / "train" / "0" / "features" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    assert _inspect(root)[0]["rows_partial"] == 48  # the file is there: only a read finds the damage
    res = run(root, "inspect", str(STORE), "--verify", "--json")
    assert res.returncode == 0, res.stderr  # no damage to report: nothing marks these rows done
    assert json.loads(res.stdout)["train"][0]["rows_partial"] == 0
    calls = _interrupt_at(monkeypatch, 0)
    assert run(root, "featurize", "run.yaml", "-q", *BIG_CHUNK).returncode == 0
    assert calls[0] == (0, 0)  # the chunk is computed from its first row
    assert_same_store(root / STORE, reference / STORE)


def test_rows_are_saved_once_save_every_s_of_work_has_passed(tmp_path, monkeypatch, reference):
    import importlib

    clock = iter(range(0, 10**6, 10))  # every reading of the clock is 10 s after the one before
    monkeypatch.setattr(importlib.import_module("trakcli.jobs.featurize"), "monotonic", lambda: next(clock))
    root = make_project(tmp_path / "p", n_models=2)
    log = tmp_path / "events.log"
    monkeypatch.setenv("TRAK_EVENT_LOG", str(log))
    assert run(root, "featurize", "run.yaml", "-q", *BIG_CHUNK, "store.save_every_s=25").returncode == 0
    # the clock is read as a chunk starts, after each batch and after each save: 30 s pass in three batches
    assert [rows for chunk, rows in _events(log, "partial") if chunk == 0] == list(range(48, 400, 48))
    assert_same_store(root / STORE, reference / STORE)


def test_a_negative_save_interval_is_refused_naming_the_key(user_project):
    res = run(user_project, "featurize", "run.yaml", "store.save_every_s=-1")
    assert res.returncode == 1 and "store.save_every_s" in msg(res), res.stderr
    assert not (user_project / STORE).exists()


def test_a_store_without_rows_done_works_as_before_and_gains_them(tmp_path, reference):
    root = tmp_path / "p"
    shutil.copytree(reference, root)
    for m in range(2):
        shutil.rmtree(root / STORE / "train" / str(m) / "rows_done")
    entry = _inspect(root)[0]
    assert entry["rows_done"] == 600 and entry["rows_partial"] == 0
    assert run(root, "score", "run.yaml", "-q", *BIG_CHUNK).returncode == 0  # read only: not re-created
    assert not (root / STORE / "train" / "0" / "rows_done").exists()
    res = run(root, "featurize", "run.yaml", *BIG_CHUNK)
    assert res.returncode == 0 and "nothing to do" in msg(res), res.stderr
    assert (root / STORE / "train" / "0" / "rows_done" / "zarr.json").exists()


def test_rows_of_a_replaced_checkpoint_are_not_kept(tmp_path, monkeypatch):
    """A checkpoint that changes before any chunk is done rebinds its model_id (as before); rows saved from the
    old file are dropped, not mixed into the new checkpoint's chunk."""
    once, root = (make_project(tmp_path / name, n_models=1) for name in ("once", "p"))
    _interrupt_at(monkeypatch, 4)
    assert run(root, "featurize", "run.yaml", *BIG_CHUNK).returncode == 130
    monkeypatch.undo()
    for r in (once, root):
        torch.save(tiny_model(hidden=32, seed=7).state_dict(), r / "ckpts" / "model_0.pt")
    assert run(once, "featurize", "run.yaml", "-q", *BIG_CHUNK).returncode == 0
    calls = _interrupt_at(monkeypatch, 0)
    res = run(root, "featurize", "run.yaml", *BIG_CHUNK)
    assert res.returncode == 0 and "no features were computed from" in msg(res), res.stderr
    assert calls[0] == (0, 0)  # chunk 0 computed from its first row
    assert_same_store(root / STORE, once / STORE)


def test_torchrun_ranks_save_their_own_chunks_rows(tmp_path, reference):
    import sys

    from projects import free_port

    root = make_project(tmp_path / "p", n_models=2)
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "trakcli.cli.main", "featurize", "run.yaml", "-q", *BIG_CHUNK,
         "store.save_every_s=0"],
        cwd=root, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TRAK_EVENT_LOG": str(tmp_path / "events.log")},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    chunks = {e[0] for m in range(2) for e in _events(tmp_path / "events.log", "partial", m)}
    assert chunks == {0, 1}  # rank 0 saved rows of chunk 0, rank 1 of chunk 1
    a, b = _arrays(root / STORE), _arrays(reference / STORE)
    assert sorted(a) == sorted(b)
    for name in a:  # the kernels' float64 sums round with the threads of BLAS (one per rank here)
        if name.endswith("/kernel"):
            np.testing.assert_allclose(a[name], b[name], rtol=1e-12, err_msg=name)
        else:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_killed_inside_a_chunk_on_s3_resumes_after_the_saved_rows(tmp_path, s3, reference):
    root = make_project(tmp_path / "p", n_models=2)
    url = s3.url()
    set_store(root, url)
    args = ["featurize", "run.yaml", "-q", *BIG_CHUNK, "store.save_every_s=0"]
    log = tmp_path / "events.log"
    kill_at_line(root, args, log, "partial featurize 0 0 48")
    assert "done featurize 0 0" not in log.read_text()
    saved = _inspect(root, url)[0]["rows_partial"]
    assert saved >= 48
    log.unlink()
    res = run_subprocess(root, *args, env={"TRAK_EVENT_LOG": str(log)})
    assert res.returncode == 0, res.stderr
    assert _events(log, "resume") == [[0, saved]]
    remote, local = s3_arrays(url), _arrays(reference / STORE)
    assert sorted(remote) == sorted(local)
    for name in local:
        np.testing.assert_array_equal(remote[name], local[name], err_msg=name)


def _arrays(store: Path) -> dict[str, np.ndarray]:
    from projects import arrays

    return arrays(store)


# --- a tiny language model: batches cut by a token budget ---------------------------------------------------------

def _lm_project(root: Path) -> Path:
    """A tiny GPT-2 (one checkpoint) on 48 pre-tokenized documents of 2 to 10 tokens, in one chunk of 48 rows, cut
    into batches of at most 4 rows and 24 padded tokens (so a batch's rows depend on the documents' lengths)."""
    rows = token_rows(48, 2, 10, seed=3)
    return tiny_lm_project(root, rows, rows[:2], max_length=10, batch_size=4, data_extra={"batch_tokens": 24},
                           projector={"kind": "kronecker", "proj_dim": 64, "seed": 0},
                           store={"path": "s.zarr", "chunk_rows": 48, "save_every_s": 0})


def test_a_language_model_killed_after_20_of_48_documents_redoes_at_most_one_batch(tmp_path):
    once, root = _lm_project(tmp_path / "once"), _lm_project(tmp_path / "p")
    ref = tmp_path / "once.log"
    res = run_subprocess(once, "featurize", "run.yaml", "-q", env={"TRAK_EVENT_LOG": str(ref)})
    assert res.returncode == 0, res.stderr
    bounds = [hi for _, hi in (b[1:] for b in _events(ref, "batch"))]
    after_20 = next(b for b in bounds if b >= 20)  # the first save with at least 20 rows done
    log = tmp_path / "events.log"
    kill_at_line(root, ["featurize", "run.yaml", "-q"], log, f"partial featurize 0 0 {after_20}\n")
    assert "done featurize 0 0" not in log.read_text()
    saved = int(np.asarray(zarr.open_group(str(root / "s.zarr"), mode="r")["train/0/rows_done"][0]))
    assert after_20 <= saved < 48 and saved in bounds  # the kill lost at most the batch after the save (<= 4 rows)
    log.unlink()
    res = run_subprocess(root, "featurize", "run.yaml", "-q", env={"TRAK_EVENT_LOG": str(log)})
    assert res.returncode == 0, res.stderr
    assert _events(log, "resume") == [[0, saved]]
    resumed = [b[1:] for b in _events(log, "batch")]
    assert resumed[0][0] == saved and all(lo >= saved for lo, _ in resumed)  # no saved row computed again
    assert_same_store(root / "s.zarr", once / "s.zarr")
