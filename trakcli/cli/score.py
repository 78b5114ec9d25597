"""`trak score CONFIG`: featurize targets, finalize kernels, write scores; show proponents/opponents."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional, Sequence

import typer
from rich.table import Table

from trakcli.cli.common import (
    ConfigArg, OverridesArg, OverwriteOpt, PrintConfigOpt, QuietOpt, RichReporter, SkipNonfiniteOpt, VerifyOpt,
    err_console, handle_errors, load,
)
from trakcli.errors import UsageError

if TYPE_CHECKING:
    import numpy as np

    #: One shown target's top: proponent indices and scores, opponent indices and scores (int64, float32 arrays).
    Shown = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]

EXPORT_SUFFIXES = (".npy", ".csv")
ANSWER_SUFFIXES = (".jsonl",)


def check_out(out: Path | None, flag: str = "--out", suffixes: tuple[str, ...] = EXPORT_SUFFIXES) -> None:
    """Validate an export path before any work is done (exit 2 on a bad one)."""
    if out is None:
        return
    if out.suffix.lower() not in suffixes:
        names = list(suffixes)
        listed = ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
        raise UsageError(f"{flag} {out}: unknown format {out.suffix or '(no suffix)'!r}; use a {listed} path")
    if not out.parent.exists():
        raise UsageError(f"{flag} {out}: directory {out.parent} does not exist; create it or choose another path")


#: What the table shows for a side without any train example: proponents are positive scores, opponents negative
#: ones, so the lowest scores of a small training set (or of a target every example helps) may be no opponents.
NO_PROPONENTS = "none: no train example has a positive score"
NO_OPPONENTS = "none: no train example has a negative score"


def top_of_rows(scores: np.ndarray, k: int) -> list[Shown]:
    """Each row's top ``k`` proponents and opponents (:func:`trakcli.plots.top_indices`) with their scores."""
    from trakcli.plots import top_indices

    out = []
    for row in scores:
        pro, opp = top_indices(row, min(k, len(row)))
        out.append((pro, row[pro], opp, row[opp]))
    return out


def shown_top(res, n: int, k: int) -> list[Shown]:
    """The first ``n`` targets' top ``k`` proponents (positive scores) and opponents (negative), best first.

    From the stored top-k arrays when there are some (nothing else is read or ranked again); else from the
    rows of the full matrix (:func:`top_of_rows`).
    """
    import numpy as np

    n = min(n, res.n_target)
    if not res.top_k:
        return top_of_rows(res.head(n), k)
    top, out = res.top(0, n), []
    for t in range(n):
        pi, ps = top["proponents"][t][:k], top["proponent_scores"][t][:k]
        oi, os_ = top["opponents"][t][:k], top["opponent_scores"][t][:k]
        keep_p, keep_o = np.isfinite(ps) & (ps > 0), np.isfinite(os_) & (os_ < 0)
        out.append((pi[keep_p], ps[keep_p], oi[keep_o], os_[keep_o]))
    return out


def scores_table(res, scores: np.ndarray | list[Shown], top_k: int, target_texts: Sequence[str] | None = None,
                 labels: bool = True, train_texts: Sequence[str] | None = None, method: str = "TRAK") -> Table:
    """The table of each shown target's ``top_k`` proponents and opponents, from the
    :class:`~trakcli.jobs.score.ScoreResult` ``res`` (experiment, labels) and per shown target its top
    (:func:`shown_top`) or ``[n_shown, n_train]`` float32 ``scores`` (ranked by :func:`top_of_rows`).

    Text data adds the targets' texts as a column and an excerpt of each train example; ``labels=False`` for
    language-model data, whose per-token labels are not classes; ``method`` (``TRAK``, ``EK-FAC``, ...) is in the
    title. Proponents are the highest positive scores and opponents the lowest negative ones
    (:func:`trakcli.plots.top_indices`): a side without any reads :data:`NO_PROPONENTS` / :data:`NO_OPPONENTS`.
    """
    import numpy as np

    from trakcli.data.sources import shorten

    shown = top_of_rows(scores, top_k) if isinstance(scores, np.ndarray) else scores
    table = Table(title=f"{method} scores, experiment {res.experiment!r}: top {top_k} proponents and opponents")
    table.add_column("target", justify="right")
    if labels:
        table.add_column("label", justify="right")
    if target_texts is not None:
        table.add_column("text", max_width=40)
    what = "train index (label) score" if labels else "train index score"
    table.add_column(f"proponents: {what}")
    table.add_column(f"opponents: {what}")
    for t, (pro, pro_s, opp, opp_s) in enumerate(shown):
        fmt = lambda idx, vals: "\n".join(  # noqa: E731
            (f"{i} ({res.train_labels[i]}) {v:+.4g}" if labels else f"{i} {v:+.4g}")
            + (f" {shorten(train_texts[i], 48)}" if train_texts is not None else "") for i, v in zip(idx, vals)
        )
        cells = [str(t)] + ([str(res.target_labels[t])] if labels else [])
        cells += [shorten(target_texts[t], 60)] if target_texts is not None else []
        table.add_row(*cells, fmt(pro, pro_s) or NO_PROPONENTS, fmt(opp, opp_s) or NO_OPPONENTS)
    return table


def _json(res, shown: list[Shown], out: Path | None, plot: Path | None,
          train_texts: Sequence[str] | None = None, meaning: str | None = None) -> dict[str, Any]:
    """What ``--json`` prints: the run's shape, store, λ per checkpoint, the shown targets' top train indices and
    what a score means (``meaning``, :func:`trakcli.report.source.scale_of`)."""
    from trakcli.answers import answer_entry

    top = [{"target": t,
            "proponents": [answer_entry(i, v, train_texts) for i, v in zip(pro, pro_s)],
            "opponents": [answer_entry(i, v, train_texts) for i, v in zip(opp, opp_s)]}
           for t, (pro, pro_s, opp, opp_s) in enumerate(shown)]
    return {
        "store": str(res.store), "experiment": res.experiment, "n_target": res.n_target, "n_train": res.n_train,
        "lambda_reg": [float(v) for v in res.lambdas],
        "scores": f"scores/{res.experiment}/scores" if res.full else None,
        "top_k": f"scores/{res.experiment}/top_k" if res.top_k else None,
        "exported": str(out) if out else None, "plot": str(plot) if plot else None,
        "two_stage": res.two_stage, "top": top, "meaning": meaning,
    }


def recall_line(two_stage: dict[str, Any]) -> str:
    """The one line reporting a two-stage top-k's measured recall (printed even with ``-q``)."""
    r, k = two_stage["recall"], two_stage["k"]
    rows = two_stage.get("rows_measured", 1.0)
    over = "" if rows >= 1 else f", estimated over {rows:.1%} of the train rows"
    rerank = f", rerank {two_stage['rerank']}" if "rerank" in two_stage else ""
    return (f"two-stage top-k ({two_stage['codes']} candidates, rescore_multiplier {two_stage['rescore_multiplier']}"
            f"{rerank}): "
            f"recall@{k} against the exact top-{k} (the bfloat16 copy's scores) of {two_stage['n_queries']} "
            f"targets{over}: proponents "
            f"{r['proponents']:.4f}, opponents {r['opponents']:.4f}")


@handle_errors
def score(
    config: ConfigArg,
    overrides: OverridesArg = None,
    targets: Annotated[
        Optional[str],  # not a Path, which would make hf://datasets/... hf:/datasets/...
        typer.Option("--targets", "-t",
                     help="Score these targets instead of data.target: a file of the same format (data.target's "
                          "settings, or data.train's, with this path), or a Hub dataset hf://datasets/ORG/NAME/FILE. "
                          "The experiment is named after the file unless score.experiment is given."),
    ] = None,
    out: Annotated[
        Optional[Path],
        typer.Option("--out", "-o",
                     help="Also write the answer: .jsonl (per target, its top proponents and opponents with scores "
                          "and, for text data, texts), or the full score matrix to .npy / .csv."),
    ] = None,
    plot: Annotated[
        Optional[Path],
        typer.Option("--plot",
                     help="Also draw the first score.show_targets targets beside their score.show_top proponents and "
                          "opponents (images; a table for other data) to this .png, .pdf or .svg file."),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the result (store, shape, the shown targets' top train indices) "
                           "as JSON on stdout.")
    ] = False,
    print_config: PrintConfigOpt = False,
    overwrite: OverwriteOpt = False,
    quiet: QuietOpt = False,
    skip_nonfinite: SkipNonfiniteOpt = False,
    verify: VerifyOpt = False,
) -> None:
    """Score the targets against every train example: per target its top proponents and opponents (score.top_k),
    and/or the full n_target x n_train score matrix."""
    check_out(out, suffixes=EXPORT_SUFFIXES + ANSWER_SUFFIXES)
    reporter = RichReporter(quiet)
    reporter.phase("reading the config, importing torch …")  # the first line, before the slow imports
    if plot is not None:
        from trakcli.plots import check_plot_path

        check_plot_path(plot, "--plot")
    if targets is not None:
        overrides = [*(overrides or []), *_target_overrides(load(config, overrides, False), targets)]
    cfg = load(config, overrides, print_config)
    if plot is not None and cfg.score.show_targets == 0:
        raise UsageError("--plot draws the first score.show_targets targets, which is 0; add score.show_targets=3")
    full = cfg.score.top_k is None if cfg.score.full is None else cfg.score.full
    if out is not None and out.suffix.lower() in EXPORT_SUFFIXES and not full:
        raise UsageError(f"--out {out}: score.top_k is set, so no full score matrix is written; write the top-k "
                         "answer to a .jsonl file, or add score.full=true")
    from trakcli.jobs.score import score as run  # after the config is valid: importing torch is slow
    from trakcli.distributed import init_from_env
    from trakcli.store import Store

    res = run(cfg, overwrite=overwrite, skip_nonfinite=skip_nonfinite, verify=verify, reporter=reporter)
    if not init_from_env().is_main:
        return
    train, target = res.train_data, res.target_data  # the rows the job read (a StoredRows: its file is gone)
    from trakcli.data.stored import StoredRows

    stored = isinstance(train, StoredRows)
    if out is not None and out.suffix.lower() in ANSWER_SUFFIXES:
        if res.per_token and stored:
            raise train.unavailable(f"--out {out} with score.per_token (the train tokens; the scores are in the store)")
        from trakcli.answers import answer_records, token_fields
        from trakcli.files import atomic_open

        tokens = token_fields(res, target, train) if res.per_token else None
        with atomic_open(out, "w", encoding="utf-8") as f:  # one JSON line per target
            for line in answer_records(res, cfg.score.show_top, _texts(target), _texts(train), 1024, tokens):
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
        err_console.print(f"answers of {res.n_target} targets -> {out}") if not quiet else None
    elif out is not None:
        Store.open_existing(res.store, mode="r").export(f"scores/{res.experiment}/scores", out)
    if plot is not None:
        if stored:
            raise train.unavailable(f"--plot {plot} (the scores are in the store)")
        from trakcli import plots

        n = min(cfg.score.show_targets, res.n_target)
        plots.plot_top(plot, shown_scores(res, n), train, target, target_ids=range(n), top_k=cfg.score.show_top,
                       train_texts=_texts(train), target_texts=_texts(target))
    if res.two_stage is not None:
        r = res.two_stage["recall"]
        style = "yellow" if min(r["proponents"], r["opponents"]) < 0.99 else "green"
        err_console.print(f"[{style}]{recall_line(res.two_stage)}[/]"
                          + (" (below 0.99: raise score.rescore_multiplier)" if style == "yellow" else ""))
    meaning, shown = "", []
    if json_out or not quiet:  # what a score is, its units and size: read from the store once
        from trakcli.report.source import scale_of

        meaning = scale_of(Store.open_existing(res.store, mode="r"), res.experiment, res.per_token)
        if json_out or cfg.score.show_targets:
            shown = shown_top(res, cfg.score.show_targets, cfg.score.show_top)
    if json_out:
        sys.stdout.write(json.dumps(_json(res, shown, out, plot, _texts(train), meaning), indent=2) + "\n")
    if quiet:
        return
    if cfg.score.show_targets:
        texts = _texts(target)
        texts = None if texts is None else [texts[i] for i in range(len(shown))]
        err_console.print(scores_table(res, shown, cfg.score.show_top, texts,
                                       labels=res.train_labels is not None and not _per_token(train),
                                       train_texts=_texts(train), method=_method(cfg)))
    lam = ", ".join(f"{v:.3g}" for v in res.lambdas)
    c = cfg.curvature
    kernel = (f"lambda_reg per checkpoint: {lam}" if c.kind == "gram" else
              f"curvature {c.kind}: exact scores, damping {c.damping:g}" if c.exact else
              f"curvature {c.kind}: scores of the stored features, feature_damping {c.feature_damping:g}")
    what = ([f"top {res.top_k} [{res.n_target}, {res.top_k}]"] if res.top_k else []) + (
        [f"scores [{res.n_target}, {res.n_train}]"] if res.full else [])
    if "lambda_reg per checkpoint" in meaning or cfg.score.method != "kernel":
        kernel = ""  # the meaning says the ridge (and an unrolled score has none)
    err_console.print(meaning, highlight=False, markup=False)  # before the result line, which comes last
    err_console.print(
        f"[green]{' and '.join(what)}[/] -> {res.store} (scores/{res.experiment})"
        + (f"; {kernel}" if kernel else "") + (f"; exported to {out}" if out else "")
        + (f"; plot: {plot}" if plot else "")
    )


def _method(cfg: Any) -> str:
    """What made the scores, for the table's title."""
    if cfg.score.method == "unroll":
        return "Unrolled"
    return {"kfac": "K-FAC", "ekfac": "EK-FAC"}.get(cfg.curvature.kind, "TRAK")


def _target_overrides(cfg, target: str) -> list[str]:
    """The overrides of ``--targets PATH``: data.target with this path (settings of data.target, else data.train),
    and the experiment named after the file unless the config or the overrides name one.

    ``target`` is the user's string: a local file, or a Hub dataset ``hf://datasets/ORG/NAME[/PATH]`` kept as given
    (messages name it as typed).

    Raises:
        UsageError: a local file that does not exist; data.target (else data.train) is a built-in dataset.
    """
    import re
    from pathlib import PurePosixPath

    import yaml

    from trakcli.models.hub import is_hub_url

    hub = is_hub_url(target)
    path = PurePosixPath(target) if hub else Path(target)
    if not hub and not path.exists():
        raise UsageError(f"--targets {target}: no such file or directory")
    base = cfg.data.target or cfg.data.train
    if base.builtin is not None:
        raise UsageError(f"--targets {target}: data.{'target' if cfg.data.target else 'train'} is the built-in "
                         f"dataset {base.builtin!r}, so the file's keys are unknown; give data.target in the config "
                         "(path and keys)")
    given = base.model_dump(exclude_unset=True, exclude={"path", "builtin", "split"}, mode="json")
    out = [f"data.target.path={target if hub else path.resolve()}"]
    if cfg.data.target is None:
        out += [f"data.target.{k}={yaml.safe_dump(v, default_flow_style=True).strip()}" for k, v in given.items()
                if v is not None]
    if "experiment" not in cfg.score.model_fields_set:
        out.append("score.experiment=" + (re.sub(r"[^A-Za-z0-9_.-]+", "_", path.stem).strip("._") or "targets"))
    return out


def shown_scores(res, n: int) -> np.ndarray:
    """The first ``n`` targets' scores ``[n, n_train]`` float32 for the table, --json and the plot.

    The rows of the full matrix when it is stored; else the top-k scores at their train
    indices and NaN elsewhere (which :func:`trakcli.plots.top_indices` leaves out).
    """
    import numpy as np

    n = min(n, res.n_target)
    if res.full:
        return res.head(n)
    top = res.top(0, n)
    rows = np.full((n, res.n_train), np.nan, dtype=np.float32)
    for side in ("proponent", "opponent"):
        np.put_along_axis(rows, top[f"{side}s"], top[f"{side}_scores"], 1)
    return rows


def _per_token(ds) -> bool:
    """Whether a dataset's labels are per-token (language-model data), not classes."""
    return bool(getattr(ds, "per_token_labels", False)) or getattr(ds, "labels", None) is not None and ds.labels.ndim == 2


def _texts(ds):
    """Short renderings of a text dataset's rows, read when shown (:class:`trakcli.plots.RowTexts`); None for
    other data."""
    if ds is None or not callable(getattr(ds, "texts", None)):
        return None
    from trakcli.plots import RowTexts

    return RowTexts(ds)
