"""`trak optimize` trains causal LMs with the next-token loss on their target tokens, and `trak eval lds`
retrains them: a tiny GPT-2 (transformers config) with a word-level tokenizer (the `tokenizers` library).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from typer.testing import CliRunner  # noqa: E402

from trakcli.cli.main import app  # noqa: E402
from trakcli.data.text import IGNORE_INDEX, TextDataset  # noqa: E402
from trakcli.train import DatasetRows, Recipe, Trainer, lr_at  # noqa: E402
from trakcli.progress import Reporter, Task  # noqa: E402
from trakcli.tasks import BUILTIN  # noqa: E402
from projects import FACT_WORDS, fact_rows, word_tokenizer, write_config, write_jsonl  # noqa: E402

COUNTRIES = "avalon brimor cestia dorun elvar fennic gorla hestra".split()
CITIES = "ostrel pavin quorra ristel sulan tarvik umbra velor".split()
WORDS = FACT_WORDS

MODEL_FILE = '''
from transformers import GPT2Config, GPT2LMHeadModel


def make_model(vocab_size=32, n_embd=16, n_layer=1):
    cfg = GPT2Config(vocab_size=vocab_size, n_embd=n_embd, n_layer=n_layer, n_head=2, n_positions=32,
                     bos_token_id=2, eos_token_id=2, attn_implementation="eager")
    return GPT2LMHeadModel(cfg)
'''


def make_tokenizer(folder: Path) -> int:
    """A word-level tokenizer of the corpus words (+ [UNK], [PAD], [EOS]) saved to ``folder``; its vocabulary size."""
    return word_tokenizer(folder, [*WORDS, *COUNTRIES, *CITIES])


def facts(n: int, seed: int) -> list[dict]:
    """Prompt/completion rows "the capital of <country> is" -> "<city>" (a fixed city per country), with filler."""
    return fact_rows(n, seed, COUNTRIES, CITIES)


@pytest.fixture
def lm_project(tmp_path, monkeypatch) -> Path:
    """model file, tokenizer, 40 train / 6 target / 8 validation prompt+completion rows, in the cwd."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lm_model.py").write_text(MODEL_FILE)
    vocab = make_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "train.jsonl", facts(40, 0))
    write_jsonl(tmp_path / "target.jsonl", facts(6, 1))
    write_jsonl(tmp_path / "val.jsonl", facts(8, 2))
    (tmp_path / "vocab.txt").write_text(str(vocab))
    return tmp_path


def tiny_gpt2(vocab: int, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                      bos_token_id=2, eos_token_id=2, attn_implementation="eager"))


class Recording(Reporter):
    """Keeps every progress update, by task description."""

    def __init__(self):
        self.updates: dict[str, list[dict]] = {}

    def task(self, description, total):
        log = self.updates.setdefault(description, [])

        class _T(Task):
            def update(self, **fields):
                log.append(fields)

        from contextlib import contextmanager

        @contextmanager
        def cm():
            yield _T()

        return cm()


def test_language_modeling_loss_is_the_mean_next_token_cross_entropy_over_targets():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 4, IGNORE_INDEX], [1, 2, 3, IGNORE_INDEX, IGNORE_INDEX]])
    batch = {"input_ids": labels.clamp(min=0), "labels": labels}
    terms = [-torch.log_softmax(logits[i, t - 1], -1)[labels[i, t]] for i in range(2) for t in range(1, 5)
             if labels[i, t] != IGNORE_INDEX]
    task = BUILTIN["language_modeling"]
    assert task.loss_count(batch) == len(terms) == 4  # the first token of a row is never predicted
    torch.testing.assert_close(task.loss(logits, batch), torch.stack(terms).mean())
    torch.testing.assert_close(task.loss(logits, batch, reduction="sum"), torch.stack(terms).sum())
    y = torch.tensor([1, 6])
    torch.testing.assert_close(BUILTIN["classification"].loss(logits[:, 0], {"labels": y}),
                               torch.nn.functional.cross_entropy(logits[:, 0], y))


@pytest.mark.parametrize("projection", [None, {"mode": "per_matrix", "kind": "kronecker", "rank": 4},
                                        {"mode": "global", "kind": "sjlt", "proj_dim": 256}])
def test_the_recipe_trains_a_tiny_lm_whose_loss_falls(lm_project, projection):
    vocab = int(Path("vocab.txt").read_text())
    data = TextDataset("train.jsonl", prompt="prompt", completion="completion", tokenizer="tok", max_length=16)
    model = tiny_gpt2(vocab)
    wte = model.transformer.wte.weight.detach().clone()
    rec = Recording()
    val = TextDataset("val.jsonl", prompt="prompt", completion="completion", tokenizer="tok", max_length=16)
    trainer = Trainer(model, DatasetRows(data),
                      Recipe(epochs=6, batch_size=8, lr=1e-2, optimizer="adamw", projection=projection, max_tokens=48),
                      task="language_modeling", seed=0, validation=val)
    trainer.fit(reporter=rec, description="lm")
    stats, state = trainer.metrics(), trainer.optimizer_state()
    hist = stats["history"]
    assert [set(h) for h in hist] == [{"epoch", "loss", "val_loss"}] * 6
    assert hist[-1]["loss"] < 0.7 * hist[0]["loss"], hist
    assert hist[-1]["val_loss"] < hist[0]["val_loss"], hist
    steps = [u for u in rec.updates["lm"] if "loss" in u]
    assert len(steps) >= 6 * 5 and all(set(u) == {"loss"} for u in steps)  # a step's loss on the bar, every step
    # the tied embedding is trained and stays tied
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not torch.equal(model.transformer.wte.weight, wte)
    assert state["param_names"][0] == "transformer.wte.weight" and state["state_dict"]["state"]
    if projection is not None:  # the state lives in the subspace: far smaller than AdamW's two moments
        assert stats["optimizer_state_numel"] < sum(p.numel() for p in model.parameters())


def test_batches_hold_at_most_batch_tokens_and_follow_the_shuffled_order(lm_project):
    data = TextDataset("train.jsonl", prompt="prompt", completion="completion", tokenizer="tok", max_length=16)
    rows = DatasetRows(data, rows=list(range(0, 40, 2)))
    order = torch.randperm(rows.n, generator=torch.Generator().manual_seed(3))
    seen = []
    for count, x, y in rows.batches(order, 0, batch_size=8, max_tokens=40):
        b, width = x["input_ids"].shape
        assert count == b and (b == 1 or b * width <= 40)
        assert width == int(x["attention_mask"].sum(1).max())  # padded to its own longest row
        seen += [x["input_ids"][i, : int(x["attention_mask"][i].sum())].tolist() for i in range(b)]
    alone = [next(data.batches(r, r + 1, 1))[1]["input_ids"][0].tolist() for r in (rows.rows[i] for i in order.tolist())]
    assert seen == alone
    assert rows.steps_per_epoch(8, 40, order) == sum(1 for _ in rows.batches(order, 0, 8, 40))


def test_warmup_and_decay_give_the_expected_learning_rates(lm_project):
    # 2 warmup steps, then 8 decay steps
    lin = [lr_at(s, lr=1.0, total_steps=10, schedule="linear", warmup_steps=2) for s in range(1, 11)]
    assert lin == pytest.approx([0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125])
    cos = [lr_at(s, lr=2.0, total_steps=10, schedule="cosine", warmup_steps=2) for s in range(1, 11)]
    assert cos == pytest.approx([1.0, 2.0] + [1 + math.cos(math.pi * k / 8) for k in range(8)])
    assert [lr_at(s, lr=0.1, total_steps=5) for s in range(1, 6)] == [0.1] * 5
    assert [lr_at(s, lr=0.1, total_steps=5, warmup_steps=4) for s in (1, 4, 5)] == pytest.approx([0.025, 0.1, 0.1])
    # the recipe steps with them: 20 rows, batches of 8 -> 3 steps per epoch, 2 epochs; warmup 0.3 -> 2 steps
    vocab = int(Path("vocab.txt").read_text())
    data = TextDataset("train.jsonl", prompt="prompt", completion="completion", tokenizer="tok", max_length=16)
    rec = Recording()
    model = tiny_gpt2(vocab)
    Trainer(model, DatasetRows(data, rows=range(20)),
            Recipe(epochs=2, batch_size=8, lr=0.01, optimizer="adamw", schedule="cosine", warmup_fraction=0.3),
            task="language_modeling", seed=0).fit(reporter=rec, description="s")
    seen_lr = [u["lr"] for u in rec.updates["s"] if "lr" in u]
    assert seen_lr == pytest.approx([lr_at(s, lr=0.01, total_steps=6, schedule="cosine", warmup_steps=2)
                                     for s in range(1, 7)])


def test_optimize_featurize_score_eval_lds_of_a_tiny_lm_through_the_cli(lm_project, monkeypatch):
    vocab = int(Path("vocab.txt").read_text())

    def whole_corpus(self):
        raise AssertionError("the whole corpus was loaded")

    monkeypatch.setattr(TextDataset, "padded", whole_corpus)
    lm = {"prompt": "prompt", "completion": "completion", "tokenizer": "tok", "max_length": 16}
    write_config(lm_project / "lm.yaml", {
        "model": {"entrypoint": "lm_model.py:make_model", "kwargs": {"vocab_size": vocab}},
        "task": "language_modeling",
        "checkpoints": "ckpts/manifest.json",
        "data": {"train": {"path": "train.jsonl", **lm}, "target": {"path": "target.jsonl", **lm},
                 "validation": {"path": "val.jsonl", **lm}, "batch_size": 8, "batch_tokens": 64},
        "projector": {"kind": "sjlt", "proj_dim": 64, "seed": 0},
        "store": {"path": "out/lm.zarr", "chunk_rows": 16},
        "optimize": {"n_models": 2, "epochs": 3, "batch_size": 8, "out_dir": "ckpts", "metrics": "metrics.json",
                     "save_optimizer_state": True,
                     "optimizer": "adamw", "lr": 1e-2, "weight_decay": 0.0, "schedule": "cosine", "warmup_steps": 2,
                     "projection": {"mode": "per_matrix", "kind": "kronecker", "rank": 4}},
        "eval": {"n_subsets": 3, "subset_fraction": 0.5, "bootstrap": 200},
        "num_threads": 1,
    })
    runner = CliRunner()
    for args in (["optimize", "lm.yaml"], ["featurize", "lm.yaml"], ["score", "lm.yaml", "--out", "s.npy"],
                 ["eval", "lds", "lm.yaml", "--out", "lds.json"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 0, (args, res.output)
    manifest = json.loads(Path("ckpts/manifest.json").read_text())
    assert manifest["complete"] and manifest["batch_tokens"] == 64
    for m in manifest["models"]:
        met = m["metrics"]
        assert [set(h) for h in met["history"]] == [{"epoch", "loss", "val_loss"}] * 3
        assert met["validation_loss"] == met["history"][-1]["val_loss"] and "train_accuracy" not in met
        state = torch.load(Path("ckpts") / m["optimizer_state"], weights_only=True)
        assert state["optimizer"] == "adamw" and state["projection"]["kind"] == "kronecker"
        assert "transformer.wte.weight" in state["param_names"]
    s = np.load("s.npy")
    assert s.shape == (6, 40) and np.isfinite(s).all()
    out = json.loads(Path("lds.json").read_text())
    assert out["n_subsets"] == 3 and out["n_target"] == 6
    assert out["n_bootstrap"] == 200 and out["confidence_level"] == 0.95
    if out["lds"] is not None and out["ci_low"] is not None:
        assert out["ci_low"] <= out["lds"] <= out["ci_high"]
    assert set(out["baselines"]["bm25"]) == {"lds", "ci_low", "ci_high"}  # the word-overlap row of text data
    import zarr

    g = zarr.open_group("out/lm.zarr", mode="r")
    assert g["eval/masks"].shape == (3, 40) and int(g["eval/masks"][0].sum()) == 20


class _Killed(Exception):
    pass


def test_an_lm_killed_mid_epoch_resumes_bit_identically(lm_project, tmp_path):
    vocab = int(Path("vocab.txt").read_text())
    data = TextDataset("train.jsonl", prompt="prompt", completion="completion", tokenizer="tok", max_length=16)
    recipe = Recipe(epochs=2, batch_size=8, lr=1e-2, optimizer="adamw", max_tokens=48, schedule="linear",
                    warmup_steps=2)
    every3 = dataclasses.replace(recipe, checkpoint_every=3)
    ref = Trainer(tiny_gpt2(vocab), DatasetRows(data), recipe, task="language_modeling", seed=1).fit()
    model, calls = tiny_gpt2(vocab), [0]

    def bomb(module, args, kwargs):
        calls[0] += 1
        if calls[0] == 7:
            raise _Killed

    handle = model.register_forward_pre_hook(bomb, with_kwargs=True)
    state = tmp_path / "resume.pt"
    with pytest.raises(_Killed):
        Trainer(model, DatasetRows(data), every3, task="language_modeling", seed=1).fit(resume_path=state)
    assert torch.load(state, weights_only=True)["step"] == 6
    handle.remove()
    resumed = Trainer(tiny_gpt2(vocab, seed=5), DatasetRows(data), recipe, task="language_modeling",
                      seed=1).fit(resume_path=state)
    for (k, a), b in zip(ref.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k
    assert not state.exists()


def test_a_command_on_a_transformers_model_prints_nothing_after_its_result(lm_project):
    """The `trak` process ends with its result line: no messages from extension modules at the interpreter's exit."""
    import subprocess
    import sys

    vocab = int(Path("vocab.txt").read_text())
    lm = {"prompt": "prompt", "completion": "completion", "tokenizer": "tok", "max_length": 16}
    torch.save(tiny_gpt2(vocab).state_dict(), "model.pt")
    write_config(lm_project / "lm.yaml", {
        "model": {"entrypoint": "lm_model.py:make_model", "kwargs": {"vocab_size": vocab}},
        "task": "language_modeling", "checkpoints": ["model.pt"],
        "data": {"train": {"path": "train.jsonl", **lm}, "target": {"path": "target.jsonl", **lm}},
        "projector": {"kind": "kronecker", "proj_dim": 64, "seed": 0}, "store": {"path": "out/lm.zarr"},
    })
    for cmd in ("featurize", "score"):
        res = subprocess.run([sys.executable, "-m", "trakcli.cli.main", cmd, "lm.yaml"], capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        last = res.stderr.strip().splitlines()[-1]
        assert last.startswith(("features", "top", "scores")) or "->" in last, res.stderr[-2000:]
        assert "leaked" not in res.stderr and "nanobind" not in res.stderr
