"""Counterfactual statistics of attribution scores, pure numpy / scipy.

- :mod:`trakcli.metrics.lds`: the linear datamodeling score (LDS) of a score
  matrix against models retrained on random subsets, with its bootstrap interval.
"""
