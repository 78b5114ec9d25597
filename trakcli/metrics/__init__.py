"""Statistics of attribution scores, pure numpy / scipy.

- :mod:`trakcli.metrics.lds`: the linear datamodeling score (LDS) of a score
  matrix against models retrained on random subsets, with its bootstrap interval.
- :mod:`trakcli.metrics.recall`: fact tracing, MRR and recall@k of ranked train
  rows against each query's known source rows, with bootstrap intervals.
"""
