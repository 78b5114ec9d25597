"""The BM25 baseline of text evaluations."""

from __future__ import annotations

import numpy as np

from trakcli.evaluation.bm25 import bm25_of, bm25_scores


def test_bm25_ranks_documents_by_shared_rare_words():
    corpus = ["the cat sat on the mat", "stock markets fell sharply today", "a zebra and a cat", "rain again"]
    s = bm25_scores(corpus, ["zebra cat", "markets", "the of and"])
    assert s.shape == (3, 4) and s.dtype == np.float32
    assert np.argmax(s[0]) == 2 and s[0, 0] > 0 and s[0, 1] == 0 == s[0, 3]
    assert np.argmax(s[1]) == 1 and np.count_nonzero(s[1]) == 1
    assert not s[2].any()  # stopwords only: no overlap counted


def test_tensor_data_has_no_bm25_row():
    class Tensors:
        pass

    assert bm25_of(Tensors(), Tensors()) is None
