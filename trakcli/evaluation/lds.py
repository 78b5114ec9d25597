"""The linear datamodeling score (LDS; Park et al. 2023, "TRAK", Sec. 2.2 and Eq. 5; Ilyas et al. 2022,
"Datamodels"): pure numpy / scipy statistics (scipy imported where used), no I/O.

Model k is retrained on the subset ``masks[k]`` of the training set (:mod:`trakcli.evaluation.retrain`); the
scores predict its output for target t as ``pred[k, t] = masks[k] @ scores[t]``; the LDS of target t is the
Spearman rank correlation over k of ``pred[:, t]`` with the actual outputs ``outputs[k, t]`` (the margin the
scores attribute), and the LDS is its mean over targets.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from trakcli.errors import DataError

#: Quantiles of the per-target LDS that :class:`LDSResult` reports.
QUANTILES = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0)


def check_lds_inputs(scores: Any, masks: Any, outputs: Any, *,
                     names: dict[str, str] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate the three arrays of :func:`lds` (``scores [n_target, n_train]`` real, ``masks [n_subsets,
    n_train]`` bool or 0/1, ``outputs [n_subsets, n_target]`` real) and convert them to ``(float64, bool,
    float64)``. ``names``: how messages call each array (e.g. the file it came from), by those keys.

    Raises:
        DataError: a wrong number of dimensions, a non-numeric dtype, masks other than 0/1, non-finite values, fewer
            than 2 subsets, or shapes that do not fit together (names the array, its shape, the expected shape and
            where the expected sizes come from).
    """
    names = {"scores": "scores", "masks": "masks", "outputs": "outputs", **(names or {})}
    expect = {
        "scores": "[n_target, n_train]",
        "masks": "[n_subsets, n_train] bool",
        "outputs": "[n_subsets, n_target] float",
    }
    arrays = {"scores": np.asarray(scores), "masks": np.asarray(masks), "outputs": np.asarray(outputs)}
    for key, a in arrays.items():
        if a.ndim != 2:
            raise DataError(f"{names[key]} has shape {list(a.shape)}; expected a 2-D array {expect[key]}")
        if not (a.dtype == bool or np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
            raise DataError(f"{names[key]} has dtype {a.dtype}; expected {expect[key]} numbers")
    m = arrays["masks"]
    if m.dtype != bool:
        bad = ~np.isin(m, (0, 1))
        if bad.any():
            raise DataError(f"{names['masks']} holds values other than 0 and 1 (e.g. {m[bad].flat[0]!r}); expected "
                            f"{expect['masks']}: True where the retrained model's subset holds the training row")
        m = m.astype(bool)
    s = arrays["scores"].astype(np.float64, copy=False)
    o = arrays["outputs"].astype(np.float64, copy=False)
    for key, a in (("scores", s), ("outputs", o)):
        bad = ~np.isfinite(a)
        if bad.any():
            rows = np.unique(np.nonzero(bad)[0])[:5].tolist()
            raise DataError(f"{names[key]} holds {int(bad.sum())} NaN/inf values (rows {rows}); the LDS needs finite "
                            f"{expect[key]} values: drop or fix those rows")
    n_subsets, n_train = m.shape
    if n_subsets < 2:
        raise DataError(f"{names['masks']} has {n_subsets} row; the LDS needs at least 2 retrained models (rows)")
    if o.shape[0] != n_subsets:
        raise DataError(f"{names['outputs']} has shape {list(o.shape)}, expected [{n_subsets}, n_target]: one row per "
                        f"retrained model, as {names['masks']} (shape {list(m.shape)}) has {n_subsets}")
    n_target = o.shape[1]
    if s.shape != (n_target, n_train):
        raise DataError(f"{names['scores']} has shape {list(s.shape)}, expected [{n_target}, {n_train}] = [n_target, "
                        f"n_train] (n_target from {names['outputs']} {list(o.shape)}, n_train from {names['masks']} "
                        f"{list(m.shape)}); give scores of the same targets and training set as the retraining")
    return s, m, o


def spearman_columns(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman rank correlation of each column of ``a`` with the same column of ``b`` (both ``[n, m]`` real):
    ``[m]`` float64 in [-1, 1]; NaN where a column of ``a`` or ``b`` is constant.

    Ranks along axis 0 with ties averaged (``scipy.stats.rankdata``), then the Pearson correlation of the ranks
    per column: equal to ``scipy.stats.spearmanr(a[:, j], b[:, j]).statistic`` for every column.
    """
    from scipy.stats import rankdata

    ra = rankdata(a, axis=0)
    rb = rankdata(b, axis=0)
    ra -= ra.mean(axis=0)
    rb -= rb.mean(axis=0)
    num = (ra * rb).sum(axis=0)
    den = np.sqrt((ra * ra).sum(axis=0) * (rb * rb).sum(axis=0))
    with np.errstate(invalid="ignore", divide="ignore"):
        rho = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)
    return np.clip(rho, -1.0, 1.0)


@dataclass
class LDSResult:
    """The linear datamodeling score of a score matrix.

    Attributes:
        lds: mean over targets (with a defined correlation) of the per-target LDS.
        ci_low, ci_high: percentile bootstrap interval of ``lds`` over targets
            (``confidence_level``; NaN with fewer than 2 targets or no resamples).
        rhos: ``[n_target]`` float64 per-target Spearman correlations; NaN where
            the predictions or the outputs of a target are constant.
        n_targets_nan: targets whose correlation is NaN (left out of ``lds``).
        n_subsets, n_target: sizes.
        quantiles: quantile (0, 0.05, ..., 1) -> per-target LDS at it.
        histogram: ``(counts [10], edges [11])`` of the per-target LDS over [-1, 1].
        n_bootstrap, confidence_level, seed: the bootstrap settings.
    """

    lds: float
    ci_low: float
    ci_high: float
    rhos: np.ndarray
    n_targets_nan: int
    n_subsets: int
    n_target: int
    quantiles: dict[float, float]
    histogram: tuple[np.ndarray, np.ndarray]
    n_bootstrap: int
    confidence_level: float
    seed: int

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (NaN -> None)."""
        counts, edges = self.histogram
        return {
            "lds": finite_or_none(self.lds),
            "ci_low": finite_or_none(self.ci_low), "ci_high": finite_or_none(self.ci_high),
            "confidence_level": self.confidence_level, "n_bootstrap": self.n_bootstrap, "bootstrap_seed": self.seed,
            "n_subsets": self.n_subsets, "n_target": self.n_target, "n_targets_nan": self.n_targets_nan,
            "quantiles": {f"{q:g}": finite_or_none(v) for q, v in self.quantiles.items()},
            "histogram": {"counts": [int(c) for c in counts], "edges": [float(e) for e in edges]},
            "per_target": [finite_or_none(r) for r in self.rhos],
        }


def finite_or_none(x: float) -> float | None:
    """``x`` as a float, None when it is NaN or infinite (JSON has neither)."""
    return float(x) if np.isfinite(x) else None


def mean_interval(values: np.ndarray, n_bootstrap: int, seed: int,
                  confidence_level: float = 0.95) -> tuple[float, float, float]:
    """The mean of ``values`` (``[n]`` float64, per target or query) and its percentile bootstrap interval
    (``scipy.stats.bootstrap``, ``n_bootstrap`` resamples drawn with ``seed``): ``(mean, low, high)``.

    NaN mean for no values; NaN bounds without resamples or with fewer than 2 values; both bounds the mean
    when every value is the same.
    """
    mean = float(values.mean()) if values.size else float("nan")
    if n_bootstrap <= 0 or values.size < 2:
        return mean, float("nan"), float("nan")
    if np.ptp(values) == 0:  # every value the same: the interval is that value
        return mean, mean, mean
    from scipy.stats import bootstrap

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ci = bootstrap(
            (values,), np.mean, n_resamples=n_bootstrap, confidence_level=confidence_level,
            method="percentile", vectorized=True, rng=np.random.default_rng(seed),
        ).confidence_interval
    return mean, float(ci.low), float(ci.high)


def lds(scores: Any, masks: Any, outputs: Any, *, n_bootstrap: int = 1000, seed: int = 0,
        confidence_level: float = 0.95) -> LDSResult:
    """Linear datamodeling score of ``scores`` against retrained models (Park et al. 2023, Eq. 5).

    ``pred = masks @ scores.T`` (``[n_subsets, n_target]``, float64) predicts each target's output under each
    subset; the per-target LDS is the Spearman correlation of ``pred[:, t]`` with ``outputs[:, t]``
    (:func:`spearman_columns`), and the LDS is its mean over the targets whose correlation is defined. The interval
    is a percentile bootstrap of that mean over targets (``scipy.stats.bootstrap``).

    Args:
        scores: ``[n_target, n_train]`` attribution scores (any real dtype).
        masks: ``[n_subsets, n_train]`` bool, the training rows of each retrained model.
        outputs: ``[n_subsets, n_target]`` the targets' model outputs under each retrained model.
        n_bootstrap: bootstrap resamples (0: no interval).
        seed: seed of the bootstrap resampling.
        confidence_level: of the interval.

    Returns:
        :class:`LDSResult`.

    Raises:
        DataError: inputs of wrong shapes, dtypes or with non-finite values (:func:`check_lds_inputs`).
    """
    s, m, o = check_lds_inputs(scores, masks, outputs)
    pred = m.astype(np.float64) @ s.T  # [n_subsets, n_target]
    rhos = spearman_columns(pred, o)
    ok = np.isfinite(rhos)
    finite = rhos[ok]
    mean, lo, hi = mean_interval(finite, n_bootstrap, seed, confidence_level)
    quantiles = {q: (float(np.quantile(finite, q)) if finite.size else float("nan")) for q in QUANTILES}
    hist = np.histogram(finite, bins=10, range=(-1.0, 1.0))
    return LDSResult(lds=mean, ci_low=lo, ci_high=hi, rhos=rhos, n_targets_nan=int((~ok).sum()),
                     n_subsets=int(m.shape[0]), n_target=int(o.shape[1]), quantiles=quantiles, histogram=hist,
                     n_bootstrap=n_bootstrap, confidence_level=confidence_level, seed=seed)
