"""What `trak eval recall` reads: the experiment's ranking of the train rows and each target's source rows.

The statistic is :func:`trakcli.evaluation.ranking.fact_recall`.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from trakcli.config import Config
from trakcli.errors import DataError, StoreError
from trakcli.evaluation.scores import check_experiment_data, dataset, open_scored_store
from trakcli.evaluation.ranking import rank_scores
from trakcli.store.integrity import node
from trakcli.store.store import Store


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
    raise StoreError(
        f"store {store.path} holds no top-k and no scores of experiment {exp!r} (score.experiment); run "
        "`trak score CONFIG score.top_k=100` first"
    )


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
        raise DataError(
            "eval recall needs data.target: the queries, each row naming its source train rows in the field "
            f"{field!r} (eval.recall.sources)"
        )
    if ds.text_source is None or ds.path is None:
        raise DataError(
            "eval recall reads each query's source rows from a field of the data.target rows; data.target is not a "
            ".jsonl / .csv / .parquet file: give the queries as one (e.g. prompt + completion + sources)"
        )
    values = field_values(ds.path, field, key="data.target")
    for row, value in enumerate(values):
        if value is None:
            raise DataError(
                f"data.target: row {row} of {ds.path} has no field {field!r} (eval.recall.sources); every query "
                "row lists the 0-based data.train rows holding its fact, e.g. \"sources\": [17]"
            )
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
        raise DataError(
            f"{sources_from} gives {len(sources)} rows but experiment {exp!r} ranks {ranked.shape[0]} targets; "
            "rerun `trak score CONFIG --overwrite` with this data.target"
        )
    return RecallInputs(ranked, sources, len(train), ranking, sources_from)
