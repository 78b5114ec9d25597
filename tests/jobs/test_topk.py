"""`score.top_k`: the streamed top proponents and opponents per target, `score.normalize: unit`, `--targets`,
JSONL answers; against the full matrix, under kills and torchrun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import zarr

from projects import N_TRAIN, assert_same_store, free_port, kill_at, make_project, run
from trakcli.topk import segments

K = 7


def _read(store, exp="default"):
    root = zarr.open_group(str(store), mode="r")
    g = root[f"scores/{exp}"]
    top = {name: np.asarray(g[f"top_k/{name}"][:]) for name in
           ("proponents", "proponent_scores", "opponents", "opponent_scores")} if "top_k" in g else None
    full = np.asarray(g["scores"][:]) if "scores" in g else None
    return top, full, root


def _check_against_full(top, full, k=K):
    """Top-k indices and scores equal those of the full matrix (best first, equal scores by train index)."""
    for side, sign in (("proponent", -1), ("opponent", 1)):
        order = np.argsort(sign * full, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(top[f"{side}s"], order)
        np.testing.assert_allclose(top[f"{side}_scores"], np.take_along_axis(full, order, 1), rtol=1e-6, atol=0)


@pytest.fixture(scope="module")
def featurized(tmp_path_factory):
    root = make_project(tmp_path_factory.mktemp("topk") / "p")
    for dims in ([], ["projector.proj_dim=640"]):  # primal (32 < n_train 600) and dual (640 > 600)
        res = run(root, "featurize", "run.yaml", "-q", *dims, f"store.path=out/{'dual' if dims else 'primal'}.zarr")
        assert res.returncode == 0, res.stderr
    return root


@pytest.mark.parametrize("form", ["primal", "dual"])
@pytest.mark.parametrize("models", [1, 3])
def test_top_k_equals_the_full_matrix(featurized, form, models):
    dims = ["projector.proj_dim=640"] if form == "dual" else []
    store = f"out/{form}.zarr" if models == 3 else f"out/{form}_one.zarr"
    args = ["run.yaml", "-q", *dims, f"store.path={store}", f"score.experiment=k{models}"]
    if models == 1:  # a store of one checkpoint
        args.append("checkpoints=ckpts/model_0.pt")
        assert run(featurized, "featurize", *args).returncode == 0
    res = run(featurized, "score", *args, f"score.top_k={K}")
    assert res.returncode == 0, res.stderr
    top, full, _ = _read(featurized / store, f"k{models}")
    assert full is None and top["proponents"].shape == (90, K) and top["proponents"].dtype == np.int64
    # the same experiment with the full matrix as well: computed beside the top-k, which is unchanged
    res = run(featurized, "score", *args, f"score.top_k={K}", "score.full=true")
    assert res.returncode == 0, res.stderr
    top2, full, root = _read(featurized / store, f"k{models}")
    assert full.shape == (90, N_TRAIN)
    _check_against_full(top, full)
    for name in top:
        np.testing.assert_array_equal(top[name], top2[name])
    assert "top_k_parts" not in root[f"scores/k{models}"]  # the parts are dropped once merged


def test_segments_cover_the_rows_in_whole_chunks():
    for n, c in ((600, 40), (1, 512), (1_000_000, 512), (513, 512), (10_000, 7)):
        segs = segments(n, c)
        assert segs[0][0] == 0 and segs[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(segs, segs[1:]))
        assert all(lo % c == 0 for lo, _ in segs)
    assert len(segments(600, 40)) == 8 and len(segments(1_000_000, 512)) == 8


def test_kill_during_top_k_then_rerun_gives_identical_arrays(tmp_path):
    one = make_project(tmp_path / "one")
    assert run(one, "featurize", "run.yaml", "-q").returncode == 0
    shutil.copytree(one, tmp_path / "two")
    assert run(one, "score", "run.yaml", "-q", f"score.top_k={K}").returncode == 0
    two = tmp_path / "two"
    log = tmp_path / "events.log"
    # 9 target chunks (3 checkpoints x 3), then 8 top-k segments: kill inside the segments, twice
    for n in (11, 15):
        assert kill_at(two, ["score", "run.yaml", "-q", f"score.top_k={K}"], log, n)
    assert "start top-k segment" in log.read_text()
    res = run(two, "score", "run.yaml", "-q", f"score.top_k={K}")
    assert res.returncode == 0, res.stderr
    assert_same_store(one / "out" / "attrib.zarr", two / "out" / "attrib.zarr")


def test_torchrun_two_ranks_write_the_top_k_of_one_process(tmp_path):
    one = make_project(tmp_path / "one")
    assert run(one, "featurize", "run.yaml", "-q").returncode == 0
    shutil.copytree(one, tmp_path / "two")
    assert run(one, "score", "run.yaml", "-q", f"score.top_k={K}").returncode == 0
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         "-m", "trakcli.cli.main", "score", "run.yaml", "-q", f"score.top_k={K}"],
        cwd=tmp_path / "two", capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_store(one / "out" / "attrib.zarr", tmp_path / "two" / "out" / "attrib.zarr")


def _closed_form_cosines(root, exp, models, lam_rel=1.0):
    """(1/M) Σ_m cos(A_m^½ φ_m(t), A_m^½ φ_m(z)) with A_m = (ΦᵀΦ + λI)⁻¹ formed explicitly, in float64."""
    total = 0
    for m in range(models):
        phi = torch.from_numpy(np.asarray(root[f"train/{m}/features"][:])).double()
        phi_t = torch.from_numpy(np.asarray(root[f"targets/{exp}/{m}/features"][:])).double()
        lam = lam_rel * phi.square().sum() / phi.shape[0]
        a = torch.linalg.inv(phi.T @ phi + lam * torch.eye(phi.shape[1], dtype=torch.float64))
        cross = phi_t @ a @ phi.T
        nt = (phi_t @ a * phi_t).sum(1).sqrt()
        nz = (phi @ a * phi).sum(1).sqrt()
        total = total + cross / nt[:, None] / nz[None, :]
    return (total / models).numpy()


@pytest.mark.parametrize("form", ["primal", "dual"])
def test_normalize_unit_equals_its_closed_form(featurized, form):
    dims = ["projector.proj_dim=640"] if form == "dual" else []
    exp = f"unit_{form}"
    args = ["run.yaml", "-q", *dims, f"store.path=out/{form}.zarr", f"score.experiment={exp}", "score.normalize=unit"]
    res = run(featurized, "score", *args, f"score.top_k={K}", "score.full=true")
    assert res.returncode == 0, res.stderr
    top, full, root = _read(featurized / f"out/{form}.zarr", exp)
    want = _closed_form_cosines(root, exp, 3)
    np.testing.assert_allclose(full, want, rtol=0, atol=2e-5)
    assert np.abs(full).max() <= 1 + 1e-5
    _check_against_full(top, full)
    # the same experiment name under TRAK's scores is another setting: refused, naming the way out
    res = run(featurized, "score", "run.yaml", "-q", *dims, f"store.path=out/{form}.zarr", f"score.experiment={exp}")
    assert res.returncode != 0 and "normalize" in res.stderr and "--overwrite" in res.stderr


def test_targets_file_and_jsonl_answers(featurized):
    root = featurized
    data = torch.load(root / "ckpts" / "data.pt")
    torch.save({"x_target": data["x_target"][:5], "y_target": data["y_target"][:5]}, root / "queries.pt")
    res = run(root, "score", "run.yaml", "-q", "store.path=out/primal.zarr", "--targets", "queries.pt",
              f"score.top_k={K}", "--out", "answers.jsonl")
    assert res.returncode == 0, res.stderr
    top, _, _ = _read(root / "out/primal.zarr", "queries")  # the experiment is named after the file
    lines = [json.loads(line) for line in (root / "answers.jsonl").read_text().splitlines()]
    assert len(lines) == 5 and [x["target"] for x in lines] == list(range(5))
    assert [p["train"] for p in lines[2]["proponents"]] == top["proponents"][2].tolist()
    assert [o["score"] for o in lines[4]["opponents"]] == pytest.approx(top["opponent_scores"][4].tolist())
    # the queries are the first 5 targets: their top-k is the full run's
    res = run(root, "score", "run.yaml", "-q", "store.path=out/primal.zarr", f"score.top_k={K}",
              "score.experiment=all")
    assert res.returncode == 0, res.stderr
    every, _, _ = _read(root / "out/primal.zarr", "all")
    np.testing.assert_array_equal(every["proponents"][:5], top["proponents"])
    # the table shows top-k results without a full matrix
    res = run(root, "score", "run.yaml", "store.path=out/primal.zarr", f"score.top_k={K}", "score.experiment=all")
    assert res.returncode == 0 and f"top {K} [90, {K}]" in res.stderr and "proponents" in res.stderr
    # a .npy needs the full matrix
    res = run(root, "score", "run.yaml", "-q", "store.path=out/primal.zarr", f"score.top_k={K}", "--out", "s.npy")
    assert res.returncode == 2 and "score.full=true" in res.stderr
    res = run(root, "score", "run.yaml", "-q", "--targets", "nope.pt")
    assert res.returncode == 2 and "nope.pt" in res.stderr
    # without a top-k, the answers are the score.show_top best of each full row
    res = run(root, "score", "run.yaml", "-q", "store.path=out/primal.zarr", "score.experiment=dense",
              "score.show_top=3", "--out", "dense.jsonl")
    assert res.returncode == 0, res.stderr
    _, full, _ = _read(root / "out/primal.zarr", "dense")
    lines = [json.loads(line) for line in (root / "dense.jsonl").read_text().splitlines()]
    assert len(lines) == full.shape[0]
    for t in (0, full.shape[0] - 1):
        best = np.argsort(-full[t], kind="stable")[:3]
        assert [p["train"] for p in lines[t]["proponents"]] == best.tolist()
        assert [p["score"] for p in lines[t]["proponents"]] == pytest.approx(full[t, best].tolist())


def test_top_k_larger_than_n_train_keeps_every_row(user_project):
    from projects import trak

    trak("featurize", "run.yaml", "-q")
    trak("score", "run.yaml", "-q", "score.top_k=100", "score.full=true")  # n_train 40
    top, full, _ = _read(user_project / "out" / "attrib.zarr")
    assert top["proponents"].shape == (7, 40)
    _check_against_full(top, full, 40)
    np.testing.assert_array_equal(np.sort(top["proponents"], 1), np.tile(np.arange(40), (7, 1)))


def test_nothing_to_compute_is_refused(user_project):
    res = run(user_project, "score", "run.yaml", "score.full=false")
    assert res.returncode == 1 and "score.top_k" in res.stderr and "nothing to compute" in res.stderr


def test_inspect_export_and_eval_know_the_top_k(featurized):
    root = featurized
    args = ["run.yaml", "-q", "store.path=out/primal.zarr", "score.experiment=shown", f"score.top_k={K}"]
    assert run(root, "score", *args).returncode == 0
    res = run(root, "inspect", "out/primal.zarr", "--verify")
    assert res.returncode == 0 and f"scores/shown: top-k [90, {K}]" in res.stderr, res.stderr
    res = run(root, "export", "out/primal.zarr", "--what", "opponents", "-e", "shown", "--out", "opp.npy")
    assert res.returncode == 0, res.stderr
    top, _, _ = _read(root / "out/primal.zarr", "shown")
    np.testing.assert_array_equal(np.load(root / "opp.npy"), top["opponents"])
    from trakcli.errors import StoreError
    from trakcli.store import Store

    with pytest.raises(StoreError, match="only its top-k.*score.full=true"):  # what `trak eval lds` reads
        Store.open_existing(root / "out/primal.zarr", mode="r").read_scores("shown")


def test_the_shown_top_of_a_top_k_run_is_the_full_matrix_runs(featurized):
    """--json and the table read a top-k run's stored arrays; they show what ranking the full rows shows."""
    args = ["run.yaml", "store.path=out/primal.zarr", "score.show_targets=4", "score.show_top=5", "--json"]
    full = run(featurized, "score", *args, "score.experiment=shown_full")
    top = run(featurized, "score", *args, "score.experiment=shown_top", "score.top_k=20")
    assert full.returncode == 0 and top.returncode == 0, full.stderr + top.stderr
    a, b = json.loads(full.stdout)["top"], json.loads(top.stdout)["top"]
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        for side in ("proponents", "opponents"):
            assert [e["train"] for e in x[side]] == [e["train"] for e in y[side]] and len(x[side]) <= 5
            np.testing.assert_allclose([e["score"] for e in x[side]], [e["score"] for e in y[side]], rtol=1e-5)
            assert all((e["score"] > 0) == (side == "proponents") for e in y[side])
