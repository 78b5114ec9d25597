"""ProjectedOptimizer and the subspace parametrization: exact reductions, refreshes, resume, state."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from trakcli.errors import OptimizerError
from trakcli.optim import ProjectedOptimizer, derive_slot_seed, subspace, transforms
from trakcli.projectors import Projector, make_projector


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread is faster than synchronizing a pool on shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def mlp(seed: int = 0, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


def batches(n_steps: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 12, generator=g).to(dtype), torch.randint(0, 3, (8,), generator=g)) for _ in range(n_steps)]


def train(model: nn.Module, opt: torch.optim.Optimizer, data) -> list[torch.Tensor]:
    """Step through ``data``; returns the flat parameter vector after each step."""
    out = []
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
    return out


INNERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2}, {"weight_decay": 0.05}, {"weight_decay": 0.05}),
    "sgd_l2": (
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9},
        {"weight_decay": 0.01},
        {"weight_decay": 0.01, "weight_decay_mode": "l2"},
    ),
    "adam_nodecay": (torch.optim.Adam, {"lr": 1e-2, "betas": (0.8, 0.95)}, {}, {}),
}


@pytest.mark.parametrize("mode", ["per_matrix", "global"])
@pytest.mark.parametrize("inner_name", sorted(INNERS))
def test_noop_projection_matches_the_inner_optimizer_step_for_step(mode, inner_name):
    inner, hyper, ref_decay, decay = INNERS[inner_name]
    data = batches(15)
    ref_model, model = mlp(), mlp()
    ref = train(ref_model, inner(ref_model.parameters(), **hyper, **ref_decay), data)
    opt = ProjectedOptimizer(model.parameters(), inner=inner, projection={"mode": mode, "kind": "noop"}, **hyper, **decay)
    got = train(model, opt, data)
    for step, (a, b) in enumerate(zip(ref, got)):
        if mode == "per_matrix":  # every parameter handed to the inner optimizer as is: bit for bit
            assert torch.equal(b, a), f"step {step}"
        else:  # through a shadow: W + (0 + Δ) may round differently from the inner's fused W + Δ
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"step {step}")
    assert not torch.equal(ref[0], ref[-1])


def test_global_fixed_projection_with_sgd_matches_the_subspace_parametrization():
    proj = {"mode": "global", "kind": "rademacher", "proj_dim": 24, "seed": 5}
    data = batches(12, torch.float64)
    model = mlp(dtype=torch.float64)
    opt = ProjectedOptimizer(model.parameters(), inner=torch.optim.SGD, projection=proj, lr=0.2, momentum=0.9, weight_decay=0.0)
    got = train(model, opt, data)

    ref_model = mlp(dtype=torch.float64)
    sub = subspace.attach(ref_model, proj)
    assert [n for n, p in sub.named_parameters()] == ["z"] and sub.z.shape == (24,)
    sgd = torch.optim.SGD(sub.parameters(), lr=0.2, momentum=0.9)
    ref = []
    for x, y in data:
        sgd.zero_grad()
        nn.functional.cross_entropy(ref_model(x), y).backward()
        sgd.step()
        ref.append(torch.cat([v.reshape(-1) for v in sub.merged_state_dict().values()]))
    for step, (a, b) in enumerate(zip(ref, got)):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=f"step {step}")
    # the update stays in the 24-dimensional subspace: W - W0 = Pᵀ z
    assert torch.linalg.matrix_rank(torch.stack([g - got[0] for g in got[1:]])).item() <= 24


def test_per_matrix_sgd_step_is_the_projected_gradient_mapped_back():
    """One SGD step: W1 = W0 - lr · Pᵀ P G along the smaller side, P from make_projector (reference)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(5, 30, dtype=torch.float64))  # smaller side 5 (rows): P is [rank, 5]
    v = nn.Parameter(torch.randn(40, 6, dtype=torch.float64))  # smaller side 6 (columns): P is [rank, 6]
    c = nn.Parameter(torch.randn(4, 2, 3, 3, dtype=torch.float64))  # a conv kernel: the matrix [4, 18]
    opt = ProjectedOptimizer([w, v, c], inner=torch.optim.SGD, projection={"rank": 3, "seed": 7}, lr=0.5, weight_decay=0.0)
    w0, v0, c0 = w.detach().clone(), v.detach().clone(), c.detach().clone()
    gw, gv, gc = torch.randn(5, 30, dtype=torch.float64), torch.randn(40, 6, dtype=torch.float64), torch.randn_like(c0)
    w.grad, v.grad, c.grad = gw.clone(), gv.clone(), gc.clone()
    opt.step()

    def dense(short: int, index: int) -> torch.Tensor:
        p = make_projector("rademacher", grad_dim=short, proj_dim=3, seed=derive_slot_seed(7, 0, index), dtype="float64")
        return p.unproject(torch.eye(3, dtype=torch.float64), model_id=0)  # [3, short] = P

    pw, pv = dense(5, 0), dense(6, 1)
    torch.testing.assert_close(w.detach(), w0 - 0.5 * pw.T @ pw @ gw)
    torch.testing.assert_close(v.detach(), v0 - 0.5 * gv @ pv.T @ pv)
    pc = dense(4, 2)
    torch.testing.assert_close(c.detach(), c0 - 0.5 * (pc.T @ pc @ gc.reshape(4, 18)).reshape(4, 2, 3, 3))
    assert opt.describe()[0]["inner_shape"] == (30, 3) and opt.describe()[1]["inner_shape"] == (40, 3)


@pytest.mark.parametrize(
    "projection",
    [
        {"mode": "per_matrix", "rank": 4, "update_gap": 3, "on_refresh": "transfer"},
        {"mode": "global", "proj_dim": 32, "update_gap": 3, "on_refresh": "transfer", "kind": "sjlt"},
        {"mode": "per_matrix", "rank": 4, "update_gap": 3, "on_refresh": "reset", "kind": "normal"},
    ],
)
def test_resume_across_refreshes_is_bit_identical(projection):
    data = batches(14)
    model = mlp()
    opt = ProjectedOptimizer(model.parameters(), projection=projection, lr=1e-2)
    full = train(model, opt, data)

    model = mlp()
    opt = ProjectedOptimizer(model.parameters(), projection=projection, lr=1e-2)
    train(model, opt, data[:5])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    del model, opt

    model = mlp(seed=1)  # other initial values: everything must come from the checkpoint
    opt = ProjectedOptimizer(model.parameters(), projection=projection, lr=1e-2)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    resumed = train(model, opt, data[5:])
    assert opt.state[next(model.parameters())]["proj_index"] >= 3  # refreshes after the resume point
    for step, (a, b) in enumerate(zip(full[5:], resumed)):
        assert torch.equal(a, b), f"step {step + 5} differs"


@pytest.mark.parametrize("inner,hyper,keys", [
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, ["momentum_buffer"]),
    (torch.optim.AdamW, {"lr": 1e-2}, ["exp_avg"]),
])
@pytest.mark.parametrize("mode", ["per_matrix", "global"])
def test_transfer_never_increases_the_momentum_norm(inner, hyper, keys, mode):
    settings = {"mode": mode, "on_refresh": "transfer", **({"rank": 4} if mode == "per_matrix" else {"proj_dim": 40})}
    model = mlp()
    opt = ProjectedOptimizer(model.parameters(), inner=inner, projection=settings, **hyper)
    shrunk = 0
    for i, (x, y) in enumerate(batches(8)):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        before = {id(p): {k: st[k].clone() for k in keys} for p, st in opt.inner.state.items() if p.dim() and any(k in st for k in keys)}
        sq_before = {id(p): {k: v.clone() for k, v in st.items() if k not in keys} for p, st in opt.inner.state.items()}
        opt.refresh()
        for p, st in opt.inner.state.items():
            for k in keys:
                if id(p) in before and k in st:
                    old, new = before[id(p)][k].norm(), st[k].norm()
                    assert new <= old, (i, k, float(old), float(new))
                    shrunk += bool(new < old)
            for k, v in sq_before[id(p)].items():  # second moments and counters are kept
                assert torch.equal(torch.as_tensor(st[k]), torch.as_tensor(v)), k
    assert shrunk > 0  # the transfer did something
    assert opt.state[next(model.parameters())]["proj_index"] == 8


def test_refresh_policies_keep_reset_and_the_update_gap():
    def run(policy: str):
        model = mlp()
        opt = ProjectedOptimizer(model.parameters(), projection={"rank": 4, "update_gap": 4, "on_refresh": policy}, lr=1e-2)
        train(model, opt, batches(4))
        state = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.inner.state.items()}
        train(model, opt, batches(1, seed=1))  # step 5: draws projection 1 first
        return opt, model, state

    opt, model, _ = run("reset")
    anchor = next(model.parameters())
    assert opt.state[anchor]["proj_index"] == 1 and opt.state[anchor]["step"] == 5
    projected = [s.shadow for s in opt._slots[0] if s.projected]
    assert all(int(opt.inner.state[z]["step"]) == 1 for z in projected)  # restarted
    unprojected = [p for p in model.parameters() if p.dim() == 1]
    assert all(int(opt.inner.state[p]["step"]) == 5 for p in unprojected)
    opt, model, _ = run("keep")
    projected = [s.shadow for s in opt._slots[0] if s.projected]
    assert all(int(opt.inner.state[z]["step"]) == 5 for z in projected)


def test_state_dict_is_plain_data_and_loads_with_weights_only(tmp_path):
    model = mlp()
    opt = ProjectedOptimizer(model.parameters(), projection={"mode": "global", "proj_dim": 16, "update_gap": 2}, lr=1e-2)
    train(model, opt, batches(5))
    sd = opt.state_dict()

    def walk(x):
        assert not isinstance(x, (Projector, nn.Module)), type(x)
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            assert x is None or isinstance(x, (torch.Tensor, int, float, str, bool)), type(x)

    walk(sd)
    torch.save(sd, tmp_path / "opt.pt")
    loaded = torch.load(tmp_path / "opt.pt", weights_only=True)
    assert loaded["param_groups"][0]["projection"]["proj_dim"] == 16
    assert opt.state_numel() == 2 * 16 + 0  # AdamW moments of the 16-dim shadow; shadows hold no storage
    other = ProjectedOptimizer(mlp().parameters(), projection={"mode": "global", "proj_dim": 17}, lr=1e-2)
    with pytest.raises(OptimizerError, match="proj_dim: saved 16, now 17"):
        other.load_state_dict(loaded)


def test_param_groups_closure_zero_grad_and_lr_changes():
    model = mlp()
    first, rest = list(model[0].parameters()), list(model[2].parameters()) + list(model[4].parameters())
    opt = ProjectedOptimizer(
        [{"params": first, "projection": None, "lr": 0.0}, {"params": rest, "projection": {"rank": 2}}],
        inner=torch.optim.SGD, lr=0.1, momentum=0.5, weight_decay=0.0,
    )
    assert [g["lr"] for g in opt.inner.param_groups] == [0.0, 0.1]
    assert opt.inner.param_groups[1]["weight_decay"] == 0.0 and opt.inner.param_groups[1]["momentum"] == 0.5
    kinds = [r["kind"] for r in opt.describe()]
    assert kinds == ["IdentitySlot", "IdentitySlot", "MatrixSlot", "IdentitySlot", "MatrixSlot", "IdentitySlot"]
    x, y = batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and loss.item() > 0
    after = list(model.parameters())
    assert torch.equal(after[0], before[0])  # lr 0 group untouched
    assert not torch.equal(after[2], before[2])
    opt.param_groups[1]["lr"] = 0.0  # a scheduler changes the outer group: the inner follows
    snapshot = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    for p in opt.inner.param_groups[1]["params"]:
        opt.inner.state[p].pop("momentum_buffer", None)  # no momentum carry-over
    closure()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(snapshot, model.parameters()))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_weight_decay_is_decoupled_in_the_full_space():
    p = nn.Parameter(torch.ones(6, 4))
    opt = ProjectedOptimizer([p], inner=torch.optim.SGD, projection={"rank": 2}, lr=0.1, weight_decay=0.5)
    p.grad = torch.zeros(6, 4)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.full((6, 4), 1 - 0.1 * 0.5))  # outside the rank-2 subspace too


def test_transforms_broadcast_with_param_ndim():
    x = torch.arange(24.0).reshape(2, 3, 4)
    assert transforms.batch_view(x, -1).shape == (2, 3, 4)
    assert transforms.batch_view(x, 1).shape == (6, 4)
    assert transforms.batch_view(x, 0).shape == (24,)
    assert transforms.batch_view(x, None).shape == (1, 2, 3, 4)
    assert transforms.batch_view(x, 5).shape == (1, 2, 3, 4)
    # sign-SGD through the grad transform: with noop it is SGD on sign(g)
    model, ref_model = mlp(), mlp()
    data = batches(3)
    opt = ProjectedOptimizer(model.parameters(), inner=torch.optim.SGD, projection={"kind": "noop"}, lr=0.01,
                             weight_decay=0.0, grad_transform=transforms.sign_())
    got = train(model, opt, data)
    ref = []
    for xb, yb in data:
        ref_model.zero_grad()
        nn.functional.cross_entropy(ref_model(xb), yb).backward()
        with torch.no_grad():
            for p in ref_model.parameters():
                p -= 0.01 * p.grad.sign()
        ref.append(torch.cat([p.detach().reshape(-1) for p in ref_model.parameters()]))
    torch.testing.assert_close(got[-1], ref[-1])
    # per-row max-norm on the parameters after each step
    model = mlp()
    opt = ProjectedOptimizer(model.parameters(), projection={"rank": 4}, lr=0.5,
                             param_transform=transforms.max_norm_(0.3), param_ndim=-1)
    train(model, opt, batches(2))
    assert model[0].weight.norm(dim=1).max() <= 0.3 + 1e-6
    assert model[0].bias.abs().max() <= 0.3 + 1e-6  # 1-D: each entry is an item


def test_per_matrix_state_is_a_small_share_of_adamw():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    n_params = sum(p.numel() for p in model.parameters())
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    for projection, share in [({"rank": 8}, 0.10), ({"mode": "global", "proj_dim": 1000}, 0.02)]:
        opt = ProjectedOptimizer(model.parameters(), projection=projection, lr=1e-3)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        assert opt.state_numel() <= share * 2 * n_params, (projection, opt.state_numel(), 2 * n_params)


def test_subspace_state_dict_keeps_the_model_keys_and_merge():
    model = mlp()
    keys = list(model.state_dict())
    sub = subspace.attach(model, {"mode": "global", "proj_dim": 8, "seed": 1})
    assert [p for p in model.parameters() if p.requires_grad] == []
    opt = torch.optim.Adam(sub.parameters(), lr=0.05)
    train(model, opt, batches(3))
    merged = sub.merged_state_dict()
    assert list(merged) == keys
    fresh = mlp(seed=3)
    fresh.load_state_dict(merged)
    x = batches(1, seed=9)[0][0]
    torch.testing.assert_close(fresh(x), model(x))
    assert not torch.equal(merged["0.weight"], mlp().state_dict()["0.weight"])
    sub.merge()
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(model(x), fresh(x))
    assert all(p.requires_grad for p in model.parameters())


def test_subspace_noop_and_projector_object():
    model = mlp()
    n = sum(p.numel() for p in model.parameters())
    sub = subspace.attach(model, make_projector("rademacher", grad_dim=n, proj_dim=6, seed=0), params=["0.*", "2.*", "4.*"])
    assert sub.z.shape == (6,)
    with pytest.raises(OptimizerError, match="grad_dim=5"):
        subspace.attach(mlp(), make_projector("rademacher", grad_dim=5, proj_dim=2))
    with pytest.raises(OptimizerError, match="mode 'global'"):
        subspace.attach(mlp(), {"mode": "per_matrix"})
    with pytest.raises(OptimizerError, match="needs a projection, got None"):
        subspace.attach(mlp(), None)
    # a projector object in the optimizer: global, its grad_dim must fit the group
    with pytest.raises(OptimizerError, match=f"grad_dim={n}"):
        ProjectedOptimizer(mlp().parameters(), projection=make_projector("rademacher", grad_dim=7, proj_dim=2), lr=0.1)
    model = mlp()
    opt = ProjectedOptimizer(model.parameters(), projection=make_projector("normal", grad_dim=n, proj_dim=9), lr=0.1)
    train(model, opt, batches(2))
    assert opt.state_numel() == 18


def test_invalid_settings_raise_optimizer_errors_naming_the_fix():
    with pytest.raises(OptimizerError, match="mode global needs proj_dim"):
        ProjectedOptimizer(mlp().parameters(), projection={"mode": "global"}, lr=0.1)
    with pytest.raises(OptimizerError, match="projection.rnk"):
        ProjectedOptimizer(mlp().parameters(), projection={"rnk": 3}, lr=0.1)
    with pytest.raises(OptimizerError, match="rejects the arguments"):
        ProjectedOptimizer(mlp().parameters(), inner=torch.optim.SGD, lr=0.1, betas=(0.9, 0.99))
    with pytest.raises(OptimizerError, match="weight_decay_mode"):
        ProjectedOptimizer(mlp().parameters(), lr=0.1, weight_decay_mode="coupled")
    with pytest.raises(OptimizerError, match="no 'inner' entry"):
        ProjectedOptimizer(mlp().parameters(), lr=0.1).load_state_dict(torch.optim.AdamW(mlp().parameters()).state_dict())


def test_a_group_projection_overrides_only_the_keys_it_names():
    model = mlp()
    opt = ProjectedOptimizer(
        [{"params": model[0].parameters(), "projection": {"rank": 2}}, {"params": model[2].parameters()}],
        projection={"rank": 5, "update_gap": 7, "seed": 3}, lr=0.1,
    )
    first, second = (g["projection"] for g in opt.param_groups)
    assert (first["rank"], first["update_gap"], first["seed"]) == (2, 7, 3)
    assert (second["rank"], second["update_gap"]) == (5, 7)
    assert [r["inner_shape"] for r in opt.describe() if r["kind"] == "MatrixSlot"] == [(20, 2), (20, 5)]


def test_lr_scheduler_drives_the_inner_optimizer():
    model = mlp()
    opt = ProjectedOptimizer(model.parameters(), inner=torch.optim.SGD, projection={"rank": 4}, lr=0.4, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for x, y in batches(2):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.1
    x, y = batches(1, seed=3)[0]
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert opt.inner.param_groups[0]["lr"] == 0.1 and "initial_lr" not in opt.inner.param_groups[0]


def test_projection_settings_object_equals_its_mapping_and_invalid_values_are_all_listed():
    from trakcli.optim import ProjectionSettings, resolve_projection

    settings = ProjectionSettings(rank=3, update_gap=5, seed=2)
    assert resolve_projection(settings) == resolve_projection({"rank": 3, "update_gap": 5, "seed": 2})
    assert resolve_projection({})["rank"] == 8 and resolve_projection(None) is None
    model_a, model_b = mlp(), mlp()
    opt_a = ProjectedOptimizer(model_a.parameters(), projection=settings, lr=0.1)
    opt_b = ProjectedOptimizer(model_b.parameters(), projection={"rank": 3, "update_gap": 5, "seed": 2}, lr=0.1)
    assert torch.equal(train(model_a, opt_a, batches(3))[-1], train(model_b, opt_b, batches(3))[-1])
    # a settings object for one group sets all its keys
    opt = ProjectedOptimizer(
        [{"params": mlp()[0].parameters(), "projection": ProjectionSettings(rank=2)}],
        projection={"rank": 5, "seed": 3}, lr=0.1,
    )
    assert (opt.param_groups[0]["projection"]["rank"], opt.param_groups[0]["projection"]["seed"]) == (2, 0)
    with pytest.raises(OptimizerError) as e:
        resolve_projection({"mode": "diagonal", "rnk": 3, "scale": 0})
    lines = str(e.value).splitlines()[1:]
    assert [ln.strip() for ln in lines] == [
        "projection.mode: Input should be 'per_matrix' or 'global' (got 'diagonal')",
        "projection.scale: Input should be greater than 0 (got 0)",
        "projection.rnk: Extra inputs are not permitted (got 3)",
    ]
    with pytest.raises(OptimizerError, match="mode global needs proj_dim"):
        ProjectedOptimizer(mlp().parameters(), projection={"mode": "global"}, lr=0.1)
    # a settings object validates when it is made; a boolean is not an integer
    with pytest.raises(ValueError, match="mode global needs proj_dim"):
        ProjectionSettings(mode="global")
    with pytest.raises(ValueError, match="rank\n.*must be an integer, not a boolean"):
        ProjectionSettings(rank=True)
    with pytest.raises(OptimizerError, match="projection.update_gap: must be an integer, not a boolean"):
        ProjectedOptimizer(mlp().parameters(), projection={"update_gap": True}, lr=0.1)


def test_optim_imports_neither_config_nor_store():
    import subprocess
    import sys

    code = "import sys, trakcli.optim; print(sorted(m for m in sys.modules if m.startswith(('trakcli.config', 'trakcli.store'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------------------- kind kronecker (two-sided per_matrix)


def _kron_slot(shape, rank, seed=11):
    from trakcli.optim.kronecker_slot import KroneckerSlot

    return KroneckerSlot(nn.Parameter(torch.zeros(shape, dtype=torch.float64)), rank, seed, torch.float64)


def _kron_matrix(d_out, d_in, k_out, k_in, seed, model_id):
    """P_out ⊗ P_in from factor_pair (the identity for a side with k = d)."""
    from trakcli.projectors.kronecker import factor_pair

    p_out, p_in = factor_pair(d_out, d_in, k_out, k_in, seed=seed, model_id=model_id, layer=0, dtype=torch.float64)
    p_out = torch.eye(d_out, dtype=torch.float64) if k_out == d_out else p_out
    p_in = torch.eye(d_in, dtype=torch.float64) if k_in == d_in else p_in
    return torch.kron(p_out.contiguous(), p_in.contiguous())  # [k_out·k_in, d_out·d_in]


@pytest.mark.parametrize("shape,rank", [((12, 30), 5), ((7, 2, 3, 3), 4), ((5, 20), 6), ((30, 4), 6)])
def test_kronecker_projection_is_the_kronecker_product_and_its_adjoint_is_exact(shape, rank):
    """R = P_out G P_inᵀ = (P_out ⊗ P_in) vec(G) row-major, factors from factor_pair; a side with k = d is I."""
    slot = _kron_slot(shape, rank)
    d_out = shape[0]
    d_in = slot.params[0].numel() // d_out
    k_out, k_in = min(rank, d_out), min(rank, d_in)
    assert slot.shape == (k_out, k_in)
    kron = _kron_matrix(d_out, d_in, k_out, k_in, 11, 2)
    g = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    r = slot.project([g], 2)
    torch.testing.assert_close(r.reshape(-1), kron @ g.reshape(-1), rtol=1e-12, atol=1e-12)
    u = torch.randn(k_out, k_in, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (back,) = slot.unproject(u, 2)
    assert back.shape == shape
    torch.testing.assert_close(back.reshape(-1), kron.T @ u.reshape(-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close((r * u).sum(), (g * back).sum(), rtol=1e-12, atol=0)  # ⟨PG, U⟩ = ⟨G, PᵀU⟩
    # a refresh's transfer: c · K_new K_oldᵀ vec(m), c = (k_out k_in) / (d_out d_in), scaled down to ‖m‖ at most
    m = u * 3
    new = (k_out * k_in) / (d_out * d_in) * _kron_matrix(d_out, d_in, k_out, k_in, 11, 3) @ kron.T @ m.reshape(-1)
    if new.norm() > m.norm():
        new = new * (float(m.norm()) / float(new.norm()) * (1 - 2.0**-20))
    got = slot.transfer(m, 2, 3)
    torch.testing.assert_close(got.reshape(-1), new, rtol=1e-10, atol=1e-12)
    assert got.norm() <= m.norm()


def test_kronecker_sgd_step_is_the_two_sided_projection_mapped_back():
    """One SGD step: vec(W1) = vec(W0) - lr · Kᵀ K vec(G), K = P_out ⊗ P_in of seed derive_slot_seed(7, 0, i)."""
    shapes = [(12, 30), (30, 12), (5, 30), (30, 4), (7, 2, 3, 3), (3, 4)]  # both orders, one-sided, conv, unprojected
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(s, dtype=torch.float64, generator=gen)) for s in shapes]
    opt = ProjectedOptimizer(params, inner=torch.optim.SGD, projection={"kind": "kronecker", "rank": 5, "seed": 7},
                             lr=0.5, weight_decay=0.0)
    assert [r["kind"] for r in opt.describe()] == ["KroneckerSlot"] * 5 + ["IdentitySlot"]
    assert [r["inner_shape"] for r in opt.describe()] == [(5, 5), (5, 5), (5, 5), (5, 4), (5, 5), (3, 4)]
    before = [p.detach().clone() for p in params]
    grads = [torch.randn(s, dtype=torch.float64, generator=gen) for s in shapes]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    for i, (p, w0, g) in enumerate(zip(params, before, grads)):
        d_out = p.shape[0]
        d_in = p.numel() // d_out
        k = _kron_matrix(d_out, d_in, min(5, d_out), min(5, d_in), derive_slot_seed(7, 0, i), 0)
        expected = w0.reshape(-1) - 0.5 * k.T @ (k @ g.reshape(-1))
        torch.testing.assert_close(p.detach().reshape(-1), expected, rtol=1e-12, atol=1e-12, msg=f"param {i}")


def test_kronecker_with_rank_at_least_every_side_is_the_inner_optimizer():
    """Nothing to compress (rank >= both sides of every matrix): identity slots, AdamW bit for bit."""
    data = batches(4)
    ref_model, model = mlp(), mlp()
    ref = train(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2), data)
    opt = ProjectedOptimizer(model.parameters(), projection={"kind": "kronecker", "rank": 20}, lr=1e-2)
    assert {r["kind"] for r in opt.describe()} == {"IdentitySlot"}
    for step, (a, b) in enumerate(zip(ref, train(model, opt, data))):
        assert torch.equal(a, b), f"step {step}"


def test_kronecker_trains_a_tiny_model_with_k_out_by_k_in_state_and_resumes():
    projection = {"kind": "kronecker", "rank": 4, "update_gap": 5, "on_refresh": "transfer"}
    data = batches(6, seed=3)

    def loss(model):
        with torch.no_grad():
            return sum(float(nn.functional.cross_entropy(model(x), y)) for x, y in data) / len(data)

    model = mlp()
    opt = ProjectedOptimizer(model.parameters(), projection=projection, lr=5e-2, weight_decay=0.0)
    start = loss(model)
    full = train(model, opt, data * 5)
    assert loss(model) < 0.85 * start, (start, loss(model))  # AdamW: 0.37 · start
    assert opt.state[next(model.parameters())]["proj_index"] == 5  # 30 steps, a new draw every 5
    # AdamW moments: [20, 12] -> [4, 4], [16, 20] -> [4, 4], [3, 16] -> [3, 4]; biases 20 + 16 + 3 unprojected
    assert opt.state_numel() == 2 * (16 + 16 + 12 + 39)
    # a resume across refreshes continues bit for bit
    model = mlp()
    opt = ProjectedOptimizer(model.parameters(), projection=projection, lr=5e-2, weight_decay=0.0)
    train(model, opt, data * 2)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model = mlp(seed=1)
    opt = ProjectedOptimizer(model.parameters(), projection=projection, lr=5e-2, weight_decay=0.0)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    resumed = train(model, opt, data * 3)
    assert all(torch.equal(a, b) for a, b in zip(full[12:], resumed))
    other = ProjectedOptimizer(mlp().parameters(), projection={**projection, "kind": "rademacher"}, lr=2e-2)
    with pytest.raises(OptimizerError, match="kind: saved 'kronecker', now 'rademacher'"):
        other.load_state_dict(saved["opt"])


def test_kronecker_has_no_global_mode():
    for extra in ({"proj_dim": 40}, {}):
        projection = {"mode": "global", "kind": "kronecker", **extra}
        with pytest.raises(OptimizerError, match="kind kronecker .* no global form; use mode: per_matrix"):
            ProjectedOptimizer(mlp().parameters(), projection=projection, lr=0.1)
    with pytest.raises(OptimizerError, match="no global form"):
        subspace.attach(mlp(), {"mode": "global", "kind": "kronecker", "proj_dim": 40})
