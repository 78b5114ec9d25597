"""The LDS statistics (trakcli.evaluation.lds): Spearman correlations per column and the LDS against scipy's
spearmanr, its bootstrap interval, and the inputs it refuses."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from scipy.stats import spearmanr

from trakcli.errors import DataError
from trakcli.evaluation.retrain import subset_mask
from trakcli.evaluation.lds import lds, spearman_columns


def test_spearman_columns_equals_scipy_spearmanr_per_column():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(30, 9))
    b = a + rng.normal(size=(30, 9))
    a[:, 3] = rng.integers(0, 4, size=30)  # ties
    b[:, 4] = np.round(b[:, 4])  # ties
    a[:, 5] = 1.5  # constant: undefined
    b[:, 6] = -2.0
    got = spearman_columns(a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = np.array([spearmanr(a[:, j], b[:, j]).statistic for j in range(9)])
    assert np.isnan(want[[5, 6]]).all() and np.isnan(got[[5, 6]]).all()
    ok = ~np.isnan(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=0, atol=1e-12)


def test_lds_equals_a_loop_of_spearmanr():
    rng = np.random.default_rng(1)
    n_subsets, n_train, n_target = 25, 60, 12
    masks = rng.random((n_subsets, n_train)) < 0.5
    scores = rng.normal(size=(n_target, n_train)).astype(np.float32)
    outputs = masks @ scores.T.astype(np.float64) + rng.normal(scale=3.0, size=(n_subsets, n_target))
    outputs[:, 7] = 0.25  # a target whose outputs are constant: nan, left out
    res = lds(scores, masks, outputs, n_bootstrap=500, seed=0)
    pred = masks.astype(np.float64) @ scores.astype(np.float64).T
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loop = np.array([spearmanr(pred[:, t], outputs[:, t]).statistic for t in range(n_target)])
    np.testing.assert_allclose(res.rhos, loop, atol=1e-12, equal_nan=True)
    assert res.n_targets_nan == 1 and np.isnan(res.rhos[7])
    assert res.lds == pytest.approx(np.nanmean(loop), abs=1e-12)
    assert res.ci_low < res.lds < res.ci_high
    assert res.quantiles[0.5] == pytest.approx(np.nanmedian(loop))
    assert res.quantiles[0.0] == pytest.approx(np.nanmin(loop)) and res.quantiles[1.0] == pytest.approx(np.nanmax(loop))
    assert res.histogram[0].sum() == n_target - 1
    # the bootstrap is seeded: same seed, same interval; another seed, another one
    again = lds(scores, masks, outputs, n_bootstrap=500, seed=0)
    assert (again.ci_low, again.ci_high) == (res.ci_low, res.ci_high)
    other = lds(scores, masks, outputs, n_bootstrap=500, seed=1)
    assert (other.ci_low, other.ci_high) != (res.ci_low, res.ci_high)
    d = res.to_dict()
    assert d["per_target"][7] is None and d["n_targets_nan"] == 1 and json.dumps(d)


def test_lds_of_a_planted_linear_datamodel_is_one_and_of_random_scores_zero():
    rng = np.random.default_rng(2)
    n_subsets, n_train, n_target = 80, 300, 40
    weights = rng.normal(size=(n_target, n_train))  # the true linear datamodel of each target
    masks = np.stack([subset_mask(n_train, 0.5, 0, k) for k in range(n_subsets)])
    outputs = masks @ weights.T + rng.normal(scale=0.01, size=(n_subsets, n_target))
    good = lds(weights, masks, outputs, n_bootstrap=300)
    assert good.lds > 0.99 and good.ci_low > 0.98
    rand = lds(rng.normal(size=(n_target, n_train)), masks, outputs, n_bootstrap=300)
    assert abs(rand.lds) < 0.1 and rand.ci_low < 0 < rand.ci_high
    flipped = lds(-weights, masks, outputs, n_bootstrap=0)
    assert flipped.lds < -0.99 and np.isnan(flipped.ci_low)


def test_lds_rejects_inputs_that_do_not_fit():
    masks = np.zeros((5, 10), dtype=bool)
    outputs = np.zeros((5, 3))
    scores = np.zeros((3, 10))
    with pytest.raises(DataError, match=r"scores has shape \[10, 3\], expected \[3, 10\]"):
        lds(scores.T, masks, outputs)
    with pytest.raises(DataError, match=r"outputs has shape \[4, 3\], expected \[5, n_target\]"):
        lds(scores, masks, outputs[:4])
    with pytest.raises(DataError, match="values other than 0 and 1"):
        lds(scores, np.full((5, 10), 0.5), outputs)
    bad = outputs.copy()
    bad[2, 1] = np.nan
    with pytest.raises(DataError, match=r"outputs holds 1 NaN/inf values \(rows \[2\]\)"):
        lds(scores, masks, bad)
    with pytest.raises(DataError, match="at least 2 retrained models"):
        lds(scores, masks[:1], outputs[:1])
    # 0/1 integers are masks too
    res = lds(np.arange(30.0).reshape(3, 10), np.eye(5, 10, dtype=np.int64), np.arange(15.0).reshape(5, 3))
    assert res.n_subsets == 5
