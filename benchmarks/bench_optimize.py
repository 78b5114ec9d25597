"""Benchmark the projected optimizer: finetune a digits MLP pretrained on digits 0-4 on all ten.

    .venv/bin/python -m benchmarks.bench_optimize [--out bench_results/optimize.json]
        [--epochs 20] [--seeds 3] [--lrs 3e-4,1e-3,3e-3,1e-2,3e-2,1e-1]
        [--rounds 30] [--block 50] [--methods adamw,per_matrix,...] [--no-fused]

Model: MLP 64-256-256-10 (85,002 parameters), pretrained with AdamW on the
digits 0-4 of the training split, then finetuned on all ten digits with each
method below (weight decay 0 for every method, batch 64).

Methods:
    adamw                full AdamW (the reference: state = 2 floats per parameter)
    per_matrix           ProjectedOptimizer(AdamW), rank 8, one fixed projection
    per_matrix_resample  same, a new projection every 50 steps (on_refresh: transfer)
    kronecker_resample   ProjectedOptimizer(AdamW), per_matrix kind kronecker: each weight's gradient
                         projected from both sides, P_out G P_inᵀ of [8, 8] (rank 8 per side), a new
                         projection every 50 steps (on_refresh: transfer)
    global               ProjectedOptimizer(AdamW), global proj_dim 1000, sjlt, fixed
    global_resample      same, a new projection every 50 steps
    global_dense         global with a dense rademacher matrix (not run by default: the
                         [1000, 85002] matrix makes each step ~100x slower than sjlt on a CPU)
    subspace             trakcli.optim.subspace (W = W0 + Pᵀz, AdamW on z, proj_dim 1000, sjlt)
    galore               GaLoreAdamW of the `galore-torch` package (the baseline), rank 8,
                         update_proj_gap 50, SVD projections

GaLore is a benchmark baseline only, never a trakcli dependency. Install it
into the benchmark environment with ``.venv-bench/bin/pip install --no-deps
galore-torch``; this script finds it on ``sys.path`` or in
``.venv-bench``'s site-packages and imports only its ``adamw`` module (its
``__init__`` needs bitsandbytes). Without it the galore row is skipped.

Accuracy: the learning rate of each method is picked on a validation split
(the last 20% of the training split) with seed 0, from ``--lrs``; then each
seed (batch order and projection seed) trains at that rate on the rest of the
training split, and the test accuracy is on the 360 held-out target images.

State: optimizer-state floats (moments; plus GaLore's stored projection
matrices) as a share of AdamW's 2 floats per parameter. The ProjectedOptimizer
regenerates its matrices from seeds: the cached current matrix (rank x the
smaller side per weight) is not state and not counted.

Step time, measured robustly on a shared machine: every method trains its own
copy of the model at its chosen learning rate, all on the same fixed batches
and one intra-op thread, *interleaved*: each round runs a block of ``--block``
steps of every method in turn (the order rotates between rounds). A block of
50 steps holds exactly one refresh of the resampled methods (and of GaLore's
SVD), so its mean step time includes the refresh cost amortized as in
training. Per round, each method's mean step time is divided by AdamW's of
the same round; the table shows the median of these ratios over rounds and
their interquartile range ``[q1-q3]`` (the JSON also has min and max), for
the whole training step (zero_grad, forward, backward, ``opt.step()``) and
for ``opt.step()`` alone. Load on other cores
slows every method of a round alike, so the ratios stay put while absolute
times move. Denormal floats are flushed to zero while timing (the timing
models overfit their fixed batches, and denormal arithmetic would slow the
methods with the most state entries most). With ``fused`` (the default), a second table compares AdamW
``fused=True`` (torch's one-kernel CPU AdamW) with the projected methods
whose inner AdamW is fused too.

Prints the tables and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import write_result  # noqa: E402  (atomic; adds date, commit, version, machine)
from trakcli.data.digits import load_digits_split  # noqa: E402
from trakcli.optim import ProjectedOptimizer, subspace  # noqa: E402

BATCH = 64
GAP = 50
DEFAULT_METHODS = "adamw,per_matrix,per_matrix_resample,kronecker_resample,global,global_resample,subspace,galore"


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def find_galore_dir() -> Path | None:
    """The ``galore_torch`` package directory: importable here, or in the repo's ``.venv-bench``."""
    spec = importlib.util.find_spec("galore_torch")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    hits = sorted(glob.glob(str(ROOT / ".venv-bench" / "lib" / "python*" / "site-packages" / "galore_torch")))
    return Path(hits[-1]) if hits else None


def load_galore():
    """GaLoreAdamW from galore-torch, importing only its adamw module (no bitsandbytes), or None."""
    where = find_galore_dir()
    if where is None:
        return None
    if importlib.util.find_spec("transformers") is None:  # adamw.py only calls require_version
        versions = types.ModuleType("transformers.utils.versions")
        versions.require_version = lambda *a, **k: None  # type: ignore[attr-defined]
        for name, mod in (("transformers", types.ModuleType("transformers")),
                          ("transformers.utils", types.ModuleType("transformers.utils")),
                          ("transformers.utils.versions", versions)):
            sys.modules.setdefault(name, mod)
    pkg = types.ModuleType("galore_torch")
    pkg.__path__ = [str(where)]  # skip __init__ (it imports bitsandbytes)
    sys.modules["galore_torch"] = pkg
    return importlib.import_module("galore_torch.adamw").AdamW


def data():
    x_tr, y_tr, x_te, y_te = load_digits_split()
    n_val = len(y_tr) // 5
    return (x_tr[:-n_val], y_tr[:-n_val]), (x_tr[-n_val:], y_tr[-n_val:]), (x_te, y_te)


def train(model, opt, x, y, epochs, seed):
    gen = torch.Generator().manual_seed(seed)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=gen)
        for lo in range(0, len(y), BATCH):
            idx = order[lo : lo + BATCH]
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval()


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def pretrained(train_split) -> dict:
    x, y = train_split
    keep = y < 5
    torch.manual_seed(1234)
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, x[keep], y[keep], epochs=20, seed=1234)
    return {k: v.clone() for k, v in model.state_dict().items()}


def state_floats(opt) -> int:
    if isinstance(opt, ProjectedOptimizer):
        return opt.state_numel()
    total = 0
    for st in opt.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and k != "step":
                total += v.numel()
            elif k == "projector" and getattr(v, "ortho_matrix", None) is not None:
                total += v.ortho_matrix.numel()  # GaLore stores its projection matrix
    return total


def build(method: str, model: nn.Module, lr: float, seed: int, galore_cls, fused: bool = False):
    """The optimizer of one method (``fused``: AdamW, inner or not, with ``fused=True``)."""
    wd = 0.0
    extra = {"fused": True} if fused else {}
    gap = GAP if method.endswith("resample") else 0
    if method == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, **extra)
    if method.startswith(("per_matrix", "kronecker")):
        kind = "kronecker" if method.startswith("kronecker") else "rademacher"
        proj = {"mode": "per_matrix", "kind": kind, "rank": 8, "update_gap": gap, "on_refresh": "transfer",
                "seed": seed}
        return ProjectedOptimizer(model.parameters(), torch.optim.AdamW, proj, lr=lr, weight_decay=wd, **extra)
    if method.startswith("global"):
        kind = "rademacher" if method == "global_dense" else "sjlt"
        proj = {"mode": "global", "kind": kind, "proj_dim": 1000, "update_gap": gap, "on_refresh": "transfer",
                "seed": seed}
        return ProjectedOptimizer(model.parameters(), torch.optim.AdamW, proj, lr=lr, weight_decay=wd, **extra)
    if method == "subspace":
        sub = subspace.attach(model, {"mode": "global", "kind": "sjlt", "proj_dim": 1000, "seed": seed})
        opt = torch.optim.AdamW(sub.parameters(), lr=lr, weight_decay=wd, **extra)
        opt._trak_subspace = sub  # keep it alive
        return opt
    if method == "galore":
        mats = [p for p in model.parameters() if p.dim() == 2]
        rest = [p for p in model.parameters() if p.dim() != 2]
        groups = [{"params": rest},
                  {"params": mats, "rank": 8, "update_proj_gap": GAP, "scale": 1.0, "proj_type": "std"}]
        return galore_cls(groups, lr=lr, weight_decay=wd, no_deprecation_warning=True)
    raise ValueError(f"unknown method {method!r}")


def fresh(init: dict) -> nn.Module:
    model = make_mlp()
    model.load_state_dict(init)
    return model


def run(method, lr, seed, init, split, epochs, galore_cls, eval_split):
    """(accuracy on eval_split, state floats) of one finetuning run."""
    torch.manual_seed(seed)
    model = fresh(init)
    opt = build(method, model, lr, seed, galore_cls)
    train(model, opt, *split, epochs, seed)
    return accuracy(model, *eval_split), state_floats(opt)


# ---------------------------------------------------------------------------- timing


class Runner:
    """One method's model and optimizer, stepping through the shared batches."""

    def __init__(self, method: str, lr: float, init: dict, galore_cls, fused: bool):
        torch.manual_seed(0)
        self.model = fresh(init).train()
        self.opt = build(method, self.model, lr, 0, galore_cls, fused)
        self.loss_fn = nn.CrossEntropyLoss()
        self.i = 0

    def block(self, batches, n: int) -> tuple[float, float]:
        """Run ``n`` steps; returns the mean seconds of (a whole step, ``opt.step()``)."""
        whole = inner = 0.0
        clock = time.perf_counter
        for _ in range(n):
            x, y = batches[self.i % len(batches)]
            self.i += 1
            t0 = clock()
            self.opt.zero_grad(set_to_none=True)
            self.loss_fn(self.model(x), y).backward()
            t1 = clock()
            self.opt.step()
            t2 = clock()
            whole += t2 - t0
            inner += t2 - t1
        return whole / n, inner / n


def interleaved(runners: dict[str, Runner], ref: str, batches, rounds: int, block: int) -> dict:
    """Round-robin timing: per round a block of every method in turn (rotating the order); ratios to ``ref``."""
    names = list(runners)
    for name in names:  # warm-up: first state allocations, caches, the first refresh
        runners[name].block(batches, block)
    per_round: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            per_round[name].append(runners[name].block(batches, block))
    out = {}
    for name in names:
        row: dict = {
            "step_ms": 1e3 * statistics.median(t[0] for t in per_round[name]),
            "opt_step_ms": 1e3 * statistics.median(t[1] for t in per_round[name]),
            "rounds_ms": [[1e3 * a, 1e3 * b] for a, b in per_round[name]],
        }
        for key, j in (("step_ratio", 0), ("opt_step_ratio", 1)):
            ratios = [a[j] / b[j] for a, b in zip(per_round[name], per_round[ref])]
            q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
            row.update({key: statistics.median(ratios), f"{key}_q1": q1, f"{key}_q3": q3,
                        f"{key}_min": min(ratios), f"{key}_max": max(ratios)})
        out[name] = row
    return out


def ratio_cell(t: dict, key: str) -> str:
    """``median [q1-q3]`` of a per-round ratio."""
    return f"{t[key]:5.2f} [{t[key + '_q1']:4.2f}-{t[key + '_q3']:4.2f}]"


def timing_batches(split, n: int = 40, seed: int = 99):
    x, y = split
    gen = torch.Generator().manual_seed(seed)
    return [(x[idx], y[idx]) for idx in (torch.randperm(len(y), generator=gen)[:BATCH] for _ in range(n))]


# ---------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--lrs", default="3e-4,1e-3,3e-3,1e-2,3e-2,1e-1")
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--rounds", type=int, default=30, help="interleaved timing rounds")
    ap.add_argument("--block", type=int, default=GAP, help="steps per method per round (a multiple of 50 "
                    "amortizes refreshes exactly)")
    ap.add_argument("--no-fused", dest="fused", action="store_false", help="skip the fused-AdamW timing table")
    ap.add_argument("--skip-accuracy", action="store_true", help="timing only (every method at lr 1e-3)")
    ap.add_argument("--out", default="bench_results/optimize.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lrs = [float(v) for v in args.lrs.split(",")]
    galore_cls = load_galore()
    methods = args.methods.split(",")
    if "galore" in methods and galore_cls is None:
        print("galore-torch not found (.venv-bench/bin/pip install --no-deps galore-torch): skipping galore",
              file=sys.stderr)
        methods.remove("galore")
    if "adamw" not in methods:
        methods.insert(0, "adamw")  # the reference of every ratio
    train_split, val_split, test_split = data()
    init = pretrained(train_split)
    n_params = sum(v.numel() for v in init.values())
    results = {
        "benchmark": "bench_optimize", "n_params": n_params, "pretrained_test_accuracy": accuracy(fresh(init), *test_split),
        "epochs": args.epochs, "batch_size": BATCH, "lrs": lrs, "seeds": args.seeds, "threads": 1,
        "timing": {"rounds": args.rounds, "block": args.block, "loadavg_start": os.getloadavg()},
        "methods": {},
    }

    # accuracy: lr on validation (seed 0), then every seed at that lr on test
    for method in methods:
        if args.skip_accuracy:
            results["methods"][method] = {"lr": 1e-3, "test_accuracy": [], "state_floats": 0}
            continue
        t0 = time.perf_counter()
        val = {lr: run(method, lr, 0, init, train_split, args.epochs, galore_cls, val_split)[0] for lr in lrs}
        best = max(lrs, key=lambda lr: val[lr])
        runs = [run(method, best, s, init, train_split, args.epochs, galore_cls, test_split)
                for s in range(args.seeds)]
        results["methods"][method] = {
            "val_accuracy_by_lr": {str(k): v for k, v in val.items()}, "lr": best,
            "lr_at_grid_edge": best in (lrs[0], lrs[-1]),
            "test_accuracy": [r[0] for r in runs], "state_floats": runs[0][1],
            "state_share_of_adamw": runs[0][1] / (2 * n_params),
        }
        print(f"{method}: lr {best:g}, test {100 * statistics.mean(r[0] for r in runs):.2f}% "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)

    # step time: interleaved rounds on identical batches
    batches = timing_batches(train_split)
    # the timing models overfit 40 fixed batches: tiny gradients and second moments would turn
    # denormal and slow every elementwise op (AdamW's most: it has the most entries); flush them
    torch.set_flush_denormal(True)
    print(f"timing {len(methods)} methods x {args.rounds} rounds x {args.block} steps ...", file=sys.stderr)
    runners = {m: Runner(m, results["methods"][m]["lr"], init, galore_cls, False) for m in methods}
    timing = interleaved(runners, "adamw", batches, args.rounds, args.block)
    for m, t in timing.items():
        results["methods"][m]["timing"] = t
    fused_methods = [m for m in methods if m in ("adamw", "per_matrix", "per_matrix_resample", "kronecker_resample")]
    if args.fused:
        runners = {m: Runner(m, results["methods"][m]["lr"], init, galore_cls, True) for m in fused_methods}
        results["fused_timing"] = interleaved(runners, "adamw", batches, args.rounds, args.block)
    results["timing"]["loadavg_end"] = os.getloadavg()

    ref_acc = results["methods"]["adamw"]["test_accuracy"]
    print(f"\nfinetune MLP 64-256-256-10 ({n_params} parameters) on digits, {args.seeds} seeds, "
          f"{args.epochs} epochs; timing: 1 thread, {args.rounds} interleaved rounds of {args.block} steps")
    head = (f"{'method':20} {'lr':>6} {'test acc (%)':>14} {'vs AdamW':>8} {'state':>7} "
            f"{'step x AdamW':>18} {'opt.step x AdamW':>18} {'step ms':>7} {'opt ms':>6}")
    print(head)
    print("-" * len(head))
    for method, r in results["methods"].items():
        t = r["timing"]
        if r["test_accuracy"]:
            accs = [100 * a for a in r["test_accuracy"]]
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            delta = statistics.mean(accs) - 100 * statistics.mean(ref_acc)
            acc = f"{statistics.mean(accs):7.2f} ± {sd:4.2f} {delta:+8.2f} {100 * r['state_share_of_adamw']:6.2f}%"
        else:
            acc = f"{'-':>14} {'-':>8} {'-':>7}"
        edge = "*" if r.get("lr_at_grid_edge") else " "
        print(f"{method:20} {r['lr']:6.0e}{edge}{acc} {ratio_cell(t, 'step_ratio')} "
              f"{ratio_cell(t, 'opt_step_ratio')} {t['step_ms']:7.3f} {t['opt_step_ms']:6.3f}")
    if any(r.get("lr_at_grid_edge") for r in results["methods"].values()):
        print("* lr at the edge of the grid")
    if args.fused and "fused_timing" in results:
        print("\nwith fused=True AdamW (the reference and the inner optimizer):")
        for method, t in results["fused_timing"].items():
            print(f"{method:20} step x {ratio_cell(t, 'step_ratio')}  opt.step x {ratio_cell(t, 'opt_step_ratio')}"
                  f"  {t['step_ms']:.3f} / {t['opt_step_ms']:.3f} ms")
    print(f"pretrained on digits 0-4: test accuracy {100 * results['pretrained_test_accuracy']:.2f}% on all ten; "
          f"load average {results['timing']['loadavg_start'][0]:.2f} -> {results['timing']['loadavg_end'][0]:.2f}")
    out = Path(args.out)
    write_result(out, results)
    print(f"-> {out}")


if __name__ == "__main__":
    main()
