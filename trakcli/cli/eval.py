"""`trak eval lds CONFIG`: the linear datamodeling score of the store's scores against retrained models;
`trak eval recall CONFIG`: fact tracing, MRR and recall@k of the top proponents against known sources;
`trak eval qld CONFIG`: the query loss difference; `trak eval sweep CONFIG`: LDS over proj_dim x checkpoints x
ridge, as a table, JSON and a PNG.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.table import Table

from trakcli.cli.common import (
    ConfigArg, OverridesArg, PrintConfigOpt, QuietOpt, RichReporter, err_console, handle_errors, load,
)
from trakcli.errors import DataError, StoreError, UsageError
from trakcli.cli.help import TrakCommand
from trakcli.files import write_text

if TYPE_CHECKING:
    import numpy as np

#: Options several evaluation commands share.
WorkersOpt = Annotated[
    int, typer.Option("--workers", "-w", min=1, help="Processes that retrain models (each with its own torch threads).")
]
ScoresOpt = Annotated[
    Optional[Path], typer.Option("--scores", help="Scores \\[n_target, n_train] (.npy or .csv) instead of the store's.")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
OutOpt = Annotated[Optional[Path], typer.Option("--out", "-o", help="Also write the result as JSON to this file.")]

#: The ``trak eval`` group (its help is given where main.py adds it).
eval_app = typer.Typer(name="eval", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def check_path(path: Path | None, flag: str, suffixes: tuple[str, ...], must_exist: bool) -> None:
    """Exit 2 on a flag naming a missing input or an output of an unknown format."""
    if path is None:
        return
    if path.suffix.lower() not in suffixes:
        raise UsageError(f"{flag} {path}: expected a {' or '.join(suffixes)} file")
    if must_exist and not path.is_file():
        raise UsageError(f"{flag} {path}: file does not exist")
    if not must_exist and not path.parent.exists():
        raise UsageError(f"{flag} {path}: directory {path.parent} does not exist; create it or choose another path")


def _load_array(path: Path, flag: str) -> np.ndarray:
    """A .npy (or .csv) array file; a DataError when it cannot be read as an array."""
    import numpy as np

    try:
        if path.suffix.lower() == ".csv":
            return np.loadtxt(path, delimiter=",", ndmin=2)
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DataError(f"{flag} {path}: cannot read it as an array ({e}); give a .npy file written by numpy.save") from None


def _histogram(counts: list[int], edges: list[float], width: int = 30) -> str:
    top = max(counts) if counts and max(counts) > 0 else 1
    lines = []
    for i, c in enumerate(counts):
        bar = "█" * round(width * c / top)
        close = "]" if i == len(counts) - 1 else ")"
        lines.append(f"[{edges[i]:+.1f}, {edges[i + 1]:+.1f}{close} {bar} {c}")
    return "\n".join(lines)


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "nan" if x is None else format(x, spec)


def _kv_table(title: str) -> Table:
    """A table of labelled values (the label bold)."""
    table = Table(title=title, show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    return table


def _table(data: dict[str, Any]) -> Table:
    table = _kv_table("Linear datamodeling score (LDS)")
    level = f"{data['confidence_level']:.0%}"
    table.add_row("LDS (mean over targets)", _fmt(data["lds"]))
    table.add_row(f"{level} interval", f"[{_fmt(data['ci_low'])}, {_fmt(data['ci_high'])}]  "
                  f"(percentile bootstrap over targets, {data['n_bootstrap']} resamples)")
    table.add_row("retrained models", str(data["n_subsets"]))
    if "retrain_seed" in data:
        table.add_row("their seeds", {
            "same": "the checkpoints' own (eval.retrain_seed: same)",
            "replay": "the recorded runs rerun, the other rows weighted 0 (eval.retrain_seed: replay)",
        }.get(data["retrain_seed"], "unlike the checkpoints' (eval.retrain_seed: other)"))
    nan = data["n_targets_nan"]
    table.add_row("targets", f"{data['n_target']}"
                  + (f" ({nan} with constant predictions or outputs: left out)" if nan else ""))
    q = data["quantiles"]
    table.add_row(
        "per-target LDS",
        "  ".join(f"{label} {_fmt(q[key], '+.3f')}" for label, key in
                  (("min", "0"), ("5%", "0.05"), ("25%", "0.25"), ("median", "0.5"), ("75%", "0.75"),
                   ("95%", "0.95"), ("max", "1"))),
    )
    table.add_row("histogram", _histogram(data["histogram"]["counts"], data["histogram"]["edges"]))
    if "bm25" in data.get("baselines", {}):
        b = data["baselines"]["bm25"]
        table.add_row("BM25 (word overlap)", f"LDS {_fmt(b['lds'])}  [{_fmt(b['ci_low'])}, {_fmt(b['ci_high'])}]  (bm25s, "
                      "the same retrained models)")
    for key, value in data["sources"].items():
        table.add_row(key, value)
    return table


@eval_app.command("lds", cls=TrakCommand)
@handle_errors
def lds(
    config: Annotated[
        Optional[Path],
        typer.Argument(help="YAML config (`trak init NAME` writes an example); may be omitted when --scores, --masks "
                            "and --outputs are all given.", show_default=False),
    ] = None,
    overrides: OverridesArg = None,
    workers: WorkersOpt = 1,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Discard the retrained models in the store and retrain them all.")
    ] = False,
    scores: ScoresOpt = None,
    masks: Annotated[
        Optional[Path],
        typer.Option("--masks", help="External retraining: subsets \\[n_subsets, n_train] bool (.npy); needs --outputs."),
    ] = None,
    outputs: Annotated[
        Optional[Path],
        typer.Option("--outputs", help="External retraining: model outputs \\[n_subsets, n_target] float (.npy)."),
    ] = None,
    json_out: JsonOpt = False,
    out: OutOpt = None,
    print_config: PrintConfigOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """LDS of the scores: Spearman correlation per target between predicted and retrained models' outputs.

    Retrains eval.n_subsets models on random eval.subset_fraction subsets of data.train
    with the config's training recipe (resumable: one model at a time into the store's
    eval/ group), then scores the store's scores of score.experiment (or --scores)
    against them. --masks and --outputs give someone else's retraining instead.
    """
    if (masks is None) != (outputs is None):
        raise UsageError("--masks and --outputs go together: give both files of the external retraining, or neither")
    if config is None and (scores is None or masks is None):
        raise UsageError("give CONFIG (it names the store, its scores and the retraining recipe), or all of --scores, "
                         "--masks and --outputs")
    given = {key: path for key, path in (("scores", scores), ("masks", masks), ("outputs", outputs)) if path}
    for key, path in given.items():
        check_path(path, f"--{key}", (".npy", ".csv"), must_exist=True)
    check_path(out, "--out", (".json",), must_exist=False)
    arrays = {key: _load_array(path, f"--{key}") for key, path in given.items()}
    names = {key: f"--{key} {path}" for key, path in given.items()}
    from trakcli.config import EvalConfig

    settings, extra = EvalConfig(), {}
    reporter = RichReporter(quiet)
    if config is not None:
        reporter.phase("reading the config, importing torch …")  # the first line, before the slow imports
        cfg = load(config, overrides, print_config)
        settings = cfg.eval
        # imported after the config is valid: torch import is slow
        from trakcli.evaluation.scores import store_scores
        from trakcli.evaluation.retrain import retrain

        store_note: StoreError | None = None
        if scores is None:
            names["scores"] = f"the scores of experiment {cfg.score.experiment!r} in {cfg.store.path}"
            try:
                with reporter.phase(f"reading the scores of experiment {cfg.score.experiment!r} …"):
                    arrays["scores"] = store_scores(cfg)
            except StoreError as e:
                if masks is not None:
                    raise
                store_note = e  # retrain first anyway (it needs no scores); the LDS needs them
                if not quiet:
                    err_console.print(f"[yellow]{e}; retraining only[/]", highlight=False)
        if masks is None:
            res = retrain(cfg, workers=workers, overwrite=overwrite, reporter=reporter)
            arrays.update(masks=res.masks, outputs=res.outputs)
            names.update(masks=f"eval/masks in {res.store}", outputs=f"eval/outputs in {res.store}")
            if store_note is not None:
                raise StoreError(f"{store_note}\nthe {res.n_subsets} retrained models are kept in {res.store}/eval; "
                                 "rerun `trak eval lds CONFIG` once the store holds scores")
            extra["retrain_seed"] = cfg.eval.retrain_seed  # retrained by this config: whose seeds
    from trakcli.evaluation.lds import check_lds_inputs
    from trakcli.evaluation.lds import lds as linear_datamodeling_score

    keys = ("scores", "masks", "outputs")
    s_arr, m_arr, o_arr = check_lds_inputs(*(arrays[k] for k in keys), names=names)
    with reporter.phase(f"computing the LDS ({settings.bootstrap} bootstrap resamples) …"):
        result = linear_datamodeling_score(s_arr, m_arr, o_arr, n_bootstrap=settings.bootstrap, seed=settings.seed)
    data = {**result.to_dict(), "sources": {k: names[k] for k in keys}, **extra}
    bm25 = _bm25(cfg) if config is not None else None
    if bm25 is not None and bm25.shape == s_arr.shape:
        base = linear_datamodeling_score(bm25, m_arr, o_arr, n_bootstrap=settings.bootstrap, seed=settings.seed)
        shown = base.to_dict()
        data["baselines"] = {"bm25": {k: shown[k] for k in ("lds", "ci_low", "ci_high")}}
    _report(data, _table(data), out, json_out, quiet)


def _bm25(cfg: Any) -> "np.ndarray | None":
    """BM25 scores ``[n_target, n_train]`` of the config's text data (``eval.bm25``), else None."""
    if not cfg.eval.bm25 or cfg.data.target is None:
        return None
    from trakcli.evaluation.bm25 import bm25_of
    from trakcli.evaluation.scores import dataset

    return bm25_of(dataset(cfg), dataset(cfg, "target"))


def _report(data: dict, table, out: Path | None, json_out: bool, quiet: bool) -> None:
    """An evaluation's result: JSON to ``out`` (atomically; a UsageError when it cannot be written) and, with
    ``json_out``, to stdout; the table on stderr."""
    text = json.dumps(data, indent=2) + "\n"
    if out is not None:
        try:
            write_text(out, text)
        except OSError as e:
            raise UsageError(f"--out {out}: cannot write it ({e})") from None
    if json_out:
        sys.stdout.write(text)
    if not quiet:
        err_console.print(table)
        if out is not None:
            err_console.print(f"[green]result -> {out}[/]")


def _parse_ks(values: list[str] | None) -> list[int] | None:
    """``--k 1 --k 5`` or ``--k 1,5,10`` -> [1, 5, 10]; None when not given."""
    if not values:
        return None
    ks = []
    for v in values:
        for part in str(v).split(","):
            part = part.strip()
            if not part.isdigit() or int(part) < 1:
                raise UsageError(f"--k {v}: expected positive integers, e.g. --k 1,5,10 or --k 1 --k 5")
            ks.append(int(part))
    return ks


def _recall_table(data: dict[str, Any]) -> Table:
    table = _kv_table("Fact tracing: do the top proponents hold each query's source?")
    level = f"{data['confidence_level']:.0%}"

    def cell(v: dict[str, Any]) -> str:
        return f"{_fmt(v['value'])}  [{_fmt(v['ci_low'])}, {_fmt(v['ci_high'])}]"

    table.add_row(f"MRR  ({level} interval)", cell(data["mrr"]))
    for k, v in data["recall"].items():
        table.add_row(f"recall@{k}", cell(v))
    if data["max_sources"] > 1:
        for k, v in data["source_recall"].items():
            table.add_row(f"sources found @{k}", cell(v))
    table.add_row("queries", f"{data['n_query']} ({data['n_not_found']} with no source in the top {data['k_max']})")
    table.add_row("interval", f"percentile bootstrap over queries, {data['n_bootstrap']} resamples")
    if "bm25" in data.get("baselines", {}):
        b = data["baselines"]["bm25"]
        table.add_row("BM25 MRR (word overlap)", cell(b["mrr"]))
        for k, v in b["recall"].items():
            table.add_row(f"BM25 recall@{k}", cell(v))
    for key, value in data["inputs"].items():
        table.add_row(key, value)
    return table


@eval_app.command("recall", cls=TrakCommand)
@handle_errors
def recall(
    config: Annotated[
        Path, typer.Argument(help="YAML config (configs/facts.yaml is the fact-tracing example).", show_default=False)
    ],
    overrides: OverridesArg = None,
    k: Annotated[
        Optional[list[str]],
        typer.Option("--k", help="The k of recall@k: --k 1,5,10 or --k 1 --k 5 (default: eval.recall.k)."),
    ] = None,
    json_out: JsonOpt = False,
    out: OutOpt = None,
    print_config: PrintConfigOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Fact tracing: MRR and recall@k of the experiment's top proponents against each query's known sources.

    Each data.target row lists, in the field eval.recall.sources (default
    "sources"), the 0-based data.train rows that hold its fact. The ranking
    is the store's top-k of score.experiment (`trak score CONFIG
    score.top_k=100`), or its full score matrix ranked. recall@k: the share
    of queries with at least one source among their top k; MRR: the mean of
    1/rank of the first source (0 when none is in the top K). Each with a
    bootstrap interval over queries (eval.bootstrap resamples, eval.seed).
    """
    ks = _parse_ks(k)
    check_path(out, "--out", (".json",), must_exist=False)
    reporter = RichReporter(quiet)
    reporter.phase("reading the config, importing torch …")  # the first line, before the slow imports
    cfg = load(config, overrides, print_config)
    # imported after the config is valid: torch import is slow
    from trakcli.evaluation.scores import recall_inputs
    from trakcli.evaluation.ranking import fact_recall

    with reporter.phase("reading the scores and the facts' sources …"):
        inputs = recall_inputs(cfg)

    def measure(ranked: Any) -> Any:
        return fact_recall(ranked, inputs.sources, ks if ks is not None else cfg.eval.recall.k,
                           n_train=inputs.n_train, n_bootstrap=cfg.eval.bootstrap, seed=cfg.eval.seed)

    with reporter.phase("computing the recall …"):
        result = measure(inputs.ranked)
    data = {
        **result.to_dict(),
        "max_sources": int(result.n_sources.max()) if result.n_query else 0,
        "inputs": {"ranking": f"{inputs.ranking} in {cfg.store.path}", "sources": inputs.sources_from},
    }
    bm25 = _bm25(cfg)
    if bm25 is not None:
        from trakcli.evaluation.ranking import rank_scores

        base = measure(rank_scores(bm25, inputs.ranked.shape[1])).to_dict()
        data["baselines"] = {"bm25": {"mrr": base["mrr"], "recall": base["recall"]}}
    _report(data, _recall_table(data), out, json_out, quiet)


def _qld_table(data: dict[str, Any]) -> Table:
    table = Table(title="Query loss difference (QLD): retraining without each query's top proponents", title_justify="left")
    table.add_column("")
    table.add_column("mean over queries [95% CI]")

    def cell(v: dict[str, Any]) -> str:
        return f"{_fmt(v['mean'])} [{_fmt(v['low'])}, {_fmt(v['high'])}]"

    unit = data.get("unit", "rows")
    top = "proponents" if unit == "rows" else "proponent tokens"
    table.add_row(f"loss increase, top {data['n_dropped']} {top} left out", cell(data["qld_top"]))
    table.add_row(f"loss increase, {data['n_dropped']} random {unit} left out", cell(data["qld_random"]))
    table.add_row("top minus random", cell(data["qld_top_minus_random"]))
    if "token_overlap" in data.get("baselines", {}):
        table.add_row(f"loss increase, the query's own tokens left out ({data['n_dropped']}, rarest first)",
                      cell(data["baselines"]["token_overlap"]))
    if "bm25" in data.get("baselines", {}):
        table.add_row(f"loss increase, BM25's top {data['n_dropped']} left out (word overlap)", cell(data["baselines"]["bm25"]))
    table.add_row("queries x seeds", f"{data['n_queries']} x {data['n_seeds']}")
    return table


@eval_app.command("qld", cls=TrakCommand)
@handle_errors
def qld(
    config: Annotated[Path, typer.Argument(help="YAML config (after `trak score`).", show_default=False)],
    overrides: OverridesArg = None,
    workers: WorkersOpt = 1,
    scores: ScoresOpt = None,
    json_out: JsonOpt = False,
    out: OutOpt = None,
    print_config: PrintConfigOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Query loss difference: retrain without each query's top proponents and compare its loss increase with random.

    For eval.qld.queries targets (a seeded choice), models are trained with the config's recipe on all
    of data.train, on all but the query's top round(eval.qld.fraction * n_train) proponents, and on
    all but as many random rows, with the same seed (eval.qld.seeds of them). The report: the mean
    loss increase of the queries when their top proponents are left out, when random rows are, and
    the difference, each with a bootstrap interval over queries.
    """
    check_path(scores, "--scores", (".npy", ".csv"), must_exist=True)
    check_path(out, "--out", (".json",), must_exist=False)
    reporter = RichReporter(quiet)
    reporter.phase("reading the config, importing torch …")  # the first line, before the slow imports
    cfg = load(config, overrides, print_config)
    from trakcli.evaluation.scores import store_scores
    from trakcli.evaluation.qld import qld as query_loss_difference

    if cfg.eval.qld.per_token:
        if scores is not None:
            raise UsageError("--scores gives document scores; eval.qld.per_token ranks training tokens by the "
                             "per-token scores of the store: leave out --scores, or set eval.qld.per_token=false")
        from trakcli.jobs.per_token import query_token_scores
        from trakcli.evaluation.qld import choose_queries
        from trakcli.evaluation.scores import dataset

        target = dataset(cfg, "target")
        queries = choose_queries(cfg, len(target))
        tokens = (queries, query_token_scores(cfg, queries, reporter))
        baselines = None
        if cfg.eval.bm25:  # the lexical row: the query's own tokens in the train documents, rarest first
            from trakcli.evaluation.bm25 import token_overlap_scores

            baselines = {"token_overlap": token_overlap_scores(dataset(cfg), target, queries, tokens[1].shape[2],
                                                               cfg.eval.seed)}
        result = query_loss_difference(cfg, None, workers=workers, reporter=reporter, token_scores=tokens,
                                       baselines=baselines)
    else:
        s_arr = _load_array(scores, "--scores") if scores is not None else store_scores(cfg)
        bm25 = _bm25(cfg)
        baselines = {"bm25": bm25} if bm25 is not None and bm25.shape == s_arr.shape else None
        result = query_loss_difference(cfg, s_arr, workers=workers, reporter=reporter, baselines=baselines)
    data = {**result.to_dict(), "scores": str(scores) if scores else
            f"the scores of experiment {cfg.score.experiment!r} in {cfg.store.path}"}
    _report(data, _qld_table(data), out, json_out, quiet)


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
    for t, names in ((t1, [f"rel {_fmt(rel, 'g')}" if rel is not None else f"abs {_fmt(a, 'g')}" for rel, a in ridges]),
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


@eval_app.command("sweep", cls=TrakCommand)
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
    as_json: JsonOpt = False,
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

    res = run_sweep(cfg, workers=workers, proj_dims=dims, n_checkpoints=ks, lambda_rel=rels, lambda_reg=abss,
                    reporter=reporter)
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
