"""`trak optimize` with the projected optimizer: config validation and checkpoints that featurize consumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from trakcli.config.load import load_config
from trakcli.errors import ConfigError
from projects import invoke as trak


def test_shipped_projected_config_validates():
    cfg = load_config("configs/digits_projected.yaml")
    p = cfg.optimize.projection
    assert (p.mode, p.kind, p.rank, p.update_gap, p.on_refresh) == ("per_matrix", "rademacher", 8, 50, "transfer")
    assert (cfg.optimize.optimizer, cfg.optimize.lr, cfg.optimize.n_models) == ("adamw", 3e-3, 10)
    cfg = load_config("configs/digits_projected.yaml", ["optimize.projection.mode=global"])
    assert (cfg.optimize.projection.mode, cfg.optimize.projection.proj_dim) == ("global", 500)


def test_trak_optimize_prints_the_config_with_its_overrides():
    res = trak("optimize", "configs/digits_projected.yaml", "--print-config", "optimize.projection.rank=4")
    assert res.exit_code == 0, res.stderr
    shown = yaml.safe_load(res.stdout)
    assert shown["optimize"]["projection"]["rank"] == 4 and shown["optimize"]["n_models"] == 10
    assert load_config(shown).optimize == load_config("configs/digits_projected.yaml",
                                                      ["optimize.projection.rank=4"]).optimize


def test_projection_config_errors_are_listed_with_their_keys():
    with pytest.raises(ConfigError) as e:
        load_config(
            "configs/digits_projected.yaml",
            ["optimize.projection.mode=global", "optimize.projection.rnk=3", "optimize.projection.on_refresh=drop"],
        )
    msg = str(e.value)
    assert "optimize.projection.rnk: unknown key; did you mean optimize.projection.rank?" in msg
    assert "optimize.projection.on_refresh" in msg
    with pytest.raises(ConfigError, match="mode global needs proj_dim"):
        load_config("configs/digits_projected.yaml", ["optimize.projection.mode=global", "optimize.projection.proj_dim=null"])


def test_trak_optimize_with_projection_writes_checkpoints_featurize_consumes(user_project):
    cfg = yaml.safe_load(Path("run.yaml").read_text())
    cfg["checkpoints"] = "trained/model_*.pt"
    cfg["optimize"] = {
        "n_models": 2, "epochs": 3, "batch_size": 8, "optimizer": "adamw", "lr": 0.01, "out_dir": "trained",
        "metrics": "trained/metrics/metrics.json",
        "projection": {"mode": "per_matrix", "rank": 2, "update_gap": 4, "on_refresh": "transfer"},
    }
    Path("opt.yaml").write_text(yaml.safe_dump(cfg))
    res = trak("optimize", "opt.yaml")
    assert res.exit_code == 0, res.stderr
    assert sorted(p.name for p in Path("trained").glob("model_*.pt")) == ["model_000.pt", "model_001.pt"]
    sd = torch.load("trained/model_000.pt", weights_only=True)
    assert set(sd) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    metrics = json.loads(Path("trained/metrics/metrics.json").read_text())
    rows = metrics["models"]
    assert [r["seed"] for r in rows] == [0, 1]
    # AdamW moments: [8, 6] -> [8, 2] and [3, 8] -> [8, 2] projected, biases 8 + 3 unprojected
    assert rows[0]["optimizer_state_numel"] == 2 * (16 + 16 + 8 + 3)
    assert 0 <= rows[0]["target_accuracy"] <= 1 and rows[0]["final_loss"] > 0
    assert trak("featurize", "opt.yaml", "-q").exit_code == 0
    res = trak("optimize", "opt.yaml", "optimize.projection.mode=global")
    assert res.exit_code == 1 and "mode global needs proj_dim" in res.stderr


class _Killed(Exception):
    pass


def test_training_killed_mid_epoch_resumes_bit_identically(tmp_path):
    from torch import nn

    import dataclasses

    from trakcli.train import Recipe, TensorRows, Trainer

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(50, 6, generator=g), torch.randint(0, 3, (50,), generator=g)
    recipe = Recipe(epochs=3, batch_size=8, lr=0.01, optimizer="adamw", weight_decay=0.01,
                    projection={"mode": "per_matrix", "kind": "rademacher", "implementation": "auto", "rank": 2,
                                "proj_dim": None, "seed": 0, "update_gap": 4, "on_refresh": "transfer", "scale": 1.0})
    every5 = dataclasses.replace(recipe, checkpoint_every=5)

    def fit_classifier(model, recipe, resume_path=None):
        trainer = Trainer(model, TensorRows(x, y), recipe, seed=4)
        trainer.fit(resume_path=resume_path)
        return trainer

    def fresh():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    ref = fit_classifier(fresh(), recipe).model

    def bomb(model: nn.Module) -> nn.Module:
        """The model, dying in the forward pass of step 12 (7 steps per epoch)."""
        calls = [0]

        def hook(module, args):
            calls[0] += 1
            if calls[0] == 12:
                raise _Killed

        model.register_forward_pre_hook(hook)
        return model

    model = fresh()
    state = tmp_path / ".resume" / "model_000.pt"
    with pytest.raises(_Killed):
        fit_classifier(bomb(model), every5, resume_path=state)
    assert torch.load(state, weights_only=True)["lo"] == 24  # saved after step 10 = epoch 1, batch 3
    resumed = fresh()
    stats = fit_classifier(resumed, every5, resume_path=state).metrics()
    assert not state.exists()
    for a, b in zip(ref.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)
    assert stats["final_loss"] > 0
    # a state made with another recipe is refused, naming the difference
    with pytest.raises(_Killed):
        fit_classifier(bomb(fresh()), every5, resume_path=state)
    from trakcli.errors import CheckpointError

    with pytest.raises(CheckpointError, match="differs in: lr"):
        fit_classifier(fresh(), dataclasses.replace(recipe, lr=0.02), resume_path=state)


def test_optimize_finetunes_from_init_checkpoint_on_random_subsets(user_project):
    cfg = yaml.safe_load(Path("run.yaml").read_text())
    cfg["checkpoints"] = "sub/model_*.pt"
    cfg["optimize"] = {
        "n_models": 2, "epochs": 1, "batch_size": 8, "optimizer": "sgd", "lr": 1e-9, "weight_decay": 0.0,
        "out_dir": "sub", "metrics": "sub.json", "init_checkpoint": "ckpts/model_1.pt", "subset_fraction": 0.5,
        "projection": {"mode": "global", "kind": "sjlt", "proj_dim": 4},
    }
    Path("sub.yaml").write_text(yaml.safe_dump(cfg))
    res = trak("optimize", "sub.yaml")
    assert res.exit_code == 0, res.stderr
    init = torch.load("ckpts/model_1.pt", weights_only=True)
    for name in ("sub/model_000.pt", "sub/model_001.pt"):
        sd = torch.load(name, weights_only=True)
        for k, v in init.items():
            torch.testing.assert_close(sd[k], v, atol=1e-6, rtol=0)  # finetuned (lr ~ 0) from the checkpoint
    rows = json.loads(Path("sub.json").read_text())["models"]
    a, b = rows[0]["subset_indices"], rows[1]["subset_indices"]
    assert len(a) == len(b) == 20 and a == sorted(a) and a != b
    res = trak("optimize", "sub.yaml", "optimize.init_checkpoint=missing.pt", "--overwrite")
    assert res.exit_code == 1 and "optimize.init_checkpoint: file 'missing.pt' does not exist" in res.stderr


def test_a_training_override_is_refused_naming_optimize(user_project):
    res = trak("optimize", "run.yaml", "training.init_checkpoint=missing.pt")
    assert res.exit_code == 1
    assert "training: is not a config section; the training recipe is the optimize: section" in " ".join(res.stderr.split())


@pytest.mark.parametrize("raw", [
    {}, {"mode": "global", "proj_dim": 40, "kind": "sjlt"}, {"rank": None}, {"rank": "4", "scale": "1e-3"},
    {"mode": "global", "kind": "noop"}, {"mode": "global"}, {"rank": 0}, {"on_refresh": "drop"}, {"rnk": 2},
    {"seed": -1}, {"update_gap": 1.5}, {"implementation": "cuda"}, {"rank": True}, {"proj_dim": False, "mode": "global"},
    {"kind": "kronecker"}, {"kind": "kronecker", "rank": 3, "update_gap": 5}, {"mode": "global", "kind": "kronecker"},
    {"mode": "global", "kind": "kronecker", "proj_dim": 40}, {"kind": "kronecker", "implementation": "chunked"},
])
def test_the_optimizer_settings_validate_as_the_config_projection_section(raw):
    """The config's optimize.projection is the optimizer's ProjectionSettings: same keys, defaults, checks and words."""
    from trakcli.errors import OptimizerError
    from trakcli.optim.settings import resolve_projection

    base = {"checkpoints": "c/*.pt", "data": {"train": {"builtin": "digits", "split": "train"}}, "store": "s.zarr"}
    try:
        expected = load_config({**base, "optimize": {"out_dir": "o", "projection": raw}}).optimize.projection
    except ConfigError as e:
        with pytest.raises(OptimizerError) as o:
            resolve_projection(raw)
        # the same keys refused (the config adds a did-you-mean to an unknown key)
        said = ["projection" + ln.split("optimize.projection", 1)[1].split(":", 1)[0] + ":"
                for ln in str(e).splitlines() if "optimize.projection" in ln]
        assert said and all(s in str(o.value) for s in said), (str(e), str(o.value))
    else:
        assert resolve_projection(raw) == expected.model_dump()


def test_kronecker_projection_in_the_config_and_the_training_recipe():
    """optimize.projection.kind: kronecker (per_matrix, two-sided) validates and trains; global is refused."""
    from torch import nn

    from trakcli.train import Recipe, TensorRows, Trainer

    cfg = load_config("configs/digits_projected.yaml", ["optimize.projection.kind=kronecker"])
    p = cfg.recipe.projection
    assert (p.kind, p.mode, p.rank) == ("kronecker", "per_matrix", 8)
    with pytest.raises(ConfigError, match="kind kronecker .* no global form; use mode: per_matrix"):
        load_config("configs/digits_projected.yaml",
                    ["optimize.projection.kind=kronecker", "optimize.projection.mode=global"])
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    projection = p.model_copy(update={"rank": 2, "update_gap": 3}).model_dump()
    trainer = Trainer(model, TensorRows(x, y), Recipe(epochs=2, batch_size=8, lr=0.01, optimizer="adamw",
                                                      projection=projection))
    trainer.fit()
    stats = trainer.metrics()
    # AdamW moments: [8, 6] -> [2, 2] and [3, 8] -> [2, 2], biases 8 + 3 unprojected
    assert stats["optimizer_state_numel"] == 2 * (4 + 4 + 8 + 3)
