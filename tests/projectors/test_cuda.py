"""The Triton projector computes the matrix of its CPU reference (the projector contract: features made on a GPU score against targets projected on a CPU).

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` at small sizes; the
tests skip when triton is not installed.
"""

from __future__ import annotations

import pytest
import torch

from trakcli.projectors import make_projector
from trakcli.projectors.matrices import DenseMatrix

pytest.importorskip("triton")

from trakcli.projectors.cuda import CudaProjector  # noqa: E402


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def reference(kind, grad_dim, proj_dim, seed):
    return make_projector(
        kind=kind, implementation="basic", grad_dim=grad_dim, proj_dim=proj_dim, seed=seed
    )


@pytest.mark.parametrize(
    "kind, grad_dim, proj_dim, n, model_id",
    [
        ("rademacher", 300, 40, 5, 0),
        ("rademacher", 70, 150, 17, 3),  # proj_dim crosses a 128-column Philox group
        ("normal", 300, 40, 5, 2),
        ("normal", 45, 70, 3, 0),
    ],
)
def test_kernel_matches_cpu_reference(interpret, kind, grad_dim, proj_dim, n, model_id):
    ref = reference(kind, grad_dim, proj_dim, seed=5)
    cuda = CudaProjector(DenseMatrix(kind, grad_dim, proj_dim, 5), block_m=16, block_n=32, block_k=16)
    assert cuda.spec() == ref.spec() and cuda.implementation == "cuda"
    P_ref = ref.unproject(torch.eye(proj_dim), model_id=model_id)
    P = cuda.unproject(torch.eye(proj_dim), model_id=model_id)
    if kind == "rademacher":
        assert torch.equal(P, P_ref)  # bit-identical signs and scale
    else:  # libm vs kernel log/cos/sin: a few float32 ulps
        torch.testing.assert_close(P, P_ref, rtol=1e-6, atol=1e-6)
    g = torch.randn(n, grad_dim, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    out = cuda.project(g, model_id=model_id)
    assert out.dtype == torch.float32 and out.shape == (n, proj_dim)
    torch.testing.assert_close(out, ref.project(g, model_id=model_id), rtol=1e-5, atol=1e-5)


def test_kernel_accepts_dict_and_strided_input(interpret):
    ref = reference("rademacher", 60, 32, seed=0)
    cuda = CudaProjector(DenseMatrix("rademacher", 60, 32, 0), block_m=16, block_n=16, block_k=16)
    big = torch.randn(4, 120)
    strided = big[:, ::2]  # non-contiguous [4, 60]
    torch.testing.assert_close(cuda.project(strided), ref.project(strided), rtol=1e-5, atol=1e-5)
    grads = {"w": torch.randn(4, 5, 10), "b": torch.randn(4, 10)}
    torch.testing.assert_close(cuda.project(grads), ref.project(grads), rtol=1e-5, atol=1e-5)


def test_cpu_tensors_without_interpreter_use_the_cpu_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ref = reference("normal", 100, 24, seed=1)
    cuda = CudaProjector(DenseMatrix("normal", 100, 24, 1))
    g = torch.randn(3, 100)
    torch.testing.assert_close(cuda.project(g, model_id=1), ref.project(g, model_id=1), rtol=1e-5, atol=1e-5)
    z = torch.randn(3, 24)
    torch.testing.assert_close(cuda.unproject(z), ref.unproject(z), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["rademacher", "normal"])
def test_gpu_features_match_cpu_features(kind):
    grad_dim, proj_dim = 100_003, 1000
    cuda = make_projector(kind=kind, implementation="cuda", grad_dim=grad_dim, proj_dim=proj_dim)
    ref = reference(kind, grad_dim, proj_dim, seed=0)
    g = torch.randn(33, grad_dim)
    torch.testing.assert_close(
        cuda.project(g.cuda(), model_id=4).cpu(), ref.project(g, model_id=4), rtol=1e-4, atol=1e-4
    )
