"""`trak eval sweep`: the grid's LDS values agree with `trak score` + `trak eval lds` and with
in-memory TRAK scores of the sweep's own stores; the CLI writes JSON and a picture."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from trakcli.config import load_config
from trakcli.errors import StoreMismatchError
from trakcli.evaluation import sweep as sw
from trakcli.evaluation.retrain import load_or_retrain
from trakcli.jobs.score import score
from trakcli.evaluation.lds import lds
from trakcli.scoring import PRIMAL, trak_scores
from trakcli.store import Store
from projects import invoke as trak


@pytest.fixture
def sweep_project(user_project: Path) -> Path:
    """The user_project config with a training recipe and a small eval section."""
    cfg = yaml.safe_load((user_project / "run.yaml").read_text())
    cfg["optimize"] = {"n_models": 2, "epochs": 2, "batch_size": 8, "lr": 0.1, "out_dir": "trained"}
    cfg["eval"] = {"n_subsets": 6, "bootstrap": 100, "sweep": {"proj_dims": [8, 32], "lambda_rel": [0.1, 10.0]}}
    cfg["num_threads"] = 1
    (user_project / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return user_project / "run.yaml"


def _row(rows, **key):
    found = [r for r in rows if all(r[k] == v for k, v in key.items())]
    assert len(found) == 1, (key, found)
    return found[0]


def test_sweep_grid_matches_score_and_lds(sweep_project):
    cfg = load_config(sweep_project)
    res = sw.sweep(cfg)
    # the config's own proj_dim (16) and lambda_rel (1.0) join the grid; ensembles 1 and all (2)
    assert {r["proj_dim"] for r in res.rows} == {8, 16, 32}
    assert {r["lambda_rel"] for r in res.rows} == {0.1, 1.0, 10.0}
    assert {r["n_checkpoints"] for r in res.rows} == {1, 2}
    assert len(res.rows) == 3 * 3 * 2
    assert res.best["lds"] == max(r["lds"] for r in res.rows)
    assert (res.default["proj_dim"], res.default["n_checkpoints"], res.default["lambda_rel"]) == (16, 2, 1.0)
    assert res.n_subsets == 6 and res.n_train == 40 and res.n_target == 7

    masks, outputs = load_or_retrain(cfg)  # from the store now: no retraining
    # the default point is what `trak score` + `trak eval lds` give for the config
    stored = score(cfg).scores
    expect = lds(stored, masks, outputs, n_bootstrap=100, seed=cfg.eval.seed)
    assert res.default["lds"] == pytest.approx(expect.lds, abs=1e-6)

    # another proj_dim, one checkpoint, another ridge: in-memory TRAK scores of the sweep store's features
    store = Store.open_existing(res.stores[8], mode="r")
    phi = [torch.from_numpy(np.asarray(store.array("train/0/features")[:]))]
    q = [torch.from_numpy(np.asarray(store.array("train/0/out_to_loss")[:]))]
    phi_t = [torch.from_numpy(np.asarray(store.array("targets/default/0/features")[:]))]
    scores8 = trak_scores(phi, q, phi_t, lambda_rel=10.0).numpy()
    row = _row(res.rows, proj_dim=8, n_checkpoints=1, lambda_rel=10.0)
    assert row["lds"] == pytest.approx(lds(scores8, masks, outputs, n_bootstrap=0).lds, abs=1e-6)
    assert row["ci_low"] <= row["lds"] <= row["ci_high"]
    assert Path(res.stores[8]).parent == Path("out/attrib.sweep")
    assert res.stores[16] == "out/attrib.zarr"  # the config's own proj_dim uses its own store

    # a rerun reuses the retrained models and the features: the same grid
    again = sw.sweep(cfg)
    assert again.rows == res.rows


def test_checkpoint_grid():
    assert sw.checkpoint_grid(10, None) == [1, 2, 5, 10]
    assert sw.checkpoint_grid(3, None) == [1, 2, 3]
    assert sw.checkpoint_grid(1, None) == [1]
    assert sw.checkpoint_grid(10, [4, 2, 4]) == [2, 4]
    with pytest.raises(Exception, match="exceed the 10 checkpoints"):
        sw.checkpoint_grid(10, [12])


def test_sweep_cli_writes_json_and_plot(sweep_project):
    r = trak("eval", "sweep", sweep_project, "--proj-dims", "8", "--lambda-rel", "1", "--checkpoints", "2",
             "--plot", "sweep.png", "--out", "sweep.json", "--json", "-q")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data == json.loads(Path("sweep.json").read_text())
    assert {(row["proj_dim"], row["n_checkpoints"], row["lambda_rel"]) for row in data["rows"]} == {(8, 2, 1.0), (16, 2, 1.0)}
    assert data["gap_default_to_best"] == pytest.approx(data["best"]["lds"] - data["default"]["lds"])
    assert Path("sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--proj-dims", "8,x"], 2, "comma-separated ints"),
        (["--lambda-rel", "0"], 2, "values > 0"),
        (["--plot", "nodir/s.png"], 2, "does not exist"),
        (["--out", "s.txt"], 2, "expected a .json"),
        (["--checkpoints", "5"], 1, "exceed the 2 checkpoints"),
    ],
)
def test_sweep_cli_bad_flags(sweep_project, args, code, message):
    r = trak("eval", "sweep", sweep_project, *args)
    assert r.exit_code == code, r.output
    assert message in " ".join(r.stderr.split())


def test_sweep_redoes_its_own_stale_stores_but_never_the_users(sweep_project):
    cfg = load_config(sweep_project, ["eval.sweep.proj_dims=[8]", "eval.sweep.lambda_rel=[1.0]"])
    first = sw.sweep(cfg)
    # another projector seed, a new main store, the same sweep directory: its proj_dim-8 store is stale
    other = load_config(sweep_project, ["eval.sweep.proj_dims=[8]", "eval.sweep.lambda_rel=[1.0]", "projector.seed=1",
                                        "store.path=out2/attrib.zarr", "eval.sweep.dir=out/attrib.sweep"])
    res = sw.sweep(other)
    assert res.stores[8] == first.stores[8]
    assert Store.open_existing(res.stores[8], mode="r").identity["projector"]["seed"] == 1
    # the user's own store (the config's proj_dim) is not the sweep's to redo
    mismatched = load_config(sweep_project, ["eval.sweep.proj_dims=[8]", "projector.seed=2"])
    with pytest.raises(StoreMismatchError):
        sw.sweep(mismatched)



def test_sweep_in_the_dual_gives_what_score_gives(sweep_project):
    # proj_dim 64 > n_train 40: the sweep and `trak score` both solve the [n_train, n_train] dual system
    cfg = load_config(sweep_project, ["projector.proj_dim=64", "eval.sweep.proj_dims=[64]"])
    res = sw.sweep(cfg)
    masks, outputs = load_or_retrain(cfg)
    expect = lds(score(cfg).scores, masks, outputs, n_bootstrap=100, seed=cfg.eval.seed)
    assert res.default["lds"] == pytest.approx(expect.lds, abs=1e-6)
    store = Store.open_existing(cfg.store.path, mode="r")
    phi = [torch.from_numpy(np.asarray(store.array(f"train/{m}/features")[:])) for m in range(2)]
    q = [torch.from_numpy(np.asarray(store.array(f"train/{m}/out_to_loss")[:])) for m in range(2)]
    phi_t = [torch.from_numpy(np.asarray(store.array(f"targets/default/{m}/features")[:])) for m in range(2)]
    primal = trak_scores(phi[:1], q[:1], phi_t[:1], lambda_rel=10.0, form=PRIMAL).numpy()
    row = _row(res.rows, proj_dim=64, n_checkpoints=1, lambda_rel=10.0)
    assert row["lds"] == pytest.approx(lds(primal, masks, outputs, n_bootstrap=0).lds, abs=1e-6)

def test_kronecker_sweep_refuses_a_too_wide_proj_dim_before_retraining(sweep_project):
    # the tiny model's two Linear layers hold (6+1)*8 + (8+1)*3 = 83 entries: no Kronecker features wider than that
    r = trak("eval", "sweep", sweep_project, "projector.kind=kronecker", "--proj-dims", "8,100")
    assert r.exit_code == 1, r.output
    assert "eval.sweep.proj_dims: 100 cannot be used with projector kind kronecker" in " ".join(r.stderr.split())
    assert "Traceback" not in r.output
    assert not Path("out/attrib.zarr").exists()  # nothing retrained, nothing featurized
