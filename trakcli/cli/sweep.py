"""`trak eval sweep CONFIG`: LDS over proj_dim x checkpoints x ridge, as a table, JSON and a PNG."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from trakcli.cli.common import ConfigArg, OverridesArg, PrintConfigOpt, QuietOpt, RichReporter, err_console, handle_errors, load
from trakcli.cli.eval import check_path
from trakcli.errors import UsageError
from trakcli.files import write_text


def _numbers(text: str | None, flag: str, kind: type) -> list[Any] | None:
    """Parse a comma-separated list such as ``64,256,1024`` (exit 2 on a bad one)."""
    if text is None:
        return None
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated {kind.__name__}s, e.g. {flag} 64,256,1024") from None
    if not values or any(v <= 0 for v in values):
        raise UsageError(f"{flag} {text!r}: give one or more values > 0, comma-separated")
    return values


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def _tables(res) -> list[Table]:
    """LDS by proj_dim x ridge (all checkpoints), and by proj_dim x checkpoints (best ridge)."""
    rows = res.rows
    k_max = max(r["n_checkpoints"] for r in rows)
    dims = sorted({r["proj_dim"] for r in rows})
    ks = sorted({r["n_checkpoints"] for r in rows})
    at: dict[tuple, dict[str, Any]] = {}  # (proj_dim, n_checkpoints, (lambda_rel, lambda_reg or None)) -> its row
    best_lds: dict[tuple[int, int], float] = {}  # (proj_dim, n_checkpoints) -> the best ridge's LDS
    for r in rows:
        at.setdefault((r["proj_dim"], r["n_checkpoints"], _ridge(r)), r)
        key = (r["proj_dim"], r["n_checkpoints"])
        best_lds[key] = max(best_lds.get(key, r["lds"]), r["lds"])

    def mark(d: int, ridge: tuple) -> str:
        r = at.get((d, k_max, ridge))
        if r is None:
            return ""
        text = f"{r['lds']:.3f}"
        return f"[bold green]{text}*[/]" if r is res.best else f"[bold]{text}d[/]" if r is res.default else text

    ridges = list(dict.fromkeys(_ridge(r) for r in rows))
    t1 = Table(title=f"LDS with {k_max} checkpoints: proj_dim x ridge  (* best, d default)")
    t2 = Table(title="LDS by number of checkpoints (each at its best ridge)")
    for t, names in ((t1, [f"rel {_fmt(rel)}" if rel is not None else f"abs {_fmt(a)}" for rel, a in ridges]),
                     (t2, [f"{k} ckpt" for k in ks])):
        for name in ["proj_dim", *names]:
            t.add_column(name, justify="right")
    for d in dims:
        t1.add_row(str(d), *(mark(d, ridge) for ridge in ridges))
        t2.add_row(str(d), *(f"{best_lds[d, k]:.3f}" if (d, k) in best_lds else "" for k in ks))
    return [t1, t2]


def _ridge(r: dict[str, Any]) -> tuple[float | None, float | None]:
    """A row's ridge: ``(lambda_rel, None)`` or ``(None, lambda_reg)``."""
    return r["lambda_rel"], None if r["lambda_rel"] is not None else r["lambda_reg"]


def _describe(r: dict[str, Any]) -> str:
    ridge = f"lambda_rel {r['lambda_rel']:g}" if r["lambda_rel"] is not None else f"lambda_reg {r['lambda_reg']:g}"
    return (f"proj_dim {r['proj_dim']}, {r['n_checkpoints']} checkpoints, {ridge}: "
            f"LDS {r['lds']:.4f} [{r['ci_low']:.4f}, {r['ci_high']:.4f}]")


@handle_errors
def sweep(
    config: ConfigArg,
    overrides: OverridesArg = None,
    workers: Annotated[int, typer.Option("--workers", "-w", min=1, help="Processes for the retraining.")] = 1,
    proj_dims: Annotated[
        Optional[str], typer.Option("--proj-dims", help="Comma-separated proj_dims (default: eval.sweep.proj_dims).")
    ] = None,
    checkpoints: Annotated[
        Optional[str],
        typer.Option("--checkpoints", help="Comma-separated ensemble sizes (default: 1, 2, 5, 10, ..., all)."),
    ] = None,
    lambda_rel: Annotated[
        Optional[str], typer.Option("--lambda-rel", help="Comma-separated relative ridges (default: eval.sweep.lambda_rel).")
    ] = None,
    lambda_reg: Annotated[
        Optional[str], typer.Option("--lambda-reg", help="Comma-separated absolute ridges to add to the grid.")
    ] = None,
    plot: Annotated[
        Optional[Path],
        typer.Option("--plot", help="Picture of the curves, .png/.pdf/.svg (default: <sweep dir>/sweep.png)."),
    ] = None,
    out: Annotated[
        Optional[Path], typer.Option("--out", "-o", help="JSON of every grid point (default: <sweep dir>/sweep.json).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")] = False,
    print_config: PrintConfigOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """LDS as a function of proj_dim, number of checkpoints and ridge, from one set of retrained models.

    Retrains (once, resumable, in the store's eval/ group) as `trak eval lds` does,
    featurizes each proj_dim once (in <store>.sweep/), then sweeps checkpoints and
    ridges in memory. Writes a table (stderr), JSON and a PNG of the curves.
    """
    dims = _numbers(proj_dims, "--proj-dims", int)
    ks = _numbers(checkpoints, "--checkpoints", int)
    rels = _numbers(lambda_rel, "--lambda-rel", float)
    abss = _numbers(lambda_reg, "--lambda-reg", float)
    reporter = RichReporter(quiet)
    reporter.phase("reading the config, importing torch …")  # the first line, before the slow imports
    from trakcli.plots.common import check_plot_path
    from trakcli.plots.sweep import plot_sweep

    if plot is not None:
        check_plot_path(plot, "--plot")
    check_path(out, "--out", (".json",), must_exist=False)
    cfg = load(config, overrides, print_config)
    from trakcli.evaluation.sweep import sweep as run_sweep
    from trakcli.evaluation.sweep import sweep_dir

    res = run_sweep(
        cfg, workers=workers, proj_dims=dims, n_checkpoints=ks, lambda_rel=rels, lambda_reg=abss, reporter=reporter,
    )
    directory = sweep_dir(cfg)
    directory.mkdir(parents=True, exist_ok=True)
    out = out or directory / "sweep.json"
    plot = plot or directory / "sweep.png"
    payload = res.to_json()
    try:
        write_text(out, json.dumps(payload, indent=2) + "\n")
    except OSError as e:
        msg = f"cannot write the sweep results to {out}: {e.strerror or e}; choose a writable --out"
        raise UsageError(msg) from None
    plot_sweep(plot, res.rows, default=res.default)
    if as_json:
        sys.stdout.write(json.dumps(payload) + "\n")
    if quiet:
        return
    for table in _tables(res):
        err_console.print(table)
    err_console.print(f"best:    {_describe(res.best)}")
    err_console.print(f"default: {_describe(res.default)}  ({res.best['lds'] - res.default['lds']:.4f} below the best)")
    err_console.print(f"[green]{len(res.rows)} grid points[/] over {res.n_subsets} retrained models -> {out}, {plot}")
