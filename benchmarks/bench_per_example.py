#!/usr/bin/env python
"""Per-example gradients: layer hooks against torch.func.vmap.

Each (method, threads) pair runs in fresh Python processes on the digits MLP
(``model: mlp`` with in_dim 64, hidden_dim 128, num_classes 10, depth 2: 26,122
parameters) at batch 128, through ``trakcli.gradients.per_example_gradients`` as
``trak featurize`` calls it, and reports:

* ``first call``: wall seconds of the first batch, including what the call imports
  (vmap: ``torch._dynamo``) and, for hooks, the first-batch exactness guard;
* ``steady``: median seconds per batch over the next ``--batches`` batches;
* whether ``torch._dynamo`` was imported by the end.

With ``--checkpoints MANIFEST`` (the ``manifest.json`` of ``trak optimize configs/digits.yaml``)
it also times ``trak featurize configs/digits.yaml`` as a user runs it (wall seconds of
the whole command, a fresh store each run) for each method and ``num_threads``.

    .venv/bin/python -m benchmarks.bench_per_example
    .venv/bin/python -m benchmarks.bench_per_example --checkpoints runs/digits/ckpts/manifest.json

Prints a table and writes JSON (``--out``, default bench_results/per_example.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import write_result  # noqa: E402  (atomic; adds date, commit, version, machine)

METHODS = ("hooks", "vmap")
BATCH = 128


def child(method: str, threads: int, batches: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from trakcli.gradients import per_example_gradients
    from trakcli.models.build import build_model

    torch.manual_seed(0)
    model = build_model("mlp", in_dim=64, hidden_dim=128, num_classes=10, depth=2)
    grads = per_example_gradients(model, method=method)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(BATCH, 64, generator=gen) for _ in range(batches + 1)]
    ys = [torch.randint(0, 10, (BATCH,), generator=gen) for _ in range(batches + 1)]
    t = time.perf_counter()
    grads(xs[0], ys[0])
    first = time.perf_counter() - t
    times = []
    for x, y in zip(xs[1:], ys[1:]):
        t = time.perf_counter()
        grads(x, y)
        times.append(time.perf_counter() - t)
    return {"method": grads.method, "threads": threads, "first_call_s": first, "steady_s": statistics.median(times),
            "dynamo_imported": "torch._dynamo" in sys.modules}


def featurize_wall(checkpoints: str, method: str, threads: int) -> float:
    """Wall seconds of one `trak featurize configs/digits.yaml` into a fresh store."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "trakcli.cli.main", "featurize", str(REPO / "configs" / "digits.yaml"), "-q",
               f"checkpoints={checkpoints}", f"store.path={tmp}/s.zarr", f"num_threads={threads}",
               f"gradient_method={method}"]
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per (method, threads)")
    ap.add_argument("--batches", type=int, default=20, help="timed batches after the first")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--checkpoints", help="manifest.json of the digits checkpoints: also time trak featurize")
    ap.add_argument("--out", default=str(REPO / "bench_results" / "per_example.json"))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.batches)))
        return

    def run(method: str, threads: int) -> dict:
        cmd = [sys.executable, __file__, "--child", method, str(threads), "--batches", str(args.batches)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        return json.loads(out.stdout.strip().splitlines()[-1])

    load = [os.getloadavg()[0]]
    rows = {}
    for threads in args.threads:
        for _ in range(args.repeats):  # interleaved, so that a load change hits both methods
            for method in METHODS:
                rows.setdefault(f"{method}/{threads}", []).append(run(method, threads))
    table = {}
    for key, rs in rows.items():
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        table[key] = {"first_call_s": med("first_call_s"), "steady_s": med("steady_s"),
                      "dynamo_imported": any(r["dynamo_imported"] for r in rs), "runs": rs}
    cli = {}
    if args.checkpoints:
        for threads in args.threads:
            for _ in range(args.repeats):
                for method in METHODS:
                    cli.setdefault(f"{method}/{threads}", []).append(featurize_wall(args.checkpoints, method, threads))
    load.append(os.getloadavg()[0])
    print(f"digits MLP 64-128-128-10, batch {BATCH}, median of {args.repeats} fresh processes, "
          f"1-min load {load[0]:.2f} -> {load[1]:.2f} (2 cores)")
    print(f"{'method/threads':15} {'first call s':>13} {'steady ms/batch':>16} {'dynamo':>7}"
          + (f" {'trak featurize s':>17}" if cli else ""))
    for key, r in table.items():
        extra = f" {statistics.median(cli[key]):17.2f}" if cli else ""
        print(f"{key:15} {r['first_call_s']:13.3f} {1000 * r['steady_s']:16.2f} "
              f"{'yes' if r['dynamo_imported'] else 'no':>7}{extra}")
    write_result(args.out, {"benchmark": "bench_per_example", "batch": BATCH, "repeats": args.repeats,
                            "batches": args.batches, "load_avg_1min": load, "gradients": table,
                            "trak_featurize_s": cli})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
