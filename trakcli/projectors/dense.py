"""CPU/GPU implementations over a matrix kind: ``noop``, ``single_block`` and ``basic``."""

from __future__ import annotations

from typing import Any

import torch

from trakcli.projectors.base import Grads, Projector, dtype_name, flatten_grads, grad_items


class NoopProjector(Projector):
    """The identity: features are the flattened gradients (``proj_dim == grad_dim``).

    Useful for tiny models and for checking the rest of the pipeline without projection error.
    """

    implementation = "noop"

    def __init__(self, grad_dim: int, dtype: torch.dtype = torch.float32):
        super().__init__(grad_dim, grad_dim, dtype)

    def spec(self) -> dict[str, Any]:
        return {"kind": "noop", "grad_dim": self.grad_dim, "proj_dim": self.proj_dim, "seed": 0,
                "dtype": dtype_name(self.dtype)}

    def _project(self, grads: Grads, model_id: int) -> torch.Tensor:
        return flatten_grads(grads, self.grad_dim).to(self.dtype, copy=True)

    def _unproject(self, z: torch.Tensor, model_id: int) -> torch.Tensor:
        return z.to(self.dtype, copy=True)


class _MatrixProjector(Projector):
    """A projector computing products with a matrix object from :mod:`.matrices`."""

    def __init__(self, matrix):
        super().__init__(matrix.grad_dim, matrix.proj_dim, matrix.dtype)
        self.matrix = matrix

    def spec(self) -> dict[str, Any]:
        return self.matrix.spec()

    def _unproject_in_steps(self, z: torch.Tensor, model_id: int, step: int) -> torch.Tensor:
        """``z P`` computed ``step`` gradient coordinates at a time."""
        z = z.to(self.dtype)
        out = torch.empty(z.shape[0], self.grad_dim, dtype=self.dtype, device=z.device)
        for a in range(0, self.grad_dim, step):
            b = min(self.grad_dim, a + step)
            out[:, a:b] = self.matrix.unproject_range(z, a, b, model_id)
        return out


class BasicSingleBlockProjector(_MatrixProjector):
    """Generates the whole matrix at once and multiplies in one step.

    The reference implementation: simplest and fastest for small models, but it
    holds all of ``Pᵀ`` (``grad_dim × proj_dim`` floats for a dense kind,
    ``s × grad_dim`` indices for sjlt) of the last ``model_id`` and device used.

    Args:
        matrix: a matrix kind from :mod:`trakcli.projectors.matrices`.
    """

    implementation = "single_block"

    def __init__(self, matrix):
        super().__init__(matrix)
        self._full: tuple[int, str, torch.Tensor] | None = None

    def full(self, model_id: int, device: torch.device) -> torch.Tensor:
        """The matrix of ``model_id`` on ``device`` in the matrix's full form (kept until the next)."""
        if self._full is not None and self._full[:2] == (model_id, str(device)):
            return self._full[2]
        self._full = None  # free the old one before making the new one
        self._full = (model_id, str(device), self.matrix.full(model_id, device))
        return self._full[2]

    def _project(self, grads: Grads, model_id: int) -> torch.Tensor:
        g = flatten_grads(grads, self.grad_dim)
        return self.matrix.project_full(self.full(model_id, g.device), g)

    def _unproject(self, z: torch.Tensor, model_id: int) -> torch.Tensor:
        return self.matrix.unproject_full(self.full(model_id, z.device), z)


class BasicProjector(_MatrixProjector):
    """Block-wise projection with bounded memory; same matrix as :class:`BasicSingleBlockProjector`.

    Walks the gradient columns in steps of ``block_size`` (parameter by parameter for a dict, so the
    concatenated gradient is never built) and accumulates ``g[:, block] @ Pᵀ[block]``. Matrix blocks (rows of
    ``Pᵀ``, about 2²⁴ entries each) come from the matrix's cache (``cache_bytes``): a matrix that fits the
    budget is generated once, not for every batch.

    Memory: the cache budget, plus ``n × block_size`` for an input slice
    converted to the accumulation dtype, plus one generated block.

    Args:
        matrix: a matrix kind from :mod:`trakcli.projectors.matrices`.
        block_size: gradient columns processed per step.
    """

    implementation = "basic"

    def __init__(self, matrix, block_size: int):
        super().__init__(matrix)
        self.block_size = block_size

    def _project(self, grads: Grads, model_id: int) -> torch.Tensor:
        n, items = grad_items(grads, self.grad_dim)
        acc = self.matrix.accumulator(n, items[0][1].device)
        offset = 0
        for _, t in items:
            width = t.shape[1]
            for a in range(0, width, self.block_size):
                self.matrix.add_into(acc, t[:, a : a + self.block_size], offset + a, model_id)
            offset += width
        return self.matrix.finish(acc)

    def _unproject(self, z: torch.Tensor, model_id: int) -> torch.Tensor:
        return self._unproject_in_steps(z, model_id, self.block_size)
