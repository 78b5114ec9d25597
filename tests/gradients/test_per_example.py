"""Exact per-example gradients from layer hooks (trakcli.gradients.LayerGradients) against torch.func.vmap.

The reference for every model is :class:`trakcli.gradients.vmap.PerExampleGradients`
(``vmap(grad(f))``, itself checked against a per-example loop in
tests/gradients/test_vmap.py). Also: the ``auto`` chooser's fallback to vmap (an
uncovered parameter, a weight used outside its module, examples that interact,
a module run without the batch first), ``gradient_method: hooks``'s errors, and
the config key.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from typer.testing import CliRunner

from trakcli.cli.main import app
from trakcli.config import load_config
from trakcli.errors import ConfigError, GradientError
from trakcli.gradients import LayerGradients, per_example_gradients
from trakcli.gradients.vmap import PerExampleGradients
from trakcli.tasks import classification_margin
from trakcli.jobs.setup import build_featurizer
from trakcli.models.build import build_model

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")

transformers = pytest.importorskip("transformers")

from projects import (  # noqa: E402  (the tiny models, shared with the Kronecker and language-model tests)
    EmbeddingModel, HFConv1DModel, TokenModel, TwiceModel, conv1d_model, conv2d_model, labels, masked_batch,
    text_batch, tiny_bert, tiny_gpt2, tiny_llama,
)


# ----------------------------------------------------------------------------- models


class NormsModel(nn.Module):
    """Conv1d -> GroupNorm -> BatchNorm1d (running statistics) -> Linear -> RMSNorm -> LayerNorm (no bias) -> Linear."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3, padding="same", padding_mode="circular")
        self.gn = nn.GroupNorm(2, 4)
        self.bn = nn.BatchNorm1d(4)
        self.lin = nn.Linear(24, 6)
        self.rms = nn.RMSNorm(6, eps=1e-5)
        self.ln = nn.LayerNorm(6, bias=False)
        self.out = nn.Linear(6, 3)
        with torch.no_grad():
            for p in (self.gn.weight, self.gn.bias, self.bn.weight, self.bn.bias, self.rms.weight, self.ln.weight):
                p.uniform_(0.5, 1.5)
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        h = self.bn(self.gn(torch.tanh(self.conv(x))))
        return self.out(self.ln(self.rms(torch.tanh(self.lin(h.flatten(1))))))


class PaddedConvModel(nn.Module):
    """Conv2d with 'same' padding, an even kernel and dilation, then a reflect-padded strided Conv2d."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 3, (4, 3), padding="same", dilation=(1, 2))
        self.b = nn.Conv2d(3, 2, 3, stride=2, padding=1, padding_mode="reflect")
        self.out = nn.Linear(32, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.b(torch.tanh(self.a(x)))).flatten(1))


class UncoveredModel(nn.Module):
    """A bare nn.Parameter: no module call the hooks could see."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        return self.lin(x) * self.scale


class ReuseModel(nn.Module):
    """fc's weight is also used through F.linear, outside fc's call."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        return self.out(torch.tanh(F.linear(torch.tanh(self.fc(x)), self.fc.weight)))


class InteractModel(nn.Module):
    """Subtracts the batch mean: examples interact."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        h = self.lin(x)
        return self.out(torch.tanh(h - 0.5 * h.mean(0, keepdim=True)))


class FlatBatchModel(nn.Module):
    """Runs its Linear on [n * T, d] (the batch is not the first dimension of the module's input)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):  # x [n, T, 4]
        return self.out(torch.tanh(self.lin(x.reshape(-1, 4))).reshape(x.shape).mean(1))


def custom_margin(logits, batch):
    """A custom task: half the built-in margin plus the mean logit; Q from the built-in."""
    f, q = classification_margin(logits, batch["labels"])
    return 0.5 * f + logits.mean(-1), q


def seeded(cls):
    return lambda: (torch.manual_seed(0), cls())[1]


def digits_mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return build_model("mlp", in_dim=64, hidden_dim=128, num_classes=10, depth=2).to(dtype)


def randn(*shape, dtype=torch.float32):
    return lambda: torch.randn(*shape, generator=torch.Generator().manual_seed(2), dtype=dtype)


CASES = {
    # name: (model builder, batch builder, task, grad_wrt, classes)
    "digits_mlp": (digits_mlp, randn(16, 64), "classification", None, 10),
    "digits_mlp_float64": (lambda: digits_mlp(torch.float64), randn(6, 64, dtype=torch.float64), "classification",
                           None, 10),
    "mlp_grad_wrt_subset": (digits_mlp, randn(7, 64), "classification", ["3.*", "5.bias"], 10),
    "conv2d_batchnorm": (conv2d_model, randn(5, 2, 8, 8), "classification", None, 5),
    "conv2d_same_reflect": (seeded(PaddedConvModel), randn(4, 2, 8, 8), "classification", None, 3),
    "conv1d": (conv1d_model, randn(5, 3, 10), "classification", None, 3),
    "norms": (seeded(NormsModel), randn(5, 3, 6), "classification", None, 3),
    "embedding": (seeded(EmbeddingModel), lambda: torch.randint(0, 23, (5, 4), generator=torch.Generator().manual_seed(2)),
                  "classification", None, 3),
    "linear3d_mask_padding_idx": (seeded(TokenModel), lambda: text_batch(6, 7), "text_classification", None, 3),
    "hf_conv1d": (seeded(HFConv1DModel), randn(4, 5, 6), "classification", None, 3),
    "linear_called_twice": (seeded(TwiceModel), randn(4, 5), "classification", None, 3),
    "custom_task": (digits_mlp, randn(6, 64), custom_margin, None, 10),
    "bert": (tiny_bert, lambda: text_batch(5, 9), "text_classification", None, 3),
    "bert_grad_wrt_subset": (tiny_bert, lambda: text_batch(5, 9), "text_classification",
                             ["bert.encoder.layer.1.*", "classifier.*"], 3),
    "gpt2_lm": (tiny_gpt2, lambda: text_batch(5, 9), "language_modeling", None, 3),
}


def assert_grads_equal(got: dict, ref: dict, names: list[str], rtol: float = 1e-4):
    """Per parameter: rtol relative to its largest entry, with a floor of 1e-6 of the largest entry of any
    parameter (BERT's key biases have gradients of ~1e-13, pure rounding, in both methods)."""
    assert list(got) == names and list(ref) == names
    floor = 1e-6 * max(float(t.abs().max()) for t in ref.values())
    for name in names:
        assert got[name].shape == ref[name].shape and got[name].dtype == ref[name].dtype, name
        atol = rtol * float(ref[name].abs().max()) + floor
        torch.testing.assert_close(got[name], ref[name], rtol=rtol, atol=atol, msg=lambda m, k=name: f"{k}: {m}")


# ----------------------------------------------------------------------------- hooks == vmap


@pytest.mark.parametrize("case", list(CASES))
def test_hook_gradients_equal_vmap_gradients(case):
    make, batch, task, wrt, classes = CASES[case]
    model, x = make(), batch()
    n = len(x["input_ids"]) if isinstance(x, dict) else len(x)
    y = labels(n, classes)
    grads = per_example_gradients(model, wrt, task)
    assert isinstance(grads, LayerGradients) and grads.method == "hooks"  # auto picks hooks: every parameter covered
    g, q = grads(x, y)
    assert grads.method == "hooks" and grads.reason is None and grads.checked  # the guard passed
    ref = PerExampleGradients(model, wrt, task)
    rg, rq = ref(x, y)
    assert grads.param_names == ref.param_names and grads.grad_dim == ref.grad_dim
    assert grads.param_shapes == ref.param_shapes
    flat = grads.flatten(rg)
    assert bool(flat.abs().sum(1).gt(0).all())  # a test that can fail: every example has a gradient
    assert_grads_equal(g, rg, ref.param_names)
    torch.testing.assert_close(q, rq.to(torch.float32), rtol=1e-5, atol=1e-6)
    assert q.dtype == torch.float32
    assert all(p.grad is None for p in model.parameters())  # no .grad was written
    assert all(p.requires_grad for p in model.parameters())  # flags restored
    g2, _ = grads(x, y)  # later batches skip the guard and give the same gradients
    assert all(torch.equal(g[k], g2[k]) for k in g)


def test_frozen_parameters_selected_still_get_gradients():
    model = digits_mlp()
    for p in model.parameters():
        p.requires_grad_(False)
    x, y = randn(5, 64)(), labels(5, 10)
    g, _ = LayerGradients(model)(x, y)
    rg, _ = PerExampleGradients(model)(x, y)
    assert_grads_equal(g, rg, list(rg))
    assert not any(p.requires_grad for p in model.parameters())


def test_an_empty_batch_gives_empty_gradients():
    grads = LayerGradients(digits_mlp())
    g, q = grads(torch.zeros(0, 64), torch.zeros(0, dtype=torch.int64))
    assert q.shape == (0,) and all(g[k].shape == (0, *s) for k, s in grads.param_shapes.items())


# ----------------------------------------------------------------------------- auto falls back, hooks refuses


def test_auto_uses_vmap_for_an_uncovered_parameter_and_hooks_names_it():
    model, x, y = seeded(UncoveredModel)(), randn(4, 5)(), labels(4)
    grads = per_example_gradients(model)
    assert isinstance(grads, PerExampleGradients) and grads.method == "vmap"
    assert "scale (UncoveredModel)" in grads.reason and "torch.func.vmap" in grads.reason
    with pytest.raises(ConfigError, match=r"gradient_method: hooks covers .*: scale \(UncoveredModel\); .*grad_wrt"):
        per_example_gradients(model, method="hooks")
    hooks = per_example_gradients(model, ["lin.*"], method="hooks")  # leaving it out makes hooks possible
    g, _ = hooks(x, y)
    assert_grads_equal(g, PerExampleGradients(model, ["lin.*"])(x, y)[0], ["lin.weight", "lin.bias"])


@pytest.mark.parametrize("cls, shape, why", [
    (ReuseModel, (6, 5), "fc.weight do not add up to its batch gradient"),
    (InteractModel, (6, 5), "examples interact"),
    (FlatBatchModel, (6, 3, 4), "module lin ran on a tensor of batch dimension 18"),
])
def test_auto_falls_back_to_vmap_when_the_guard_fails_and_hooks_raises(cls, shape, why):
    model, x, y = seeded(cls)(), randn(*shape)(), labels(shape[0])
    grads = per_example_gradients(model)
    assert isinstance(grads, LayerGradients) and grads.reason is None  # every parameter is in a hooked module
    g, q = grads(x, y)
    assert grads.method == "vmap" and why in grads.reason
    rg, rq = PerExampleGradients(model)(x, y)
    assert all(torch.equal(g[k], rg[k]) for k in rg) and torch.equal(q, rq)
    g2, _ = grads(x[:3], y[:3])  # for good
    assert all(torch.equal(g2[k], PerExampleGradients(model)(x[:3], y[:3])[0][k]) for k in rg)
    with pytest.raises(GradientError, match=f"gradient_method hooks: .*{why}.*use gradient_method auto"):
        per_example_gradients(model, method="hooks")(x, y)


def test_the_hooks_are_not_exact_on_those_models():  # what the guard protects from: hooks alone would be wrong
    for cls, shape in ((ReuseModel, (6, 5)), (InteractModel, (6, 5))):
        model, x, y = seeded(cls)(), randn(*shape)(), labels(shape[0])
        grads = LayerGradients(model)
        grads.checked = True  # skip the guard
        g, _ = grads(x, y)
        rg, _ = PerExampleGradients(model)(x, y)
        assert not torch.allclose(g["fc.weight" if cls is ReuseModel else "lin.weight"],
                                  rg["fc.weight" if cls is ReuseModel else "lin.weight"], atol=1e-4)


def test_llama_rms_norm_is_hooked_and_equals_vmap():
    """Tiny Llama (LlamaRMSNorm in float32 inside, rotary attention, tied head) with a completion mask: auto
    chooses the hooks, the guard passes, and every parameter, the RMSNorm weights included, equals vmap."""
    model = tiny_llama()
    inputs, y = masked_batch("completion", seed=3)
    grads = per_example_gradients(model, None, "language_modeling")
    assert isinstance(grads, LayerGradients) and grads.method == "hooks"
    norms = [n for n in grads.param_names if n.endswith("layernorm.weight") or n == "model.norm.weight"]
    assert len(norms) == 5
    assert {u.kind.name for u in grads.uses if u.weight in norms} == {"hf_rms_norm"}
    g, q = grads(inputs, y)
    assert grads.method == "hooks" and grads.checked
    rg, rq = PerExampleGradients(model, None, "language_modeling")(inputs, y)
    assert all(bool(rg[n].abs().sum(1).gt(0).all()) for n in norms)  # a test that can fail: norm gradients exist
    assert_grads_equal(g, rg, grads.param_names, rtol=1e-4)
    torch.testing.assert_close(q, rq.to(torch.float32), rtol=1e-5, atol=1e-6)


def hf_rms_model(norm_cls):
    """Linear -> ``norm_cls`` (named and placed as a transformers RMSNorm) -> Linear."""
    norm_cls.__module__ = "transformers.models.fake.modeling_fake"

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin, self.norm, self.out = nn.Linear(5, 6), norm_cls(6), nn.Linear(6, 3)
            with torch.no_grad():
                self.norm.weight.uniform_(0.5, 1.5)

        def forward(self, x):
            return self.out(self.norm(torch.tanh(self.lin(x))))

    return Model()


class MeanAbsRMSNorm(nn.Module):
    """Named like Llama's RMSNorm, with ``variance_epsilon``, but normalized by mean |x|: not Llama's formula."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(d)), eps

    def forward(self, hidden_states):
        return self.weight * (hidden_states / (hidden_states.abs().mean(-1, keepdim=True) + self.variance_epsilon))


class GemmaLikeRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``(1 + weight)`` and ``eps`` instead of ``variance_epsilon``."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(d)), eps

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


def test_an_hf_rms_norm_of_another_formula_is_caught_by_the_guard_or_refused():
    x, y = randn(6, 5)(), labels(6)
    model = hf_rms_model(MeanAbsRMSNorm)
    grads = per_example_gradients(model)
    assert isinstance(grads, LayerGradients)  # recognized by its name and variance_epsilon ...
    g, _ = grads(x, y)
    assert grads.method == "vmap" and "norm.weight do not add up to its batch gradient" in grads.reason  # ... caught
    rg, _ = PerExampleGradients(model)(x, y)
    assert all(torch.equal(g[k], rg[k]) for k in rg)
    grads = per_example_gradients(hf_rms_model(GemmaLikeRMSNorm))
    assert grads.method == "vmap" and "norm.weight (GemmaLikeRMSNorm without variance_epsilon" in grads.reason


def test_multihead_attention_out_proj_is_left_to_vmap():
    model = nn.Sequential(nn.Linear(4, 4))
    model.attn = nn.MultiheadAttention(4, 2, batch_first=True)
    grads = per_example_gradients(model)
    assert grads.method == "vmap" and "attn.out_proj.weight" in grads.reason


def test_the_featurizer_reports_the_fallback_reason_once():
    class Rec:
        def __init__(self):
            self.lines = []

        def info(self, m):
            self.lines.append(m)

    from trakcli.config import ProjectorConfig

    proj = ProjectorConfig(kind="rademacher", proj_dim=8)
    x, y = randn(6, 5)(), labels(6)
    for cls, before in ((UncoveredModel, 1), (ReuseModel, 0), (TwiceModel, 0)):
        rec = Rec()
        feat = build_featurizer(seeded(cls)(), proj, grad_wrt=None, task="classification", memory_mb=64, reporter=rec)
        assert len(rec.lines) == before
        for _ in range(3):
            feat(x, y, 0, 0)
        assert len(rec.lines) == (0 if cls is TwiceModel else 1), rec.lines
        assert all("torch.func.vmap" in m for m in rec.lines)
    with pytest.raises(ConfigError, match="did you mean 'hooks'"):
        build_featurizer(digits_mlp(), proj, grad_wrt=None, task="classification", memory_mb=64, gradient_method="hook")
    with pytest.raises(ConfigError, match="not a method"):  # checked for kind kronecker too
        build_featurizer(digits_mlp(), ProjectorConfig(kind="kronecker", proj_dim=64), grad_wrt=None,
                         task="classification", memory_mb=64, gradient_method="fast")


# ----------------------------------------------------------------------------- config key, CLI, API


def test_gradient_method_config_key():
    base = {"checkpoints": "c.pt", "data": {"train": {"builtin": "digits", "split": "train"}}, "store": "s.zarr"}
    assert load_config(base).gradient_method == "auto"
    assert load_config(base, ["gradient_method=hooks"]).gradient_method == "hooks"
    with pytest.raises(ConfigError, match=r"gradient_method: Input should be 'auto', 'hooks' or 'vmap' \(got 'hook'\)"):
        load_config({**base, "gradient_method": "hook"})
    with pytest.raises(ConfigError, match="gradient_methd: unknown key; did you mean gradient_method"):
        load_config({**base, "gradient_methd": "vmap"})


def test_stores_of_either_method_are_one_identity_with_the_same_scores(user_project):
    runner = CliRunner()
    scores = {}
    for featurize_with, score_with in (("vmap", "hooks"), ("hooks", "hooks")):
        store = f"store.path=out/{featurize_with}.zarr"
        res = runner.invoke(app, ["featurize", "run.yaml", "-q", store, f"gradient_method={featurize_with}"])
        assert res.exit_code == 0, res.stderr
        res = runner.invoke(app, ["score", "run.yaml", "-q", "--json", store, f"gradient_method={score_with}"])
        assert res.exit_code == 0, res.stderr  # a store featurized with vmap is scored with hooks: one identity
        from trakcli.store import Store

        scores[featurize_with] = Store.open_existing(user_project / f"out/{featurize_with}.zarr", mode="r").read(
            "scores/default/scores")
    assert scores["vmap"].shape == (7, 40) and abs(scores["vmap"]).max() > 0
    assert abs(scores["vmap"] - scores["hooks"]).max() <= 1e-4 * abs(scores["vmap"]).max()


def test_attributor_takes_gradient_method(tmp_path):
    from trakcli import Attributor

    model = digits_mlp()
    with pytest.raises(ConfigError, match="did you mean 'vmap'"):
        Attributor(model, store=tmp_path / "a.zarr", gradient_method="vmapp")
    att = Attributor(model, store=tmp_path / "a.zarr", projector={"kind": "sjlt", "proj_dim": 32}, gradient_method="hooks")
    assert att.featurizer.grads.method == "hooks"
