#!/usr/bin/env python
"""How much of EK-FAC's exact LDS can any proj_dim-dimensional sketch of the whitened gradients keep? A probe.

``curvature.exact: false`` scores EK-FAC influences from stored features: the train examples' whitened
gradients, Kronecker-projected to ``proj_dim`` (docs/guides/curvature.md, "Stored features"). This probe
asks whether a better linear sketch at the same width could come close to the exact scores, on the
fine-tuned GPT-2 of ``benchmarks/bench_lds_finetune.py`` (its cached work folder: checkpoint, tokens,
ground-truth retrains, and the store of its row ``trakcli ekfac (curvature.kind alone)`` with the fitted
EK-FAC factors ``Q_S``, ``Q_A``, ``Λ`` of its 8 layers).

For every train and target document it takes each layer's gradient of the summed next-token loss
``G = Σ_t g_t [a_t, 1]ᵀ`` from forward/backward hooks, rotated into the eigenbasis, ``X = Q_Sᵀ G Q_A``, and
whitened, ``W = X / sqrt(Λ + δ)`` with ``δ = damping · mean(Λ)`` per layer (the influence is then
``⟨W_t, W_z⟩`` summed over layers; its LDS is checked against the stored exact scores' correlation).
Rows, each the LDS on the targets' loss against the retrains (95% bootstrap interval):

* ``exact``: the full inner product (395,520 coordinates);
* ``dense Gaussian r`` (r <= 16,384): ``⟨P W_t, P W_z⟩`` with ``P`` ``[r, D]`` i.i.d. N(0, 1/r), the random
  linear sketch with the smallest inner-product error for its width (a Kronecker projection's is larger);
* ``top whitened variance r``: the r coordinates with the largest mean ``W_z²`` over the train rows, kept
  exactly (a data-dependent selection: what a deterministic sketch of the eigenbasis could keep);
* ``share of the whitened variance`` in the top r coordinates (how spread the whitened gradients are).

Usage (after ``python -m benchmarks.bench_lds_finetune`` has cached its work folder and that row)::

    python -m benchmarks.probe_curvature_sketch --out bench_results/curvature_sketch_probe.json

About 10 minutes and 12 GiB on 2 cores (the rotated gradients of 1,100 documents are held in memory).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.benchjson import write_result  # noqa: E402

DEFAULT_WORK = REPO / "runs" / "bench_finetune"
STORE = "stores/trakcli-ekfac-curvature-kind-alone.zarr"
N_BOOTSTRAP = 1000
#: The widest dense Gaussian sketch drawn (r = 65,536 would take hours on 2 cores).
MAX_DENSE = 16384


def rotated_gradients(work: Path, store: Path, threads: int) -> dict[str, Any]:
    """Per layer ``Q_Sᵀ G Q_A`` ``[n, d_out, d_in]`` float32 of every train and target document, and ``Λ``."""
    import torch
    import zarr
    from transformers import GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    torch.set_num_threads(threads)
    tok = torch.load(work / "tokens.pt", weights_only=False)
    model = GPT2LMHeadModel.from_pretrained(work / "pretrained")
    model.load_state_dict(torch.load(work / "finetuned" / "model.pt", weights_only=False), strict=False)
    model.eval()
    curvature = zarr.open(str(store), mode="r")["train/0/curvature"]
    names = [n for n, m in model.named_modules() if isinstance(m, Conv1D) and ".h." in n]  # the store's layer order
    stored = [k for k in curvature.keys() if k.isdigit()]  # the layers' groups (beside the covariance pass's sums)
    if len(names) != len(stored):
        raise SystemExit(f"{store} holds {len(stored)} layers, the model {len(names)} block linears")
    factors = [tuple(torch.tensor(curvature[str(i)][k][:]).double() for k in ("q_out", "q_in", "eig"))
               for i in range(len(names))]
    modules = dict(model.named_modules())
    seen: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Any:
        def forward(_module: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            x = inputs[0].detach()
            seen[name] = torch.cat([x, torch.ones(*x.shape[:-1], 1)], -1)  # the bias as a last input column
            output.register_hook(lambda g: seen.__setitem__(name + ".g", g.detach()))
        return forward

    for n in names:
        modules[n].register_forward_hook(hook(n))
    out: dict[str, Any] = {"eig": [f[2].float() for f in factors], "layers": names}
    for split in ("train", "target"):
        ids, mask, labels = tok[f"{split}_ids"], tok[f"{split}_mask"], tok[f"{split}_labels"]
        parts: list[list[torch.Tensor]] = [[] for _ in names]
        for lo in range(0, len(ids), 50):
            rows = slice(lo, lo + 50)
            logits = model(input_ids=ids[rows], attention_mask=mask[rows]).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     labels[rows][:, 1:].reshape(-1), ignore_index=-100,
                                                     reduction="sum")
            model.zero_grad()
            loss.backward()
            for i, n in enumerate(names):
                grad = torch.einsum("bto,bti->boi", seen[n + ".g"].double(), seen[n].double())  # [b, d_out, d_in]
                q_out, q_in, _ = factors[i]
                parts[i].append((q_out.T @ grad @ q_in).float())
        out[split] = [torch.cat(p) for p in parts]
        print(f"[probe] {split}: {len(ids)} documents' rotated layer gradients", file=sys.stderr, flush=True)
    return out


def dense_gaussian(a: Any, b: Any, r: int, seed: int = 0) -> Any:
    """``(a Pᵀ)(b Pᵀ)ᵀ`` ``[n_a, n_b]`` with ``P`` ``[r, D]`` i.i.d. N(0, 1/r), drawn in blocks of columns."""
    import torch

    g = torch.Generator().manual_seed(seed)
    pa, pb = torch.zeros(a.shape[0], r), torch.zeros(b.shape[0], r)
    for lo in range(0, a.shape[1], 20_000):
        p = torch.randn(min(20_000, a.shape[1] - lo), r, generator=g) / r ** 0.5
        pa += a[:, lo:lo + 20_000] @ p
        pb += b[:, lo:lo + 20_000] @ p
    return pa @ pb.T


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=DEFAULT_WORK, help="bench_lds_finetune's work folder")
    p.add_argument("--store", default=STORE, help=f"the EK-FAC store, relative to --work (default {STORE})")
    p.add_argument("--dims", type=int, nargs="+", default=[4096, 16384, 65536], help="sketch widths r")
    p.add_argument("--damping", type=float, nargs="+", default=[0.1, 1.0, 10.0],
                   help="relative dampings of the whitening (the first is the scores' default, 0.1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="JSON result")
    a = p.parse_args(argv)
    import glob

    import numpy as np
    import torch

    from trakcli.evaluation.lds import lds

    t0 = time.perf_counter()
    files = sorted(glob.glob(str(a.work / "retrains" / "r*.npz")))
    if not files:
        raise SystemExit(f"no retrains in {a.work}/retrains: run python -m benchmarks.bench_lds_finetune first")
    truth = [np.load(f) for f in files]
    masks = np.stack([t["mask"] for t in truth])
    outputs = -np.stack([t["loss"] for t in truth])  # higher = helped
    store = a.work / a.store
    d = rotated_gradients(a.work, store, a.threads)

    def entry(scores: Any) -> dict[str, float]:
        # ⟨∇loss_t, H⁻¹ ∇loss_z⟩: how much upweighting z lowers t's loss, i.e. raises -loss
        res = lds(np.asarray(scores, dtype=np.float64), masks, outputs, n_bootstrap=N_BOOTSTRAP, seed=0)
        return {"lds": float(res.lds), "ci_low": float(res.ci_low), "ci_high": float(res.ci_high)}

    rows: list[dict[str, Any]] = []
    check: dict[str, float] = {}
    for damping in a.damping:
        w = [(1.0 / (e.double() + damping * e.double().mean())).flatten().sqrt().float() for e in d["eig"]]
        train = torch.cat([x.flatten(1) * s for x, s in zip(d["train"], w)], 1)  # [n_train, D] whitened
        target = torch.cat([x.flatten(1) * s for x, s in zip(d["target"], w)], 1)
        exact = target @ train.T
        if damping == a.damping[0]:
            import zarr

            stored = zarr.open(str(store), mode="r")["scores/default/scores"][:]
            check = {"damping": damping, "pearson_with_stored_exact": float(np.corrcoef(
                exact.numpy().ravel(), stored.ravel())[0, 1])}
        rows.append({"damping": damping, "sketch": "exact", "r": int(train.shape[1]), **entry(exact)})
        print(f"[probe] damping {damping}: exact {rows[-1]['lds']:.3f}", file=sys.stderr, flush=True)
        var = (train.double() ** 2).mean(0)
        order = var.argsort(descending=True)
        share = (var[order].cumsum(0) / var.sum()).numpy()
        for r in a.dims if damping == a.damping[0] else a.dims[:1]:
            if r <= MAX_DENSE:
                rows.append({"damping": damping, "sketch": "dense Gaussian", "r": r,
                             **entry(dense_gaussian(target, train, r))})
                print(f"[probe] damping {damping}, r {r}: gaussian {rows[-1]['lds']:.3f}", file=sys.stderr, flush=True)
            top = order[:r]
            rows.append({"damping": damping, "sketch": "top whitened variance", "r": r,
                         "variance_share": float(share[r - 1]), **entry(target[:, top] @ train[:, top].T)})
            print(f"[probe] damping {damping}, r {r}: top {rows[-1]['lds']:.3f} "
                  f"({share[r - 1]:.1%} of the variance)", file=sys.stderr, flush=True)
    args = argv if argv is not None else sys.argv[1:]
    result = {"benchmark": "probe_curvature_sketch",
              "command": " ".join(["python -m benchmarks.probe_curvature_sketch", *args]),
              "work": str(a.work.resolve().relative_to(REPO)) if a.work.resolve().is_relative_to(REPO) else a.work.name,
              "store": a.store, "n_train": int(d["train"][0].shape[0]), "n_target": int(d["target"][0].shape[0]),
              "n_retrain": len(files), "layers": d["layers"], "check": check, "rows": rows,
              "seconds": time.perf_counter() - t0}
    for r in rows:
        extra = f" ({r['variance_share']:.1%} of the whitened variance)" if "variance_share" in r else ""
        print(f"damping {r['damping']:>5}  {r['sketch']:<24} r={r['r']:>7}  LDS {r['lds']:.3f} "
              f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]{extra}")
    if a.out:
        write_result(a.out, result)
    return result


if __name__ == "__main__":
    main()
