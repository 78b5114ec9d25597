"""`trak select CONFIG`: keep the data.train rows that most help the data.target task (LESS-style selection)."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from rich.table import Table

from trakcli.cli.common import (
    ConfigArg, OverridesArg, PrintConfigOpt, QuietOpt, RichReporter, SkipNonfiniteOpt, VerifyOpt, err_console,
    handle_errors, load,
)

TargetsOverwriteOpt = Annotated[
    bool, typer.Option("--overwrite", help="Recompute the target features (the train features are trak "
                       "featurize --overwrite's).")
]


#: The statistics of a score distribution that --json and the table show.
STATS = ("min", "q25", "median", "q75", "max", "mean")


def _stats(values: Any) -> dict[str, float]:
    import numpy as np

    return dict(zip(STATS, map(float, [*np.quantile(values, [0.0, 0.25, 0.5, 0.75, 1.0]), np.mean(values)])))


def summary(res) -> dict[str, Any]:
    """What ``--json`` prints: the files, sizes, settings, score distributions and the best rows."""
    sel = res.selection
    chosen = sel.scores[sel.ranked]
    top = []
    for i, r in enumerate(sel.ranked[: len(res.texts) if res.texts is not None else 10].tolist()):
        entry: dict[str, Any] = {"rank": i + 1, "row": r, "score": float(sel.scores[r])}
        if len(sel.groups) > 1:
            entry["group"] = sel.groups[int(sel.best_group[r])]
        if res.texts is not None:
            entry["text"] = res.texts[i]
        top.append(entry)
    return {
        "out": str(res.out), "scores_out": str(res.scores_out), "store": str(res.store),
        "n_train": res.n_train, "n_target": res.n_target, "n_selected": int(sel.ranked.size),
        "fraction": sel.ranked.size / res.n_train, "aggregate": res.aggregate, "normalize": res.normalize,
        "n_models": res.n_models, "groups": dict(zip(sel.groups, sel.group_sizes)), "quota": sel.quota,
        "selected_per_group": dict(zip(sel.groups, sel.kept_per_group())),
        "threshold": float(chosen.min()), "scores": {"pool": _stats(sel.scores), "selected": _stats(chosen)},
        "train_chunks_computed": res.train_chunks_computed, "target_chunks_computed": sel.targets_computed,
        "top": top,
    }


def _table(data: dict[str, Any]) -> Table:
    table = Table(title=f"selected {data['n_selected']} of {data['n_train']} rows ({data['fraction']:.1%}): "
                  f"{data['aggregate']} over {data['n_target']} targets"
                  + (f" in {len(data['groups'])} groups" if len(data["groups"]) > 1 else "") + ", "
                  f"{'cosines' if data['normalize'] == 'unit' else 'inner products'} summed over "
                  f"{data['n_models']} checkpoints")
    table.add_column("rows")
    for name in STATS:
        table.add_column(name, justify="right")
    for key in ("pool", "selected"):
        table.add_row(key, *(f"{data['scores'][key][n]:+.4g}" for n in STATS))
    return table


def _top_table(data: dict[str, Any]) -> Table:
    table = Table(title="the best rows")
    table.add_column("rank", justify="right")
    table.add_column("row", justify="right")
    table.add_column("score", justify="right")
    groups = any("group" in e for e in data["top"])
    if groups:
        table.add_column("group")
    table.add_column("text", max_width=80)
    for e in data["top"]:
        cells = [str(e["rank"]), str(e["row"]), f"{e['score']:+.4g}"] + ([e.get("group", "")] if groups else [])
        table.add_row(*cells, " ".join(e.get("text", "").split()))
    return table


@handle_errors
def select(
    config: ConfigArg,
    overrides: OverridesArg = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the result (files, sizes, score distributions, the best rows) as "
                           "JSON on stdout.")
    ] = False,
    print_config: PrintConfigOpt = False,
    overwrite: TargetsOverwriteOpt = False,
    quiet: QuietOpt = False,
    skip_nonfinite: SkipNonfiniteOpt = False,
    verify: VerifyOpt = False,
) -> None:
    """Keep the data.train rows whose features best match the data.target examples (LESS): select.fraction or
    select.count of them, written to select.out in data.train's format, their scores beside it."""
    reporter = RichReporter(quiet)
    reporter.phase("reading the config, importing torch …")  # the first line, before the slow imports
    cfg = load(config, overrides, print_config)
    from trakcli.jobs.select import select as run  # after the config is valid: importing torch is slow

    res = run(cfg, overwrite=overwrite, skip_nonfinite=skip_nonfinite, verify=verify, reporter=reporter)
    if res is None:  # not rank 0 under torchrun
        return
    data = summary(res)
    if json_out:
        sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    if quiet:
        return
    err_console.print(_table(data))
    if len(data["groups"]) > 1:
        kept = ", ".join(f"{g}: {n}" for g, n in data["selected_per_group"].items())
        how = ("each group its share (select.quota: equal)" if data["quota"] else
               "by each row's best group; select.quota=equal gives every group its share")
        err_console.print(f"rows kept per target group ({how}): {kept}")
    if data["top"] and res.texts is not None:
        err_console.print(_top_table(data))
    err_console.print(f"[green]selected {data['n_selected']} rows[/] -> {res.out} (scores: {res.scores_out}); "
                      f"feature chunks computed: {res.train_chunks_computed} train, {res.selection.targets_computed} "
                      f"target (store {res.store})")
