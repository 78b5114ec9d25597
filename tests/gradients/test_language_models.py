"""Causal LMs with target masks: features of every featurizer equal the projection of vmap gradients of the masked f.

Tiny Llama (RMSNorm, rotary attention, tied head) and GPT-2 models built from
transformers configs. The per-token labels follow the -100 convention (unshifted:
``labels[t]`` is token ``t`` where it is a target): prompt/completion masks, chat
masks (assistant turns only), and padding.
"""

from __future__ import annotations

import pytest
import torch

from trakcli.gradients import KroneckerFeaturizer
from trakcli.gradients.vmap import PerExampleGradients
from trakcli.jobs.setup import build_featurizer
from trakcli.config.schema import ProjectorConfig
from trakcli.tasks import IGNORE_INDEX, LanguageModeling, language_modeling_margin

transformers = pytest.importorskip("transformers")

from projects import LM_VOCAB as VOCAB, masked_batch, tiny_llama  # noqa: E402


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                     bos_token_id=1, eos_token_id=1, attn_implementation="eager")
    return GPT2LMHeadModel(cfg).eval()


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def loop_margins(model, inputs, labels):
    """f of each example alone, unpadded, by a plain loop over its target tokens."""
    out = []
    for i in range(len(labels)):
        real = int(inputs["attention_mask"][i].sum())
        ids, lab = inputs["input_ids"][i, :real], labels[i, :real]
        logits = model(input_ids=ids[None]).logits[0]
        f = sum(logits[t - 1, lab[t]] - torch.logsumexp(torch.cat([logits[t - 1, :lab[t]], logits[t - 1, lab[t] + 1:]]), 0)
                for t in range(1, real) if lab[t] != IGNORE_INDEX)
        out.append(f)
    return torch.stack(out)


def vmap_reference(model, param_names, inputs, labels):
    return PerExampleGradients(model, param_names, "language_modeling")(inputs, labels)


@pytest.mark.parametrize("name", list(MODELS))
def test_masked_margin_is_the_loop_over_target_tokens(name):
    model = MODELS[name]()
    inputs, labels = masked_batch("completion")
    with torch.no_grad():
        from trakcli.models.forward import forward

        f, q = LanguageModeling()(forward(model, inputs), {**inputs, "labels": labels})
        torch.testing.assert_close(f, loop_margins(model, inputs, labels), rtol=1e-5, atol=1e-5)
    assert ((q > 0) & (q < 1)).all()


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("name", list(MODELS))
def test_kronecker_features_are_projected_vmap_gradients_of_the_masked_f(name, kind):
    model = MODELS[name]()
    inputs, labels = masked_batch(kind, seed=3)
    feat = KroneckerFeaturizer(model, proj_dim=256, seed=1, task="language_modeling")
    phi, q = feat(inputs, labels, model_id=2)
    grads, q_ref = vmap_reference(model, feat.param_names, inputs, labels)
    ref = feat.projector.project(grads, model_id=2)
    torch.testing.assert_close(phi, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    torch.testing.assert_close(q, q_ref)
    # the mask matters: the same texts with every real token a target give other features
    everything = torch.where(inputs["attention_mask"] != 0, inputs["input_ids"], IGNORE_INDEX)
    assert not torch.allclose(feat(inputs, everything, model_id=2)[0], phi, rtol=1e-3)


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("name", list(MODELS))
def test_sjlt_features_of_hooks_and_vmap_are_the_projected_masked_gradients(name, kind):
    model = MODELS[name]()
    inputs, labels = masked_batch(kind, seed=4)
    proj = ProjectorConfig(kind="sjlt", proj_dim=128, seed=0)
    feat = build_featurizer(model, proj, grad_wrt=None, task="language_modeling", memory_mb=1024)
    phi, q = feat(inputs, labels, 0, 0)
    grads, q_ref = vmap_reference(model, None, inputs, labels)
    ref = feat.projector.project(grads, model_id=0)
    torch.testing.assert_close(phi, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    torch.testing.assert_close(q, q_ref)


def test_a_custom_task_reading_the_batch_labels_reproduces_the_builtin():
    def completion_only(logits, batch):  # as a user writes it: the labels of the batch, -100 ignored
        return language_modeling_margin(logits, batch["labels"])

    model = tiny_llama()
    inputs, labels = masked_batch("completion", seed=5)
    builtin = KroneckerFeaturizer(model, proj_dim=128, task="language_modeling")
    custom = KroneckerFeaturizer(model, proj_dim=128, task=completion_only)
    a, qa = builtin(inputs, labels, model_id=0)
    b, qb = custom(inputs, labels, model_id=0)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(qa, qb, rtol=0, atol=0)
    va, _ = PerExampleGradients(model, None, "language_modeling")(inputs, labels)
    vb, _ = PerExampleGradients(model, None, completion_only)(inputs, labels)
    for k in va:
        torch.testing.assert_close(va[k], vb[k], rtol=0, atol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_mixed_length_batch_gives_the_features_of_each_text_alone(name):
    """Padding to the batch's longest text (and cutting passes by memory) changes nothing beyond rounding."""
    model = MODELS[name]()
    inputs, labels = masked_batch("completion", n=6, length=14, seed=6)
    feat = KroneckerFeaturizer(model, proj_dim=256, task="language_modeling")
    whole, q = feat(inputs, labels, model_id=1)
    for i in range(6):
        real = int(inputs["attention_mask"][i].sum())
        one = {k: v[i:i + 1, :real] for k, v in inputs.items()}
        phi, qi = feat(one, labels[i:i + 1, :real], model_id=1)
        torch.testing.assert_close(phi[0], whole[i], rtol=1e-5, atol=1e-5 * float(whole[i].abs().max()))
        torch.testing.assert_close(qi[0], q[i], rtol=1e-5, atol=1e-7)
    small = KroneckerFeaturizer(model, proj_dim=256, task="language_modeling", memory_mb=0.05)
    phi, _ = small(inputs, labels, model_id=1)  # probe of 8 tokens, then passes of a few rows
    assert 1 <= small.rows_per_pass(inputs) < 6
    torch.testing.assert_close(phi, whole, rtol=1e-5, atol=1e-5 * float(whole.abs().max()))


def test_token_labels_out_of_range_and_tensor_inputs_are_clear_errors():
    from trakcli.errors import DataError

    model = tiny_gpt2()
    inputs, labels = masked_batch("completion", seed=7)
    labels[2, -1] = VOCAB + 3
    feat = KroneckerFeaturizer(model, proj_dim=64, task="language_modeling")
    with pytest.raises(DataError, match=r"token labels out of range in examples \[12\]"):
        feat(inputs, labels, row_offset=10)
    with pytest.raises(DataError, match="needs token data"):
        LanguageModeling().check(torch.zeros(2, 3), {"inputs": torch.zeros(2, 4), "labels": torch.zeros(2)})
