"""What `trak eval` reads from a config's store, checked against the config: the scores of an experiment (lds,
qld), and its ranking of the train rows with each target's source rows (recall).

The retrained models are :mod:`trakcli.evaluation.retrain`; the statistics are :func:`trakcli.evaluation.lds.lds`
and :func:`trakcli.evaluation.ranking.fact_recall`.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from trakcli.config import Config
from trakcli.data.load import load_dataset
from trakcli.errors import DataError, StoreError, StoreMismatchError
from trakcli.evaluation.ranking import rank_scores
from trakcli.store.integrity import node
from trakcli.store.store import Store
from trakcli.tasks import resolve_task


def dataset(cfg: Config, which: str = "train") -> Any:
    """``data.train`` or ``data.target`` (``which``) of the config, loaded for its task."""
    return load_dataset(getattr(cfg.data, which), key=f"data.{which}", task=resolve_task(cfg.task))


def open_scored_store(cfg: Config, what: str, then: str) -> Store:
    """The config's store, opened to read; a StoreError naming the commands to run when there is none (``what``
    the evaluation reads, ``"scores"`` or ``"top-k"``, and ``then``, the command after `trak featurize CONFIG`)."""
    path = cfg.store.location
    if not Store.exists(path):
        raise StoreError(f"no store at {path}, so no {what} of experiment {cfg.score.experiment!r} to evaluate; run "
                         f"`trak featurize CONFIG` and {then}")
    return Store.open_existing(path, mode="r")


def store_scores(cfg: Config) -> np.ndarray:
    """The scores ``[n_target, n_train]`` float32 of experiment ``score.experiment`` in the config's store.

    Raises:
        StoreError: no store, no scores of the experiment, or unfinished ones (each names the `trak featurize` /
            `trak score` command to run).
        StoreMismatchError: the scores were computed on other train or target data than the config's.
    """
    store = open_scored_store(cfg, "scores", "`trak score CONFIG` first (or give --scores FILE)")
    scores, attrs = store.read_scores(cfg.score.experiment)
    check_experiment_data(cfg, store, attrs, dataset(cfg))
    return np.asarray(scores, dtype=np.float32)


def check_experiment_data(cfg: Config, store: Store, attrs: dict[str, Any], train: Any) -> None:
    """Refuse scores made from other train or target data than the config's (``attrs``: those of
    ``scores/<score.experiment>``; ``train``: the loaded data.train).

    Raises:
        StoreMismatchError: data.train or data.target differs from what the experiment was scored on
            (names ``--overwrite``).
    """
    exp = cfg.score.experiment
    problems = []
    if store.identity.get("train_data") != train.fingerprint():
        problems.append("data.train differs from the train data the store was featurized with")
    if cfg.data.target is not None and attrs.get("target_data") != dataset(cfg, "target").fingerprint():
        problems.append(f"data.target differs from the targets of experiment {exp!r}")
    if problems:
        raise StoreMismatchError(
            f"the scores in {store.path} do not belong to this config: " + "; ".join(problems)
            + "; rerun `trak featurize CONFIG --overwrite` and `trak score CONFIG --overwrite`"
        )


@dataclass
class RecallInputs:
    """The two inputs of :func:`trakcli.evaluation.ranking.fact_recall`, and where they came from.

    Attributes:
        ranked: ``[n_target, K]`` int64 train row indices per target, best first.
        sources: per target, the raw value of its sources field (checked by ``fact_recall``).
        n_train: rows of data.train (the range of the indices).
        ranking: how messages and the report name the ranking (store array and K).
        sources_from: how they name the sources (file and field).
    """

    ranked: np.ndarray
    sources: list[Any]
    n_train: int
    ranking: str
    sources_from: str


def store_ranking(cfg: Config, store: Store) -> tuple[np.ndarray, dict[str, Any], str]:
    """The experiment's proponents ``[n_target, K]`` int64 (top-k, else the full score matrix ranked).

    Returns:
        ``(ranked, attrs of scores/<experiment>, description)``.

    Raises:
        StoreError: the experiment has neither a top-k nor a score matrix (names ``trak score``),
            or unfinished ones; StoreCorruptError: a damaged chunk.
    """
    exp = cfg.score.experiment
    group = node(store.root, f"scores/{exp}")
    if group is not None and node(group, "top_k") is not None:
        ranked = store.read(f"scores/{exp}/top_k/proponents")
        return np.asarray(ranked, dtype=np.int64), dict(group.attrs), f"scores/{exp}/top_k/proponents (K={ranked.shape[1]})"
    if group is not None and node(group, "scores") is not None:
        scores, attrs = store.read_scores(exp)
        ranked = rank_scores(scores, scores.shape[1])
        return ranked, attrs, f"scores/{exp}/scores ranked (all {scores.shape[1]} train rows)"
    raise StoreError(f"store {store.path} holds no top-k and no scores of experiment {exp!r} (score.experiment); run "
                     "`trak score CONFIG score.top_k=100` first")


def target_sources(cfg: Config) -> tuple[list[Any], str]:
    """Each data.target row's value of the field ``eval.recall.sources``.

    Returns:
        ``(sources, description)``: one raw value per target row (a list of train row indices).

    Raises:
        DataError: no data.target, a target that is not a text / language-model data file (the
            sources are a field of its rows), or a row without the field (names the row and the fix).
    """
    from trakcli.data.sources import field_values

    field = cfg.eval.recall.sources
    ds = cfg.data.target
    if ds is None:
        raise DataError("eval recall needs data.target: the queries, each row naming its source train rows in the "
                        f"field {field!r} (eval.recall.sources)")
    if ds.text_source is None or ds.path is None:
        raise DataError("eval recall reads each query's source rows from a field of the data.target rows; data.target "
                        "is not a .jsonl / .csv / .parquet file: give the queries as one (e.g. prompt + completion + "
                        "sources)")
    values = field_values(ds.path, field, key="data.target")
    for row, value in enumerate(values):
        if value is None:
            raise DataError(f"data.target: row {row} of {ds.path} has no field {field!r} (eval.recall.sources); every "
                            "query row lists the 0-based data.train rows holding its fact, e.g. \"sources\": [17]")
        if isinstance(value, str):  # a .csv cell: its JSON text ("[3, 17]"), or one index ("3")
            with contextlib.suppress(json.JSONDecodeError):
                values[row] = json.loads(value)
    return values, f"field {field!r} of {ds.path}"


def recall_inputs(cfg: Config) -> RecallInputs:
    """The store's ranking of experiment ``score.experiment`` and the targets' sources, checked against the config.

    Raises:
        StoreError: no store, or no top-k / scores of the experiment (names the command to run).
        StoreMismatchError: the scores were computed on other train or target data than the config's.
        DataError: the sources cannot be read (:func:`target_sources`), or their number differs from the
            ranking's targets.
    """
    exp = cfg.score.experiment
    store = open_scored_store(cfg, "top-k", "`trak score CONFIG score.top_k=100` first")
    sources, sources_from = target_sources(cfg)
    ranked, attrs, ranking = store_ranking(cfg, store)
    train = dataset(cfg)
    check_experiment_data(cfg, store, attrs, train)
    if len(sources) != ranked.shape[0]:
        raise DataError(f"{sources_from} gives {len(sources)} rows but experiment {exp!r} ranks {ranked.shape[0]} "
                        "targets; rerun `trak score CONFIG --overwrite` with this data.target")
    return RecallInputs(ranked, sources, len(train), ranking, sources_from)
