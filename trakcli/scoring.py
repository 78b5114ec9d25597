"""The TRAK kernel and scores: pure tensor math, no I/O.

Per checkpoint m of M (Park et al. 2023, TRAK, Eq. 17 / Algorithm 1):

    A_m = (Φ_mᵀ Φ_m + λ_m I)⁻¹                       [proj_dim, proj_dim]
    τ(t, i) = [(1/M) Σ_m φ_m(t)ᵀ A_m φ_m(z_i)] · [(1/M) Σ_m Q_m(z_i)]

``Φ_m`` is the ``[n_train, proj_dim]`` matrix of projected train gradients and
``Q_m(z_i) = 1 − p_y`` the out-to-loss term. ``A_m`` is never formed: the
Gram matrix is accumulated in float64 and factored by Cholesky, and ``A_m φ``
is a triangular solve. The ridge ``λ_m`` defaults to

    λ_m = lambda_rel · trace(Φ_mᵀ Φ_m) / n_train = lambda_rel · mean_i ‖φ_m(z_i)‖²,

the mean squared norm of a train feature. Since E‖P g‖² = ‖g‖², this λ does
not depend on proj_dim; it keeps the kernel well-posed when
``proj_dim >= n_train``, where the unregularized Gram matrix is singular
(MadryLab's default λ = 0). On the digits benchmark (10 MLP checkpoints,
LDS against retrained half-subset models, ``scripts/bench_lds_digits.py``)
``lambda_rel = 1`` was within noise of the best ridge at proj_dim 256 and
2048 alike, where a ridge relative to trace/proj_dim needed a different
constant at each proj_dim.
"""

from __future__ import annotations

from typing import Iterable

import torch

from trakcli.errors import TrakError


def gram_matrix(feature_chunks: Iterable[torch.Tensor]) -> torch.Tensor:
    """Σ Φ_cᵀ Φ_c over row chunks, accumulated in float64.

    Args:
        feature_chunks: tensors ``[rows, proj_dim]`` (any float dtype).

    Returns:
        ``[proj_dim, proj_dim]`` float64 Gram matrix ``Φᵀ Φ``.
    """
    gram: torch.Tensor | None = None
    for chunk in feature_chunks:
        c = chunk.to(torch.float64)
        g = c.T @ c
        gram = g if gram is None else gram + g
    if gram is None:
        raise TrakError("no train features to build the kernel from; run `trak featurize` first")
    return gram


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


def kernel_factor(gram: torch.Tensor, lam: float) -> torch.Tensor:
    """Lower Cholesky factor ``L`` of ``gram + λ I`` (float64), so ``A = (L Lᵀ)⁻¹``.

    Raises:
        TrakError: if ``gram + λ I`` is not positive definite (e.g. λ = 0 with
            ``proj_dim >= n_train``), suggesting a ridge.
    """
    p = gram.shape[0]
    mat = gram.to(torch.float64) + lam * torch.eye(p, dtype=torch.float64, device=gram.device)
    factor, info = torch.linalg.cholesky_ex(mat)
    if int(info) != 0:
        raise TrakError(
            f"the kernel Φᵀ Φ + λ I with λ = {lam:g} is not positive definite (proj_dim {p}); "
            "set score.lambda_reg > 0 or leave it unset to use the default relative ridge (score.lambda_rel)"
        )
    return factor


def solve_kernel(
    gram: torch.Tensor, n_train: int, lambda_reg: float | None, lambda_rel: float
) -> tuple[torch.Tensor, float]:
    """One checkpoint's kernel solve: the ridge λ_m and the Cholesky factor of ``Φ_mᵀ Φ_m + λ_m I``.

    The one place the chain gram → λ → factor is written: `trak score`
    (kernels stored per checkpoint), `trak eval sweep` (one factor per ridge)
    and :func:`trak_scores` all call it. ``A_m = (L Lᵀ)⁻¹`` is applied by
    :func:`target_weights`, never formed.

    Args:
        gram: ``[proj_dim, proj_dim]`` Gram matrix ``Φ_mᵀ Φ_m`` (:func:`gram_matrix`, float64).
        n_train: rows of ``Φ_m``.
        lambda_reg: absolute ridge, or None to use ``lambda_rel``.
        lambda_rel: multiple of the mean squared train-feature norm ``trace(gram) / n_train``.

    Returns:
        ``(factor, lam)``: the ``[proj_dim, proj_dim]`` float64 lower Cholesky
        factor (:func:`kernel_factor`) and λ_m as a Python float (:func:`resolve_lambda`).

    Raises:
        TrakError: ``gram + λ I`` is not positive definite (e.g. λ = 0 with ``proj_dim >= n_train``).
    """
    lam = resolve_lambda(gram, n_train, lambda_reg, lambda_rel)
    return kernel_factor(gram, lam), lam


def target_weights(
    factor: torch.Tensor, target_features: torch.Tensor, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """``φ(t)ᵀ A`` for each target: a Cholesky solve in float64.

    Args:
        factor: ``[proj_dim, proj_dim]`` float64 lower Cholesky factor from :func:`solve_kernel`.
        target_features: ``[n_target, proj_dim]``.
        dtype: dtype of the returned weights. `trak score` and the sweep take
            float32 (the products of :func:`score_block` then run in float32);
            :func:`trak_scores` keeps float64.

    Returns:
        ``[n_target, proj_dim]`` rows ``(A φ(t))ᵀ`` (A is symmetric), solved in
        float64 and cast to ``dtype``.
    """
    rhs = target_features.to(torch.float64).T  # [proj_dim, n_target]
    return torch.cholesky_solve(rhs, factor).T.to(dtype)


def score_block(
    weights: list[torch.Tensor],
    train_features: list[torch.Tensor],
    out_to_loss: list[torch.Tensor],
) -> torch.Tensor:
    """Ensembled TRAK scores of all targets against a block of train rows.

    The products are computed in the dtype of ``weights`` (float64, or the
    float32 weights of the streamed scoring of `trak score`); ``Q`` is
    averaged in float64.

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
    q = sum(o.to(torch.float64) for o in out_to_loss) / m
    return (acc / m * q.to(dtype).unsqueeze(0)).to(torch.float32)


def trak_scores(
    train_features: list[torch.Tensor],
    out_to_loss: list[torch.Tensor],
    target_features: list[torch.Tensor],
    lambda_reg: float | None = None,
    lambda_rel: float = 1.0,
) -> torch.Tensor:
    """TRAK scores of in-memory features (the formula above, one call).

    Args:
        train_features: per checkpoint ``[n_train, proj_dim]``.
        out_to_loss: per checkpoint ``[n_train]``.
        target_features: per checkpoint ``[n_target, proj_dim]``.
        lambda_reg: absolute ridge; ``None`` uses ``lambda_rel``.
        lambda_rel: relative ridge (multiple of trace(ΦᵀΦ)/n_train).

    Returns:
        ``[n_target, n_train]`` float32 scores.
    """
    weights = []
    for phi, phi_t in zip(train_features, target_features):
        factor, _ = solve_kernel(gram_matrix([phi]), phi.shape[0], lambda_reg, lambda_rel)
        weights.append(target_weights(factor, phi_t))
    return score_block(weights, train_features, out_to_loss)
