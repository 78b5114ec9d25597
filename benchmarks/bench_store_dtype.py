#!/usr/bin/env python
"""Top-k attribution with half-precision train features: float16 and bfloat16 against float32.

What it measures: how much of the top-100 proponents and opponents of a target
`trak score` finds with ``store.dtype: float16`` or ``bfloat16`` are the ones
float32 features give, on real projected gradients at corpus scale.

Features (float32, ``[n_train, proj_dim]``, default 100,000 × 1024): per-example
gradients (``trakcli.gradients.vmap.PerExampleGradients``, torch.func.vmap) of the
margin of the digits MLP of ``configs/digits.yaml`` (64-128-128-10, 26,122
parameters, trained here with that config's recipe: 30 epochs SGD, lr 0.05,
momentum 0.9, weight decay 5e-4, batch 64), projected with the config's
projector (``sjlt``, seed 0). scikit-learn's digits have 1,437 train rows, so
the train set is 100,000 augmented copies of them: each a random train image
shifted by up to one pixel in x and y, its intensity scaled by U(0.8, 1.2),
plus N(0, 0.05²) pixel noise, clipped to [0, 1]. The targets are 1,000
augmentations of the 360 held-out rows (another seed).

Half precision: the float32 features rounded as the store rounds them when it
writes them: ``numpy.ndarray.astype(float16)`` (a float16 zarr array) and
:func:`trakcli.store.bfloat16.round_to_bfloat16` (what a bfloat16 store's
:meth:`~trakcli.store.rows.ChunkedRows.write` stores and its reads return).

Scores: as ``trak score`` computes them for one checkpoint (``trakcli.scoring``):
Gram ΦᵀΦ in float64 from the (rounded) train features, λ = trace(ΦᵀΦ)/n_train
(``lambda_rel: 1``), Cholesky factor, weights φ(t)ᵀA solved in float64 and cast
to float32, scores ``(W Φᵀ) · Q`` in float32 (Q, the out-to-loss term, is stored
in float32 whatever ``store.dtype``). Each half-precision variant is scored twice:
with float32 target features (``train``: only the train features rounded), and
with the target features rounded too (``train+targets``: what `trak score` does,
since a store keeps its target features in ``store.dtype`` as well).

Metrics, per target against the float32 scores, then averaged over the targets:
recall@k of the top-k proponents (|top-k ∩ top-k of float32| / k), the same for
the bottom-k (opponents), Spearman correlation over all n_train scores, and
relative error ‖s − s₃₂‖ / ‖s₃₂‖. The row ``float32, proj seed 1`` puts them in
scale: the same gradients projected with another JL matrix (what a different
``projector.seed`` changes), i.e. the noise TRAK's projection itself carries.

    python -m benchmarks.bench_store_dtype              # 100,000 × 1024, 1,000 targets (~2 min on 2 cores)
    python -m benchmarks.bench_store_dtype --quick      # 10,000 × 256, 200 targets

Prints a table and writes JSON (``--out``, default bench_results/store_dtype.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from trakcli.data.digits import load_digits_split
from trakcli.gradients.vmap import PerExampleGradients
from trakcli.models.build import make_mlp
from trakcli.projectors import make_projector
from trakcli.scoring import gram_matrix, solve_kernel, target_weights
from trakcli.store.bfloat16 import round_to_bfloat16

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import write_result  # noqa: E402  (atomic; adds date, commit, version, machine)

MLP = {"in_dim": 64, "hidden_dim": 128, "num_classes": 10, "depth": 2}  # configs/digits.yaml
RECIPE = {"epochs": 30, "batch_size": 64, "lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, "seed": 0}
SCORE_BLOCK = 200  # targets per block of the [n_target, n_train] scores


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def train_mlp(x: torch.Tensor, y: torch.Tensor) -> torch.nn.Module:
    """The digits MLP trained with configs/digits.yaml's recipe (plain SGD with momentum)."""
    torch.manual_seed(RECIPE["seed"])
    model = make_mlp(**MLP)
    opt = torch.optim.SGD(model.parameters(), lr=RECIPE["lr"], momentum=RECIPE["momentum"],
                          weight_decay=RECIPE["weight_decay"])
    g = torch.Generator().manual_seed(RECIPE["seed"])
    for _ in range(RECIPE["epochs"]):
        for idx in torch.randperm(len(x), generator=g).split(RECIPE["batch_size"]):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval()


def augment(x: torch.Tensor, y: torch.Tensor, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` augmented digits ``[n, 64]`` float32 in [0, 1] and their labels ``[n]``.

    Each row: a random row of ``x`` shifted by -1, 0 or 1 pixels in x and y (zeros
    shifted in), intensity times U(0.8, 1.2), plus N(0, 0.05²) noise, clipped to [0, 1].
    """
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, len(x), (n,), generator=g)
    img = torch.nn.functional.pad(x[src].reshape(n, 1, 8, 8), (1, 1, 1, 1))  # [n, 1, 10, 10]
    dx, dy = torch.randint(0, 3, (n,), generator=g), torch.randint(0, 3, (n,), generator=g)
    rows = (dy[:, None] + torch.arange(8)[None, :])[:, :, None]  # [n, 8, 1]
    cols = (dx[:, None] + torch.arange(8)[None, :])[:, None, :]  # [n, 1, 8]
    out = img[torch.arange(n)[:, None, None], 0, rows, cols].reshape(n, 64)
    out = out * (0.8 + 0.4 * torch.rand(n, 1, generator=g)) + 0.05 * torch.randn(n, 64, generator=g)
    return out.clamp(0.0, 1.0), y[src]


def features(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, proj_dim: int, seeds: list[int], batch: int = 2000
) -> tuple[list[np.ndarray], np.ndarray]:
    """Projected per-example gradients ``[n, proj_dim]`` float32, one array per projector seed, and Q ``[n]``."""
    pg = PerExampleGradients(model)
    projs = [make_projector("sjlt", grad_dim=pg.grad_dim, proj_dim=proj_dim, seed=s) for s in seeds]
    out = [np.empty((len(x), proj_dim), dtype=np.float32) for _ in seeds]
    q_all = np.empty(len(x), dtype=np.float32)
    for lo in range(0, len(x), batch):
        grads, q = pg(x[lo : lo + batch], y[lo : lo + batch])
        flat = pg.flatten(grads)  # [b, grad_dim]
        for o, p in zip(out, projs):
            o[lo : lo + batch] = p.project(flat).numpy()
        q_all[lo : lo + batch] = q.numpy()
    return out, q_all


def kernel(phi: np.ndarray) -> torch.Tensor:
    """The float64 Cholesky factor of ΦᵀΦ + λI, λ = trace(ΦᵀΦ)/n_train, as `trak score` makes it."""
    train = torch.from_numpy(phi)
    gram = gram_matrix(train[lo : lo + 8192] for lo in range(0, len(train), 8192))  # float64
    return solve_kernel(gram, len(train), None, 1.0)[0]


def scores(factor: torch.Tensor, phi: np.ndarray, phi_t: np.ndarray, q: np.ndarray) -> np.ndarray:
    """TRAK scores ``[n_target, n_train]`` float32 of one checkpoint, as `trak score` computes them."""
    w = target_weights(factor, torch.from_numpy(phi_t), dtype=torch.float32)  # [n_target, proj_dim]
    return (w @ torch.from_numpy(phi).T * torch.from_numpy(q)[None, :]).numpy()


def centred_ranks(s: torch.Tensor) -> torch.Tensor:
    """Per row, the rank of each entry (0 = smallest) minus the mean rank, float32 (exact below 2^24 columns)."""
    r = torch.empty_like(s, dtype=torch.float32)
    r.scatter_(1, s.argsort(dim=1), torch.arange(s.shape[1], dtype=torch.float32).expand(s.shape[0], -1))
    return r.sub_((s.shape[1] - 1) / 2)


class Reference:
    """The float32 scores ``[n_target, n_train]`` and, per block of targets, their top-k, bottom-k and ranks."""

    def __init__(self, ref: np.ndarray, k: int):
        self.scores, self.k, self.blocks = ref, k, []
        for lo in range(0, len(ref), SCORE_BLOCK):
            a = torch.from_numpy(ref[lo : lo + SCORE_BLOCK])
            top, bot = (a.topk(k, dim=1, largest=largest).indices for largest in (True, False))
            self.blocks.append((lo, a, top, bot, centred_ranks(a)))


def compare(ref: Reference, other: np.ndarray) -> dict[str, float]:
    """Per-target agreement of ``other`` ``[n_target, n_train]`` with the float32 scores, averaged over targets."""
    k = ref.k
    rec_top, rec_bot, rho, rel = [], [], [], []
    for lo, a, top, bot, ra in ref.blocks:
        b = torch.from_numpy(other[lo : lo + SCORE_BLOCK])
        for largest, ia, out in ((True, top, rec_top), (False, bot, rec_bot)):
            ib = b.topk(k, dim=1, largest=largest).indices
            hit = (ia[:, :, None] == ib[:, None, :]).any(dim=2).sum(dim=1)  # [block]
            out.append(hit.double() / k)
        rb = centred_ranks(b)
        rho.append((ra.double() * rb.double()).sum(1) / (ra.double().norm(dim=1) * rb.double().norm(dim=1)))
        rel.append((a - b).double().norm(dim=1) / a.double().norm(dim=1))
    rec_top, rec_bot, rho, rel = (torch.cat(v) for v in (rec_top, rec_bot, rho, rel))
    return {
        f"recall@{k}_proponents": float(rec_top.mean()),
        f"recall@{k}_proponents_min": float(rec_top.min()),
        f"recall@{k}_opponents": float(rec_bot.mean()),
        f"recall@{k}_opponents_min": float(rec_bot.min()),
        "spearman": float(rho.mean()),
        "spearman_min": float(rho.min()),
        "rel_error": float(rel.mean()),
        "rel_error_max": float(rel.max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-train", type=int, default=100_000)
    ap.add_argument("--proj-dim", type=int, default=1024)
    ap.add_argument("--n-target", type=int, default=1000)
    ap.add_argument("--k", type=int, default=100, help="top-k (and bottom-k) compared")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="10,000 × 256, 200 targets (a smoke run)")
    ap.add_argument("--out", type=Path, default=REPO / "bench_results" / "store_dtype.json")
    args = ap.parse_args()
    if args.quick:
        args.n_train, args.proj_dim, args.n_target = 10_000, 256, 200
    t0 = time.perf_counter()
    timings = {}

    x_tr, y_tr, x_ta, y_ta = load_digits_split()
    torch.set_num_threads(1)  # the tiny MLP trains faster on one thread than on two
    model = train_mlp(x_tr, y_tr)
    torch.set_num_threads(args.threads)
    acc = float((model(x_ta).argmax(1) == y_ta).float().mean())
    timings["train_s"] = time.perf_counter() - t0
    log(f"MLP trained in {timings['train_s']:.1f} s, held-out accuracy {acc:.3f}")

    xt, yt = augment(x_tr, y_tr, args.n_train, seed=1)
    xq, yq = augment(x_ta, y_ta, args.n_target, seed=2)
    t = time.perf_counter()
    (phi32, phi_seed1), q = features(model, xt, yt, args.proj_dim, seeds=[0, 1])
    (tgt32, tgt_seed1), _ = features(model, xq, yq, args.proj_dim, seeds=[0, 1])
    timings["features_s"] = time.perf_counter() - t
    log(f"features [{args.n_train}, {args.proj_dim}] in {timings['features_s']:.1f} s")

    t = time.perf_counter()
    ref = Reference(scores(kernel(phi32), phi32, tgt32, q), args.k)
    rounders = {"float16": lambda a: a.astype(np.float16).astype(np.float32), "bfloat16": round_to_bfloat16}
    rows = {}
    for dtype, rnd in rounders.items():
        phi = rnd(phi32)
        factor = kernel(phi)
        rows[f"{dtype}, train"] = compare(ref, scores(factor, phi, tgt32, q))
        rows[f"{dtype}, train+targets"] = compare(ref, scores(factor, phi, rnd(tgt32), q))
        log(f"{dtype} compared")
    del phi, factor
    rows["float32, proj seed 1"] = compare(ref, scores(kernel(phi_seed1), phi_seed1, tgt_seed1, q))
    timings["scores_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t0

    k = args.k
    cols = [f"recall@{k}_proponents", f"recall@{k}_opponents", "spearman", "rel_error"]
    head = ["features", f"recall@{k} prop (min)", f"recall@{k} opp (min)", "spearman (min)", "rel. error (max)"]
    print(f"n_train {args.n_train}, proj_dim {args.proj_dim}, n_target {args.n_target}, digits MLP, sjlt; "
          "each row against float32 features (seed 0)")
    print(f"| {' | '.join(head)} |")
    print(f"|{'|'.join(' --- ' for _ in head)}|")
    for name, r in rows.items():
        cells = [f"{r[c]:.4f} ({r[c + ('_max' if c == 'rel_error' else '_min')]:.4f})" for c in cols]
        print(f"| {name} | {' | '.join(cells)} |")
    print(f"total {timings['total_s']:.0f} s")

    write_result(args.out, {
        "benchmark": "bench_store_dtype",
        "command": "python -m benchmarks.bench_store_dtype" + (" --quick" if args.quick else ""),
        "sizes": {"n_train": args.n_train, "proj_dim": args.proj_dim, "n_target": args.n_target, "k": k},
        "model": {**MLP, "held_out_accuracy": acc, "recipe": RECIPE},
        "projector": {"kind": "sjlt", "seed": 0},
        "lambda_rel": 1.0,
        "results": rows,
        "timings": timings,
        "env": {"numpy": np.__version__, "threads": args.threads, "loadavg": os.getloadavg()},
    })
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
