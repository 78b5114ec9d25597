"""Projected optimizers and subspace parametrizations, built on :mod:`trakcli.projectors`.

* :class:`ProjectedOptimizer`: any ``torch.optim`` optimizer stepping in a random subspace (``per_matrix``:
  GaLore/Flora-style per-matrix projections, or with kind ``kronecker`` two-sided ones, ``P_out G P_inᵀ``; ``global``:
  one projection of the whole parameter vector).
* :mod:`trakcli.optim.subspace`: intrinsic-dimension training by reparametrization, ``W = W0 + unproject(z)``.
* :mod:`trakcli.optim.transforms`: pre/post-step transforms with ``param_ndim``.
* :class:`ProjectionSettings`: the projection settings, also the schema of the
  config's ``optimize.projection`` (the optimizer never reads the YAML config).
"""

from __future__ import annotations

from trakcli.optim import subspace, transforms
from trakcli.optim.projected import ProjectedOptimizer
from trakcli.optim.settings import ProjectionSettings, resolve_projection
from trakcli.optim.slots import LINEAR_STATE_KEYS, derive_slot_seed

__all__ = ["LINEAR_STATE_KEYS", "ProjectedOptimizer", "ProjectionSettings", "derive_slot_seed", "resolve_projection",
           "subspace", "transforms"]
