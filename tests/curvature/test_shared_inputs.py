"""The curvature passes take each layer's input ``a_t`` as it is (no product with an identity matrix), and layers that
read one input tensor (a transformer's query, key and value projections) share its second moment and eigenbasis."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from projects import masked_batch, tiny_llama
from trakcli.curvature import correct_eigenvalues, curvature_layers, eigenbases, fit_covariances
from trakcli.gradients.kinds import Kind, kind_of
from trakcli.gradients.vmap import select_parameters
from trakcli.tasks import IGNORE_INDEX, resolve_task


def _modules():
    torch.manual_seed(0)
    return [
        ("linear", nn.Linear(6, 4), torch.randn(3, 5, 6)),
        ("linear, no bias", nn.Linear(6, 4, bias=False), torch.randn(3, 5, 6)),
        ("conv2d", nn.Conv2d(3, 4, 3, stride=2, padding=1), torch.randn(2, 3, 7, 6)),
        ("conv1d", nn.Conv1d(3, 4, 2, dilation=2, padding=1, bias=False), torch.randn(2, 3, 9)),
    ]


@pytest.mark.parametrize("which", range(4), ids=[m[0] for m in _modules()])
@pytest.mark.parametrize("weight, bias", [(True, True), (True, False), (False, True)])
def test_layer_input_equals_the_projection_by_the_identity(which, weight, bias):
    _, module, x = _modules()[which]
    kind, _ = kind_of(module)
    out = module(x)
    cols = module.weight[0].numel()
    width = cols + 1  # a bias column, filled only when the call's bias is selected
    got = kind.layer_input(module, x, out, width, cols, weight, bias, torch.float64)
    want = Kind.layer_input(kind, module, x, out, width, cols, weight, bias, torch.float64)  # x @ I
    assert got.dtype == torch.float64 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if weight and not bias:
        assert got.data_ptr() != x.data_ptr()  # a copy: a later in-place change of x cannot reach it


def test_query_key_and_value_projections_share_their_input_factor_and_basis_and_match_separate_fits():
    model = tiny_llama().double().eval()
    inputs, labels = masked_batch("completion", n=6, length=11)
    vocab = model.config.vocab_size
    inputs["input_ids"] = inputs["input_ids"] % vocab
    labels = torch.where(labels == IGNORE_INDEX, labels, labels % vocab)
    task = resolve_task("language_modeling")
    batches = [({k: v[:3] for k, v in inputs.items()}, labels[:3]), ({k: v[3:] for k, v in inputs.items()}, labels[3:])]
    attn = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight"]
    names = select_parameters(model, attn)
    layers, uses = curvature_layers(model, names, "ekfac")
    a, s = fit_covariances(model, layers, uses, task, batches, fisher="empirical")
    assert torch.equal(a[0], a[1]) and torch.equal(a[0], a[2])
    bases = eigenbases(layers, a, s)
    assert bases[0].q_in is bases[1].q_in and bases[0].q_in is bases[2].q_in  # one decomposition
    shared = correct_eigenvalues(model, layers, uses, task, bases, batches, fisher="empirical")
    for j, name in enumerate(attn):  # each layer fitted alone, with nothing to share, gives the same factors
        one_layers, one_uses = curvature_layers(model, [name], "ekfac")
        a1, s1 = fit_covariances(model, one_layers, one_uses, task, batches, fisher="empirical")
        torch.testing.assert_close(a1[0], a[j], rtol=1e-12, atol=1e-14)
        one = correct_eigenvalues(model, one_layers, one_uses, task, eigenbases(one_layers, a1, s1), batches,
                                  fisher="empirical")
        torch.testing.assert_close(one[0].eig, shared[j].eig, rtol=1e-9, atol=1e-14)


def test_a_trial_fit_runs_every_pass_without_an_eigendecomposition(monkeypatch):
    """`trak featurize`'s trial of the curvature on its first batch (JobSetup.check_curvature) runs both passes and
    the whitening in the standard basis: a language model's hundreds of decompositions are made once, by the fit."""
    from trakcli.curvature import Curvature

    model = tiny_llama().double().eval()
    inputs, labels = masked_batch("completion", n=4, length=9)
    inputs["input_ids"] = inputs["input_ids"] % model.config.vocab_size
    labels = torch.where(labels == IGNORE_INDEX, labels, labels % model.config.vocab_size)
    names = select_parameters(model, ["model.layers.*.mlp.*"])
    curv = Curvature(model, names, "language_modeling", "ekfac", output="loss")

    def refused(*args, **kwargs):
        raise AssertionError("an eigendecomposition in a trial fit")

    monkeypatch.setattr(torch.linalg, "eigh", refused)
    f = curv.fit(0, lambda: iter([(inputs, labels)]), trial=True)
    for layer, lf in zip(curv.layers, f.factors):
        assert torch.equal(lf.q_in, torch.eye(layer.d_in, dtype=lf.q_in.dtype))
        assert lf.eig.shape == (layer.d_out, layer.d_in) and bool((lf.eig > 0).any())
    monkeypatch.undo()
    curv.forget(0)
    full = curv.fit(0, lambda: iter([(inputs, labels)]))  # the fit itself decomposes
    assert not torch.equal(full.factors[0].q_in, f.factors[0].q_in)
