"""Benchmark the projected optimizer: finetune a digits MLP pretrained on digits 0-4 on all ten.

    .venv/bin/python scripts/bench_optimize.py [--epochs 20] [--seeds 3] [--lrs 1e-3,3e-3,1e-2,3e-2] [--out bench_results/optimize.json]

Model: MLP 64-256-256-10 (85,002 parameters), pretrained with AdamW on the
digits 0-4 of the training split, then finetuned on all ten digits with each
method below. The learning rate of each method is picked on a validation
split (the last 20% of the training split) with seed 0, then every seed runs
at that learning rate; test accuracy is on the 360 held-out target images.

Methods:
    adamw              full AdamW (the reference: state = 2 floats per parameter)
    per_matrix         ProjectedOptimizer(AdamW), rank 8, fixed projection
    per_matrix_resample  same, a new projection every 50 steps (on_refresh: transfer)
    global             ProjectedOptimizer(AdamW), global proj_dim 1000, sjlt, fixed
    global_resample    same, a new projection every 50 steps
    global_dense       global with a dense rademacher matrix (not run by default: the
                       [1000, 85002] matrix makes each step ~100x slower than sjlt on a CPU)
    subspace           trakcli.optim.subspace (W = W0 + Pᵀz, AdamW on z, proj_dim 1000, sjlt)
    galore             GaLoreAdamW from the `galore-torch` package, rank 8, update_proj_gap 50
                       (skipped if it is not installed; it needs only its adamw module:
                       `pip install --no-deps --target DIR galore-torch` and PYTHONPATH=DIR)

Columns: test accuracy (mean ± std over seeds), optimizer-state floats as a
share of AdamW's (moments, plus GaLore's stored projection matrices; the
ProjectedOptimizer's matrices are regenerated from seeds and cached, the
cache is not counted), and the time of one training step (forward, backward
and ``opt.step()``, median over steps) relative to AdamW's, plus ``opt.step()``
alone. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trakcli.data import load_digits_split  # noqa: E402
from trakcli.optim import ProjectedOptimizer, subspace  # noqa: E402


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def load_galore():
    """GaLoreAdamW from galore-torch, importing only its adamw module (no bitsandbytes)."""
    spec = importlib.util.find_spec("galore_torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    if importlib.util.find_spec("transformers") is None:  # adamw.py only calls require_version
        versions = types.ModuleType("transformers.utils.versions")
        versions.require_version = lambda *a, **k: None  # type: ignore[attr-defined]
        for name, mod in (("transformers", types.ModuleType("transformers")),
                          ("transformers.utils", types.ModuleType("transformers.utils")),
                          ("transformers.utils.versions", versions)):
            sys.modules.setdefault(name, mod)
    pkg = types.ModuleType("galore_torch")
    pkg.__path__ = list(spec.submodule_search_locations)  # skip __init__ (imports bitsandbytes)
    sys.modules["galore_torch"] = pkg
    return importlib.import_module("galore_torch.adamw").AdamW


def data():
    x_tr, y_tr, x_te, y_te = load_digits_split()
    n_val = len(y_tr) // 5
    return (x_tr[:-n_val], y_tr[:-n_val]), (x_tr[-n_val:], y_tr[-n_val:]), (x_te, y_te)


def train(model, opt, x, y, epochs, batch_size, seed, times=None):
    """Minibatch training; ``times`` collects (whole step, opt.step) seconds per step."""
    gen = torch.Generator().manual_seed(seed)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=gen)
        for lo in range(0, len(y), batch_size):
            idx = order[lo : lo + batch_size]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x[idx]), y[idx]).backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            if times is not None:
                times.append((t2 - t0, t2 - t1))
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
    train(model, opt, x[keep], y[keep], epochs=20, batch_size=64, seed=1234)
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


def build(method: str, model: nn.Module, lr: float, galore_cls):
    """(optimizer, parameters to train) for one method."""
    wd = 0.0
    if method == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    if method.startswith("per_matrix"):
        gap = 50 if method.endswith("resample") else 0
        proj = {"mode": "per_matrix", "rank": 8, "update_gap": gap, "on_refresh": "transfer"}
        return ProjectedOptimizer(model.parameters(), torch.optim.AdamW, proj, lr=lr, weight_decay=wd)
    if method.startswith("global"):
        gap = 50 if method.endswith("resample") else 0
        kind = "rademacher" if method == "global_dense" else "sjlt"
        proj = {"mode": "global", "kind": kind, "proj_dim": 1000, "update_gap": gap, "on_refresh": "transfer"}
        return ProjectedOptimizer(model.parameters(), torch.optim.AdamW, proj, lr=lr, weight_decay=wd)
    if method == "subspace":
        sub = subspace.attach(model, {"mode": "global", "kind": "sjlt", "proj_dim": 1000})
        opt = torch.optim.AdamW(sub.parameters(), lr=lr, weight_decay=wd)
        opt._trak_subspace = sub  # keep it alive
        return opt
    if method == "galore":
        mats = [p for p in model.parameters() if p.dim() == 2]
        rest = [p for p in model.parameters() if p.dim() != 2]
        groups = [{"params": rest}, {"params": mats, "rank": 8, "update_proj_gap": 50, "scale": 1.0, "proj_type": "std"}]
        return galore_cls(groups, lr=lr, weight_decay=wd)
    raise ValueError(method)


def run(method, lr, seed, init, split, epochs, galore_cls, eval_split):
    torch.manual_seed(seed)
    model = make_mlp()
    model.load_state_dict(init)
    opt = build(method, model, lr, galore_cls)
    times: list[tuple[float, float]] = []
    x, y = split
    train(model, opt, x, y, epochs, 64, seed, times)
    step = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
    return accuracy(model, *eval_split), state_floats(opt), step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2")
    ap.add_argument("--methods", default="adamw,per_matrix,per_matrix_resample,global,global_resample,subspace,galore")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench_results/optimize.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lrs = [float(v) for v in args.lrs.split(",")]
    galore_cls = load_galore()
    methods = [m for m in args.methods.split(",") if m != "galore" or galore_cls is not None]
    if "galore" in args.methods and galore_cls is None:
        print("galore-torch not installed: skipping the galore row", file=sys.stderr)
    train_split, val_split, test_split = data()
    init = pretrained(train_split)
    n_params = sum(v.numel() for v in init.values())
    base = make_mlp()
    base.load_state_dict(init)
    results = {"n_params": n_params, "pretrained_test_accuracy": accuracy(base, *test_split),
               "epochs": args.epochs, "lrs": lrs, "threads": args.threads, "methods": {}}
    for method in methods:
        val = {lr: run(method, lr, 0, init, train_split, args.epochs, galore_cls, val_split)[0] for lr in lrs}
        best = max(lrs, key=lambda lr: val[lr])
        runs = [run(method, best, s, init, train_split, args.epochs, galore_cls, test_split) for s in range(args.seeds)]
        accs = [r[0] for r in runs]
        results["methods"][method] = {
            "val_accuracy_by_lr": {str(k): v for k, v in val.items()}, "lr": best,
            "test_accuracy": accs, "state_floats": runs[0][1],
            "step_seconds": statistics.median(r[2][0] for r in runs),
            "opt_step_seconds": statistics.median(r[2][1] for r in runs),
        }
        print(f"{method}: lr {best:g}, test {statistics.mean(accs):.4f}", file=sys.stderr)
    ref = results["methods"].get("adamw")
    print(f"{'method':20} {'lr':>6} {'test acc (%)':>14} {'state floats':>12} {'% AdamW':>8} "
          f"{'step ms':>8} {'x AdamW':>7} {'opt.step ms':>11}")
    for method, r in results["methods"].items():
        accs = [100 * a for a in r["test_accuracy"]]
        sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
        share = 100 * r["state_floats"] / (2 * n_params)
        rel = r["step_seconds"] / ref["step_seconds"] if ref else float("nan")
        r["state_share_of_adamw"] = share / 100
        r["step_time_vs_adamw"] = rel
        print(f"{method:20} {r['lr']:6.0e} {statistics.mean(accs):8.2f} ± {sd:4.2f} {r['state_floats']:12d} "
              f"{share:7.2f}% {1000 * r['step_seconds']:8.3f} {rel:7.2f} {1000 * r['opt_step_seconds']:11.3f}")
    print(f"pretrained on digits 0-4: test accuracy {100 * results['pretrained_test_accuracy']:.2f}% on all ten")
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
