#!/usr/bin/env python
"""Benchmark the projectors: examples/s, first-call time and peak memory, plus JL distortion.

Every measurement runs in its own subprocess, so peak resident memory
(``VmHWM``) is that of one projector alone; "peak extra" is the high-water mark
minus the one right after the input gradients were made. Baselines in the same
table:

* ``matmul``: ``g @ Pᵀ`` with a pre-made dense matrix (the dense compute floor);
* ``traker``: MadryLab's ``trak.projectors.BasicProjector`` (``pip install
  traker``), run with the interpreter given by ``--traker-python`` (default: the
  repository's ``.venv-bench``); skipped when traker is not importable there.

Presets:

* ``goals`` (default): the shapes of the projector goals — grad_dim 1e6,
  proj_dim 1024, batch 32 for every kind and implementation and both
  baselines; chunked rademacher at grad_dim 1e7, proj_dim 2048, batch 32 for
  peak memory; the distortion table.
* ``grid``: grad_dim {1e5, 1e6, 1e7} × proj_dim {512, 2048, 8192} × batch {32,
  256}; configurations whose dense matrix exceeds ``--max-matrix-gib`` skip
  ``single_block`` and ``matmul``; each run stops at ``--timeout``.
* ``quick``: small shapes, a smoke test of this script.

Usage::

    .venv/bin/python -m benchmarks.bench_projectors                 # goals preset
    .venv/bin/python -m benchmarks.bench_projectors --preset grid --out grid.json
    .venv/bin/python -m benchmarks.bench_projectors --preset quick

Prints a table to stdout and writes all numbers to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import write_result  # noqa: E402  (atomic; adds date, commit, version, machine)


# -- child side ------------------------------------------------------------------------------------


def _vm_hwm() -> int:
    """Peak resident set size of this process in bytes (Linux ``VmHWM``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _make_input(grad_dim: int, batch: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    g = torch.empty(batch, grad_dim)
    g.normal_(generator=gen)  # in place: no temporary raises the memory high-water mark
    return g


def _as_param_dict(g, n_params: int = 8):
    """Views of ``g`` as a dict of per-parameter gradients (no copy)."""
    bounds = [round(i * g.shape[1] / n_params) for i in range(n_params + 1)]
    return {f"p{i}": g[:, bounds[i] : bounds[i + 1]] for i in range(n_params)}


def child_speed(job: dict) -> dict:
    import torch

    grad_dim, proj_dim, batch = job["grad_dim"], job["proj_dim"], job["batch"]
    g = _make_input(grad_dim, batch)
    base = _vm_hwm()
    method, kind = job["method"], job.get("kind")
    if method == "matmul":
        pt = torch.empty(grad_dim, proj_dim)
        for a in range(0, grad_dim, 2**16):
            pt[a : a + 2**16].bernoulli_(0.5)
        run = lambda: g @ pt  # noqa: E731
    elif method == "traker":
        from trak.projectors import BasicProjector, ProjectionType

        proj = BasicProjector(
            grad_dim=grad_dim, proj_dim=proj_dim, seed=0, proj_type=ProjectionType(kind),
            device=torch.device("cpu"), dtype=torch.float32,
        )
        run = lambda: proj.project(g, model_id=0)  # noqa: E731
    else:
        from trakcli.projectors import make_projector

        proj = make_projector(
            kind=kind, implementation=job["impl"], grad_dim=grad_dim, proj_dim=proj_dim, seed=0,
            **job.get("options", {}),
        )
        inp = _as_param_dict(g) if job["impl"] == "chunked" else g
        run = lambda: proj.project(inp, model_id=0)  # noqa: E731
    t = time.perf_counter()
    run()
    first = time.perf_counter() - t
    times = []
    deadline = time.perf_counter() + job.get("steady_seconds", 20)
    for _ in range(job.get("repeats", 2)):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
        if time.perf_counter() > deadline:
            break
    steady = min(times) if times else first
    return {
        "first_call_s": first,
        "steady_s": steady,
        "examples_per_s": batch / steady,
        "peak_extra_bytes": _vm_hwm() - base,
        "input_bytes": g.numel() * g.element_size(),
        "threads": torch.get_num_threads(),
    }


def child_distortion(job: dict) -> dict:
    """Mean relative distortion |‖P(x−y)‖/‖x−y‖ − 1| over pairs, averaged over model_ids."""
    import torch

    from trakcli.projectors import make_projector

    grad_dim, proj_dim, n = job["grad_dim"], job["proj_dim"], job["n_points"]
    gen = torch.Generator().manual_seed(1)
    data = {
        "gaussian": torch.randn(n, grad_dim, generator=gen, dtype=torch.float64),
        # heavy-tailed, like real per-example gradients: a few coordinates dominate
        "heavy_tailed": torch.distributions.StudentT(1.5).sample((n, grad_dim)).double()
        * (torch.rand(n, grad_dim, generator=gen) < 0.05),
    }
    out = {}
    proj = make_projector(
        kind=job["kind"], implementation="basic", grad_dim=grad_dim, proj_dim=proj_dim, seed=0,
        **job.get("options", {}),
    )
    for name, x in data.items():
        d = torch.pdist(x)
        errs = []
        for model_id in range(job["model_ids"]):
            f = proj.project(x, model_id=model_id).double()
            errs.append(((torch.pdist(f) / d) - 1).abs().mean().item())
        out[name] = sum(errs) / len(errs)
    return out


def child_main(spec: str) -> None:
    job = json.loads(spec)
    try:
        result = child_distortion(job) if job["mode"] == "distortion" else child_speed(job)
        result["ok"] = True
    except Exception as exc:  # reported in the table, not fatal to the benchmark
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print("RESULT " + json.dumps(result), flush=True)


# -- parent side -----------------------------------------------------------------------------------


def run_child(job: dict, python: str, timeout: float) -> dict:
    cmd = [python, str(Path(__file__).resolve()), "--child", json.dumps(job)]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timeout after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"ok": False, "error": f"exit {proc.returncode}: {tail[0]}"}


def traker_available(python: str | None) -> bool:
    if not python or not Path(python).exists():
        return False
    proc = subprocess.run([python, "-c", "import trak.projectors"], capture_output=True)
    return proc.returncode == 0


TRAKCLI_METHODS = [
    ("rademacher", "single_block", {}),
    ("rademacher", "basic", {}),
    ("rademacher", "chunked", {}),
    ("normal", "basic", {}),
    ("sjlt", "basic", {"s": 1}),
    ("sjlt", "chunked", {"s": 1}),
    ("sjlt", "basic", {"s": 4}),
]


def speed_jobs(shapes, methods, with_traker: bool, max_matrix_gib: float, repeats: int):
    jobs = []
    for grad_dim, proj_dim, batch in shapes:
        dense_gib = grad_dim * proj_dim * 4 / 2**30
        common = {"mode": "speed", "grad_dim": grad_dim, "proj_dim": proj_dim, "batch": batch,
                  "repeats": repeats}
        if dense_gib <= max_matrix_gib:
            jobs.append({**common, "method": "matmul", "kind": "rademacher"})
        if with_traker:
            jobs.append({**common, "method": "traker", "kind": "rademacher", "repeats": 1})
        for kind, impl, options in methods:
            if impl == "single_block" and kind != "sjlt" and dense_gib > max_matrix_gib:
                continue
            jobs.append({**common, "method": "trakcli", "kind": kind, "impl": impl, "options": options})
    return jobs


def label(job: dict) -> str:
    if job["method"] != "trakcli":
        return f"{job['method']} ({job['kind']})" if job["method"] == "traker" else "bare matmul"
    opts = "".join(f" {k}={v}" for k, v in job.get("options", {}).items())
    return f"{job['kind']}{opts} / {job['impl']}"


def fmt_num(x: float) -> str:
    return f"{x:,.1f}" if x < 1000 else f"{x:,.0f}"


def print_speed_table(rows) -> None:
    head = f"{'method':<28} {'grad_dim':>9} {'proj':>5} {'batch':>5} {'first s':>8} {'ex/s':>9} " \
           f"{'x traker':>9} {'x matmul':>9} {'peak extra MiB':>15}"
    print(head)
    print("-" * len(head))
    for job, res in rows:
        shape = f"{job['grad_dim']:>9.0e} {job['proj_dim']:>5} {job['batch']:>5}"
        if not res.get("ok"):
            print(f"{label(job):<28} {shape} {res.get('error', '')}")
            continue
        vs_t = f"{res['vs_traker']:.1f}" if res.get("vs_traker") else "-"
        vs_m = f"{res['vs_matmul']:.2f}" if res.get("vs_matmul") else "-"
        print(
            f"{label(job):<28} {shape} {res['first_call_s']:>8.2f} {fmt_num(res['examples_per_s']):>9} "
            f"{vs_t:>9} {vs_m:>9} {res['peak_extra_bytes'] / 2**20:>15,.0f}"
        )


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child_main(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=["goals", "grid", "quick"], default="goals")
    ap.add_argument("--out", default="bench_projectors.json", help="JSON output file")
    ap.add_argument("--traker-python", default=str(REPO / ".venv-bench" / "bin" / "python"),
                    help="interpreter with traker installed (baseline); '' to skip")
    ap.add_argument("--max-matrix-gib", type=float, default=6.0,
                    help="skip bare matmul and dense single_block when grad_dim*proj_dim*4 exceeds this")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per measurement")
    ap.add_argument("--repeats", type=int, default=2, help="steady-state calls after the first")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every measurement this many times, alternating, and keep the best")
    ap.add_argument("--no-distortion", action="store_true")
    args = ap.parse_args()

    with_traker = traker_available(args.traker_python)
    if not with_traker:
        print(f"traker not importable with {args.traker_python!r}: no traker baseline", file=sys.stderr)
    if args.preset == "quick":
        shapes, big = [(20_000, 256, 32)], []
        dist = {"grad_dim": 5_000, "proj_dim": 256, "n_points": 16, "model_ids": 2}
    elif args.preset == "goals":
        shapes = [(1_000_000, 1024, 32)]
        big = [(10_000_000, 2048, 32)]
        dist = {"grad_dim": 100_000, "proj_dim": 1024, "n_points": 48, "model_ids": 4}
    else:
        shapes = [(d, k, b) for d in (100_000, 1_000_000, 10_000_000) for k in (512, 2048, 8192)
                  for b in (32, 256)]
        big = []
        dist = {"grad_dim": 100_000, "proj_dim": 1024, "n_points": 48, "model_ids": 4}

    jobs = speed_jobs(shapes, TRAKCLI_METHODS, with_traker, args.max_matrix_gib, args.repeats)
    for grad_dim, proj_dim, batch in big:  # memory goal: chunked over a parameter dict
        jobs.append({"mode": "speed", "grad_dim": grad_dim, "proj_dim": proj_dim, "batch": batch,
                     "repeats": 0, "method": "trakcli", "kind": "rademacher", "impl": "chunked",
                     "options": {}})
        jobs.append({"mode": "speed", "grad_dim": grad_dim, "proj_dim": proj_dim, "batch": batch,
                     "repeats": 0, "method": "trakcli", "kind": "sjlt", "impl": "chunked",
                     "options": {"s": 1}})

    # Rounds run the whole list again and keep each job's best speed, so that a change
    # in the machine's load during the run hits every method alike.
    results: list[list[dict]] = [[] for _ in jobs]
    for rnd in range(args.rounds):
        for i, job in enumerate(jobs):
            if rnd > 0 and job.get("repeats", 1) == 0:
                continue  # single-shot memory runs are not repeated
            python = args.traker_python if job["method"] == "traker" else sys.executable
            print(f"[round {rnd + 1}/{args.rounds}] {label(job)} at {job['grad_dim']:.0e} x "
                  f"{job['proj_dim']}, batch {job['batch']} ...", file=sys.stderr, flush=True)
            results[i].append(run_child(job, python, args.timeout))
    rows = []
    for job, runs in zip(jobs, results):
        ok = [r for r in runs if r.get("ok")]
        if not ok:
            rows.append((job, runs[-1]))
            continue
        best = dict(max(ok, key=lambda r: r["examples_per_s"]))
        best["peak_extra_bytes"] = max(r["peak_extra_bytes"] for r in ok)
        best["rounds"] = len(ok)
        best["examples_per_s_all"] = [r["examples_per_s"] for r in ok]
        rows.append((job, best))
    # ratios against the baselines of the same shape
    for job, res in rows:
        if not res.get("ok"):
            continue
        shape = (job["grad_dim"], job["proj_dim"], job["batch"])
        for base, key in (("traker", "vs_traker"), ("matmul", "vs_matmul")):
            ref = [r for j, r in rows if j["method"] == base and r.get("ok")
                   and (j["grad_dim"], j["proj_dim"], j["batch"]) == shape]
            if ref and job["method"] == "trakcli":
                res[key] = res["examples_per_s"] / ref[0]["examples_per_s"]

    distortion = []
    if not args.no_distortion:
        for kind, options in [("rademacher", {}), ("normal", {}), ("sjlt", {"s": 1}), ("sjlt", {"s": 4})]:
            job = {"mode": "distortion", "kind": kind, "options": options, **dist}
            print(f"distortion of {kind} {options} ...", file=sys.stderr, flush=True)
            distortion.append((job, run_child(job, sys.executable, args.timeout)))

    print()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average at end {os.getloadavg()[0]:.1f}")
    print_speed_table(rows)
    if distortion:
        print()
        print(f"mean relative pairwise-distance distortion, grad_dim {dist['grad_dim']:.0e}, "
              f"proj_dim {dist['proj_dim']}, {dist['n_points']} points, {dist['model_ids']} model_ids")
        print(f"{'kind':<16} {'gaussian':>10} {'heavy-tailed':>13}")
        for job, res in distortion:
            name = job["kind"] + "".join(f" {k}={v}" for k, v in job["options"].items())
            if res.get("ok"):
                print(f"{name:<16} {res['gaussian']:>10.4f} {res['heavy_tailed']:>13.4f}")
            else:
                print(f"{name:<16} {res.get('error')}")
    payload = {
        "benchmark": "bench_projectors",
        "preset": args.preset,
        "load_average_end": os.getloadavg()[0],
        "speed": [{**job, **res} for job, res in rows],
        "distortion": [{**job, **res} for job, res in distortion],
    }
    write_result(args.out, payload)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
