"""Triton kernels of :mod:`trakcli.projectors.cuda` (imported lazily: triton is optional).

Loaded by :func:`trakcli.projectors.cuda.kernels` once per ``TRITON_INTERPRET`` setting, since triton decides at
decoration time whether a kernel is compiled or interpreted. Each function mirrors :mod:`trakcli.projectors.philox`
and :class:`trakcli.projectors.matrices.DenseMatrix` operation by operation.

Only builtins of ``triton.language`` are used (``tl.full``, not the jit-defined ``tl.zeros``), so the kernels also run
in the interpreter when triton itself was imported before ``TRITON_INTERPRET`` was set, as in a test session.
"""

import triton
import triton.language as tl


@triton.jit
def philox(c0, c1, c2, c3, k0, k1):
    # Philox4x32-10, as trakcli.projectors.philox.philox4x32; uint32 arithmetic wraps.
    # k0, k1 arrive as int32 or int64 kernel arguments holding values < 2**32.
    k0 = k0.to(tl.uint32)
    k1 = k1.to(tl.uint32)
    A: tl.constexpr = 0xD2511F53
    B: tl.constexpr = 0xCD9E8D57
    for _ in tl.static_range(10):
        _c0 = c0
        _c2 = c2
        c0 = tl.umulhi(_c2, B) ^ c1 ^ k0
        c2 = tl.umulhi(_c0, A) ^ c3 ^ k1
        c1 = tl.mul(_c2, B, sanitize_overflow=False)
        c3 = tl.mul(_c0, A, sanitize_overflow=False)
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
    return c0, c1, c2, c3

@triton.jit
def uniform(w):
    return ((w >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2**-24

@triton.jit
def entries(rows, cols, k0, k1, scale, KIND: tl.constexpr):
    # Pᵀ[rows, cols] as float32: rows [BK, 1] and cols [1, BN] int64 -> [BK, BN].
    zero = (rows * 0 + cols * 0).to(tl.uint32)
    c1 = (rows & 0xFFFFFFFF).to(tl.uint32) + zero
    c2 = (rows >> 32).to(tl.uint32) + zero
    if KIND == 0:  # rademacher: bit (c % 32) of word (c % 128) // 32 of call c // 128
        c0 = (cols // 128).to(tl.uint32) + zero
        w0, w1, w2, w3 = philox(c0, c1, c2, zero, k0, k1)
        which = (cols % 128) // 32 + rows * 0
        word = tl.where(which == 0, w0, tl.where(which == 1, w1, tl.where(which == 2, w2, w3)))
        bit = (word >> ((cols % 32).to(tl.uint32) + zero)) & 1
        val = tl.where(bit == 1, 1.0, -1.0)
    else:  # normal: Box-Muller on (w0, w1) for columns 4j, 4j+1 and (w2, w3) for 4j+2, 4j+3
        c0 = (cols // 4).to(tl.uint32) + zero
        w0, w1, w2, w3 = philox(c0, c1, c2, zero, k0, k1)
        j = cols % 4 + rows * 0
        ua = tl.where(j < 2, uniform(w0), uniform(w2))
        ub = tl.where(j < 2, uniform(w1), uniform(w3))
        r = tl.sqrt(-2.0 * tl.log(ua))
        theta = 6.283185307179586 * ub
        val = tl.where(j % 2 == 0, r * tl.cos(theta), r * tl.sin(theta))
    return val * scale

@triton.jit
def project_kernel(
    g_ptr, out_ptr, n, grad_dim, proj_dim, stride_gn, stride_gk, stride_on, stride_ok,
    k0, k1, scale, KIND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # out[m, c] = Σ_r g[m, r] Pᵀ[r, c]
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # not tl.zeros: a jit function, see module doc
    for start in range(0, grad_dim, BLOCK_K):
        rk = start + tl.arange(0, BLOCK_K).to(tl.int64)
        g = tl.load(
            g_ptr + rm[:, None] * stride_gn + rk[None, :] * stride_gk,
            mask=(rm[:, None] < n) & (rk[None, :] < grad_dim), other=0.0,
        ).to(tl.float32)
        pt = entries(rk[:, None], rn[None, :], k0, k1, scale, KIND)
        pt = tl.where(rk[:, None] < grad_dim, pt, 0.0)
        acc += tl.dot(g, pt, input_precision="ieee")
    tl.store(
        out_ptr + rm[:, None] * stride_on + rn[None, :] * stride_ok, acc,
        mask=(rm[:, None] < n) & (rn[None, :] < proj_dim),
    )

@triton.jit
def unproject_kernel(
    z_ptr, out_ptr, n, grad_dim, proj_dim, stride_zn, stride_zc, stride_on, stride_ok,
    k0, k1, scale, KIND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # out[m, r] = Σ_c z[m, c] Pᵀ[r, c]
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    acc = tl.full((BLOCK_M, BLOCK_K), 0.0, tl.float32)
    for start in range(0, proj_dim, BLOCK_N):
        rn = start + tl.arange(0, BLOCK_N).to(tl.int64)
        z = tl.load(
            z_ptr + rm[:, None] * stride_zn + rn[None, :] * stride_zc,
            mask=(rm[:, None] < n) & (rn[None, :] < proj_dim), other=0.0,
        ).to(tl.float32)
        pt = entries(rk[:, None], rn[None, :], k0, k1, scale, KIND)
        pt = tl.where(rn[None, :] < proj_dim, pt, 0.0)
        acc += tl.dot(z, tl.trans(pt), input_precision="ieee")
    tl.store(
        out_ptr + rm[:, None] * stride_on + rk[None, :] * stride_ok, acc,
        mask=(rm[:, None] < n) & (rk[None, :] < grad_dim),
    )

