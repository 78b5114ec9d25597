#!/usr/bin/env python
"""Featurize's peak memory against the size of a text corpus: does RAM grow with n_train?

For each corpus size, a jsonl file of that many documents (mixed length, 5 to 120
words drawn from a fixed vocabulary) is featurized by ``trak featurize`` in its own
process, with a tiny GPT-2 built from a transformers config (2 layers, hidden 16)
and a word-level tokenizer of the same vocabulary (2,000 seeded syllable words), plain-text
language modeling, kronecker projection at proj_dim 256, max_length 128, batch 64.
The peak RSS is that process's ru_maxrss; the wall seconds include start-up.

Usage::

    python -m benchmarks.bench_text_rss                    # 10,000 and 100,000 documents
    python -m benchmarks.bench_text_rss --n-docs 2000 20000

Prints a table and writes JSON (``--out``, default bench_results/text_rss.json).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.launch import run_measured  # noqa: E402  (wall time and the command's own peak RSS)
from benchmarks.benchjson import write_result  # noqa: E402  (atomic; adds date, commit, version, machine)


def vocabulary(n: int = 2000) -> list[str]:
    """A fixed vocabulary of ``n`` distinct pronounceable words (two or three seeded syllables)."""
    rng = random.Random(0)
    onsets, vowels = "b d f g k l m n p r s t v z".split(), "a e i o u".split()
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.randint(2, 3))))
    return sorted(words)


def make_model(folder: Path) -> None:
    """A tiny GPT-2 and a word-level tokenizer of :func:`vocabulary` (+ [UNK], [PAD], [EOS]) in ``folder``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "[EOS]", *vocabulary()])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(vocab), n_embd=16, n_layer=2, n_head=2, n_positions=128,
                     bos_token_id=2, eos_token_id=2)
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)


def make_corpus(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = vocabulary()
    with path.open("w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(5, 120)))}) + "\n")


def run(work: Path, n: int) -> dict:
    import yaml

    corpus = work / f"docs_{n}.jsonl"
    make_corpus(corpus, n)
    cfg = {
        "model": {"entrypoint": f"hf:{work / 'model'}"},
        "task": "language_modeling",
        "checkpoints": [f"hf:{work / 'model'}"],
        "data": {"train": {"path": str(corpus), "text": "text", "max_length": 128}, "batch_size": 64},
        "projector": {"kind": "kronecker", "proj_dim": 256, "seed": 0},
        "store": {"path": str(work / f"store_{n}.zarr")},
    }
    (work / f"run_{n}.yaml").write_text(yaml.safe_dump(cfg))
    # under the launcher: the peak RSS is featurize's own, not the corpus this process wrote
    got = run_measured([sys.executable, "-m", "trakcli.cli.main", "featurize", str(work / f"run_{n}.yaml"), "-q"],
                       cwd=work)
    if got["exit"] != 0:
        raise SystemExit(f"featurize of {n} documents failed:\n{got['stderr'][-3000:]}")
    return {"n_docs": n, "seconds": got["seconds"], "peak_rss_mb": got["peak_rss_gib"] * 1024,
            "corpus_mb": corpus.stat().st_size / 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-docs", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--work", type=Path, default=REPO / "bench_results" / "text_rss_work")
    p.add_argument("--out", type=Path, default=REPO / "bench_results" / "text_rss.json")
    a = p.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    make_model(a.work / "model")
    rows = []
    for n in a.n_docs:
        rows.append(run(a.work, n))
        r = rows[-1]
        print(f"{r['n_docs']:>8} docs  {r['corpus_mb']:7.1f} MB jsonl  {r['seconds']:7.1f} s  "
              f"peak RSS {r['peak_rss_mb']:7.1f} MB", flush=True)
    growth = rows[-1]["peak_rss_mb"] - rows[0]["peak_rss_mb"]
    print(f"peak RSS growth from {rows[0]['n_docs']} to {rows[-1]['n_docs']} documents: {growth:+.1f} MB")
    write_result(a.out, {"benchmark": "bench_text_rss", "rows": rows, "growth_mb": growth})
    shutil.rmtree(a.work, ignore_errors=True)
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()
