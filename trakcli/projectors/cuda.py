"""``CudaProjector``: a fused Triton kernel that generates the matrix tile by tile, never stored.

Each program computes a ``[BLOCK_M, BLOCK_N]`` tile of the features: it walks the gradient coordinates in steps of
``BLOCK_K``, regenerates the ``[BLOCK_K, BLOCK_N]`` tile of ``Pᵀ`` from Philox4x32-10 with exactly the counters, key,
bit layout and Box-Muller transform of :class:`trakcli.projectors.matrices.DenseMatrix` (the CPU reference), and
accumulates ``tl.dot`` products in float32 (``input_precision="ieee"``, no TF32). Rademacher entries are bit-identical
to the reference; normal entries agree to a few float32 ulps (``log``/``cos``/``sin`` differ between libdevice and the
CPU math library). Features computed on a GPU can therefore be scored against targets projected on a CPU with
``basic`` or ``chunked``.

Triton is optional (``pip install 'trakcli-attribution[cuda]'``), imported when a kernel is first built.
Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (the tests); CPU tensors without the interpreter
get the CPU reference's product.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from trakcli.errors import ProjectorError
from trakcli.projectors.base import Grads, flatten_grads
from trakcli.projectors.dense import _MatrixProjector
from trakcli.projectors.matrices import DenseMatrix

_KERNELS: dict[bool, Any] = {}


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1``: kernels then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def kernels():
    """The kernel module (``project_kernel``, ``unproject_kernel``), loaded afresh once per interpreter setting
    (so the current ``TRITON_INTERPRET`` applies)."""
    mode = interpreting()
    if mode not in _KERNELS:
        if importlib.util.find_spec("triton") is None:
            raise ProjectorError("the cuda projector needs triton, which is not installed: pip install "
                                 "'trakcli-attribution[cuda]' (or use implementation: basic, same matrix)")
        spec = importlib.util.find_spec("trakcli.projectors._triton_kernels")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _KERNELS[mode] = module
    return _KERNELS[mode]


class CudaProjector(_MatrixProjector):
    """Dense projection by a fused Triton kernel; same matrix as ``basic`` (its CPU reference).

    Memory: the input, the output, and nothing of size ``grad_dim × proj_dim``; cost per batch is the matmul plus
    regenerating each matrix tile once per ``BLOCK_M`` rows of the batch. Any batch size, any ``proj_dim``.

    Args:
        matrix: a :class:`~trakcli.projectors.matrices.DenseMatrix` (float32).
        block_m, block_n, block_k: tile sizes (each >= 16, powers of two).
    """

    implementation = "cuda"

    def __init__(self, matrix: DenseMatrix, block_m: int = 32, block_n: int = 64, block_k: int = 32):
        if not isinstance(matrix, DenseMatrix) or matrix.dtype != torch.float32:
            raise ProjectorError("the cuda projector implements the dense kinds rademacher and normal with float32 "
                                 "accumulation; use implementation: basic for other kinds or dtypes")
        super().__init__(matrix)
        self.blocks = (block_m, block_n, block_k)
        self._kind_code = 0 if matrix.kind == "rademacher" else 1

    def _launch(self, kernel: str, x: torch.Tensor, out_dim: int, tile: int, model_id: int) -> torch.Tensor:
        """Run ``kernel`` on the rows of ``x`` into a new ``[n, out_dim]`` float32 tensor (``out_dim`` in tiles)."""
        n = x.shape[0]
        out = torch.empty(n, out_dim, dtype=torch.float32, device=x.device)
        bm, bn, bk = self.blocks
        k0, k1 = self.matrix.key(model_id)
        grid = (-(-n // bm), -(-out_dim // tile))
        getattr(kernels(), kernel)[grid](x, out, n, self.grad_dim, self.proj_dim, x.stride(0), x.stride(1),
                                         out.stride(0), out.stride(1), k0, k1, self.matrix.scale,
                                         KIND=self._kind_code, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
        return out

    def _project(self, grads: Grads, model_id: int) -> torch.Tensor:
        g = flatten_grads(grads, self.grad_dim)
        if not (g.is_cuda or interpreting()):
            return self.matrix.project_full(self.matrix.full(model_id, g.device), g)
        return self._launch("project_kernel", g, self.proj_dim, self.blocks[1], model_id)

    def _unproject(self, z: torch.Tensor, model_id: int) -> torch.Tensor:
        if not (z.is_cuda or interpreting()):
            return self.matrix.unproject_full(self.matrix.full(model_id, z.device), z)
        return self._launch("unproject_kernel", z, self.grad_dim, self.blocks[2], model_id)
