#!/usr/bin/env python
"""Per-example gradient start-up: torch.func.vmap against alternatives (issue 15, item 2).

Each variant runs in a fresh Python process (one thread, like ``configs/digits.yaml``)
on the digits MLP (64-128-128-10, ReLU, 26,122 parameters) at batch 128 and reports:

* ``import torch``: seconds to import torch in that process;
* ``first call``: wall seconds of the first batch, including any module the call
  imports (``torch.func.vmap`` imports ``torch._dynamo`` on its first call);
* ``steady``: median seconds per batch over the next ``--batches`` batches;
* ``start-up``: first call minus steady, what a fresh process pays once;
* whether ``torch._dynamo`` was imported by the end.

Variants:

* ``vmap``: ``torch.func.vmap(torch.func.grad(f))`` with ``functional_call``, the
  shape of ``trakcli.gradients.PerExampleGradients`` (margin output function);
* ``loop``: one ``torch.autograd.grad`` per example (ordinary autograd);
* ``hooks``: one batched forward + backward with hooks; each ``nn.Linear``'s
  per-example gradient is ``g_i a_iᵀ`` (and ``g_i`` for the bias): the same
  ``[n, grad_dim]`` gradients as vmap, for models made only of ``nn.Linear`` layers
  acting once per example;
* ``kronecker``: ``trakcli.factors.KroneckerFeaturizer`` (``--proj-dim``), which
  returns projected features, not gradients (its first call includes importing
  ``trakcli.factors``);
* ``dynamo``: ``import torch._dynamo`` alone (first call = the import).

A separate untimed process checks that ``loop`` and ``hooks`` give vmap's gradients.

    .venv/bin/python scripts/bench_startup.py                  # 3 processes per variant
    .venv/bin/python scripts/bench_startup.py --repeats 1 --batches 10

Prints a table and writes JSON (``--out``, default bench_results/startup.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

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
                from trakcli.factors import KroneckerFeaturizer

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per variant")
    ap.add_argument("--batches", type=int, default=20, help="timed batches after the first")
    ap.add_argument("--proj-dim", type=int, default=1024, help="kronecker proj_dim")
    ap.add_argument("--out", default="bench_results/startup.json")
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
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"batch": BATCH, "repeats": args.repeats, "batches": args.batches, "proj_dim": args.proj_dim,
                   "load_avg_1min": load, "check_max_abs_diff": diffs, "variants": rows}, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
