"""Checking attribution scores: `trak eval` (lds, qld, recall, sweep) and the statistics they report.

The statistics (:mod:`~trakcli.evaluation.lds`, :mod:`~trakcli.evaluation.ranking`) are pure numpy / scipy;
the retraining (:mod:`~trakcli.evaluation.retrain`) and the rest read the config's data and store
(docs/development.md maps every module).
"""
