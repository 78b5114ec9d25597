"""The generated pages of the docs site: the config reference and the benchmarks page.

``docs/hooks.py`` calls :func:`config_reference` and :func:`benchmarks_page` while
``mkdocs build`` runs, so the pages always follow the pydantic schema
(``trakcli/config/schema.py``, ``trakcli/config/recipe.py``) and the committed
``bench_results/*.json``. Run directly to write both pages to a folder for a look:

    python docs/gen_docs.py OUT_DIR
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------- markdown helpers

_SPECIAL = re.compile(r"([\\*_\[\]|])")


def md_text(text: str) -> str:
    """``text`` as literal markdown in a table cell: code spans kept, ``* _ [ ] | \\`` escaped, ``< >`` as entities."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", " ".join(text.split())).replace("``", "`")  # reST roles
    parts = re.split(r"(`[^`]*`)", text)
    out = []
    for i, part in enumerate(parts):
        if i % 2:  # a code span: kept as it is (a table cell's pipes inside code do not split it)
            out.append(part)
        else:
            out.append(_SPECIAL.sub(r"\\\1", part).replace("<", "&lt;").replace(">", "&gt;"))
    return "".join(out)


def md_code(text: str) -> str:
    """``text`` as an inline code span in a table cell."""
    return f"`{text}`"


def table(header: list[str], rows: list[list[str]], align: list[str] | None = None) -> str:
    """A markdown table; ``align`` holds ``"l"`` or ``"r"`` per column."""
    align = align or ["l"] * len(header)
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- config reference


def type_name(annotation: Any) -> str:
    """A short readable name of a field's type (``int > 0``, ``"a" | "b"``, ``list[str] | None`` ...)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        base = type_name(args[0])
        for meta in args[1:]:
            gt = getattr(meta, "gt", None)
            ge = getattr(meta, "ge", None)
            if gt is not None:
                base += f" > {gt}"
            elif ge is not None:
                base += f" ≥ {ge}"
        return base
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is typing.Union or origin is types.UnionType:
        names = [type_name(a) for a in args if a is not type(None)]
        if type(None) in args:
            names.append("None")
        return " | ".join(names)
    if origin in (list, tuple, set):
        return f"list[{', '.join(type_name(a) for a in args)}]"
    if origin is dict:
        return "mapping"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return "path"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _field_type(field: Any) -> str:
    name = type_name(field.annotation)
    for meta in field.metadata:  # constraints given as Field(gt=..., ge=...)
        for attr, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            value = getattr(meta, attr, None)
            if value is not None:
                name += f" {sign} {value}"
    return name


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "**required**"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, Path):
        value = str(value)
    return md_code(json.dumps(value, ensure_ascii=False))


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic model classes a field's annotation holds (``X``, ``X | None``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models_in(a)]


def walk_fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, type[BaseModel], str, Any]]:
    """Every field of ``model`` and of the sections it holds, depth first: ``(dotted key, model, name, FieldInfo)``."""
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        yield key, model, name, field
        for sub in _models_in(field.annotation):
            yield from walk_fields(sub, key + ".")


def _doc_summary(model: type[BaseModel]) -> str:
    doc = (model.__doc__ or "").strip()
    return doc.split("\n\n")[0] if doc else ""


def config_reference() -> str:
    """The markdown page listing every config key: dotted key, type, default and description.

    Sections follow the schema (a model used at several keys, like the datasets, is one
    table whose rows name every key). Descriptions are the fields' ``description=``.
    """
    from trakcli.config.schema import Config

    # group rows by the model class that defines them, in order of first appearance
    sections: dict[type[BaseModel], dict[str, list[str]]] = {}
    where: dict[type[BaseModel], list[str]] = {Config: [""]}
    fields: dict[tuple[type[BaseModel], str], Any] = {}
    for key, model, name, field in walk_fields(Config):
        sections.setdefault(model, {}).setdefault(name, []).append(key)
        fields[(model, name)] = field
        for sub in _models_in(field.annotation):
            where.setdefault(sub, []).append(key)

    lines = [
        "# Config reference",
        "",
        "Every key of the YAML config, generated from the pydantic schema "
        "(`trakcli/config/schema.py`, `trakcli/config/recipe.py`) when the docs are built. "
        "Keys are dotted paths: `projector.proj_dim: 512` in YAML is `projector.proj_dim=512` "
        "as an override on the command line (see [Getting started](../getting-started.md#config-and-overrides)). "
        "Unknown keys are errors with a did-you-mean.",
        "",
        "`trak init digits run.yaml` writes a commented config to start from; "
        "`trak featurize run.yaml --print-config` prints the resolved config.",
        "",
    ]
    for model, names in sections.items():
        keys = [k for k in where.get(model, []) if k]
        title = "Top level" if model is Config else ", ".join(f"`{k}`" for k in keys)
        lines += [f"## {title}", ""]
        summary = _doc_summary(model)
        if summary:
            lines += [md_text(summary), ""]
        rows = []
        for name, paths in names.items():
            field = fields[(model, name)]
            description = field.description or ""
            subs = _models_in(field.annotation)
            if not description and subs:
                description = _doc_summary(subs[0])
            if subs:
                description += " Its keys are listed below." if description else "A section; its keys are below."
            rows.append([
                "<br>".join(md_code(p) for p in paths),
                md_code(_field_type(field)),
                _default(field),
                md_text(description),
            ])
        lines += [table(["key", "type", "default", "description"], rows), ""]
        if model.__name__ == "ProjectorConfig":
            lines += _projector_options()
    return "\n".join(lines)


def _projector_options() -> list[str]:
    """The options ``projector:`` takes besides its fields, per registered kind (validated by the projector)."""
    from trakcli.projectors.registry import COMMON_OPTIONS, kind_names, projector_kind

    kinds = [projector_kind(n) for n in kind_names()]
    from_model = [k.name for k in kinds if k.built_from_model is not None]
    every = "every kind" + (f" but {', '.join(from_model)}" if from_model else "")
    rows = [[md_code(f"projector.{k}"), every, md_text(v)] for k, v in COMMON_OPTIONS.items()]
    rows += [[md_code(f"projector.{k}"), kind.name, md_text(v)] for kind in kinds for k, v in kind.options.items()]
    return [
        "Besides these keys, `projector:` takes the options of its kind "
        "(see [Projectors](../guides/projectors.md)):",
        "",
        table(["key", "kinds", "meaning"], rows),
        "",
    ]


# --------------------------------------------------------------------------- benchmarks


def committed_results() -> list[Path]:
    """The ``bench_results/*.json`` files that are committed (the folder itself is ignored by git)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "bench_results"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: whatever JSON is there
        return sorted((REPO / "bench_results").glob("*.json"))
    return sorted(REPO / p for p in out if p.endswith(".json"))


def _f(x: float, digits: int = 2) -> str:
    return f"{x:,.{digits}f}"


def _machine(data: dict[str, Any], key: str, default: Any = "?") -> Any:
    """A machine fact of a result (``cpus``, ``torch``, ...): top level (benchmarks/benchjson.py), else ``machine``."""
    if key in data:
        return data[key]
    return data.get("machine", {}).get(key, default)


def _made(data: dict[str, Any]) -> str:
    """Where a result comes from: its date, commit and trakcli version (and, for a result that did not record
    them when it ran, that they come from the git log of its file)."""
    made = f"Recorded {data['date']}, commit {data['commit'][:8]}, trakcli {data['version']}"
    source = data.get("provenance_source")
    return made + (f" (from the {source})." if source else ".")


#: The commands of the committed results that do not record their own (their benchmarks' defaults otherwise).
COMMANDS = {
    "startup_cli.json": ("python -m benchmarks.bench_startup --part cli --cli-repeats 7 --bytecode-cache "
                         "--out bench_results/startup_cli.json"),
    "lm.json": "python -m benchmarks.bench_lm --threads 2",
}

#: A recorded command that runs a benchmark as a file of the folder ``scripts`` (``python scripts/NAME.py``):
#: shown as the command that runs that benchmark, ``python -m benchmarks.NAME``.
_SCRIPT_COMMAND = re.compile(r"^python scripts/(\w+)\.py\b")


def run_command(module: str, args: list[str] | tuple[str, ...] = ()) -> str:
    """The command that runs the benchmark ``module`` (``benchmarks.bench_topk``) with ``args``."""
    return " ".join(["python", "-m", module, *args])


def shown_command(command: str) -> str:
    """A result's recorded ``command`` as the page shows it: a benchmark named by its file under ``scripts/``
    becomes ``python -m benchmarks.NAME`` (the same benchmark); any other command is shown as recorded."""
    return _SCRIPT_COMMAND.sub(lambda m: run_command(f"benchmarks.{m.group(1)}"), command)


def _command(path: Path, data: dict[str, Any], module: str) -> str:
    if "command" in data:
        return shown_command(data["command"])
    if "argv" in data:
        return run_command(module, data["argv"])
    return COMMANDS.get(path.name, run_command(module))


def _lds_digits(data: dict[str, Any]) -> tuple[str, str, str]:
    results = data["results"]
    ours = [r for r in results if r["method"] != "traker"]
    theirs = {(r["model"], r["proj_dim"]): r for r in results if r["method"] == "traker"}
    rows = []
    for r in ours:
        model = data["models"][r["model"]]
        kw = model["kwargs"]
        t = theirs.get((r["model"], r["proj_dim"]), {})
        rows.append([
            f"{kw.get('depth', 2)}x{kw.get('hidden_dim', '?')}, {model['n_params']:,} params, "
            f"{model['n_checkpoints']} ckpts",
            str(r["proj_dim"]), _f(r["seconds"]),
            f"{_f(r['featurize_seconds'])} / {_f(r['score_seconds'])}",
            _f(r["score_compute_seconds"]), _f(r["lds"], 3),
            _f(t["seconds"]) if t else "", _f(t["lds"], 3) if t else "",
            f"{r['ratio_traker_over_trakcli']:.1f}x" if "ratio_traker_over_trakcli" in r else "",
        ])
    head = ["model", "proj_dim", "trakcli s", "featurize / score wall s", "score compute s", "LDS",
            "traker s", "traker LDS", "traker / trakcli"]
    env = data.get("env", {})
    note = (
        f"{data['n_train']} train / {data['n_target']} target digits, LDS over {data['n_subsets']} models "
        f"retrained on random halves. Protocol: {data['protocol']}. Start-up median subtracted: "
        f"{data['startup_median_seconds']:.2f} s. {_machine(data, 'cpus', env.get('cpu_count', '?'))} CPUs, torch "
        f"{_machine(data, 'torch', env.get('torch', '?'))}, "
        f"traker {env.get('traker', '?')}."
    )
    return "trakcli against MadryLab's traker on digits", note, table(head, rows, ["l"] + ["r"] * 8)


def _lm(data: dict[str, Any]) -> tuple[str, str, str]:
    rows = []
    for name, v in data["variants"].items():
        label = "plain forward + backward (floor)" if name == "floor" else f"`trak featurize`, kind {name}"
        rows.append([label, _f(v["seconds"], 1), f"{data['ratios_to_floor'][name]:.2f}",
                     _f(v["peak_rss_gib"]), f"{v['tokens']:,} / {v['padded_tokens']:,}", _f(v["tokens_per_s"], 1)])
    a = data["args"]
    note = (
        f"`{data['model']}` on {data['docs']['n_train']} BBC news articles (median {data['docs']['median_words']} "
        f"words), max_length {a['max_length']}, batch {a['batch_size']}, proj_dim {a['proj_dim']}, "
        f"{a['threads']} CPU threads."
    )
    head = ["variant", "seconds", "x floor", "peak RSS GiB", "tokens / padded", "tokens/s"]
    return "Kronecker features of a language model (SmolLM2-135M)", note, table(head, rows, ["l"] + ["r"] * 5)


def _startup(data: dict[str, Any]) -> tuple[str, str, str]:
    cli = data["cli"]
    rows = [[md_code(name), _f(v["wall_median_s"]), _f(v["wall_min_s"]), _f(v["cpu_median_s"])]
            for name, v in cli["commands"].items()]
    note = (f"Each command in {cli['repeats']} fresh processes, interleaved; load {cli['load_avg_1min']:.1f}; "
            f"a {cli['config']} with {', '.join(cli['overrides'])}.")
    head = ["command", "wall median s", "wall min s", "CPU median s"]
    return "Command start-up", note, table(head, rows, ["l", "r", "r", "r"])


def _store_dtype(data: dict[str, Any]) -> tuple[str, str, str]:
    rows = []
    for name, v in data["results"].items():
        rows.append([name, f"{v['recall@100_proponents']:.4f} ({v['recall@100_proponents_min']:.2f})",
                     f"{v['recall@100_opponents']:.4f} ({v['recall@100_opponents_min']:.2f})",
                     f"{v['spearman']:.4f}", f"{v['rel_error']:.4f}"])
    s = data["sizes"]
    note = (f"{s['n_train']:,} train × {s['n_target']:,} target features at proj_dim {s['proj_dim']} "
            f"({data['projector']['kind']}), top-{s['k']} against float32 storage; mean over targets "
            "(worst target in parentheses).")
    head = ["features", f"recall@{s['k']} proponents", f"recall@{s['k']} opponents", "Spearman",
            "relative error"]
    return "Half-precision features", note, table(head, rows, ["l", "r", "r", "r", "r"])


def _text_rss(data: dict[str, Any]) -> tuple[str, str, str]:
    rows = [[f"{r['n_docs']:,}", _f(r["corpus_mb"], 1), _f(r["seconds"], 1), _f(r["peak_rss_mb"], 0)]
            for r in data["rows"]]
    note = (f"Peak memory of `trak featurize` over text corpora of growing size; growth "
            f"{data['growth_mb']:.0f} MB for 10x the documents ({_machine(data, 'cpus')} CPUs).")
    head = ["documents", "corpus MB", "seconds", "peak RSS MB"]
    return "Memory of text featurization", note, table(head, rows, ["r"] * 4)


def _topk(data: dict[str, Any]) -> tuple[str, str, str]:
    two_stage = "recall_recorded" in json.dumps(data["results"])
    rows = []
    for r in data["results"]:
        floor = r["rows"]["floor"]["seconds"] if "floor" in r["rows"] else None  # --skip floor (10^7 rows)
        exact = r["rows"]["trak score top_k"]["seconds"]
        for name, v in r["rows"].items():
            ov, rec = v.get("overlap_with_floor"), v.get("recall_recorded")
            if v.get("reused_store"):
                name += " (store kept: checked only)"
            rows.append([f"{r['n_train']:,}", name, _f(v["seconds"], 1),
                         f"{v['seconds'] / floor:.2f}" if floor else "",
                         *([f"{v['seconds'] / exact:.2f}"] if two_stage else []),
                         _f(v["peak_rss_gib"]), _f(v["store_bytes"] / 1e6, 1) if "store_bytes" in v else "",
                         f"{ov[0]:.4f} / {ov[1]:.4f}" if ov else "",
                         *([f"{rec[0]:.4f} / {rec[1]:.4f}" if rec else ""] if two_stage else [])])
    first = data["results"][0]
    ref = "exact" if first.get("overlap_reference") == "trak score top_k" else "floor"
    note = (f"{first['n_target']:,} targets, proj_dim {first['proj_dim']}, top {first['k']}, one checkpoint; "
            "wall seconds include each process's start-up; the floor reads the stored features into RAM and runs "
            f"one torch matmul and `topk`; {_machine(data, 'cpus')} CPUs.")
    if ref == "exact":
        note += (" No floor: the features do not fit in memory; the overlaps are against `trak score top_k`, "
                 "the exact streamed pass.")
    head = ["n_train", "variant", "seconds", "x floor", "peak RSS GiB", "store MB", f"top-k = {ref} (pro / opp)"]
    align = ["r", "l", "r", "r", "r", "r", "r"]
    if not two_stage:
        return "Top-k at corpus scale", note, table(head, rows, align)
    note += (" Two-stage rows: `store.dtype` int8 or binary featurized through the real path, `trak score` with "
             "`score.rescore_multiplier` M (K' = M · 100 candidates); x exact is over `trak score top_k` (the exact "
             "streamed pass of the float32 store, same run); the recorded recall is the one the run measured itself "
             "on its sampled targets against the exact top-100 of the bfloat16 copy (over a sample of the rows "
             "past 10^6 rows); the top-k overlap counts the bfloat16 rounding of the float copy as well.")
    head = head[:4] + ["x exact"] + head[4:] + ["recorded recall (pro / opp)"]
    return "Two-stage top-k over compressed features", note, table(head, rows, align + ["r", "r"])


def _ridge_cells(group: list[dict[str, Any]], default_rel: float) -> list[str]:
    """LDS rows of one setting over ridges -> the LDS (interval) at the default ridge, the best, and its lambda_rel."""
    default = next((r for r in group if r["lambda_rel"] == default_rel), group[0])
    best = max(group, key=lambda r: r["lds"])
    cell = lambda r: f"{r['lds']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"  # noqa: E731
    return [cell(default), cell(best), f"{best['lambda_rel']:g}"]


def _lds_lm(data: dict[str, Any]) -> tuple[str, str, str]:
    default_rel = data["default_lambda_rel"]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in data["rows"]:
        groups.setdefault((r.get("normalize") or "", r["kind"], r["proj_dim"], r["n_checkpoints"]), []).append(r)
    rows = []
    for (norm, kind, d, k), group in sorted(groups.items()):
        at_default, best, ridge = _ridge_cells(group, default_rel)
        ridge = "0 (traker's)" if kind == "traker" else ridge  # traker: its own default, no ridge
        rows.append([kind + (f", {norm}" if norm else ""), str(d), str(k), at_default, best, ridge])
    c = data["corpus"]
    note = (
        f"A GPT-2 of {c['n_params']:,} parameters trained from scratch ({data['recipe']['epochs']} epochs) on "
        f"{c['n_train']:,} Shakespeare speeches (median {c['median_words']} words); {c['n_target']} held-out "
        f"speeches are the targets (f: the sum of their next-token margins). LDS over {data['n_subsets']} models "
        f"retrained on random halves, with 95% bootstrap intervals; the checkpoints are {data['n_models']} "
        f"independently trained models."
    )
    head = ["projector", "proj_dim", "checkpoints", f"LDS, lambda_rel {default_rel:g}", "best LDS of the ridges",
            "at lambda_rel"]
    body = table(head, rows, ["l"] + ["r"] * 5)
    if data.get("curvature"):
        best: dict[tuple, dict[str, float]] = {}
        for r in data["curvature"]:
            cell = best.setdefault((r["kind"], r["proj_dim"], r["n_checkpoints"]), {})
            cell[r["curvature"]] = max(cell.get(r["curvature"], -1.0), r["lds"])
        curv = [[kind, str(d), str(k), f"{v['output']:.3f}", f"{v['fisher']:.3f}"]
                for (kind, d, k), v in sorted(best.items())]
        body += "\n\nThe curvature, best LDS over the same ridges (float64, dual form): TRAK's kernel of the output " \
                "gradients ΦᵀΦ against the Fisher of the loss gradients Φᵀ diag(Q²) Φ.\n\n" + table(
                    ["projector", "proj_dim", "checkpoints", "TRAK kernel", "loss-gradient Fisher"], curv,
                    ["l", "r", "r", "r", "r"])
    if data.get("trajectory"):
        groups2: dict[tuple, list[dict[str, Any]]] = {}
        for r in data["trajectory"]:
            groups2.setdefault((r["features"], r["checkpoints"], r["n_checkpoints"]), []).append(r)
        traj = [[features, label, str(k), *_ridge_cells(group, default_rel)]
                for (features, label, k), group in groups2.items()]
        d = data["trajectory"][0]["proj_dim"]
        body += (f"\n\nCheckpoints along training (`optimize.epoch_checkpoints`), sjlt {d}: TRAK's features, and "
                 "Adam-corrected ones (`second_moment: adam`, each checkpoint's saved AdamW state). Run r's epoch e "
                 "is a checkpoint; its last epoch is its final checkpoint.\n\n") + table(
                     ["features", "checkpoints", "n", f"LDS, lambda_rel {default_rel:g}", "best LDS of the ridges",
                      "at lambda_rel"], traj, ["l", "l", "r", "r", "r", "r"])
    title = "LDS of a language model trained from scratch"
    return title + (", checkpoints along training" if data.get("trajectory") else ""), note, body


def _optimize_lm(data: dict[str, Any]) -> tuple[str, str, str]:
    methods = data["methods"]
    ref = methods.get("adamw")
    rows = []
    for name, r in methods.items():
        rows.append([
            name, f"{r['lr']:g}" if "lr" in r else "", f"{r['val_loss']:.4f}",
            f"{100 * (r['val_loss'] / ref['val_loss'] - 1):+.2f}%" if ref else "",
            _f(r["state_bytes"] / 2**20, 1), f"{100 * r['state_floats'] / ref['state_floats']:.1f}%" if ref else "",
            _f(r["step_seconds_median"]),
            f"{r['step_seconds_median'] / ref['step_seconds_median']:.2f}x" if ref else "",
        ])
    s = data["settings"]
    note = (
        f"`{data['model']}` finetuned on BBC news articles for {s['steps']} steps of {s['batch_size']} x "
        f"{s['seq_len']} tokens (warmup, cosine decay); validation loss on {s['n_val']} held-out articles; both "
        f"low-rank methods at rank {s['rank']}, a new projection every {s['update_gap']} steps; "
        f"{_machine(data, 'cpus')} CPUs."
    )
    head = ["optimizer", "lr", "validation loss", "vs AdamW", "state MiB", "state vs AdamW", "s/step", "vs AdamW"]
    body = table(head, rows, ["l"] + ["r"] * 7)
    if data.get("lr_sweep"):
        lrs = sorted({r["lr"] for r in data["lr_sweep"]})
        loss = {(r["method"], r["lr"]): r["val_loss"] for r in data["lr_sweep"]}
        grid = [[m] + [f"{loss[m, lr]:.4f}" if (m, lr) in loss else "" for lr in lrs] for m in methods]
        note += " Each method at its best learning rate of the sweep below (final validation loss per rate)."
        body += "\n\n" + table(["optimizer"] + [f"lr {lr:g}" for lr in lrs], grid, ["l"] + ["r"] * len(lrs))
    return "Finetuning a language model in a projected subspace", note, body


def _recall(data: dict[str, Any]) -> tuple[str, str, str]:
    ks = ["1", "5", "10", "50"]
    rows = []
    for name, r in data["variants"].items():
        m = r["mrr"]
        rows.append([name, " ".join(f"`{o}`" for o in r["overrides"]) or "(the config)",
                     f"{m['value']:.3f} [{m['ci_low']:.3f}, {m['ci_high']:.3f}]",
                     *[f"{r['recall'][k]['value']:.3f}" for k in ks]])
    c = data["corpus"]
    what, model = _RECALL_SETUPS[data["setup"]]
    note = (f"`{data['config']}`: {c['n_facts']} invented facts planted one each into {c['n_train']:,} BBC news "
            f"articles of ~{c['words']} words, {model} {c['epochs']} epochs on them; each query's top 100 "
            "documents against the article that holds its fact, 95% bootstrap intervals over queries.")
    if data.get("paraphrase"):
        note += (" Paraphrased (`plant_facts.py --paraphrase`): each fact in other words than the query, and ten "
                 "distractor articles per fact naming its country and city.")
    bm25 = next((r["baselines"]["bm25"] for r in data["variants"].values() if r.get("baselines", {}).get("bm25")), None)
    if bm25:
        m = bm25["mrr"]
        rows.append(["BM25 (bm25s, word overlap)", "-", f"{m['value']:.3f} [{m['ci_low']:.3f}, {m['ci_high']:.3f}]",
                     *[f"{bm25['recall'][k]['value']:.3f}" if k in bm25["recall"] else "-" for k in ks]])
    head = ["variant", "overrides", "MRR", *[f"recall@{k}" for k in ks]]
    return f"Fact tracing on planted facts: {what}", note, table(head, rows, ["l", "l"] + ["r"] * 5)


def _lds_finetune(data: dict[str, Any]) -> tuple[str, str, str]:
    def cell(e: dict[str, Any]) -> str:
        return f"{e['lds']:.3f} [{e['ci_low']:.3f}, {e['ci_high']:.3f}]"

    rows = [[r["method"], str(r.get("checkpoints") or "-"), cell(r["lds"]["loss"]), cell(r["lds"]["margin"]),
             f"{r.get('wall_s', 0.0):,.1f}"] for r in data["rows"]]
    p = data["protocol"]
    pre = ("Shakespeare and other BBC news articles" if p.get("shape") == "deep" else "Shakespeare")
    note = (f"A GPT-2 of {p['model']['n_layer']} layers, width {p['model']['n_embd']}, vocabulary "
            f"{p['model']['vocab_size']:,}, pretrained on {pre} and "
            f"fine-tuned on {p['n_train']:,} BBC articles of {p['max_length']} tokens; ground truth: "
            f"{p['n_retrain']} fine-tunes from the same pretrained weights on random halves. LDS over "
            f"{p['n_target']} held-out targets with 95% bootstrap intervals, on each target's loss and margin; every "
            "method scores the one fine-tuned checkpoint. Rows are cached and computed as they are added; each "
            "records its commit in the JSON.")
    head = ["method", "checkpoints", "LDS loss", "LDS margin", "wall s"]
    return "LDS of a fine-tuned language model: curvature, kronfluence, BM25", note, table(head, rows, ["l"] + ["r"] * 4)


def _ekfac_lm(data: dict[str, Any]) -> tuple[str, str, str]:
    rows_in = data["variants"]
    base = rows_in.get("trak-kronecker")
    rows = []
    for v, r in rows_in.items():
        if "failed" in r:
            rows.append([v, "failed", "", "", "", "", ""])
            continue
        feat = r["floor"]["seconds"] if v == "floor" else r["featurize"]["seconds"]
        score = "-" if v == "floor" else _f(r["score"]["seconds"], 1)
        ratio_t = f"{r['total_seconds'] / base['total_seconds']:.2f}" if base and "failed" not in base else "-"
        ratio_m = f"{r['peak_rss_gib'] / base['peak_rss_gib']:.2f}" if base and "failed" not in base else "-"
        rows.append([v, _f(feat, 1), score, _f(r["total_seconds"], 1), ratio_t, f"{r['peak_rss_gib']:.2f}", ratio_m])
    a = data["args"]
    load = data.get("load_average", {})
    note = (f"SmolLM2-135M-Instruct, {a['n_docs']} BBC articles and {a['n_queries']} queries of {a['max_length']} "
            f"tokens, top-{a['top_k']}, {a['threads']} CPU threads: `trak featurize` then `trak score` as two "
            "processes per variant, wall seconds and peak RSS of each; trak-kronecker is TRAK's Kronecker recipe on "
            "the blocks' linears, ekfac-exact `curvature: {kind: ekfac}` alone, ekfac-stored the same with "
            f"`curvature.exact: false`. Load average before and after: {load.get('before')} / {load.get('after')}.")
    head = ["variant", "featurize s", "score s", "total s", "x TRAK", "peak GiB", "x TRAK"]
    return "EK-FAC on a real language model against TRAK's Kronecker recipe", note, table(head, rows, ["l"] + ["r"] * 6)



def _examples(data: dict[str, Any]) -> tuple[str, str, str]:
    def output(name: str, r: dict[str, Any]) -> str:
        out = r.get("output", {})
        if "failed" in r or not out or "error" in out:
            return "failed"
        if "selected_upper" in out:
            return (f"{out['selected_upper']} of {out['n_selected']} kept rows upper case (pool: "
                    f"{out['pool_upper']} of {out['n_pool']})")
        rc = out["recall"]
        bm25 = f"; BM25 MRR {out['bm25']['mrr']['value']:.3f}" if "bm25" in out else ""
        return (f"MRR {out['mrr']['value']:.3f}, recall@1 {rc['1']['value']:.2f}, recall@5 {rc['5']['value']:.2f}"
                f"{bm25}")

    d = data["data"]
    rows = [["`python -m examples.news_lm runs/news` (data, base model)", "", _f(d["seconds"], 1), ""]]
    for name, r in data["examples"].items():
        cmds = ", ".join(md_code(" ".join(c["command"].split()[:2])) for c in r["commands"])
        rows.append([f"`configs/{name}.yaml`", cmds, _f(r["seconds"], 1) if "seconds" in r else "failed",
                     output(name, r)])
    for name, alts in data.get("alternatives", {}).items():
        for label, r in alts.items():
            rows.append([f"`{name}`, {label} (untimed)", "", "", output(name, r)])
    load = data.get("load_average", {})
    note = (f"Each example's header commands as its own processes from a new folder, wall seconds summed; its "
            f"output read afterwards. {_machine(data, 'cpus')} CPUs; load average before and after: "
            f"{load.get('before')} / {load.get('after')}.")
    head = ["example", "commands", "seconds", "what it finds"]
    return "The runnable examples, as shipped", note, table(head, rows, ["l", "l", "r", "l"])

def _per_token(data: dict[str, Any]) -> tuple[str, str, str]:
    sec = data["seconds"]
    doc = sec["document"]
    rows = [[label, _f(sec[key], 1), f"{sec[key] / doc:.2f}"] for label, key in (
        ("document-level `trak score`", "document"), ("`trak score` with `score.per_token`", "per_token"),
        ("per-token part (difference)", "per_token_part"), ("floor: forward + backward of the top documents",
                                                            "floor_fwd_bwd"))]
    m = data["machine"]
    note = (f"SmolLM2-135M-Instruct (`{data['config']}`), the top {data['top_k']} proponents and opponents of each "
            f"query ({data['top_documents']} top documents), {m['threads']} CPU threads.")
    return "Per-token scores on a language model", note, table(["run", "seconds", "/ document-level"], rows,
                                                              ["l", "r", "r"])


def _qld_tokens(data: dict[str, Any]) -> tuple[str, str, str]:
    def cell(v: dict[str, Any]) -> str:
        return f"{v['mean']:.4f} [{v['low']:.4f}, {v['high']:.4f}]"

    rows = [[name, cell(r["qld_top"]), cell(r["qld_random"]), cell(r["qld_top_minus_random"]),
             cell(r["baselines"]["token_overlap"]) if "token_overlap" in r.get("baselines", {}) else "",
             _f(r["seconds"], 0)] for name, r in data["rows"].items()]
    first = next(iter(data["rows"].values()))
    note = (f"The fine-tuned GPT-2 of the LDS benchmark above; {data['queries']} queries, the top "
            f"{data['fraction']:.0%} training tokens ({first['n_dropped']}) by each method's per-token scores masked "
            "out of the loss while retraining, against as many random tokens, same seed; mean loss increase of the "
            f"query with 95% bootstrap intervals.")
    head = ["method", "top tokens left out", "random tokens left out", "top - random",
            "the query's own tokens left out (lexical)", "wall s"]
    return "Per-token QLD of a fine-tuned language model", note, table(head, rows, ["l"] + ["r"] * 5)


def _callback(data: dict[str, Any]) -> tuple[str, str, str]:
    med, cpu, s = data["median_seconds"], data["median_cpu_seconds"], data["setup"]
    rows = [["Trainer", _f(med["plain"]), _f(cpu["plain"]), ""],
            ["Trainer + TrakCallback, a save per epoch", _f(med["callback"]), _f(cpu["callback"]),
             f"{data['overhead']:+.1%} (median of the repeats {data['overhead_paired_median']:+.1%})"],
            ["inside the callback's events", _f(data["callback_seconds_median"]), "",
             f"{data['overhead_inside']:.1%}"]]
    m = data["machine"]
    note = (f"A GPT-2 of {s['n_params'] / 1e6:.2f}M parameters ({s['layers']} layers, width {s['width']}), "
            f"{s['epochs']} epochs of {s['steps_per_epoch']} steps (batch {s['batch_size']} x {s['seq_len']} tokens), "
            f"median of {s['repeats']}; one save (checkpoint, AdamW state, manifest) {data['seconds_per_save']:.3f} s "
            f"and {data['bytes_per_save'] / 2**20:.1f} MiB, a step {data['seconds_per_step']:.3f} s. {m['device']}, "
            f"{m['threads']} thread(s), load average {data['load_average_1min']['before']:.1f}.")
    return ("The cost of TrakCallback in transformers' Trainer", note,
            table(["run", "wall s", "CPU s", "overhead"], rows, ["l", "r", "r", "r"]))


def _select(data: dict[str, Any]) -> tuple[str, str, str]:
    def cell(e: dict[str, Any]) -> str:
        return f"{e['mean']:.4f} [{e['low']:.4f}, {e['high']:.4f}]"

    fmt = data.get("task") == "format"
    share = "upper_share" if fmt else "category_share"
    rows = [[r["name"], f"{r['n_rows']:,}", f"{r[share]:.0%}", cell(r["loss"]),
             _f(r["select_s"], 0) if "select_s" in r else ""] for r in data["rows"]]
    p = data["protocol"]
    if fmt:
        task = (f"the target format UPPER CASE ({p['n_upper']:,} rows of the pool, {p['upper_fraction']:.0%}, drawn "
                f"from every category and the speeches, are upper case) from {p['n_examples']} upper-case articles; "
                f"mean next-token loss of {p['n_heldout']} held-out upper-case articles")
    else:
        task = (f"the target task `{p['category']}` from {p['n_examples']} examples; mean next-token "
                f"loss of {p['n_heldout']} held-out `{p['category']}` articles")
    lm = p.get("model")
    if lm:
        lora = p["lora"]
        who = (f"SmolLM2-135M-Instruct (`{lm}`) with fresh LoRA adapters (rank {lora['r']}, alpha "
               f"{lora['alpha']:g}, {', '.join(lora['target_modules'])}) fine-tuned")
    else:
        who = "The pretrained GPT-2 of the LDS benchmark fine-tuned"
    note = (f"{who} on {p['fraction']:.0%} of a pool of {p['n_pool']:,} "
            f"rows (BBC articles of 5 categories and Shakespeare speeches, {p['max_length']} tokens each), chosen "
            f"by each method for {task} after {p['finetune']['epochs']} epochs (lr {p['finetune']['lr']:g}, batches "
            f"of {p['finetune']['batch_size']}), mean over {p['seeds']} seeds with 95% intervals (before "
            f"fine-tuning: {data['heldout_loss_pretrained']:.4f}).")
    head = ["selection", "rows", "upper case" if fmt else f"of `{p['category']}`", "held-out loss (lower is better)",
            "select s"]
    title = ("Data selection for a target format (trak select)" if fmt
             else "Data selection for a target task (trak select)")
    if lm:
        title += ", SmolLM2-135M with LoRA"
    return title, note, table(head, rows, ["l"] + ["r"] * 4)


def _append(data: dict[str, Any]) -> tuple[str, str, str]:
    sec, st = data["seconds"], data["setup"]
    rows = []
    for name, once, app in (("featurize (features + kernels)", "once_featurize", "append_featurize"),
                            ("score (full matrix; the append rescores)", "once_score", "append_rescore")):
        rows.append([name, _f(sec[once]), _f(sec[app]), f"{sec[app] / sec[once]:.3f}"])
    total_once, total_app = sec["once_featurize"] + sec["once_score"], sec["append_featurize"] + sec["append_rescore"]
    rows.append(["both", _f(total_once), _f(total_app), f"{total_app / total_once:.3f}"])
    m = data["machine"]
    note = (f"{st['n_old']:,} train rows featurized, then {st['n_appended']:,} more ({st['fraction']:.0%}) appended "
            f"as a second file, against featurizing all {st['n_old'] + st['n_appended']:,} rows into a new store "
            f"({st['model']}, {st['models']} checkpoint(s), {st['projector']} proj_dim {st['proj_dim']}, chunk_rows "
            f"{st['chunk_rows']}, {st['targets']} targets; best of {st['repeats']}). The append featurized "
            f"{data['append_chunks_computed']} chunk(s) and rewrote {data['old_full_chunk_files_rewritten']} chunk "
            f"file(s) of the old full chunks; the largest score difference is {data['max_rel_score_difference']:.1e} "
            f"of the largest score. {_machine(data, 'cpus')} CPUs, {m['threads']} thread(s).")
    return ("Appending 10% more rows to a store", note,
            table(["step", "at once s", "append s", "ratio"], rows, ["l", "r", "r", "r"]))


def _object_store(data: dict[str, Any]) -> tuple[str, str, str]:
    rows = [[name, _f(r["featurize_s"], 1), _f(r["top_k_s"], 1),
             _f(max(r["featurize_peak_rss_gib"], r["top_k_peak_rss_gib"]))] for name, r in data["rows"].items()]
    ratio = data["s3_over_local"]
    rows.append(["S3 / local disk", f"{ratio['featurize_s']:.2f}x", f"{ratio['top_k_s']:.2f}x", ""])
    a = data["args"]
    note = (f"The project of `bench_topk.py` ({a['n_train']:,} train rows, {a['n_target']:,} targets, proj_dim "
            f"{a['proj_dim']}, top {a['top_k']}) featurized and scored with the store on local disk and on S3 "
            f"({a['service']}), each command in its own process, `trak score` best of {a['repeats']}; the top-k of "
            f"both stores {'are equal' if data['top_k_equal'] else 'DIFFER'}. {_machine(data, 'cpus')} CPUs, load average "
            f"{data.get('load_average_1min', float('nan')):.1f}.")
    return ("The store on S3 against local disk", note,
            table(["store", "featurize s", "trak score top-k s", "peak GiB"], rows, ["l", "r", "r", "r"]))


def _sketch_probe(data: dict[str, Any]) -> tuple[str, str, str]:
    res = data["result"]
    rows = [[r["sketch"], str(r["r"]), f"{r['k_prime']:,}", f"{r['recall'][0]:.3f} / {r['recall'][1]:.3f}"]
            for r in res["rows"]]
    energy = ", ".join(f"r = {k}: {v:.0%}" for k, v in res["pca_energy"].items())
    note = (f"Recall@{res['k']} (proponents / opponents) of the exact TRAK top-{res['k']} among the top K' of "
            f"int8 codes of r-dimensional sketches of the train features ({res['n_train']:,} rows, "
            f"{res['n_target']:,} targets, proj_dim {res['proj_dim']}): a fixed random rotation, or the top "
            f"eigenvectors of the train features (share of their energy: {energy}). A low-dimensional sketch does "
            f"not find the candidates, which is why the two-stage top-k takes its candidates from full-width codes.")
    return ("Low-dimensional sketches as top-k candidates (a negative result)", note,
            table(["sketch", "r", "K'", "recall@100"], rows, ["l", "r", "r", "r"]))


def _curvature_sketch_probe(data: dict[str, Any]) -> tuple[str, str, str]:
    def cell(r: dict[str, Any]) -> str:
        return f"{r['lds']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"

    rows = [[str(r["damping"]), r["sketch"], f"{r['r']:,}", cell(r),
             f"{r['variance_share']:.1%}" if "variance_share" in r else ""] for r in data["rows"]]
    sketches = " and ".join(sorted({r["sketch"] for r in data["rows"]} - {"exact"}))
    note = (f"LDS on the targets' loss of EK-FAC influences on the fine-tuned GPT-2 of `bench_lds_finetune` "
            f"({data['n_train']:,} train documents, {data['n_target']} targets, {data['n_retrain']} retrains, 95% "
            f"bootstrap intervals), scored exactly and from {sketches} "
            f"sketches of the whitened layer gradients (damping relative to each layer's mean eigenvalue). The "
            f"probe's exact scores correlate {data['check']['pearson_with_stored_exact']:.3f} with `trak score`'s. "
            "The whitened gradients spread over most of their coordinates, so no sketch a few thousand wide keeps "
            "the exact ranking: exact scores (or a two-stage top-k) are the way to EK-FAC's quality.")
    return ("How much of EK-FAC a sketch keeps (a negative result)", note,
            table(["damping", "sketch", "r", "LDS", "share of the whitened variance"], rows,
                  ["r", "l", "r", "r", "r"]))


def _gpu_measured(sec: dict[str, Any]) -> str:
    """`` (GPU, date, commit)`` of a section or variant kept from an earlier run (``measured``), else ``""``."""
    m = sec.get("measured")
    if not m:
        return ""
    gpu = (m.get("gpu") or "?").replace("NVIDIA ", "")
    return f" ({gpu}, {str(m.get('date') or '?')[:10]}, commit {str(m.get('commit') or '?')[:8]})"


def _gpu_failed(what: str, r: dict[str, Any]) -> list[str]:
    """A table row for a section or variant that failed or timed out."""
    return [what, f"failed: {md_text(str(r.get('error', '?')).splitlines()[-1][:80])}", "", ""]


#: The steps of `trak featurize` / `trak score` that bench_gpu's curvature section times (its ``steps`` keys).
_GPU_STEPS = (("featurize", "load_and_trial", "checkpoint loaded (with a curvature: its trial on the first batch)"),
              ("featurize", "fit", "curvature fit (covariance and eigenvalue passes, eigendecompositions)"),
              ("featurize", "first_batch", "first batch"), ("featurize", "features", "train features"),
              ("featurize", "kernels", "kernel"), ("featurize", "other", "data, model, hashing, store"),
              ("score", "load_and_trial", "checkpoint loaded"),
              ("score", "queries", "queries (features; exact: preconditioned layer gradients)"),
              ("score", "exact_pass", "exact pass over the train rows"), ("score", "other", "data, model, store"))


def _gpu_curvature(cv: dict[str, Any], rows: list[list[str]]) -> tuple[str, list[str]]:
    """The curvature section's rows of the main table (appended to ``rows``), its table of steps, its notes."""
    notes: list[str] = []
    fl = cv.get("curv_floor", {})
    floor = (f"{fl['seconds']:.1f} s (forward + backward, docs and queries)" if "seconds" in fl else "")
    for v, name in (("curv_trak", "TRAK kronecker recipe"), ("curv_ekfac", "`curvature: {kind: ekfac}`, exact")):
        r = cv.get(v)
        if r is None:
            continue
        if "seconds" not in r:
            rows.append(_gpu_failed(f"{name}: featurize + score", r))
            continue
        rows.append([f"{name}: featurize + score, {r['docs']:,} docs, {r['targets']} queries{_gpu_measured(r)}",
                     f"{r['seconds']:.1f} s ({r['featurize']['seconds']:.1f} + {r['score']['seconds']:.1f}), "
                     f"{r['peak_gpu_gib'] or 0:.1f} GiB", floor,
                     f"{r['x_floor']:.1f}x" if "x_floor" in r else ""])
    e, t = cv.get("curv_ekfac", {}), cv.get("curv_trak", {})
    steps = ""
    if "seconds" in e and "seconds" in t:
        srows = []
        for job, key, what in _GPU_STEPS:
            a, b = t[job]["steps"].get(key), e[job]["steps"].get(key)
            if a is None and b is None:
                continue
            srows.append([f"{job}: {what}", "" if a is None else f"{a:.1f}", "" if b is None else f"{b:.1f}"])
        for job in ("featurize", "score"):
            srows.append([f"**{job}** (peak GPU GiB)", f"**{t[job]['seconds']:.1f}** ({t[job]['peak_gpu_gib'] or 0:.1f})",
                          f"**{e[job]['seconds']:.1f}** ({e[job]['peak_gpu_gib'] or 0:.1f})"])
        steps = table(["step (seconds)", "TRAK kronecker", "EK-FAC exact"], srows, ["l", "r", "r"])
        ratio = cv.get("ekfac_over_trak", {})
        notes.append(f"EK-FAC against TRAK: {ratio.get('seconds', float('nan')):.2f}x the seconds "
                     f"(featurize {ratio.get('featurize_seconds', float('nan')):.2f}x, score "
                     f"{ratio.get('score_seconds', float('nan')):.2f}x), {ratio.get('peak_gpu', float('nan')):.2f}x "
                     "the peak GPU memory.")
        info = [ev["info"] for ev in e["score"].get("events", []) if "info" in ev and "exact" in ev["info"]]
        if info:
            notes.append(f"`trak score` said: \"{md_text(info[0])}\".")
    m = cv.get("curv_match")
    if m is not None and "max_rel_diff" in m:
        notes.append(f"Exact EK-FAC scores of {m['docs']} documents and {m['queries']} queries on the GPU against the "
                     f"CPU (the same config, the linear layers of blocks {', '.join(map(str, m['blocks']))}): largest "
                     f"difference {m['max_rel_diff']:.1e} of the largest score, Spearman per query at least "
                     f"{m['min_spearman']:.4f}, top-{m['top_k']} overlap at least {m['min_top_k_overlap']:.2f}, "
                     f"top-1 equal for {m['top1_equal']:.0%} of the queries.")
    elif m is not None:
        notes.append(f"The GPU-against-CPU check of the exact EK-FAC scores failed: "
                     f"{md_text(str(m.get('error', '?')))}.")
    return steps, notes


def _gpu_replay(rp: dict[str, Any], rows: list[list[str]]) -> list[str]:
    """The replay section's row of the main table (appended to ``rows``) and its notes."""
    if "score_run_b" not in rp and "score_run_a" not in rp:
        rows.append(_gpu_failed("unrolled scores (`score.method: unroll`)", rp))
        return []
    run = "run_b" if "score_run_b" in rp else "run_a"  # the second run: CUDA and the data already warm
    sc, tr = rp[f"score_{run}"], rp[f"train_{run}"]
    cfg = rp.get("config", {}).get("optimize", {})
    rows.append([f"unrolled scores (`score.method: unroll`), digits MLP, {sc['targets']} targets, "
                 f"{cfg.get('epochs', '?')} epochs of {cfg.get('optimizer', '?')}{_gpu_measured(rp)}",
                 f"{sc['seconds_per_target'] * 1e3:,.0f} ms a target ({sc['seconds']:.1f} s)",
                 f"{tr['seconds']:.1f} s (one training, `trak optimize`)",
                 f"{sc['per_target_x_training']:.2f}x a target"])

    def said(flag: str) -> str:
        return "bit for bit" if rp.get(flag) else "NOT bit for bit"

    return [f"Unrolled attribution on the GPU: two `trak optimize` runs with `optimize.replay` end on the same weights "
            f"{said('trainings_bit_identical')}; the record replayed from its first state gives the checkpoint "
            f"{said('replay_bit_identical')}, from step {rp.get('replay_from_step')} "
            f"{said('replay_from_step_bit_identical')}; the unrolled scores of the two runs are equal "
            f"{said('scores_bit_identical')} (largest difference {rp.get('scores_max_rel_diff', float('nan')):.1e}); "
            f"{rp.get('record', {}).get('total_steps', '?')} steps, {sc['targets']} targets scored "
            f"{rp.get('config', {}).get('data', {}).get('batch_size', '?')} per replay."]


def _gpu(data: dict[str, Any]) -> tuple[str, str, str]:
    sec, gpu = data["sections"], data.get("gpu", {})
    rows: list[list[str]] = []
    notes: list[str] = []
    proj = sec.get("projector", {})
    for r in proj.get("speed", []):
        rows.append([f"project, {r['kind']}, grad_dim {r['grad_dim']:.0e}, proj_dim {r['proj_dim']}, batch {r['batch']}"
                     f"{_gpu_measured(proj)}",
                     f"{r['cuda_examples_per_s']:,.0f} ex/s", f"{r['floor_examples_per_s']:,.0f} ex/s (GEMM)",
                     f"{r['x_floor']:.1f}x"])
    feat = sec.get("featurize", {})
    fl, kr = feat.get("floor", {}), feat.get("kronecker", {})
    if "seconds" in fl and kr:
        kr_s = (f"> {kr['seconds_at_least']:.0f} s (timed out)" if "seconds_at_least" in kr else
                f"{kr['seconds']:.1f} s, {kr.get('peak_gpu_gib') or 0:.1f} GiB")
        kr_x = f"> {kr['x_floor_at_least']:.1f}x" if "x_floor_at_least" in kr else (
            f"{kr['x_floor']:.2f}x" if "x_floor" in kr else "")
        rows.append([f"kronecker featurize, {fl['docs']:,} docs, proj_dim {data['args']['proj_dim']}{_gpu_measured(kr)}",
                     kr_s, f"{fl['seconds']:.1f} s (forward + backward), {fl.get('peak_gpu_gib') or 0:.1f} GiB", kr_x])
    elif "error" in feat:
        rows.append(_gpu_failed("kronecker featurize", feat))
    steps = ""
    if "curvature" in sec:
        cv = sec["curvature"]
        if "error" in cv and not any(k.startswith("curv_") for k in cv):
            rows.append(_gpu_failed("curvature (EK-FAC against TRAK)", cv))
        else:
            steps, more = _gpu_curvature(cv, rows)
            notes += more
    if "replay" in sec:
        notes += _gpu_replay(sec["replay"], rows)
    tk = sec.get("topk", {})
    g = tk.get("gpu_floor")
    if g:
        rows.append([f"top-{g['k']} of {g['n_target']:,} targets over {g['n_train']:,} rows{_gpu_measured(tk)}",
                     "(CPU: below)", f"{g['seconds']:.2f} s (GEMM + topk, bfloat16 in GPU memory)", ""])
    res = tk.get("bench_topk_cpu", {}).get("result", {}).get("results", [{}])[0].get("rows", {})
    if res:
        rows.append([f"trak score top-k, {tk['bench_topk_cpu']['result']['args']['n_train'][0]:,} rows, "
                     f"{tk.get('measured', {}).get('cpus') or data['cpus']} CPU cores{_gpu_measured(tk)}",
                     f"{res['trak score top_k']['seconds']:.1f} s",
                     f"{res['floor']['seconds']:.1f} s (CPU floor process)",
                     f"{res['trak score top_k']['seconds'] / res['floor']['seconds']:.2f}x"])
    m = [r for r in proj.get("match", []) if "matrix_bit_identical" in r]
    if m:
        match = "; ".join(f"{r['kind']}: matrix {'bit-identical' if r['matrix_bit_identical'] else 'max diff %.1e' % r['matrix_max_abs_diff']}"
                          for r in m)
        feats = max(r["features_max_rel_diff"] for r in proj["match"])
        notes.insert(0, f"The CUDA projector against its CPU reference: {match}; features within {feats:.1e} "
                        "(relative).")
    fm = feat.get("match", {})
    if "max_rel_diff" in fm:
        notes.append(f"Kronecker features of the first {fm['docs']} documents on the GPU against the CPU"
                     f"{_gpu_measured(fm)}: largest difference {fm['max_rel_diff']:.1e} of the largest entry, "
                     f"smallest row cosine {fm['min_row_cosine']:.7f}.")
    prof = sec.get("featurize_profile", {})
    if prof.get("reading"):
        notes.append(f"{prof['reading']}{_gpu_measured(prof)} (cProfile: {prof.get('forward_and_backward_passes', '?')} "
                     "passes for 64 documents); `data.grad_memory_mb` unset takes a quarter of the GPU's memory.")
    kept = any(isinstance(v, dict) and ("measured" in v or any(isinstance(x, dict) and "measured" in x
                                                               for x in v.values())) for v in sec.values())
    machine = (f"{gpu.get('name', 'no GPU')} ({gpu.get('memory_gib', 0):.0f} GiB), {data['cpus']} CPU cores, torch "
               f"{data['torch']}, triton {data.get('triton', '?')}. The LM is a LlamaForCausalLM with SmolLM2-135M's "
               "config and seeded random weights, float32, on BBC prompt/completion documents"
               + ("; a row marked with a GPU and date was measured by an earlier run of the benchmark (`--keep`)."
                  if kept else "."))
    note = " ".join([machine] + notes)
    body = table(["what", "trakcli", "floor", "x floor"], rows, ["l", "r", "r", "r"])
    if steps:
        body += "\n\nThe steps of `trak featurize` and `trak score` in the curvature rows (seconds):\n\n" + steps
    return ("trakcli on a GPU", note, body)


#: benchmarks/bench_recall.py's setups: (the title's subject, the model and how it was trained).
_RECALL_SETUPS = {
    "smollm2": ("a finetuned pretrained LM", "SmolLM2-135M-Instruct finetuned"),
    "tiny": ("a tiny LM trained from scratch", "a tiny GPT-2 (0.72M parameters) trained from scratch"),
}


#: How each benchmark's JSON becomes a table: the key that identifies it, the benchmark module that writes it
#: (its "Made by" command: ``python -m MODULE``), its renderer.
RENDERERS: list[tuple[Any, str, Any]] = [
    (lambda d: d.get("benchmark") == "lds_digits", "benchmarks.bench_lds_digits", _lds_digits),
    (lambda d: d.get("benchmark") == "bench_lm", "benchmarks.bench_lm", _lm),
    (lambda d: "cli" in d and "commands" in d.get("cli", {}), "benchmarks.bench_startup", _startup),
    (lambda d: "sizes" in d and "results" in d and "recall" in json.dumps(d["results"]),
     "benchmarks.bench_store_dtype", _store_dtype),
    (lambda d: d.get("benchmark") == "bench_text_rss", "benchmarks.bench_text_rss", _text_rss),
    (lambda d: d.get("benchmark") == "bench_topk", "benchmarks.bench_topk", _topk),
    (lambda d: d.get("benchmark") == "lds_lm", "benchmarks.bench_lds_lm", _lds_lm),
    (lambda d: d.get("benchmark") == "optimize_lm", "benchmarks.bench_optimize_lm", _optimize_lm),
    (lambda d: d.get("benchmark") == "recall", "benchmarks.bench_recall", _recall),
    (lambda d: d.get("benchmark") == "lds_finetune", "benchmarks.bench_lds_finetune", _lds_finetune),
    (lambda d: d.get("benchmark") == "per_token", "benchmarks.bench_per_token", _per_token),
    (lambda d: d.get("benchmark") == "qld_tokens", "benchmarks.bench_qld_tokens", _qld_tokens),
    (lambda d: d.get("benchmark") == "callback", "benchmarks.bench_callback", _callback),
    (lambda d: d.get("benchmark") == "select", "benchmarks.bench_select", _select),
    (lambda d: d.get("benchmark") == "append", "benchmarks.bench_append", _append),
    (lambda d: d.get("benchmark") == "bench_object_store", "benchmarks.bench_object_store", _object_store),
    (lambda d: d.get("benchmark") == "probe_sketch", "benchmarks.probe_sketch", _sketch_probe),
    (lambda d: d.get("benchmark") == "probe_curvature_sketch", "benchmarks.probe_curvature_sketch",
     _curvature_sketch_probe),
    (lambda d: d.get("benchmark") == "bench_gpu", "benchmarks.bench_gpu", _gpu),
    (lambda d: d.get("benchmark") == "bench_ekfac_lm", "benchmarks.bench_ekfac_lm", _ekfac_lm),
    (lambda d: d.get("benchmark") == "examples", "benchmarks.bench_examples", _examples),
]


def _renderer(data: dict[str, Any]) -> tuple[str, Any] | None:
    """``(module, render)`` of the benchmark result ``data``, or None."""
    for matches, module, render in RENDERERS:
        if matches(data):
            return module, render
    return None


def render_table(data: dict[str, Any]) -> str:
    """A benchmark result's main table (Markdown), as the benchmarks page shows it: what a benchmark prints.

    Raises:
        ValueError: no renderer matches ``data``.
    """
    found = _renderer(data)
    if found is None:
        raise ValueError("no renderer for this benchmark result; add one to docs/gen_docs.py RENDERERS")
    return found[1](data)[2]


def render_result(path: Path) -> str:
    """One committed result as a section: title, the command that produced it, its main table."""
    data = json.loads(path.read_text())
    found = _renderer(data)
    if found is None:
        raise ValueError(f"{path}: no renderer for this benchmark result; add one to docs/gen_docs.py RENDERERS")
    missing = [k for k in ("date", "commit", "version") if not data.get(k)]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)} in this benchmark result; write it with "
                         "benchmarks/benchjson.py write_result (it adds date, commit and version)")
    module, render = found
    title, note, body = render(data)
    return "\n".join([
        f"## {title} (`{path.name}`)", "", "Made by", "", "```bash", _command(path, data, module), "```", "",
        note, "", _made(data), "", body, "",
    ])


#: Where docs/benchmarks_intro.md wants the generated sections (else they go at its end).
RESULTS_MARK = "{{ results }}"


def benchmarks_page() -> str:
    """The benchmarks page: docs/benchmarks_intro.md with one section per committed result at its mark."""
    intro = (REPO / "docs" / "benchmarks_intro.md").read_text()
    sections = "\n".join(render_result(p) for p in committed_results())
    if RESULTS_MARK in intro:
        return intro.replace(RESULTS_MARK, sections.rstrip())
    return intro.rstrip() + "\n\n" + sections


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else Path("site_gen")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.md").write_text(config_reference())
    (out / "benchmarks.md").write_text(benchmarks_page())
    print(f"wrote {out}/config.md and {out}/benchmarks.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main(sys.argv))
