"""The random matrices (projector *kinds*), independent of how a product with them is computed.

A matrix object knows how to produce any range of rows of ``Pᵀ``
(``[grad_dim, proj_dim]``) for a given ``model_id`` and how to multiply a slice
of the gradient by it. Implementations (``single_block``, ``basic``,
``chunked``, ``cuda``) only decide the traversal, so they agree on the matrix
by construction.

Kinds:
    * ``rademacher``: entries ±1/√proj_dim, independent fair signs.
    * ``normal``: entries N(0, 1/proj_dim).
    * ``sjlt``: sparse JL / CountSketch (see :class:`SJLTMatrix`).

Both dense kinds satisfy E‖Pg‖² = ‖g‖² (Achlioptas 2003, "Database-friendly
random projections"; Johnson & Lindenstrauss 1984).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trakcli.projectors.base import GEN_ROWS, BlockCache, derive_seed, scale_for

# Tags mixed into the seed so that kinds never share random streams.
_TAGS = {"rademacher": 0x5241, "normal": 0x4E4F, "sjlt": 0x534A}

# byte value -> its 8 bits as ±1 (bit i, least significant first, gives column i).
_SIGN_LUT = torch.tensor(
    [[1.0 if (b >> i) & 1 else -1.0 for i in range(8)] for b in range(256)], dtype=torch.float32
)


class DenseMatrix:
    """A dense random matrix ``P`` ``[proj_dim, grad_dim]`` generated block by block.

    Block ``b`` holds rows ``[b·GEN_ROWS, (b+1)·GEN_ROWS)`` of ``Pᵀ`` and is drawn
    from a ``torch.Generator`` (Mersenne Twister) seeded with
    ``derive_seed(tag(kind), seed, model_id, b)``; nothing else influences it.

    * rademacher: ``GEN_ROWS·proj_dim/64`` random int64 words, each byte's
      bits expanded to 8 signs through a lookup table (64 signs per RNG draw,
      about 5x faster than ``torch.randint(0, 2)``).
    * normal: ``torch.randn`` of the block.

    Entries are float32 values; ``dtype`` only sets the accumulation precision.

    Args:
        kind: ``"rademacher"`` or ``"normal"``.
        grad_dim: gradient coordinates (columns of ``P``).
        proj_dim: features (rows of ``P``).
        seed: base seed, an int >= 0.
        dtype: accumulation dtype, float32 or float64.
        cache_bytes: byte budget of the LRU cache of generated blocks (0: none).
    """

    generator = "torch"

    def __init__(
        self,
        kind: str,
        grad_dim: int,
        proj_dim: int,
        seed: int,
        dtype: torch.dtype = torch.float32,
        cache_bytes: int = 0,
    ):
        self.kind = kind
        self.grad_dim = grad_dim
        self.proj_dim = proj_dim
        self.seed = seed
        self.dtype = dtype
        self.scale = scale_for(proj_dim)
        self.n_blocks = math.ceil(grad_dim / GEN_ROWS)
        self.cache = BlockCache(cache_bytes)

    def spec(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "grad_dim": self.grad_dim,
            "proj_dim": self.proj_dim,
            "seed": self.seed,
            "dtype": str(self.dtype).removeprefix("torch."),
            "generator": self.generator,
            "gen_rows": GEN_ROWS,
        }

    # -- generation ---------------------------------------------------------------------------

    def generate_block(self, model_id: int, b: int) -> torch.Tensor:
        """Rows ``[b·GEN_ROWS, (b+1)·GEN_ROWS)`` of ``Pᵀ`` (not cut at grad_dim), CPU float32.

        Returns:
            ``[GEN_ROWS, proj_dim]`` float32 tensor on the CPU.
        """
        g = torch.Generator(device="cpu")
        g.manual_seed(derive_seed(_TAGS[self.kind], self.seed, model_id, b))
        if self.kind == "rademacher":
            n_words = GEN_ROWS * self.proj_dim // 64  # GEN_ROWS is a multiple of 64
            words = torch.randint(
                -(2**63), 2**63 - 1, (n_words,), generator=g, dtype=torch.int64
            )
            lut = _SIGN_LUT * self.scale
            signs = lut.index_select(0, words.view(torch.uint8).to(torch.int32))
            return signs.view(GEN_ROWS, self.proj_dim)
        out = torch.randn(GEN_ROWS, self.proj_dim, generator=g, dtype=torch.float32)
        return out.mul_(self.scale)

    def block(self, model_id: int, b: int, device: torch.device) -> torch.Tensor:
        """Block ``b`` of ``Pᵀ`` in the accumulation dtype on ``device``, cut at ``grad_dim``.

        Served from the cache when present; stored in it when the budget allows.
        """
        key = (model_id, b, str(device))
        blk = self.cache.get(key)
        if blk is None:
            blk = self.generate_block(model_id, b)
            stop = min(GEN_ROWS, self.grad_dim - b * GEN_ROWS)
            if stop < GEN_ROWS:
                blk = blk[:stop]
            blk = blk.to(device=device, dtype=self.dtype).contiguous()
            self.cache.put(key, blk)
        return blk

    def _pieces(self, start: int, stop: int):
        """Yield ``(b, lo, hi, offset)``: rows ``[lo, hi)`` of block ``b`` are rows
        ``[offset, offset + hi - lo)`` of the range ``[start, stop)``."""
        b = start // GEN_ROWS
        while b * GEN_ROWS < stop:
            base = b * GEN_ROWS
            lo = max(start, base) - base
            hi = min(stop, base + GEN_ROWS) - base
            yield b, lo, hi, base + lo - start
            b += 1

    # -- products -----------------------------------------------------------------------------

    def rows(self, model_id: int, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``Pᵀ``: ``[stop - start, proj_dim]`` in the accumulation dtype."""
        parts = [self.block(model_id, b, device)[lo:hi] for b, lo, hi, _ in self._pieces(start, stop)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def project_into(self, out: torch.Tensor, g: torch.Tensor, start: int, model_id: int) -> None:
        """``out += g @ Pᵀ[start:start + g.shape[1]]``.

        Args:
            out: ``[n, proj_dim]`` accumulator in the accumulation dtype.
            g: ``[n, L]`` gradient columns ``[start, start + L)``, any float dtype.
            start: first gradient coordinate of ``g``.
            model_id: checkpoint index.
        """
        g = g.to(self.dtype)
        for b, lo, hi, off in self._pieces(start, start + g.shape[1]):
            out.addmm_(g[:, off : off + hi - lo], self.block(model_id, b, out.device)[lo:hi])

    def unproject_range(self, z: torch.Tensor, start: int, stop: int, model_id: int) -> torch.Tensor:
        """``z @ Pᵀ[start:stop]ᵀ``: ``[n, stop - start]`` in the accumulation dtype.

        Args:
            z: ``[n, proj_dim]`` already in the accumulation dtype.
        """
        out = torch.empty(z.shape[0], stop - start, dtype=self.dtype, device=z.device)
        for b, lo, hi, off in self._pieces(start, stop):
            out[:, off : off + hi - lo] = z @ self.block(model_id, b, z.device)[lo:hi].T
        return out
