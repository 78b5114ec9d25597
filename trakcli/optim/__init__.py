"""Projected optimizers and subspace parametrizations, built on :mod:`trakcli.projectors`.

* :class:`ProjectedOptimizer`: any ``torch.optim`` optimizer stepping in a
  random subspace (``per_matrix``: GaLore/Flora-style per-matrix projections,
  or with kind ``kronecker`` two-sided ones, ``P_out G P_inᵀ``; ``global``: one
  projection of the whole parameter vector).
* :mod:`trakcli.optim.subspace`: intrinsic-dimension training by
  reparametrization, ``W = W0 + unproject(z)``.
* :mod:`trakcli.optim.transforms`: pre/post-step transforms with ``param_ndim``.
* :class:`ProjectionSettings`: the projection settings, also the schema of the
  config's ``optimize.projection`` (the optimizer never reads the YAML config).

Names are imported on first use: the config imports :mod:`trakcli.optim.settings`
without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trakcli.lazy import lazy_getattr

if TYPE_CHECKING:
    from trakcli.optim import subspace, transforms  # submodules: imported by `from trakcli.optim import subspace`
    from trakcli.optim.projected import ProjectedOptimizer
    from trakcli.optim.settings import ProjectionSettings, resolve_projection
    from trakcli.optim.slots import LINEAR_STATE_KEYS, derive_slot_seed

_LAZY = {
    "ProjectedOptimizer": "trakcli.optim.projected",
    **dict.fromkeys(("ProjectionSettings", "resolve_projection"), "trakcli.optim.settings"),
    **dict.fromkeys(("LINEAR_STATE_KEYS", "derive_slot_seed"), "trakcli.optim.slots"),
}

__all__ = [
    "LINEAR_STATE_KEYS",
    "ProjectedOptimizer",
    "ProjectionSettings",
    "derive_slot_seed",
    "resolve_projection",
    "subspace",
    "transforms",
]

__getattr__ = lazy_getattr(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
