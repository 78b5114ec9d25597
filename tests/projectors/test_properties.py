"""Hypothesis properties of every projector kind and CPU implementation.

Linearity, determinism across batchings and chunkings, exact adjointness, and
JL norm preservation over random matrices (seed and model_id drawn too: JL is
a statement about a random matrix and a fixed vector).
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trakcli.projectors import make_projector

KINDS = [("rademacher", {}), ("normal", {}), ("sjlt", {"s": 1}), ("sjlt", {"s": 2})]
IMPLS = ["single_block", "basic", "chunked"]

kinds = st.sampled_from(KINDS)
impls = st.sampled_from(IMPLS)
seeds = st.integers(0, 2**31 - 1)
model_ids = st.integers(0, 1000)


def make(kind, opts, impl, grad_dim, proj_dim, seed=0, **kw):
    size = {"basic": {"block_size": 97}, "chunked": {"max_chunk_size": 89}}.get(impl, {})
    return make_projector(
        kind=kind, implementation=impl, grad_dim=grad_dim, proj_dim=proj_dim, seed=seed,
        **opts, **size, **kw,
    )


def randn(seed, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@settings(max_examples=30, deadline=None)
@given(kind=kinds, impl=impls, grad_dim=st.integers(1, 400), proj_dim=st.integers(2, 40),
       seed=seeds, model_id=model_ids, data_seed=seeds, a=st.floats(-3, 3), b=st.floats(-3, 3))
def test_linearity(kind, impl, grad_dim, proj_dim, seed, model_id, data_seed, a, b):
    proj = make(*kind, impl, grad_dim, proj_dim, seed, dtype="float64")
    x = randn(data_seed, 3, grad_dim, dtype=torch.float64)
    y = randn(data_seed + 1, 3, grad_dim, dtype=torch.float64)
    lhs = proj.project(a * x + b * y, model_id=model_id)
    rhs = a * proj.project(x, model_id=model_id) + b * proj.project(y, model_id=model_id)
    torch.testing.assert_close(lhs, rhs, rtol=1e-9, atol=1e-9)


@settings(max_examples=30, deadline=None)
@given(kind=kinds, impl=impls, grad_dim=st.integers(1, 400), proj_dim=st.integers(2, 40),
       seed=seeds, model_id=model_ids, data_seed=seeds,
       cuts=st.lists(st.integers(1, 11), min_size=1, max_size=4))
def test_rows_do_not_depend_on_batching(kind, impl, grad_dim, proj_dim, seed, model_id, data_seed, cuts):
    proj = make(*kind, impl, grad_dim, proj_dim, seed)
    g = randn(data_seed, 12, grad_dim)
    full = proj.project(g, model_id=model_id)
    bounds = sorted(set([0, 12] + cuts))
    parts = torch.cat([proj.project(g[a:b], model_id=model_id) for a, b in zip(bounds, bounds[1:])])
    tol = 2e-6 * max(1.0, full.abs().max().item())
    torch.testing.assert_close(parts, full, rtol=0, atol=tol)
    # a fresh projector of the same spec agrees (no hidden state)
    again = make(*kind, impl, grad_dim, proj_dim, seed).project(g, model_id=model_id)
    torch.testing.assert_close(again, full, rtol=0, atol=tol)


@settings(max_examples=30, deadline=None)
@given(kind=kinds, grad_dim=st.integers(2, 500), proj_dim=st.integers(2, 30), seed=seeds,
       data_seed=seeds, max_chunk_size=st.integers(1, 200),
       splits=st.lists(st.integers(1, 499), max_size=6))
def test_chunking_and_parameter_split_do_not_change_the_output(
    kind, grad_dim, proj_dim, seed, data_seed, max_chunk_size, splits
):
    g = randn(data_seed, 4, grad_dim, dtype=torch.float64)
    bounds = sorted(set([0, grad_dim] + [s for s in splits if s < grad_dim]))
    grads = {f"p{i}": g[:, a:b] for i, (a, b) in enumerate(zip(bounds, bounds[1:]))}
    chunked = make_projector(kind=kind[0], implementation="chunked", grad_dim=grad_dim,
                             proj_dim=proj_dim, seed=seed, max_chunk_size=max_chunk_size,
                             dtype="float64", **kind[1])
    reference = make(*kind, "single_block", grad_dim, proj_dim, seed, dtype="float64")
    torch.testing.assert_close(chunked.project(grads), reference.project(g), rtol=1e-10, atol=1e-10)


@settings(max_examples=30, deadline=None)
@given(kind=kinds, impl=impls, grad_dim=st.integers(1, 400), proj_dim=st.integers(2, 40),
       seed=seeds, model_id=model_ids, data_seed=seeds)
def test_unproject_is_the_adjoint(kind, impl, grad_dim, proj_dim, seed, model_id, data_seed):
    proj = make(*kind, impl, grad_dim, proj_dim, seed, dtype="float64")
    g = randn(data_seed, 3, grad_dim, dtype=torch.float64)
    z = randn(data_seed + 7, 3, proj_dim, dtype=torch.float64)
    lhs = (proj.project(g, model_id=model_id) * z).sum()
    rhs = (g * proj.unproject(z, model_id=model_id)).sum()
    assert math.isclose(lhs.item(), rhs.item(), rel_tol=1e-10, abs_tol=1e-10)


@settings(max_examples=25, deadline=None)
@given(kind=kinds, proj_dim=st.sampled_from([512, 1024]), grad_dim=st.integers(600, 3000),
       seed=seeds, model_id=model_ids, data_seed=seeds)
def test_norms_preserved_within_jl_error(kind, proj_dim, grad_dim, seed, model_id, data_seed):
    # ‖Pg‖²/‖g‖² has mean 1 and standard deviation at most sqrt(2/proj_dim) for every kind;
    # 7 standard deviations: a false alarm about once in 10^11 draws.
    proj = make(*kind, "basic", grad_dim, proj_dim, seed, dtype="float64")
    g = randn(data_seed, 2, grad_dim, dtype=torch.float64)
    ratio = proj.project(g, model_id=model_id).norm(dim=1) ** 2 / g.norm(dim=1) ** 2
    assert (ratio - 1).abs().max().item() < 7 * math.sqrt(2 / proj_dim)
