"""The jobs: `trak optimize`, `trak featurize`, `trak score` and `trak eval` as library functions.

Each takes a validated :class:`~trakcli.config.Config`, raises
:class:`~trakcli.errors.TrakError` subclasses on bad input, and reports progress
through a :class:`~trakcli.progress.Reporter`; the CLI (:mod:`trakcli.cli`) is a
thin layer over them. Under ``torchrun`` featurize and score split the row
chunks between the ranks.

Modules:

- :mod:`~trakcli.jobs.runtime`: device, threads, the store lock, the test event hook.
- :mod:`~trakcli.jobs.setup`: model, per-example gradients, projector, data and
  the run identity shared by featurize and score; the featurizer of a batch.
- :mod:`~trakcli.jobs.featurize`: train features, chunk by chunk, into the store.
- :mod:`~trakcli.jobs.score`: target features, kernels, the score matrix.
- :mod:`~trakcli.jobs.optimize`: N seeded models (trained by :mod:`trakcli.train`), checkpoints and
  their manifest.

`trak eval` (retraining, LDS, QLD, recall, sweep) is :mod:`trakcli.evaluation`.
"""

from trakcli.jobs.featurize import FeaturizeResult, featurize
from trakcli.jobs.optimize import optimize
from trakcli.jobs.score import ScoreResult, finalize_and_score, score

__all__ = ["FeaturizeResult", "ScoreResult", "featurize", "finalize_and_score", "optimize", "score"]
