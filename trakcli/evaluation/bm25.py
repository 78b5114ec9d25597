"""BM25 word-overlap scores of text data: the baseline every attribution of text is shown beside.

BM25 (Robertson & Zaragoza 2009, "The Probabilistic Relevance Framework: BM25 and Beyond") ranks the training
documents by the query's words they share, weighted by rarity; it needs no model. On text benchmarks it is a strong
baseline (EleutherAI's Bergson leaderboard: BM25 LDS 0.220 against TRAK's 0.138 on fine-tuned GPT-2), so `trak eval`
reports it beside the gradient method's LDS, QLD and recall on text data: a result that BM25 matches measures word
overlap, not what the model learned. Computed with the ``bm25s`` package (Lù 2024), with its default tokenizer and
English stopwords.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from trakcli.errors import ConfigError

def bm25_scores(corpus: Sequence[str], queries: Sequence[str]) -> np.ndarray:
    """BM25 score of every (query, document) pair of the targets' and the training documents' texts:
    ``[n_target, n_train]`` float32, higher = more word overlap (0 without a shared word).

    Raises:
        ConfigError: ``bm25s`` is not installed.
    """
    try:
        import bm25s
    except ImportError:
        raise ConfigError("the BM25 baseline needs the bm25s package: pip install bm25s (or the [hf] extra) for the "
                          "BM25 row of text evaluations") from None
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(list(corpus), stopwords="en", show_progress=False), show_progress=False)
    tokens = bm25s.tokenize(list(queries), stopwords="en", show_progress=False, return_ids=False)
    out = np.zeros((len(queries), len(corpus)), dtype=np.float32)
    for i, words in enumerate(tokens):
        if words:
            out[i] = retriever.get_scores(words)
    return out


def bm25_of(train: Any, target: Any) -> np.ndarray | None:
    """:func:`bm25_scores` of two datasets when both are text (every row's text: the prompt and completion
    joined, the chat's turns), else None (tensor data has no words).

    Raises:
        ConfigError: the data is text and ``bm25s`` is not installed.
    """
    if not (callable(getattr(train, "texts", None)) and callable(getattr(target, "texts", None))):
        return None
    return bm25_scores(*(d.texts(range(len(d)), max_chars=None) for d in (train, target)))


def token_overlap_scores(train: Any, target: Any, queries: Sequence[int], width: int, seed: int = 0,
                         batch_rows: int = 64) -> np.ndarray:
    """A lexical baseline of per-token scores: each train token that also is a target token of the query,
    weighted by its rarity (the per-token counterpart of BM25's ranking, for the per-token QLD).

    A train token ``x`` at position ``t`` (a target of the loss there) of document ``z`` scores
    ``idf(x) = log((n_train + 1) / (df(x) + 0.5))`` when ``x`` is among the query's target tokens, else 0
    (``df``: the documents holding ``x`` as a target), plus a seeded jitter below 1e-6 that breaks ties at random.

    ``train`` and ``target`` are token datasets (``batches``: per-token labels ``[b, L]``, the token where it is
    a target), read ``batch_rows`` rows at once; ``width``: the longest sequence (``max_length``).

    Returns:
        ``[len(queries), n_train, width]`` float32, NaN where a token is not a target.
    """
    n = len(train)
    labels = np.full((n, width), -100, dtype=np.int64)
    for off, _, y in train.batches(0, n, batch_rows):
        y = y.numpy()
        labels[off:off + len(y), :min(width, y.shape[1])] = y[:, :width]
    labels[:, 0] = -100  # position 0 predicts nothing
    valid = labels != -100
    ids, df = np.unique(np.concatenate([np.unique(row[ok]) for row, ok in zip(labels, valid)]), return_counts=True)
    idf = dict(zip(ids.tolist(), np.log((n + 1) / (df + 0.5)).tolist()))
    weight = np.vectorize(lambda v: idf.get(int(v), 0.0), otypes=[np.float64])(np.where(valid, labels, 0))
    jitter = np.random.default_rng(seed).uniform(0, 1e-6, size=(len(queries), n, width))
    out = np.full((len(queries), n, width), np.nan, dtype=np.float32)
    for i, q in enumerate(queries):
        _, _, y = next(target.batches(q, q + 1, 1))
        mine = set(y[0, 1:][y[0, 1:] != -100].tolist())
        hit = np.isin(labels, list(mine)) & valid
        out[i][valid] = (np.where(hit, weight, 0.0) + jitter[i])[valid]
    return out
