"""K-FAC and EK-FAC against float64 dense closed forms built from per-token and per-example gradients of a loop.

The references never go through the hooks: each example is run alone, its layer inputs and output gradients
are captured per token, and its gradient per layer is taken with autograd.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from projects import masked_batch, tiny_gpt2, tiny_llama
from trakcli.curvature import Curvature, correct_eigenvalues, curvature_layers, eigenbases, fit_covariances
from trakcli.curvature.kfac import CurvatureFactors
from trakcli.errors import ConfigError
from trakcli.gradients.vmap import select_parameters
from trakcli.tasks import IGNORE_INDEX, resolve_task

torch.set_default_dtype(torch.float32)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3, bias=False)).double()


def mlp_data(n: int = 23):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def reference(model: nn.Module, layers, uses, examples, loss_of):
    """Per layer, per example: the inputs a_t [T, d_in] (bias 1 appended) and output gradients g_t [T, d_out]
    of the summed loss, each example run alone (T: its real positions)."""
    out = []
    for ex in examples:
        acts: dict[int, torch.Tensor] = {}
        outs: dict[int, torch.Tensor] = {}
        handles = []
        for i, use in enumerate(uses):
            def hook(mod, inp, o, i=i):
                acts[i] = inp[0].detach()
                o.retain_grad()
                outs[i] = o
            handles.append(use.module.register_forward_hook(hook))
        loss = loss_of(model, ex)
        loss.backward()
        for h in handles:
            h.remove()
        per = []
        for i, layer in enumerate(layers):
            a = acts[i].reshape(-1, acts[i].shape[-1]).double()
            if layer.has_bias:
                a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], dim=1)
            g = outs[i].grad.reshape(-1, outs[i].shape[-1]).double()
            per.append((a, g))
        out.append(per)
        model.zero_grad(set_to_none=True)
    return out


def dense_factors(per_example, n_layers):
    """A = Σ a aᵀ / N_tokens, S = Σ g gᵀ / N_examples, and the examples' G = Σ_t g_t a_tᵀ, per layer."""
    out = []
    for j in range(n_layers):
        a_all = torch.cat([ex[j][0] for ex in per_example])
        g_all = torch.cat([ex[j][1] for ex in per_example])
        big_g = torch.stack([ex[j][1].T @ ex[j][0] for ex in per_example])
        out.append((a_all.T @ a_all / a_all.shape[0], g_all.T @ g_all / len(per_example), big_g))
    return out


def check_factors(model, names, task, batches, loss_of, examples):
    layers, uses = curvature_layers(model, names, "ekfac")
    a, s = fit_covariances(model, layers, uses, task, batches, fisher="empirical")
    ref = dense_factors(reference(model, layers, uses, examples, loss_of), len(layers))
    for j, (a_ref, s_ref, _) in enumerate(ref):
        torch.testing.assert_close(a[j], a_ref, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(s[j], s_ref, rtol=1e-5, atol=1e-7)
    kfac = eigenbases(layers, a, s)
    for f, (a_ref, s_ref, _) in zip(kfac, ref):  # the eigenbasis diagonalizes S ⊗ A with λ_S λ_Aᵀ
        dense = torch.kron(s_ref, a_ref)
        q = torch.kron(f.q_out, f.q_in)
        torch.testing.assert_close(q.T @ dense @ q, torch.diag(f.eig.flatten()), rtol=1e-5, atol=1e-7)
    ekfac = correct_eigenvalues(model, layers, uses, task, kfac, batches, fisher="empirical")
    for f, (_, _, big_g) in zip(ekfac, ref):
        want = (f.q_out.T @ big_g @ f.q_in).square().mean(0)
        torch.testing.assert_close(f.eig, want, rtol=1e-5, atol=1e-9)
    return layers, ekfac, ref


def test_mlp_factors_and_eigenvalue_correction_equal_the_dense_closed_form():
    model, (x, y) = mlp(), mlp_data()
    names = select_parameters(model, None)
    task = resolve_task("classification")
    batches = [(x[:10], y[:10]), (x[10:], y[10:])]

    def loss_of(m, i):
        return nn.functional.cross_entropy(m(x[i:i + 1]), y[i:i + 1], reduction="sum")

    check_factors(model, names, task, batches, loss_of, range(len(y)))


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_lm_factors_over_real_tokens_equal_the_per_token_closed_form(make, kind):
    model = make().double().eval()
    inputs, labels = masked_batch(kind, n=6, length=11)
    vocab = model.config.vocab_size
    inputs["input_ids"] = inputs["input_ids"] % vocab
    labels = torch.where(labels == IGNORE_INDEX, labels, labels % vocab)
    patterns = ["transformer.h.*.attn.c_*", "transformer.h.*.mlp.*"] if make is tiny_gpt2 else \
        ["model.layers.*.self_attn.*_proj.weight", "model.layers.*.mlp.*"]
    names = select_parameters(model, patterns)
    task = resolve_task("language_modeling")
    batches = [({k: v[:4] for k, v in inputs.items()}, labels[:4]), ({k: v[4:] for k, v in inputs.items()}, labels[4:])]

    def loss_of(m, i):
        real = int(inputs["attention_mask"][i].sum())
        ex = {k: v[i:i + 1, :real] for k, v in inputs.items()}
        logits = m(**ex).logits
        return task.loss(logits, {**ex, "labels": labels[i:i + 1, :real]}, reduction="sum")

    check_factors(model, names, task, batches, loss_of, range(6))


def mlp_ekfac():
    """The MLP, its data, parameters, task, and its EK-FAC layers and factors (checked against the closed form)."""
    model, (x, y) = mlp(), mlp_data()
    names = select_parameters(model, None)
    task = resolve_task("classification")
    layers, ekfac, _ = check_factors(model, names, task, [(x, y)],
                                     lambda m, i: nn.functional.cross_entropy(m(x[i:i + 1]), y[i:i + 1],
                                                                              reduction="sum"), range(len(y)))
    return model, (x, y), names, task, layers, ekfac


def dense_inverse(f, damping):
    q = torch.kron(f.q_out, f.q_in)
    return q @ torch.diag(1.0 / (f.eig.flatten() + f.damping(damping))) @ q.T


def test_whitened_inner_products_and_inverse_hvp_equal_the_damped_dense_inverse():
    model, (x, y), names, task, layers, ekfac = mlp_ekfac()
    curv = CurvatureFactors(layers, ekfac, damping=0.3)
    grads = {n: torch.randn(7, *p.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
             for n, p in model.named_parameters()}
    white = curv.whiten(grads)
    ihvp = curv.inverse_hvp(grads)
    got = sum(torch.einsum("i...,j...->ij", white[n], white[n]) for n in grads)
    want = torch.zeros(7, 7, dtype=torch.float64)
    for layer, f in zip(layers, ekfac):
        g = layer.to_matrix(grads, 7).reshape(7, -1)
        inv = dense_inverse(f, 0.3)
        want += g @ inv @ g.T
        torch.testing.assert_close(layer.to_matrix(ihvp, 7).reshape(7, -1), g @ inv, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)


def test_true_fisher_of_the_output_layer_is_the_softmax_covariance():
    """Sampled labels: S of the logits' layer converges to mean_x (diag p − p pᵀ), the exact Fisher there."""
    model, (x, _) = mlp(), mlp_data(40)
    names = [n for n, _ in model.named_parameters() if n.startswith("4.")]
    task = resolve_task("classification")
    layers, uses = curvature_layers(model, names, "kfac")
    batches = [(x, torch.zeros(len(x), dtype=torch.long))] * 400
    _, s = fit_covariances(model, layers, uses, task, batches, fisher="true", seed=3)
    with torch.no_grad():
        p = torch.softmax(model(x), -1)
    exact = (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]).mean(0)
    torch.testing.assert_close(s[0], exact, rtol=0, atol=0.01)
    _, s_emp = fit_covariances(model, layers, uses, task, batches[:1], fisher="empirical")
    assert not torch.allclose(s_emp[0], exact, atol=0.01)  # the data's labels give another matrix


def test_parameters_outside_matrix_layers_and_tied_weights_are_refused_by_name():
    model = tiny_gpt2()
    with pytest.raises(ConfigError, match=r"ln_1\.weight.*grad_wrt"):
        Curvature(model, select_parameters(model, ["transformer.h.*"]), "language_modeling", "ekfac")
    with pytest.raises(ConfigError, match=r"shared by several modules.*transformer\.wte"):
        Curvature(model, select_parameters(model, ["transformer.wte.*"]), "language_modeling", "ekfac")
    with pytest.raises(ConfigError, match="damping must be a number > 0"):
        Curvature(model, select_parameters(model, ["transformer.h.*.mlp.*"]), "language_modeling", "ekfac", damping=0)


def dense_gauss_newton(model, names, batches, positions):
    """(1/N) Σ_z J_zᵀ (diag p − p pᵀ) J_z over the loss positions, from the full Jacobian of the logits."""
    from torch.func import functional_call, jacrev

    params = {n: p.detach() for n, p in model.named_parameters() if n in names}
    rest = {n: p.detach() for n, p in model.named_parameters() if n not in names}
    total, count = 0.0, 0
    for inputs, labels in batches:
        def logits(flat):
            p, at = {}, 0
            for n in names:
                p[n] = flat[at:at + params[n].numel()].reshape(params[n].shape)
                at += params[n].numel()
            call = functional_call(model, {**p, **rest}, args=(), kwargs=inputs) if isinstance(inputs, dict) \
                else functional_call(model, {**p, **rest}, (inputs,))
            return call.logits if hasattr(call, "logits") else call

        flat = torch.cat([params[n].flatten() for n in names])
        out = logits(flat)
        jac = jacrev(logits)(flat)  # [*out.shape, grad_dim]
        rows, keep = positions(out, jac, inputs, labels)
        for (o, j), k in zip(rows, keep):
            if k:
                p = torch.softmax(o, -1)
                total = total + j.T @ (torch.diag(p) - torch.outer(p, p)) @ j
        count += out.shape[0]
    return total / count


def test_refined_inverse_hvp_is_the_dense_solve_of_the_damped_gauss_newton_matrix():
    from trakcli.curvature.refine import GaussNewton, refine

    model, (x, y), names, task, layers, ekfac = mlp_ekfac()
    curv = CurvatureFactors(layers, ekfac, damping=0.2)
    gn = GaussNewton(model, names, task, [(x[:9], y[:9]), (x[9:], y[9:])])
    dense = dense_gauss_newton(model, names, [(x, y)],
                               lambda out, jac, i, l: (zip(out, jac), [True] * len(out)))
    damp = torch.cat([torch.full((p.numel,), f.damping(0.2), dtype=torch.float64)
                      for layer, f in zip(layers, ekfac) for p in layer.params])
    order = [p.name for layer in layers for p in layer.params]
    g = {n: t for n, t in zip(names, torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64,
                                                  generator=torch.Generator().manual_seed(4)).split(
        [p.numel() for p in model.parameters()]))}
    g = {n: g[n].reshape(dict(model.named_parameters())[n].shape) for n in names}
    flat_g = torch.cat([g[n].flatten() for n in order])
    dense_v = dense @ flat_g
    gv = gn(g)
    torch.testing.assert_close(torch.cat([gv[n].flatten() for n in order]), dense_v, rtol=1e-8, atol=1e-10)
    want = torch.linalg.solve(dense + torch.diag(damp), flat_g)
    x_ref = refine(curv, gn, g, iterations=200, tol=1e-13)
    torch.testing.assert_close(torch.cat([x_ref[n].flatten() for n in order]), want, rtol=1e-6, atol=1e-9)
    start = refine(curv, gn, g, iterations=0)  # the EK-FAC solution, whose dual feature is the whitened gradient
    white = curv.whiten({n: t[None] for n, t in g.items()})
    dual = curv.dual({n: t[None] for n, t in start.items()})
    for n in names:
        torch.testing.assert_close(dual[n], white[n], rtol=1e-8, atol=1e-10)


def test_gauss_newton_products_of_an_lm_cover_exactly_the_target_positions():
    from trakcli.curvature.refine import GaussNewton

    model = tiny_gpt2().double().eval()
    inputs, labels = masked_batch("completion", n=3, length=9)
    inputs["input_ids"] = inputs["input_ids"] % model.config.vocab_size
    labels = torch.where(labels == IGNORE_INDEX, labels, labels % model.config.vocab_size)
    names = select_parameters(model, ["transformer.h.1.mlp.c_proj.*"])
    task = resolve_task("language_modeling")

    def positions(out, jac, inp, lab):
        pred, pj = out[:, :-1].reshape(-1, out.shape[-1]), jac[:, :-1].reshape(-1, out.shape[-1], jac.shape[-1])
        return zip(pred, pj), (lab[:, 1:] != IGNORE_INDEX).reshape(-1).tolist()

    dense = dense_gauss_newton(model, names, [(inputs, labels)], positions)
    gn = GaussNewton(model, names, task, [(inputs, labels)])
    v = {n: torch.randn_like(p) for n, p in model.named_parameters() if n in names}
    got = gn(v)
    flat = torch.cat([v[n].flatten() for n in names])
    torch.testing.assert_close(torch.cat([got[n].flatten() for n in names]), dense @ flat, rtol=1e-7, atol=1e-10)
