"""Metagradients through the training of a tiny GPT-2 (transformers): tied input / output embeddings,
torch's default scaled-dot-product attention, a padded row; against plain autograd through every step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from trakcli.tasks import resolve_task  # noqa: E402
from trakcli.train import Recipe, ReplayRecorder, TensorRows, Trainer  # noqa: E402
from trakcli.unroll import ReplayRecord, Unroller, initial_state, update  # noqa: E402
from trakcli.unroll.metagrad import differentiable_attention  # noqa: E402

V, L, N = 24, 8, 12
TASK = resolve_task("language_modeling")


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # attention: transformers' default (sdpa)
    return GPT2LMHeadModel(cfg)


def rows():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (N + 3, L), generator=g)
    mask = torch.ones(N + 3, L, dtype=torch.int64)
    mask[2, 5:] = 0  # a padded row (its last tokens are no targets)
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    x = {"input_ids": ids, "attention_mask": mask}
    train = ({k: v[:N] for k, v in x.items()}, labels[:N])
    target = ({k: v[N:] for k, v in x.items()}, labels[N:])
    return train, target


def summed_loss(model: nn.Module, params: dict, x: dict, y: torch.Tensor) -> torch.Tensor:
    """Each row's summed next-token cross-entropy over its target tokens, ``[b]`` (the reference's own)."""
    logits = torch.func.functional_call(model, params, (), {"input_ids": x["input_ids"],
                                                            "attention_mask": x["attention_mask"]}).logits
    lp = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), y[:, 1:], reduction="none")  # [b, L-1]
    return lp.sum(1)


def test_gpt2_with_tied_embeddings_and_sdpa_equals_autograd_through_the_steps(tmp_path):
    (x, y), (tx, ty) = rows()
    trained = gpt2()
    assert trained.lm_head.weight is trained.transformer.wte.weight  # tied: one trainable tensor, two names
    recipe = Recipe(epochs=2, batch_size=4, optimizer="adamw", lr=1e-2, weight_decay=0.1)
    Trainer(trained, TensorRows(x, y), recipe, task=TASK, seed=1).fit(replay=ReplayRecorder(tmp_path / "r", 2))
    record = ReplayRecord(tmp_path / "r")
    u = Unroller(gpt2(), TensorRows(x, y), record, TASK)
    assert "lm_head.weight" not in u.names and "lm_head.weight" not in u.fixed
    final = u.final_params()
    for k, v in trained.named_parameters():
        torch.testing.assert_close(final[k], v.detach(), rtol=1e-4, atol=1e-4)  # functional AdamW against torch.optim's
    got = u.metagradients(tx, ty)
    assert u.vmapped  # the three targets' adjoints went through vmap, not the loop

    # reference: autograd through every step at once (create_graph), w a leaf [N]
    snap = record.state(0)
    params = {k: snap["model"][k].clone().requires_grad_() for k in u.names}
    state, count = initial_state(u.hyper, params, snap["optimizer"], u.names)
    w = torch.ones(N, requires_grad=True)
    with differentiable_attention():
        for step in record.steps(TensorRows(x, y), snap):
            n_tok = int((step.labels[:, 1:] != -100).sum())
            loss = (w[step.rows] * summed_loss(u.model, params, step.inputs, step.labels)).sum() / n_tok
            grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
            params, state = update(u.hyper, params, state, dict(zip(params, grads)), step.lr, count + 1)
            count += 1
        target = summed_loss(u.model, params, tx, ty)
        want = torch.stack([torch.autograd.grad(target[j], w, retain_graph=True)[0] for j in range(3)])
    assert got.shape == (3, N) and want.abs().max() > 1e-3
    # float32 both ways (Adam's 1 / sqrt(v) of the first steps amplifies rounding): agreement to 1e-3 of the largest
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3 * float(want.abs().max()))
