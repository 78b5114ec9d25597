#!/usr/bin/env python
"""The runnable examples as shipped: each one's commands, their wall time, and what they find.

Examples (``trakcli/configs/NAME.yaml``; all read the data and the small pretrained GPT-2 that
``python -m examples.news_lm runs/news`` writes, run once first and timed on its own):

* ``news_ekfac``: fine-tune every weight, then EK-FAC influences of 20 planted-fact queries;
* ``news_lora``: LoRA adapters on the frozen base, EK-FAC influences through the adapters;
* ``news_select``: ``trak select`` of the upper-case tenth of a news pool from 8 upper-case examples.

Protocol: a new work folder (``--work``, default ``bench_results/examples_work``) holds ``runs/``;
every command of a config's header (its ``#   trak ...`` lines before the wall-time line) runs as its
own process from the work folder, in order, with the shipped config's path (the ``trak`` script of
this environment, ``HF_HUB_OFFLINE=1``), one process at a time; seconds = each process's wall time
(start-up and imports included, :func:`benchmarks.launch.run_measured`), an example's seconds their
sum. The key output is read afterwards, untimed: ``trak eval recall CONFIG --json`` (MRR and
recall@k against the planted sources, BM25's beside them) for the two fact examples, and the share of
upper-case rows in ``select.out`` for the selection. ``--alternatives`` also runs, untimed, the other
recipes the headers compare with (:data:`ALTERNATIVES`), each on its own store.

    python -m benchmarks.bench_examples                       # every example, as shipped (~4 minutes on 2 cores)
    python -m benchmarks.bench_examples --alternatives
    python -m benchmarks.bench_examples --examples news_select --out /tmp/examples.json

Prints a table and writes JSON (``--out``, default ``bench_results/examples.json``) with the command
line, the load average before and after, every command with its seconds and exit code, and each
example's key output; machine paths are written relative (``<work>``, ``.``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import relative_paths, write_result  # noqa: E402  (atomic; adds date, commit, version, machine)
from benchmarks.launch import run_measured, trak_command  # noqa: E402  (wall time and the command's own peak RSS)

EXAMPLES = ("news_ekfac", "news_lora", "news_select")
DEFAULT_OUT = REPO / "bench_results" / "examples.json"
DEFAULT_WORK = REPO / "bench_results" / "examples_work"  # bench_results/ is ignored by git
DATA_COMMAND = ["-m", "examples.news_lm", "runs/news"]  # run with this interpreter, from the work folder

#: Recipes the headers compare with: example -> {name: overrides}, each on a store of its own.
ALTERNATIVES = {
    "news_ekfac": {"TRAK's kernel (gram), kronecker 1024": ["curvature.kind=gram", "projector.kind=kronecker"]},
    "news_lora": {"TRAK's recipe: sjlt 4096, second_moment adam, cosine": [
        "curvature.kind=gram", "projector.kind=sjlt", "second_moment=adam", "score.normalize=unit"]},
}

#: The children's environment: nothing downloaded, Python's default bytecode caching (as a user's shell has it).
CHILD_ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "HF_HUB_OFFLINE": "1",
             "PYTHONPATH": str(REPO)}


def config_path(name: str) -> Path:
    return REPO / "trakcli" / "configs" / f"{name}.yaml"


def header_commands(name: str) -> list[list[str]]:
    """The ``trak`` commands of the config's header, in order (the ``#   trak ...`` lines before "Wall time")."""
    out = []
    for line in config_path(name).read_text().splitlines():
        if not line.startswith("#"):
            break
        if "Wall time" in line:
            break
        text = line.lstrip("#").strip()
        if text.startswith("trak "):
            args = shlex.split(text.split("  #")[0].split(" #")[0])
            out.append([a if a != f"configs/{name}.yaml" else str(config_path(name)) for a in args[1:]])
    return out


def measured(cmd: list[str], work: Path) -> dict[str, Any]:
    """Run ``cmd`` from ``work`` in its own process: wall seconds, own peak RSS, exit code, stderr's last lines."""
    got = run_measured(cmd, cwd=work, env=CHILD_ENV)
    row = {"command": shlex.join(cmd), "seconds": round(got["seconds"], 2),
           "peak_rss_gib": round(got["peak_rss_gib"], 3), "exit": got["exit"]}
    if got["exit"] != 0:
        row["error"] = got["stderr"][-3000:]
    print(f"  {row['seconds']:7.1f} s  exit {row['exit']}  {row['command']}", file=sys.stderr)
    return row


def recall(name: str, work: Path, overrides: list[str] = ()) -> dict[str, Any]:
    """``trak eval recall --json`` of ``name``: MRR, recall@k and BM25's, with their 95% intervals."""
    got = run_measured([*trak_command(), "eval", "recall", str(config_path(name)), "--json", "-q", *overrides],
                       cwd=work, env=CHILD_ENV)
    if got["exit"] != 0:
        return {"error": got["stderr"][-3000:]}
    data = json.loads(got["stdout"])
    keep = {"mrr": data["mrr"], "recall": data["recall"], "n_query": data.get("n_query")}
    if "bm25" in data:
        keep["bm25"] = {"mrr": data["bm25"]["mrr"], "recall": data["bm25"]["recall"]}
    return keep


def selection(work: Path) -> dict[str, Any]:
    """The kept rows of ``news_select``: how many, how many upper case, and the pool's share."""
    pool = [json.loads(x) for x in (work / "runs" / "news" / "pool.jsonl").read_text().splitlines()]
    kept = [json.loads(x) for x in (work / "runs" / "news" / "selected.jsonl").read_text().splitlines()]
    return {"n_pool": len(pool), "pool_upper": sum(r["upper"] for r in pool), "n_selected": len(kept),
            "selected_upper": sum(r["upper"] for r in kept)}


def run_example(name: str, work: Path) -> dict[str, Any]:
    print(f"{name}:", file=sys.stderr)
    steps = []
    for args in header_commands(name):
        steps.append(measured([*trak_command(), *args], work))
        if steps[-1]["exit"] != 0:
            return {"commands": steps, "failed": steps[-1]["command"]}
    row: dict[str, Any] = {"commands": steps, "seconds": round(sum(s["seconds"] for s in steps), 2)}
    row["output"] = selection(work) if name == "news_select" else recall(name, work)
    return row


def run_alternative(name: str, i: int, overrides: list[str], work: Path) -> dict[str, Any]:
    store = f"store=runs/alternatives/{name}-{i}.zarr"
    steps = [measured([*trak_command(), cmd, str(config_path(name)), "-q", *overrides, store], work)
             for cmd in ("featurize", "score")]
    row: dict[str, Any] = {"overrides": overrides, "commands": steps}
    if all(s["exit"] == 0 for s in steps):
        row["output"] = recall(name, work, [*overrides, store])
    return row


def summary(name: str, row: dict[str, Any]) -> str:
    if "failed" in row:
        return f"failed: {row['failed']}"
    out = row["output"]
    if "error" in out:
        return "output unreadable"
    if name == "news_select":
        return (f"{out['selected_upper']} of {out['n_selected']} kept rows upper case "
                f"(pool: {out['pool_upper']} of {out['n_pool']})")
    r = out["recall"]
    bm25 = f"; BM25 MRR {out['bm25']['mrr']['value']:.3f}" if "bm25" in out else ""
    return (f"MRR {out['mrr']['value']:.3f}, recall@1 {r['1']['value']:.2f}, @5 {r['5']['value']:.2f}, "
            f"@10 {r['10']['value']:.2f}{bm25}")


def table(data_row: dict[str, Any], rows: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'example':<16} {'seconds':>8}  output", f"{'news_lm (data)':<16} {data_row['seconds']:8.1f}"]
    for name, row in rows.items():
        lines.append(f"{name:<16} {row.get('seconds', float('nan')):8.1f}  {summary(name, row)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", nargs="+", default=list(EXAMPLES), choices=EXAMPLES,
                   help=f"which to run, in this order (default all: {' '.join(EXAMPLES)})")
    p.add_argument("--alternatives", action="store_true", help="also run the recipes the headers compare with")
    p.add_argument("--work", type=Path, default=DEFAULT_WORK,
                   help="folder of runs/ (emptied first; default bench_results/examples_work)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result (default bench_results/examples.json)")
    a = p.parse_args(argv)
    work = a.work.resolve()
    shutil.rmtree(work / "runs", ignore_errors=True)
    (work / "runs").mkdir(parents=True)
    load_before = os.getloadavg()  # other jobs on the same cores slow every command
    print("data:", file=sys.stderr)
    data_row = measured([sys.executable, *DATA_COMMAND], work)
    if data_row["exit"] != 0:
        sys.exit(f"examples.news_lm failed:\n{data_row['error']}")
    rows = {name: run_example(name, work) for name in a.examples}
    alternatives = {}
    if a.alternatives:
        for name in a.examples:
            for i, (label, overrides) in enumerate(ALTERNATIVES.get(name, {}).items()):
                print(f"{name}, {label}:", file=sys.stderr)
                alternatives.setdefault(name, {})[label] = run_alternative(name, i, overrides, work)
    text = table(data_row, rows)
    print(text)
    for name, alts in alternatives.items():
        for label, row in alts.items():
            print(f"  {name}, {label}: {summary(name, row) if 'output' in row else 'failed'}")
    result = {
        "benchmark": "examples",
        "command": shlex.join(["python", "-m", "benchmarks.bench_examples", *(sys.argv[1:] if argv is None else argv)]),
        "protocol": __doc__.split("\n\n")[2].replace("\n", " "),
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "data": {"command": "python " + shlex.join(DATA_COMMAND), **data_row},
        "examples": rows,
        "alternatives": alternatives,
        "table": text,
    }
    roots = {str(work): "<work>", str(REPO): ".", str(Path(sys.executable).parent) + "/": ""}
    write_result(a.out, relative_paths(result, roots))
    print(f"wrote {a.out}", file=sys.stderr)
    if any("failed" in r for r in rows.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
