"""TrakCallback: transformers' Trainer and TRL's SFTTrainer write checkpoints, AdamW state and a manifest that
`trak featurize` reads.

The reference is `trak optimize` itself: the Trainer is set to its recipe (the same
tiny Llama folder, AdamW with lr 0.01, no weight decay, betas and eps the defaults of
both, constant learning rate without warmup, no gradient clipping, batches of 4, and
the data order `trak optimize` draws: one ``torch.randperm`` per epoch from a
generator seeded with the recipe's seed, given to the Trainer as its sampler). Both
then train the same model the same way, so the callback's checkpoints and Adam
second moments must equal those `trak optimize` writes, and featurizing either
manifest with ``second_moment: adam`` must give the same features.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from projects import LM_VOCAB, arrays, msg, run, tiny_llama, word_tokenizer, write_config, write_jsonl  # noqa: E402
from trakcli.config import load_config  # noqa: E402
from trakcli.jobs.inputs import resolve_checkpoints, resolve_optimizer_states  # noqa: E402
from trakcli.errors import ArgumentError, ConfigError  # noqa: E402
from trakcli.integrations import TrakCallback  # noqa: E402
from trakcli.models import file_sha256, load_checkpoint  # noqa: E402
from trakcli.models.build import build_model  # noqa: E402

LENGTH, N_ROWS, BATCH, SEED = 8, 10, 4, 3
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def _project(root: Path, checkpoints: str, **extra) -> dict:
    """A tiny Llama folder (with a word tokenizer), 10 rows of 8 token ids, and a config for both runs."""
    tiny_llama().save_pretrained(str(root / "base"))
    word_tokenizer(root / "base", ["the", "capital", "of", "is", "a", "city"])
    g = torch.Generator().manual_seed(0)
    rows = [{"ids": torch.randint(3, LM_VOCAB, (LENGTH,), generator=g).tolist()} for _ in range(N_ROWS)]
    write_jsonl(root / "train.jsonl", [{**r, "labels": r["ids"]} for r in rows])
    cfg = {
        "model": {"entrypoint": "hf:base", "kwargs": {"model_class": "causal_lm"}},
        "task": "language_modeling",
        "checkpoints": checkpoints,
        "data": {"train": {"path": "train.jsonl", "input_ids": "ids", "labels": "labels", "max_length": LENGTH},
                 "batch_size": BATCH},
        "projector": {"kind": "sjlt", "proj_dim": 64, "seed": 0},
        "second_moment": {"kind": "adam"},
        "store": {"path": "s.zarr", "chunk_rows": 4},
        "num_threads": 1,
        **extra,
    }
    write_config(root / "run.yaml", cfg)
    return cfg


class _Rows(torch.utils.data.Dataset):
    """The rows of train.jsonl as the Trainer's default collator stacks them (every row is a target)."""

    def __init__(self, path: Path):
        self.rows = [json.loads(line)["ids"] for line in path.read_text().splitlines()]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor(self.rows[i])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class _OptimizeOrder(torch.utils.data.Sampler):
    """`trak optimize`'s data order: one ``torch.randperm(n)`` per epoch from a generator seeded with ``seed``."""

    def __init__(self, n: int, seed: int):
        self.n, self.gen = n, torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.gen).tolist())


class _OptimizeOrderTrainer(Trainer):
    def _get_train_sampler(self, train_dataset=None):
        return _OptimizeOrder(len(self.train_dataset), SEED)


def _train(root: Path, callbacks: list, *, epochs: int = 2, resume: str | None = None, **args) -> None:
    """Train the tiny Llama of ``root/base`` with the Trainer on ``root/train.jsonl``, `trak optimize`'s recipe."""
    model = build_model(f"hf:{root / 'base'}", model_class="causal_lm")
    settings = dict(
        output_dir=str(root / "hf"), num_train_epochs=epochs, per_device_train_batch_size=BATCH, learning_rate=0.01,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, optim="adamw_torch", max_grad_norm=0.0,
        use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no", seed=SEED, disable_tqdm=True,
        dataloader_num_workers=0,
    )
    settings.update(args)
    trainer = _OptimizeOrderTrainer(model=model, args=TrainingArguments(**settings),
                                    train_dataset=_Rows(root / "train.jsonl"), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)


def _second_moments(path: Path) -> dict[str, torch.Tensor]:
    """``exp_avg_sq`` by parameter name of an optimizer state file (trak optimize's format)."""
    state = torch.load(path, weights_only=True)
    return {n: state["state_dict"]["state"][i]["exp_avg_sq"] for i, n in enumerate(state["param_names"])}


def test_trainer_checkpoints_equal_trak_optimize_and_featurize_the_same_with_adam(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _project(tmp_path, "opt/manifest.json", optimize={
        "n_models": 1, "out_dir": "opt", "epochs": 2, "batch_size": BATCH, "optimizer": "adamw", "lr": 0.01,
        "weight_decay": 0.0, "save_optimizer_state": True, "epoch_checkpoints": True, "seed": SEED})
    res = run(tmp_path, "optimize", "run.yaml", "-q")
    assert res.returncode == 0, msg(res)
    _train(tmp_path, [TrakCallback(tmp_path / "cb")])

    manifest = json.loads((tmp_path / "cb" / "manifest.json").read_text())
    assert manifest["source"] == "trainer" and manifest["complete"] and manifest["n_models"] == 1
    assert manifest["recipe"]["trainer"]["learning_rate"] == 0.01 and manifest["recipe"]["trainer"]["seed"] == SEED
    assert manifest["recipe"]["trainer"]["optimizer"] == "AdamW" and manifest["train_data"]["n"] == N_ROWS
    (model,) = manifest["models"]
    assert (model["checkpoint"], model["step"], model["epoch"]) == ("model_000.pt", 6, 2)  # 3 steps per epoch
    assert [(e["epoch"], e["step"], e["checkpoint"]) for e in model["epoch_checkpoints"]] == [
        (1, 3, "model_000_epoch1.pt")]
    names = ["model_000_epoch1.pt", "model_000.pt"]  # the layout of trak optimize's epoch checkpoints
    for name in names:
        cb, opt = tmp_path / "cb" / name, tmp_path / "opt" / name
        mine, theirs = torch.load(cb, weights_only=True), torch.load(opt, weights_only=True)
        assert mine.keys() == theirs.keys()
        for k in theirs:
            torch.testing.assert_close(mine[k], theirs[k], rtol=1e-5, atol=1e-7)
        v_mine, v_theirs = _second_moments(cb.parent / "optimizer_state" / name), _second_moments(
            opt.parent / "optimizer_state" / name)
        assert v_mine.keys() == v_theirs.keys() and "model.layers.0.self_attn.q_proj.weight" in v_mine
        for n in v_theirs:
            torch.testing.assert_close(v_mine[n], v_theirs[n], rtol=1e-5, atol=1e-12)
        load_checkpoint(build_model(f"hf:{tmp_path / 'base'}", model_class="causal_lm"), cb)
    assert not torch.equal(*(torch.load(tmp_path / "cb" / n, weights_only=True)["model.norm.weight"] for n in names))

    # the callback's manifest resolves its saves and their optimizer states in training order
    mine = load_config("run.yaml", ["checkpoints=cb/manifest.json"])
    ckpts = resolve_checkpoints(mine)
    assert ckpts == [Path("cb") / n for n in names]
    assert resolve_optimizer_states(mine, ckpts) == [Path("cb/optimizer_state") / n for n in names]

    for which in ("opt", "cb"):
        res = run(tmp_path, "featurize", "run.yaml", f"checkpoints={which}/manifest.json", f"store.path={which}.zarr")
        assert res.returncode == 0, msg(res)
    theirs, mine = arrays(tmp_path / "opt.zarr"), arrays(tmp_path / "cb.zarr")
    for k in range(2):
        phi = theirs[f"train/{k}/features"]
        assert phi.shape == (N_ROWS, 64) and np.abs(phi).sum(1).min() > 0
        np.testing.assert_allclose(mine[f"train/{k}/features"], phi, rtol=1e-5, atol=1e-6 * np.abs(phi).max())
    assert not np.allclose(theirs["train/0/features"], theirs["train/1/features"])


class _Killed(Exception):
    pass


class _StopAt(TrainerCallback):
    """Raises at the end of optimizer step ``step``: a training killed there."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise _Killed(f"stopped at step {self.step}")


def test_step_saves_survive_a_resumed_training_and_an_unfinished_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _project(tmp_path, "cb/manifest.json")
    hf_saves = dict(save_strategy="steps", save_steps=4)
    with pytest.raises(_Killed):
        _train(tmp_path, [TrakCallback(tmp_path / "cb", save="steps", every=2), _StopAt(5)], **hf_saves)
    manifest = json.loads((tmp_path / "cb" / "manifest.json").read_text())
    assert not manifest["complete"] and manifest["models"][0]["checkpoint"] == "model_000_step4.pt"
    with pytest.raises(ConfigError, match="Trainer training that did not end .* resume it"):
        resolve_checkpoints(load_config("run.yaml"))

    # resumed from the Trainer's checkpoint at step 4: the saves up to it are kept, the rest written
    _train(tmp_path, [TrakCallback(tmp_path / "cb", save="steps", every=2)], resume=str(tmp_path / "hf" / "checkpoint-4"),
           **hf_saves)
    manifest = json.loads((tmp_path / "cb" / "manifest.json").read_text())
    (model,) = manifest["models"]
    assert manifest["complete"] and (model["checkpoint"], model["step"]) == ("model_000.pt", 6)
    assert [(e["step"], e["checkpoint"]) for e in model["epoch_checkpoints"]] == [
        (2, "model_000_step2.pt"), (4, "model_000_step4.pt")]
    cfg = load_config("run.yaml")
    assert [p.name for p in resolve_checkpoints(cfg)] == ["model_000_step2.pt", "model_000_step4.pt", "model_000.pt"]
    steps = [int(torch.load(p, weights_only=True)["state_dict"]["state"][0]["step"])
             for p in resolve_optimizer_states(cfg, resolve_checkpoints(cfg))]
    assert steps == [2, 4, 6]

    # a save changed since: named by its step, with the fix
    step2 = tmp_path / "cb" / "model_000_step2.pt"
    torch.save({k: v + 1 for k, v in torch.load(step2, weights_only=True).items()}, step2)
    with pytest.raises(ConfigError, match=r"\(model 0, step 2\) changed since TrakCallback wrote the manifest"):
        resolve_checkpoints(cfg)


def test_final_false_makes_the_last_save_the_final_checkpoint(tmp_path):
    _project(tmp_path, "cb/manifest.json")
    _train(tmp_path, [TrakCallback(tmp_path / "cb", save="steps", every=4, final=False, save_optimizer_state=False)])
    (model,) = json.loads((tmp_path / "cb" / "manifest.json").read_text())["models"]
    assert (model["checkpoint"], model["step"], "epoch_checkpoints" in model) == ("model_000_step4.pt", 4, False)
    assert model["sha256"] == file_sha256(tmp_path / "cb" / "model_000_step4.pt")
    assert not (tmp_path / "cb" / "optimizer_state").exists() and not (tmp_path / "cb" / "model_000.pt").exists()


def test_manifest_entries_by_step_are_read_and_one_without_epoch_or_step_is_damaged(tmp_path):
    from trakcli.store.manifest import FORMAT, FORMAT_VERSION, manifest_checkpoints, manifest_entries, read_manifest

    for name in ("a.pt", "b.pt", "c.pt"):
        torch.save({"w": torch.ones(2)}, tmp_path / name)
    sha = {n: file_sha256(tmp_path / n) for n in ("a.pt", "b.pt", "c.pt")}
    saves = [{"step": 5, "checkpoint": "a.pt", "sha256": sha["a.pt"]},
             {"epoch": 1, "step": 8, "checkpoint": "b.pt", "sha256": sha["b.pt"]}]
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "n_models": 1, "complete": True,
                "models": [{"model_id": 0, "checkpoint": "c.pt", "sha256": sha["c.pt"], "epoch_checkpoints": saves}]}
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    assert [e["what"] for e in manifest_entries(read_manifest(path))] == ["model 0, step 5", "model 0, epoch 1", "model 0"]
    assert manifest_checkpoints(path) == [tmp_path / n for n in ("a.pt", "b.pt", "c.pt")]
    del saves[0]["step"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="is damaged"):
        read_manifest(path)


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"save": "batch"}, "save='batch': use \"epoch\""),
    ({"every": 0}, "every=0: give a whole number of epochs >= 1"),
])
def test_bad_arguments_are_one_clear_error_each(tmp_path, kwargs, error):
    with pytest.raises(ArgumentError, match=error):
        TrakCallback(tmp_path, **kwargs)


def test_an_unwritable_out_dir_names_the_file_and_the_fix(tmp_path):
    _project(tmp_path, "cb/manifest.json")
    (tmp_path / "cb").write_text("a file where the folder goes")
    with pytest.raises(ArgumentError, match="TrakCallback out_dir .*cb' cannot be created.*choose a folder"):
        _train(tmp_path, [TrakCallback(tmp_path / "cb")], epochs=1)


def test_importing_the_package_imports_neither_transformers_nor_torch():
    # `import trakcli` (as `trak --help`) stays light; trakcli.integrations is the callback, with transformers
    code = ("import sys, trakcli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)); "
            "import trakcli.integrations as i; assert i.TrakCallback is i.trainer.TrakCallback")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_sft_trainer_with_lora_writes_adapter_folders_whose_adam_state_featurizes(tmp_path):
    peft = pytest.importorskip("peft")
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer

    _project(tmp_path, "cb/manifest.json", data={"train": {"path": "text.jsonl", "text": "text", "max_length": 12},
                                                  "batch_size": 4})
    texts = ["the capital of a city is a city", "a city of the capital", "the city is the capital of a",
             "capital of the city", "is a city the capital", "of a city is the capital of the city"]
    write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in texts])
    model = build_model(f"hf:{tmp_path / 'base'}", model_class="causal_lm")
    args = trl.SFTConfig(output_dir=str(tmp_path / "hf"), num_train_epochs=2, per_device_train_batch_size=3,
                         learning_rate=0.01, max_length=12, use_cpu=True, report_to=[], save_strategy="no",
                         logging_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([{"text": t} for t in texts]),
                             processing_class=AutoTokenizer.from_pretrained(str(tmp_path / "base")),
                             peft_config=peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
                             callbacks=[TrakCallback(tmp_path / "cb")])
    trainer.train()

    manifest = json.loads((tmp_path / "cb" / "manifest.json").read_text())
    (entry,) = manifest["models"]
    assert manifest["complete"] and manifest["recipe"]["trainer"]["arguments"] == "SFTConfig"
    assert manifest["model"]["adapter"]["r"] == 2 and manifest["train_data"]["n"] == len(texts)
    names = [e["checkpoint"] for e in entry["epoch_checkpoints"]] + [entry["checkpoint"]]
    assert names == ["model_000_epoch1", "model_000"]
    for name in names:
        folder = tmp_path / "cb" / name
        assert (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
        v = _second_moments(tmp_path / "cb" / "optimizer_state" / name)
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in v
        assert len(v) == 2 * 2 * 2 and all("lora_" in n for n in v)  # 2 layers x (q, v) x (A, B)
    assert json.loads((tmp_path / "cb" / "model_000" / "adapter_config.json").read_text())["r"] == 2

    res = run(tmp_path, "featurize", "run.yaml")
    assert res.returncode == 0, msg(res)
    stored = arrays(tmp_path / "s.zarr")
    for k in range(2):
        phi = stored[f"train/{k}/features"]
        assert phi.shape == (len(texts), 64) and np.isfinite(phi).all() and np.abs(phi).sum(1).min() > 0
    assert not np.allclose(stored["train/0/features"], stored["train/1/features"])
    # the adapters' second moments scaled them: without the correction the features differ
    res = run(tmp_path, "featurize", "run.yaml", "second_moment.kind=null", "store.path=plain.zarr")
    assert res.returncode == 0, msg(res)
    assert not np.allclose(arrays(tmp_path / "plain.zarr")["train/1/features"], stored["train/1/features"], rtol=0.1)
