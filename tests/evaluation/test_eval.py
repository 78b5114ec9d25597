"""`trak eval lds`: subsets, model outputs, retraining into the store (resume after kill -9, workers, identity
checks), external files through the CLI, optimize.entrypoint. The LDS statistics: tests/evaluation/test_lds.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
import zarr

from trakcli.config import load_config
from trakcli.data import load_dataset
from trakcli.errors import StoreMismatchError
from trakcli.evaluation.scores import store_scores
from trakcli.evaluation.retrain import load_or_retrain, model_outputs, model_seed, retrain, subset_mask
from trakcli.train import train_one
from trakcli.evaluation.lds import lds
from trakcli.models import build_model
from projects import invoke as trak
from projects import trak_cmd

N_SUBSETS = 4


def eval_project(root: Path, **optimize) -> Path:
    """Add a training recipe and a small eval section to the user_project config (in the cwd)."""
    cfg = yaml.safe_load((root / "run.yaml").read_text())
    cfg["optimize"] = {"n_models": 2, "epochs": 2, "batch_size": 8, "lr": 0.1, "out_dir": "trained", **optimize}
    cfg["eval"] = {"n_subsets": N_SUBSETS, "bootstrap": 200}
    cfg["num_threads"] = 1
    (root / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return root / "run.yaml"


def eval_arrays(store: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    g = zarr.open_group(str(Path(store) / "eval"), mode="r")
    return np.asarray(g["masks"][:]), np.asarray(g["outputs"][:]), np.asarray(g["done"][:])


# ----------------------------------------------------------------------------
# subsets and outputs: pure functions


def subset_masks(n_train: int, fraction: float, seed: int, n_subsets: int) -> np.ndarray:
    """The masks of retrained models 0..n_subsets-1, as `retrain` stores them."""
    return np.stack([subset_mask(n_train, fraction, seed, k) for k in range(n_subsets)])


@pytest.mark.parametrize("n_train, fraction", [(1437, 0.5), (40, 0.5), (41, 0.3), (10, 0.95), (7, 0.01)])
def test_subset_masks_are_deterministic_and_exactly_sized(n_train, fraction):
    masks = subset_masks(n_train, fraction, seed=3, n_subsets=6)
    assert masks.dtype == bool and masks.shape == (6, n_train)
    size = min(n_train, max(1, round(fraction * n_train)))
    assert (masks.sum(axis=1) == size).all()
    # row k is a pure function of (seed, k): not of how many rows are drawn, nor their order
    for k in (5, 0, 2):
        np.testing.assert_array_equal(subset_mask(n_train, fraction, 3, k), masks[k])
    np.testing.assert_array_equal(subset_masks(n_train, fraction, 3, 2), masks[:2])
    if size < n_train:
        assert len({m.tobytes() for m in masks}) > 1  # rows differ
        assert not np.array_equal(subset_masks(n_train, fraction, 4, 6), masks)  # the seed matters
    assert subset_mask(1437, 0.5, 0, 0).sum() == 718


def test_model_seed_does_not_collide_with_checkpoint_seeds():
    seeds = {model_seed(s, k) for s in range(3) for k in range(1000)}
    assert len(seeds) == 3000 and min(seeds) >= 10**6


def test_model_outputs_are_the_classification_margin():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4))
    x, y = torch.randn(23, 5), torch.randint(0, 4, (23,))
    from trakcli.data import TensorDataset

    out = model_outputs(model, TensorDataset(x, y, "t"), "classification", batch_size=7)
    p = torch.softmax(model(x).double(), dim=1)[torch.arange(23), y]
    assert out.dtype == np.float64 and out.shape == (23,)
    np.testing.assert_allclose(out, torch.log(p / (1 - p)).detach().numpy(), rtol=1e-9, atol=1e-9)  # log(p/(1-p))


class _TinyLM(torch.nn.Module):
    """A causal "LM" over a vocabulary of 11 tokens: logits [n, L, 11] from the token embeddings."""

    trak_causal = True

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(11, 11)

    def forward(self, input_ids, attention_mask=None):
        return self.emb(input_ids).cumsum(dim=1)


def test_model_outputs_of_a_language_model_sum_the_next_token_margins():
    from trakcli.data import TensorDataset
    from trakcli.tasks import language_modeling_margin

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 11, (9, 6), generator=g)
    am = torch.ones(9, 6, dtype=torch.long)
    am[2, 4:] = 0  # padding on the right
    data = TensorDataset({"input_ids": ids, "attention_mask": am}, torch.zeros(9, dtype=torch.long), "t")
    model = _TinyLM()
    out = model_outputs(model, data, "language_modeling", batch_size=4)
    with torch.no_grad():
        want = [language_modeling_margin(model(ids[i : i + 1])[0].double(), torch.where(am[i] != 0, ids[i], -100))[0].item() for i in range(9)]
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    # a memory cap smaller than a batch's logits cuts the batches, never the result
    np.testing.assert_array_equal(model_outputs(model, data, "language_modeling", batch_size=4, memory_mb=0), out)


class _WideLM(torch.nn.Module):
    """A language model with 2**17 logits per token (1 MiB of float64 per token) that records its batch shapes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(11, 4), torch.nn.Linear(4, 1 << 17)
        self.shapes: list[tuple[int, int]] = []

    def forward(self, input_ids, attention_mask=None):
        self.shapes.append(tuple(input_ids.shape))
        return self.head(self.emb(input_ids))


def test_model_outputs_bound_the_tokens_of_every_batch_not_only_the_first_rows():
    from trakcli.data import TensorDataset

    ids = torch.randint(0, 11, (7, 6), generator=torch.Generator().manual_seed(1))
    am = torch.ones(7, 6, dtype=torch.long)
    am[0, 1:] = 0  # the first row has 1 token, the others 6
    data = TensorDataset({"input_ids": ids, "attention_mask": am}, torch.zeros(7, dtype=torch.long), "t")
    model = _WideLM()
    want = model_outputs(model, data, "language_modeling", batch_size=1, memory_mb=64)
    for memory_mb, max_tokens, most in [(4, None, 4), (64, 12, 12)]:  # 4 MiB: 4 tokens of 1 MiB logits
        model.shapes.clear()
        out = model_outputs(model, data, "language_modeling", batch_size=8, memory_mb=memory_mb, max_tokens=max_tokens)
        np.testing.assert_allclose(out, want, rtol=1e-5)  # float32 logits: batch shapes change the rounding
        batches = model.shapes[1:]  # after the probe of the first row
        assert sum(b for b, _ in batches) == 7
        assert all(b == 1 or b * length <= most for b, length in batches), batches
        assert any(b > 1 for b, _ in batches) == (most >= 12), batches


# ----------------------------------------------------------------------------
# training: one implementation for trak optimize and the retraining


def test_train_one_reproduces_trak_optimize_checkpoints(user_project):
    eval_project(user_project)
    assert trak("optimize", "run.yaml", "-q").exit_code == 0
    cfg = load_config("run.yaml")
    train = load_dataset(cfg.data.train)
    torch.set_num_threads(1)
    model = train_one(cfg, train.inputs, train.labels, seed=cfg.optimize.seed + 1).model
    saved = torch.load("trained/model_001.pt")
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k


TRAIN_FILE = '''
import torch

def train(model, inputs, labels, seed, steps=3, lr=0.5, log="calls.txt"):
    with open(log, "a") as f:
        f.write(f"{len(labels)} {seed}\\n")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        idx = torch.randperm(len(labels), generator=gen)[:8]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs[idx]), labels[idx]).backward()
        opt.step()
    if steps == 0:
        return "not a model"
'''


def test_training_entrypoint_trains_optimize_and_eval_models(user_project):
    (user_project / "my_train.py").write_text(TRAIN_FILE)
    cfg = yaml.safe_load(Path("run.yaml").read_text())
    cfg["optimize"] = {
        "n_models": 1, "out_dir": "trained", "entrypoint": "my_train.py:train", "kwargs": {"steps": 4}, "seed": 5,
        "optimizer": "sgd",
    }
    cfg["eval"] = {"n_subsets": 3, "bootstrap": 50}
    cfg["num_threads"] = 1
    Path("run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    res = trak("optimize", "run.yaml", "-q")
    assert res.exit_code == 0, res.stderr
    assert Path("calls.txt").read_text().split("\n")[0] == "40 5"  # all 40 rows, seed optimize.seed + 0
    loaded = load_config("run.yaml")
    res = retrain(loaded)
    # the retraining called it on each model's 20 rows with the model's seed
    calls = Path("calls.txt").read_text().split("\n")[1:4]
    assert calls == [f"20 {model_seed(0, k)}" for k in range(3)]
    # and the outputs are those of the model the function trained
    import importlib.util

    spec = importlib.util.spec_from_file_location("my_train_ref", "my_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    train, target = load_dataset(loaded.data.train), load_dataset(loaded.data.target)
    mask = subset_mask(40, 0.5, 0, 1)
    torch.manual_seed(model_seed(0, 1))
    model = build_model(loaded.model.entrypoint)
    idx = torch.from_numpy(np.flatnonzero(mask))
    mod.train(model, train.inputs[idx], train.labels[idx], seed=model_seed(0, 1), steps=4, log="other.txt")
    np.testing.assert_array_equal(res.outputs[1], model_outputs(model, target, "classification"))
    np.testing.assert_array_equal(res.masks[1], mask)
    # the recipe the store records is the function's, and a changed kwarg refuses
    with pytest.raises(StoreMismatchError, match=r"recipe.kwargs.steps: store has 4, this run has 5"):
        retrain(load_config("run.yaml", ["optimize.kwargs.steps=5"]))
    # a function returning something else than a model
    res = trak("eval", "lds", "run.yaml", "optimize.kwargs.steps=0", "--overwrite")
    assert res.exit_code == 1 and "optimize.entrypoint 'my_train.py:train' returned a str" in res.stderr
    res = trak("optimize", "run.yaml", "optimize.entrypoint=my_train.py:trian", "--overwrite")
    assert res.exit_code == 1 and "optimize.entrypoint: 'my_train.py' has no function 'trian'; did you mean 'train'?" in res.stderr
    # trak eval needs no optimize.out_dir (its retrained models live in the store); trak optimize does
    before = sorted(p.name for p in Path(".").iterdir())
    assert retrain(load_config("run.yaml", ["optimize.out_dir=null", "store.path=out/no_out_dir.zarr"])).trained == 3
    assert sorted(p.name for p in Path(".").iterdir()) == before
    res = trak("optimize", "run.yaml", "optimize.out_dir=null")
    assert res.exit_code == 1 and "optimize.out_dir: required by trak optimize" in res.stderr


# ----------------------------------------------------------------------------
# retraining into the store


def test_retrain_resumes_extends_and_checks_identity(user_project):
    eval_project(user_project)
    cfg = load_config("run.yaml")
    full = retrain(cfg)
    assert full.trained == N_SUBSETS and full.masks.shape == (N_SUBSETS, 40) and full.outputs.shape == (N_SUBSETS, 7)
    assert full.outputs.dtype == np.float64 and np.isfinite(full.outputs).all()
    assert len({o.tobytes() for o in full.outputs}) == N_SUBSETS  # every model is its own
    np.testing.assert_array_equal(full.masks, subset_masks(40, 0.5, 0, N_SUBSETS))
    # the store holds them, done flags set; a second run trains nothing
    masks, outputs, done = eval_arrays("out/attrib.zarr")
    np.testing.assert_array_equal(outputs, full.outputs)
    assert done.tolist() == [1] * N_SUBSETS
    assert retrain(cfg).trained == 0
    # a simulated interruption: rows 1 and 3 never finished; the rerun trains exactly those, identically
    g = zarr.open_group("out/attrib.zarr/eval", mode="r+")
    g["done"][1] = 0
    g["done"][3] = 0
    g["outputs"][1] = 123.0
    again = retrain(cfg)
    assert again.trained == 2
    np.testing.assert_array_equal(again.outputs, full.outputs)
    # more subsets extend the group; fewer read the first rows
    more = retrain(load_config("run.yaml", [f"eval.n_subsets={N_SUBSETS + 2}"]))
    assert more.trained == 2 and more.n_subsets == N_SUBSETS + 2
    np.testing.assert_array_equal(more.outputs[:N_SUBSETS], full.outputs)
    fewer = load_or_retrain(load_config("run.yaml", ["eval.n_subsets=3"]))
    np.testing.assert_array_equal(fewer[1], full.outputs[:3])
    # another recipe, seed or subset size refuses, naming the keys; --overwrite retrains
    with pytest.raises(StoreMismatchError) as e:
        retrain(load_config("run.yaml", ["optimize.lr=0.2", "eval.seed=1"]))
    assert "recipe.lr: store has 0.1, this run has 0.2" in str(e.value)
    assert "seed: store has 0, this run has 1" in str(e.value)
    assert "--overwrite" in str(e.value)
    res = trak("eval", "lds", "run.yaml", "eval.subset_fraction=0.25")
    assert res.exit_code == 1 and "subset_fraction: store has 0.5, this run has 0.25" in res.stderr
    # settings that do not change the models do not refuse
    assert retrain(load_config("run.yaml", ["optimize.n_models=7", "projector.proj_dim=8"])).trained == 0
    other = retrain(load_config("run.yaml", ["optimize.lr=0.2"]), overwrite=True)
    assert other.trained == N_SUBSETS and not np.array_equal(other.outputs, full.outputs)
    np.testing.assert_array_equal(other.masks, full.masks)


def test_retrain_seed_same_reuses_the_checkpoints_seeds(user_project):
    """eval.retrain_seed: same trains model k with optimize.seed + k mod n_models: the attributed model itself,
    but on its subset; other (the default) with seeds unlike any checkpoint's. The stores' identities differ."""
    eval_project(user_project, seed=5)
    cfg = load_config("run.yaml", ["eval.retrain_seed=same", "eval.n_subsets=3"])
    same = retrain(cfg)
    train, target = load_dataset(cfg.data.train), load_dataset(cfg.data.target)
    for k, seed in enumerate([5, 6, 5]):  # optimize.seed 5, n_models 2
        idx = torch.from_numpy(np.flatnonzero(same.masks[k]))
        model = train_one(cfg, train.inputs[idx], train.labels[idx], seed=seed, device="cpu").model
        np.testing.assert_array_equal(same.outputs[k], model_outputs(model, target, "classification"))
    with pytest.raises(StoreMismatchError, match="model_seed: store has 'optimize.seed"):
        retrain(load_config("run.yaml", ["eval.n_subsets=3"]))  # other: the default
    other = retrain(load_config("run.yaml", ["eval.n_subsets=3"]), overwrite=True)
    np.testing.assert_array_equal(other.masks, same.masks)
    assert all(not np.array_equal(a, b) for a, b in zip(other.outputs, same.outputs))
    res = trak("eval", "lds", "run.yaml", "eval.retrain_seed=mine")
    assert res.exit_code == 1 and "eval.retrain_seed" in res.stderr


def test_eval_before_featurize_then_featurize_overwrite_keeps_the_retraining(user_project):
    eval_project(user_project)
    # no store yet: eval retrains into a new store, then asks for scores
    res = trak("eval", "lds", "run.yaml")
    assert res.exit_code == 1
    assert "retraining only" in res.stderr and "run `trak featurize CONFIG` and `trak score CONFIG`" in res.stderr
    assert f"the {N_SUBSETS} retrained models are kept" in res.stderr
    masks, outputs, done = eval_arrays("out/attrib.zarr")
    assert done.all()
    res = trak("score", "run.yaml")
    assert res.exit_code == 1 and "holds no train features yet; run `trak featurize CONFIG` first" in res.stderr
    # featurize adopts the store; --overwrite re-creates it but keeps the eval group
    for args in (["featurize", "run.yaml", "-q"], ["featurize", "run.yaml", "-q", "--overwrite"], ["score", "run.yaml", "-q"]):
        res = trak(*args)
        assert res.exit_code == 0, res.stderr
    m2, o2, d2 = eval_arrays("out/attrib.zarr")
    np.testing.assert_array_equal(m2, masks)
    np.testing.assert_array_equal(o2, outputs)
    assert d2.all() and not Path("out/.attrib.zarr.eval-kept").exists()
    # now the LDS: nothing retrained, the JSON on stdout is the library's LDS of the store's scores
    res = trak("eval", "lds", "run.yaml", "--json", "--out", "lds.json")
    assert res.exit_code == 0, res.stderr
    assert "retraining" not in res.stderr and "Linear datamodeling score" in res.stderr
    data = json.loads(res.stdout)
    assert json.loads(Path("lds.json").read_text()) == data
    scores = np.asarray(zarr.open_group("out/attrib.zarr", mode="r")["scores/default/scores"][:])
    want = lds(scores, masks, outputs, n_bootstrap=200, seed=0)
    assert data["lds"] == pytest.approx(want.lds, abs=1e-12)
    assert (data["ci_low"], data["ci_high"]) == pytest.approx((want.ci_low, want.ci_high), abs=1e-12)
    assert data["n_subsets"] == N_SUBSETS and data["n_target"] == 7 and len(data["per_target"]) == 7
    assert data["n_bootstrap"] == 200
    # trak inspect shows the eval group
    info = json.loads(trak("inspect", "out/attrib.zarr", "--json").stdout)
    assert info["eval"]["done"] == N_SUBSETS
    shown = trak("inspect", "out/attrib.zarr").stderr
    assert f"eval: {N_SUBSETS}/{N_SUBSETS} retrained models" in " ".join(shown.split())
    # the store's scores must be those of the config's data and experiment
    with pytest.raises(StoreMismatchError, match="data.target differs from the targets of experiment 'default'"):
        store_scores(load_config("run.yaml", ["data.target.inputs=x_train", "data.target.labels=y_train"]))
    res = trak("eval", "lds", "run.yaml", "score.experiment=other", "--masks", "m.npy", "--outputs", "o.npy")
    assert res.exit_code == 2  # m.npy does not exist: a bad flag, before any work
    np.save("m.npy", masks)
    np.save("o.npy", outputs)
    res = trak("eval", "lds", "run.yaml", "score.experiment=other", "--masks", "m.npy", "--outputs", "o.npy")
    assert res.exit_code == 1 and "holds no scores of experiment 'other'" in res.stderr


def test_external_files_through_the_cli(user_project):
    rng = np.random.default_rng(0)
    masks = rng.random((6, 40)) < 0.5
    scores = rng.normal(size=(7, 40)).astype(np.float32)
    outputs = masks @ scores.T.astype(np.float64) + rng.normal(size=(6, 7))
    np.save("m.npy", masks)
    np.save("o.npy", outputs)
    np.save("s.npy", scores)
    res = trak("eval", "lds", "--scores", "s.npy", "--masks", "m.npy", "--outputs", "o.npy", "--json")
    assert res.exit_code == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["lds"] == pytest.approx(lds(scores, masks, outputs).lds, abs=1e-12)
    assert data["sources"]["masks"] == "--masks m.npy"
    # bad shapes: which file, its shape, the expected one
    np.save("bad.npy", scores.T)
    res = trak("eval", "lds", "--scores", "bad.npy", "--masks", "m.npy", "--outputs", "o.npy")
    assert res.exit_code == 1
    assert "--scores bad.npy has shape [40, 7], expected [7, 40] = [n_target, n_train]" in res.stderr
    np.save("bad.npy", outputs[:5])
    res = trak("eval", "lds", "--scores", "s.npy", "--masks", "m.npy", "--outputs", "bad.npy")
    assert res.exit_code == 1 and "--outputs bad.npy has shape [5, 7], expected [6, n_target]" in res.stderr
    np.save("bad.npy", masks[0])
    res = trak("eval", "lds", "--scores", "s.npy", "--masks", "bad.npy", "--outputs", "o.npy")
    assert res.exit_code == 1 and "--masks bad.npy has shape [40]; expected a 2-D array [n_subsets, n_train] bool" in res.stderr
    np.save("bad.npy", masks * 2)
    res = trak("eval", "lds", "--scores", "s.npy", "--masks", "bad.npy", "--outputs", "o.npy")
    assert res.exit_code == 1 and "--masks bad.npy holds values other than 0 and 1" in res.stderr
    Path("junk.npy").write_text("not an array")
    res = trak("eval", "lds", "--scores", "junk.npy", "--masks", "m.npy", "--outputs", "o.npy")
    assert res.exit_code == 1 and "--scores junk.npy: cannot read it as an array" in res.stderr
    # bad flags: exit 2
    res = trak("eval", "lds", "--scores", "s.npy", "--masks", "m.npy")
    assert res.exit_code == 2 and "--masks and --outputs go together" in res.stderr
    res = trak("eval", "lds", "--scores", "s.npy")
    assert res.exit_code == 2 and "give CONFIG" in res.stderr
    res = trak("eval", "lds", "--scores", "nope.npy", "--masks", "m.npy", "--outputs", "o.npy")
    assert res.exit_code == 2 and "--scores nope.npy: file does not exist" in res.stderr
    # a config's store scores against external retraining; wrong n_train is named
    eval_project(user_project)
    assert trak("featurize", "run.yaml", "-q").exit_code == 0
    assert trak("score", "run.yaml", "-q").exit_code == 0
    res = trak("eval", "lds", "run.yaml", "--masks", "m.npy", "--outputs", "o.npy", "--json", "-q")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["sources"]["scores"] == "the scores of experiment 'default' in out/attrib.zarr"
    assert not Path("out/attrib.zarr/eval").exists()  # no retraining with external files
    np.save("m30.npy", masks[:, :30])
    res = trak("eval", "lds", "run.yaml", "--masks", "m30.npy", "--outputs", "o.npy")
    assert res.exit_code == 1
    assert "the scores of experiment 'default' in out/attrib.zarr has shape [7, 40], expected [7, 30]" in res.stderr


# ----------------------------------------------------------------------------
# processes: kill -9 and resume, workers, orphans


def _wait_for(log: Path, text: str, count: int, proc: subprocess.Popen, timeout: float = 120) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if log.exists() and log.read_text().count(text) >= count:
            return True
        time.sleep(0.005)
    return False


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")  # a zombie does not run


@pytest.mark.slow
def test_kill_then_resume_and_workers_give_identical_rows(user_project):
    eval_project(user_project, epochs=150)
    cfg = load_config("run.yaml", [f"eval.n_subsets={N_SUBSETS + 2}"])
    ref = retrain(cfg.model_copy(update={"store": cfg.store.model_copy(update={"path": Path("ref.zarr")})}))

    # kill -9 after two models are written; the rerun trains only the others
    log = user_project / "events.log"
    args = ["eval", "lds", "run.yaml", f"eval.n_subsets={N_SUBSETS + 2}", "-q"]
    proc = subprocess.Popen(trak_cmd(*args), env={**os.environ, "TRAK_EVENT_LOG": str(log)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed = _wait_for(log, "done eval", 2, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert killed
    _, _, done = eval_arrays("out/attrib.zarr")
    assert 2 <= done.sum() < N_SUBSETS + 2
    res = subprocess.run(trak_cmd(*args), env={**os.environ, "TRAK_EVENT_LOG": str(log)}, capture_output=True, text=True)
    assert res.returncode == 1 and "trak score CONFIG" in res.stderr  # no scores in this store: retraining only
    starts = log.read_text().count("start eval")
    assert N_SUBSETS + 2 <= starts <= N_SUBSETS + 3  # at most the model in flight was lost
    masks, outputs, done = eval_arrays("out/attrib.zarr")
    assert done.all()
    np.testing.assert_array_equal(masks, ref.masks)
    np.testing.assert_array_equal(outputs, ref.outputs)

    # two worker processes write the same rows, bit for bit
    two = retrain(cfg.model_copy(update={"store": cfg.store.model_copy(update={"path": Path("two.zarr")})}), workers=2)
    assert two.workers == 2 and two.trained == N_SUBSETS + 2
    np.testing.assert_array_equal(two.masks, ref.masks)
    np.testing.assert_array_equal(two.outputs, ref.outputs)


@pytest.mark.slow
def test_workers_die_with_their_parent_and_report_errors(user_project):
    (user_project / "my_train.py").write_text(
        "import time\n"
        "def train(model, inputs, labels, seed, fail_seed=-1, sleep=0.0):\n"
        "    if seed == fail_seed:\n"
        "        raise ValueError(f'bad seed {seed}')\n"
        "    time.sleep(sleep)\n"
    )
    eval_project(user_project, entrypoint="my_train.py:train", kwargs={"sleep": 30.0})
    # kill -9 the parent while its workers train: they exit instead of training on
    log = user_project / "events.log"
    proc = subprocess.Popen(trak_cmd("eval", "lds", "run.yaml", "--workers", "2", "-q"),
                            env={**os.environ, "TRAK_EVENT_LOG": str(log)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert _wait_for(log, "start eval", 2, proc)
    pids = {int(line.split(" pid ")[1]) for line in log.read_text().splitlines() if line.startswith("start eval")}
    assert len(pids) == 2 and proc.pid not in pids
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10
    while time.time() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), "worker processes outlived their killed parent"
    # an error in a worker stops the run with its message and traceback
    res = trak("eval", "lds", "run.yaml", "--workers", "2", f"optimize.kwargs.fail_seed={model_seed(0, 2)}", "optimize.kwargs.sleep=0",
               "--overwrite")
    assert res.exit_code == 1
    # the user's exception, named with the key that configured the function and the user's file and line
    assert (f"retraining model 2 failed in a worker process: optimize.entrypoint my_train.py:train raised "
            f"ValueError: bad seed {model_seed(0, 2)} (my_train.py, line 4)") in res.stderr


def test_the_time_left_of_retraining_in_workers_is_measured_after_each_workers_first_model(user_project):
    """Each worker's first model carries its start-up (spawn, imports, data): the estimate starts after them."""
    from contextlib import contextmanager

    from trakcli.progress import Reporter, Task

    class Steps(Reporter):
        def __init__(self):
            self.events: list[str] = []

        @contextmanager
        def task(self, description, total):
            events = self.events

            class Recorded(Task):
                def advance(self, n=1):
                    events.append("advance")

                def warmed_up(self):
                    events.append("warmed_up")

            yield Recorded()

    eval_project(user_project, epochs=1)
    cfg = load_config("run.yaml")
    two = Steps()
    retrain(cfg, workers=2, reporter=two)
    assert two.events == ["advance", "advance", "warmed_up"] + ["advance"] * (N_SUBSETS - 2)
    one = Steps()  # one process: its first model alone is warm-up, which the estimate skips by itself
    retrain(cfg.model_copy(update={"store": cfg.store.model_copy(update={"path": Path("one.zarr")})}), reporter=one)
    assert one.events == ["advance"] * N_SUBSETS
