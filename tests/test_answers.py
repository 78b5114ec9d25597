"""What a score is, said per method (trakcli.answers.score_meaning, ridge_meaning): the quantity and units follow the
store's task and curvature, and the experiment's settings."""

from __future__ import annotations

import pytest

from trakcli.answers import ridge_meaning, score_meaning

CLASSIFIER = {"task": "classification"}
LM = {"task": "language_modeling"}


def test_trak_scores_are_an_estimate_of_the_targets_margin_in_nats():
    text = score_meaning(CLASSIFIER, {"normalize": None, "lambda_rel": 1.0})
    assert text.startswith("A score is TRAK's estimate (Park et al. 2023) of how much training on the train example "
                           "raised the target's margin (log-odds of the right answer against the rest, in nats)")
    assert "ridge lambda" in text and "influence" not in text and "token" not in text
    assert "margin summed over its target tokens" in score_meaning(LM)


@pytest.mark.parametrize("settings,how,damping", [
    ({"curvature_exact": {"damping": 1e-5}}, "exactly", "1e-05 x each layer's mean eigenvalue"),
    ({}, "from the stored projected features", "0.1 x each layer's mean eigenvalue"),
])
def test_curvature_scores_are_influences_per_unit_weight_bounded_by_the_damping(settings, how, damping):
    identity = {**LM, "curvature": {"kind": "ekfac", "feature_damping": 0.1, "output": "loss"}}
    text = score_meaning(identity, settings, per_token=True)
    assert f"A score is an influence (Koh & Liang 2017), computed {how}" in text
    assert "log-likelihood of its target tokens (minus its cross-entropy loss, in nats)" in text
    assert "about score / n_train" in text and damping in text and "sum over many tokens" in text
    assert text.endswith("A token's value is its share of the document's score, in the same units: a document's "
                         "values sum to its score.")
    margin = score_meaning({**CLASSIFIER, "curvature": {"kind": "kfac", "feature_damping": 0.1}}, settings)
    assert "margin (log-odds" in margin and "tokens" not in margin


def test_cosines_have_no_units_and_a_task_of_ones_own_keeps_its_own():
    assert "it has no units" in score_meaning(LM, {"normalize": "unit"})
    own = score_meaning({"task": "my_task.py:Task"})
    assert "output (the task's output function, in its units)" in own and "margin" not in own


def test_the_ridge_says_where_it_comes_from_and_why_it_can_be_large():
    text = ridge_meaning([3.95e12, 4.1e12], 1.0)
    assert text.startswith("lambda_reg per checkpoint: 3.95e+12, 4.1e+12 (lambda_rel 1 x the mean squared norm of a "
                           "train feature; the ridge is in the squared units of the gradients")
    assert "scaling every gradient by c scales it by c^2 and leaves the scores as they are" in text
    assert "score.lambda_reg, as given" in ridge_meaning([0.5], None, 0.5)


def test_trak_score_says_what_a_score_is_and_its_ridge(project):
    import json

    from projects import run

    res = run(project, "score", "run.yaml", "--json")
    assert res.returncode == 0, res.stderr
    meaning = json.loads(res.stdout)["meaning"]
    assert meaning.startswith("A score is TRAK's estimate") and "Ridge lambda_reg per checkpoint: " in meaning
    assert " ".join(meaning.split()[:6]) in " ".join(res.stderr.split())


def test_unrolled_scores_are_metagradients_without_a_ridge():
    text = score_meaning({"task": "classification"}, {"method": "unroll"})
    assert text.startswith("A score is a metagradient") and "No ridge or damping" in text
