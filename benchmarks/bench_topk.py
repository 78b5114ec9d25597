#!/usr/bin/env python
"""Top-k attribution at corpus scale: `trak score` with ``score.top_k`` against the floor, FAISS and the full matrix.

A store of ``n_train`` rows at proj_dim 1024 is made through the real
``trak featurize`` path (a small MLP, 16 -> 64 -> 10, on synthetic inputs;
sjlt projection; one checkpoint), with 1,000 targets. Then, each in its own
process (wall seconds include the interpreter's start-up and imports; peak RSS
is the process's ru_maxrss):

* ``trak score top_k``: ``trak score CONFIG score.top_k=100`` as a user runs it
  (target features, the ensembled TRAK score streamed over the train features,
  the top 100 proponents and opponents per target into the store).
* ``floor``: the stored train features, out_to_loss, target features and kernel read
  into RAM with zarr, then one torch matmul ``W Φᵀ ⊙ Q`` (``W = φ_t A``) and ``topk(100)``
  from both ends (the same scores; what the floor does not do: the target
  features and the kernel, which it reads from the store).
* ``faiss IndexFlatIP``: the same features read with zarr, an exact inner-product index
  over the rows ``Q_i φ_i`` queried with ``W`` and ``-W`` (faiss-cpu: a baseline installed
  in the benchmark environment, never a trakcli dependency).
* ``trak score full``: ``trak score CONFIG`` writing the full ``[n_target, n_train]`` matrix.
* ``two-stage <dtype> xM``: the same project featurized again with ``store.dtype`` int8 or binary
  (codes beside a bfloat16 copy, through the real featurize path; the featurize time is its own
  row), then ``trak score CONFIG score.top_k=100 score.rescore_multiplier=M``: candidates from the
  codes, exact re-rank from the bfloat16 copy. Each row gives the recall the run measured and
  recorded itself (sampled targets, against the exact top-100 of the bfloat16 copy) and the
  overlap of all 1,000 targets' top-100 with the float32 floor (which also counts the bfloat16
  rounding of the float copy). ``x exact`` is the wall time over ``trak score top_k``'s (the exact
  streamed pass of the float32 store, same run). ``--rerank scan`` names the row ``two-stage <dtype> xM
  scan`` and forces the one-pass scan (``auto``, the default, takes the plain pass on a store too small for
  the scan's sampled floor; the row records what ran).

For each it reports wall seconds, peak RSS, the bytes the result adds to the store,
and the top-100 overlap with the floor (proponents and opponents).

At 10^7 rows the floor cannot hold the features in memory (40 GB): ``--skip floor``
leaves it out and takes the overlaps against ``trak score top_k`` (the exact streamed
pass) instead. Featurizing 10^7 rows takes most of an hour per store: ``--keep`` keeps
the stores, and ``--reuse`` runs again over them (featurize then only checks them; the
``trak score`` rows are computed again).

Usage (faiss: ``pip install faiss-cpu`` into the environment, ``benchmarks/env.sh`` does)::

    python -m benchmarks.bench_topk                          # n_train 200,000 and 1,000,000
    python -m benchmarks.bench_topk --n-train 20000          # a quick run
    python -m benchmarks.bench_topk --n-train 10000000 --dtypes int8 --multipliers 2 \
        --skip faiss full floor --keep --reuse               # 10^7 rows (stores kept in --work)

Prints a table and writes JSON (``--out``, default bench_results/topk.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import write_result  # noqa: E402  (atomic; adds date, commit, version, machine)
from benchmarks.launch import run_measured  # noqa: E402  (wall time and the command's own peak RSS)
K = 100
MODEL = '''import torch.nn as nn


def make_model():
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))
'''


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def make_project(work: Path, n_train: int, n_target: int, proj_dim: int) -> Path:
    import torch
    import yaml

    work.mkdir(parents=True, exist_ok=True)
    (work / "model.py").write_text(MODEL)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    torch.save(model.state_dict(), work / "model.pt")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n_train + n_target, 16, generator=g)
    y = model(x).argmax(1).detach()  # labels the model mostly predicts, as after training
    flip = torch.rand(len(y), generator=g) < 0.2
    y[flip] = torch.randint(0, 10, (int(flip.sum()),), generator=g)
    torch.save({"x_train": x[:n_train].clone(), "y_train": y[:n_train].clone(), "x_target": x[n_train:].clone(),
                "y_target": y[n_train:].clone()}, work / "data.pt")
    cfg = {
        "model": {"entrypoint": "model.py:make_model"},
        "checkpoints": ["model.pt"],
        "data": {
            "train": {"path": "data.pt", "inputs": "x_train", "labels": "y_train"},
            "target": {"path": "data.pt", "inputs": "x_target", "labels": "y_target"},
            "batch_size": 4096,
        },
        "projector": {"kind": "sjlt", "proj_dim": proj_dim, "seed": 0},
        "store": {"path": "store.zarr"},
    }
    (work / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return work


def timed(cmd: list[str], cwd: Path) -> dict:
    """Run ``cmd``; its wall seconds (start-up included), peak RSS and last stdout line (JSON if any).

    The command runs under :func:`benchmarks.launch.run_measured`, so its peak RSS is its own, not this
    benchmark's (which holds the corpus it wrote).
    """
    got = run_measured(cmd, cwd=cwd)
    if got["exit"] != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{got['stderr'][-3000:]}")
    res = {"seconds": got["seconds"], "peak_rss_gib": got["peak_rss_gib"]}
    out = got["stdout"]
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if last.startswith("{"):
        res.update(json.loads(last))
    return res


def _inputs(store: Path, exp: str):
    import torch
    import zarr

    from trakcli.scoring import target_weights

    t0 = time.perf_counter()
    root = zarr.open_group(str(store), mode="r")
    phi = torch.from_numpy(np.asarray(root["train/0/features"][:]))
    q = torch.from_numpy(np.asarray(root["train/0/out_to_loss"][:]))
    phi_t = torch.from_numpy(np.asarray(root[f"targets/{exp}/0/features"][:]))
    kernel = torch.from_numpy(np.asarray(root["train/0/kernel"][:]))
    read = time.perf_counter() - t0
    return phi, q, target_weights(kernel, phi_t, dtype=torch.float32), read


def child_floor(store: Path, exp: str) -> dict:
    import torch

    phi, q, w, read = _inputs(store, exp)
    t0 = time.perf_counter()
    scores = (w @ phi.T).mul_(q)
    pro = torch.topk(scores, K, dim=1).indices.numpy()
    opp = torch.topk(scores, K, dim=1, largest=False).indices.numpy()
    compute = time.perf_counter() - t0
    np.save(store.parent / "floor_pro.npy", pro)
    np.save(store.parent / "floor_opp.npy", opp)
    return {"read_s": read, "compute_s": compute}


def child_faiss(store: Path, exp: str) -> dict:
    import faiss

    phi, q, w, read = _inputs(store, exp)
    t0 = time.perf_counter()
    index = faiss.IndexFlatIP(phi.shape[1])
    index.add(np.ascontiguousarray((phi * q[:, None]).numpy()))
    _, pro = index.search(np.ascontiguousarray(w.numpy()), K)
    _, opp = index.search(np.ascontiguousarray((-w).numpy()), K)
    compute = time.perf_counter() - t0
    np.save(store.parent / "faiss_pro.npy", pro)
    np.save(store.parent / "faiss_opp.npy", opp)
    return {"read_s": read, "compute_s": compute}


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of |a_row ∩ b_row| / K."""
    return float(np.mean([len(set(x) & set(y)) / a.shape[1] for x, y in zip(a, b)]))


def bench(n_train: int, n_target: int, proj_dim: int, work: Path, dtypes: list[str],
          multipliers: dict[str, list[int]], skip: list[str], reuse: bool = False,
          reranks: tuple[str, ...] = ("auto",)) -> dict:
    import zarr

    trak = [sys.executable, "-m", "trakcli.cli.main"]
    reused = reuse and (work / "run.yaml").exists()
    proj = work if reused else make_project(work, n_train, n_target, proj_dim)
    store = proj / "store.zarr"
    rows = {"featurize": timed([*trak, "featurize", "run.yaml", "-q"], proj)}
    rows["featurize"]["reused_store"] = reused
    rows["featurize"]["store_bytes"] = du(store / "train")
    shutil.rmtree(store / "scores" / "topk", ignore_errors=True)  # a reused store is scored again
    rows["trak score top_k"] = timed([*trak, "score", "run.yaml", "-q", f"score.top_k={K}", "score.experiment=topk"],
                                     proj)
    rows["trak score top_k"]["store_bytes"] = du(store / "scores" / "topk")
    me = sys.executable, str(Path(__file__).resolve())
    if "floor" not in skip:
        rows["floor"] = timed([*me, "--child", "floor", "--store", str(store)], proj)
    if "faiss" not in skip and _has_faiss():
        rows["faiss IndexFlatIP"] = timed([*me, "--child", "faiss", "--store", str(store)], proj)
    if "full" not in skip:
        rows["trak score full"] = timed([*trak, "score", "run.yaml", "-q", "score.experiment=full"], proj)
        rows["trak score full"]["store_bytes"] = du(store / "scores" / "full")
    root = zarr.open_group(str(store), mode="r")
    pro = np.asarray(root["scores/topk/top_k/proponents"][:])
    opp = np.asarray(root["scores/topk/top_k/opponents"][:])
    if "floor" in skip:  # the reference is the exact streamed pass (float32 store)
        floor_pro, floor_opp = pro, opp
    else:
        floor_pro, floor_opp = np.load(proj / "floor_pro.npy"), np.load(proj / "floor_opp.npy")
    for dtype in dtypes:  # two-stage: a store of codes beside a bfloat16 copy, through the real featurize path
        other = [f"store.dtype={dtype}", f"store.path={dtype}.zarr"]
        reused = reuse and (proj / f"{dtype}.zarr").exists()
        rows[f"featurize {dtype}"] = timed([*trak, "featurize", "run.yaml", "-q", *other], proj)
        rows[f"featurize {dtype}"]["reused_store"] = reused
        rows[f"featurize {dtype}"]["store_bytes"] = du(proj / f"{dtype}.zarr" / "train")
        for m, rerank in ((m, rr) for m in multipliers[dtype] for rr in reranks):
            name = f"two-stage {dtype} x{m}" + ("" if rerank == "auto" else f" {rerank}")
            exp = f"ts{m}" + ("" if rerank == "auto" else rerank)
            shutil.rmtree(proj / f"{dtype}.zarr" / "scores" / exp, ignore_errors=True)
            rows[name] = timed([*trak, "score", "run.yaml", "-q", *other, f"score.top_k={K}",
                                f"score.rescore_multiplier={m}", f"score.experiment={exp}",
                                f"score.rerank={rerank}"], proj)
            g = zarr.open_group(str(proj / f"{dtype}.zarr"), mode="r")[f"scores/{exp}/top_k"]
            rec = dict(g["proponents"].attrs).get("two_stage")
            if rec is None:  # auto on a store too small for the scan's floor: the plain pass ran
                rows[name]["rerank"] = "plain pass"
            else:
                rows[name]["rerank"] = rec.get("rerank", "scan")
                rows[name]["recall_recorded"] = [rec["recall"]["proponents"], rec["recall"]["opponents"]]
                rows[name]["recall_queries"] = rec["n_queries"]
                rows[name]["recall_rows_measured"] = rec.get("rows_measured", 1.0)
            rows[name]["overlap_with_floor"] = [overlap(np.asarray(g["proponents"][:]), floor_pro),
                                                overlap(np.asarray(g["opponents"][:]), floor_opp)]
    rows["trak score top_k"]["overlap_with_floor"] = [overlap(pro, floor_pro), overlap(opp, floor_opp)]
    if "faiss IndexFlatIP" in rows:
        rows["faiss IndexFlatIP"]["overlap_with_floor"] = [
            overlap(np.load(proj / "faiss_pro.npy"), floor_pro), overlap(np.load(proj / "faiss_opp.npy"), floor_opp)]
    if "trak score full" in rows:
        full = np.asarray(root["scores/full/scores"][:8])
        rows["trak score full"]["overlap_with_floor"] = [
            overlap(np.argsort(-full, 1)[:, :K], floor_pro[:8]), overlap(np.argsort(full, 1)[:, :K], floor_opp[:8])]
    return {"n_train": n_train, "n_target": n_target, "proj_dim": proj_dim, "k": K,
            "overlap_reference": "trak score top_k" if "floor" in skip else "floor",
            "features_bytes": du(store / "train"), "rows": rows}


def _has_faiss() -> bool:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


def table(results: list[dict]) -> str:
    ref = "exact" if results and results[0].get("overlap_reference") == "trak score top_k" else "floor"
    lines = [f"{'n_train':>9} {'variant':<22} {'wall s':>8} {'x floor':>8} {'x exact':>8} {'peak GiB':>9} "
             f"{'store MB':>9} {f'top-100 = {ref} (pro, opp)':>27} {'recorded recall (pro, opp)':>27}"]
    for r in results:
        exact = r["rows"]["trak score top_k"]["seconds"]
        floor = r["rows"]["floor"]["seconds"] if "floor" in r["rows"] else float("nan")
        for name, row in r["rows"].items():
            ov = row.get("overlap_with_floor")
            ov = f"{ov[0]:.4f}, {ov[1]:.4f}" if ov else ""
            rec = row.get("recall_recorded")
            rec = f"{rec[0]:.4f}, {rec[1]:.4f}" if rec else ""
            mb = f"{row['store_bytes'] / 1e6:.1f}" if "store_bytes" in row else ""
            lines.append(f"{r['n_train']:>9} {name:<22} {row['seconds']:>8.1f} {row['seconds'] / floor:>8.2f} "
                         f"{row['seconds'] / exact:>8.2f} {row['peak_rss_gib']:>9.2f} {mb:>9} {ov:>27} {rec:>27}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-train", type=int, nargs="+", default=[200_000, 1_000_000])
    p.add_argument("--n-target", type=int, default=1000)
    p.add_argument("--proj-dim", type=int, default=1024)
    p.add_argument("--work", type=Path, default=REPO / "bench_results" / "topk_work")
    p.add_argument("--out", type=Path, default=REPO / "bench_results" / "topk.json")
    p.add_argument("--keep", action="store_true", help="keep the work directories (stores)")
    p.add_argument("--dtypes", nargs="*", default=["int8", "binary"], choices=["int8", "binary"],
                   help="store.dtype of the two-stage rows (none: no two-stage rows)")
    p.add_argument("--multipliers", type=int, nargs="*", default=[1, 2, 4, 8],
                   help="score.rescore_multiplier values of the two-stage rows")
    p.add_argument("--binary-multipliers", type=int, nargs="*", default=None,
                   help="score.rescore_multiplier values of the binary rows (default: --multipliers)")
    p.add_argument("--rerank", nargs="+", default=["auto"], choices=["auto", "scan"],
                   help="score.rerank of the two-stage rows (each its own row)")
    p.add_argument("--skip", nargs="*", default=[], choices=["faiss", "full", "floor"],
                   help="rows to leave out (floor: it holds every feature in memory, 40 GB at 10^7 rows; the "
                        "overlaps are then taken against trak score top_k, the exact streamed pass)")
    p.add_argument("--reuse", action="store_true",
                   help="keep the stores of an earlier --keep run in --work (featurize then only checks them)")
    p.add_argument("--child", choices=["floor", "faiss"], help=argparse.SUPPRESS)
    p.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        res = (child_floor if a.child == "floor" else child_faiss)(a.store, "topk")
        print(json.dumps(res))
        return
    results = []
    for n in a.n_train:
        work = a.work / f"n{n}"
        if not a.reuse:
            shutil.rmtree(work, ignore_errors=True)
        binary = a.multipliers if a.binary_multipliers is None else a.binary_multipliers
        mult = {"int8": a.multipliers, "binary": binary}
        results.append(bench(n, a.n_target, a.proj_dim, work, a.dtypes, mult, a.skip, a.reuse, tuple(a.rerank)))
        print(table(results[-1:]), flush=True)
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(table(results))
    write_result(a.out, {
        "benchmark": "bench_topk",
        "args": {k: getattr(a, k) for k in ("n_train", "n_target", "proj_dim", "dtypes", "multipliers",
                                             "binary_multipliers", "rerank", "skip", "reuse")}, "results": results,
    })
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()
