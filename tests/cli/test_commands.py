"""The CLI end to end, as a user runs it: exit codes, stderr messages, the store."""

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
import zarr
from typer.testing import CliRunner

from trakcli.cli.main import app
from trakcli.config import load_config
from trakcli.data import load_dataset
from trakcli.gradients.vmap import PerExampleGradients
from trakcli.models import build_model, load_checkpoint
from trakcli.projectors import make_projector
from trakcli.scoring import trak_scores
from projects import invoke as trak

runner = CliRunner()


def reference_scores(cfg_path):
    """Scores computed in memory from the same pieces, without the store."""
    cfg = load_config(cfg_path)
    train = load_dataset(cfg.data.train)
    target = load_dataset(cfg.data.target)
    model = build_model(cfg.model.entrypoint, **cfg.model.kwargs)
    pg = PerExampleGradients(model, cfg.grad_wrt)
    proj = make_projector(**cfg.projector.options(), grad_dim=pg.grad_dim)
    feats, qs, tfeats = [], [], []
    for mid, ck in enumerate(sorted(Path("ckpts").glob("model_*.pt"))):
        load_checkpoint(model, ck)
        g, q = pg(train.inputs, train.labels)
        feats.append(proj.project(g, model_id=mid))
        qs.append(q)
        gt, _ = pg(target.inputs, target.labels)
        tfeats.append(proj.project(gt, model_id=mid))
    return trak_scores(feats, qs, tfeats, cfg.score.lambda_reg, cfg.score.lambda_rel).numpy()


def test_user_model_featurize_then_score_exports_float32_matrix(user_project):
    res = trak("featurize", "run.yaml")
    assert res.exit_code == 0, res.stderr
    assert "featurized 2 checkpoints x 40 train rows" in res.stderr
    res = trak("score", "run.yaml", "--out", "scores.npy")
    assert res.exit_code == 0, res.stderr
    assert "proponents" in res.stderr and "opponents" in res.stderr
    scores = np.load("scores.npy")
    assert scores.dtype == np.float32 and scores.shape == (7, 40)
    np.testing.assert_allclose(scores, reference_scores("run.yaml"), rtol=2e-4, atol=1e-6)
    # the store holds the same scores, in the layout of docs/guides/store.md
    root = zarr.open_group("out/attrib.zarr", mode="r")
    np.testing.assert_array_equal(np.asarray(root["scores/default/scores"][:]), scores)
    assert root["train/0/features"].shape == (40, 16)
    assert root["train/1/out_to_loss"].shape == (40,)
    assert np.asarray(root["train/0/done"][:]).tolist() == [1, 1, 1]
    assert root["targets/default/1/features"].shape == (7, 16)
    assert root.attrs["config"]["projector"]["proj_dim"] == 16
    assert len(root["train/0"].attrs["sha256"]) == 64
    # csv export holds the same numbers
    assert trak("score", "run.yaml", "--out", "scores.csv", "--quiet").exit_code == 0
    np.testing.assert_allclose(np.loadtxt("scores.csv", delimiter=","), scores, rtol=1e-6)


def test_rerun_is_a_noop_and_resume_recomputes_only_missing_chunks(user_project):
    assert trak("featurize", "run.yaml").exit_code == 0
    root = zarr.open_group("out/attrib.zarr", mode="r+")
    before = np.asarray(root["train/1/features"][:])
    res = trak("featurize", "run.yaml")
    assert res.exit_code == 0 and "nothing to do" in res.stderr
    # simulate a run killed inside chunk 1 of model 1: rows zeroed, flag not set
    root["train/1/done"][1] = 0
    root["train/1/features"][16:32] = np.zeros((16, 16), np.float32)
    res = trak("featurize", "run.yaml", "data.batch_size=5")  # resuming with another batch size works
    assert res.exit_code == 0, res.stderr
    assert "computed 1/6 chunks" in res.stderr
    np.testing.assert_allclose(np.asarray(root["train/1/features"][:]), before, rtol=1e-5, atol=1e-6)


def test_store_made_with_other_settings_refuses_and_names_keys(user_project):
    assert trak("featurize", "run.yaml").exit_code == 0
    res = trak("featurize", "run.yaml", "projector.seed=1", "projector.proj_dim=8")
    assert res.exit_code == 1
    assert "projector.seed: store has 0, this run has 1" in res.stderr
    assert "projector.proj_dim: store has 16, this run has 8" in res.stderr
    assert "--overwrite" in res.stderr
    # nothing was lost: the old features are intact
    assert zarr.open_group("out/attrib.zarr", mode="r")["train/0/features"].shape == (40, 16)
    res = trak("featurize", "run.yaml", "projector.seed=1", "projector.proj_dim=8", "--overwrite")
    assert res.exit_code == 0, res.stderr
    assert zarr.open_group("out/attrib.zarr", mode="r")["train/0/features"].shape == (40, 8)


def test_changed_checkpoint_is_refused(user_project):
    assert trak("featurize", "run.yaml").exit_code == 0
    from projects import tiny_model

    torch.save(tiny_model(seed=7).state_dict(), "ckpts/model_1.pt")
    res = trak("featurize", "run.yaml")
    assert res.exit_code == 1
    assert "model_id 1" in res.stderr and "sha256" in res.stderr
    res = trak("score", "run.yaml")
    assert res.exit_code == 1 and "model_id 1" in res.stderr


def test_score_needs_featurize_first(user_project):
    res = trak("score", "run.yaml")
    assert res.exit_code == 1
    assert "run `trak featurize CONFIG` first" in res.stderr


def test_score_settings_change_refuses_then_overwrite_recomputes(user_project):
    assert trak("featurize", "run.yaml", "-q").exit_code == 0
    assert trak("score", "run.yaml", "-q", "--out", "a.npy").exit_code == 0
    res = trak("score", "run.yaml", "score.lambda_reg=0.5")
    assert res.exit_code == 1 and "lambda_reg: store has None, this run has 0.5" in res.stderr
    res = trak("score", "run.yaml", "score.lambda_reg=0.5", "score.experiment=lam", "-q", "--out", "b.npy")
    assert res.exit_code == 0, res.stderr
    assert not np.allclose(np.load("a.npy"), np.load("b.npy"))
    res = trak("score", "run.yaml", "score.lambda_reg=0.5", "--overwrite", "-q", "--out", "c.npy")
    assert res.exit_code == 0, res.stderr
    np.testing.assert_allclose(np.load("b.npy"), np.load("c.npy"), rtol=1e-6)


def test_print_config_shows_resolved_overrides(user_project):
    res = trak("featurize", "run.yaml", "projector.proj_dim=512", "--print-config")
    assert res.exit_code == 0
    cfg = yaml.safe_load(res.stdout)
    assert cfg["projector"]["proj_dim"] == 512 and cfg["data"]["batch_size"] == 8
    assert cfg["store"] == {"path": "out/attrib.zarr", "storage_options": {}, "chunk_rows": 16, "save_every_s": 30.0,
                            "dtype": "float32", "compressor": "zstd"}
    assert not Path("out").exists()


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["score", "run.yaml", "--out", "s.txt"], 2, "--out s.txt: unknown format '.txt'; use a .npy, .csv or .jsonl path"),
        (["score", "run.yaml", "--out", "nodir/s.npy"], 2, "directory nodir does not exist"),
        (["featurize", "nope.yaml"], 1, "config file 'nope.yaml' does not exist"),
        (["featurize", "run.yaml", "projector.proj_dim=0"], 1, "projector.proj_dim: Input should be greater than 0"),
        (["featurize", "run.yaml", "checkpoints=none/*.pt"], 1, "checkpoints: no file matches 'none/*.pt'"),
        (["featurize", "run.yaml", "model.entrypoint=my_model.py:nope"], 1, "has no function 'nope'"),
        (["featurize", "run.yaml", "data.train.labels=x_train"], 1, "labels 'x_train' must be 1-D class indices"),
        (["featurize", "run.yaml", "model.kwargs.in_dim=5"], 1, "does not fit the model"),
        (["featurize", "run.yaml", "grad_wrt=[enc.*]"], 1, "pattern 'enc.*' matches no parameter"),
        (["featurize", "run.yaml", "--no-such-flag"], 2, "No such option"),
        (["featurize", "run.yaml", "projector.proj_dim=2.5"], 1, "projector.proj_dim: Input should be a valid integer"),
        (["featurize", "run.yaml", "data.train.inputs=x_empty", "data.train.labels=y_empty"], 1,
         "x_empty] is empty (shape [0, 6]); it needs at least one row"),
        (["featurize", "run.yaml", "data.train.labels=y_target"], 1,
         "40 inputs but 7 labels; 'x_train' and 'y_target' must have the same number of rows"),
        (["featurize", "run.yaml", "data.train.inputs=x_wide"], 1, "the model cannot take inputs of shape [5] per example"),
        (["score", "run.yaml", "data.target.inputs=x_wide", "data.target.labels=y_train"], 1,
         "data.target inputs have shape [5] (float32) per example but the train inputs have [6] (float32)"),
    ],
)
def test_bad_input_exit_codes_and_messages(user_project, args, code, message):
    data = torch.load("ckpts/data.pt")
    data.update(x_empty=torch.zeros(0, 6), y_empty=torch.zeros(0, dtype=torch.long), x_wide=torch.randn(40, 5))
    torch.save(data, "ckpts/data.pt")
    if args[0] == "score":
        assert trak("featurize", "run.yaml", "-q").exit_code == 0
    res = trak(*args)
    assert res.exit_code == code, res.output
    assert message in " ".join(res.stderr.split()), res.stderr
    assert "Traceback" not in res.stderr


def test_labels_out_of_range_keep_what_was_written(user_project):
    data = torch.load("ckpts/data.pt")
    data["y_bad"] = data["y_train"].clone()
    data["y_bad"][30] = 7
    torch.save(data, "ckpts/data.pt")
    res = trak("featurize", "run.yaml", "data.train.labels=y_bad")
    assert res.exit_code == 1
    assert "the model has 3 classes but examples [30] have labels [7]" in res.stderr
    # the first chunk (rows 0-15) of model 0 was written and stays done
    root = zarr.open_group("out/attrib.zarr", mode="r")
    assert np.asarray(root["train/0/done"][:]).tolist() == [1, 0, 0]


def test_optimize_writes_checkpoints_that_featurize_consumes(user_project):
    cfg = yaml.safe_load(Path("run.yaml").read_text())
    cfg["checkpoints"] = "trained/model_*.pt"
    cfg["optimize"] = {"n_models": 2, "epochs": 2, "batch_size": 16, "lr": 0.1, "out_dir": "trained"}
    Path("opt.yaml").write_text(yaml.safe_dump(cfg))
    res = trak("optimize", "opt.yaml")
    assert res.exit_code == 0, res.stderr
    assert sorted(p.name for p in Path("trained").iterdir()) == ["manifest.json", "model_000.pt", "model_001.pt"]
    a = torch.load("trained/model_000.pt")
    b = torch.load("trained/model_001.pt")
    assert not torch.equal(a["0.weight"], b["0.weight"])  # independently seeded
    res = trak("optimize", "opt.yaml")
    assert "exists, kept" in res.stderr
    assert trak("featurize", "opt.yaml", "-q").exit_code == 0


def test_optimize_without_section_is_a_config_error(user_project):
    res = trak("optimize", "run.yaml")
    assert res.exit_code == 1 and "optimize: section missing" in res.stderr
    res = trak("eval", "lds", "run.yaml")  # retraining: the built-in recipe or the user's own training
    assert res.exit_code == 1 and "optimize: section missing" in res.stderr and "optimize: {entrypoint:" in " ".join(
        res.stderr.split()), res.stderr


@pytest.mark.parametrize("kind", ["rademacher", "sjlt"])
def test_nonfinite_inputs_are_reported_by_example_index(user_project, kind):
    data = torch.load("ckpts/data.pt")
    data["x_train"][21, 2] = float("inf")
    torch.save(data, "ckpts/data.pt")
    res = trak("featurize", "run.yaml", f"projector.kind={kind}")
    assert res.exit_code == 1
    assert "non-finite gradients for examples [21]" in res.stderr
    root = zarr.open_group("out/attrib.zarr", mode="r")
    assert np.asarray(root["train/0/done"][:]).tolist() == [1, 0, 0]  # chunk 0 kept


def test_the_default_kind_is_sjlt_and_a_rademacher_store_names_the_change(user_project):
    """A config without projector.kind gets sjlt; a store featurized with the old default says how to keep it."""
    cfg = yaml.safe_load(Path("run.yaml").read_text())
    assert load_config(Path("run.yaml"), overrides=[]).projector.kind == "rademacher"  # the fixture pins it
    del cfg["projector"]["kind"]
    Path("default.yaml").write_text(yaml.safe_dump(cfg))
    assert load_config(Path("default.yaml"), overrides=[]).projector.kind == "sjlt"
    runner = CliRunner()
    assert runner.invoke(app, ["featurize", "run.yaml", "-q"]).exit_code == 0  # store made with rademacher
    res = runner.invoke(app, ["featurize", "default.yaml", "-q"])
    assert res.exit_code != 0
    assert "projector.kind" in res.stderr and "set projector.kind: rademacher to go on with this store" in res.stderr
    assert runner.invoke(app, ["featurize", "default.yaml", "-q", "projector.kind=rademacher"]).exit_code == 0


def test_proj_dim_above_grad_dim_gets_a_note(user_project):
    res = trak("featurize", "run.yaml", "projector.proj_dim=128")  # the tiny MLP has grad_dim 83
    note = ("projector.proj_dim 128 exceeds grad_dim 83: the features are a random embedding of the gradients into "
            "more dimensions, which adds nothing; set projector.kind: noop (the gradients themselves) or "
            "projector.proj_dim <= 83")
    assert note in " ".join(res.stderr.split())
    res = trak("featurize", "run.yaml", "projector.proj_dim=16", "store.path=out/small.zarr")
    assert "exceeds grad_dim" not in res.stderr
