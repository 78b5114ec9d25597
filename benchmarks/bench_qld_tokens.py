#!/usr/bin/env python
"""Per-token QLD on a fine-tuned language model: leave each query's top training tokens out of the loss.

The fine-tune of ``benchmarks/bench_lds_finetune.py`` (a small GPT-2 pretrained on Shakespeare,
fine-tuned on 1,000 BBC snippets of 64 tokens; run it first, its work folder is reused): for
``--queries`` of its 100 targets, `trak eval qld` with ``eval.qld.per_token`` retrains the fine-tune
(the same recipe: AdamW, lr 5e-4, 3 epochs, batch 16, from the pretrained weights) on all tokens,
without the query's top 1% training tokens by each method's per-token scores, and without 1% random
tokens, all with the same seed, and reports the query's loss increase with bootstrap intervals.
Rows: trakcli ``curvature.kind: ekfac`` (exact scores), TRAK (sjlt 4096, TRAK's kernel); the random
tokens and a lexical row (the query's own target tokens in the train documents, rarest first:
:func:`trakcli.evaluation.bm25.token_overlap_scores`) are each run's baselines. Token masking keeps every batch the same, so the models differ
only by the masked tokens.

Usage::

    python -m benchmarks.bench_lds_finetune --workers 1 --threads 2   # once: the fine-tune and its data
    python -m benchmarks.bench_qld_tokens --queries 10

Prints a table and writes JSON (``--out``, default bench_results/qld_tokens.json) with the date,
commit, trakcli version and machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import write_result  # noqa: E402  (atomic; adds date, commit, version, machine)

#: The fine-tune's recipe (benchmarks/bench_lds_finetune.py FINETUNE), as `trak optimize` runs it.
RECIPE = {"n_models": 1, "epochs": 3, "batch_size": 16, "lr": 5.0e-4, "weight_decay": 0.0, "optimizer": "adamw",
          "schedule": "constant", "out_dir": "qld_ckpts"}

METHODS = {
    "ekfac": {"curvature": {"kind": "ekfac"}, "projector": {"kind": "sjlt", "proj_dim": 4096},
              "grad_wrt": ["transformer.h.*.attn.c_*", "transformer.h.*.mlp.*"]},
    "trak": {"projector": {"kind": "sjlt", "proj_dim": 4096}},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="runs/bench_finetune", help="the work folder of bench_lds_finetune.py")
    ap.add_argument("--queries", type=int, default=10)
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--methods", default="ekfac,trak")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench_results/qld_tokens.json")
    a = ap.parse_args()
    work = ROOT / a.work
    if not (work / "finetune.yaml").exists():
        sys.exit(f"{work}/finetune.yaml is missing: run python -m benchmarks.bench_lds_finetune first")
    base = yaml.safe_load((work / "finetune.yaml").read_text())
    rows = {}
    for name in a.methods.split(","):
        cfg = json.loads(json.dumps(base))
        cfg.update(json.loads(json.dumps(METHODS[name])))
        cfg["store"] = f"stores/qld_tokens_{name}.zarr"
        cfg["score"] = {"experiment": "qld", "top_k": 5}
        cfg["optimize"] = dict(RECIPE)
        cfg["eval"] = {"qld": {"queries": a.queries, "fraction": a.fraction, "per_token": True}, "bootstrap": 1000}
        cfg["num_threads"] = a.threads
        path = work / f"qld_tokens_{name}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        t0 = time.perf_counter()
        for args in (["featurize", path.name, "-q"], ["score", path.name, "-q"],
                     ["eval", "qld", path.name, "-q", "--out", f"qld_tokens_{name}.json"]):
            res = subprocess.run([sys.executable, "-m", "trakcli.cli.main", *args], cwd=work, capture_output=True,
                                 text=True)
            if res.returncode != 0:
                sys.exit(f"trak {' '.join(args)} failed:\n{res.stderr[-3000:]}")
        out = json.loads((work / f"qld_tokens_{name}.json").read_text())
        out["seconds"] = time.perf_counter() - t0
        rows[name] = out
        print(f"{name}: top {out['qld_top']['mean']:.4f} random {out['qld_random']['mean']:.4f} "
              f"({out['seconds']:.0f}s)", flush=True)

    def cell(v):
        return f"{v['mean']:.4f} [{v['low']:.4f}, {v['high']:.4f}]"

    print(f"\n{'method':10s} {'top tokens left out':>28s} {'random tokens left out':>28s} {'top - random':>28s} "
          f"{'query tokens (lexical)':>28s}")
    for name, out in rows.items():
        lexical = out.get("baselines", {}).get("token_overlap")
        print(f"{name:10s} {cell(out['qld_top']):>28s} {cell(out['qld_random']):>28s} "
              f"{cell(out['qld_top_minus_random']):>28s} {cell(lexical) if lexical else '':>28s}")
    result = {
        "benchmark": "qld_tokens",
        "command": " ".join(["python", "-m", "benchmarks.bench_qld_tokens", *sys.argv[1:]]),
        "machine": {"threads": a.threads},
        "queries": a.queries, "fraction": a.fraction, "recipe": RECIPE,
        "rows": {name: {k: out[k] for k in ("qld_top", "qld_random", "qld_top_minus_random", "n_dropped",
                                             "n_queries", "seconds", "per_query", "baselines")} for name, out in rows.items()},
    }
    write_result(ROOT / a.out, result)
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()
