import os

import numpy as np
import pytest
import torch
import zarr

from projects import trak
from trakcli.errors import TrakError
from trakcli.scoring import (
    DUAL, PRIMAL, dual_gram, dual_scores, gram_matrix, kernel_factor, kernel_form, resolve_lambda, score_block,
    solve_kernel, target_weights, trak_scores,
)


def closed_form(train, q, target, lambdas):
    """The TRAK score (Park et al. 2023, eq. 5 ensembled over checkpoints) with explicit float64 inverses (numpy)."""
    m = len(train)
    acc = 0
    for phi, phi_t, lam in zip(train, target, lambdas):
        phi, phi_t = phi.double().numpy(), phi_t.double().numpy()
        a = np.linalg.inv(phi.T @ phi + lam * np.eye(phi.shape[1]))
        acc = acc + phi_t @ a @ phi.T
    qbar = sum(x.double().numpy() for x in q) / m
    return acc / m * qbar[None, :]


def make(m=3, n=50, n_t=6, p=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    train = [torch.randn(n, p, generator=g) for _ in range(m)]
    q = [torch.rand(n, generator=g) for _ in range(m)]
    target = [torch.randn(n_t, p, generator=g) for _ in range(m)]
    return train, q, target


@pytest.mark.parametrize("lambda_reg", [0.0, 0.5, None])
def test_scores_match_float64_closed_form(lambda_reg):
    train, q, target = make()
    got = trak_scores(train, q, target, lambda_reg=lambda_reg, lambda_rel=0.1)
    lambdas = [resolve_lambda(gram_matrix([t]), len(t), lambda_reg, 0.1) for t in train]
    ref = closed_form(train, q, target, lambdas)
    assert got.dtype == torch.float32 and got.shape == (6, 50)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-6)


def test_default_ridge_relative_to_trace_and_sound_when_proj_dim_exceeds_n_train():
    train, q, target = make(m=2, n=10, p=32)
    gram = gram_matrix([train[0]])
    lam = resolve_lambda(gram, 10, None, 0.1)
    assert lam == pytest.approx(0.1 * float((train[0].double() ** 2).sum(1).mean()))
    with pytest.raises(TrakError, match="not positive definite"):
        kernel_factor(gram, 0.0)  # rank 10 < 32: singular without a ridge
    scores = trak_scores(train, q, target)
    assert torch.isfinite(scores).all()
    ref = closed_form(train, q, target, [resolve_lambda(gram_matrix([t]), len(t), None, 1.0) for t in train])
    np.testing.assert_allclose(scores.numpy(), ref, rtol=1e-4, atol=1e-6)


def test_gram_accumulates_over_chunks_in_float64():
    train, _, _ = make(m=1, n=37, p=5)
    full = gram_matrix([train[0]])
    chunked = gram_matrix(train[0].split(8))
    assert chunked.dtype == torch.float64
    torch.testing.assert_close(full, chunked)


def test_block_scoring_equals_whole():
    train, q, target = make(m=2, n=40, p=8)
    whole = trak_scores(train, q, target, lambda_reg=1.0)
    weights = [target_weights(kernel_factor(gram_matrix([t]), 1.0), tt) for t, tt in zip(train, target)]
    left = score_block(weights, [t[:15] for t in train], [x[:15] for x in q])
    right = score_block(weights, [t[15:] for t in train], [x[15:] for x in q])
    torch.testing.assert_close(torch.cat([left, right], 1), whole)


def max_rel(a, b):
    """max |a - b| / max |b|: relative to the scale of the score matrix (single entries may be ~0)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("lambda_reg, lambda_rel", [(None, 1.0), (None, 0.1), (0.5, 1.0)])
def test_dual_and_primal_solves_give_the_same_scores(lambda_reg, lambda_rel):
    train, q, target = make(m=3, n=30, n_t=7, p=64, seed=3)  # n_train < proj_dim
    assert kernel_form(30, 64) == DUAL and kernel_form(64, 64) == PRIMAL
    dual = trak_scores(train, q, target, lambda_reg, lambda_rel, form=DUAL)
    primal = trak_scores(train, q, target, lambda_reg, lambda_rel, form=PRIMAL)
    assert max_rel(dual, primal) < 1e-6
    torch.testing.assert_close(trak_scores(train, q, target, lambda_reg, lambda_rel), dual, rtol=0, atol=0)
    # both against the float64 closed form with explicit inverses
    lambdas = [resolve_lambda(gram_matrix([t]), len(t), lambda_reg, lambda_rel) for t in train]
    ref = closed_form(train, q, target, lambdas)
    assert max_rel(dual, ref) < 1e-6 and max_rel(primal, ref) < 1e-6


def test_dual_gram_trace_gives_the_same_ridge_and_refuses_a_zero_ridge():
    train, _, _ = make(m=1, n=20, p=1100)
    phi = train[0]
    k = dual_gram(phi, col_chunk=256)  # 5 column blocks, the last one short
    assert k.dtype == torch.float64 and k.shape == (20, 20)
    torch.testing.assert_close(k, phi.double() @ phi.double().T)
    assert resolve_lambda(k, 20, None, 1.0) == pytest.approx(resolve_lambda(gram_matrix([phi]), 20, None, 1.0), rel=1e-12)
    with pytest.raises(TrakError, match=r"not positive definite \(proj_dim 1100\)"):
        solve_kernel(k, 20, 0.0, 1.0, proj_dim=1100)  # as the primal: ΦᵀΦ has rank 20 < 1100


def test_dual_scores_in_blocks_equal_one_block():
    train, _, target = make(m=1, n=25, n_t=9, p=40)
    phi, phi_t = train[0], target[0]
    factor, _ = solve_kernel(dual_gram(phi), 25, None, 1.0, proj_dim=40)
    whole = dual_scores(factor, phi_t, phi)
    blocked = dual_scores(factor, phi_t, phi, target_block=4, col_chunk=7)
    torch.testing.assert_close(blocked, whole, rtol=1e-12, atol=1e-12)
    twice = dual_scores(factor, phi_t, phi, out=whole.clone())
    torch.testing.assert_close(twice, 2 * whole)


def test_trak_score_solves_in_the_dual_when_n_train_below_proj_dim(user_project, monkeypatch):
    """`trak score` on a store with n_train 40 < proj_dim 64: the dual kernel, the primal's scores, reused on reruns."""
    log = user_project / "events.log"
    monkeypatch.setenv("TRAK_EVENT_LOG", str(log))
    trak("featurize", "run.yaml", "projector.proj_dim=64", "-q")
    trak("score", "run.yaml", "projector.proj_dim=64", "-q")
    root = zarr.open_group("out/attrib.zarr", mode="r")
    kernel = root["train/0/kernel"]
    assert kernel.shape == (40, 64) and kernel.attrs["form"] == DUAL and kernel.dtype == np.float32  # (ΦΦᵀ + λI)⁻¹Φ
    assert log.read_text().count("start kernel") == 2
    phi = [torch.from_numpy(np.asarray(root[f"train/{m}/features"][:])) for m in range(2)]
    q = [torch.from_numpy(np.asarray(root[f"train/{m}/out_to_loss"][:])) for m in range(2)]
    phi_t = [torch.from_numpy(np.asarray(root[f"targets/default/{m}/features"][:])) for m in range(2)]
    dual = np.asarray(root["scores/default/scores"][:])
    assert max_rel(dual, trak_scores(phi, q, phi_t, form=PRIMAL)) < 1e-6

    # a rerun recomputes neither kernels nor scores; --overwrite recomputes the scores, not the kernels
    trak("score", "run.yaml", "projector.proj_dim=64", "-q")
    trak("score", "run.yaml", "projector.proj_dim=64", "-q", "--overwrite")
    assert log.read_text().count("start kernel") == 2
    np.testing.assert_array_equal(np.asarray(root["scores/default/scores"][:]), dual)


def test_torchrun_two_ranks_score_in_the_dual_as_one_process(tmp_path):
    """`trak score` under torchrun: ranks split the kernels and the train-column blocks; the store is bit-identical."""
    import shutil
    import subprocess
    import sys

    from projects import assert_same_store, free_port, make_project, run

    one = make_project(tmp_path / "one")
    dual = ["projector.proj_dim=640"]  # n_train 600 < 640: [600, 640] dual kernels; 15 score blocks of 40 columns
    assert run(one, "featurize", "run.yaml", *dual, "-q").returncode == 0
    shutil.copytree(one, tmp_path / "two")
    res = run(one, "score", "run.yaml", *dual, "-q")
    assert res.returncode == 0, res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         "-m", "trakcli.cli.main", "score", "run.yaml", *dual, "-q"],
        cwd=tmp_path / "two", capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    root = zarr.open_group(str(one / "out" / "attrib.zarr"), mode="r")
    assert root["train/1/kernel"].attrs["form"] == DUAL and root["train/1/kernel"].shape == (600, 640)
    assert_same_store(one / "out" / "attrib.zarr", tmp_path / "two" / "out" / "attrib.zarr")


def test_featurize_makes_the_kernels_and_score_only_the_target_side(user_project, monkeypatch):
    """The kernels are made at the end of `trak featurize` with score.lambda_*; score reuses them, another ridge makes its own."""
    log = user_project / "events.log"
    monkeypatch.setenv("TRAK_EVENT_LOG", str(log))
    res = trak("featurize", "run.yaml", "score.lambda_rel=0.5")
    assert "made 2 kernels" in res.stderr
    assert log.read_text().count("start kernel") == 2
    root = zarr.open_group("out/attrib.zarr", mode="r")
    assert [root[f"train/{m}/kernel"].attrs["settings"] for m in range(2)] == [
        {"lambda_reg": None, "lambda_rel": 0.5}] * 2
    before = log.read_text()
    trak("score", "run.yaml", "score.lambda_rel=0.5", "-q")
    assert log.read_text().count("start kernel") == 2 and "start targets" in log.read_text()[len(before):]
    with_featurize_kernels = np.asarray(zarr.open_group("out/attrib.zarr", mode="r")["scores/default/scores"][:])
    # the same scores as kernels made by score itself
    for m in range(2):
        del zarr.open_group("out/attrib.zarr", mode="r+")[f"train/{m}/kernel"]
    trak("score", "run.yaml", "score.lambda_rel=0.5", "-q", "--overwrite")
    assert log.read_text().count("start kernel") == 4
    np.testing.assert_array_equal(
        np.asarray(zarr.open_group("out/attrib.zarr", mode="r")["scores/default/scores"][:]), with_featurize_kernels)
    # a no-op featurize makes nothing; another ridge at score time makes new kernels
    res = trak("featurize", "run.yaml", "score.lambda_rel=0.5")
    assert "nothing to do" in res.stderr and log.read_text().count("start kernel") == 4
    trak("score", "run.yaml", "score.lambda_rel=2.0", "score.experiment=other", "-q")
    assert log.read_text().count("start kernel") == 6
