"""Philox4x32-10, the counter-based generator every projector matrix is drawn from.

Philox (Salmon, Moraes, Dror, Shaw 2011, "Parallel random numbers: as easy as 1, 2, 3", SC'11) maps a 128-bit counter
and a 64-bit key to 128 random bits. Because each entry of the matrix is a function of its own (row, column) counter,
any device, block, chunk or kernel tile regenerates exactly the same entries: this module is the pure-torch reference
that the Triton kernel of :mod:`trakcli.projectors.cuda` mirrors operation by operation.

Values are held as uint32 numbers inside int64 tensors; products of two uint32 values wrap modulo 2**64 in int64
arithmetic and their high and low halves are recovered with shifts and masks.
"""

from __future__ import annotations

import torch

from trakcli.projectors.base import derive_seed

M32 = 0xFFFFFFFF
ROUND_A = 0xD2511F53
ROUND_B = 0xCD9E8D57
KEY_A = 0x9E3779B9
KEY_B = 0xBB67AE85
ROUNDS = 10

#: 2**-24: uniform floats are ((x >> 8) + 0.5) * 2**-24, exact in float32, in (0, 1).
TWO_M24 = 2.0**-24
TWO_PI = 6.283185307179586


def philox4x32(c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, k0: int, k1: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32 with 10 rounds on int64 tensors holding uint32 values.

    Args:
        c0, c1, c2, c3: counter words, broadcastable int64 tensors in ``[0, 2**32)``.
        k0, k1: key words, Python ints in ``[0, 2**32)``.

    Returns:
        Four int64 tensors of the broadcast shape with values in ``[0, 2**32)``. Known answer (Random123 test vector):
        counter 0 and key 0 give ``0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8``.
    """
    for _ in range(ROUNDS):
        p0 = c0 * ROUND_A  # < 2**64; wraps in int64, low 64 bits exact
        p2 = c2 * ROUND_B
        hi0 = (p0 >> 32) & M32
        hi2 = (p2 >> 32) & M32
        c0, c1, c2, c3 = hi2 ^ c1 ^ k0, p2 & M32, hi0 ^ c3 ^ k1, p0 & M32
        k0 = (k0 + KEY_A) & M32
        k1 = (k1 + KEY_B) & M32
    return c0, c1, c2, c3


def matrix_key(tag: int, seed: int, model_id: int) -> tuple[int, int]:
    """The Philox key ``(k0, k1)`` of one matrix: a hash of ``(tag, seed, model_id)``."""
    h = derive_seed(tag, seed, model_id)
    return h & M32, (h >> 32) & M32


def uniform_from_bits(x: torch.Tensor) -> torch.Tensor:
    """uint32 values (int64 tensor) -> float32 uniforms in (0, 1): ``((x >> 8) + 0.5) · 2**-24``."""
    return ((x >> 8).to(torch.float32) + 0.5) * TWO_M24


def box_muller(u1: torch.Tensor, u2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent N(0, 1) float32 tensors from two uniforms in (0, 1) (Box & Muller 1958)."""
    r = torch.sqrt(-2.0 * torch.log(u1))
    theta = TWO_PI * u2
    return r * torch.cos(theta), r * torch.sin(theta)
