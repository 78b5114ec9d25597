"""The TRAK kernel and scores: pure tensor math, no I/O.

Per checkpoint m of M (Park et al. 2023, TRAK, Eq. 17 / Algorithm 1):

    A_m = (Φ_mᵀ Φ_m + λ_m I)⁻¹                       [proj_dim, proj_dim]
    τ(t, i) = [(1/M) Σ_m φ_m(t)ᵀ A_m φ_m(z_i)] · [(1/M) Σ_m Q_m(z_i)]

``Φ_m`` is the ``[n_train, proj_dim]`` matrix of projected train gradients and ``Q_m(z_i) = 1 − p_y`` the out-to-loss
term. ``A_m`` is never formed: the Gram matrix is accumulated in float64 and factored by Cholesky, and ``A_m φ`` is a
triangular solve. The ridge ``λ_m`` defaults to

    λ_m = lambda_rel · trace(Φ_mᵀ Φ_m) / n_train = lambda_rel · mean_i ‖φ_m(z_i)‖²,

the mean squared norm of a train feature. Since E‖P g‖² = ‖g‖², this λ does not depend on proj_dim; it keeps the kernel
well-posed when ``proj_dim >= n_train``, where the unregularized Gram matrix is singular (MadryLab's default λ = 0;
``benchmarks/bench_lds_digits.py`` measures the ridge).

When ``n_train < proj_dim`` the same scores come from the dual (the
push-through identity ``(ΦᵀΦ + λI)⁻¹Φᵀ = Φᵀ(ΦΦᵀ + λI)⁻¹``)::

    Σ_t,m = Φ_m(targets) Φ_mᵀ (Φ_m Φ_mᵀ + λ_m I)⁻¹                [n_target, n_train]

an ``[n_train, n_train]`` system instead of ``[proj_dim, proj_dim]``: the Gram matrix costs n_train²·proj_dim instead of
n_train·proj_dim², the Cholesky n_train³/3 instead of proj_dim³/3. ``trace(ΦᵀΦ) = trace(ΦΦᵀ)``, so the default ridge is
the same. :func:`kernel_form` chooses; :func:`trak_scores`, `trak score` and `trak eval sweep` all follow it.

The kernel `trak featurize` stores in the dual is the solved train features
(:func:`dual_solved_features`)::

    X_m = (Φ_m Φ_mᵀ + λ_m I)⁻¹ Φ_m = Φ_m A_m                     [n_train, proj_dim]

(MadryLab's TRAK stores the same product, its ``features @ (ΦᵀΦ)⁻¹``, in ``finalize_features``), so that scoring new
targets is one float32 product ``Φ_m(targets) X_mᵀ`` per checkpoint, like the primal ``(Φ_m(targets) A_m) Φ_mᵀ``.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from trakcli.errors import TrakError

PRIMAL = "cholesky_lower"
"""Kernel form: the lower Cholesky factor of ``ΦᵀΦ + λI``, ``[proj_dim, proj_dim]`` float64."""
DUAL = "dual_solved_features"
"""Kernel form of the dual: solved with the lower Cholesky factor of ``ΦΦᵀ + λI`` (``[n_train, n_train]``
float64); the stored kernel is ``X = (ΦΦᵀ + λI)⁻¹Φ``, ``[n_train, proj_dim]`` float32 (:func:`dual_solved_features`)."""


def kernel_form(n_train: int, proj_dim: int) -> str:
    """The smaller of the two equivalent systems: :data:`DUAL` if ``n_train < proj_dim``, else :data:`PRIMAL`."""
    return DUAL if n_train < proj_dim else PRIMAL


def symmetric_blocks(n: int, block: int = 256) -> list[tuple[int, int]]:
    """Bounds ``(lo, hi)`` of the row blocks of an ``[n, n]`` symmetric product (blocks of about ``block`` rows)."""
    n_blocks = max(1, -(-n // block))
    bounds = [round(n * i / n_blocks) for i in range(n_blocks + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def add_lower_product(gram: torch.Tensor, a: torch.Tensor, block: int = 256) -> torch.Tensor:
    """``gram += a aᵀ`` on the block lower triangle only (rows ``lo:hi`` against columns ``:hi``).

    ``a aᵀ`` is symmetric, so about half of its products are skipped: with blocks of ``block`` rows the work is
    ``(1 + 1/n_blocks)/2`` of a full product. Entries above the block diagonal are left as they were; call
    :func:`mirror_lower` when the product is complete.

    Args:
        gram: ``[n, n]`` accumulator (float64), updated in place.
        a: ``[n, k]`` in ``gram``'s dtype.
        block: rows per block.

    Returns:
        ``gram``.
    """
    for lo, hi in symmetric_blocks(a.shape[0], block):
        gram[lo:hi, :hi].addmm_(a[lo:hi], a[:hi].T)
    return gram


def mirror_lower(gram: torch.Tensor, block: int = 256) -> torch.Tensor:
    """Make ``gram`` the symmetric matrix of its lower triangle (diagonal included), in place, block by block.

    Args:
        gram: ``[n, n]``; its entries above the diagonal are overwritten.
        block: rows per block (as in :func:`add_lower_product`; any value gives the same result).

    Returns:
        ``gram``, now exactly symmetric.
    """
    for lo, hi in symmetric_blocks(gram.shape[0], block):
        gram[:lo, lo:hi] = gram[lo:hi, :lo].T
        diag = gram[lo:hi, lo:hi]
        diag.copy_(diag.tril() + diag.tril(-1).T)
    return gram


def gram_matrix(feature_chunks: Iterable[torch.Tensor]) -> torch.Tensor:
    """Σ Φ_cᵀ Φ_c over row chunks, accumulated in float64.

    Each chunk is cast to float64 and only the block lower triangle of ``Φ_cᵀ Φ_c`` is computed
    (:func:`add_lower_product`), mirrored at the end: the exact float64 product at about half the work.

    Args:
        feature_chunks: tensors ``[rows, proj_dim]`` (any float dtype).

    Returns:
        ``[proj_dim, proj_dim]`` float64 Gram matrix ``Φᵀ Φ`` (symmetric).

    Raises:
        TrakError: no chunks.
    """
    gram: torch.Tensor | None = None
    for chunk in feature_chunks:
        c = chunk.to(torch.float64).T.contiguous()  # [proj_dim, rows]
        if gram is None:
            gram = torch.zeros(c.shape[0], c.shape[0], dtype=torch.float64, device=c.device)
        add_lower_product(gram, c)
    if gram is None:
        raise TrakError("no train features to build the kernel from; run `trak featurize` first")
    return mirror_lower(gram)


def float64_columns(n_rows: int, budget_bytes: int = 64 << 20) -> int:
    """Columns per block so that a float64 ``[n_rows, block]`` copy takes about ``budget_bytes`` (at least 64)."""
    return max(64, budget_bytes // (8 * max(n_rows, 1)))


def dual_gram(features: torch.Tensor, col_chunk: int | None = None) -> torch.Tensor:
    """The dual Gram matrix ``Φ Φᵀ``, accumulated in float64 over column blocks.

    Each block of ``col_chunk`` feature columns (default :func:`float64_columns`: 64 MiB) is cast to float64 and
    multiplied, so the float64 copy in memory is ``[n_train, col_chunk]``, never ``[n_train, proj_dim]``; only the block
    lower triangle is multiplied (:func:`add_lower_product`) and then mirrored.

    Args:
        features: ``Φ``, ``[n_train, proj_dim]`` (any float dtype, e.g. the stored float32).
        col_chunk: feature columns per block (default :func:`float64_columns`).

    Returns:
        ``[n_train, n_train]`` float64 ``Φ Φᵀ``; its trace equals that of ``ΦᵀΦ``.

    Raises:
        TrakError: no train rows.
    """
    n, p = features.shape
    if n == 0:
        raise TrakError("no train features to build the kernel from; run `trak featurize` first")
    col_chunk = col_chunk or float64_columns(n)
    gram = torch.zeros(n, n, dtype=torch.float64, device=features.device)
    for lo in range(0, p, col_chunk):
        add_lower_product(gram, features[:, lo : lo + col_chunk].to(torch.float64))  # [n_train, col_chunk]
    return mirror_lower(gram)


def resolve_lambda(gram: torch.Tensor, n_train: int, lambda_reg: float | None, lambda_rel: float) -> float:
    """The ridge λ: ``lambda_reg`` if given, else ``lambda_rel · trace(gram) / n_train``.

    Args:
        gram: ``[proj_dim, proj_dim]`` Gram matrix ``Φᵀ Φ``.
        n_train: rows of Φ.
        lambda_reg: absolute ridge, or None.
        lambda_rel: multiple of the mean squared train-feature norm.

    Returns:
        λ >= 0 as a Python float (in units of squared feature norm).
    """
    if lambda_reg is not None:
        return float(lambda_reg)
    return float(lambda_rel * torch.trace(gram).item() / max(n_train, 1))


def kernel_factor(gram: torch.Tensor, lam: float, proj_dim: int | None = None) -> torch.Tensor:
    """Lower Cholesky factor ``L`` of ``gram + λ I`` (float64), so ``A = (L Lᵀ)⁻¹``.

    Args:
        gram: ``[proj_dim, proj_dim]`` ``ΦᵀΦ`` or ``[n_train, n_train]`` ``ΦΦᵀ``.
        lam: the ridge λ.
        proj_dim: named in the error (default: the size of ``gram``).

    Raises:
        TrakError: if ``gram + λ I`` is not positive definite (e.g. λ = 0 with
            ``proj_dim >= n_train``), suggesting a ridge.
    """
    p = gram.shape[0]
    mat = gram.to(torch.float64, copy=True)
    mat.diagonal().add_(lam)  # gram + λ I, without a [p, p] identity
    factor, info = torch.linalg.cholesky_ex(mat)
    if int(info) != 0:
        raise _not_positive_definite(lam, proj_dim or p)
    return factor


def _not_positive_definite(lam: float, proj_dim: int) -> TrakError:
    return TrakError(f"the kernel Φᵀ Φ + λ I with λ = {lam:g} is not positive definite (proj_dim {proj_dim}); "
                     "set score.lambda_reg > 0 or leave it unset to use the default relative ridge (score.lambda_rel)")


def solve_kernel(gram: torch.Tensor, n_train: int, lambda_reg: float | None, lambda_rel: float,
                 proj_dim: int | None = None) -> tuple[torch.Tensor, float]:
    """One checkpoint's kernel solve: the ridge λ_m and the Cholesky factor of ``gram + λ_m I``.

    The one solve of `trak score`, `trak eval sweep` and :func:`trak_scores`, of the primal Gram
    ``Φ_mᵀ Φ_m`` (applied by :func:`target_weights`) or the dual ``Φ_m Φ_mᵀ`` (by :func:`dual_scores`).

    Args:
        gram: ``[proj_dim, proj_dim]`` Gram matrix ``Φ_mᵀ Φ_m`` (:func:`gram_matrix`) or
            ``[n_train, n_train]`` ``Φ_m Φ_mᵀ`` (:func:`dual_gram`), float64.
        n_train: rows of ``Φ_m``.
        lambda_reg: absolute ridge, or None to use ``lambda_rel``.
        lambda_rel: multiple of the mean squared train-feature norm ``trace(gram) / n_train``.
        proj_dim: columns of ``Φ_m`` (needed for a dual ``gram``: it has n_train rows, fewer than proj_dim). The dual
            refuses λ = 0 like the primal, whose ``ΦᵀΦ`` then has rank n_train < proj_dim and no inverse.

    Returns:
        ``(factor, lam)``: the float64 lower Cholesky factor of ``gram + λ_m I`` (:func:`kernel_factor`), of ``gram``'s
        shape, and λ_m as a Python float (:func:`resolve_lambda`).

    Raises:
        TrakError: ``gram + λ I`` is not positive definite (e.g. λ = 0 with ``proj_dim >= n_train``).
    """
    lam = resolve_lambda(gram, n_train, lambda_reg, lambda_rel)
    if proj_dim is not None and gram.shape[0] < proj_dim and lam <= 0:
        raise _not_positive_definite(lam, proj_dim)
    return kernel_factor(gram, lam, proj_dim), lam


def target_weights(factor: torch.Tensor, target_features: torch.Tensor, dtype: torch.dtype = torch.float64,
                   target_block: int = 4096) -> torch.Tensor:
    """``φ(t)ᵀ A`` for each target: a Cholesky solve in float64, ``target_block`` targets at a time.

    Args:
        factor: ``[proj_dim, proj_dim]`` float64 lower Cholesky factor from :func:`solve_kernel`.
        target_features: ``[n_target, proj_dim]``.
        dtype: dtype of the returned weights. `trak score` and the sweep take float32 (the products of
            :func:`score_block` then run in float32); :func:`trak_scores` keeps float64.
        target_block: targets per solve; the float64 temporaries are ``[proj_dim, target_block]``, so the memory is the
            result's plus ``2 · 8 · proj_dim · target_block`` bytes.

    Returns:
        ``[n_target, proj_dim]`` rows ``(A φ(t))ᵀ`` (A is symmetric), solved in float64 and cast to ``dtype``.
    """
    n_target = target_features.shape[0]
    out = torch.empty(n_target, factor.shape[0], dtype=dtype, device=factor.device)
    for lo in range(0, n_target, target_block):
        rhs = target_features[lo : lo + target_block].to(torch.float64).T  # [proj_dim, block]
        out[lo : lo + target_block] = torch.cholesky_solve(rhs, factor).T
    return out


def dual_scores(factor: torch.Tensor, target_features: torch.Tensor, train_features: torch.Tensor,
                out: torch.Tensor | None = None, target_block: int = 1024, col_chunk: int | None = None
                ) -> torch.Tensor:
    """One checkpoint's term of the scores, solved in the dual: ``Φ_t Φᵀ (ΦΦᵀ + λI)⁻¹``, float64.

    Equal to ``Φ_t (ΦᵀΦ + λI)⁻¹ Φᵀ`` (push-through identity). The products ``Φ_t Φᵀ`` are accumulated in float64 over
    blocks of ``col_chunk`` columns and ``target_block`` targets, so the float64 temporaries are
    ``[target_block, n_train]`` and ``[n_train, col_chunk]`` (default :func:`float64_columns`: 64 MiB).

    Args:
        factor: ``[n_train, n_train]`` float64 lower Cholesky factor of ``ΦΦᵀ + λI``
            (:func:`solve_kernel` of :func:`dual_gram`).
        target_features: ``Φ_t``, ``[n_target, proj_dim]``.
        train_features: ``Φ``, ``[n_train, proj_dim]``.
        out: ``[n_target, n_train]`` float64 to add the term to (the sum over checkpoints), or None for a new one.
        target_block, col_chunk: block sizes (they do not change the result's meaning, only its rounding).

    Returns:
        ``out`` (or a new tensor) ``[n_target, n_train]`` float64 plus this checkpoint's term.
    """
    n_target, proj_dim = target_features.shape
    n_train = train_features.shape[0]
    col_chunk = col_chunk or float64_columns(n_train)
    if out is None:
        out = torch.zeros(n_target, n_train, dtype=torch.float64, device=factor.device)
    for lo in range(0, n_target, target_block):
        hi = min(lo + target_block, n_target)
        cross = torch.zeros(hi - lo, n_train, dtype=torch.float64, device=factor.device)  # Φ_t[lo:hi] Φᵀ
        for c in range(0, proj_dim, col_chunk):
            train_cols = train_features[:, c : c + col_chunk].to(torch.float64)  # [n_train, col_chunk]
            cross.addmm_(target_features[lo:hi, c : c + col_chunk].to(torch.float64), train_cols.T)
        out[lo:hi] += torch.cholesky_solve(cross.T, factor).T  # (ΦΦᵀ + λI) is symmetric
    return out


def dual_solved_features(train_features: torch.Tensor, factor: torch.Tensor, col_chunk: int | None = None
                         ) -> torch.Tensor:
    """The dual kernel `trak featurize` stores: ``X = (ΦΦᵀ + λI)⁻¹ Φ = Φ (ΦᵀΦ + λI)⁻¹ = Φ A``.

    A checkpoint's score term is then ``Φ_t Xᵀ`` (``φ(t)ᵀ A φ(z_i) = φ(t) · X_i``): the same as :func:`dual_scores`,
    with the solve done once for the train side instead of for every set of targets. Solved in float64 over blocks of
    ``col_chunk`` columns, rounded to float32.

    Args:
        train_features: ``Φ``, ``[n_train, proj_dim]`` (any float dtype).
        factor: ``[n_train, n_train]`` float64 lower Cholesky factor of ``ΦΦᵀ + λI``
            (:func:`solve_kernel` of :func:`dual_gram`).
        col_chunk: columns per solve (default :func:`float64_columns`: 64 MiB float64 temporaries).

    Returns:
        ``[n_train, proj_dim]`` float32 ``X``.
    """
    n, p = train_features.shape
    col_chunk = col_chunk or float64_columns(n)
    out = torch.empty(n, p, dtype=torch.float32, device=factor.device)
    for lo in range(0, p, col_chunk):
        out[:, lo : lo + col_chunk] = torch.cholesky_solve(train_features[:, lo : lo + col_chunk].to(torch.float64), factor)
    return out


def ensemble_block(total: torch.Tensor, out_to_loss: list[torch.Tensor]) -> torch.Tensor:
    """``[(1/M) total] ⊙ [(1/M) Σ_m Q_m]`` as float32, computed in ``total``'s dtype.

    Args:
        total: ``[n_target, rows]`` sum over the M checkpoints of ``φ_m(t)ᵀ A_m φ_m(z_i)``.
        out_to_loss: per checkpoint, ``[rows]`` out-to-loss terms (averaged in float64).

    Returns:
        ``[n_target, rows]`` float32 scores.
    """
    m = len(out_to_loss)
    q = sum(o.to(torch.float64) for o in out_to_loss) / m
    return (total / m * q.to(total.dtype).unsqueeze(0)).to(torch.float32)


def score_block(weights: list[torch.Tensor], train_features: list[torch.Tensor], out_to_loss: list[torch.Tensor]
                ) -> torch.Tensor:
    """Ensembled TRAK scores of all targets against a block of train rows.

    The products are computed in the dtype of ``weights`` (float64, or the float32 weights of the streamed scoring of
    `trak score`); ``Q`` is averaged in float64.

    Args:
        weights: per checkpoint, ``[n_target, proj_dim]`` from :func:`target_weights`.
        train_features: per checkpoint, ``[rows, proj_dim]`` features of the block.
        out_to_loss: per checkpoint, ``[rows]`` out-to-loss terms of the block.

    Returns:
        ``[n_target, rows]`` float32: ``[(1/M) Σ_m W_m Φ_mᵀ] ⊙ [(1/M) Σ_m Q_m]``.
    """
    m = len(weights)
    if not (m == len(train_features) == len(out_to_loss)) or m == 0:
        raise ValueError("weights, train_features and out_to_loss need one entry per checkpoint")
    dtype = weights[0].dtype
    acc = torch.zeros(weights[0].shape[0], train_features[0].shape[0], dtype=dtype, device=weights[0].device)
    for w, f in zip(weights, train_features):
        acc.addmm_(w, f.to(dtype).T)
    return ensemble_block(acc, out_to_loss)


def trak_scores(train_features: list[torch.Tensor], out_to_loss: list[torch.Tensor],
                target_features: list[torch.Tensor], lambda_reg: float | None = None, lambda_rel: float = 1.0,
                form: str | None = None) -> torch.Tensor:
    """TRAK scores of in-memory features (the formula above, one call), in float64.

    Args:
        train_features: per checkpoint ``[n_train, proj_dim]``.
        out_to_loss: per checkpoint ``[n_train]``.
        target_features: per checkpoint ``[n_target, proj_dim]``.
        lambda_reg: absolute ridge; ``None`` uses ``lambda_rel``.
        lambda_rel: relative ridge (multiple of trace(ΦᵀΦ)/n_train).
        form: :data:`PRIMAL` or :data:`DUAL`; default :func:`kernel_form`.

    Returns:
        ``[n_target, n_train]`` float32 scores.
    """
    n_train, proj_dim = train_features[0].shape
    if (form or kernel_form(n_train, proj_dim)) == DUAL:
        total = None
        for phi, phi_t in zip(train_features, target_features):
            factor, _ = solve_kernel(dual_gram(phi), n_train, lambda_reg, lambda_rel, proj_dim)
            total = dual_scores(factor, phi_t, phi, out=total)
        return ensemble_block(total, out_to_loss)
    weights = []
    for phi, phi_t in zip(train_features, target_features):
        factor, _ = solve_kernel(gram_matrix([phi]), phi.shape[0], lambda_reg, lambda_rel)
        weights.append(target_weights(factor, phi_t))
    return score_block(weights, train_features, out_to_loss)


# -- unit normalization (cosine in the kernel's space) ----------------------------------------------------------
#
# TrackStar (Chang et al. 2025, "Scalable Influence and Fact Tracing for Large Language Model
# Pretraining", ICLR) ranks by the cosine of the corrected, projected gradients. With the kernel
# A = (ΦᵀΦ + λI)⁻¹ = L⁻ᵀL⁻¹ (L the lower Cholesky factor of ΦᵀΦ + λI) the map φ ↦ L⁻¹φ is an
# isometry of A's inner product (an A^{1/2} up to a rotation, which cosines do not see), so
#
#     cos_m(t, i) = φ_m(t)ᵀ A_m φ_m(z_i) / sqrt(φ_m(t)ᵀ A_m φ_m(t) · φ_m(z_i)ᵀ A_m φ_m(z_i))
#     τ_unit(t, i) = (1/M) Σ_m cos_m(t, i)
#
# Q is left out: it would weigh each train row again after the normalization removed its scale.


def kernel_sq_norms(factor: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """``φᵀ A φ = ‖L⁻¹ φ‖²`` per row, in float64 (a triangular solve; primal kernels).

    Args:
        factor: ``[proj_dim, proj_dim]`` float64 lower Cholesky factor of ``ΦᵀΦ + λI``.
        features: ``[rows, proj_dim]`` (any float dtype).

    Returns:
        ``[rows]`` float64.
    """
    solved = torch.linalg.solve_triangular(factor, features.to(torch.float64).T, upper=False)
    return solved.square().sum(0)


def dual_target_sq_norms(target_features: torch.Tensor, term: torch.Tensor, train_features: torch.Tensor, lam: float
                         ) -> torch.Tensor:
    """``φ(t)ᵀ A φ(t)`` per target from the dual kernel, in float64.

    With ``X = (ΦΦᵀ + λI)⁻¹Φ`` (so ``Xᵀ = Φᵀ(ΦΦᵀ + λI)⁻¹``, push-through), the Woodbury
    identity gives ``A = (ΦᵀΦ + λI)⁻¹ = (I − XᵀΦ)/λ``, hence
    ``φᵀAφ = (‖φ‖² − (Φφ)·(Xφ)) / λ``: rows of ``φΦᵀ`` and of the score term ``φXᵀ``.

    Args:
        target_features: ``Φ_t`` ``[n_target, proj_dim]``.
        term: ``Φ_t Xᵀ`` ``[n_target, n_train]`` (the checkpoint's score term).
        train_features: ``Φ`` ``[n_train, proj_dim]``.
        lam: the ridge λ (> 0).

    Returns:
        ``[n_target]`` float64, clamped at 0 against rounding.

    Raises:
        TrakError: ``lam`` is 0 (A does not exist when n_train < proj_dim).
    """
    if lam <= 0:
        raise TrakError("score.normalize unit needs a positive ridge when n_train < proj_dim (the kernel A is not "
                        "defined without one); unset score.lambda_reg or give it a positive value")
    phi = target_features.to(torch.float64)
    cross = phi @ train_features.to(torch.float64).T  # [n_target, n_train]
    return ((phi.square().sum(1) - (cross * term.to(torch.float64)).sum(1)) / lam).clamp_min(0)


def cosine_term(term: torch.Tensor, target_sq: torch.Tensor, train_sq: torch.Tensor) -> torch.Tensor:
    """One checkpoint's cosines ``term / sqrt(target_sq ⊗ train_sq)``, in ``term``'s dtype; 0 where a norm is 0.

    Args:
        term: ``[n_target, rows]`` ``φ(t)ᵀ A φ(z_i)``.
        target_sq, train_sq: ``[n_target]`` and ``[rows]`` squared kernel norms (:func:`kernel_sq_norms`).
    """
    t = target_sq.sqrt().to(term.dtype)
    z = train_sq.sqrt().to(term.dtype)
    t = torch.where(t > 0, 1 / t, torch.zeros_like(t))
    z = torch.where(z > 0, 1 / z, torch.zeros_like(z))
    return term * t.unsqueeze(1) * z.unsqueeze(0)


# -- top-k ------------------------------------------------------------------------------------------------------


def merge_top_k(values: torch.Tensor | None, indices: torch.Tensor | None, block: torch.Tensor, offset: int, k: int,
                largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Running top-k: the ``k`` best of the kept ``(values, indices)`` and a new block of columns.

    Args:
        values, indices: ``[n_target, k']`` kept so far (None at the start).
        block: ``[n_target, cols]`` scores of train rows ``offset .. offset + cols``.
        k: how many to keep (at most the columns seen).
        largest: keep the highest (proponents) or the lowest (opponents).

    Returns:
        ``([n_target, k] values, [n_target, k] int64 train indices)``, in no particular order
        (:func:`order_top_k` sorts them).
    """
    kept, pos = torch.topk(block, min(k, block.shape[1]), dim=1, largest=largest, sorted=False)
    pos = pos + offset  # the block's own top-k first: no copy of the block
    if values is None:
        return kept, pos
    both, both_idx = torch.cat([values, kept], dim=1), torch.cat([indices, pos], dim=1)
    kept, sel = torch.topk(both, min(k, both.shape[1]), dim=1, largest=largest, sorted=False)
    return kept, torch.gather(both_idx, 1, sel)


def order_top_k(values: np.ndarray, indices: np.ndarray, k: int, largest: bool) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best candidates per row, ordered best first, equal scores by train index.

    Args:
        values: ``[n_target, c]`` scores of the candidates (numpy, any float dtype).
        indices: ``[n_target, c]`` their train indices.
        k: how many to keep (``k <= c``).
        largest: best = highest (proponents) or lowest (opponents).

    Returns:
        ``([n_target, k] values, [n_target, k] indices)`` (numpy).
    """
    key = -values if largest else values
    order = np.lexsort((indices, key), axis=-1)[:, :k]
    return np.take_along_axis(values, order, 1), np.take_along_axis(indices, order, 1)
