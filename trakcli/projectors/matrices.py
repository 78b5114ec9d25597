"""The random matrices of the kinds (:mod:`.kinds`), independent of how a product with them is computed.

A matrix object produces any range of rows of ``Pᵀ`` (``[grad_dim, proj_dim]``) for a ``model_id`` and multiplies
a slice of the gradient by it; implementations (``single_block``, ``basic``, ``chunked``, ``cuda``) only decide
the traversal, so they agree on the matrix by construction. Every entry is drawn from Philox4x32-10
(:mod:`.philox`) with a counter made of its own coordinates and a key made of ``(kind, seed, model_id)``, so it
never depends on which block, chunk, batch, device or process asks for it. E‖Pg‖² = ‖g‖² for every kind.
"""

from __future__ import annotations

import math
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from trakcli.projectors.base import BlockCache, dtype_name
from trakcli.projectors.philox import M32, box_muller, matrix_key, philox4x32, uniform_from_bits

#: Cached blocks hold a multiple of GEN_ROWS rows of ``Pᵀ`` and about BLOCK_ENTRIES entries (64 MB of float32): big
#: enough for efficient matmuls, small enough to bound memory. Only a caching granularity: the matrix does not depend
#: on it.
GEN_ROWS = 1024
BLOCK_ENTRIES = 2**24
#: Philox counters generated per step, so temporaries stay in cache and below torch's intra-op parallel grain (many
#: small ops are cheaper single-threaded than synchronized).
COUNTERS_PER_STEP = 2**15

GENERATOR = "philox4x32-10"

# Mixed into the key so that kinds never share random streams.
TAGS = {"rademacher": 0x5241, "normal": 0x4E4F, "sjlt": 0x534A}

#: Columns of one rademacher Philox call (128 bits) and of one normal call (4 words).
RADEMACHER_GROUP = 128
NORMAL_GROUP = 4

#: The sign lookup reads each 32-bit word as 4 bytes, least significant first.
LITTLE_ENDIAN = sys.byteorder == "little"

# byte value -> its 8 bits as ±1 (bit i, least significant first, gives column i).
_SIGN_LUT = torch.tensor([[1.0 if (b >> i) & 1 else -1.0 for i in range(8)] for b in range(256)], dtype=torch.float32)


def _rows_counter(start: int, stop: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.arange(start, stop, dtype=torch.int64, device=device)
    return rows & M32, rows >> 32


def run_steps(fn, start: int, stop: int, step: int, device) -> None:
    """Call ``fn(a, b)`` for consecutive ranges ``[a, b)`` of ``[start, stop)`` (disjoint rows, any order).

    On a CPU the steps run single-threaded in a pool of ``torch.get_num_threads()`` Python threads:
    their many small elementwise ops cost less that way than synchronizing torch's intra-op pool.
    """
    ranges = [(a, min(stop, a + step)) for a in range(start, stop, step)]
    threads = torch.get_num_threads()
    if torch.device(device).type != "cpu" or threads == 1 or len(ranges) == 1:
        for a, b in ranges:
            fn(a, b)
        return
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            for f in [pool.submit(fn, a, b) for a, b in ranges]:
                f.result()
    finally:
        torch.set_num_threads(threads)


class _Matrix:
    """Common parts: dims, key, cache of generated blocks (of about BLOCK_ENTRIES, ``row_entries`` per row)."""

    kind = ""

    def __init__(self, grad_dim, proj_dim, seed, dtype, cache_bytes, row_entries):
        self.grad_dim, self.proj_dim, self.seed, self.dtype = grad_dim, proj_dim, seed, dtype
        self.scale = 1.0 / math.sqrt(proj_dim)  # E‖Pg‖² = ‖g‖² for ±1 or N(0, 1) entries
        self.cache = BlockCache(cache_bytes)
        self.block_rows = max(GEN_ROWS, BLOCK_ENTRIES // row_entries // GEN_ROWS * GEN_ROWS)

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "grad_dim": self.grad_dim, "proj_dim": self.proj_dim, "seed": self.seed,
                "dtype": dtype_name(self.dtype), "generator": GENERATOR}

    def key(self, model_id: int) -> tuple[int, int]:
        """Philox key of this matrix for ``model_id``."""
        return matrix_key(TAGS[self.kind], self.seed, model_id)

    def generate(self, model_id: int, start: int, stop: int, device: torch.device):
        raise NotImplementedError

    def full(self, model_id: int, device: torch.device) -> torch.Tensor:
        """All of the matrix, generated at once (not cached): what :meth:`generate` returns for every row."""
        return self.generate(model_id, 0, self.grad_dim, device)

    def block(self, model_id: int, b: int, device: torch.device):
        """Rows ``[b·block_rows, min((b+1)·block_rows, grad_dim))`` of ``Pᵀ``, from the cache if there."""
        key = (model_id, b, str(device))
        blk = self.cache.get(key)
        if blk is None:
            start = b * self.block_rows
            blk = self.generate(model_id, start, min(start + self.block_rows, self.grad_dim), device)
            self.cache.put(key, blk)
        return blk

    def pieces(self, start: int, stop: int):
        """Yield ``(b, lo, hi, offset)``: rows ``[lo, hi)`` of block ``b`` are rows
        ``[offset, offset + hi - lo)`` of the range ``[start, stop)``."""
        size = self.block_rows
        for b in range(start // size, -(-stop // size)):
            base = b * size
            lo, hi = max(start, base) - base, min(stop, base + size) - base
            yield b, lo, hi, base + lo - start

    def add_into(self, acc: torch.Tensor, g: torch.Tensor, start: int, model_id: int) -> None:
        """``acc += g @ Pᵀ[start:start + L]``, in the accumulator's form.

        Args:
            acc: accumulator from :meth:`accumulator`.
            g: ``[n, L]`` gradient columns ``[start, start + L)``, any float dtype.
            start: first gradient coordinate of ``g``.
            model_id: checkpoint index.
        """
        g = g.to(self.dtype)
        for b, lo, hi, off in self.pieces(start, start + g.shape[1]):
            self._add(acc, g[:, off : off + hi - lo], self._rows(self.block(model_id, b, acc.device), lo, hi))

    def unproject_range(self, z: torch.Tensor, start: int, stop: int, model_id: int) -> torch.Tensor:
        """``z @ Pᵀ[start:stop]ᵀ``: ``[n, stop - start]``; ``z`` ``[n, proj_dim]`` in the accumulation dtype."""
        out = torch.empty(z.shape[0], stop - start, dtype=self.dtype, device=z.device)
        for b, lo, hi, off in self.pieces(start, stop):
            out[:, off : off + hi - lo] = self._gather(z, self._rows(self.block(model_id, b, z.device), lo, hi))
        return out

    def project_full(self, full: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``g @ Pᵀ`` with ``full`` from :meth:`full`: ``[n, grad_dim] -> [n, proj_dim]``."""
        g = g.to(self.dtype)
        acc = self.accumulator(g.shape[0], g.device)
        self._add(acc, g, full)
        return self.finish(acc)

    def unproject_full(self, full: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``z @ P`` with ``full`` from :meth:`full`: ``[n, proj_dim] -> [n, grad_dim]``."""
        return self._gather(z.to(self.dtype), full)


class DenseMatrix(_Matrix):
    """A dense random matrix ``P`` ``[proj_dim, grad_dim]``: kinds ``rademacher`` (Achlioptas 2003) and ``normal``
    (Johnson & Lindenstrauss 1984).

    Entry ``Pᵀ[r, c]`` comes from the Philox call with counter ``(c // G, r mod 2**32, r >> 32, 0)``:

    * rademacher (``G = 128``): bit ``c mod 32`` of word ``(c mod 128) // 32``
      gives the sign (1 → +, 0 → −), times 1/√proj_dim;
    * normal (``G = 4``): the four words become two uniform pairs ``u = ((w >> 8) + 0.5)·2⁻²⁴`` and Box-Muller gives
      ``(r₁cos θ₁, r₁sin θ₁, r₂cos θ₂, r₂sin θ₂)`` for columns ``4j … 4j+3``, times 1/√proj_dim.

    Entries are float32; ``dtype`` only sets the accumulation precision.

    Args:
        kind: ``"rademacher"`` or ``"normal"``.
        grad_dim: gradient coordinates (columns of ``P``).
        proj_dim: features (rows of ``P``).
        seed: base seed, an int >= 0.
        dtype: accumulation dtype, float32 or float64.
        cache_bytes: byte budget of the LRU cache of generated blocks (0: none).
    """

    def __init__(self, kind, grad_dim, proj_dim, seed, dtype=torch.float32, cache_bytes=0):
        super().__init__(grad_dim, proj_dim, seed, dtype, cache_bytes, proj_dim)
        self.kind = kind

    def generate(self, model_id: int, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``Pᵀ``: ``[stop - start, proj_dim]`` in the accumulation dtype."""
        rademacher = self.kind == "rademacher"
        group = RADEMACHER_GROUP if rademacher else NORMAL_GROUP
        n_groups = -(-self.proj_dim // group)
        out = torch.empty(stop - start, self.proj_dim, dtype=self.dtype, device=device)
        # a rademacher counter expands to 128 entries, a normal one to 4
        step = max(1, (COUNTERS_PER_STEP // 2 if rademacher else COUNTERS_PER_STEP) // n_groups)
        k0, k1 = self.key(model_id)
        cols = torch.arange(n_groups, dtype=torch.int64, device=device)[None, :]
        zero = torch.zeros((), dtype=torch.int64, device=device)
        lut = (_SIGN_LUT * self.scale).to(device=device, dtype=self.dtype)
        # with whole groups, the sign lookup writes straight into the output rows
        direct = rademacher and self.proj_dim == n_groups * group

        def fill(a: int, b: int) -> None:
            lo, hi = _rows_counter(a, b, device)
            w = philox4x32(cols, lo[:, None], hi[:, None], zero, k0, k1)  # 4 x [rows, n_groups]
            if rademacher and not LITTLE_ENDIAN:  # bytes of a word in the other order: use shifts
                words = torch.stack(w, dim=-1)[..., None]  # [rows, n_groups, 4, 1]
                bits = (words >> torch.arange(32, device=device)) & 1  # [rows, n_groups, 4, 32]
                vals = lut[0, 0] * (1 - 2 * bits.to(self.dtype)).view(b - a, n_groups * group)
            elif rademacher:
                words = torch.stack(w, dim=-1)  # [rows, n_groups, 4]: uint32 values in int64
                words = (words - ((words >> 31) << 32)).to(torch.int32)  # the same bits as int32 (no overflow)
                index = words.view(torch.uint8).flatten().to(torch.int64)
                if direct:
                    torch.index_select(lut, 0, index, out=out[a - start : b - start].view(-1, 8))
                    return
                vals = lut.index_select(0, index).view(b - a, n_groups * group)
            else:
                x0, x1 = box_muller(uniform_from_bits(w[0]), uniform_from_bits(w[1]))
                x2, x3 = box_muller(uniform_from_bits(w[2]), uniform_from_bits(w[3]))
                vals = torch.stack([x0, x1, x2, x3], dim=-1).view(b - a, n_groups * group)
                vals.mul_(self.scale)
            out[a - start : b - start] = vals[:, : self.proj_dim]

        run_steps(fill, start, stop, step, device)
        return out

    def accumulator(self, n: int, device: torch.device) -> torch.Tensor:
        """A zero ``[n, proj_dim]`` accumulator for :meth:`add_into`."""
        return torch.zeros(n, self.proj_dim, dtype=self.dtype, device=device)

    def finish(self, acc: torch.Tensor) -> torch.Tensor:
        """The features held by an accumulator (the accumulator itself for a dense matrix)."""
        return acc

    def project_full(self, full: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``g @ Pᵀ`` with ``full`` from :meth:`full`: ``[n, grad_dim] -> [n, proj_dim]``, one matmul."""
        return g.to(self.dtype) @ full

    def _rows(self, blk: torch.Tensor, lo: int, hi: int) -> torch.Tensor:  # rows [lo, hi) of a block of Pᵀ
        return blk[lo:hi]

    def _add(self, acc: torch.Tensor, g: torch.Tensor, rows: torch.Tensor) -> None:
        acc.addmm_(g, rows)

    def _gather(self, z: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return z @ rows.T


class SJLTMatrix(_Matrix):
    """Sparse JL transform / CountSketch (Charikar, Chen, Farach-Colton 2002): each gradient coordinate goes to
    ``s`` features.

    The features are cut into ``s`` contiguous buckets ``[⌊i·k/s⌋, ⌊(i+1)·k/s⌋)`` (``k = proj_dim``); coordinate ``r``
    adds ``±g_r/√s`` to one feature of each bucket (the block construction of Kane & Nelson 2014, so the ``s`` features
    are distinct). For hash ``i`` the Philox call with counter ``(i, r mod 2**32, r >> 32, 0)`` gives words ``w0, w1``:
    the feature is ``⌊i·k/s⌋ + ((w0 >> 1)·width_i >> 31)`` and the sign is + if ``w1`` is odd. E‖Pg‖² = ‖g‖²; nothing of
    size ``grad_dim × proj_dim`` is ever stored, a product costs ``O(n · grad_dim · s)`` whatever ``proj_dim``.

    Internally the signs are folded into the index: coordinate ``r`` goes to column ``feature + k·[sign < 0]`` of a
    ``[n, 2k]`` accumulator, so a product is ``s`` ``index_add_`` calls with no multiplication, and the result is the
    difference of the two halves times 1/√s.

    Args:
        grad_dim, proj_dim, seed, dtype, cache_bytes: as :class:`DenseMatrix`.
        s: nonzeros per column, ``1 <= s <= proj_dim``.
    """

    kind = "sjlt"

    def __init__(self, grad_dim, proj_dim, seed, dtype=torch.float32, cache_bytes=0, s=1):
        self.s = s
        super().__init__(grad_dim, proj_dim, seed, dtype, cache_bytes, s)

    def spec(self) -> dict[str, Any]:
        return {**super().spec(), "s": self.s}

    def generate(self, model_id: int, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """``[s, stop - start]`` int64 columns of the ``2·proj_dim`` accumulator (sign folded in)."""
        k, s = self.proj_dim, self.s
        k0, k1 = self.key(model_id)
        out = torch.empty(s, stop - start, dtype=torch.int64, device=device)
        i = torch.arange(s, dtype=torch.int64, device=device)[:, None]
        zero = torch.zeros((), dtype=torch.int64, device=device)
        bucket_lo = (i * k) // s
        width = ((i + 1) * k) // s - bucket_lo
        step = max(1, COUNTERS_PER_STEP // s)

        def fill(a: int, b: int) -> None:
            lo, hi = _rows_counter(a, b, device)
            w0, w1, _, _ = philox4x32(i, lo[None, :], hi[None, :], zero, k0, k1)  # [s, rows]
            feature = bucket_lo + (((w0 >> 1) * width) >> 31)
            out[:, a - start : b - start] = feature + k * (1 - (w1 & 1))

        run_steps(fill, start, stop, step, device)
        return out

    def accumulator(self, n: int, device: torch.device) -> torch.Tensor:
        """A zero ``[n, 2·proj_dim]`` accumulator for :meth:`add_into`."""
        return torch.zeros(n, 2 * self.proj_dim, dtype=self.dtype, device=device)

    def finish(self, acc: torch.Tensor) -> torch.Tensor:
        """``[n, 2k]`` accumulator -> ``[n, k]`` features: (positive − negative half) / √s."""
        k = self.proj_dim
        out = acc[:, :k] - acc[:, k:]
        if self.s > 1:
            out.mul_(1.0 / math.sqrt(self.s))
        return out

    def _rows(self, blk: torch.Tensor, lo: int, hi: int) -> torch.Tensor:  # signed indices of rows [lo, hi)
        return blk[:, lo:hi]

    def _add(self, acc: torch.Tensor, g: torch.Tensor, idx: torch.Tensor) -> None:
        for i in range(self.s):
            acc.index_add_(1, idx[i], g)

    def _gather(self, z: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``z @ P`` over the columns of the signed indices ``idx`` ``[s, L]``, through ``[z, -z]`` ``[n, 2k]``."""
        z2 = torch.cat([z, -z], dim=1)
        out = z2.index_select(1, idx[0])
        for i in range(1, self.s):
            out += z2.index_select(1, idx[i])
        if self.s > 1:
            out.mul_(1.0 / math.sqrt(self.s))
        return out
