"""Projected optimizers and subspace parametrizations, built on :mod:`trakcli.projectors`.

* :class:`ProjectedOptimizer`: any ``torch.optim`` optimizer stepping in a
  random subspace (``per_matrix``: GaLore/Flora-style per-matrix projections;
  ``global``: one projection of the whole parameter vector).
* :mod:`trakcli.optim.subspace`: intrinsic-dimension training by
  reparametrization, ``W = W0 + unproject(z)``.
* :mod:`trakcli.optim.transforms`: pre/post-step transforms with ``param_ndim``.
"""

from trakcli.optim import subspace, transforms
from trakcli.optim.projected import ProjectedOptimizer
from trakcli.optim.slots import LINEAR_STATE_KEYS, derive_slot_seed, resolve_projection

__all__ = ["LINEAR_STATE_KEYS", "ProjectedOptimizer", "derive_slot_seed", "resolve_projection", "subspace", "transforms"]
