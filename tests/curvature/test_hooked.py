"""kfac / ekfac from layer hooks (the default projector kind kronecker): the loss's gradient, default layers,
exact scores of every target in one pass against a float64 closed form, query ranks, folded stored features,
kill -9 and torchrun."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from projects import kill_at_line, make_project, run, tiny_model, trak_cmd
from trakcli.curvature import Curvature
from trakcli.curvature.kfac import CurvatureFactors, LayerFactors
from trakcli.gradients.vmap import PerExampleGradients, select_parameters
from trakcli.projectors.kronecker_layers import KroneckerLayer, LayerParam
from trakcli.tasks import LossOutput, resolve_task


def _project(root: Path, n_models: int = 2) -> Path:
    """The tiny project with no projector kind: the curvature picks kronecker."""
    import yaml

    from projects import write_config

    make_project(root, n_models=n_models)
    cfg = yaml.safe_load((root / "run.yaml").read_text())
    cfg["projector"] = {"proj_dim": 32, "seed": 0}
    write_config(root / "run.yaml", cfg)
    return root


def _store(root: Path) -> Path:
    return root / "out" / "attrib.zarr"


def _scores(root: Path, experiment: str = "default") -> np.ndarray:
    return zarr.open_group(str(_store(root)), mode="r")[f"scores/{experiment}/scores"][:]


def _closed_form(root: Path, kind: str, damping: float, output: str = "loss") -> torch.Tensor:
    """float64 (1/M) Σ_m g_m(t)ᵀ (F_m + δ)⁻¹ g_m(z) · mean Q, from whole per-example gradients of the output."""
    data = torch.load(root / "ckpts" / "data.pt")
    total, qs = 0.0, []
    for m in range(2):
        model = tiny_model(hidden=32, seed=m).double()
        names = select_parameters(model, None)
        task = LossOutput(resolve_task("classification")) if output == "loss" else "classification"
        curv = Curvature(model, names, task, kind, damping=damping, fisher="empirical")
        curv.fit(m, lambda: [(data["x_train"].double(), data["y_train"])])
        grads = PerExampleGradients(model, None, task)
        g_z, q = grads(data["x_train"].double(), data["y_train"])
        g_t, _ = grads(data["x_target"].double(), data["y_target"])
        h_t = curv.factors(m).inverse_hvp(g_t)
        total = total + sum(h_t[n].flatten(1) @ g_z[n].flatten(1).T for n in names)
        qs.append(q.double())
    return (total / 2) * torch.stack(qs).mean(0)


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_exact_scores_from_hooks_equal_the_loss_gradients_closed_form(tmp_path, kind):
    """`curvature.kind` alone: the kronecker projector, the loss's gradient on both sides, no Q, every target in
    one hooked pass, equal to a float64 closed form of whole per-example gradients."""
    root = _project(tmp_path / "p", n_models=2)
    args = [f"curvature.kind={kind}", "curvature.fisher=empirical", "curvature.damping=0.05"]
    res = run(root, "featurize", "run.yaml", *args)
    assert res.returncode == 0, res.stderr
    assert "curvature " + kind + ": 4 parameters of linear and convolution layers" in res.stderr, res.stderr
    res = run(root, "score", "run.yaml", *args)
    assert res.returncode == 0, res.stderr
    assert "full rank" in res.stderr, res.stderr
    want = _closed_form(root, kind, 0.05)
    np.testing.assert_allclose(_scores(root), want.numpy(), rtol=1e-3, atol=1e-5 * float(want.abs().max()))


def test_margin_output_keeps_the_out_to_loss_weighting(tmp_path):
    root = _project(tmp_path / "p", n_models=2)
    args = ["curvature.kind=ekfac", "curvature.fisher=empirical", "curvature.damping=0.05", "curvature.output=margin"]
    for cmd in ("featurize", "score"):
        assert run(root, cmd, "run.yaml", "-q", *args).returncode == 0
    want = _closed_form(root, "ekfac", 0.05, output="margin")
    np.testing.assert_allclose(_scores(root), want.numpy(), rtol=1e-3, atol=1e-5 * float(want.abs().max()))
    loss = _project(tmp_path / "l", n_models=2)
    for cmd in ("featurize", "score"):
        assert run(loss, cmd, "run.yaml", "-q", *args[:-1]).returncode == 0
    assert not np.allclose(_scores(loss), _scores(root), rtol=1e-2)


def test_query_rank_full_is_exact_and_a_low_rank_approximates(tmp_path):
    root = _project(tmp_path / "p", n_models=2)
    base = ["curvature.kind=ekfac", "curvature.fisher=empirical"]
    assert run(root, "featurize", "run.yaml", "-q", *base).returncode == 0
    assert run(root, "score", "run.yaml", "-q", *base, "--out", "full.npy").returncode == 0
    # the layers are [32, 7] and [3, 33]: rank 3 keeps the second whole, rank 7 both
    res = run(root, "score", "run.yaml", *base, "curvature.query_rank=7", "score.experiment=r7", "--out", "r7.npy")
    assert res.returncode == 0 and "rank 7" in res.stderr, res.stderr
    res = run(root, "score", "run.yaml", "-q", *base, "curvature.query_rank=1", "score.experiment=r1", "--out", "r1.npy")
    assert res.returncode == 0, res.stderr
    full, r7, r1 = (np.load(root / f) for f in ("full.npy", "r7.npy", "r1.npy"))
    np.testing.assert_allclose(r7, full, rtol=1e-4, atol=1e-5 * np.abs(full).max())
    assert not np.allclose(r1, full, rtol=1e-3)
    assert np.mean([np.corrcoef(a, b)[0, 1] for a, b in zip(r1, full)]) > 0.5


def test_fold_is_the_whitening_when_the_damped_eigenvalues_separate():
    """With Λ + δ = s aᵀ the folded factors (identity projection) give the whitened gradient exactly."""
    torch.manual_seed(0)
    d_out, d_in = 4, 5
    layer = KroneckerLayer("l", "linear", d_out, (LayerParam("l.weight", (d_out, d_in), "weight"),))
    q_out = torch.linalg.qr(torch.randn(d_out, d_out, dtype=torch.float64))[0]
    q_in = torch.linalg.qr(torch.randn(d_in, d_in, dtype=torch.float64))[0]
    eig = torch.rand(d_out, dtype=torch.float64)[:, None] + 0.5
    eig = eig * (torch.rand(d_in, dtype=torch.float64)[None, :] + 0.5)
    factors = CurvatureFactors([layer], [LayerFactors("l", q_out, q_in, eig)], 1e-12)
    curv = Curvature.__new__(Curvature)
    curv._factors, curv._folded, curv.damping = {0: factors}, None, 1e-12
    eye = [(torch.eye(d_out, dtype=torch.float64), torch.eye(d_in, dtype=torch.float64))]
    w_out_t, w_in_t = curv.fold(eye, 0)[0]
    g = torch.randn(3, d_out, d_in, dtype=torch.float64)
    folded = w_out_t.T @ g @ w_in_t  # (P_out W_out) G (P_in W_in)ᵀ
    whitened = factors.whiten({"l.weight": g})["l.weight"]
    torch.testing.assert_close(folded, whitened)


def test_stored_features_keep_the_curvature(tmp_path):
    """`curvature.exact: false` scores the folded kronecker features: near the exact scores of the same damping
    (the fold itself is exact where it can be, test above; what remains is the projection's error)."""
    root = _project(tmp_path / "p", n_models=2)
    base = ["curvature.kind=ekfac", "curvature.fisher=empirical", "projector.proj_dim=323",  # every grid entry
            "curvature.damping=0.1", "curvature.feature_damping=0.1"]
    assert run(root, "featurize", "run.yaml", "-q", *base).returncode == 0
    assert run(root, "score", "run.yaml", "-q", *base, "--out", "exact.npy").returncode == 0
    res = run(root, "score", "run.yaml", "-q", *base, "curvature.exact=false", "score.experiment=stored",
              "--out", "stored.npy")
    assert res.returncode == 0, res.stderr
    exact, stored = np.load(root / "exact.npy"), np.load(root / "stored.npy")
    corr = np.mean([np.corrcoef(a, b)[0, 1] for a, b in zip(exact, stored)])
    assert corr > 0.75, corr  # 0.86 measured


def test_fit_rows_fits_on_a_sample_and_counts_it(tmp_path):
    root = _project(tmp_path / "p", n_models=1)
    res = run(root, "featurize", "run.yaml", "curvature.kind=ekfac", "curvature.fit_rows=100")
    assert res.returncode == 0, res.stderr
    assert "over 100 train rows (a sample of 600" in res.stderr, res.stderr
    res = run(root, "featurize", "run.yaml", "curvature.kind=ekfac")  # another fit: another store identity
    assert res.returncode == 1 and "fit_rows" in res.stderr and "--overwrite" in res.stderr, res.stderr


@pytest.mark.slow
def test_exact_top_k_killed_mid_pass_resumes_to_the_same_top_k_and_two_ranks_give_it(tmp_path):
    from projects import free_port

    one = _project(tmp_path / "one", n_models=2)
    for name in ("two", "three"):
        shutil.copytree(one, tmp_path / name)
    two, three = tmp_path / "two", tmp_path / "three"
    base = ["curvature.kind=ekfac", "score.top_k=5"]
    for root in (one, two, three):
        assert run(root, "featurize", "run.yaml", "-q", *base).returncode == 0
    assert run(one, "score", "run.yaml", "-q", *base).returncode == 0
    log = tmp_path / "events.log"
    kill_at_line(two, ["score", "run.yaml", "-q", *base], log, "done top-k segment 2")
    assert "done top-k segment 2" in log.read_text() and "done top-k segment 7" not in log.read_text()
    log.unlink()
    res = subprocess.run(trak_cmd("score", "run.yaml", "-q", *base), cwd=two,
                         env={**os.environ, "TRAK_EVENT_LOG": str(log)}, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "segment 0" not in log.read_text()  # the finished segments were kept
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "trakcli.cli.main", "score", "run.yaml", "-q", *base],
        cwd=three, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    want = zarr.open_group(str(_store(one)), mode="r")["scores/default/top_k"]
    for root in (two, three):
        got = zarr.open_group(str(_store(root)), mode="r")["scores/default/top_k"]
        for side in ("proponents", "opponents"):
            np.testing.assert_array_equal(got[side][:], want[side][:])
            np.testing.assert_allclose(got[f"{side[:-1]}_scores"][:], want[f"{side[:-1]}_scores"][:], rtol=1e-5)


def test_two_stage_exact_top_k_rescoring_candidates_of_the_stored_features(tmp_path):
    """`score.rescore_multiplier` with exact scores: candidates from the stored features, re-scored exactly; the
    top-k equals the one-pass exact top-k where the candidates hold it, and the recall is estimated and recorded."""
    root = _project(tmp_path / "p", n_models=2)
    base = ["curvature.kind=ekfac", "score.top_k=5", "projector.proj_dim=64"]
    assert run(root, "featurize", "run.yaml", "-q", *base).returncode == 0
    assert run(root, "score", "run.yaml", "-q", *base).returncode == 0
    res = run(root, "score", "run.yaml", *base, "score.rescore_multiplier=8", "score.experiment=two")
    assert res.returncode == 0, res.stderr
    assert "two-stage exact top-5" in res.stderr and "estimated recall" in res.stderr, res.stderr
    g = zarr.open_group(str(_store(root)), mode="r")
    one, two = g["scores/default/top_k"], g["scores/two/top_k"]
    info = two["proponents"].attrs["exact_two_stage"]
    assert info["candidates"] == 40 and 0.0 <= info["recall"]["proponents"] <= 1.0
    got, want = two["proponents"][:], one["proponents"][:]
    same = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(got, want)])
    assert abs(same - info["recall"]["proponents"]) < 0.1, (same, info)  # the estimate is near the true recall
    hit = np.all(got == want, axis=1)  # where the candidates hold the exact top-k, it is the same, same order
    np.testing.assert_allclose(two["proponent_scores"][:][hit], one["proponent_scores"][:][hit], rtol=1e-4)
    assert hit.mean() > 0.5


def test_low_rank_queries_are_near_the_truncated_svd_also_when_randomized():
    """A rank far below the layer's smaller side takes the randomized SVD: its error is that of the truncated SVD."""
    from trakcli.curvature.influence import precondition_layer

    torch.manual_seed(0)
    d_out, d_in, n = 64, 80, 3
    layer = KroneckerLayer("l", "linear", d_out, (LayerParam("l.weight", (d_out, d_in), "weight"),))
    q_out = torch.linalg.qr(torch.randn(d_out, d_out))[0]
    q_in = torch.linalg.qr(torch.randn(d_in, d_in))[0]
    eig = torch.rand(d_out, d_in) + 0.1
    factors = CurvatureFactors([layer], [LayerFactors("l", q_out, q_in, eig)], 1e-3)
    g = torch.randn(n, d_out, 5) @ torch.randn(n, 5, d_in) + 0.01 * torch.randn(n, d_out, d_in)
    full, _, _, _ = precondition_layer(layer, factors, 0, g, None)
    h = full.reshape(n, d_out, d_in).double()
    for rank in (2, 30):  # 2: randomized (2 + 10 < 64 // 4); 30: the full SVD
        _, left, right, r = precondition_layer(layer, factors, 0, g, rank)
        assert r == rank
        approx = torch.einsum("oqr,iqr->qoi", left.reshape(d_out, n, r), right.reshape(d_in, n, r)).double()
        s = torch.linalg.svdvals(h)
        best = s[:, rank:].square().sum(1).sqrt()
        err = (h - approx).flatten(1).norm(dim=1)
        assert torch.all(err <= 1.05 * best + 1e-6), (err, best)
