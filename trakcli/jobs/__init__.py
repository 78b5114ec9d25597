"""The jobs: `trak optimize`, `trak featurize`, `trak score` and `trak select` as library functions.

Each takes a validated :class:`~trakcli.config.Config`, raises :class:`~trakcli.errors.TrakError`
subclasses on bad input, and reports progress through a :class:`~trakcli.progress.Reporter`; the CLI
(:mod:`trakcli.cli`) is a thin layer over them. Under ``torchrun`` featurize and score split the row
chunks between the ranks. docs/development.md maps the modules; `trak eval` is :mod:`trakcli.evaluation`.
"""

from trakcli.jobs.featurize import FeaturizeResult, featurize
from trakcli.jobs.optimize import optimize
from trakcli.jobs.score import ScoreResult, finalize_and_score, score

__all__ = ["FeaturizeResult", "ScoreResult", "featurize", "finalize_and_score", "optimize", "score"]
