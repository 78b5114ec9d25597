"""The optimizer second-moment correction (TrackStar) equals its closed form on tiny models.

The state comes from a few real AdamW steps, saved as `trak optimize` saves it; the
reference reads the optimizer's own ``exp_avg_sq / (1 - β₂^step)``, forms the scaled
per-example gradients from exact (vmap) gradients, and projects them with the same
projector.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from projects import tiny_model
from trakcli.cli.main import app
from trakcli.config.schema import Config, ProjectorConfig
from trakcli.errors import ConfigError
from trakcli.gradients import KroneckerFeaturizer
from trakcli.gradients.second_moment import embedding_note, read_second_moments
from trakcli.gradients.vmap import PerExampleGradients
from trakcli.jobs.setup import attach_second_moment, build_featurizer
from trakcli.tasks import IGNORE_INDEX


def adamw_state(model: nn.Module, batches, task, path: Path, steps: int = 3) -> dict[str, torch.Tensor]:
    """Train ``model`` a few AdamW steps on ``batches`` (its loss: minus the task's margin), save the optimizer
    state as `trak optimize` does, and return the bias-corrected ``v`` of each parameter, by name."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        inputs, labels = batches(step)
        logits = model(**inputs).logits if isinstance(inputs, dict) else model(inputs)
        from trakcli.tasks import make_batch, resolve_task

        f, _ = resolve_task(task)(logits, make_batch(inputs, labels))
        opt.zero_grad()
        (-f.mean()).backward()
        opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"optimizer": "adamw", "projection": None,
                "param_names": [names[id(p)] for g in opt.param_groups for p in g["params"]],
                "state_dict": opt.state_dict()}, path)
    beta2 = opt.param_groups[0]["betas"][1]
    return {names[id(p)]: (s["exp_avg_sq"].double() / (1 - beta2 ** float(s["step"])))
            for p, s in opt.state.items()}


def closed_form_adafactor(v: torch.Tensor) -> torch.Tensor:
    """``1/sqrt(r cᵀ / S)``: the Adafactor factorization of ``v`` ``[d_out, d_in]`` (Shazeer & Stern 2018)."""
    r, c, s = v.sum(1), v.sum(0), v.sum()
    return s.sqrt() / (r.sqrt()[:, None] * c.sqrt()[None, :])


def scaled_layers(layers, grads, v):
    """Per parameter of ``layers``, ``D_out G D_in`` of its layer's exact per-example gradients ``G``, float64.

    An entry whose second moment's row or column is all zero (GPT-2's last position embedding:
    no target follows the last position) has an infinite closed form; its gradient must be 0
    in every example too, and its product is taken as 0."""
    n = next(iter(grads.values())).shape[0]
    scaled = {}
    for layer in layers:
        g = layer.to_matrix(grads, n).double()                    # [n, d_out, d_in]
        scale = closed_form_adafactor(layer.to_matrix({k: t[None] for k, t in v.items()}, 1)[0])
        never = ~torch.isfinite(scale)
        assert not g[:, never].any()
        scaled.update(layer.from_matrix(g * torch.where(never, 0.0, scale)))
    return scaled


def factored_reference(projector, grads, v, model_id):
    """Project ``D_out G D_in`` of each layer of a kronecker projector (the closed form, from exact gradients)."""
    return projector.project(scaled_layers(projector.layers, grads, v), model_id=model_id)


# ---------------------------------------------------------------- tiny models and data

def mlp_batch(step: int = 0, n: int = 9):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


VOCAB = 23


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=8, n_layer=1, n_head=2, n_positions=9,  # every position trained
                     bos_token_id=1, eos_token_id=1, attn_implementation="eager")
    return GPT2LMHeadModel(cfg)


def lm_batch(step: int = 0, n: int = 4, length: int = 9):
    g = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(2, VOCAB, (n, length), generator=g)
    am = torch.ones(n, length, dtype=torch.long)
    am[0, length - 3:] = 0  # one padded row
    ids[am == 0] = 0
    labels = torch.where(am != 0, ids, IGNORE_INDEX)
    labels[:, :2] = IGNORE_INDEX  # a prompt
    return {"input_ids": ids, "attention_mask": am}, labels


def trained(make, batches, task, path):
    model = make().train()
    v = adamw_state(model, batches, task, path)
    return model.eval(), v


# ---------------------------------------------------------------- closed forms

def test_adafactor_kronecker_features_of_an_mlp_equal_the_closed_form(tmp_path):
    state = tmp_path / "optimizer_state" / "model_0.pt"
    model, v = trained(tiny_model, mlp_batch, "classification", state)
    feat = KroneckerFeaturizer(model, proj_dim=24, seed=3, dtype=torch.float64)
    attach_second_moment(feat, model, "adafactor", [state, state], eps=0.0)
    x, y = mlp_batch(7)
    phi, _ = feat(x, y, model_id=1)
    grads, _ = PerExampleGradients(model, feat.param_names, "classification")(x, y)
    ref = factored_reference(feat.projector, grads, v, model_id=1)
    torch.testing.assert_close(phi, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    plain = KroneckerFeaturizer(model, proj_dim=24, seed=3, dtype=torch.float64)(x, y, model_id=1)[0]
    assert not torch.allclose(plain, phi, rtol=1e-2)  # the correction changes the features


def test_adafactor_kronecker_features_of_a_tiny_gpt2_equal_the_closed_form(tmp_path):
    pytest.importorskip("transformers")
    state = tmp_path / "state.pt"
    model, v = trained(tiny_gpt2, lm_batch, "language_modeling", state)
    feat = KroneckerFeaturizer(model, proj_dim=96, seed=1, dtype=torch.float64, task="language_modeling")
    # a tied wte / lm_head (a transposed use), Conv1D layers, the position embedding, biases
    assert any(lay.has_bias for lay in feat.projector.layers) and "transformer.wte.weight" in feat.param_names
    attach_second_moment(feat, model, "adafactor", [state], eps=1e-30)  # the last wpe row has v = 0
    inputs, labels = lm_batch(5)
    phi, _ = feat(inputs, labels, model_id=0)
    grads, _ = PerExampleGradients(model, feat.param_names, "language_modeling")(inputs, labels)
    ref = factored_reference(feat.projector, grads, v, model_id=0)
    torch.testing.assert_close(phi, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_adafactor_on_whole_gradients_equals_the_kronecker_scaling_and_scales_vectors_elementwise(tmp_path):
    pytest.importorskip("transformers")
    state = tmp_path / "state.pt"
    model, v = trained(tiny_gpt2, lm_batch, "language_modeling", state)
    feat = build_featurizer(model, ProjectorConfig(kind="rademacher", proj_dim=32, seed=0), grad_wrt=None,
                            task="language_modeling", memory_mb=64, gradient_method="vmap")
    second = attach_second_moment(feat, model, "adafactor", [state], eps=1e-30)
    inputs, labels = lm_batch(6)
    phi, _ = feat(inputs, labels, 0, 0)
    grads, _ = PerExampleGradients(model, None, "language_modeling")(inputs, labels)
    kron = KroneckerFeaturizer(model, proj_dim=96, task="language_modeling")
    scaled = {k: t.float() for k, t in scaled_layers(kron.projector.layers, grads, v).items()}  # D_out G D_in
    vectors = [n for n in grads if n not in scaled]
    assert vectors and all(v[n].dim() == 1 for n in vectors)  # the layer norms: elementwise
    scaled.update({n: grads[n] / v[n].sqrt().float() for n in vectors})
    ref = feat.projector.project(torch.cat([scaled[n].reshape(len(labels), -1) for n in second.param_names], 1))
    torch.testing.assert_close(phi, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_adam_scales_each_entry_by_one_over_sqrt_v_plus_eps(tmp_path):
    state = tmp_path / "state.pt"
    model, v = trained(tiny_model, mlp_batch, "classification", state)
    eps = 1e-6
    feat = build_featurizer(model, ProjectorConfig(kind="rademacher", proj_dim=16, seed=2), grad_wrt=None,
                            task="classification", memory_mb=64, gradient_method="vmap")
    attach_second_moment(feat, model, "adam", [state], eps=eps)
    x, y = mlp_batch(8)
    phi, _ = feat(x, y, 0, 0)
    grads, _ = PerExampleGradients(model, None, "classification")(x, y)
    flat = torch.cat([(grads[n] / (v[n] + eps).sqrt().float()).reshape(len(y), -1) for n in feat.param_names], 1)
    ref = feat.projector.project(flat, model_id=0)
    torch.testing.assert_close(phi, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    with pytest.raises(ConfigError, match="kronecker never forms"):
        attach_second_moment(KroneckerFeaturizer(model, proj_dim=8), model, "adam", [state])


def test_default_eps_is_the_optimizers_eps_squared_and_v_is_bias_corrected(tmp_path):
    state = tmp_path / "state.pt"
    model, v = trained(tiny_model, mlp_batch, "classification", state)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    read, eps = read_second_moments(state, list(shapes), shapes)
    assert eps == 1e-8
    for n in shapes:
        torch.testing.assert_close(read[n], v[n])


# ---------------------------------------------------------------- refusals and the store

def test_a_state_of_another_optimizer_is_refused_naming_the_parameter(tmp_path):
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(mlp_batch()[0]).sum().backward()
    opt.step()
    names = [n for n, _ in model.named_parameters()]
    torch.save({"optimizer": "sgd", "projection": None, "param_names": names, "state_dict": opt.state_dict()},
               tmp_path / "s.pt")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    with pytest.raises(ConfigError, match=r"optimizer 'sgd'\) has no exp_avg_sq for it: parameter '0.weight'"):
        read_second_moments(tmp_path / "s.pt", names, shapes)


@pytest.fixture
def with_states(user_project):
    """The user project with an AdamW optimizer state beside each checkpoint (ckpts/optimizer_state/model_i.pt)."""
    for i in range(2):
        model = tiny_model(seed=i).train()
        adamw_state(model, mlp_batch, "classification", user_project / "ckpts" / "optimizer_state" / f"model_{i}.pt")
        torch.save(model.state_dict(), user_project / "ckpts" / f"model_{i}.pt")
    return user_project


def trak(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_a_missing_state_is_refused_in_one_line_naming_save_optimizer_state(with_states):
    (with_states / "ckpts" / "optimizer_state" / "model_1.pt").unlink()
    res = trak("featurize", "run.yaml", "-q", "second_moment=adafactor")
    assert res.exit_code == 1
    line = res.stderr.strip()
    assert "\n" not in line and "optimize.save_optimizer_state: true" in line and "model_1.pt" in line
    assert "model_id 1" in line


def test_the_correction_is_part_of_the_store_identity_and_its_files_are_recorded(with_states):
    import zarr

    assert trak("featurize", "run.yaml", "-q").exit_code == 0
    res = trak("featurize", "run.yaml", "-q", "second_moment=adafactor")
    assert res.exit_code == 1 and "second_moment.kind" in res.stderr
    res = trak("featurize", "run.yaml", "-q", "second_moment=adafactor", "--overwrite")
    assert res.exit_code == 0, res.stderr
    attrs = zarr.open_group("out/attrib.zarr", mode="r")["train/1"].attrs
    from trakcli.models import file_sha256

    state = with_states / "ckpts" / "optimizer_state" / "model_1.pt"
    assert attrs["optimizer_state"].endswith("model_1.pt") and attrs["optimizer_state_sha256"] == file_sha256(state)
    assert trak("featurize", "run.yaml", "-q", "second_moment=adafactor").exit_code == 0  # finished: nothing to do
    assert trak("score", "run.yaml", "-q", "second_moment=adafactor", "--out", "s.npy").exit_code == 0
    res = trak("featurize", "run.yaml", "-q", "second_moment=adam")
    assert res.exit_code == 1 and "second_moment.kind" in res.stderr
    # another state file for the same checkpoint is refused like another checkpoint
    adamw_state(tiny_model(seed=5).train(), mlp_batch, "classification", state, steps=1)
    res = trak("featurize", "run.yaml", "-q", "second_moment=adafactor")
    assert res.exit_code == 1 and "optimizer state" in res.stderr and "--overwrite" in res.stderr


def test_config_refuses_adam_with_kronecker_and_takes_the_short_form():
    base = {"checkpoints": "c.pt", "data": {"train": {"builtin": "digits", "split": "train"}}, "store": "s.zarr"}
    assert Config.model_validate({**base, "second_moment": "adafactor"}).second_moment.kind == "adafactor"
    assert Config.model_validate(base).second_moment.kind is None
    assert Config.model_validate({**base, "second_moment": None}).second_moment.kind is None
    with pytest.raises(Exception, match="kronecker never forms"):
        Config.model_validate({**base, "second_moment": "adam", "projector": {"kind": "kronecker"}})


def test_featurize_reads_the_state_a_trak_optimize_manifest_records(user_project):
    import yaml

    cfg = yaml.safe_load(Path("run.yaml").read_text())
    cfg.update(checkpoints="trained/manifest.json", projector={"kind": "kronecker", "proj_dim": 16},
               optimize={"n_models": 1, "epochs": 2, "batch_size": 8, "out_dir": "trained", "optimizer": "adamw",
                         "lr": 1e-2})
    Path("opt.yaml").write_text(yaml.safe_dump(cfg))
    assert trak("optimize", "opt.yaml", "-q").exit_code == 0
    res = trak("featurize", "opt.yaml", "-q", "second_moment=adafactor")
    assert res.exit_code == 1 and "optimize.save_optimizer_state: true" in res.stderr
    assert trak("optimize", "opt.yaml", "-q", "optimize.save_optimizer_state=true", "--overwrite").exit_code == 0
    res = trak("featurize", "opt.yaml", "-q", "second_moment=adafactor")
    assert res.exit_code == 0, res.stderr
    import zarr

    attrs = zarr.open_group("out/attrib.zarr", mode="r")["train/0"].attrs
    assert Path(attrs["optimizer_state"]) == Path("trained/optimizer_state/model_000.pt")


def test_a_corrected_embedding_gets_a_note_naming_it_and_grad_wrt():
    model = tiny_gpt2()
    names = [n for n, _ in model.named_parameters()]
    note = embedding_note(model, names)
    assert note is not None and "\n" not in note
    assert "transformer.wte.weight" in note and "transformer.wpe.weight" in note and "grad_wrt" in note
    assert embedding_note(model, [n for n in names if n.startswith("transformer.h.")]) is None
    assert embedding_note(tiny_model(), [n for n, _ in tiny_model().named_parameters()]) is None
