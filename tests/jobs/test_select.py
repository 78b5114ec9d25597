"""`trak select` (trakcli.jobs.select): the selection against a float64 reference from the stored features, the
output in the pool's own format, reuse of the store on a rerun, and one clear error per bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from projects import FACT_WORDS, fact_rows, run, word_tokenizer, write_config, write_jsonl
from trakcli.jobs.select import n_selected, quota_rows, top_rows

MODEL_FILE = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def gpt2(vocab_size=29, seed=0):
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                     bos_token_id=1, eos_token_id=1, attn_implementation="eager")
    return GPT2LMHeadModel(cfg)
'''

COUNTRIES = ["norway", "chile", "kenya", "laos", "peru", "mali"]
CITIES = ["oslo", "santiago", "nairobi", "vientiane", "lima", "bamako"]
N_POOL = 30


def _lm_project(root: Path) -> Path:
    """A tiny GPT-2 of two checkpoints (two seeds), a pool of 30 prompt/completion rows with extra fields, and 4
    target rows in two tasks (field ``task``)."""
    import importlib.util

    vocab = word_tokenizer(root / "tok", [*FACT_WORDS, *COUNTRIES, *CITIES])
    (root / "lm_model.py").write_text(MODEL_FILE)
    spec = importlib.util.spec_from_file_location("select_lm_model", root / "lm_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for seed in range(2):
        torch.save(mod.gpt2(vocab, seed).state_dict(), root / f"ck{seed}.pt")
    facts = fact_rows(N_POOL, 1, COUNTRIES, CITIES)
    pool = [{"id": f"doc-{i}", **r, "note": "ü" * (i % 3)} for i, r in enumerate(facts)]
    write_jsonl(root / "pool.jsonl", pool)
    targets = [{**r, "task": "ab"[i % 2]} for i, r in enumerate(fact_rows(4, 2, COUNTRIES[:3], CITIES[:3]))]
    write_jsonl(root / "target.jsonl", targets)
    data = {"prompt": "prompt", "completion": "completion", "tokenizer": "tok", "max_length": 16}
    return write_config(root / "run.yaml", {
        "model": {"entrypoint": "lm_model.py:gpt2", "kwargs": {"vocab_size": vocab}},
        "task": "language_modeling",
        "checkpoints": ["ck0.pt", "ck1.pt"],
        "data": {"train": {"path": "pool.jsonl", **data}, "target": {"path": "target.jsonl", **data},
                 "batch_size": 8},
        "projector": {"kind": "sjlt", "proj_dim": 48, "seed": 0},
        "store": {"path": "s.zarr", "chunk_rows": 8},
        "select": {"out": "selected.jsonl"},
        "num_threads": 1,
    })


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> Path:
    """The project after one `trak select` (fraction 0.2, max_mean over the two tasks)."""
    root = tmp_path_factory.mktemp("select_lm")
    _lm_project(root)
    res = run(root, "select", "run.yaml", "select.fraction=0.2", "select.group_by=task", "-q")
    assert res.returncode == 0, res.stderr
    return root


def _features(store: Path, group: str, n_models: int = 2) -> list[np.ndarray]:
    g = zarr.open_group(str(store), mode="r")
    return [np.asarray(g[f"{group}/{m}/features"][:], dtype=np.float64) for m in range(n_models)]


def _reference(root: Path, aggregate: str, groups: list | None, unit: bool = True, store: str = "s.zarr",
               n_models: int = 2) -> np.ndarray:
    """Every pool row's score in float64 from the stored features: the [n_target, n_train] matrix of cosines summed
    over the checkpoints, then aggregated over the targets (written without trakcli's code)."""
    total = 0.0
    for t, z in zip(_features(root / store, "targets/select", n_models), _features(root / store, "train", n_models)):
        if unit:
            t = t / np.linalg.norm(t, axis=1, keepdims=True)
            z = z / np.linalg.norm(z, axis=1, keepdims=True)
        total = total + t @ z.T  # [n_target, n_train]
    if aggregate == "sum":
        return total.sum(0)
    if aggregate == "mean" or groups is None:
        return total.mean(0)
    return np.max([total[[i for i, g in enumerate(groups) if g == name]].mean(0) for name in set(groups)], 0)


def _want(scores: np.ndarray, k: int) -> list[int]:
    return sorted(sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k])


def _sidecar(root: Path, out: str = "selected.jsonl") -> list[dict]:
    return [json.loads(x) for x in (root / out).with_name(Path(out).stem + ".scores.jsonl").read_text().splitlines()]


def test_the_selected_rows_are_the_top_of_a_float64_reference_verbatim_in_the_pools_format(lm):
    targets = [json.loads(x) for x in (lm / "target.jsonl").read_text().splitlines()]
    ref = _reference(lm, "max_mean", [t["task"] for t in targets])
    lines, side = (lm / "selected.jsonl").read_text(encoding="utf-8").splitlines(), _sidecar(lm)
    k = round(0.2 * N_POOL)
    want = _want(ref, k)
    assert [e["row"] for e in side] == want  # pool order
    pool = (lm / "pool.jsonl").read_text(encoding="utf-8").splitlines()
    assert lines == [pool[i] for i in want]  # the pool's own lines, byte for byte
    np.testing.assert_allclose([e["score"] for e in side], ref[want], rtol=1e-9, atol=1e-12)
    assert sorted(e["rank"] for e in side) == list(range(1, k + 1))
    best = max(side, key=lambda e: e["score"])
    assert best["rank"] == 1 and best["group"] in ("a", "b")


@pytest.mark.parametrize(("aggregate", "size"), [("mean", "select.count=7"), ("sum", "select.fraction=0.1")])
def test_mean_and_sum_and_count_and_fraction_on_a_rerun_that_reuses_every_feature(lm, aggregate, size):
    g = zarr.open_group(str(lm / "s.zarr"), mode="r")
    before = {m: g[f"train/{m}/features"][:].copy() for m in range(2)}
    res = run(lm, "select", "run.yaml", f"select.aggregate={aggregate}", size, f"select.out={aggregate}.jsonl",
              "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["train_chunks_computed"] == 0 and data["target_chunks_computed"] == 0  # nothing recomputed
    assert "reused" in res.stderr
    k = 7 if "count" in size else round(0.1 * N_POOL)
    assert data["n_selected"] == k and data["aggregate"] == aggregate and data["n_models"] == 2
    ref = _reference(lm, aggregate, None)
    side = _sidecar(lm, f"{aggregate}.jsonl")
    assert [e["row"] for e in side] == _want(ref, k)
    assert data["threshold"] == pytest.approx(min(ref[_want(ref, k)]), rel=1e-9)
    assert data["top"][0]["text"] and data["top"][0]["row"] == int(np.argmax(ref))
    for m in range(2):
        np.testing.assert_array_equal(g[f"train/{m}/features"][:], before[m])


def test_inner_products_and_a_csv_pool_written_as_csv(lm, tmp_path):
    for name in ("run.yaml", "pool.jsonl", "target.jsonl", "lm_model.py", "ck0.pt", "ck1.pt"):
        shutil.copy(lm / name, tmp_path / name)
    shutil.copytree(lm / "tok", tmp_path / "tok")
    import csv

    rows = [json.loads(x) for x in (lm / "pool.jsonl").read_text().splitlines()]
    rows[3]["prompt"] = 'a "quoted", two-line\nprompt'  # a record spanning two lines
    with open(tmp_path / "pool.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    res = run(tmp_path, "select", "run.yaml", "data.train.path=pool.csv", "select.normalize=null",
              "select.count=30", "select.out=sel.csv", "-q")
    assert res.returncode == 0, res.stderr
    with open(tmp_path / "sel.csv", newline="", encoding="utf-8") as f:
        got = list(csv.DictReader(f))
    assert got == [{k: str(v) for k, v in r.items()} for r in rows]  # every row kept: the whole pool, in pool order
    side = _sidecar(tmp_path, "sel.csv")
    ref = _reference(tmp_path, "max_mean", None, unit=False)  # the csv pool is a new store: its own features
    np.testing.assert_allclose([e["score"] for e in side], ref, rtol=1e-9, atol=1e-9)


def test_a_tensor_pool_selects_its_rows_tensors_under_the_same_keys(user_project):
    res = run(user_project, "select", "run.yaml", "select.count=25", "select.out=sel.pt", "select.group_by=y_target")
    assert res.returncode == 0, res.stderr
    pool = torch.load(user_project / "ckpts" / "data.pt")
    got = torch.load(user_project / "sel.pt")
    rows = [e["row"] for e in _sidecar(user_project, "sel.pt")]
    assert sorted(got) == ["x_train", "y_train"] and len(rows) == 25
    assert torch.equal(got["x_train"], pool["x_train"][rows]) and torch.equal(got["y_train"], pool["y_train"][rows])
    ref = _reference(user_project, "max_mean", pool["y_target"].tolist(), store="out/attrib.zarr")
    assert rows == _want(ref, 25)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["select.fraction=0.1", "select.count=3"], "select.fraction (0.1) and select.count (3) are both set"),
        (["select.fraction=1.5"], "select.fraction: Input should be less than or equal to 1"),
        (["select.fraction=0"], "select.fraction: Input should be greater than 0"),
        (["select.count=31"], "select.count is 31 but data.train has 30 rows"),
        (["select.group_by=topic"], "data.target (target.jsonl) has no field 'topic'"),
        (["select.out=nodir/sel.jsonl"], "directory nodir does not exist"),
        (["select.out=sel.parquet"], "data.train is a .jsonl file, written as .jsonl"),
        (["select.out=null"], "select.out is unset"),
        (["select.aggregate=mean", "select.group_by=task"], "select.group_by groups the targets of aggregate max_mean"),
    ],
)
def test_each_bad_input_is_one_clear_error(lm, args, message):
    res = run(lm, "select", "run.yaml", *args)
    assert res.returncode == 1, res.stderr
    assert message in " ".join(res.stderr.split())


def test_an_unwritable_out_path_is_one_clear_error(lm, tmp_path, monkeypatch):
    import os

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.access(locked, os.W_OK):  # root may write anywhere: the folder's mode is what a user would meet
        real = os.access
        monkeypatch.setattr("trakcli.jobs.pool_files.os.access",
                            lambda p, mode: real(p, mode) and not str(p).startswith(str(locked)))
    try:
        res = run(lm, "select", "run.yaml", f"select.out={locked}/sel.jsonl")
    finally:
        locked.chmod(0o700)
    assert res.returncode == 1 and f"cannot write to {locked} (permission denied)" in " ".join(res.stderr.split())
    res = run(lm, "select", "run.yaml", "select.out=pool.jsonl/sel.jsonl")
    assert res.returncode == 1 and "pool.jsonl is a file, not a directory" in " ".join(res.stderr.split())


def test_count_rounding_and_ties_by_row_index():
    assert n_selected(30) == 2  # the default 5%: round(1.5), half to even
    assert n_selected(100, fraction=0.05) == 5 and n_selected(10, fraction=0.01) == 1 and n_selected(7, count=7) == 7
    assert n_selected(50, fraction=0.25) == 12  # round(12.5) = 12
    scores = np.array([1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.5])
    assert top_rows(scores, 4).tolist() == [1, 3, 2, 4]
    assert top_rows(scores, 7).tolist() == [1, 3, 2, 4, 5, 0, 6]
    rng = np.random.default_rng(0)
    many = rng.integers(0, 5, 1000).astype(float)
    assert top_rows(many, 123).tolist() == sorted(range(1000), key=lambda i: (-many[i], i))[:123]


def test_the_python_api_selects_what_the_cli_selects(user_project):
    from torch.utils.data import DataLoader, TensorDataset

    import trakcli
    from trakcli.models import build_model
    from trakcli.progress import NULL_REPORTER

    res = run(user_project, "select", "run.yaml", "select.count=10", "select.out=sel.pt", "select.group_by=y_target",
              "-q")
    assert res.returncode == 0, res.stderr
    data = torch.load(user_project / "ckpts" / "data.pt")
    att = trakcli.Attributor(build_model("my_model.py:make_model"), store={"path": "api.zarr", "chunk_rows": 16},
                             projector={"kind": "rademacher", "proj_dim": 16, "seed": 0}, reporter=NULL_REPORTER)
    ckpts = sorted((user_project / "ckpts").glob("model_*.pt"))
    for m, ckpt in enumerate(ckpts):
        att.featurize(DataLoader(TensorDataset(data["x_train"], data["y_train"]), batch_size=8), checkpoint=ckpt,
                      model_id=m)
    target = DataLoader(TensorDataset(data["x_target"], data["y_target"]), batch_size=8)
    sel = att.select(target, checkpoints=ckpts, count=10, groups=data["y_target"].tolist())
    assert sel.rows.tolist() == [e["row"] for e in _sidecar(user_project, "sel.pt")]
    assert sel.scores.shape == (40,) and sel.ranked[0] == int(np.argmax(sel.scores))
    with pytest.raises(trakcli.errors.ConfigError, match="select.fraction"):
        att.select(target, checkpoints=ckpts, fraction=2.0)
    # quota equal through the API: the rows trak select keeps with select.quota=equal
    res = run(user_project, "select", "run.yaml", "select.count=9", "select.out=quota.pt", "select.group_by=y_target",
              "select.quota=equal", "select.experiment=quota", "-q")
    assert res.returncode == 0, res.stderr
    sel = att.select(target, checkpoints=ckpts, count=9, groups=data["y_target"].tolist(), quota="equal",
                     experiment="quota")
    assert sel.rows.tolist() == [e["row"] for e in _sidecar(user_project, "quota.pt")]
    with pytest.raises(trakcli.errors.ConfigError, match="quota"):
        att.select(target, checkpoints=ckpts, count=9, quota="equal")


def test_table_and_builtin_pools_are_written_in_their_own_format(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trakcli.config.schema import DatasetConfig
    from trakcli.data.load import load_dataset
    from trakcli.errors import ConfigError
    from trakcli.jobs.pool_files import write_rows

    table = pa.table({"text": [f"row {i}" for i in range(9)], "id": list(range(9)), "tags": [[i, i] for i in range(9)]})
    pq.write_table(table, tmp_path / "pool.parquet")
    section = DatasetConfig(path=tmp_path / "pool.parquet", text="text", tokenizer="tok")
    rows = np.array([1, 4, 8])
    for suffix in (".parquet", ".arrow"):
        write_rows(section, rows, tmp_path / f"sel{suffix}")
    assert pq.read_table(tmp_path / "sel.parquet").to_pylist() == table.take(rows).to_pylist()
    with pa.memory_map(str(tmp_path / "sel.arrow")) as f:
        assert pa.ipc.open_stream(f).read_all().to_pylist() == table.take(rows).to_pylist()
    with pytest.raises(ConfigError, match="written as .parquet or .arrow"):
        write_rows(section, rows, tmp_path / "sel.jsonl")
    digits = DatasetConfig(builtin="digits", split="train")
    write_rows(digits, rows, tmp_path / "digits.pt")
    got, pool = torch.load(tmp_path / "digits.pt"), load_dataset(digits)
    assert torch.equal(got["inputs"], pool.inputs[rows]) and torch.equal(got["labels"], pool.labels[rows])


def test_select_reads_and_hashes_the_pool_once(user_project, monkeypatch):
    """`trak select` featurizes with the setup it made: the pool is loaded once, not again by featurize."""
    import trakcli.jobs.setup as setup

    loads = []
    real = setup.load_dataset
    monkeypatch.setattr(setup, "load_dataset", lambda ds, key, **kw: loads.append(key) or real(ds, key=key, **kw))
    res = run(user_project, "select", "run.yaml", "select.count=5", "select.out=sel.pt")
    assert res.returncode == 0, res.stderr
    assert loads == ["data.train"]


def test_torchrun_two_ranks_select_what_one_process_selects(tmp_path):
    """Under torchrun the ranks featurize and score their share of the pool; rank 0 writes the same selection."""
    import os
    import subprocess
    import sys

    from projects import assert_same_store, free_port, make_project

    one = make_project(tmp_path / "one", n_models=2)
    shutil.copytree(one, tmp_path / "two")
    args = ["select", "run.yaml", "-q", "select.count=25", "select.out=sel.pt"]
    res = run(one, *args)
    assert res.returncode == 0, res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "trakcli.cli.main", *args],
        cwd=tmp_path / "two", capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "two" / "sel.pt").read_bytes() == (one / "sel.pt").read_bytes()
    assert _sidecar(tmp_path / "two", "sel.pt") == _sidecar(one, "sel.pt")
    assert_same_store(one / "out" / "attrib.zarr", tmp_path / "two" / "out" / "attrib.zarr")


def test_select_makes_no_kernel_and_a_later_score_makes_it(user_project):
    """Selection reads no kernel, so trak select leaves it out; trak score on the same store makes the one it needs."""
    res = run(user_project, "select", "run.yaml", "select.count=5", "select.out=sel.pt")
    assert res.returncode == 0, res.stderr
    root = zarr.open_group(str(user_project / "out" / "attrib.zarr"), mode="r")
    assert "features" in root["train/0"] and "kernel" not in root["train/0"]
    res = run(user_project, "score", "run.yaml", "-q")
    assert res.returncode == 0, res.stderr
    root = zarr.open_group(str(user_project / "out" / "attrib.zarr"), mode="r")
    assert "kernel" in root["train/0"] and "kernel" in root["train/1"]


# -- group_by and quota: what each guarantees ---------------------------------------------------------------------


def _round_robin(group_scores: np.ndarray, k: int) -> tuple[list[int], list[int]]:
    """The groups take turns (0, 1, ...), each its highest-scoring row not yet taken (ties: lower row)."""
    orders = [sorted(range(len(col)), key=lambda i: (-col[i], i)) for col in group_scores.T]
    taken: list[int] = []
    groups: list[int] = []
    while len(taken) < k:
        for g, order in enumerate(orders):
            if len(taken) < k:
                taken.append(next(i for i in order if i not in taken))
                groups.append(g)
    return taken, groups


@pytest.mark.parametrize("n,n_groups,k,seed", [(50, 3, 10, 0), (40, 4, 4, 1), (30, 2, 30, 2), (200, 5, 37, 3),
                                               (12, 3, 7, 4)])
def test_quota_rows_give_every_group_its_share_of_its_best_rows(n, n_groups, k, seed):
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(n, n_groups))
    scores[:, 0] += 3.0  # group 0 matches every row best: without a quota it would take all k
    scores[rng.integers(0, n, 5), 1] = scores[0, 1]  # equal scores
    assert np.bincount(scores.argmax(1)[top_rows(scores.max(1), k)], minlength=n_groups)[0] >= min(k, n - 5)
    rows, groups = quota_rows(scores, k)
    want_rows, want_groups = _round_robin(scores, k)
    assert rows.tolist() == want_rows and groups.tolist() == want_groups
    assert len(set(rows.tolist())) == k  # no row twice
    counts = np.bincount(groups, minlength=n_groups)
    assert counts.tolist() == [k // n_groups + (g < k % n_groups) for g in range(n_groups)]
    left_out = np.setdiff1d(np.arange(n), rows)
    for g in range(n_groups):  # no row left out scores higher for a group than a row that group kept
        if left_out.size:
            assert scores[left_out, g].max() <= scores[rows[groups == g], g].min()


def test_quota_needs_a_row_per_group():
    from trakcli.errors import ConfigError

    with pytest.raises(ConfigError, match=r"shares 2 rows among 3 target groups, so some group would keep none; "
                                          r"keep at least 3 rows \(select.count=3 or more\)"):
        quota_rows(np.zeros((10, 3)), 2)


def test_group_by_alone_may_keep_one_groups_rows_and_quota_equal_shares_them(lm):
    targets = [json.loads(x) for x in (lm / "target.jsonl").read_text().splitlines()]
    tasks = [t["task"] for t in targets]
    res = run(lm, "select", "run.yaml", "select.count=6", "select.group_by=task", "select.quota=equal",
              "select.out=quota.jsonl")
    assert res.returncode == 0, res.stderr
    assert "rows kept per target group (each group its share (select.quota: equal)): a: 3, b: 3" in \
        " ".join(res.stderr.split())
    side = _sidecar(lm, "quota.jsonl")
    # the reference: per group, the mean over its targets of the cosines summed over checkpoints
    total = 0.0
    for t, z in zip(_features(lm / "s.zarr", "targets/select"), _features(lm / "s.zarr", "train")):
        total = total + (t / np.linalg.norm(t, axis=1, keepdims=True)) @ (z / np.linalg.norm(z, axis=1,
                                                                                            keepdims=True)).T
    names = list(dict.fromkeys(tasks))
    per_group = np.stack([total[[i for i, g in enumerate(tasks) if g == name]].mean(0) for name in names], 1)
    rows, groups = _round_robin(per_group, 6)
    assert [e["row"] for e in side] == sorted(rows)
    by_row = dict(zip(rows, groups))
    assert [e["group"] for e in side] == [names[by_row[e["row"]]] for e in side]
    np.testing.assert_allclose([e["score"] for e in side], [per_group[e["row"], by_row[e["row"]]] for e in side],
                               rtol=1e-9, atol=1e-12)
    assert sorted(e["rank"] for e in side) == list(range(1, 7))
    # without the quota: one ranking by the best group, whatever the groups keep
    res = run(lm, "select", "run.yaml", "select.count=6", "select.group_by=task", "select.out=plain.jsonl", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    best = per_group.max(1)
    assert [e["row"] for e in _sidecar(lm, "plain.jsonl")] == _want(best, 6)
    kept = per_group.argmax(1)[_want(best, 6)]
    assert data["quota"] is None
    assert data["selected_per_group"] == {name: int((kept == g).sum()) for g, name in enumerate(names)}


@pytest.mark.parametrize(
    "args,message",
    [
        (["select.quota=equal"], "select.quota: equal shares the kept rows among the target groups of select.group_by, "
                                 "which is unset"),
        (["select.quota=equal", "select.group_by=task", "select.count=1"], "shares 1 rows among 2 target groups"),
        (["select.quota=most"], "select.quota: Input should be 'equal'"),
    ],
)
def test_bad_quotas_are_one_clear_error(lm, args, message):
    res = run(lm, "select", "run.yaml", *args)
    assert res.returncode == 1, res.stderr
    assert message in " ".join(res.stderr.split())


def test_text_targets_of_another_max_length_select_as_those_of_the_train_length(lm, tmp_path):
    """Features are per example: targets cut at another length (or not at all) are scored against the same pool.
    The targets are shorter than 16 tokens, so every max_length at or above their longest gives the same rows."""
    shutil.copytree(lm, tmp_path / "p")
    root = tmp_path / "p"
    res = run(root, "select", "run.yaml", "select.count=6", "select.out=same.jsonl")
    assert res.returncode == 0, res.stderr
    for value, name in (("null", "whole"), ("40", "long")):
        res = run(root, "select", "run.yaml", "select.count=6", f"select.out={name}.jsonl",
                  f"data.target.max_length={value}", f"select.experiment={name}")
        assert res.returncode == 0, res.stderr
        assert (root / f"{name}.jsonl").read_text() == (root / "same.jsonl").read_text()
        np.testing.assert_allclose([e["score"] for e in _sidecar(root, f"{name}.jsonl")],
                                   [e["score"] for e in _sidecar(root, "same.jsonl")], rtol=1e-6)
    res = run(root, "select", "run.yaml", "select.count=6", "select.out=short.jsonl", "data.target.max_length=4",
              "select.experiment=short")
    assert res.returncode == 0, res.stderr
    cut = [e["score"] for e in _sidecar(root, "short.jsonl")]
    assert not np.allclose(cut, [e["score"] for e in _sidecar(root, "same.jsonl")][:len(cut)])
