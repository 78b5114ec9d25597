"""Kronecker-projected per-example gradients from layer factors (LoGra, Choe et al. 2024).

Public API::

    from trakcli.factors import KroneckerFeaturizer
    feat = KroneckerFeaturizer(model, proj_dim=2048, seed=0, grad_wrt=None, task="classification")
    print(feat.info)                               # covered layers, left-out parameters, fraction covered
    phi, q = feat(inputs, labels, model_id=0)      # [n, proj_dim] float32, [n] float32
    feat.projector.spec()                          # kind "kronecker": the store identity

Modules: :mod:`.layers` (which modules are covered, :func:`find_layers`) and
:mod:`.featurizer` (one forward + one backward per batch, :class:`KroneckerFeaturizer`).
The projector itself is :class:`trakcli.projectors.kronecker.KroneckerProjector`.
"""

from trakcli.factors.featurizer import KroneckerFeaturizer
from trakcli.factors.layers import SUPPORTED, LayerUse, coverage_info, find_layers, module_kind

__all__ = ["SUPPORTED", "KroneckerFeaturizer", "LayerUse", "coverage_info", "find_layers", "module_kind"]
