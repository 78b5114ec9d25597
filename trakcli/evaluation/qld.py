"""`trak eval qld`: the query loss difference, retraining without each query's top proponents.

For a query (a target) ``q`` and a fraction ``ρ`` of the training set (``m = round(ρ · n_train)`` rows, at
least 1), three models are trained with the config's recipe and the same seed: on all rows, on all rows but
``q``'s ``m`` highest-scored proponents, and on all rows but ``m`` random ones. The query's loss (the task's
summed training loss on its row) under each gives

    QLD_top(q)    = L_q(without top m)    − L_q(all rows)
    QLD_random(q) = L_q(without random m) − L_q(all rows)

and their mean over the queries with bootstrap intervals; an attribution that finds what the query depends on has
``QLD_top`` well above ``QLD_random`` (the filter validation of EleutherAI's Bergson; Koh & Liang 2017, Sec. 5.1,
remove-and-retrain). Unlike the LDS, it asks only about each query's most influential rows, which is what a user
acts on, and a method that ranks by word overlap gets no credit for rows that do not change the query's loss.

With ``eval.qld.per_token`` the unit left out is a training *token* instead of a row: the query's
``m = round(ρ · n_tokens)`` train tokens (targets of the loss) of highest per-token score
(:mod:`trakcli.jobs.per_token`) are masked out of the loss (labels ``-100``), against as many random target tokens
(Bergson's per-token QLD).

Every model is a pure function of the config and its rows and seed: ``eval.seed`` fixes the queries, the
random rows and the seeds (``eval.qld.seeds`` of them, each model of a query trained once per seed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from trakcli.config import Config
from trakcli.data.tensors import inputs_to
from trakcli.errors import ConfigError
from trakcli.evaluation.lds import mean_interval
from trakcli.evaluation.retrain import WorkerState, check_eval_config, model_seed, run_models, train_on_rows
from trakcli.jobs.runtime import event
from trakcli.models.forward import forward
from trakcli.progress import NULL_REPORTER, Reporter
from trakcli.tasks import make_batch, resolve_task

#: QLD models are seeded apart from the LDS's retrained models (which use eval.seed directly).
QLD_SEED_OFFSET = 7919


def query_losses(model: torch.nn.Module, target: Any, rows: list[int], task: Any, device: Any) -> np.ndarray:
    """The task's summed training loss of each target row ``rows`` under ``model``: ``[len(rows)]`` float64."""
    task = resolve_task(task)
    model.eval()
    out = np.empty(len(rows), dtype=np.float64)
    with torch.no_grad():
        for i, r in enumerate(rows):
            _, x, y = next(target.batches(r, r + 1, 1))
            x = inputs_to(x, device)
            logits = forward(model, x).double()
            out[i] = float(task.loss(logits, make_batch(x, y.to(device)), reduction="sum"))
    return out


@dataclass
class QLDPlan:
    """Which models a QLD run trains.

    Attributes:
        queries: ``[n_queries]`` target rows.
        drop: per model, the train rows left out (empty for the full-data model).
        seeds: per model, its training seed.
        kinds: per model, ``("all", s, -1)``, ``("top", s, qi)`` or ``("random", s, qi)``.
        masked: per model, the train tokens masked out of the loss, ``{row: [positions]}``
            (``eval.qld.per_token``; None otherwise).
        n_dropped: the rows (tokens) each model but the full-data one leaves out.
    """

    queries: list[int]
    drop: list[np.ndarray]
    seeds: list[int]
    kinds: list[tuple[str, int, int]]
    masked: list[dict[int, list[int]]] | None = None
    n_dropped: int = 0


def choose_queries(cfg: Config, n_target: int) -> list[int]:
    """The ``eval.qld.queries`` target rows of a QLD run, a seeded choice (``eval.seed``).

    Raises:
        ConfigError: more queries than targets.
    """
    q = cfg.eval.qld
    if q.queries > n_target:
        raise ConfigError(f"eval.qld.queries is {q.queries} but data.target has {n_target} rows; "
                          f"use eval.qld.queries <= {n_target}")
    rng = np.random.default_rng([cfg.eval.seed, 1])
    return sorted(rng.choice(n_target, size=q.queries, replace=False).tolist())


def _plan(cfg: Config, queries: list[int], units: np.ndarray, ranked: dict[str, np.ndarray],
          of_query: Callable[[np.ndarray, int, int], np.ndarray], stream: int,
          as_masked: Callable[[np.ndarray], dict[int, list[int]]] | None) -> QLDPlan:
    """Per seed, the full-data model and, per query, the models without its top ``m`` units (rows or token
    cells) of each score in ``ranked`` (``"top"``, then ``"top:<baseline>"``; ``of_query(scores, qi, t)``: query
    ``qi`` (target ``t``)'s ``[len(units)]`` scores) and without ``m`` random ones (``eval.seed``, ``stream``).
    ``as_masked``: units are tokens, masked from the loss."""
    q = cfg.eval.qld
    m = max(1, round(q.fraction * len(units)))
    empty = np.zeros(0, dtype=np.int64)
    p = QLDPlan(queries, [], [], [], [] if as_masked else None, m)

    def add(kind: tuple[str, int, int], seed: int, left_out: np.ndarray | None) -> None:
        p.kinds.append(kind)
        p.seeds.append(seed)
        p.drop.append(empty if as_masked or left_out is None else np.sort(left_out))
        if as_masked:
            p.masked.append({} if left_out is None else as_masked(left_out))

    tops = [{kind: units[np.argsort(-of_query(v, qi, t), kind="stable")[:m]] for kind, v in ranked.items()}
            for qi, t in enumerate(queries)]  # the same for every seed
    for s in range(q.seeds):
        seed = model_seed(cfg.eval.seed + QLD_SEED_OFFSET, s)
        add(("all", s, -1), seed, None)
        for qi, t in enumerate(queries):
            add(("top", s, qi), seed, tops[qi]["top"])
            add(("random", s, qi), seed, np.random.default_rng([cfg.eval.seed, stream, s, t]).choice(
                units, size=m, replace=False))
            for kind, left_out in tops[qi].items():
                if kind != "top":
                    add((kind, s, qi), seed, left_out)
    return p


def plan_tokens(cfg: Config, queries: list[int], token_scores: np.ndarray,
                baselines: dict[str, np.ndarray] | None = None) -> QLDPlan:
    """The models of a per-token QLD run (module docstring) from the ``queries``' (:func:`choose_queries`)
    per-token scores ``[n_queries, n_train, width]``, NaN where a token is not a target
    (:func:`trakcli.jobs.per_token.query_token_scores`). ``baselines``: other per-token scores of that shape
    (name -> scores, e.g. :func:`trakcli.evaluation.bm25.token_overlap_scores`) whose top tokens are masked too
    (kind ``"top:<name>"``)."""
    valid = ~np.isnan(token_scores[0])  # [n_train, width]: the train targets
    cells = np.flatnonzero(valid.ravel())
    width = valid.shape[1]

    def as_rows(flat: np.ndarray) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for c in sorted(flat.tolist()):
            out.setdefault(c // width, []).append(c % width)
        return out

    ranked = {"top": token_scores, **{f"top:{name}": b for name, b in (baselines or {}).items()}}
    return _plan(cfg, queries, cells, ranked, lambda v, qi, t: v[qi].ravel()[cells], 3, as_rows)


def plan(cfg: Config, scores: np.ndarray, baselines: dict[str, np.ndarray] | None = None) -> QLDPlan:
    """The models of a QLD run from the ``[n_target, n_train]`` scores (module docstring).

    ``baselines`` (name -> scores of the same shape, e.g. BM25's) add, per query and seed, one
    model without the baseline's top rows (kind ``"top:<name>"``), sharing the others.

    Raises:
        ConfigError: more queries than targets.
    """
    queries = choose_queries(cfg, scores.shape[0])
    ranked = {"top": scores, **{f"top:{name}": b for name, b in (baselines or {}).items()}}
    return _plan(cfg, queries, np.arange(scores.shape[1]), ranked, lambda v, qi, t: v[t], 2, None)


def _train_and_measure(state: WorkerState, k: int) -> np.ndarray:
    """Model ``k`` of the plan: trained without its dropped rows, the queries' losses under it."""
    event(f"start qld {k} pid {os.getpid()}")
    cfg, train, p = state.cfg, state.train, state.plan
    keep = np.setdiff1d(np.arange(len(train)), p.drop[k])
    masked = p.masked[k] if p.masked is not None else None
    model = train_on_rows(cfg, train, keep, p.seeds[k], state.device, f"qld {k}", masked_tokens=masked)
    return query_losses(model, state.target, p.queries, cfg.task, state.device)


@dataclass
class QLDResult:
    """A QLD run: ``losses``, per kind of model (``all``, ``top``, ``random``, ``top:<baseline>``), the queries'
    losses ``[seeds, queries]``; ``unit``: what is left out, ``rows`` or ``tokens`` (``eval.qld.per_token``)."""

    queries: list[int]
    fraction: float
    n_dropped: int
    losses: dict[str, np.ndarray]
    n_bootstrap: int
    seed: int
    unit: str = "rows"

    def to_dict(self) -> dict[str, Any]:
        """Means over queries (of the seeds' means) with 95% bootstrap intervals, and the per-query values."""
        rise = {kind: (v - self.losses["all"]).mean(0) for kind, v in self.losses.items()}  # per query
        top, rand = rise["top"], rise["random"]

        def summary(v: np.ndarray) -> dict[str, float]:
            mean, lo, hi = mean_interval(v, self.n_bootstrap, self.seed)
            return {"mean": mean, "low": lo, "high": hi}

        return {
            "metric": "qld",
            "baselines": {kind[4:]: summary(v) for kind, v in rise.items() if kind.startswith("top:")},
            "fraction": self.fraction, "n_dropped": self.n_dropped, "unit": self.unit,
            "n_queries": len(self.queries),
            "n_seeds": int(self.losses["all"].shape[0]),
            "qld_top": summary(top), "qld_random": summary(rand), "qld_top_minus_random": summary(top - rand),
            "queries": self.queries,
            "per_query": {"top": top.tolist(), "random": rand.tolist(),
                          "loss_all": self.losses["all"].mean(0).tolist()},
        }


def qld(cfg: Config, scores: np.ndarray | None, *, workers: int = 1, reporter: Reporter = NULL_REPORTER,
        baselines: dict[str, np.ndarray] | None = None, token_scores: tuple[list[int], np.ndarray] | None = None
        ) -> QLDResult:
    """Train the models of :func:`plan` (``workers`` processes) and measure each query's loss under them.

    ``scores``: ``[n_target, n_train]`` (the queries are among the targets); ``baselines``: other scores of the
    same shape whose top rows are left out too. With ``token_scores``, ``(queries, [n_queries, n_train, width]
    per-token scores)``, tokens are left out instead of rows (:func:`plan_tokens`; ``scores`` is then unused and
    ``baselines`` are per-token scores of the same shape).

    Raises:
        ConfigError: a recipe that cannot retrain, or more queries than targets.
        TrakError: training failed.
    """
    check_eval_config(cfg)
    p = plan_tokens(cfg, *token_scores, baselines) if token_scores is not None else plan(cfg, scores, baselines)
    n = len(p.drop)
    results: dict[int, np.ndarray] = {}
    with reporter.task("qld models", n) as task:
        def done(k: int, losses: np.ndarray) -> None:
            results[k] = losses
            task.advance()

        run_models(cfg, list(range(n)), workers, _train_and_measure, done, "qld model", "trak-qld-worker", plan=p)
    q = cfg.eval.qld
    losses = {kind: np.zeros((q.seeds, len(p.queries))) for kind in dict.fromkeys(kind for kind, _, _ in p.kinds)}
    for k, (kind, s, qi) in enumerate(p.kinds):
        if kind == "all":
            losses["all"][s] = results[k]
        else:
            losses[kind][s, qi] = results[k][qi]
    return QLDResult(p.queries, q.fraction, p.n_dropped, losses, cfg.eval.bootstrap, cfg.eval.seed,
                     "tokens" if token_scores is not None else "rows")
