"""The built-in projector kinds: ``noop``, ``rademacher``, ``normal``, ``sjlt`` and ``kronecker``.

Each is a :class:`~trakcli.projectors.registry.ProjectorKind` registered by name; see
:mod:`trakcli.projectors.registry` for the contract and how to add a kind. No torch
at import (the config validates ``projector.kind`` against the registry).
"""

from __future__ import annotations

import logging
from typing import Any

from trakcli.errors import ProjectorError
from trakcli.projectors.registry import ProjectorKind, register_projector_kind

logger = logging.getLogger("trakcli.projectors")

#: Options of ``projector:`` that kind ``kronecker`` takes besides proj_dim and seed (values checked by the projector).
KRONECKER_OPTIONS = {
    "dtype": "float32 (default) or float64 accumulation",
    "distribution": "rademacher (default, ±1/√k) or normal (N(0, 1/k)) factor entries",
    "split": "how proj_dim is shared among the layers: equal (default, equal shares) or size (in proportion "
    "to each layer's gradient entries d_out·d_in, as a projection of the whole gradient spreads them)",
}


@register_projector_kind
class Noop(ProjectorKind):
    """The identity: features are the ``grad_dim`` gradient entries; ``proj_dim`` is ignored."""

    name = "noop"
    summary = "the identity: proj_dim = grad_dim"
    needs_proj_dim = False

    def __init__(self, *, grad_dim: int, proj_dim: int | None, seed: int, dtype: Any, **options: Any):
        if proj_dim is not None and proj_dim != grad_dim:
            # a config always carries a proj_dim (default 2048): say it is unused, do not fail
            logger.warning("projector kind 'noop' keeps every gradient coordinate: features have "
                           "grad_dim=%d columns, proj_dim=%r is ignored", grad_dim, proj_dim)
        super().__init__(grad_dim=grad_dim, proj_dim=None, seed=seed, dtype=dtype, **options)

    def resolve_implementation(self, implementation: str) -> str:
        """Any implementation but ``cuda`` is the identity (``"noop"``)."""
        if implementation == "cuda":
            raise ProjectorError("kind 'noop' has no cuda implementation; use implementation: auto")
        return "noop"

    def check_memory(self, implementation: str) -> None:
        """The identity holds nothing beside the gradient."""

    def matrix_bytes(self) -> int:
        return 0

    def build(self, implementation: str, *, cache_bytes: int, block_size: int, max_chunk_size: int) -> Any:
        from trakcli.projectors.dense import NoopProjector

        return NoopProjector(self.grad_dim, self.dtype)


class _Dense(ProjectorKind):
    """A dense matrix generated block by block (:class:`~trakcli.projectors.matrices.DenseMatrix`)."""

    implementations = ("single_block", "basic", "chunked", "cuda")

    def matrix(self, cache_bytes: int) -> Any:
        from trakcli.projectors.matrices import DenseMatrix

        return DenseMatrix(self.name, self.grad_dim, self.proj_dim, self.seed, self.dtype, cache_bytes)


@register_projector_kind
class Rademacher(_Dense):
    """Entries ±1/√proj_dim (Achlioptas 2003)."""

    name = "rademacher"
    summary = "±1/√proj_dim entries"


@register_projector_kind
class Normal(_Dense):
    """Entries N(0, 1/proj_dim) (Johnson & Lindenstrauss 1984)."""

    name = "normal"
    summary = "N(0, 1/proj_dim) entries"


@register_projector_kind
class SJLT(ProjectorKind):
    """Sparse JL / CountSketch: ``s`` entries ±1/√s per gradient coordinate (Kane & Nelson 2014).

    Raises:
        ProjectorError: ``s`` not an int in ``[1, proj_dim]``.
    """

    name = "sjlt"
    summary = "sparse JL / CountSketch, s entries ±1/√s per gradient coordinate"
    options = {"s": "nonzeros per gradient coordinate, 1 <= s <= proj_dim (default 1)"}

    def __init__(self, *, grad_dim: int, proj_dim: int | None, seed: int, dtype: Any, **options: Any):
        from trakcli.projectors.base import check_int

        super().__init__(grad_dim=grad_dim, proj_dim=proj_dim, seed=seed, dtype=dtype, **options)
        self.s = check_int("s", options.get("s", 1), 1, "e.g. s: 1 (CountSketch) or s: 4")
        if self.s > self.proj_dim:
            raise ProjectorError(f"projector option s={self.s} is larger than proj_dim={self.proj_dim}; sjlt puts s "
                                 "nonzeros in distinct features, so use s <= proj_dim")

    def matrix_bytes(self) -> int:
        return self.s * self.grad_dim * 8  # int64 indices

    def memory_floor(self, implementation: str) -> tuple[int, str]:
        """A ``2 * proj_dim`` accumulator (sign folded into the index); the indices for ``single_block``."""
        row = 2 * self.proj_dim * self.dtype.itemsize
        if implementation == "single_block":
            return row + self.matrix_bytes(), f"the whole {self.grad_dim} x {self.proj_dim} matrix"
        return row, f"a {self.proj_dim}-wide accumulator per example"

    def matrix(self, cache_bytes: int) -> Any:
        from trakcli.projectors.matrices import SJLTMatrix

        return SJLTMatrix(self.grad_dim, self.proj_dim, self.seed, self.dtype, cache_bytes, s=self.s)


@register_projector_kind
class Kronecker(ProjectorKind):
    """Per layer ``P_out ⊗ P_in`` from the layer's inputs and output gradients (LoGra, Choe et al. 2024).

    Built from the model (:class:`trakcli.gradients.KroneckerFeaturizer`), never by ``make_projector``.
    """

    name = "kronecker"
    summary = "per-layer P_out ⊗ P_in from one forward + backward"
    options = KRONECKER_OPTIONS
    implementations = ()
    built_from_model = ("projector kind 'kronecker' is built from the model, not from a gradient dimension: use "
                        "trakcli.gradients.KroneckerFeaturizer(model, proj_dim=..., seed=...) (projector.kind: "
                        "kronecker in a config), or trakcli.projectors.kronecker.KroneckerProjector(layers, proj_dim) "
                        "for given layer shapes")

    @classmethod
    def implementation_error(cls, implementation: str) -> str | None:
        if implementation == "auto":
            return None
        return ("kind kronecker has one implementation (factors from layer hooks in one forward + backward, "
                "no [n, grad_dim] gradient); remove projector.implementation or set it to auto")
