"""The trainer: its recipe read from the optimize: section, its optimizer and schedule set up once, its position
(step, epoch, order, history) held on the object and restored from a training-state file."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trakcli.config.load import load_config
from trakcli.errors import CheckpointError
from trakcli.train import Recipe, TensorRows, Trainer


class _Killed(Exception):
    pass


def rows(n: int = 30) -> TensorRows:
    g = torch.Generator().manual_seed(0)
    return TensorRows(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def fresh() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def test_the_recipe_is_the_optimize_sections_settings_of_the_steps():
    cfg = load_config("configs/digits_projected.yaml", ["optimize.schedule=cosine", "optimize.warmup_steps=3",
                                                        "optimize.checkpoint_every=7"])
    oc = cfg.recipe
    r = Recipe.from_config(oc, max_tokens=64)
    assert (r.epochs, r.batch_size, r.lr, r.optimizer, r.momentum, r.weight_decay) == (
        oc.epochs, oc.batch_size, oc.lr, oc.optimizer, oc.momentum, oc.weight_decay)
    assert (r.schedule, r.warmup_steps, r.checkpoint_every, r.max_tokens) == ("cosine", 3, 7, 64)
    assert r.projection == oc.projection.model_dump() and r.projection["rank"] == 8


def test_the_schedule_is_set_up_once_and_the_position_lives_on_the_trainer():
    # 30 rows in batches of 8: 4 steps per epoch, 3 epochs; warmup 0.2 of 12 steps -> 3 steps
    trainer = Trainer(fresh(), rows(), Recipe(epochs=3, batch_size=8, lr=0.05, schedule="linear",
                                              warmup_fraction=0.2), seed=1)
    assert (trainer.total_steps, trainer.warmup_steps) == (12, math.ceil(0.2 * 12))
    assert trainer.state.step == 0 and trainer.state.history == []
    model = trainer.fit()
    s = trainer.state
    assert model is trainer.model and not model.training
    assert (s.step, s.epoch, s.lo, s.order) == (12, 3, 30, None)
    assert [h["epoch"] for h in s.history] == [1, 2, 3]
    assert trainer.metrics()["final_loss"] == pytest.approx(s.history[-1]["loss"])
    assert trainer.optimizer_state()["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_a_new_trainer_takes_up_the_position_a_killed_one_saved(tmp_path):
    recipe = Recipe(epochs=2, batch_size=8, lr=0.05, optimizer="adam", checkpoint_every=3)
    ref = Trainer(fresh(), rows(), recipe, seed=2)
    ref.fit()
    model, calls = fresh(), [0]

    def bomb(module, args):
        calls[0] += 1
        if calls[0] == 6:  # step 6 = epoch 2, batch 2; the state of step 4 (epoch 1's end) is on disk
            raise _Killed

    handle = model.register_forward_pre_hook(bomb)
    path = tmp_path / "state.pt"
    with pytest.raises(_Killed):
        Trainer(model, rows(), recipe, seed=2).fit(resume_path=path)
    handle.remove()
    again = Trainer(fresh(), rows(), recipe, seed=2)
    again.load_state(path)
    assert (again.state.step, again.state.epoch, again.state.lo, again.state.order) == (4, 1, 0, None)
    assert [h["epoch"] for h in again.state.history] == [1]
    again.fit(resume_path=path)
    for a, b in zip(ref.model.state_dict().values(), again.model.state_dict().values()):
        assert torch.equal(a, b)
    assert again.metrics()["history"] == ref.metrics()["history"] and not path.exists()
    # a trainer of another recipe refuses the file, naming the difference
    calls[0] = 0
    with pytest.raises(_Killed):
        killed = fresh()
        killed.register_forward_pre_hook(bomb)
        Trainer(killed, rows(), recipe, seed=2).fit(resume_path=path)
    with pytest.raises(CheckpointError, match=r"differs in: batch_size"):
        Trainer(fresh(), rows(), Recipe(epochs=2, batch_size=4, lr=0.05, optimizer="adam"), seed=2).load_state(path)
