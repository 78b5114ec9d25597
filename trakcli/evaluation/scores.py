"""What `trak eval lds` reads from a config's store: the scores of an experiment, checked against the config.

The retrained models are :mod:`trakcli.evaluation.retrain`; the statistic is
:func:`trakcli.evaluation.lds.lds`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trakcli.config import Config
from trakcli.data.load import load_dataset
from trakcli.errors import StoreError, StoreMismatchError
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
        raise StoreError(
            f"no store at {path}, so no {what} of experiment {cfg.score.experiment!r} to evaluate; run "
            f"`trak featurize CONFIG` and {then}"
        )
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
