"""Per-example gradients and their per-layer factors: exact gradients from layer hooks or torch.func.vmap, and
Kronecker projections from layer factors (LoGra, Choe et al. 2024) without any per-example gradient.

Public API::

    from trakcli.gradients import KroneckerFeaturizer
    feat = KroneckerFeaturizer(model, proj_dim=2048, seed=0, grad_wrt=None, task="classification")
    print(feat.info)                               # covered layers, left-out parameters, fraction covered
    phi, q = feat(inputs, labels, model_id=0)      # [n, proj_dim] float32, [n] float32
    feat.projector.spec()                          # kind "kronecker": the store identity

    from trakcli.gradients import per_example_gradients
    grads = per_example_gradients(model, grad_wrt=None, task="classification", method="auto")
    g, q = grads(inputs, labels)                   # g[name]: [n, *param.shape]; q: [n] float32
    grads.method, grads.reason                     # "hooks" / "vmap", and why vmap (auto), to report once

The modules are named in docs/development.md; the projector itself is
:class:`trakcli.projectors.kronecker.KroneckerProjector`.
"""

from trakcli.gradients.featurizer import KroneckerFeaturizer
from trakcli.gradients.hooks import HookPass
from trakcli.gradients.kinds import KINDS, KRONECKER_KINDS, Kind, kind_of
from trakcli.gradients.layers import HOOKED, SUPPORTED, Use, coverage_info, find_uses
from trakcli.gradients.per_example import METHODS, LayerGradients, check_method, per_example_gradients
from trakcli.gradients.second_moment import SecondMoment

__all__ = [
    "HOOKED", "KINDS", "KRONECKER_KINDS", "METHODS", "SUPPORTED", "HookPass", "Kind", "KroneckerFeaturizer",
    "LayerGradients", "SecondMoment", "Use", "check_method", "coverage_info", "find_uses", "kind_of", "per_example_gradients",
]
