"""BM25 word-overlap scores of text data: the baseline every attribution of text is shown beside.

BM25 (Robertson & Zaragoza 2009, "The Probabilistic Relevance Framework: BM25 and Beyond")
ranks the training documents by the query's words they share, weighted by rarity; it needs no
model. On text benchmarks it is a strong baseline (EleutherAI's Bergson leaderboard: BM25 LDS
0.220 against TRAK's 0.138 on fine-tuned GPT-2), so `trak eval` reports it beside the
gradient method's LDS, QLD and recall on text data: a result that BM25 matches measures
word overlap, not what the model learned. Computed with the ``bm25s`` package (Lù 2024), with
its default tokenizer and English stopwords.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from trakcli.errors import ConfigError

#: How a missing bm25s is fixed.
INSTALL_HINT = "pip install bm25s (or the [hf] extra) for the BM25 row of text evaluations"


def bm25_scores(corpus: Sequence[str], queries: Sequence[str]) -> np.ndarray:
    """BM25 score of every (query, document) pair.

    Args:
        corpus: the training documents' texts, ``n_train`` of them.
        queries: the targets' texts, ``n_target`` of them.

    Returns:
        ``[n_target, n_train]`` float32, higher = more word overlap (0 without a shared word).

    Raises:
        ConfigError: ``bm25s`` is not installed.
    """
    try:
        import bm25s
    except ImportError:
        raise ConfigError(f"the BM25 baseline needs the bm25s package: {INSTALL_HINT}") from None
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(list(corpus), stopwords="en", show_progress=False), show_progress=False)
    tokens = bm25s.tokenize(list(queries), stopwords="en", show_progress=False, return_ids=False)
    out = np.zeros((len(queries), len(corpus)), dtype=np.float32)
    for i, words in enumerate(tokens):
        if words:
            out[i] = retriever.get_scores(words)
    return out


def dataset_texts(data: Any) -> list[str] | None:
    """Every row's text of a text dataset (the prompt and completion joined, the chat's turns), else None."""
    texts = getattr(data, "texts", None)
    if not callable(texts):
        return None
    return texts(range(len(data)), max_chars=None)


def bm25_of(train: Any, target: Any) -> np.ndarray | None:
    """:func:`bm25_scores` of two datasets when both are text, else None (tensor data has no words).

    Raises:
        ConfigError: the data is text and ``bm25s`` is not installed.
    """
    corpus, queries = dataset_texts(train), dataset_texts(target)
    if corpus is None or queries is None:
        return None
    return bm25_scores(corpus, queries)
