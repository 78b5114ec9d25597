"""`projector: {kind: kronecker}` end to end: config, featurize, score, inspect, resume, torchrun.

The reference is :class:`trakcli.gradients.KroneckerFeaturizer` called directly
on the whole training set (its own agreement with vmap per-example gradients
is tests/gradients/test_kronecker.py's); the store-robustness helpers (kills, torchrun,
store comparison) are tests/projects.py's.
"""

from __future__ import annotations

import re

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from torch import nn

from trakcli.config import load_config
from trakcli.data import load_dataset
from trakcli.gradients import KroneckerFeaturizer
from trakcli.jobs.setup import prepare
from trakcli.models import build_model, load_checkpoint
from trakcli.scoring import trak_scores
from projects import assert_same_store, free_port, kill_at, make_project, run
from projects import invoke as trak

KRON = ("projector.kind=kronecker",)

LN_MODEL = '''
from torch import nn

def make_model(in_dim=6, hidden=8, num_classes=3):
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.LayerNorm(hidden), nn.Tanh(), nn.Linear(hidden, num_classes))
'''


def direct(overrides=()):
    """Train/target features and out_to_loss of KroneckerFeaturizer called on whole datasets, per checkpoint."""
    cfg = load_config("run.yaml", [*KRON, *overrides])
    model = build_model(cfg.model.entrypoint, **cfg.model.kwargs)
    train, target = load_dataset(cfg.data.train), load_dataset(cfg.data.target)
    feat = KroneckerFeaturizer(model, proj_dim=cfg.projector.proj_dim, seed=cfg.projector.seed, grad_wrt=cfg.grad_wrt)
    phis, qs, tphis = [], [], []
    for mid, ck in enumerate(sorted(Path("ckpts").glob("model_*.pt"))):
        load_checkpoint(model, ck)
        phi, q = feat(train.inputs, train.labels, model_id=mid)
        phis.append(phi)
        qs.append(q)
        tphis.append(feat(target.inputs, target.labels, model_id=mid)[0])
    return cfg, phis, qs, tphis


def test_featurize_and_score_equal_the_featurizer_whatever_the_batch_size(user_project):
    res = trak("featurize", "run.yaml", *KRON)
    assert res.exit_code == 0, res.stderr
    assert "kronecker projection: 2 layers cover 83 of the 83 selected parameter entries (100.00%)" in res.stderr
    assert "featurized 2 checkpoints x 40 train rows (grad_dim 83 -> proj_dim 16)" in res.stderr
    res = trak("score", "run.yaml", *KRON, "--out", "scores.npy", "-q")
    assert res.exit_code == 0, res.stderr
    cfg, phis, qs, tphis = direct()
    root = zarr.open_group("out/attrib.zarr", mode="r")
    assert root.attrs["identity"]["projector"]["kind"] == "kronecker"
    for mid in range(2):
        np.testing.assert_allclose(root[f"train/{mid}/features"][:], phis[mid].numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(root[f"train/{mid}/out_to_loss"][:], qs[mid].numpy(), rtol=1e-6)
        np.testing.assert_allclose(root[f"targets/default/{mid}/features"][:], tphis[mid].numpy(), rtol=1e-5, atol=1e-6)
    ref = trak_scores(phis, qs, tphis, cfg.score.lambda_reg, cfg.score.lambda_rel).numpy()
    np.testing.assert_allclose(np.load("scores.npy"), ref, rtol=2e-4, atol=1e-6)
    # other batch sizes (and memory bounds, which cut batches into passes) give the same features
    for other in (["data.batch_size=3"], ["data.batch_size=40", "data.grad_memory_mb=1"]):
        res = trak("featurize", "run.yaml", *KRON, *other, "store.path=out/b.zarr", "--overwrite", "-q")
        assert res.exit_code == 0, res.stderr
        b = zarr.open_group("out/b.zarr", mode="r")
        for mid in range(2):
            name = f"train/{mid}/features"
            np.testing.assert_allclose(b[name][:], root[name][:], rtol=1e-5, atol=1e-7, err_msg=str(other))


def test_batches_are_data_batch_size_and_memory_bounds_the_passes(user_project):
    s = prepare(load_config("run.yaml", [*KRON, "data.batch_size=32", "data.grad_memory_mb=2"]))
    assert isinstance(s.featurizer, KroneckerFeaturizer)
    assert s.batch_rows == 32 and s.featurizer.memory_mb == 2
    assert s.identity["grad_dim"] == 83 and s.identity["projector"] == s.featurizer.projector.spec()


def test_changed_split_is_refused_naming_the_difference_until_overwrite(user_project):
    assert trak("featurize", "run.yaml", *KRON, "-q").exit_code == 0
    res = trak("featurize", "run.yaml", *KRON, "projector.proj_dim=12")
    assert res.exit_code == 1
    assert "projector.proj_dim: store has 16, this run has 12" in res.stderr
    # the split is named leaf by leaf (layer index and factor), not as two whole lists
    assert re.search(r"projector\.layers\.\d\.k_(out|in): store has \d+, this run has \d+", res.stderr), res.stderr
    assert "projector.layers: store has" not in res.stderr
    assert "--overwrite" in res.stderr
    res = trak("featurize", "run.yaml", *KRON, "projector.split=size")  # the other split rule, same proj_dim
    assert res.exit_code == 1 and re.search(r"projector\.layers\.\d\.width: store has \d+", res.stderr), res.stderr
    res = trak("featurize", "run.yaml", *KRON, 'grad_wrt=["2.*"]')  # the same proj_dim on other layers
    assert res.exit_code == 1 and "projector.layers" in res.stderr and "grad_wrt" in res.stderr
    res = trak("featurize", "run.yaml", *KRON, "projector.proj_dim=12", "--overwrite", "-q")
    assert res.exit_code == 0, res.stderr
    assert zarr.open_group("out/attrib.zarr", mode="r")["train/0/features"].shape == (40, 12)
    # a dense store is not a kronecker one either
    res = trak("score", "run.yaml")
    assert res.exit_code == 1 and "projector.kind: store has 'kronecker', this run has 'rademacher'" in res.stderr


@pytest.mark.parametrize(
    "override, message",
    [
        ("projector.implementation=chunked", "projector.implementation: kind kronecker has one implementation"),
        ("projector.block_size=64", "projector: option block_size does not apply to kind kronecker; remove it"),
        ("projector.distribtion=normal", "distribtion (did you mean distribution?)"),
        ("projector.distribution=gaussian", "kronecker distribution must be one of rademacher, normal"),
        ("projector.split=sqrt", "kronecker split must be one of equal, size"),
        ("projector.proj_dim=1", "smaller than the 2 layers"),
    ],
)
def test_bad_kronecker_settings_exit_1_with_the_fix(user_project, override, message):
    res = trak("featurize", "run.yaml", *KRON, override)
    assert res.exit_code == 1
    assert message in " ".join(res.stderr.split()), res.stderr
    assert not Path("out/attrib.zarr").exists()


def layer_norm_project() -> tuple[str, ...]:
    """A LayerNorm model beside user_project's; the overrides that use it."""
    Path("ln_model.py").write_text(LN_MODEL)
    Path("ln").mkdir()
    for i in range(2):
        torch.manual_seed(i)
        model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))
        torch.save(model.state_dict(), f"ln/model_{i}.pt")
    return (*KRON, "model.entrypoint=ln_model.py:make_model", "checkpoints=ln/model_*.pt", "store.path=out/ln.zarr")


def test_grad_wrt_of_only_unsupported_parameters_is_a_one_line_error(user_project):
    res = trak("featurize", "run.yaml", *layer_norm_project(), 'grad_wrt=["1.*"]')
    assert res.exit_code == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    assert "every selected parameter is outside them: 1.weight (LayerNorm); 1.bias (LayerNorm)" in lines[0]
    assert "Traceback" not in res.stderr


def test_scores_of_a_layer_norm_model_name_the_left_out_parameters(user_project):
    ln = layer_norm_project()
    assert trak("featurize", "run.yaml", *ln, "-q").exit_code == 0
    res = trak("score", "run.yaml", *ln)
    assert res.exit_code == 0, res.stderr
    info = [line for line in res.stderr.splitlines() if line.startswith("kronecker projection:")]
    assert info == [
        "kronecker projection: 2 layers cover 83 of the 99 selected parameter entries (83.84%); "
        "left out: LayerNorm: 1.weight, 1.bias"
    ]
    assert "proponents" in res.stderr


def test_inspect_shows_the_layers(user_project):
    assert trak("featurize", "run.yaml", *KRON, "-q").exit_code == 0
    res = trak("inspect", "out/attrib.zarr")
    assert res.exit_code == 0, res.stderr
    assert "kronecker projection: 2 layers" in res.stderr
    for row in ("│ 0     │ linear │ 8 x 7        │ 3 x 3        │        8 │ weight, bias │",
                "│ 2     │ linear │ 3 x 9        │ 3 x 3        │        8 │ weight, bias │"):
        assert row in res.stderr, res.stderr
    # the grid holds more products than the layer's features: the caption says which ones are kept
    assert "they are the first `features` entries of the k_out x k_in grid" in " ".join(res.stderr.split())
    res = trak("inspect", "out/attrib.zarr", "--json")
    assert res.exit_code == 0, res.stderr
    layers = json.loads(res.stdout)["identity"]["projector"]["layers"]
    assert [(la["name"], la["d_out"], la["d_in"], la["k_out"], la["k_in"], la["width"]) for la in layers] == [
        ("0", 8, 7, 3, 3, 8), ("2", 3, 9, 3, 3, 8),
    ]


def test_kronecker_path_never_imports_torch_dynamo(user_project):
    """torch.func's vmap(grad) imports torch._dynamo (1.2-1.5 s); featurize + score with kronecker need neither."""
    script = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from trakcli.cli.main import app\n"
        "for cmd in ('featurize', 'score'):\n"
        "    r = CliRunner().invoke(app, [cmd, 'run.yaml', 'projector.kind=kronecker', '-q'])\n"
        "    assert r.exit_code == 0, r.stderr\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def kron_reference(tmp_path_factory) -> Path:
    """An uninterrupted kronecker featurize + score of make_project's project (3 checkpoints, 15 chunks each)."""
    root = make_project(tmp_path_factory.mktemp("kref"))
    for cmd in ("featurize", "score"):
        res = run(root, cmd, "run.yaml", *KRON, "-q")
        assert res.returncode == 0, res.stderr
    return root


def test_killed_featurize_resumes_to_the_same_store(tmp_path, kron_reference):
    root = make_project(tmp_path / "p")
    log = tmp_path / "events.log"
    assert kill_at(root, ["featurize", "run.yaml", *KRON, "-q"], log, 20)
    res = run(root, "featurize", "run.yaml", *KRON, "data.batch_size=7", "--verify", "-q")
    assert res.returncode == 0, res.stderr
    assert run(root, "score", "run.yaml", *KRON, "-q").returncode == 0
    a = zarr.open_group(str(root / "out" / "attrib.zarr"), mode="r")
    b = zarr.open_group(str(kron_reference / "out" / "attrib.zarr"), mode="r")
    for name in ("train/0/features", "train/2/features", "train/1/out_to_loss", "scores/default/scores"):
        np.testing.assert_allclose(a[name][:], b[name][:], rtol=1e-5, atol=1e-6, err_msg=name)


def test_torchrun_two_ranks_write_the_same_store_as_one_process(tmp_path, kron_reference):
    root = make_project(tmp_path / "p")
    for cmd in ("featurize", "score"):
        res = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
             "-m", "trakcli.cli.main", cmd, "run.yaml", *KRON],
            cwd=root, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stderr.count("kronecker projection: 2 layers") == 1  # rank 0 reports the coverage, once
    assert_same_store(root / "out" / "attrib.zarr", kron_reference / "out" / "attrib.zarr")
