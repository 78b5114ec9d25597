"""Appending train rows to a featurized store: only the new rows are featurized, the scores equal featurizing
everything at once, earlier experiments are stale until rescored, and anything but an append is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from trakcli.jobs import kernels
from trakcli.jobs.setup import JobSetup

from projects import MODEL_FILE, kill_at, msg, run, run_subprocess, tiny_model, write_config

N_OLD, N_NEW, N_TARGET = 40, 44, 6  # 10% more rows
STORE = Path("out") / "attrib.zarr"


def make(root: Path, n_train: int, chunk_rows: int = 16, extra: dict | None = None, proj_dim: int = 16,
         **train) -> Path:
    """A project of 2 tiny checkpoints whose data.pt holds the first ``n_train`` of 64 seeded train rows."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "my_model.py").write_text(MODEL_FILE)
    (root / "ckpts").mkdir(exist_ok=True)
    for i in range(2):
        torch.save(tiny_model(seed=i).state_dict(), root / "ckpts" / f"model_{i}.pt")
    write_data(root, n_train)
    write_config(root / "run.yaml", {
        "model": {"entrypoint": "my_model.py:make_model"},
        "checkpoints": "ckpts/model_*.pt",
        "data": {
            "train": {"path": "data.pt", "inputs": "x_train", "labels": "y_train", **train},
            "target": {"path": "data.pt", "inputs": "x_target", "labels": "y_target"},
            "batch_size": 8,
        },
        "projector": {"kind": "rademacher", "proj_dim": proj_dim, "seed": 0},
        "store": {"path": str(STORE), "chunk_rows": chunk_rows},
        "num_threads": 1,
        **(extra or {}),
    })
    return root


def rows(n: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g),
            torch.randn(N_TARGET, 6, generator=g), torch.randint(0, 3, (N_TARGET,), generator=g))


def write_data(root: Path, n_train: int, edit=None) -> None:
    x, y, xt, yt = rows()
    x, y = x[:n_train].clone(), y[:n_train].clone()
    if edit is not None:
        edit(x, y)
    torch.save({"x_train": x, "y_train": y, "x_target": xt, "y_target": yt}, root / "data.pt")


def ok(root: Path, *args: str):
    res = run(root, *args)
    assert res.returncode == 0, res.stderr
    return res


def chunk_files(root: Path) -> dict[tuple[str, int], tuple[int, bytes]]:
    """Every chunk file of the train arrays (features, out_to_loss, nonfinite, done):
    (path, row chunk index) -> (mtime_ns, bytes)."""
    out = {}
    for f in sorted((root / STORE / "train").rglob("*")):
        parts = f.relative_to(root / STORE).parts  # train/<m>/<array>/c/<row chunk>[/<col chunk>]
        if f.is_file() and "c" in parts and "kernel" not in parts:
            out[("/".join(parts), int(parts[parts.index("c") + 1]))] = (f.stat().st_mtime_ns, f.read_bytes())
    return out


def scores(root: Path) -> np.ndarray:
    return np.asarray(zarr.open_group(str(root / STORE), mode="r")["scores/default/scores"][:])


@pytest.fixture
def counted(monkeypatch) -> list[int]:
    """The rows of every batch featurized (train and target), in order."""
    seen: list[int] = []
    real = JobSetup.features

    def features(self, inputs, labels, model_id, row_offset):
        seen.append(len(labels))
        return real(self, inputs, labels, model_id, row_offset)

    monkeypatch.setattr(JobSetup, "features", features)
    return seen


@pytest.fixture(scope="module")
def at_once(tmp_path_factory) -> dict[int, np.ndarray]:
    """By (chunk_rows, proj_dim): the scores of a store featurized with all N_NEW rows at once."""
    out = {}
    for chunk_rows, proj_dim in ((8, 16), (16, 16), (16, 64)):
        root = make(tmp_path_factory.mktemp(f"once{chunk_rows}"), N_NEW, chunk_rows, proj_dim=proj_dim)
        ok(root, "featurize", "run.yaml", "-q")
        ok(root, "score", "run.yaml", "-q")
        out[chunk_rows, proj_dim] = scores(root)
    for c in (8, 16):
        out[c] = out[c, 16]
    return out


# 40 rows: whole chunks of 8; chunks of 16 end in a half-filled one; proj_dim 64 > n_train: the dual kernel
@pytest.mark.parametrize("chunk_rows,proj_dim", [(8, 16), (16, 16), (16, 64)])
def test_appended_rows_are_featurized_alone_and_score_as_featurized_at_once(
        tmp_path, monkeypatch, counted, at_once, chunk_rows, proj_dim):
    root = make(tmp_path, N_OLD, chunk_rows, proj_dim=proj_dim)
    ok(root, "featurize", "run.yaml", "-q")
    ok(root, "score", "run.yaml", "-q")
    before = chunk_files(root)
    old = zarr.open_group(str(root / STORE), mode="r")
    old_features = [np.asarray(old[f"train/{m}/features"][:]) for m in range(2)]
    n_full = N_OLD // chunk_rows  # old chunks that were full: never rewritten

    write_data(root, N_NEW)
    log = tmp_path / "events.log"
    monkeypatch.setenv("TRAK_EVENT_LOG", str(log))
    counted.clear()
    gram_rows = []
    real_gram = kernels.gram_matrix

    def gram_matrix(chunks):
        chunks = list(chunks)
        gram_rows.append(sum(c.shape[0] for c in chunks))
        return real_gram(chunks)

    monkeypatch.setattr(kernels, "gram_matrix", gram_matrix)
    res = ok(root, "featurize", "run.yaml")
    assert "appending 4 train rows to the 40" in msg(res)
    assert sum(counted) == 2 * (N_NEW - N_OLD)  # only the new rows, of each checkpoint
    # the primal kernels add the new rows' products to the old rows' Gram; the dual ones (n_train < proj_dim)
    # are solved over every row
    assert gram_rows == ([N_NEW - N_OLD] * 2 if proj_dim < N_OLD else [])
    assert not any((root / STORE / "train" / str(m) / "gram_prefix").exists() for m in range(2))
    started = [line.split() for line in log.read_text().splitlines() if line.startswith("start featurize")]
    assert sorted({int(c) for *_, c in started}) == list(range(n_full, -(-N_NEW // chunk_rows)))
    after = chunk_files(root)
    kept = [key for key in before if key[1] < n_full]
    assert {key[0].split("/")[2] for key in kept} == {"features", "out_to_loss", "nonfinite", "done"}
    for key in kept:
        assert after[key] == before[key], f"{key[0]} was rewritten"
    grown = zarr.open_group(str(root / STORE), mode="r")
    assert dict(grown.attrs)["layout"]["n_train"] == N_NEW
    assert [a["n_train_before"] for a in grown.attrs["appends"]] == [N_OLD]
    for m in range(2):
        np.testing.assert_array_equal(np.asarray(grown[f"train/{m}/done"][:]), 1)
        assert grown[f"train/{m}/done"].attrs["all_done"] == -(-N_NEW // chunk_rows)  # marked over the grown flags
        np.testing.assert_array_equal(np.asarray(grown[f"train/{m}/features"][:N_OLD]), old_features[m])
        assert "lambda_reg" in grown[f"train/{m}/kernel"].attrs  # made again over all rows

    # the earlier experiment is stale: score, export and inspect say so and how to rescore
    res = run(root, "score", "run.yaml", "-q")
    assert res.returncode == 1
    assert "stale: they were computed over 40 train rows, and the store now holds 44" in msg(res)
    assert "trak score CONFIG --overwrite" in msg(res)
    res = run(root, "export", str(STORE), "-o", "s.npy")
    assert res.returncode == 1 and "stale" in msg(res) and not (root / "s.npy").exists()
    res = ok(root, "inspect", str(STORE))
    assert "stale" in msg(res) and "--overwrite" in msg(res)
    assert "appended: 40 -> 44 train rows" in msg(res)
    info = json.loads(ok(root, "inspect", str(STORE), "--json").stdout)
    assert info["scores"]["default"]["stale"]["n_train"] == N_OLD

    counted.clear()
    ok(root, "score", "run.yaml", "-q", "--overwrite")
    assert counted == []  # the target features are kept: they depend on the checkpoints, not the train rows
    np.testing.assert_allclose(scores(root), at_once[chunk_rows, proj_dim], rtol=1e-5, atol=1e-6)
    ok(root, "export", str(STORE), "-o", "s.npy")
    assert np.load(root / "s.npy").shape == (N_TARGET, N_NEW)


def _change_row(x, y):
    x[3] += 1.0


def _swap_rows(x, y):
    x[[0, 1]] = x[[1, 0]]
    y[[0, 1]] = y[[1, 0]]


@pytest.mark.parametrize("edit", [_change_row, _swap_rows])
def test_more_rows_whose_old_rows_differ_are_refused_and_change_nothing(tmp_path, edit):
    root = make(tmp_path, N_OLD)
    ok(root, "featurize", "run.yaml", "-q")
    before = {str(f): f.read_bytes() for f in (root / STORE).rglob("*") if f.is_file()}
    write_data(root, N_NEW, edit)
    res = run(root, "featurize", "run.yaml", "-q")
    assert res.returncode == 1
    assert "data.train has 44 rows" in msg(res)
    assert "first 40 rows are not the rows the store was featurized with" in msg(res)
    assert "--overwrite" in msg(res)
    assert {str(f): f.read_bytes() for f in (root / STORE).rglob("*") if f.is_file()} == before


def test_fewer_rows_are_refused_as_other_data(tmp_path):
    root = make(tmp_path, N_OLD)
    ok(root, "featurize", "run.yaml", "-q")
    write_data(root, N_OLD - 4)
    res = run(root, "featurize", "run.yaml", "-q")
    assert res.returncode == 1
    assert "train_data.n: store has 40, this run has 36" in msg(res)


def test_more_rows_with_other_settings_are_refused_naming_them(tmp_path):
    root = make(tmp_path, N_OLD)
    ok(root, "featurize", "run.yaml", "-q")
    write_data(root, N_NEW)
    res = run(root, "featurize", "run.yaml", "-q", "projector.seed=1")
    assert res.returncode == 1
    assert "projector.seed: store has 0, this run has 1" in msg(res)
    assert dict(zarr.open_group(str(root / STORE), mode="r").attrs)["layout"]["n_train"] == N_OLD


def test_an_append_killed_in_the_middle_resumes(tmp_path):
    root = make(tmp_path, N_OLD, 8)
    ok(root, "featurize", "run.yaml", "-q")
    # grown by 24 rows (3 new chunks of 8 per checkpoint); killed as the second new chunk starts
    write_data(root, 64)
    log = tmp_path / "events.log"
    assert kill_at(root, ["featurize", "run.yaml", "-q"], log, 2)
    flags = [np.asarray(zarr.open_group(str(root / STORE), mode="r")[f"train/{m}/done"][:]) for m in range(2)]
    assert flags[0][:5].all() and not flags[0].all()  # the old chunks stay done, some new one is not
    res = run_subprocess(root, "featurize", "run.yaml", "-q", env={"TRAK_EVENT_LOG": str(log)})
    assert res.returncode == 0, res.stderr
    started = [int(line.split()[-1]) for line in log.read_text().splitlines() if line.startswith("start featurize")]
    assert min(started) >= 5  # no old chunk was computed by either run

    once = make(tmp_path / "once", 64, 8)
    ok(once, "featurize", "run.yaml", "-q")
    a, b = (zarr.open_group(str(r / STORE), mode="r") for r in (root, once))
    for m in range(2):
        np.testing.assert_allclose(np.asarray(a[f"train/{m}/features"][:]), np.asarray(b[f"train/{m}/features"][:]),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(a[f"train/{m}/kernel"][:]), np.asarray(b[f"train/{m}/kernel"][:]),
                                   rtol=1e-5, atol=1e-6)


def test_a_crash_while_growing_is_finished_by_the_next_run(tmp_path, monkeypatch, at_once):
    """Arrays resized and the half-filled chunk's flag cleared, the root attributes not yet written: the next run
    with the grown data finishes the append (and keeps the old rows of that chunk)."""
    import trakcli.store.append as append

    root = make(tmp_path, N_OLD, 16)
    ok(root, "featurize", "run.yaml", "-q")
    ok(root, "score", "run.yaml", "-q")
    write_data(root, N_NEW)

    def crash(*a, **k):
        raise OSError("disk went away")

    monkeypatch.setattr(append, "_mark_stale", crash)
    res = run(root, "featurize", "run.yaml", "-q")
    assert res.returncode == 1 and "rerun the same command to finish the append" in msg(res)
    g = zarr.open_group(str(root / STORE), mode="r")
    assert g["train/0/features"].shape[0] == N_NEW and g.attrs["layout"]["n_train"] == N_OLD
    assert "all_done" not in g["train/0/done"].attrs  # dropped before the half-filled chunk's flag was cleared
    monkeypatch.undo()
    ok(root, "featurize", "run.yaml", "-q")
    ok(root, "score", "run.yaml", "-q", "--overwrite")
    np.testing.assert_allclose(scores(root), at_once[16], rtol=1e-5, atol=1e-6)


def test_a_kfac_store_is_not_grown(tmp_path):
    root = make(tmp_path, N_OLD, extra={"curvature": {"kind": "kfac"}, "projector": {"kind": "sjlt", "proj_dim": 16}})
    ok(root, "featurize", "run.yaml", "-q")
    write_data(root, N_NEW)
    res = run(root, "featurize", "run.yaml", "-q")
    assert res.returncode == 1
    assert "whitened by a kfac curvature fitted over all its train rows" in msg(res)
    assert "--overwrite" in msg(res)


def test_a_second_data_file_is_appended(tmp_path, counted, at_once):
    """data.train.path: data.pt, then [data.pt, more.pt]: the rows of more.pt are appended."""
    import yaml

    root = make(tmp_path, N_OLD, 16)
    ok(root, "featurize", "run.yaml", "-q")
    ok(root, "score", "run.yaml", "-q")
    x, y, *_ = rows()
    torch.save({"x_train": x[N_OLD:N_NEW].clone(), "y_train": y[N_OLD:N_NEW].clone()}, root / "more.pt")
    cfg = yaml.safe_load((root / "run.yaml").read_text())
    cfg["data"]["train"]["path"] = ["data.pt", "more.pt"]
    write_config(root / "run.yaml", cfg)
    counted.clear()
    res = ok(root, "featurize", "run.yaml")
    assert "appending 4 train rows to the 40" in msg(res)
    assert sum(counted) == 2 * (N_NEW - N_OLD)
    ok(root, "score", "run.yaml", "-q", "--overwrite")
    np.testing.assert_allclose(scores(root), at_once[16], rtol=1e-5, atol=1e-6)

    # a second file whose rows do not fit the first's: named, nothing changed
    torch.save({"x_train": torch.zeros(3, 5), "y_train": torch.zeros(3, dtype=torch.long)}, root / "more.pt")
    res = run(root, "featurize", "run.yaml", "-q")
    assert res.returncode == 1
    assert "'x_train' has rows of different shapes in the files of the list" in msg(res)
    torch.save({"y_train": torch.zeros(3, dtype=torch.long)}, root / "more.pt")
    res = run(root, "featurize", "run.yaml", "-q")
    assert res.returncode == 1 and "more.pt has no key 'x_train'" in msg(res)


@pytest.mark.slow
def test_torchrun_two_ranks_append_as_one_process(tmp_path):
    """Grown under torchrun: rank 0 grows the store, each rank featurizes its new chunks (rank 0 the half-filled
    old one, keeping its rows); the features and rescored scores are those of one process featurizing all rows."""
    import os
    import subprocess
    import sys

    from projects import free_port

    root = make(tmp_path / "grow", N_OLD, 16)
    ok(root, "featurize", "run.yaml", "-q")
    ok(root, "score", "run.yaml", "-q")
    write_data(root, 64)
    for args in (["featurize", "run.yaml", "-q"], ["score", "run.yaml", "-q", "--overwrite"]):
        res = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(free_port()), "-m", "trakcli.cli.main", *args],
            cwd=root, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert res.returncode == 0, res.stderr[-3000:]
    once = make(tmp_path / "once", 64, 16)
    ok(once, "featurize", "run.yaml", "-q")
    ok(once, "score", "run.yaml", "-q")
    a, b = (zarr.open_group(str(r / STORE), mode="r") for r in (root, once))
    for m in range(2):
        np.testing.assert_allclose(np.asarray(a[f"train/{m}/features"][:]), np.asarray(b[f"train/{m}/features"][:]),
                                   rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scores(root), scores(once), rtol=1e-5, atol=1e-6)


def _lm_project(root: Path, n_train: int) -> Path:
    """A tiny GPT-2 with pre-tokenized language-model rows: the first ``n_train`` of 24 in train.jsonl; top-k scores."""
    pytest.importorskip("transformers")
    from projects import masked_batch, tiny_lm_project

    def lm_rows(n: int, seed: int) -> list[dict]:
        inputs, labels = masked_batch("prompt", n=n, length=10, seed=seed)
        return [{"ids": ids[:int(am.sum())].tolist(), "labels": lab[:int(am.sum())].tolist()}
                for ids, am, lab in zip(inputs["input_ids"], inputs["attention_mask"], labels)]

    return tiny_lm_project(root, lm_rows(24, 1)[:n_train], lm_rows(3, 2), max_length=10, batch_size=8,
                           projector={"kind": "sjlt", "proj_dim": 32, "seed": 0},
                           store={"path": str(STORE), "chunk_rows": 8}, score={"top_k": 5})


def test_lines_appended_to_a_jsonl_file_are_featurized_alone_and_the_top_k_rescored(tmp_path, counted):
    root = _lm_project(tmp_path / "grow", 20)  # 20 rows: chunks of 8, the last half filled
    ok(root, "featurize", "run.yaml", "-q")
    ok(root, "score", "run.yaml", "-q")
    full = _lm_project(tmp_path / "full", 24)
    (root / "train.jsonl").write_bytes((full / "train.jsonl").read_bytes())  # 4 lines appended
    counted.clear()
    ok(root, "featurize", "run.yaml", "-q")
    assert sum(counted) == 4
    res = run(root, "export", str(STORE), "--what", "proponents", "-o", "p.npy")
    assert res.returncode == 1 and "computed over 20 train rows, and the store now holds 24" in msg(res)
    ok(root, "score", "run.yaml", "-q", "--overwrite")
    ok(full, "featurize", "run.yaml", "-q")
    ok(full, "score", "run.yaml", "-q")
    a, b = (zarr.open_group(str(r / STORE), mode="r")["scores/default/top_k"] for r in (root, full))
    np.testing.assert_array_equal(np.asarray(a["proponents"][:]), np.asarray(b["proponents"][:]))
    np.testing.assert_allclose(np.asarray(a["proponent_scores"][:]), np.asarray(b["proponent_scores"][:]),
                               rtol=1e-5, atol=1e-6)

    # a line changed in the middle of the file: refused, naming the fix
    lines = (full / "train.jsonl").read_text().splitlines()
    lines[5] = lines[6]
    (root / "train.jsonl").write_text("\n".join(lines + lines[:2]) + "\n")
    res = run(root, "featurize", "run.yaml", "-q")
    assert res.returncode == 1 and "first 24 rows are not the rows the store was featurized with" in msg(res)


def test_select_refuses_a_list_of_pool_files_naming_the_fix():
    from trakcli.config.schema import DatasetConfig
    from trakcli.errors import ConfigError
    from trakcli.jobs.pool_files import pool_kind

    section = DatasetConfig(path=["a.pt", "b.pt"], inputs="x", labels="y")
    with pytest.raises(ConfigError, match="is a list of 2 files; trak select writes the selected rows"):
        pool_kind(section)
    assert pool_kind(DatasetConfig(path=["a.pt"], inputs="x", labels="y")) == "pt"  # a list of one is that file


@pytest.mark.parametrize("dtype", ["int8", "binary"])
def test_rows_appended_to_a_compressed_store_get_codes_and_its_two_stage_top_k_equals_featurizing_at_once(
        tmp_path, dtype):
    """An int8 or binary store grows its codes and row scales with the features; the two-stage top-k over the
    grown store (K' covering every row: exact) equals the one of a store featurized with every row at once."""
    store = {"path": str(STORE), "chunk_rows": 16, "dtype": dtype}
    root = make(tmp_path / "grown", N_OLD, extra={"store": store})
    ok(root, "featurize", "run.yaml", "-q")
    write_data(root, N_NEW)
    assert "appending 4 train rows to the 40" in msg(ok(root, "featurize", "run.yaml"))
    once = make(tmp_path / "once", N_NEW, extra={"store": store})
    ok(once, "featurize", "run.yaml", "-q")
    a, b = (zarr.open_group(str(r / STORE), mode="r") for r in (root, once))
    for m in range(2):
        for name in ("codes", "scale", "features"):
            assert a[f"train/{m}/{name}"].shape == b[f"train/{m}/{name}"].shape
            np.testing.assert_array_equal(np.asarray(a[f"train/{m}/{name}"][:]), np.asarray(b[f"train/{m}/{name}"][:]))
    top = ("score.top_k=3", f"score.rescore_multiplier={N_NEW}", "score.rerank=scan")  # K' >= n_train: exact
    for r in (root, once):
        ok(r, "score", "run.yaml", "-q", *top)
    for name in ("proponents", "opponents"):
        np.testing.assert_array_equal(
            np.asarray(zarr.open_group(str(root / STORE), mode="r")[f"scores/default/top_k/{name}"][:]),
            np.asarray(zarr.open_group(str(once / STORE), mode="r")[f"scores/default/top_k/{name}"][:]))
