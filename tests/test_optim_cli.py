"""`trak optimize` with the projected optimizer: config validation and checkpoints that featurize consumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from trakcli.cli.main import app
from trakcli.config import load_config
from trakcli.errors import ConfigError


def trak(*args: str):
    return CliRunner().invoke(app, list(args))


def test_shipped_projected_config_validates():
    cfg = load_config("configs/digits_projected.yaml")
    p = cfg.optimize.projection
    assert (p.mode, p.kind, p.rank, p.update_gap, p.on_refresh) == ("per_matrix", "rademacher", 8, 100, "transfer")
    cfg = load_config("configs/digits_projected.yaml", ["optimize.projection.mode=global"])
    assert (cfg.optimize.projection.mode, cfg.optimize.projection.proj_dim) == ("global", 500)


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
