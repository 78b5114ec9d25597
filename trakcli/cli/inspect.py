"""`trak inspect STORE`: provenance, progress, sizes and damage of a store; `trak export STORE`: arrays to files."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from trakcli.cli.common import RichReporter, err_console, handle_errors
from trakcli.cli.score import check_out
from trakcli.errors import UsageError

StoreArg = Annotated[str, typer.Argument(
    help="The Zarr store: a directory or an s3:// URL (store.path of the config; the endpoint and "
    "credentials from the AWS_* environment variables)."
)]


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _layer_table(layers: list[dict]) -> Table:
    """The per-layer split of a kronecker projector's spec: gradient matrix d_out x d_in, grid k_out x k_in, width."""
    table = Table(title=f"kronecker projection: {len(layers)} layers",
                  caption="features: the layer's share of proj_dim; they are the first `features` entries of the "
                          "k_out x k_in grid (row-major), the near-square grid that holds them")
    for col in ("layer", "kind", "d_out x d_in", "k_out x k_in", "features", "parameters"):
        # names are folded, never cut: they are what grad_wrt patterns match
        table.add_column(col, justify="right" if col == "features" else "left", overflow="fold")
    for la in layers:
        name = str(la.get("name"))
        # "weight, bias" for the layer's own parameters; a tied one (GPT-2's lm_head) keeps its full name
        params = [p.removeprefix(f"{name}.") if p.startswith(f"{name}.") else p for p in la.get("params", [])]
        table.add_row(name, str(la.get("kind")), f"{la.get('d_out')} x {la.get('d_in')}",
                      f"{la.get('k_out')} x {la.get('k_in')}", str(la.get("width")), ", ".join(params))
    return table


@handle_errors
def inspect(
    store: StoreArg,
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
    verify: Annotated[
        bool,
        typer.Option("--verify",
                     help="Read every chunk of every array and report the corrupt ones (without it, only missing "
                          "chunk files are found). Exit code 1 when any chunk is damaged."),
    ] = False,
) -> None:
    """Show what a store holds: provenance, per-checkpoint progress, sizes, projector (kronecker: its layers)."""
    from trakcli.store import Store
    from trakcli.store.summary import summary

    with RichReporter().phase(f"reading every chunk of {store} …" if verify else f"reading {store} …"):
        opened = Store.open_existing(store, mode="r")
        info = summary(opened, verify=verify)
    if json_out:
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
    else:
        _render(info)
    _report_damage(info)


def _report_damage(info: dict) -> None:
    """One line per damaged array with its repair; exit 1 (a StoreCorruptError) if there is any."""
    from trakcli.store import StoreCorruptError

    damage = info["corrupt"]
    checked = "every chunk read" if info["verified"] else "chunk files listed; `--verify` also reads them"
    if not damage:
        if info["verified"]:
            err_console.print("[green]verified:[/] every done chunk is present and passes its checksum, and every "
                              "group and array the store's records imply is there")
        return
    for d in damage:
        err_console.print(f"[red]damaged:[/] {escape(d['message'])}", highlight=False)
    raise StoreCorruptError(
        f"store {info['store']} has {len(damage)} damaged array{'s' if len(damage) > 1 else ''} ({checked}): "
        + ", ".join(d["array"] for d in damage[:10]) + "; repair as listed above"
    )


def _rows_done(t: dict) -> str:
    """``done/total`` rows of a checkpoint, and the rows a rerun keeps of its unfinished chunks."""
    partial = t.get("rows_partial") or 0
    if not partial:
        return f"{t['rows_done']}/{t['rows_total']}"
    return f"{t['rows_done'] + partial}/{t['rows_total']} ({partial} partial)"


def _render(info: dict) -> None:
    """The human summary on stderr: provenance, projector, per-checkpoint table, scores, eval."""
    ident = info["identity"]
    proj = ident.get("projector", {})
    data = ident.get("train_data", {})
    err_console.print(f"[bold]{info['store']}[/]  ({_size(info['bytes_on_disk'])} on disk, "
                      f"trakcli {info['trakcli_version']}, schema {info['schema_version']}, created {info['created']})")
    err_console.print(f"model: {ident.get('model')}  task: {ident.get('task')}  grad_wrt: {ident.get('grad_wrt')}  "
                      f"grad_dim: {ident.get('grad_dim')}")
    layers = proj.get("layers") if isinstance(proj, dict) else None
    err_console.print(f"projector: {({k: v for k, v in proj.items() if k != 'layers'}) if layers else proj}")
    if layers:
        err_console.print(_layer_table(layers))
    err_console.print(f"train data: n={data.get('n')} input_shape={data.get('input_shape')} "
                      f"sha256={str(data.get('sha256'))[:16]}  storage: {ident.get('storage')}")
    for a in info.get("appends", []):
        err_console.print(f"appended: {a.get('n_train_before')} -> {a.get('n_train')} train rows on {a.get('date')}")
    table = Table(title="train features per checkpoint (done and intact)")
    for col in ("model_id", "checkpoint", "sha256", "rows done", "skipped", "kernel λ", "on disk"):
        table.add_column(col)
    for t in info["train"]:
        kernel, skipped = t["kernel"], t["nonfinite_skipped"]
        table.add_row(str(t["model_id"]), str(t["checkpoint"]), str(t["sha256"])[:12],
                      _rows_done(t), "?" if skipped is None else str(skipped),
                      f"{kernel['lambda_reg']:.3g}" if kernel else "-", _size(t["bytes_on_disk"]))
    err_console.print(table)
    for exp, s in info["scores"].items():
        parts = []
        if "top_k" in s:
            t = s["top_k"]
            parts.append(f"top-k {t['shape']}, {t['chunks_done']}/{t['chunks_total']} target chunks done")
        if "shape" in s:
            parts.append(f"shape {s['shape']}, {s.get('chunks_done')}/{s.get('chunks_total')} column chunks done")
        err_console.print(f"scores/{exp}: {'; '.join(parts) or 'nothing computed yet'}, {_size(s['bytes_on_disk'])}")
        if "stale" in s:
            err_console.print(f"[yellow]stale:[/] {escape(str(s['stale']['message']))}", highlight=False)
    for exp in info["targets"]:
        if exp not in info["scores"]:
            err_console.print(f"targets/{exp}: target features only (not scored yet)")
    ev = info.get("eval")
    if ev:
        ident = ev.get("identity") or {}
        err_console.print(f"eval: {ev['done']}/{ev['n_subsets']} retrained models (subset_fraction "
                          f"{ident.get('subset_fraction')}, seed {ident.get('seed')}), {_size(ev['bytes_on_disk'])}; "
                          "`trak eval lds CONFIG` reports their LDS")


#: The top-k arrays of an experiment (``score.top_k``), by name.
TOP_K_NAMES = ("proponents", "proponent_scores", "opponents", "opponent_scores")


@handle_errors
def export(
    store: StoreArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="Output file: .npy or .csv.")],
    what: Annotated[
        str, typer.Option("--what", help="'scores', 'features' (train features), one of the top-k arrays "
                          "'proponents', 'proponent_scores', 'opponents', 'opponent_scores', or any array path in "
                          "the store.")
    ] = "scores",
    experiment: Annotated[str, typer.Option("--experiment", "-e", help="Experiment of the scores.")] = "default",
    model_id: Annotated[Optional[int], typer.Option("--model-id", "-m", help="Checkpoint of the features.")] = None,
) -> None:
    """Export scores or features from a store to .npy or .csv, streamed chunk by chunk.

    Arrays keep their dtype; bfloat16 features (store.dtype: bfloat16) are written as float32.
    """
    from trakcli.store import Store

    check_out(out)
    if what == "scores":
        name = f"scores/{experiment}/scores"
    elif what == "features":
        name = f"train/{0 if model_id is None else model_id}/features"
    elif what in TOP_K_NAMES:
        name = f"scores/{experiment}/top_k/{what}"
    elif "/" in what:
        name = what
    else:
        raise UsageError(f"--what {what!r}: use 'scores', 'features', {', '.join(map(repr, TOP_K_NAMES))} or an "
                         "array path such as train/0/out_to_loss")
    with RichReporter().phase(f"exporting {name} of {store} to {out} …"):
        shape = Store.open_existing(store, mode="r").export(name, out)
    err_console.print(f"[green]exported[/] {name} {list(shape)} -> {out}")
