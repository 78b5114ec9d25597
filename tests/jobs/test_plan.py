"""The score plan (trakcli.jobs.plan): one object from ``score:``, what it resolves, what the scores record."""

from __future__ import annotations

from types import SimpleNamespace

from trakcli.config.schema import ScoreConfig
from trakcli.jobs.plan import ScorePlan


def test_a_bare_plan_has_the_config_defaults():
    assert ScorePlan() == ScorePlan.of(ScoreConfig())


def test_full_follows_top_k_unless_set():
    assert ScorePlan.of(ScoreConfig()).full is True
    assert ScorePlan.of(ScoreConfig(top_k=5)).full is False
    assert ScorePlan.of(ScoreConfig(top_k=5, full=True)).full is True


def test_the_setup_decides_curvature_and_exact_scores():
    plan = ScorePlan.of(ScoreConfig(top_k=5, rescore_multiplier=4))
    trak = plan.for_setup(SimpleNamespace(curvature=None, exact_damping=0.1))
    assert not trak.curvature and not trak.exact and trak.exact_two_stage is None
    assert "curvature_exact" not in trak.settings({})
    exact = plan.for_setup(SimpleNamespace(curvature=object(), exact_damping=0.1))
    assert exact.exact and exact.exact_two_stage == 4
    assert exact.settings({"target_data": "t"}) == {
        "lambda_reg": None, "lambda_rel": 1.0, "target_data": "t", "normalize": None,
        "curvature_exact": {"damping": 0.1, "rescore_multiplier": 4},
    }
    stored = plan.for_setup(SimpleNamespace(curvature=object(), exact_damping=None))
    assert stored.curvature and not stored.exact
