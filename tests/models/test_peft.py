"""PEFT adapters: LoRA adapter folders as checkpoints, their features against vmap gradients, and `optimize.lora`.

The references differentiate the language-modeling margin of each row with
``torch.func`` on a ``peft.PeftModel`` loaded by peft itself
(``PeftModel.from_pretrained``), independently of trakcli's wrapping and hooks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.func import functional_call, grad, vmap

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from projects import arrays, masked_batch, msg, run, tiny_llama, word_tokenizer, write_config, write_jsonl  # noqa: E402
from trakcli.gradients import KroneckerFeaturizer  # noqa: E402
from trakcli.gradients.vmap import PerExampleGradients  # noqa: E402
from trakcli.models.forward import logits_of, model_kwargs  # noqa: E402
from trakcli.models.peft import with_adapters  # noqa: E402
from trakcli.tasks import language_modeling_margin  # noqa: E402

TARGETS = ["q_proj", "v_proj", "up_proj"]
LENGTH = 10
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")


def _adapter(folder: Path, seed: int, r: int = 4, targets: list[str] = TARGETS) -> Path:
    """A LoRA adapter with random A and B (both nonzero) on the tiny Llama, saved by peft."""
    base = tiny_llama()  # seeds the global RNG itself
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=8, target_modules=targets,
                                                       init_lora_weights=False))
    model.save_pretrained(str(folder))
    return folder


def _rows(n: int, seed: int) -> list[dict]:
    inputs, labels = masked_batch("chat", n=n, length=LENGTH, seed=seed)
    out = []
    for ids, am, lab in zip(inputs["input_ids"], inputs["attention_mask"], labels):
        real = int(am.sum())
        out.append({"ids": ids[:real].tolist(), "labels": lab[:real].tolist()})
    return out


def _project(root: Path, checkpoints: list[str], extra: dict | None = None) -> dict:
    """A base tiny Llama folder, chat rows (12 train, 3 target) and a config featurizing the adapters."""
    tiny_llama().save_pretrained(str(root / "base"))
    word_tokenizer(root / "base", ["a", "b"])  # hf:DIR data takes DIR's tokenizer; the rows are token ids
    write_jsonl(root / "train.jsonl", _rows(12, 1))
    write_jsonl(root / "target.jsonl", _rows(3, 2))
    data = {"input_ids": "ids", "labels": "labels", "max_length": LENGTH}
    cfg = {
        "model": {"entrypoint": "hf:base", "kwargs": {"model_class": "causal_lm"}},
        "task": "language_modeling",
        "checkpoints": checkpoints,
        "data": {"train": {"path": "train.jsonl", **data}, "target": {"path": "target.jsonl", **data},
                 "batch_size": 5},
        "projector": {"kind": "noop"},
        "store": {"path": "s.zarr", "chunk_rows": 4, "dtype": "float32"},
        "num_threads": 1,
        **(extra or {}),
    }
    write_config(root / "run.yaml", cfg)
    return cfg


def _batch(rows: list[dict]):
    ids = torch.zeros(len(rows), LENGTH, dtype=torch.long)
    am = torch.zeros(len(rows), LENGTH, dtype=torch.long)
    lab = torch.full((len(rows), LENGTH), -100)
    for i, r in enumerate(rows):
        ids[i, :len(r["ids"])] = torch.tensor(r["ids"])
        am[i, :len(r["ids"])] = 1
        lab[i, :len(r["labels"])] = torch.tensor(r["labels"])
    return ids, am, lab


def _vmap_gradients(root: Path, adapter: Path) -> tuple[list[str], torch.Tensor]:
    """``(names, [n_train, grad_dim])``: per-row gradients of the margin w.r.t. the adapter's parameters."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(root / "base"), attn_implementation="eager")
    model = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    names = [n for n, p in model.named_parameters() if "lora_" in n]
    params = {n: p.detach() for n, p in model.named_parameters() if n in names}
    ids, am, lab = _batch(_rows(12, 1))

    def f(p, i, a, y):
        x = {"input_ids": i[None], "attention_mask": a[None]}
        logits = logits_of(functional_call(model, p, args=(), kwargs=model_kwargs(base, x)))
        return language_modeling_margin(logits, y[None])[0].sum()

    g = vmap(grad(f), in_dims=(None, 0, 0, 0))(params, ids, am, lab)
    return names, torch.cat([g[n].reshape(len(ids), -1) for n in names], 1)


def test_featurize_of_lora_adapters_equals_vmap_gradients_of_the_adapter_parameters(tmp_path):
    ads = [_adapter(tmp_path / f"ad{k}", seed=10 + k) for k in range(2)]
    _project(tmp_path, ["ad0", "ad1"])
    res = run(tmp_path, "featurize", "run.yaml")
    assert res.returncode == 0, msg(res)
    stored = arrays(tmp_path / "s.zarr")
    for k, ad in enumerate(ads):
        names, ref = _vmap_gradients(tmp_path, ad)
        assert ref.shape == (12, 768) and bool(ref.abs().sum(1).gt(0).all())
        np.testing.assert_allclose(stored[f"train/{k}/features"], ref.numpy(), rtol=1e-4,
                                   atol=1e-4 * float(ref.abs().max()))
    assert not np.allclose(stored["train/0/features"], stored["train/1/features"])  # each checkpoint its own


def test_kronecker_features_factor_lora_a_and_b_as_their_own_layers():
    base = tiny_llama()
    torch.manual_seed(3)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                               init_lora_weights=False))
    model.trak_trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    feat = KroneckerFeaturizer(model, proj_dim=96, seed=2, task="language_modeling")
    assert feat.param_names == model.trak_trainable  # every adapter weight, no base weight
    assert {layer.name.rsplit(".", 2)[-2] for layer in feat.layers} == {"lora_A", "lora_B"}
    ids, am, lab = _batch(_rows(5, 4))
    x = {"input_ids": ids, "attention_mask": am}
    phi, _ = feat(x, lab, model_id=0)
    grads, _ = PerExampleGradients(model, feat.param_names, "language_modeling")(x, lab)
    ref = feat.projector.project(grads, model_id=0)
    assert bool(ref.abs().sum(1).gt(0).all())
    torch.testing.assert_close(phi, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_optimize_lora_writes_adapter_folders_whose_adam_state_corrects_the_features(tmp_path):
    _project(tmp_path, "out/manifest.json", {
        "optimize": {"n_models": 1, "out_dir": "out", "epochs": 2, "batch_size": 4, "optimizer": "adamw",
                     "lr": 0.01, "weight_decay": 0.0, "save_optimizer_state": True, "epoch_checkpoints": True,
                     "lora": {"r": 2, "target_modules": ["q_proj", "v_proj"]}},
        "second_moment": {"kind": "adam"},
    })
    res = run(tmp_path, "optimize", "run.yaml")
    assert res.returncode == 0, msg(res)
    for name in ("model_000_epoch1", "model_000"):
        assert (tmp_path / "out" / name / "adapter_config.json").is_file()
        assert (tmp_path / "out" / "optimizer_state" / name).is_file()
    res = run(tmp_path, "optimize", "run.yaml")  # a rerun keeps the adapters and their epoch checkpoints
    assert res.returncode == 0 and "out/model_000 exists, kept" in msg(res), msg(res)
    res = run(tmp_path, "featurize", "run.yaml")
    assert res.returncode == 0, msg(res)
    stored = arrays(tmp_path / "s.zarr")
    for k, name in enumerate(("model_000_epoch1", "model_000")):
        names, g = _vmap_gradients(tmp_path, tmp_path / "out" / name)
        state = torch.load(tmp_path / "out" / "optimizer_state" / name, weights_only=True)
        index = {n: i for i, n in enumerate(state["param_names"])}
        group = state["state_dict"]["param_groups"][0]
        scale = []
        for n in names:  # Adam's bias-corrected v (Kingma & Ba 2015), eps the optimizer's squared
            entry = state["state_dict"]["state"][index[n]]
            v = entry["exp_avg_sq"].double() / (1 - group["betas"][1] ** float(entry["step"]))
            scale.append((v + group["eps"] ** 2).rsqrt().reshape(-1))
        ref = g.double() * torch.cat(scale)
        assert g.shape[1] == 2 * 2 * (2 * 16 + 16 + 8)  # two layers' q (16 -> 16) and v (16 -> 8) adapters, r 2
        np.testing.assert_allclose(stored[f"train/{k}/features"], ref.numpy(), rtol=1e-4,
                                   atol=1e-4 * float(ref.abs().max()))


def test_adapters_mixed_with_whole_checkpoints_or_of_another_rank_are_one_clear_error_each(tmp_path):
    _adapter(tmp_path / "ad0", seed=1)
    _adapter(tmp_path / "ad_r2", seed=2, r=2)
    _project(tmp_path, ["ad0", "ad_r2"])
    torch.save(tiny_llama().state_dict(), tmp_path / "whole.pt")
    res = run(tmp_path, "featurize", "run.yaml")
    assert res.returncode == 1 and "ad_r2 does not fit the model's adapter" in msg(res), msg(res)
    assert "same adapter config" in msg(res)
    res = run(tmp_path, "featurize", "run.yaml", "checkpoints=[ad0,whole.pt]", "--overwrite")
    assert res.returncode == 1 and "1 of 2 are PEFT adapter folders, but 'whole.pt' is not" in msg(res), msg(res)


def test_a_plain_model_given_an_adapter_folder_names_the_fix(tmp_path):
    from trakcli.errors import CheckpointError
    from trakcli.models.checkpoints import load_checkpoint

    ad = _adapter(tmp_path / "ad0", seed=1)
    with pytest.raises(CheckpointError, match="is a PEFT adapter folder but the model is not a PEFT model"):
        load_checkpoint(tiny_llama(), ad)
    wrapped = with_adapters(tiny_llama(), [ad])
    load_checkpoint(wrapped, ad)
    ref = peft.PeftModel.from_pretrained(tiny_llama(), str(ad))
    own = dict(wrapped.named_parameters())
    for n, p in ref.named_parameters():
        if "lora_" in n:
            torch.testing.assert_close(own[n], p)


def test_an_adapter_folder_loads_its_adapter_weights_beside_full_model_weights_and_names_missing_ones(tmp_path):
    from trakcli.errors import CheckpointError
    from trakcli.models.checkpoints import load_checkpoint

    ad = _adapter(tmp_path / "ad0", seed=1)
    torch.save(tiny_llama().state_dict(), ad / "pytorch_model.bin")  # full-model weights beside the adapter's
    wrapped = with_adapters(tiny_llama(), [ad])
    load_checkpoint(wrapped, ad)
    ref = peft.PeftModel.from_pretrained(tiny_llama(), str(ad))
    own = dict(wrapped.named_parameters())
    lora = [n for n, _ in ref.named_parameters() if "lora_" in n]
    assert lora
    for n, p in ref.named_parameters():
        if "lora_" in n:
            torch.testing.assert_close(own[n], p)
    for f in ad.glob("adapter_model.*"):
        f.unlink()
    with pytest.raises(CheckpointError, match="has adapter_config.json but no weights .*save_pretrained"):
        load_checkpoint(wrapped, ad)


def test_lora_with_init_checkpoint_is_refused_naming_the_fix(tmp_path):
    _project(tmp_path, "out/manifest.json", {
        "optimize": {"n_models": 1, "out_dir": "out", "init_checkpoint": "whole.pt", "lora": {"r": 2}},
    })
    res = run(tmp_path, "optimize", "run.yaml")
    assert res.returncode == 1 and "lora with init_checkpoint" in msg(res) and "hf:DIR" in msg(res), msg(res)


def test_a_peft_model_in_the_python_api_differentiates_its_adapter_and_loads_adapter_folders(tmp_path):
    import trakcli
    from trakcli.errors import ConfigError

    ads = [_adapter(tmp_path / f"ad{k}", seed=10 + k) for k in range(2)]
    ids, am, lab = _batch(_rows(6, 1))
    batch = ({"input_ids": ids, "attention_mask": am}, lab)
    frozen = peft.PeftModel.from_pretrained(tiny_llama(), str(ads[0]))  # inference mode: nothing trainable
    with pytest.raises(ConfigError, match="is_trainable=True"):
        trakcli.Attributor(frozen, store=tmp_path / "f.zarr", task="language_modeling", projector={"kind": "noop"})
    model = peft.PeftModel.from_pretrained(tiny_llama(), str(ads[0]), is_trainable=True)
    att = trakcli.Attributor(model, store=tmp_path / "a.zarr", task="language_modeling", projector={"kind": "noop"})
    for k, ad in enumerate(ads):
        att.featurize([batch], checkpoint=ad, model_id=k)
    stored = arrays(tmp_path / "a.zarr")
    for k in range(2):
        assert stored[f"train/{k}/features"].shape == (6, 768)  # the adapter's parameters only
    assert not np.allclose(stored["train/0/features"], stored["train/1/features"])
