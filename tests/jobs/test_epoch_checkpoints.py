"""`optimize.epoch_checkpoints`: checkpoints along training, listed in the manifest and featurized in order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from projects import invoke as trak
from trakcli.config import load_config
from trakcli.jobs.inputs import resolve_checkpoints, resolve_optimizer_states
from trakcli.errors import ConfigError
from trakcli.models import file_sha256
from trakcli.store import Store


def project(name: str = "opt.yaml", **recipe) -> None:
    """The user_project config training 2 models for 3 epochs into trained/ (checkpoints: its manifest)."""
    cfg = yaml.safe_load(Path("run.yaml").read_text())
    cfg["checkpoints"] = "trained/manifest.json"
    cfg["num_threads"] = 1
    cfg["optimize"] = {"optimizer": "adamw", "lr": 0.01, "n_models": 2, "epochs": 3, "batch_size": 8, "seed": 5,
                       "out_dir": "trained", **recipe}
    Path(name).write_text(yaml.safe_dump(cfg, sort_keys=False))


def manifest() -> dict:
    return json.loads(Path("trained/manifest.json").read_text())


def weights(path: str | Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_epoch_checkpoints_are_listed_after_each_other_and_featurized_in_that_order(user_project):
    project(epoch_checkpoints=True, save_optimizer_state=True)
    res = trak("optimize", "opt.yaml", "-q")
    assert res.exit_code == 0, res.stderr
    for model in manifest()["models"]:
        i = model["model_id"]
        assert [e["epoch"] for e in model["epoch_checkpoints"]] == [1, 2]  # the last epoch is the final checkpoint
        for e in model["epoch_checkpoints"]:
            assert e["checkpoint"] == f"model_{i:03d}_epoch{e['epoch']}.pt"
            assert e["sha256"] == file_sha256(Path("trained") / e["checkpoint"])
            assert e["optimizer_state"] == f"optimizer_state/{e['checkpoint']}"
    cfg = load_config("opt.yaml")
    names = ["model_000_epoch1.pt", "model_000_epoch2.pt", "model_000.pt",
             "model_001_epoch1.pt", "model_001_epoch2.pt", "model_001.pt"]
    assert resolve_checkpoints(cfg) == [Path("trained") / n for n in names]
    states = resolve_optimizer_states(cfg, resolve_checkpoints(cfg))
    assert states == [Path("trained/optimizer_state") / n for n in names] and all(p.is_file() for p in states)
    # a step of AdamW later, each epoch's state holds more steps than the one before
    steps = [int(weights(p)["state_dict"]["state"][0]["step"]) for p in states[:3]]
    assert steps[0] > 0 and steps == [steps[0], 2 * steps[0], 3 * steps[0]]

    # the epoch 1 checkpoint is the model a 1-epoch run of the same recipe writes (constant learning rate)
    project("one.yaml", epochs=1, out_dir="one")
    assert trak("optimize", "one.yaml", "-q").exit_code == 0
    first, one = weights("trained/model_001_epoch1.pt"), weights("one/model_001.pt")
    assert all(torch.equal(first[k], one[k]) for k in one)
    final = weights("trained/model_001.pt")
    assert not all(torch.equal(first[k], final[k]) for k in final)

    # featurize numbers the checkpoints in that order: model_id 3 is model 1's epoch 1
    res = trak("featurize", "opt.yaml", "-q")
    assert res.exit_code == 0, res.stderr
    store = Store.open_existing(cfg.store.path, mode="r")
    assert store.model_ids() == list(range(len(names)))
    load = yaml.safe_load(Path("opt.yaml").read_text())
    load["checkpoints"] = [f"trained/{n}" for n in names[:3]] + ["one/model_001.pt"]  # model_id 3, as above
    load["store"] = "alone.zarr"
    Path("alone.yaml").write_text(yaml.safe_dump(load, sort_keys=False))
    assert trak("featurize", "alone.yaml", "-q").exit_code == 0
    alone = Store.open_existing(Path("alone.zarr"), mode="r")
    assert torch.equal(torch.as_tensor(store.read("train/3/features")), torch.as_tensor(alone.read("train/3/features")))


def test_reruns_train_a_model_again_only_when_its_epoch_checkpoints_are_missing(user_project):
    project()
    assert trak("optimize", "opt.yaml", "-q").exit_code == 0
    before = manifest()["models"]
    assert all("epoch_checkpoints" not in m for m in before) and len(resolve_checkpoints(load_config("opt.yaml"))) == 2
    # asked for now: the models are trained again (the same bytes), their epoch checkpoints written
    res = trak("optimize", "opt.yaml", "optimize.epoch_checkpoints=true")
    assert res.exit_code == 0, res.stderr
    assert res.stderr.count("epoch checkpoints (optimize.epoch_checkpoints) are missing or changed") == 2
    after = manifest()["models"]
    assert [m["sha256"] for m in after] == [m["sha256"] for m in before]
    assert all(len(m["epoch_checkpoints"]) == 2 for m in after)
    # a rerun keeps them all
    res = trak("optimize", "opt.yaml", "optimize.epoch_checkpoints=true")
    assert res.exit_code == 0, res.stderr
    assert res.stderr.count("exists, kept") == 2 and manifest()["models"] == after
    # one changed epoch checkpoint: featurize names it; optimize trains that model again
    good = Path("trained/model_001_epoch2.pt").read_bytes()
    torch.save({k: v + 1 for k, v in weights("trained/model_001_epoch2.pt").items()}, "trained/model_001_epoch2.pt")
    res = trak("featurize", "opt.yaml", "optimize.epoch_checkpoints=true")
    assert res.exit_code == 1
    assert "checkpoint 'trained/model_001_epoch2.pt' (model 1, epoch 2) changed since trak optimize" in res.stderr
    res = trak("optimize", "opt.yaml", "optimize.epoch_checkpoints=true")
    assert res.exit_code == 0, res.stderr
    assert "model 1: its epoch checkpoints" in res.stderr and "trained/model_000.pt exists, kept" in res.stderr
    assert Path("trained/model_001_epoch2.pt").read_bytes() == good
    # not asked for any more: the manifest lists the final checkpoints only (the files stay)
    assert trak("optimize", "opt.yaml", "-q").exit_code == 0
    assert manifest()["models"] == before
    assert len(resolve_checkpoints(load_config("opt.yaml"))) == 2 and Path("trained/model_001_epoch2.pt").exists()


def test_a_damaged_epoch_entry_and_a_training_function_are_refused(user_project):
    project(epoch_checkpoints=True)
    assert trak("optimize", "opt.yaml", "-q").exit_code == 0
    text = Path("trained/manifest.json").read_text()
    Path("trained/manifest.json").write_text(text.replace('"epoch": 1', '"epoch": "one"'))
    with pytest.raises(ConfigError, match="is damaged .* epoch_checkpoints of epoch, checkpoint and sha256"):
        resolve_checkpoints(load_config("opt.yaml"))
    Path("my_train.py").write_text("def fit(model, inputs, labels, seed=0):\n    return model\n")
    res = trak("optimize", "opt.yaml", "optimize.entrypoint=my_train.py:fit", "optimize.out_dir=other")
    assert res.exit_code == 1
    assert "optimize.epoch_checkpoints: the built-in recipe writes them, but optimize.entrypoint" in res.stderr
    assert not Path("other").exists() or not any(Path("other").iterdir())
