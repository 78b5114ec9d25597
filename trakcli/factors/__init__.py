"""Per-layer factors of per-example gradients: Kronecker projections (LoGra, Choe et al. 2024) and exact gradients.

Public API::

    from trakcli.factors import KroneckerFeaturizer
    feat = KroneckerFeaturizer(model, proj_dim=2048, seed=0, grad_wrt=None, task="classification")
    print(feat.info)                               # covered layers, left-out parameters, fraction covered
    phi, q = feat(inputs, labels, model_id=0)      # [n, proj_dim] float32, [n] float32
    feat.projector.spec()                          # kind "kronecker": the store identity

    from trakcli.factors import per_example_gradients
    grads = per_example_gradients(model, grad_wrt=None, task="classification", method="auto")
    g, q = grads(inputs, labels)                   # g[name]: [n, *param.shape]; q: [n] float32
    grads.method, grads.reason                     # "hooks" / "vmap", and why vmap (auto), to report once

Modules: :mod:`.layers` (which modules are covered, :func:`find_layers`),
:mod:`.featurizer` (one forward + one backward per batch, :class:`KroneckerFeaturizer`) and
:mod:`.per_example` (exact per-example gradients from the same hooks, :class:`LayerGradients`,
no torch.func; :func:`per_example_gradients` chooses it or torch.func.vmap).
The projector itself is :class:`trakcli.projectors.kronecker.KroneckerProjector`.
"""

from trakcli.factors.featurizer import KroneckerFeaturizer
from trakcli.factors.layers import SUPPORTED, LayerUse, coverage_info, find_layers, module_kind
from trakcli.factors.per_example import (
    HOOKED, METHODS, GradUse, LayerGradients, check_method, gradient_uses, norm_kind, per_example_gradients,
)

__all__ = [
    "HOOKED", "METHODS", "SUPPORTED", "GradUse", "KroneckerFeaturizer", "LayerGradients", "LayerUse", "check_method",
    "coverage_info", "find_layers", "gradient_uses", "module_kind", "norm_kind", "per_example_gradients",
]
