"""``ChunkedProjector``: project per-parameter gradients chunk by chunk, never building ``[n, grad_dim]``."""

from __future__ import annotations

import torch

from trakcli.projectors.base import Grads, grad_items
from trakcli.projectors.dense import _MatrixProjector
from trakcli.projectors.matrices import DenseMatrix

#: Pieces narrower than this are concatenated into one matmul (dense kinds).
JOIN_BELOW = 4096


class ChunkedProjector(_MatrixProjector):
    """Splits the parameter vector into chunks of at most ``max_chunk_size`` entries.

    The per-parameter gradients (a dict, in its order; a plain ``[n, grad_dim]`` tensor is one parameter) are packed
    into consecutive chunks: small parameters are concatenated together, a parameter larger than ``max_chunk_size`` is
    split across chunks. Each chunk ``[n, ≤max_chunk_size]`` is projected with the rows of ``Pᵀ`` of its global
    coordinates and the results are summed, so this computes the same matrix as ``basic`` and ``single_block`` for any
    kind (dense or sjlt), and the full ``[n, grad_dim]`` gradient never exists.

    Peak memory beyond the input: one chunk (``n × max_chunk_size``), one generated matrix block (about 2²⁴ entries,
    64 MB of float32), the accumulator, and the matrix cache (``cache_bytes``; ``auto`` caches nothing when the matrix
    exceeds min(4 GiB, RAM/4)) — independent of ``grad_dim``.

    Args:
        matrix: a matrix kind from :mod:`trakcli.projectors.matrices`.
        max_chunk_size: most gradient entries per chunk.
    """

    implementation = "chunked"

    def __init__(self, matrix, max_chunk_size: int):
        super().__init__(matrix)
        self.max_chunk_size = max_chunk_size

    def chunk_parts(self, grads: Grads):
        """Yield ``(start, parts)``: consecutive views ``[n, L_i]`` of the gradient that together
        hold the entries ``[start, start + ΣL_i)`` of the parameter vector, ``ΣL_i <= max_chunk_size``."""
        n, items = grad_items(grads, self.grad_dim)
        pending: list[torch.Tensor] = []
        width = start = 0
        for _, t in items:
            pos = 0
            while pos < t.shape[1]:
                take = min(self.max_chunk_size - width, t.shape[1] - pos)
                pending.append(t[:, pos : pos + take])
                width += take
                pos += take
                if width == self.max_chunk_size:
                    yield start, pending
                    start += width
                    pending, width = [], 0
        if pending:
            yield start, pending

    def _project(self, grads: Grads, model_id: int) -> torch.Tensor:
        acc = None
        for start, parts in self.chunk_parts(grads):
            if acc is None:
                acc = self.matrix.accumulator(parts[0].shape[0], parts[0].device)
            # Small parameters are joined so that a dense chunk is one matmul; large pieces
            # (and every sjlt piece: a scatter gains nothing from joining) go in as views.
            if len(parts) > 1 and isinstance(self.matrix, DenseMatrix):
                small = [p for p in parts if p.shape[1] < JOIN_BELOW]
                if len(small) > 1:
                    self.matrix.add_into(acc, torch.cat([p.to(self.dtype) for p in parts], dim=1), start, model_id)
                    continue
            for part in parts:
                self.matrix.add_into(acc, part, start, model_id)
                start += part.shape[1]
        return self.matrix.finish(acc)

    def _unproject(self, z: torch.Tensor, model_id: int) -> torch.Tensor:
        return self._unproject_in_steps(z, model_id, self.max_chunk_size)
