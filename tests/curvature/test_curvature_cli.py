"""`curvature.kind: kfac / ekfac` through `trak featurize` and `trak score`: the stored scores, resume, errors."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from projects import arrays, assert_same_store, kill_at_line, make_project, run, tiny_model, trak_cmd
from trakcli.curvature import Curvature
from trakcli.gradients.vmap import PerExampleGradients, select_parameters


def _store(root: Path) -> Path:
    return root / "out" / "attrib.zarr"


@pytest.mark.parametrize("kind, exact", [("kfac", True), ("ekfac", True), ("ekfac", False)])
def test_scores_are_the_mean_whitened_inner_products_times_q(user_project, kind, exact):
    """With whole per-example gradients (projector kind noop) and TRAK's margin, exact scores (damping) and scores of
    the stored noop features (feature_damping) are the same closed form."""
    damping = ["curvature.damping=0.05", "curvature.feature_damping=0.3"] if exact else \
        ["curvature.damping=0.3", "curvature.feature_damping=0.05", "curvature.exact=false"]
    args = ["projector.kind=noop", f"curvature.kind={kind}", "curvature.fisher=empirical", "curvature.output=margin",
            *damping]
    for cmd in ("featurize", "score"):
        res = run(user_project, cmd, "run.yaml", "-q", *args)
        assert res.returncode == 0, res.stderr
    data = torch.load(user_project / "ckpts" / "data.pt")
    total, qs = 0.0, []
    for m in range(2):
        model = tiny_model(seed=m)
        names = select_parameters(model, None)
        curv = Curvature(model, names, "classification", kind, damping=0.05, fisher="empirical")
        curv.fit(m, lambda: [(data["x_train"], data["y_train"])])
        grads = PerExampleGradients(model, None, "classification")
        g_z, q = grads(data["x_train"], data["y_train"])
        g_t, _ = grads(data["x_target"], data["y_target"])
        w_z, w_t = curv.whiten(g_z, m), curv.whiten(g_t, m)
        total = total + sum(w_t[n].flatten(1).double() @ w_z[n].flatten(1).double().T for n in names)
        qs.append(q.double())
    want = (total / 2) * torch.stack(qs).mean(0)
    got = zarr.open_group(str(_store(user_project)), mode="r")["scores/default/scores"][:]
    np.testing.assert_allclose(got, want.numpy(), rtol=2e-4, atol=1e-6 * float(want.abs().max()))
    stored = arrays(_store(user_project))
    assert "train/0/curvature/0/eig" in stored and not any(k.endswith("/kernel") for k in stored)


def test_killed_in_the_eigenvalue_pass_resumes_from_the_stored_covariances(tmp_path):
    one = make_project(tmp_path / "one", n_models=2)
    shutil.copytree(one, tmp_path / "two")
    two = tmp_path / "two"
    args = ["featurize", "run.yaml", "-q", "projector.kind=sjlt", "curvature.kind=ekfac"]
    assert run(one, *args).returncode == 0
    log = tmp_path / "events.log"
    kill_at_line(two, args, log, "start curvature-eigenvalues 1")
    assert "start curvature-eigenvalues 1" in log.read_text()
    assert "done featurize 1" not in log.read_text()
    log.unlink()
    res = subprocess.run(trak_cmd(*args), cwd=two, env={**os.environ, "TRAK_EVENT_LOG": str(log)},
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    rerun = log.read_text()
    assert "start curvature-covariances 1" not in rerun and "start curvature-eigenvalues 1" in rerun
    assert "curvature 0" not in rerun  # model 0's features and curvature were finished
    assert_same_store(_store(one), _store(two))


def test_another_feature_damping_or_damping_is_refused_naming_overwrite(user_project):
    base = ["projector.kind=sjlt", "projector.proj_dim=32", "curvature.kind=ekfac"]
    assert run(user_project, "featurize", "run.yaml", "-q", *base).returncode == 0
    res = run(user_project, "featurize", "run.yaml", "-q", *base, "curvature.feature_damping=0.5")
    assert res.returncode == 1
    assert "feature_damping" in res.stderr and "--overwrite" in res.stderr
    assert run(user_project, "score", "run.yaml", "-q", *base).returncode == 0
    res = run(user_project, "score", "run.yaml", "-q", *base, "curvature.damping=0.5")  # the scores' own setting
    assert res.returncode == 1 and "--overwrite" in res.stderr, res.stderr
    assert run(user_project, "score", "run.yaml", "-q", *base, "curvature.damping=0.5", "--overwrite").returncode == 0


@pytest.mark.parametrize("args, message", [
    (["curvature.kind=ekfac", "projector.kind=kronecker", "curvature.refine.iterations=2"], "projector.kind kronecker never forms"),
    (["curvature=shampoo"], "curvature.kind"),
    (["curvature.kind=kfac", "curvature.damping=0"], "curvature.damping"),
])
def test_bad_curvature_settings_are_one_clear_error(user_project, args, message):
    res = run(user_project, "featurize", "run.yaml", *args)
    assert res.returncode == 1 and message in res.stderr, res.stderr
    assert not _store(user_project).exists()


def test_parameters_outside_layers_are_left_out_by_default_and_named_when_selected(tmp_path):
    from projects import write_config
    import yaml

    root = make_project(tmp_path / "p", n_models=1)
    cfg = yaml.safe_load((root / "run.yaml").read_text())
    cfg["model"] = {"entrypoint": "norm_model.py:make_model"}
    (root / "norm_model.py").write_text(
        "from torch import nn\n"
        "def make_model():\n"
        "    return nn.Sequential(nn.Linear(6, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 3))\n")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.LayerNorm(32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    torch.save(model.state_dict(), root / "ckpts" / "model_0.pt")
    write_config(root / "run.yaml", cfg)
    res = run(root, "featurize", "run.yaml", "curvature.kind=ekfac", "store.path=out/default.zarr")
    assert res.returncode == 0, res.stderr  # grad_wrt unset: the layers it factors, the norm named in one line
    assert "left out: 2 parameters (LayerNorm)" in res.stderr, res.stderr
    res = run(root, "featurize", "run.yaml", "curvature.kind=ekfac", "grad_wrt=['*']")
    assert res.returncode == 1
    assert "1.weight (LayerNorm)" in res.stderr and "grad_wrt" in res.stderr, res.stderr
    assert not _store(root).exists()
    res = run(root, "featurize", "run.yaml", "-q", "curvature.kind=ekfac", "grad_wrt=['0.*','3.*']")
    assert res.returncode == 0, res.stderr


def test_torchrun_two_ranks_fit_and_featurize_the_store_of_one_process(tmp_path):
    import sys

    from projects import free_port

    one = make_project(tmp_path / "one", n_models=2)
    shutil.copytree(one, tmp_path / "two")
    args = ["featurize", "run.yaml", "-q", "projector.kind=sjlt", "curvature.kind=ekfac"]
    assert run(one, *args).returncode == 0
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "trakcli.cli.main", *args],
        cwd=tmp_path / "two", capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_store(_store(one), _store(tmp_path / "two"))
    for root in (one, tmp_path / "two"):
        assert run(root, "score", "run.yaml", "-q", "projector.kind=sjlt", "curvature.kind=ekfac").returncode == 0
    assert_same_store(_store(one), _store(tmp_path / "two"))


def test_exact_scores_give_the_top_k_and_the_refinement_changes_them(user_project):
    base = ["projector.kind=sjlt", "projector.proj_dim=32", "curvature.kind=ekfac"]
    assert run(user_project, "featurize", "run.yaml", "-q", *base).returncode == 0
    assert run(user_project, "score", "run.yaml", "-q", *base, "--out", "full.npy").returncode == 0
    full = np.load(user_project / "full.npy")
    res = run(user_project, "score", "run.yaml", "-q", *base, "score.top_k=5", "score.experiment=top")
    assert res.returncode == 0, res.stderr
    top = zarr.open_group(str(_store(user_project)), mode="r")["scores/top/top_k/proponents"][:]
    np.testing.assert_array_equal(top, np.argsort(-full, axis=1, kind="stable")[:, :5])
    res = run(user_project, "score", "run.yaml", "-q", *base, "curvature.refine.iterations=3",
              "curvature.refine.samples=16", "score.experiment=refined", "--out", "refined.npy")
    assert res.returncode == 0, res.stderr
    refined = np.load(user_project / "refined.npy")
    assert refined.shape == full.shape and np.isfinite(refined).all() and not np.allclose(refined, full, rtol=1e-3)
    corr = np.mean([np.corrcoef(a, b)[0, 1] for a, b in zip(refined, full)])
    assert corr > 0.5  # a refinement of the same solve, not another ranking


def test_cosines_need_the_stored_features_and_sweep_refuses_curvature_each_one_clear_error(user_project):
    base = ["projector.kind=sjlt", "projector.proj_dim=32", "curvature.kind=ekfac"]
    assert run(user_project, "featurize", "run.yaml", "-q", *base).returncode == 0
    res = run(user_project, "score", "run.yaml", *base, "score.normalize=unit")
    assert res.returncode == 1 and "curvature.exact: false" in res.stderr, res.stderr
    assert "scores" not in zarr.open_group(str(_store(user_project)), mode="r")  # nothing written, nothing lost
    res = run(user_project, "score", "run.yaml", *base, "score.normalize=unit", "curvature.exact=false",
              "score.show_targets=1")
    assert res.returncode == 0, res.stderr
    assert "EK-FAC scores, experiment 'default'" in res.stderr and "TRAK scores" not in res.stderr
    res = run(user_project, "eval", "sweep", "run.yaml", *base)
    assert res.returncode == 1 and "curvature.kind ekfac has no kernel" in res.stderr, res.stderr
