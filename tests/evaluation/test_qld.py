"""`trak eval qld`: the plan of models, the query losses, and a run on digits end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import yaml

from projects import run, tiny_model, write_config
from trakcli.config import load_config
from trakcli.data.load import load_dataset
from trakcli.evaluation.qld import plan, query_losses


def _digits_config(root: Path) -> Path:
    cfg = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "digits.yaml").read_text())
    cfg["checkpoints"] = "ckpts/manifest.json"
    cfg["store"]["path"] = "attrib.zarr"
    cfg["optimize"].update({"n_models": 1, "epochs": 4, "out_dir": "ckpts"})
    cfg["eval"] = {"qld": {"queries": 4, "fraction": 0.01}, "bootstrap": 200}
    cfg["num_threads"] = 1
    return write_config(root / "digits.yaml", cfg)


def test_plan_leaves_out_each_querys_top_rows_and_as_many_random_ones(tmp_path):
    cfg = load_config(_digits_config(tmp_path), ["eval.qld.seeds=2"])
    scores = np.random.default_rng(0).normal(size=(30, 200)).astype(np.float32)
    p = plan(cfg, scores)
    assert len(p.queries) == 4 and len(set(p.queries)) == 4 and p.queries == sorted(p.queries)
    assert len(p.drop) == 2 * (1 + 2 * 4)
    for (kind, s, qi), drop, seed in zip(p.kinds, p.drop, p.seeds):
        assert seed == p.seeds[p.kinds.index(("all", s, -1))]  # the three models of a query share the seed
        if kind == "all":
            assert drop.size == 0
        elif kind == "top":
            assert set(drop) == set(np.argsort(-scores[p.queries[qi]])[:2])  # round(0.01 * 200) = 2
        else:
            assert drop.size == 2 and len(set(drop)) == 2
    assert plan(cfg, scores).queries == p.queries  # a pure function of the config


def test_query_losses_are_the_summed_cross_entropy_of_each_row(user_project):
    cfg = load_config(user_project / "run.yaml")
    target = load_dataset(cfg.data.target, key="data.target")
    model = tiny_model(seed=0)
    got = query_losses(model, target, [0, 3], "classification", "cpu")
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(model(target.inputs[[0, 3]]).double(), target.labels[[0, 3]],
                                                 reduction="none")
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-7)  # float32 logits


def test_qld_on_digits_end_to_end(tmp_path):
    config = _digits_config(tmp_path)
    for cmd in ("optimize", "featurize", "score"):
        res = run(tmp_path, cmd, config.name, "-q")
        assert res.returncode == 0, res.stderr
    res = run(tmp_path, "eval", "qld", config.name, "--workers", "2", "--out", "qld.json")
    assert res.returncode == 0, res.stderr
    assert "top minus random" in res.stderr
    data = json.loads((tmp_path / "qld.json").read_text())
    assert data["n_dropped"] == 14 and data["n_queries"] == 4 and len(data["per_query"]["top"]) == 4
    # leaving out a query's top proponents raises its loss more than leaving out random rows
    assert data["qld_top"]["mean"] > data["qld_random"]["mean"]
    res = run(tmp_path, "eval", "qld", config.name, "eval.qld.queries=1000")
    assert res.returncode == 1 and "eval.qld.queries is 1000 but data.target has 360 rows" in res.stderr
