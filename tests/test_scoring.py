import numpy as np
import pytest
import torch

from trakcli.errors import TrakError
from trakcli.scoring import gram_matrix, kernel_factor, resolve_lambda, score_block, target_weights, trak_scores


def closed_form(train, q, target, lambdas):
    """The design.md formula with explicit float64 inverses (numpy)."""
    m = len(train)
    acc = 0
    for phi, phi_t, lam in zip(train, target, lambdas):
        phi, phi_t = phi.double().numpy(), phi_t.double().numpy()
        a = np.linalg.inv(phi.T @ phi + lam * np.eye(phi.shape[1]))
        acc = acc + phi_t @ a @ phi.T
    qbar = sum(x.double().numpy() for x in q) / m
    return acc / m * qbar[None, :]


def make(m=3, n=50, n_t=6, p=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    train = [torch.randn(n, p, generator=g) for _ in range(m)]
    q = [torch.rand(n, generator=g) for _ in range(m)]
    target = [torch.randn(n_t, p, generator=g) for _ in range(m)]
    return train, q, target


@pytest.mark.parametrize("lambda_reg", [0.0, 0.5, None])
def test_scores_match_float64_closed_form(lambda_reg):
    train, q, target = make()
    got = trak_scores(train, q, target, lambda_reg=lambda_reg, lambda_rel=0.1)
    lambdas = [resolve_lambda(gram_matrix([t]), len(t), lambda_reg, 0.1) for t in train]
    ref = closed_form(train, q, target, lambdas)
    assert got.dtype == torch.float32 and got.shape == (6, 50)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-6)


def test_default_ridge_relative_to_trace_and_sound_when_proj_dim_exceeds_n_train():
    train, q, target = make(m=2, n=10, p=32)
    gram = gram_matrix([train[0]])
    lam = resolve_lambda(gram, 10, None, 0.1)
    assert lam == pytest.approx(0.1 * float((train[0].double() ** 2).sum(1).mean()))
    with pytest.raises(TrakError, match="not positive definite"):
        kernel_factor(gram, 0.0)  # rank 10 < 32: singular without a ridge
    scores = trak_scores(train, q, target)
    assert torch.isfinite(scores).all()
    ref = closed_form(train, q, target, [resolve_lambda(gram_matrix([t]), len(t), None, 1.0) for t in train])
    np.testing.assert_allclose(scores.numpy(), ref, rtol=1e-4, atol=1e-6)


def test_gram_accumulates_over_chunks_in_float64():
    train, _, _ = make(m=1, n=37, p=5)
    full = gram_matrix([train[0]])
    chunked = gram_matrix(train[0].split(8))
    assert chunked.dtype == torch.float64
    torch.testing.assert_close(full, chunked)


def test_block_scoring_equals_whole():
    train, q, target = make(m=2, n=40, p=8)
    whole = trak_scores(train, q, target, lambda_reg=1.0)
    weights = [target_weights(kernel_factor(gram_matrix([t]), 1.0), tt) for t, tt in zip(train, target)]
    left = score_block(weights, [t[:15] for t in train], [x[:15] for x in q])
    right = score_block(weights, [t[15:] for t in train], [x[15:] for x in q])
    torch.testing.assert_close(torch.cat([left, right], 1), whole)
