#!/usr/bin/env python
"""Start-up: the CLI commands, and per-example gradients: torch.func.vmap against alternatives.

**CLI** (``--part cli``): wall and CPU seconds of fresh processes, each command
run ``--cli-repeats`` times (interleaved, so a busy machine slows all alike):
``python -c "import torch"`` (and with the garbage collector paused, as the
commands import torch), ``trak --help``, ``trak inspect STORE`` and ``trak
featurize CONFIG`` on a finished store (nothing to do), with each command's
median excess over the ``import torch`` run of the same round. The project is ``--config`` (a config
whose store is featurized; ``--override`` key=value as given to it), else a
digits project built in a temporary directory (trak init digits, trak optimize
with 1 epoch, trak featurize at proj_dim 2048). ``--bytecode-cache`` lets the
children write and read ``.pyc`` files in a temporary ``PYTHONPYCACHEPREFIX``
(after one warm-up run each), for an environment that sets ``PYTHONDONTWRITEBYTECODE``:
every module of trakcli is otherwise compiled from source on every start.

**Per-example gradients** (``--part gradients``): each variant runs in a fresh Python process (one thread, like ``configs/digits.yaml``)
on the digits MLP (64-128-128-10, ReLU, 26,122 parameters) at batch 128 and reports:

* ``import torch``: seconds to import torch in that process;
* ``first call``: wall seconds of the first batch, including any module the call
  imports (``torch.func.vmap`` imports ``torch._dynamo`` on its first call);
* ``steady``: median seconds per batch over the next ``--batches`` batches;
* ``start-up``: first call minus steady, what a fresh process pays once;
* whether ``torch._dynamo`` was imported by the end.

Variants:

* ``vmap``: ``torch.func.vmap(torch.func.grad(f))`` with ``functional_call``, the
  shape of ``trakcli.gradients.vmap.PerExampleGradients`` (margin output function);
* ``loop``: one ``torch.autograd.grad`` per example (ordinary autograd);
* ``hooks``: one batched forward + backward with hooks; each ``nn.Linear``'s
  per-example gradient is ``g_i a_iᵀ`` (and ``g_i`` for the bias): the same
  ``[n, grad_dim]`` gradients as vmap, for models made only of ``nn.Linear`` layers
  acting once per example;
* ``kronecker``: ``trakcli.gradients.KroneckerFeaturizer`` (``--proj-dim``), which
  returns projected features, not gradients (its first call includes importing
  ``trakcli.gradients``);
* ``dynamo``: ``import torch._dynamo`` alone (first call = the import).

A separate untimed process checks that ``loop`` and ``hooks`` give vmap's gradients.

    .venv/bin/python -m benchmarks.bench_startup                  # 3 processes per variant
    .venv/bin/python -m benchmarks.bench_startup --repeats 1 --batches 10
    .venv/bin/python -m benchmarks.bench_startup --part cli --config runs/digits.yaml --override projector.proj_dim=2048

Prints tables and writes JSON (``--out``, default bench_results/startup.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import write_result  # noqa: E402  (atomic; adds date, commit, version, machine)

VARIANTS = ("dynamo", "vmap", "loop", "hooks", "kronecker")
BATCH = 128


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)).eval()


def _margin(logits, y):
    """Classification margin of ``[n, C]`` logits (vmap-safe), summed over the rows."""
    import torch

    correct = torch.arange(logits.shape[-1], device=logits.device) == y.unsqueeze(-1)
    right = (logits * correct).sum(-1)
    rest = torch.logsumexp(logits.masked_fill(correct, float("-inf")), dim=-1)
    return (right - rest).sum()


def _make(variant: str, model, proj_dim: int):
    """A function batch(x, y) -> result for the variant."""
    import torch

    if variant == "vmap":
        from torch.func import functional_call, grad, vmap

        params = {n: p.detach() for n, p in model.named_parameters()}

        def f(p, x, y):
            return _margin(functional_call(model, p, (x.unsqueeze(0),)), y.unsqueeze(0))

        g = vmap(grad(f), in_dims=(None, 0, 0))
        return lambda x, y: g(params, x, y)

    if variant == "loop":
        params = list(model.parameters())

        def loop(x, y):
            rows = []
            for i in range(x.shape[0]):
                out = _margin(model(x[i : i + 1]), y[i : i + 1])
                rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(out, params)]))
            return torch.stack(rows)

        return loop

    if variant == "hooks":
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]

        def hooks(x, y):
            acts, outs = [], []

            def keep(module, args, output):  # returns None: the output is unchanged
                acts.append(args[0])
                outs.append(output)

            handles = [m.register_forward_hook(keep) for m in linears]
            try:
                out = _margin(model(x), y)
            finally:
                for h in handles:
                    h.remove()
            gs = torch.autograd.grad(out, outs)
            rows = []
            for a, g in zip(acts, gs):
                rows.append(torch.einsum("ni,nj->nij", g, a).reshape(x.shape[0], -1))
                rows.append(g)
            return torch.cat(rows, dim=1)

        return hooks

    if variant == "kronecker":
        state: dict = {}

        def kron(x, y):
            if "f" not in state:
                from trakcli.gradients import KroneckerFeaturizer

                state["f"] = KroneckerFeaturizer(model, proj_dim=proj_dim, seed=0)
            return state["f"](x, y)

        return kron
    raise ValueError(variant)


def child(variant: str, batches: int, proj_dim: int) -> dict:
    t0 = time.perf_counter()
    import torch

    t_torch = time.perf_counter() - t0
    torch.set_num_threads(1)
    if variant == "dynamo":
        t = time.perf_counter()
        import torch._dynamo  # noqa: F401

        first = time.perf_counter() - t
        return {"variant": variant, "import_torch_s": t_torch, "first_call_s": first, "steady_s": 0.0,
                "dynamo_imported": True}
    model = _model()
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(BATCH, 64, generator=gen) for _ in range(batches + 1)]
    ys = [torch.randint(0, 10, (BATCH,), generator=gen) for _ in range(batches + 1)]
    fn = _make(variant, model, proj_dim)
    t = time.perf_counter()
    fn(xs[0], ys[0])
    first = time.perf_counter() - t
    times = []
    for x, y in zip(xs[1:], ys[1:]):
        t = time.perf_counter()
        fn(x, y)
        times.append(time.perf_counter() - t)
    return {"variant": variant, "import_torch_s": t_torch, "first_call_s": first,
            "steady_s": statistics.median(times), "dynamo_imported": "torch._dynamo" in sys.modules}


def check() -> dict:
    """Max abs difference of loop and hooks gradients from vmap's on one batch."""
    import torch

    model = _model()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 64, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)
    g = _make("vmap", model, 0)(x, y)
    ref = torch.cat([g[n].reshape(BATCH, -1) for n, _ in model.named_parameters()], dim=1)
    # hooks orders weight, bias per layer like named_parameters
    return {v: float((_make(v, model, 0)(x, y).detach() - ref).abs().max()) for v in ("loop", "hooks")}


def _cli_project(tmp: Path) -> tuple[Path, list[str]]:
    """A finished digits project in ``tmp``: 10 checkpoints (1 epoch each), train features at proj_dim 2048."""
    config, overrides = tmp / "digits.yaml", ["projector.proj_dim=2048"]
    for cmd in (["init", "digits", str(config)], ["optimize", str(config), "optimize.epochs=1", "-q"],
                ["featurize", str(config), *overrides, "-q"]):
        subprocess.run([sys.executable, "-m", "trakcli.cli.main", *cmd], cwd=tmp, check=True, capture_output=True)
    return config, overrides


def _store_of(config: Path, overrides: list[str]) -> str:
    """The store path of ``config`` with ``overrides``, as the CLI resolves it."""
    out = subprocess.run([sys.executable, "-m", "trakcli.cli.main", "featurize", str(config), *overrides,
                          "--print-config"], cwd=config.parent, check=True, capture_output=True, text=True)
    import yaml

    return str(yaml.safe_load(out.stdout)["store"]["path"])


def cli(args: argparse.Namespace) -> dict:
    """Wall and CPU seconds of the CLI commands in fresh processes (module docstring); prints the table."""
    tmp = Path(tempfile.mkdtemp(prefix="bench_startup_"))
    try:
        if args.config:
            config, overrides = Path(args.config).resolve(), list(args.override)
        else:
            config, overrides = _cli_project(tmp)
        store = _store_of(config, overrides)
        trak = [sys.executable, "-m", "trakcli.cli.main"]
        cases = {
            "import torch": [sys.executable, "-c", "import torch"],
            "import torch (gc paused)": [sys.executable, "-c", "import gc; gc.disable(); import torch"],
            "trak --help": [*trak, "--help"],
            "trak inspect STORE": [*trak, "inspect", store],
            "trak featurize (no-op)": [*trak, "featurize", str(config), *overrides],
        }
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if args.bytecode_cache:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
        for i in range(args.cli_repeats + bool(args.bytecode_cache)):  # + a warm-up writing the .pyc files
            for name, cmd in cases.items():
                r0, t = os.times(), time.perf_counter()
                res = subprocess.run(cmd, cwd=config.parent, env=env, capture_output=True, text=True)
                wall, r1 = time.perf_counter() - t, os.times()
                if res.returncode != 0:
                    raise SystemExit(f"{name} failed: {res.stderr.strip()}")
                if name == "trak featurize (no-op)" and "nothing to do" not in res.stderr:
                    raise SystemExit(f"the store of {config} is not finished: {res.stderr.strip()}")
                if i or not args.bytecode_cache:
                    cpu = (r1.children_user - r0.children_user) + (r1.children_system - r0.children_system)
                    runs[name].append((wall, cpu))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = {}
    for name, rs in runs.items():
        rows[name] = {"wall_median_s": statistics.median(w for w, _ in rs), "wall_min_s": min(w for w, _ in rs),
                      "cpu_median_s": statistics.median(c for _, c in rs), "runs": rs}
    for name, r in rows.items():  # paired with the import torch of the same round: less noise from the load
        r["beyond_torch_s"] = statistics.median(w - t for (w, _), (t, _) in zip(r["runs"], runs["import torch"]))
    load = os.getloadavg()[0]
    print(f"CLI start-up: {args.cli_repeats} fresh processes each, interleaved; bytecode cache "
          f"{'on' if args.bytecode_cache else 'as the environment has it'}; load {load:.2f}")
    print(f"{'command':26} {'wall median s':>14} {'wall min s':>11} {'cpu median s':>13} {'beyond import torch s':>22}")
    for name, r in rows.items():
        print(f"{name:26} {r['wall_median_s']:14.3f} {r['wall_min_s']:11.3f} {r['cpu_median_s']:13.3f} "
              f"{r['beyond_torch_s']:22.3f}")
    return {"repeats": args.cli_repeats, "bytecode_cache": args.bytecode_cache, "load_avg_1min": load,
            "config": str(config) if args.config else "built digits project", "overrides": overrides,
            "commands": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per variant")
    ap.add_argument("--batches", type=int, default=20, help="timed batches after the first")
    ap.add_argument("--proj-dim", type=int, default=1024, help="kronecker proj_dim")
    ap.add_argument("--out", default="bench_results/startup.json")
    ap.add_argument("--part", choices=("all", "cli", "gradients"), default="all", help="what to measure")
    ap.add_argument("--cli-repeats", type=int, default=7, help="fresh processes per CLI command")
    ap.add_argument("--config", help="CLI: a config whose store is featurized (default: build a digits project)")
    ap.add_argument("--override", action="append", default=[], help="CLI: a key=value override of --config")
    ap.add_argument("--bytecode-cache", action="store_true", help="CLI: children write and read .pyc files")
    ap.add_argument("--child", choices=VARIANTS + ("check",), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "check":
        print(json.dumps(check()))
        return
    if args.child:
        print(json.dumps(child(args.child, args.batches, args.proj_dim)))
        return

    def run(variant: str) -> dict:
        cmd = [sys.executable, __file__, "--child", variant, "--batches", str(args.batches),
               "--proj-dim", str(args.proj_dim)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return json.loads(out.stdout.strip().splitlines()[-1])

    result: dict = {"benchmark": "bench_startup"}
    if args.part in ("all", "cli"):
        result["cli"] = cli(args)
    if args.part in ("all", "gradients"):
        result.update(gradients(args, run))
    write_result(args.out, result)
    print(f"wrote {args.out}")


def gradients(args: argparse.Namespace, run) -> dict:
    """The per-example gradient variants (module docstring); prints the table."""
    diffs = run("check")
    runs = {v: [run(v) for _ in range(args.repeats)] for v in VARIANTS}
    rows = {}
    for v, rs in runs.items():
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        rows[v] = {"import_torch_s": med("import_torch_s"), "first_call_s": med("first_call_s"),
                   "steady_s": med("steady_s"), "startup_s": med("first_call_s") - med("steady_s"),
                   "dynamo_imported": all(r["dynamo_imported"] for r in rs), "runs": rs}
    load = os.getloadavg()[0]
    print(f"digits MLP 64-128-128-10, batch {BATCH}, 1 thread, median of {args.repeats} fresh processes, "
          f"load {load:.2f}")
    print(f"{'variant':10} {'import torch s':>15} {'first call s':>13} {'steady ms/batch':>16} {'start-up s':>11} dynamo")
    for v, r in rows.items():
        print(f"{v:10} {r['import_torch_s']:15.3f} {r['first_call_s']:13.3f} {1000 * r['steady_s']:16.2f} "
              f"{r['startup_s']:11.3f} {'yes' if r['dynamo_imported'] else 'no'}")
    print("max |grad - vmap grad|: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    return {"batch": BATCH, "repeats": args.repeats, "batches": args.batches, "proj_dim": args.proj_dim,
            "load_avg_1min": load, "check_max_abs_diff": diffs, "variants": rows}


if __name__ == "__main__":
    main()
