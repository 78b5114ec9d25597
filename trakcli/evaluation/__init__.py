"""Checking attribution scores: `trak eval` (lds, qld, recall, sweep) and the statistics they report.

- :mod:`~trakcli.evaluation.retrain`: models retrained on random subsets of the training data, row by row
  into the store (:mod:`~trakcli.evaluation.workers`: their worker processes).
- :mod:`~trakcli.evaluation.scores`: the store's scores that `trak eval lds` measures.
- :mod:`~trakcli.evaluation.lds`: the linear datamodeling score (LDS) of a score matrix against the retrained
  models, with its bootstrap interval (pure numpy / scipy).
- :mod:`~trakcli.evaluation.qld`: `trak eval qld`, retraining without each query's top proponents.
- :mod:`~trakcli.evaluation.recall`: what `trak eval recall` reads; :mod:`~trakcli.evaluation.ranking`: MRR and
  recall@k of ranked train rows against each query's known source rows (pure numpy / scipy).
- :mod:`~trakcli.evaluation.bm25`: BM25 word-overlap scores, the baseline beside every attribution of text.
- :mod:`~trakcli.evaluation.sweep`: `trak eval sweep`, the LDS over proj_dim, checkpoints and ridge.
"""
