"""Random projections of per-example gradients (the JL step of TRAK, Park et al. 2023).

Public API::

    from trakcli.projectors import make_projector, Projector
    proj = make_projector(kind="rademacher", implementation="basic",
                          grad_dim=9610, proj_dim=256, seed=0)
    feats = proj.project(grads, model_id=0)     # [n, grad_dim] or dict -> [n, proj_dim] float32
    back = proj.unproject(feats, model_id=0)    # [n, proj_dim] -> [n, grad_dim], the adjoint

The matrix is a pure function of ``proj.spec()`` and ``model_id`` (every entry is drawn from Philox4x32-10 with its
coordinates as the counter); the implementation only decides how the product is computed. No I/O here.

The kinds (``kind``: the matrix) and implementations (``implementation``: how the product is computed, same matrix for
one spec) are listed with :func:`make_projector`; a kind is a :class:`~trakcli.projectors.registry.ProjectorKind`
subclass registered by name (:mod:`.registry`; the built-in ones are in :mod:`.kinds`).

Modules: :mod:`.philox` (the generator), :mod:`.matrices` (kinds' matrices), :mod:`.registry` and :mod:`.kinds` (the
kinds), :mod:`.dense` and :mod:`.chunked` (CPU/GPU implementations), :mod:`.cuda` (Triton), :mod:`.factory`
(``make_projector``), :mod:`.base` (input handling).
"""

from __future__ import annotations

from trakcli.projectors.base import Projector
from trakcli.projectors.chunked import ChunkedProjector
from trakcli.projectors.dense import BasicProjector, BasicSingleBlockProjector, NoopProjector
from trakcli.projectors.factory import KINDS, make_projector
from trakcli.projectors.matrices import GEN_ROWS, DenseMatrix, SJLTMatrix
from trakcli.projectors.registry import (
    IMPLEMENTATIONS, OPTIONS, ProjectorKind, projector_kind, register_projector_kind, unregister_projector_kind,
)

__all__ = [
    "GEN_ROWS", "IMPLEMENTATIONS", "KINDS", "OPTIONS", "BasicProjector", "BasicSingleBlockProjector",
    "ChunkedProjector", "DenseMatrix", "NoopProjector", "Projector", "ProjectorKind", "SJLTMatrix",
    "make_projector", "projector_kind", "register_projector_kind", "unregister_projector_kind",
]
