"""The report page (trakcli.report.render_report) without a browser: what it embeds, and how safely."""

from __future__ import annotations

import base64
import html
import json
import re

import numpy as np
import pytest
import torch

from trakcli.errors import ArgumentError, DataError
from trakcli.report import embed_json, render_report

NASTY = '</script><script>alert(1)</script><b onclick="x">&amp; <!-- \u2028'


def embedded(page: str) -> dict:
    """The JSON the page embeds, parsed back."""
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    assert m is not None
    return json.loads(m.group(1))


def record(t: int, docs=((3, 2.5), (1, 0.5)), opp=((7, -1.25),), **extra) -> dict:
    return {"target": t, **extra,
            "proponents": [{"train": d, "score": s} for d, s in docs],
            "opponents": [{"train": d, "score": s} for d, s in opp]}


def test_texts_cannot_close_the_data_element_or_become_markup():
    rec = record(0, text=NASTY)
    rec["proponents"][0]["text"] = NASTY
    page = render_report([rec], title="<i>title</i> & co")
    assert page.count("</script>") == 2  # the data element's and the script's own; no text closes either
    assert "<script>alert" not in page and "<b onclick" not in page and "<!--" not in page
    assert "<title>&lt;i&gt;title&lt;/i&gt; &amp; co</title>" in page
    data = embedded(page)
    assert data["queries"][0]["text"] == NASTY and data["docs"]["3"]["text"] == NASTY  # the same text, read back
    assert data["title"] == "<i>title</i> & co"
    assert "\u2028" not in page.split('id="report-data">')[1].split("</script>")[0]


def test_embed_json_escapes_what_html_would_read_and_round_trips():
    value = {"a": "</SCRIPT>", "b": "<!--x-->", "c": "x & y", "d": [1, None, 2.5]}
    text = embed_json(value)
    assert not set("<>&") & set(text)
    assert json.loads(text) == value
    with pytest.raises(ValueError):
        embed_json({"x": float("nan")})  # the renderer turns non-finite numbers into null first


def test_scores_and_contributions_are_rounded_and_non_finite_ones_are_null():
    rec = record(4, docs=((2, 0.123456789), (5, float("nan"))), opp=((9, -float("inf")),))
    rec["proponents"][0]["target_tokens"] = [["Q", None], ["▁Paris", 0.80000001], ["!", float("nan")]]
    rec["proponents"][0]["document_tokens"] = [["The", None], ["▁capital", -0.4]]
    q = embedded(render_report([rec], title="t"))["queries"][0]
    assert [e["s"] for e in q["p"]] == [0.1235, None] and q["o"][0]["s"] is None
    assert q["tok"] == ["Q", "▁Paris", "!"] and q["p"][0]["tc"] == [None, 0.8, None]
    assert q["p"][0]["dc"] == [None, -0.4] and "tc" not in q["p"][1]
    assert embedded(render_report([rec], title="t"))["docs"]["2"]["tok"] == ["The", "▁capital"]


def test_a_document_and_its_tokens_are_embedded_once_however_many_targets_it_answers():
    recs = []
    for t in range(50):
        rec = record(t)
        for side in ("proponents", "opponents"):
            for e in rec[side]:
                e["text"] = f"document {e['train']} " + "words " * 50
                e["document_tokens"] = [[w, 0.1 * t] for w in ("alpha", "beta")]
        recs.append(rec)
    page = render_report(recs, title="t")
    data = embedded(page)
    assert sorted(data["docs"]) == ["1", "3", "7"] and page.count("document 3 ") == 1
    assert data["docs"]["3"]["tok"] == ["alpha", "beta"]
    assert [q["p"][0]["dc"] for q in data["queries"][:3]] == [[0.0, 0.0], [0.1, 0.1], [0.2, 0.2]]
    assert data["k"] == 2


def test_labels_go_beside_the_indices():
    rec = record(0, label=np.int64(7))
    rec["proponents"][0]["label"] = 7
    rec["opponents"][0]["label"] = "cat"
    data = embedded(render_report([rec], title="t"))
    assert data["queries"][0]["label"] == 7 and data["docs"]["3"]["label"] == 7 and data["docs"]["7"]["label"] == "cat"


def test_pictures_share_one_intensity_range_and_only_shown_rows_are_embedded():
    train = np.arange(10 * 4, dtype=np.float32).reshape(10, 2, 2)  # [n, H, W]
    target = -np.ones((3, 2, 2))
    data = embedded(render_report([record(1)], title="t", images=(torch.from_numpy(train), target)))
    assert data["image"] == {"shape": [1, 2, 2]}
    raw = lambda b: list(base64.b64decode(b))  # noqa: E731
    assert raw(data["queries"][0]["img"]) == [0, 0, 0, 0]  # -1: the lowest value shown
    hi = raw(data["docs"]["7"]["img"])
    assert hi[-1] == 255 and hi == sorted(hi)  # 31: the highest shown (row 7 of 0..39)
    assert sorted(data["docs"]) == ["1", "3", "7"] and all("img" in d for d in data["docs"].values())
    rgb = embedded(render_report([record(0)], title="t", images=(np.zeros((10, 3, 4, 5)), np.ones((1, 3, 4, 5)))))
    assert rgb["image"]["shape"] == [3, 4, 5] and len(base64.b64decode(rgb["queries"][0]["img"])) == 60


@pytest.mark.parametrize("images,message", [
    ((np.zeros((10, 64)), np.zeros((3, 64))), r"images must be \[n, H, W\] or \[n, C, H, W\]"),
    ((np.zeros((10, 2, 8, 8)), np.zeros((3, 2, 8, 8))), "C = 1 or 3"),
    ((np.zeros((10, 8, 8)), np.zeros((3, 4, 4))), "give pictures of one shape"),
    ((np.zeros((5, 8, 8)), np.zeros((3, 8, 8))), r"train indices \[7\] are outside the 5 train images"),
    (np.zeros((3, 8, 8)), r"give \(train_images, target_images\)"),
])
def test_bad_pictures_are_one_clear_error(images, message):
    with pytest.raises(DataError, match=message):
        render_report([record(0)], title="t", images=images)


def test_a_record_that_is_not_an_answer_is_one_clear_error():
    with pytest.raises(ArgumentError, match="lacks opponents"):
        render_report([{"target": 0, "proponents": []}], title="t")
    bad = record(0)
    bad["proponents"][0]["document_tokens"] = [["a", 1.0, 2.0]]
    with pytest.raises(ArgumentError, match=r"document_tokens: each token must be \[token text, contribution or null\]"):
        render_report([bad], title="t")


def test_the_page_is_self_contained():
    page = render_report([record(0, text="hello")], title="t", about="about <this>")
    assert page.startswith("<!DOCTYPE html>") and '<meta charset="utf-8">' in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page)  # nothing fetched
    assert "<link" not in page and "@import" not in page and "fetch(" not in page
    assert html.escape("about <this>") in page
    assert render_report([], title="t").count('"queries":[]') == 1  # no targets: a page that says so
