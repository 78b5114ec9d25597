"""Replay and metagradients (trakcli.unroll) on a tiny seeded MLP, against independent references:
bit-for-bit replay, reverse mode against autograd through the whole unrolled training, and against
central finite differences of trainings by torch.optim itself in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trakcli.errors import ArgumentError, ConfigError
from trakcli.tasks import resolve_task
from trakcli.train import Recipe, ReplayRecorder, TensorRows, Trainer
from trakcli.unroll import ReplayRecord, Unroller, replay, update

N, D, C = 24, 5, 3
TASK = resolve_task("classification")

RECIPES = {
    "sgd": dict(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
    "adamw": dict(optimizer="adamw", lr=0.01, weight_decay=0.1, schedule="cosine", warmup_steps=2),
    "adam": dict(optimizer="adam", lr=0.01, weight_decay=0.01, schedule="linear"),
}


def data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, D, generator=g), torch.randint(0, C, (N,), generator=g),
            torch.randn(3, D, generator=g), torch.randint(0, C, (3,), generator=g))


def model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(D, 7), nn.Tanh(), nn.Linear(7, C)).to(dtype)


def train(tmp_path, name: str, every: int = 2, epochs: int = 2):
    x, y, _, _ = data()
    m = model()
    rec = Recipe(epochs=epochs, batch_size=8, **RECIPES[name])
    Trainer(m, TensorRows(x, y), rec, task=TASK, seed=3).fit(replay=ReplayRecorder(tmp_path / name, every))
    return m, ReplayRecord(tmp_path / name)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_replay_reproduces_the_final_weights_bit_for_bit(tmp_path, name):
    trained, record = train(tmp_path, name, every=4, epochs=3)
    x, y, _, _ = data()
    assert record.states == [0, 4, 8] and record.total_steps == 9
    for start in (0, 4):
        again = replay(model(), TensorRows(x, y), record, TASK, start=start)
        for k, v in trained.state_dict().items():
            assert torch.equal(v, again.state_dict()[k]), (start, k)


def _unrolled_reference(u: Unroller, record: ReplayRecord, tx, ty) -> torch.Tensor:
    """d loss(target)/d w by plain autograd through every step at once (create_graph), w a leaf [N]."""
    x, y, _, _ = data()
    snap = record.state(0)
    params = {k: snap["model"][k].clone().requires_grad_() for k in u.names}
    from trakcli.unroll import initial_state

    state, count = initial_state(u.hyper, params, snap["optimizer"], u.names)
    w = torch.ones(N, requires_grad=True)
    for step in record.steps(TensorRows(x, y), snap):
        logits = torch.func.functional_call(u.model, params, (step.inputs,))
        loss = (w[step.rows] * nn.functional.cross_entropy(logits, step.labels, reduction="none")).mean()
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        params, state = update(u.hyper, params, state, dict(zip(params, grads)), step.lr, count + 1)
        count += 1
    out = []
    for j in range(len(ty)):
        target = nn.functional.cross_entropy(torch.func.functional_call(u.model, params, (tx[j:j + 1],)), ty[j:j + 1])
        out.append(torch.autograd.grad(target, w, retain_graph=True)[0])
    return torch.stack(out)


@pytest.mark.parametrize("name", ["sgd", "adamw", "adam"])
def test_metagradients_equal_autograd_through_the_unrolled_training(tmp_path, name):
    _, record = train(tmp_path, name)
    x, y, tx, ty = data()
    u = Unroller(model(), TensorRows(x, y), record, TASK)
    got = u.metagradients(tx, ty)
    want = _unrolled_reference(u, record, tx, ty)
    assert got.shape == (3, N) and want.abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))


def _weighted_training(name: str, w: torch.Tensor, record: ReplayRecord) -> nn.Module:
    """The recorded training redone in float64 by torch.optim, example losses weighted by ``w``."""
    x, y, _, _ = data()
    m = model(torch.float64)
    r = RECIPES[name]
    opt = (torch.optim.SGD(m.parameters(), lr=r["lr"], momentum=r["momentum"], weight_decay=r["weight_decay"])
           if name == "sgd" else torch.optim.AdamW(m.parameters(), lr=r["lr"], weight_decay=r["weight_decay"]))
    for step in record.steps(TensorRows(x, y), record.state(0)):
        for group in opt.param_groups:
            group["lr"] = step.lr
        opt.zero_grad()
        loss = (w[step.rows] * nn.functional.cross_entropy(m(step.inputs.double()), step.labels, reduction="none")).mean()
        loss.backward()
        opt.step()
    return m


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_metagradients_equal_finite_differences_of_weighted_trainings(tmp_path, name):
    _, record = train(tmp_path, name)
    x, y, tx, ty = data()
    got = Unroller(model(), TensorRows(x, y), record, TASK).metagradients(tx, ty)
    eps = 1e-4
    for i in (0, 13):
        losses = []
        for sign in (1, -1):
            w = torch.ones(N, dtype=torch.float64)
            w[i] += sign * eps
            m = _weighted_training(name, w, record)
            losses.append(nn.functional.cross_entropy(m(tx.double()), ty, reduction="none").detach())
        fd = (losses[0] - losses[1]) / (2 * eps)
        torch.testing.assert_close(got[:, i].double(), fd, rtol=2e-3, atol=2e-3 * float(fd.abs().max()) + 1e-7)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_reweighted_training_equals_torch_optim_with_rows_dropped(tmp_path, name):
    """Weights 0 on a third of the rows: the recorded batches and order without them, as torch.optim trains it."""
    trained, record = train(tmp_path, name)
    x, y, tx, _ = data()
    u = Unroller(model(), TensorRows(x, y), record, TASK)
    ones = u.reweighted_params(torch.ones(N))
    for k, v in trained.named_parameters():
        torch.testing.assert_close(ones[k], v.detach(), rtol=1e-5, atol=1e-6)
    w = (torch.arange(N) % 3 != 0).double()
    want = {k: v.detach() for k, v in _weighted_training(name, w, record).named_parameters()}
    got = u.reweighted_params(w)
    moved = max(float((want[k].float() - ones[k]).abs().max()) for k in want)
    assert moved > 1e-3  # dropping rows changed the run
    for k, v in want.items():
        torch.testing.assert_close(got[k], v.float(), rtol=1e-4, atol=1e-5)
    with pytest.raises(ArgumentError, match=r"\[24\]"):
        u.reweighted_params(torch.ones(N + 1))


def test_batched_targets_equal_one_at_a_time_and_the_loop(tmp_path):
    _, record = train(tmp_path, "adamw")
    x, y, tx, ty = data()
    u = Unroller(model(), TensorRows(x, y), record, TASK)
    batched = u.metagradients(tx, ty)
    assert u.vmapped  # the stacked adjoints went through vmap
    single = torch.cat([u.metagradients(tx[j:j + 1], ty[j:j + 1]) for j in range(3)])
    torch.testing.assert_close(batched, single, rtol=1e-5, atol=1e-8)
    u.vmapped = False  # the loop over targets, where vmap fails
    torch.testing.assert_close(u.metagradients(tx, ty), batched, rtol=1e-5, atol=1e-8)


def test_refusals_name_the_part(tmp_path):
    _, record = train(tmp_path, "sgd")
    x, y, _, _ = data()
    with pytest.raises(ConfigError, match="bfloat16"):
        Unroller(model().to(torch.bfloat16), TensorRows(x, y), record, TASK)
    bn = nn.Sequential(nn.Linear(D, 7), nn.BatchNorm1d(7), nn.Linear(7, C))
    with pytest.raises(ConfigError, match=r"module '1' \(BatchNorm1d\)"):
        Unroller(bn, TensorRows(x, y), record, TASK)
    record.meta["recipe"]["optimizer"] = "rmsprop"
    with pytest.raises(ConfigError, match="'rmsprop'.*sgd, adam, adamw"):
        Unroller(model(), TensorRows(x, y), record, TASK)
    record.meta["recipe"]["optimizer"] = "sgd"
    record.meta["params"][0]["dtype"] = "float16"
    with pytest.raises(ConfigError, match="trained in float16"):
        Unroller(model(), TensorRows(x, y), record, TASK)
