"""Issue 16 items 4-6: checkpoints of wrapped models, the store's named dimensions, CLI conveniences, packaging."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from conftest import tiny_model, write_config
from trakcli.cli.main import app
from trakcli.errors import CheckpointError
from trakcli.models.checkpoints import load_checkpoint, read_state_dict

runner = CliRunner()


def trak(*args):
    return runner.invoke(app, [str(a) for a in args])


# --- checkpoints ------------------------------------------------------------------------------------


def test_whole_model_pickle_says_to_save_the_state_dict(tmp_path):
    path = tmp_path / "whole.pt"
    torch.save(tiny_model(), path)
    with pytest.raises(CheckpointError, match=r"torch\.save\(model\.state_dict\(\), PATH\)") as e:
        read_state_dict(path)
    assert "whole model" in str(e.value) and "Traceback" not in str(e.value)


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "_orig_mod.module."])
def test_wrapper_prefixes_are_stripped(tmp_path, prefix):
    src = tiny_model(seed=3)
    path = tmp_path / "wrapped.pt"
    torch.save({prefix + k: v for k, v in src.state_dict().items()}, path)
    model = tiny_model(seed=0)
    stripped = load_checkpoint(model, path)
    assert "".join(stripped) == prefix
    for a, b in zip(model.state_dict().values(), src.state_dict().values()):
        assert torch.equal(a, b)


def test_plain_state_dict_strips_nothing(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save(tiny_model(seed=1).state_dict(), path)
    assert load_checkpoint(tiny_model(), path) == []


def test_featurize_reports_a_stripped_prefix_once(user_project):
    for ck in sorted(Path("ckpts").glob("model_*.pt")):
        sd = torch.load(ck, weights_only=True)
        torch.save({"module." + k: v for k, v in sd.items()}, ck)
    res = trak("featurize", "run.yaml")
    assert res.exit_code == 0, res.stderr
    assert res.stderr.count("stripped the key prefix 'module.'") == 1


def test_a_first_batch_error_leaves_no_store(user_project):
    cfg = yaml.safe_load(Path("run.yaml").read_text())
    cfg["model"]["kwargs"] = {"in_dim": 5}  # the data has 6 features
    write_config(Path("bad.yaml"), cfg)
    res = trak("featurize", "bad.yaml")
    assert res.exit_code == 1
    assert not Path("out/attrib.zarr").exists()
    res = trak("featurize", "run.yaml")  # the fixed config needs no --overwrite
    assert res.exit_code == 0, res.stderr


# --- the store in the ecosystem ------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Failed to open Zarr store with consolidated metadata")
def test_xarray_opens_the_store_with_named_dimensions(user_project):
    xarray = pytest.importorskip("xarray")
    assert trak("featurize", "run.yaml", "-q").exit_code == 0
    assert trak("score", "run.yaml", "-q").exit_code == 0
    ds = xarray.open_zarr("out/attrib.zarr", group="train/0")  # as the issue asks
    assert ds["features"].dims == ("train", "proj") and ds["features"].shape == (40, 16)
    assert ds["out_to_loss"].dims == ("train",) and ds["done"].dims == ("chunk",)
    scores = xarray.open_zarr("out/attrib.zarr", group="scores/default", consolidated=False)["scores"]
    assert scores.dims == ("target", "train") and scores.shape == (7, 40)
    targets = xarray.open_zarr("out/attrib.zarr", group="targets/default/0", consolidated=False)
    assert targets["features"].dims == ("target", "proj")
