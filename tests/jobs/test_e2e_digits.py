"""trakcli on the real bundled digits data, through the library API the CLI uses."""

import numpy as np
import pytest

from trakcli import jobs
from trakcli.config import load_config


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("digits")
    cfg = load_config(
        "configs/digits.yaml",
        [
            f"checkpoints={tmp}/ckpts/model_*.pt",
            f"optimize.out_dir={tmp}/ckpts",
            f"store.path={tmp}/attrib.zarr",
            "optimize.n_models=2",
            "optimize.epochs=8",
            "projector.proj_dim=128",
        ],
    )
    jobs.optimize(cfg)
    feat = jobs.featurize(cfg)
    res = jobs.score(cfg)
    return cfg, feat, res


def test_digits_end_to_end_scores_are_meaningful(digits_run):
    cfg, feat, res = digits_run
    assert feat.n_models == 2 and feat.n_train == 1437 and feat.chunks_computed == 2 * 3
    assert res.scores.shape == (360, 1437) and res.scores.dtype == np.float32
    assert np.isfinite(res.scores).all()
    # the strongest proponent of a target is far more often an image of the same digit than chance
    top = res.scores.argmax(axis=1)
    agree = (res.train_labels[top] == res.target_labels).mean()
    assert agree > 0.5, agree  # chance is 0.1
    # and the same-class train examples get more positive total score than the rest
    same = res.train_labels[None, :] == res.target_labels[:, None]
    assert (res.scores * same).sum(1).mean() > (res.scores * ~same).sum(1).mean()


def test_digits_rerun_is_noop_and_scores_are_stable(digits_run):
    cfg, _, res = digits_run
    again = jobs.featurize(cfg)
    assert again.chunks_computed == 0
    res2 = jobs.score(cfg)
    np.testing.assert_array_equal(res.scores, res2.scores)


@pytest.mark.slow
def test_digits_lds_is_far_above_shuffled_scores(digits_run):
    """The product's own check on real data: retrained-subset LDS of the scores vs scores of shuffled rows."""
    from trakcli.evaluation.retrain import load_or_retrain
    from trakcli.evaluation.lds import lds

    cfg, _, res = digits_run
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"n_subsets": 20})})
    masks, outputs = load_or_retrain(cfg)
    assert masks.shape == (20, 1437) and outputs.shape == (20, 360)
    real = lds(res.scores, masks, outputs, n_bootstrap=200)
    shuffled = lds(res.scores[:, np.random.default_rng(0).permutation(1437)], masks, outputs, n_bootstrap=200)
    assert real.lds > 0.1, real.lds  # 0.14 here (2 checkpoints, proj_dim 128, 20 subsets)
    assert abs(shuffled.lds) < 0.05, shuffled.lds
    assert real.ci_low > shuffled.ci_high
