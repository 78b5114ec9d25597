"""Kronecker-factored projection (LoGra): projector math, and hook-based features against vmap per-example gradients.

The reference for every model is ``KroneckerProjector.project`` of the
examples' own gradients from :class:`trakcli.gradients.vmap.PerExampleGradients`
(``torch.func.vmap``), and ``project`` itself is checked against the dense
matrix ``torch.kron(P_out, P_in)``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from trakcli.errors import ConfigError, DataError, GradientError, ProjectorError
from trakcli.gradients import KroneckerFeaturizer
from trakcli.gradients.vmap import PerExampleGradients
from trakcli.projectors.kronecker import KroneckerProjector, factor_pair
from trakcli.projectors.kronecker_layers import KroneckerLayer, LayerParam, choose_grid, split_widths

transformers = pytest.importorskip("transformers")

from projects import (  # noqa: E402  (the tiny models, shared with the per-example hook tests)
    TOKEN_VOCAB as VOCAB, EmbeddingModel, HFConv1DModel, TokenModel, TwiceModel, conv1d_model, conv2d_model, labels,
    text_batch, tiny_bert, tiny_gpt2,
)

CASES = {
    # name: (model builder, batch builder, task, proj_dim)
    "linear3d_padding+embedding": (lambda: (torch.manual_seed(0), TokenModel())[1], lambda: text_batch(6, 7),
                                   "text_classification", 64),
    "conv2d": (conv2d_model, lambda: torch.randn(5, 2, 8, 8, generator=torch.Generator().manual_seed(2)),
               "classification", 64),
    "conv1d": (conv1d_model, lambda: torch.randn(5, 3, 10, generator=torch.Generator().manual_seed(2)),
               "classification", 48),
    "embedding": (lambda: (torch.manual_seed(0), EmbeddingModel())[1],
                  lambda: torch.randint(0, VOCAB, (5, 4), generator=torch.Generator().manual_seed(2)),
                  "classification", 40),
    "hf_conv1d": (lambda: (torch.manual_seed(0), HFConv1DModel())[1],
                  lambda: torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(2)), "classification", 40),
    "linear_called_twice": (lambda: (torch.manual_seed(0), TwiceModel())[1],
                            lambda: torch.randn(4, 5, generator=torch.Generator().manual_seed(2)),
                            "classification", 30),
    "bert": (tiny_bert, lambda: text_batch(5, 9), "text_classification", 512),
    "gpt2_lm": (tiny_gpt2, lambda: text_batch(5, 9), "language_modeling", 512),
}


def reference(feat: KroneckerFeaturizer, x, y, model_id):
    """Projection of the vmap per-example gradients of the covered parameters, and their Q."""
    grads, q = PerExampleGradients(feat.model, feat.param_names, feat.task)(x, y)
    return feat.projector.project(grads, model_id=model_id), q


def assert_layers_close(phi, ref, proj, rtol=1e-4):
    for i, layer in enumerate(proj.layers):
        a, b = (t[:, proj.offsets[i] : proj.offsets[i] + proj.widths[i]] for t in (phi, ref))
        atol = rtol * float(b.abs().max()) + 1e-12
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, name=layer.name: f"{name}: {m}")


# ----------------------------------------------------------------------------- hook features == vmap gradients


@pytest.mark.parametrize("case", list(CASES))
def test_features_equal_projected_vmap_gradients(case):
    make, batch, task, proj_dim = CASES[case]
    model, x = make(), batch()
    y = labels(len(x["input_ids"]) if isinstance(x, dict) else len(x))
    feat = KroneckerFeaturizer(model, proj_dim=proj_dim, seed=3, task=task)
    phi, q = feat(x, y, model_id=1)
    ref, ref_q = reference(feat, x, y, model_id=1)
    assert phi.shape == (len(y), proj_dim) and phi.dtype == q.dtype == torch.float32
    assert bool(ref.abs().sum(1).gt(0).all())  # a test that can fail: nonzero features for every example
    assert_layers_close(phi, ref, feat.projector)
    torch.testing.assert_close(q, ref_q, rtol=1e-5, atol=1e-6)
    assert all(p.requires_grad for p in model.parameters())  # flags restored after the pass
    assert all(p.grad is None for p in model.parameters())  # no weight gradient was ever computed


def test_bert_and_gpt2_coverage_position_embeddings_and_tied_head():
    bert = KroneckerFeaturizer(tiny_bert(), proj_dim=512, task="text_classification")
    names = [layer.name for layer in bert.layers]
    assert "bert.embeddings.position_embeddings" in names  # batch-broadcast input, expanded in the hook
    assert all("LayerNorm" in n for n in bert.left_out)
    assert "bert.embeddings.LayerNorm.weight" in bert.info and "LayerNorm" in bert.info and "%" in bert.info
    gpt = KroneckerFeaturizer(tiny_gpt2(), proj_dim=512, task="language_modeling")
    wte = next(i for i, layer in enumerate(gpt.layers) if layer.name == "transformer.wte")
    # lm_head shares wte's weight: one layer, fed by both modules, lm_head in the transposed orientation
    uses = [(u.name, u.transposed) for u in gpt.uses if u.layer == wte]
    assert uses == [("transformer.wte", False), ("lm_head", True)]
    assert "lm_head.weight" not in gpt.param_names


@pytest.mark.parametrize("case", ["linear3d_padding+embedding", "bert", "gpt2_lm"])
def test_padding_positions_contribute_nothing(case):
    make, batch, task, proj_dim = CASES[case]
    feat = KroneckerFeaturizer(make(), proj_dim=proj_dim, task=task)
    x = batch()
    y = labels(len(x["input_ids"]))
    phi, _ = feat(x, y)
    other = dict(x, input_ids=torch.where(x["attention_mask"] == 0, 5, x["input_ids"]))
    assert not torch.equal(other["input_ids"], x["input_ids"])
    phi2, _ = feat(other, y)
    torch.testing.assert_close(phi2, phi, rtol=1e-5, atol=1e-6)


def test_independent_of_batch_size_and_memory_passes():
    x = text_batch(6, 9, seed=4)
    y = labels(6)
    feat = KroneckerFeaturizer(tiny_bert(), proj_dim=256, task="text_classification")
    whole, q = feat(x, y, model_id=2)
    parts = [feat({k: v[a:b] for k, v in x.items()}, y[a:b], model_id=2)[0] for a, b in ((0, 1), (1, 4), (4, 6))]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-6)
    small = KroneckerFeaturizer(tiny_bert(), proj_dim=256, task="text_classification", memory_mb=0.01)
    phi, q2 = small(x, y, model_id=2)  # a 1-row probe, then passes that fit 0.01 MiB
    torch.testing.assert_close(phi, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(q2, q)
    assert 1 <= small.rows_per_pass(x) < 6 and feat.rows_per_pass(x) is None


# ----------------------------------------------------------------------------- projector math


def small_layers():
    return [
        KroneckerLayer("lin", "linear", 5, (LayerParam("lin.weight", (5, 4), "weight"),
                                            LayerParam("lin.bias", (5,), "bias"))),
        KroneckerLayer("emb", "embedding", 3, (LayerParam("emb.weight", (7, 3), "weight_t"),)),
        KroneckerLayer("conv", "conv2d", 2, (LayerParam("conv.weight", (2, 3, 2, 2), "weight"),)),
        KroneckerLayer("b", "bias", 4, (LayerParam("b.bias", (4,), "bias"),)),
    ]


def random_grads(layers, n, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {p.name: torch.randn(n, *p.shape, generator=g, dtype=dtype) for layer in layers for p in layer.params}


def test_project_is_the_truncated_kronecker_matrix():
    layers = small_layers()
    proj = KroneckerProjector(layers, 33, seed=5, dtype=torch.float64)
    assert sum(proj.widths) == 33 and any(w != k_o * k_i for w, (k_o, k_i) in zip(proj.widths, proj.grids))
    grads = random_grads(layers, 3)
    got = proj.project(grads, model_id=4)
    for i, layer in enumerate(layers):
        p_out, p_in = proj.factors(i, model_id=4)
        w = proj.widths[i]
        dense = torch.kron(p_out, p_in)[:w] * math.sqrt(p_out.shape[0] * p_in.shape[0] / w)  # [w, d_out*d_in]
        G = layer.to_matrix(grads, 3)  # [n, d_out, d_in]
        torch.testing.assert_close(got[:, proj.offsets[i] : proj.offsets[i] + w], G.reshape(3, -1) @ dense.T)
        # the factor-level entry point: G = Σ_t g_t a_tᵀ never formed
        g_t = torch.randn(3, 6, layer.d_out, dtype=torch.float64)
        a_t = torch.randn(3, 6, layer.d_in, dtype=torch.float64)
        direct = torch.einsum("nto,nti->noi", g_t, a_t).reshape(3, -1) @ dense.T
        torch.testing.assert_close(proj.project_factors(layer.name, g_t, a_t, model_id=4), direct)
    flat = torch.cat([grads[n].reshape(3, -1) for n in proj.param_names], dim=1)
    torch.testing.assert_close(proj.project(flat, model_id=4), got)  # flat input in param_names order


def test_unproject_is_the_adjoint():
    layers = KroneckerFeaturizer(tiny_bert(), proj_dim=300).layers
    proj = KroneckerProjector(layers, 300, seed=1, dtype=torch.float64)
    g = random_grads(layers, 2)
    z = torch.randn(2, 300, dtype=torch.float64)
    back = proj.unproject(z, model_id=3)
    flat = torch.cat([g[n].reshape(2, -1) for n in proj.param_names], dim=1)
    assert back.shape == (2, proj.grad_dim)
    torch.testing.assert_close((proj.project(g, model_id=3) * z).sum(), (flat * back).sum())
    params = proj.unproject_params(z, model_id=3)
    torch.testing.assert_close(torch.cat([params[n].reshape(2, -1) for n in proj.param_names], dim=1), back)


@pytest.mark.parametrize("distribution, proj_dim", [("rademacher", 10), ("rademacher", 16), ("normal", 10)])
def test_norm_is_preserved_in_expectation(distribution, proj_dim):
    # deterministic (fixed seeds), and 5 standard errors wide: a missing truncation scale √(12/10) fails it
    layer = KroneckerLayer("l", "linear", 12, (LayerParam("w", (12, 9), "weight"), LayerParam("b", (12,), "bias")))
    g = random_grads([layer], 1, seed=7)
    norm2 = sum(float((t**2).sum()) for t in g.values())
    proj = KroneckerProjector([layer], proj_dim, seed=0, dtype=torch.float64, distribution=distribution)
    ratios = torch.tensor([float((proj.project(g, m) ** 2).sum()) / norm2 for m in range(400)])
    assert abs(float(ratios.mean()) - 1.0) < 5 * float(ratios.std()) / math.sqrt(len(ratios))


def test_spec_is_plain_deterministic_and_records_the_split():
    a = KroneckerFeaturizer(tiny_bert(), proj_dim=256, seed=2, task="text_classification")
    b = KroneckerFeaturizer(tiny_bert(), proj_dim=256, seed=2, task="text_classification")
    spec = a.projector.spec()
    assert json.loads(json.dumps(spec)) == spec == b.projector.spec()
    assert spec["kind"] == "kronecker" and spec["distribution"] == "rademacher" and spec["dtype"] == "float32"
    assert sum(layer["width"] for layer in spec["layers"]) == 256
    for layer in spec["layers"]:
        assert layer["k_out"] <= layer["d_out"] and layer["k_in"] <= layer["d_in"]
        assert layer["width"] <= layer["k_out"] * layer["k_in"]
    x, y = text_batch(3, 9), labels(3)
    torch.testing.assert_close(a(x, y, model_id=1)[0], b(x, y, model_id=1)[0], rtol=0, atol=0)
    assert not torch.allclose(a(x, y, model_id=1)[0], a(x, y, model_id=0)[0])
    other = KroneckerFeaturizer(tiny_bert(), proj_dim=300, seed=2, task="text_classification").projector.spec()
    assert other["layers"] != spec["layers"]
    assert KroneckerProjector(a.layers, 256, seed=3).spec() != spec
    assert KroneckerProjector(a.layers, 256, seed=2, distribution="normal").spec() != spec


def test_split_rule():
    assert split_widths([10, 1000, 5, 1000], 100) == [10, 43, 5, 42]
    assert split_widths([12, 12], 24) == [12, 12]
    assert choose_grid(64, 100, 100) == (8, 8)
    assert choose_grid(54, 100, 100) == (7, 8)
    assert choose_grid(54, 384, 2) == (27, 2)
    assert choose_grid(64, 5, 1000) == (5, 13)
    for d_out in range(1, 9):
        for d_in in range(1, 9):
            for w in range(1, d_out * d_in + 1):
                k_out, k_in = choose_grid(w, d_out, d_in)
                assert k_out <= d_out and k_in <= d_in and w <= k_out * k_in < w + max(k_out, k_in)
    layers = small_layers()
    widest = sum(layer.d_out * layer.d_in for layer in layers)
    with pytest.raises(ProjectorError, match=f"exceeds {widest}, the widest kronecker projection"):
        KroneckerProjector(layers, widest + 1)
    with pytest.raises(ProjectorError, match="smaller than the 4 layers"):
        KroneckerProjector(layers, 3)
    assert KroneckerProjector(layers, widest).widths == [layer.d_out * layer.d_in for layer in layers]


def test_size_split_is_proportional_to_the_layers_gradient_entries():
    assert split_widths([10, 1000, 5, 1000], 100, "size") == [1, 49, 1, 49]  # the small ones lifted to 1
    assert split_widths([100, 300], 8, "size") == [2, 6]
    assert split_widths([1, 2, 3], 6, "size") == [1, 2, 3]  # every entry: the capacities
    assert split_widths([1, 1, 10**6], 3, "size") == [1, 1, 1]
    for caps, d in [([7, 13, 29, 1], 20), ([5, 5, 5], 4), ([1000, 3, 17, 400], 333)]:
        widths = split_widths(caps, d, "size")
        assert sum(widths) == d and all(1 <= w <= c for w, c in zip(widths, caps))
    layers = small_layers()
    equal, size = KroneckerProjector(layers, 40), KroneckerProjector(layers, 40, split="size")
    assert size.widths == split_widths([la.d_out * la.d_in for la in layers], 40, "size") != equal.widths
    assert size.spec() != equal.spec()  # the widths are in the spec: a store refuses the other split
    with pytest.raises(ProjectorError, match="kronecker split must be one of equal, size, got 'sqrt'"):
        KroneckerProjector(layers, 40, split="sqrt")


def test_per_matrix_factors_for_two_sided_projection():
    layers = small_layers()
    proj = KroneckerProjector(layers, 4 + 9 + 4 + 4, seed=9)  # every width a full grid
    i = 0
    k_out, k_in = proj.grids[i]
    assert k_out * k_in == proj.widths[i]
    p_out, p_in = factor_pair(5, 5, k_out, k_in, seed=9, model_id=2, layer=i)
    torch.testing.assert_close(p_out, proj.factors("lin", model_id=2)[0], rtol=0, atol=0)
    torch.testing.assert_close(p_in, proj.factors("lin", model_id=2)[1], rtol=0, atol=0)
    grads = random_grads(layers, 1, dtype=torch.float32)
    G = layers[i].to_matrix(grads, 1)[0]
    torch.testing.assert_close((p_out @ G @ p_in.T).reshape(-1), proj.project(grads, 2)[0, : proj.widths[i]])
    with pytest.raises(ProjectorError, match="exceeds the layer's size 5"):
        factor_pair(5, 5, 6, 1, seed=0, model_id=0, layer=0)


# ----------------------------------------------------------------------------- coverage and errors


def test_grad_wrt_of_only_unsupported_parameters_is_a_config_error():
    outside = r"grad_wrt: .*every selected parameter is outside them: ln.weight \(LayerNorm\)"
    with pytest.raises(ConfigError, match=outside):
        KroneckerFeaturizer(TokenModel(), proj_dim=8, grad_wrt=["ln.*"])
    feat = KroneckerFeaturizer(TokenModel(), proj_dim=3, grad_wrt=["ln.*", "head.bias"])
    assert [layer.kind for layer in feat.layers] == ["bias"]
    assert feat.left_out == {"ln.weight": "LayerNorm", "ln.bias": "LayerNorm"}


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # vmap of the reference over sdpa
def test_module_that_never_runs_and_multihead_attention():
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 3), nn.Linear(4, 3)

        def forward(self, x):
            return self.used(x)

    feat = KroneckerFeaturizer(Unused(), proj_dim=8)
    with pytest.raises(GradientError, match="never called unused"):
        feat(torch.randn(2, 4), labels(2))
    torch.manual_seed(0)
    encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    mha = nn.Sequential(nn.Linear(8, 8), encoder, nn.Flatten(), nn.Linear(24, 3))
    feat = KroneckerFeaturizer(mha, proj_dim=32)
    assert "1.self_attn.out_proj.weight" in feat.left_out and "1.self_attn.in_proj_weight" in feat.left_out
    assert "nn.MultiheadAttention" in feat.info
    x = torch.randn(3, 3, 8)
    phi, _ = feat(x, labels(3))
    ref, _ = reference(feat, x, labels(3), 0)
    assert_layers_close(phi, ref, feat.projector)


def test_broadcast_output_used_per_row_is_refused():
    class FirstRow(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Embedding(5, 4)
            self.out = nn.Linear(4, 3)

        def forward(self, x):
            return self.out(x + self.pos(torch.arange(5)[None])[0].sum(0))  # indexes row 0 of a [1, T, d] output

    with pytest.raises(GradientError, match="only the first row"):
        KroneckerFeaturizer(FirstRow(), proj_dim=8)(torch.randn(3, 4), labels(3))


def test_bad_batches_and_gradients_are_named():
    feat = KroneckerFeaturizer(conv1d_model(), proj_dim=16)
    x = torch.randn(3, 3, 10)
    with pytest.raises(DataError, match=r"labels out of range: the model has 3 classes but examples \[11\]"):
        feat(x, torch.tensor([0, 1, 7]), row_offset=9)
    with pytest.raises(DataError, match="cannot take inputs of shape \\[4, 10\\]"):
        feat(torch.randn(3, 4, 10), labels(3))
    with pytest.raises(DataError, match="language_modeling needs token data"):
        KroneckerFeaturizer(conv1d_model(), proj_dim=16, task="language_modeling")(x, labels(3))
    grads = random_grads(feat.layers, 2, dtype=torch.float32)
    with pytest.raises(ProjectorError, match=r"not covered \['extra'\]"):
        feat.projector.project({**grads, "extra": torch.zeros(2, 3)})
    first = next(iter(grads))
    with pytest.raises(ProjectorError, match=rf"gradient of parameter '{first}' has shape \(2, 1\), expected \[2, "):
        feat.projector.project({**grads, first: torch.zeros(2, 1)})
    phi, q = feat(x[:0], labels(0))
    assert phi.shape == (0, 16) and q.shape == (0,)
