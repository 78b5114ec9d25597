"""The projector contract (docs/guides/projectors.md): each promise is a test here."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from trakcli.errors import ProjectorError
from trakcli.projectors import GEN_ROWS, make_projector

DENSE_KINDS = ["rademacher", "normal"]
CPU_IMPLS = ["single_block", "basic", "chunked"]
# (kind, options): every kind, sjlt with one and with several nonzeros per column
KINDS = [("rademacher", {}), ("normal", {}), ("sjlt", {"s": 1}), ("sjlt", {"s": 3})]
KIND_IDS = ["rademacher", "normal", "sjlt1", "sjlt3"]


@pytest.fixture(autouse=True)
def small_cache_blocks(monkeypatch):
    """Cache blocks of GEN_ROWS rows at these small sizes, so multi-block paths are exercised."""
    from trakcli.projectors import matrices

    monkeypatch.setattr(matrices, "BLOCK_ENTRIES", 1)
    monkeypatch.setattr(matrices, "COUNTERS_PER_STEP", 4096)


def dense_matrix(proj, model_id=0):
    """P as [proj_dim, grad_dim] float64, read off the adjoint applied to the identity."""
    eye = torch.eye(proj.proj_dim)
    return proj.unproject(eye, model_id=model_id).double()


def make(kind="rademacher", impl="basic", grad_dim=2500, proj_dim=64, seed=0, **kw):
    return make_projector(
        kind=kind, implementation=impl, grad_dim=grad_dim, proj_dim=proj_dim, seed=seed, **kw
    )


# -- promise 2: every CPU implementation of one spec computes the same matrix -----------------


@pytest.mark.parametrize("kind, opts", KINDS, ids=KIND_IDS)
def test_single_block_basic_and_chunked_same_matrix(kind, opts):
    grad_dim = 2 * GEN_ROWS + 300  # two full cache blocks and a partial one
    ref = make(kind, "single_block", grad_dim=grad_dim, **opts)
    p_ref = dense_matrix(ref)
    others = [make(kind, "basic", grad_dim=grad_dim, block_size=b, **opts) for b in (1, 37, GEN_ROWS, 5000)]
    others += [make(kind, "chunked", grad_dim=grad_dim, max_chunk_size=c, **opts) for c in (1, 500, 4096)]
    others += [make(kind, "basic", grad_dim=grad_dim, cache_bytes=0, **opts)]
    for p in others:
        assert p.spec() == ref.spec()
        assert torch.equal(dense_matrix(p), p_ref), p
    # project reads the same matrix as unproject: project(I) = Pᵀ (exact for one nonzero per sum)
    for p in (ref, others[2], others[-2]):
        torch.testing.assert_close(p.project(torch.eye(grad_dim)).double(), p_ref.T, rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind, opts", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_project_matches_dense_reference(kind, opts, impl):
    size = {"basic": {"block_size": 700}, "chunked": {"max_chunk_size": 700}}.get(impl, {})
    proj = make(kind, impl, grad_dim=3000, proj_dim=48, **size, **opts)
    P = dense_matrix(make(kind, "single_block", grad_dim=3000, proj_dim=48, **opts))
    g = torch.randn(7, 3000, generator=torch.Generator().manual_seed(1))
    expect = g.double() @ P.T
    got = proj.project(g)
    assert got.dtype == torch.float32 and got.shape == (7, 48)
    torch.testing.assert_close(got.double(), expect, rtol=1e-5, atol=1e-5)
    z = torch.randn(4, 48, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(proj.unproject(z).double(), z.double() @ P, rtol=1e-5, atol=1e-5)


def test_prefix_property_matrix_does_not_depend_on_grad_dim_padding():
    # rows of Pᵀ are generated per fixed block, so a longer grad_dim extends the matrix
    for kind, opts in KINDS:
        small = dense_matrix(make(kind, grad_dim=1500, impl="single_block", **opts))
        big = dense_matrix(make(kind, grad_dim=4000, impl="basic", block_size=999, **opts))
        assert torch.equal(big[:, :1500], small)


# -- promise 1: pure function of spec and model_id --------------------------------------------


@pytest.mark.parametrize("kind, opts", [KINDS[0], KINDS[3]], ids=["rademacher", "sjlt3"])
@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_rows_independent_of_batch_size_and_composition(kind, opts, impl):
    proj = make(kind, impl, grad_dim=3000, proj_dim=64, block_size=1000, max_chunk_size=999, **opts)
    g = torch.randn(33, 3000, generator=torch.Generator().manual_seed(3))
    full = proj.project(g, model_id=2)
    # equal up to float32 rounding: BLAS may sum in another order for another batch size
    tol = dict(rtol=0, atol=2e-6 * full.abs().max().item())
    # single rows, other batch sizes, permuted batches
    for i in (0, 17, 32):
        torch.testing.assert_close(proj.project(g[i : i + 1], model_id=2)[0], full[i], **tol)
    perm = torch.randperm(33, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(proj.project(g[perm], model_id=2), full[perm], **tol)
    parts = torch.cat([proj.project(g[a : a + 8], model_id=2) for a in range(0, 33, 8)])
    torch.testing.assert_close(parts, full, **tol)


def test_fresh_projectors_of_equal_spec_agree_and_order_of_model_ids_is_irrelevant():
    a = make(grad_dim=2100, cache_bytes=0)
    b = make(grad_dim=2100, cache_bytes=1 << 20)  # cache that holds only part of the matrix
    g = torch.randn(5, 2100, generator=torch.Generator().manual_seed(5))
    a1 = a.project(g, model_id=1)
    b.project(g, model_id=0)
    b.project(g, model_id=3)
    torch.testing.assert_close(b.project(g, model_id=1), a1, rtol=0, atol=0)
    assert a.spec() == b.spec()


def test_dict_input_equals_concatenated_tensor():
    shapes = {"w1": (30, 40), "b1": (30,), "w2": (7, 30, 5), "b2": (7,)}
    grad_dim = sum(math.prod(s) for s in shapes.values())
    gen = torch.Generator().manual_seed(6)
    grads = {k: torch.randn(6, *s, generator=gen) for k, s in shapes.items()}
    flat = torch.cat([v.reshape(6, -1) for v in grads.values()], dim=1)
    for kind, opts in KINDS:
        for impl in CPU_IMPLS:
            proj = make(kind, impl, grad_dim=grad_dim, proj_dim=32, block_size=100, max_chunk_size=77, **opts)
            torch.testing.assert_close(proj.project(grads), proj.project(flat), rtol=1e-5, atol=1e-5)


# -- promise 4: adjoint and JL --------------------------------------------------------------------


@pytest.mark.parametrize("kind, opts", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_unproject_is_exact_adjoint(kind, opts, impl):
    proj = make(kind, impl, grad_dim=2600, proj_dim=40, dtype="float64", block_size=900, max_chunk_size=800, **opts)
    gen = torch.Generator().manual_seed(7)
    g = torch.randn(3, 2600, generator=gen, dtype=torch.float64)
    z = torch.randn(3, 40, generator=gen, dtype=torch.float64)
    lhs = (proj.project(g) * z).sum(dim=1)
    rhs = (g * proj.unproject(z)).sum(dim=1)
    torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("kind, opts", KINDS, ids=KIND_IDS)
def test_jl_preserves_norms_distances_and_inner_products(kind, opts):
    proj_dim, grad_dim, n = 1024, 4096, 24
    proj = make(kind, "basic", grad_dim=grad_dim, proj_dim=proj_dim, seed=11, **opts)
    g = torch.randn(n, grad_dim, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    f = proj.project(g).double()
    ratio = f.norm(dim=1) ** 2 / g.norm(dim=1) ** 2
    # ‖Pg‖²/‖g‖² has mean 1 and std ≈ sqrt(2/proj_dim) = 0.044 (normal; smaller for rademacher)
    assert (ratio - 1).abs().max() < 6 * math.sqrt(2 / proj_dim)
    assert abs(ratio.mean().item() - 1) < 3 * math.sqrt(2 / proj_dim / n) + 1e-3
    d_g = torch.pdist(g)
    d_f = torch.pdist(f)
    assert ((d_f / d_g) ** 2 - 1).abs().max() < 6 * math.sqrt(2 / proj_dim)
    ip_g = g @ g.T
    ip_f = f @ f.T
    norms = g.norm(dim=1)
    err = (ip_f - ip_g) / (norms[:, None] * norms[None, :])
    assert err.abs().max() < 6 / math.sqrt(proj_dim)


def test_entries_have_the_documented_distribution():
    k = 256
    P = dense_matrix(make("rademacher", "single_block", grad_dim=4096, proj_dim=k))
    scale = torch.tensor(1 / math.sqrt(k), dtype=torch.float32).item()
    assert torch.equal(P.abs(), torch.full_like(P, scale))
    assert abs((P > 0).double().mean().item() - 0.5) < 0.005
    Q = dense_matrix(make("normal", "single_block", grad_dim=4096, proj_dim=k))
    assert abs(Q.mean().item()) < 5 / math.sqrt(Q.numel()) / math.sqrt(k)
    assert abs(Q.var().item() * k - 1) < 0.01


# -- promise: independent matrices per model_id and seed -----------------------------------------


@pytest.mark.parametrize("kind, opts", KINDS, ids=KIND_IDS)
def test_model_ids_and_seeds_give_independent_matrices(kind, opts):
    proj = make(kind, "basic", grad_dim=3000, proj_dim=64, seed=0, **opts)
    other_seed = make(kind, "basic", grad_dim=3000, proj_dim=64, seed=1, **opts)
    mats = [dense_matrix(proj, 0), dense_matrix(proj, 1), dense_matrix(proj, 7), dense_matrix(other_seed, 0)]
    flat = torch.stack([m.flatten() for m in mats])
    corr = torch.corrcoef(flat)
    off = corr[~torch.eye(len(mats), dtype=torch.bool)]
    # independent matrices: correlation ~ N(0, 1/N) with N = 192000 entries
    assert off.abs().max() < 5 / math.sqrt(flat.shape[1])
    # and every generation block differs, not only the matrix as a whole
    for b in range(3):
        rows = slice(b * GEN_ROWS, min(3000, (b + 1) * GEN_ROWS))
        assert not torch.equal(mats[0][:, rows], mats[1][:, rows])
        assert not torch.equal(mats[0][:, rows], mats[3][:, rows])


def test_sjlt_columns_have_s_distinct_nonzeros_in_their_buckets():
    k, s_ = 50, 4
    P = dense_matrix(make("sjlt", "single_block", grad_dim=3000, proj_dim=k, s=s_))
    nz = P != 0
    assert torch.equal(nz.sum(dim=0), torch.full((3000,), s_))
    assert torch.equal(P[nz].abs(), torch.full((3000 * s_,), 0.5, dtype=torch.float64))
    bounds = [i * k // s_ for i in range(s_ + 1)]
    for i in range(s_):
        assert torch.equal(nz[bounds[i] : bounds[i + 1]].sum(dim=0), torch.ones(3000, dtype=torch.int64))
    # features used roughly uniformly, signs fair
    load = nz.sum(dim=1).double()
    assert load.min() > 0.6 * load.mean() and load.max() < 1.4 * load.mean()
    assert abs((P > 0).sum().item() / nz.sum().item() - 0.5) < 0.03


def test_generation_blocks_are_not_repeated_within_a_matrix():
    P = dense_matrix(make("rademacher", "single_block", grad_dim=3 * GEN_ROWS, proj_dim=64))
    blocks = [P[:, b * GEN_ROWS : (b + 1) * GEN_ROWS].flatten() for b in range(3)]
    corr = torch.corrcoef(torch.stack(blocks))
    assert corr[~torch.eye(3, dtype=torch.bool)].abs().max() < 5 / math.sqrt(blocks[0].numel())


# -- dtypes, devices, noop -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("kind", ["rademacher", "sjlt"])
def test_accepts_float_dtypes_and_returns_float32(dtype, impl, kind):
    proj = make(kind, impl, grad_dim=1200, proj_dim=32, max_chunk_size=500)
    g = torch.randn(4, 1200, generator=torch.Generator().manual_seed(9)).to(dtype)
    out = proj.project(g)
    assert out.dtype == torch.float32 and out.shape == (4, 32)
    torch.testing.assert_close(out, proj.project(g.float()), rtol=1e-5, atol=1e-5)
    assert proj.unproject(torch.ones(2, 32, dtype=dtype)).dtype == torch.float32


def test_noop_is_identity():
    proj = make_projector(kind="noop", grad_dim=50)
    assert proj.proj_dim == 50 and proj.spec()["kind"] == "noop"
    g = torch.randn(3, 50, dtype=torch.float16)
    torch.testing.assert_close(proj.project(g), g.float())
    torch.testing.assert_close(proj.unproject(g), g.float())
    assert make_projector(kind="noop", grad_dim=50, proj_dim=50).proj_dim == 50


def test_noop_ignores_a_config_proj_dim_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="trakcli.projectors"):
        proj = make_projector(kind="noop", grad_dim=50, proj_dim=2048)
    assert proj.proj_dim == 50
    assert "proj_dim=2048 is ignored" in caplog.text


def test_spec_is_json_and_excludes_implementation():
    import json

    a = make(impl="basic", block_size=10, cache_bytes=0)
    b = make(impl="single_block")
    assert json.loads(json.dumps(a.spec())) == a.spec() == b.spec()
    assert a.implementation == "basic" and b.implementation == "single_block"
    for key in ("kind", "grad_dim", "proj_dim", "seed", "dtype"):
        assert key in a.spec()
    assert make(seed=1).spec() != a.spec()
    assert make(kind="normal").spec() != a.spec()


def test_auto_picks_cuda_where_it_runs_else_basic_and_logs(caplog):
    from trakcli.projectors.factory import _cuda_unavailable

    with caplog.at_level(logging.INFO, logger="trakcli.projectors"):
        proj = make(impl="auto")
    picked = "basic" if _cuda_unavailable("rademacher") else "cuda"  # a GPU machine with triton picks cuda
    assert proj.implementation == picked
    assert f"picked '{picked}'" in caplog.text
    if not torch.cuda.is_available():
        assert "skipped 'cuda': no CUDA GPU" in caplog.text


# -- user errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kind": "rademacher_"}, "did you mean 'rademacher'"),
        ({"kind": "gaussian"}, "unknown projector kind 'gaussian'"),
        ({"implementation": "basik"}, "did you mean 'basic'"),
        ({"proj_dim": 0}, "proj_dim must be >= 1, got 0"),
        ({"proj_dim": 12.5}, "proj_dim must be an integer"),
        ({"proj_dim": "512"}, "proj_dim must be an integer"),
        ({"proj_dim": True}, "proj_dim must be an integer"),
        ({"grad_dim": 0}, "grad_dim must be >= 1, got 0"),
        ({"grad_dim": -5}, "grad_dim must be >= 1"),
        ({"seed": -1}, "seed must be >= 0"),
        ({"blok_size": 3}, "did you mean 'block_size'"),
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"dtype": "float16"}, "dtype must be one of float32, float64"),
        ({"cache_bytes": -1}, "cache_bytes must be >= 0"),
        ({"cache_bytes": "lots"}, "cache_bytes must be an integer"),
        ({"max_chunk_size": 0}, "max_chunk_size must be >= 1"),
        ({"implementation": "triton"}, "unknown projector implementation 'triton'"),
    ],
)
def test_bad_options_raise_projector_error(kwargs, message):
    args = {"kind": "rademacher", "implementation": "basic", "grad_dim": 100, "proj_dim": 16, "seed": 0}
    args.update(kwargs)
    with pytest.raises(ProjectorError, match=message):
        make_projector(**args)


def test_bad_inputs_raise_projector_error():
    proj = make(grad_dim=100, proj_dim=16)
    with pytest.raises(ProjectorError, match="grad_dim=100"):
        proj.project(torch.randn(2, 99))
    with pytest.raises(ProjectorError, match=r"shape \[n, grad_dim\]"):
        proj.project(torch.randn(100))
    with pytest.raises(ProjectorError, match="dtype torch.int64"):
        proj.project(torch.ones(2, 100, dtype=torch.int64))
    with pytest.raises(ProjectorError, match="hold 90 entries"):
        proj.project({"a": torch.randn(2, 9, 10)})
    with pytest.raises(ProjectorError, match="batch size 3"):
        proj.project({"a": torch.randn(2, 50), "b": torch.randn(3, 50)})
    with pytest.raises(ProjectorError, match="model_id must be >= 0"):
        proj.project(torch.randn(2, 100), model_id=-1)
    with pytest.raises(ProjectorError, match=r"\[n, 16\]"):
        proj.unproject(torch.randn(2, 15))
    with pytest.raises(ProjectorError, match="torch.Tensor"):
        proj.project([[1.0] * 100])


# -- generator, cache, chunking, cuda availability ---------------------------------------------


def test_philox_matches_random123_known_answers():
    from trakcli.projectors.philox import philox4x32

    def run(c, k):
        out = philox4x32(*(torch.tensor(x, dtype=torch.int64) for x in c), *k)
        return [int(x) for x in out]

    assert run((0, 0, 0, 0), (0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    m = 0xFFFFFFFF
    assert run((m, m, m, m), (m, m)) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    pi = ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0))
    assert run(*pi) == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_block_cache_keeps_a_prefix_of_a_too_large_matrix_and_evicts_other_models():
    from trakcli.projectors.base import BlockCache

    cache = BlockCache(max_bytes=3 * 400)
    blk = lambda: torch.zeros(100)  # noqa: E731 - 400 bytes
    for b in range(5):  # model 0 has 5 blocks, only 3 fit
        cache.put((0, b, "cpu"), blk())
    assert [cache.get((0, b, "cpu")) is not None for b in range(5)] == [True] * 3 + [False] * 2
    cache.put((1, 0, "cpu"), blk())  # another model evicts model 0's least recently used block
    assert cache.get((1, 0, "cpu")) is not None and cache.nbytes == 1200
    assert sum(cache.get((0, b, "cpu")) is not None for b in range(5)) == 2


def test_cache_auto_caches_small_matrices_only(caplog):
    small = make(grad_dim=5000, proj_dim=64)
    assert small.matrix.cache.max_bytes > 0
    with caplog.at_level(logging.INFO, logger="trakcli.projectors"):
        big = make(grad_dim=10**9, proj_dim=4096)  # 16 TB: never cached
    assert big.matrix.cache.max_bytes == 0
    assert "regenerated for every batch" in caplog.text
    assert make(grad_dim=5000, cache_bytes=0).matrix.cache.max_bytes == 0


def test_chunks_respect_max_chunk_size_and_cover_the_vector_in_order():
    shapes = {"a": (3, 5), "b": (40,), "c": (2,), "d": (7, 9)}
    grad_dim = 15 + 40 + 2 + 63
    gen = torch.Generator().manual_seed(12)
    grads = {k: torch.randn(2, *v, generator=gen) for k, v in shapes.items()}
    flat = torch.cat([v.reshape(2, -1) for v in grads.values()], dim=1)
    proj = make("rademacher", "chunked", grad_dim=grad_dim, proj_dim=8, max_chunk_size=16)
    chunks = [(start, torch.cat(parts, dim=1)) for start, parts in proj.chunk_parts(grads)]
    assert all(c.shape[1] <= 16 for _, c in chunks)
    assert [s for s, _ in chunks] == list(range(0, grad_dim, 16))
    torch.testing.assert_close(torch.cat([c for _, c in chunks], dim=1), flat)


def test_cuda_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    with pytest.raises(ProjectorError, match="no CUDA GPU.*Use implementation: basic"):
        make(impl="cuda")
    with pytest.raises(ProjectorError, match="dense kinds"):
        make("sjlt", impl="cuda")


def test_s_only_for_sjlt_and_bounded():
    with pytest.raises(ProjectorError, match="only applies to kind 'sjlt'"):
        make("rademacher", s=2)
    with pytest.raises(ProjectorError, match="s=65 is larger than proj_dim=64"):
        make("sjlt", s=65)
    with pytest.raises(ProjectorError, match="s must be >= 1"):
        make("sjlt", s=0)


def test_rademacher_sign_expansion_does_not_depend_on_byte_order(monkeypatch):
    from trakcli.projectors import matrices

    for proj_dim in (64, 128, 200):  # within one 128-column Philox group, exactly one, across two
        m = matrices.DenseMatrix("rademacher", 300, proj_dim, seed=3)
        lookup = m.generate(1, 0, 300, "cpu")
        monkeypatch.setattr(matrices, "LITTLE_ENDIAN", False)
        shifts = m.generate(1, 0, 300, "cpu")
        monkeypatch.setattr(matrices, "LITTLE_ENDIAN", True)
        assert torch.equal(lookup, shifts)
