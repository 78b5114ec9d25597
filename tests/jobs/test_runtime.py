"""Threads: ``num_threads`` for per-example gradients, ``linalg_threads`` for the kernels' and scores' linear algebra."""

from __future__ import annotations

import importlib

import pytest
import torch

from trakcli.config import load_config
from trakcli.errors import ConfigError
from trakcli.jobs.runtime import DEFAULT_THREADS, torch_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_torch_threads_sets_and_restores(restore_threads):
    torch.set_num_threads(1)
    with torch_threads(2) as n:
        assert n == 2 and torch.get_num_threads() == 2
    assert torch.get_num_threads() == 1
    with torch_threads(None) as n:  # unset: torch's count at import (one per core, or OMP_NUM_THREADS)
        assert n == DEFAULT_THREADS == torch.get_num_threads()
    assert torch.get_num_threads() == 1
    with pytest.raises(RuntimeError), torch_threads(2):
        raise RuntimeError("the count is restored on errors too")
    assert torch.get_num_threads() == 1


def test_linalg_threads_is_validated(user_project):
    assert load_config("run.yaml", ["linalg_threads=2"]).linalg_threads == 2
    assert load_config("run.yaml").linalg_threads is None
    with pytest.raises(ConfigError, match="linalg_threads"):
        load_config("run.yaml", ["linalg_threads=0"])


def test_featurize_and_score_use_each_setting_where_it_belongs(user_project, monkeypatch, restore_threads):
    """num_threads=1 for the gradients; linalg_threads=2 for the dual kernels (featurize) and the score products."""
    from projects import trak

    kernels = importlib.import_module("trakcli.jobs.kernels")
    block_scores = importlib.import_module("trakcli.topk.features")  # the score products of every block
    setup = importlib.import_module("trakcli.jobs.setup")
    seen: dict[str, set[int]] = {"gradients": set(), "kernel": set(), "score": set()}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            seen[name].add(torch.get_num_threads())
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(setup.JobSetup, "features", spy("gradients", setup.JobSetup.features))
    monkeypatch.setattr(kernels, "dual_solved_features", spy("kernel", kernels.dual_solved_features))
    monkeypatch.setattr(block_scores, "ensemble_block", spy("score", block_scores.ensemble_block))
    args = ["run.yaml", "projector.proj_dim=64", "num_threads=1", "linalg_threads=2", "-q"]  # n_train 40 < 64: dual
    trak("featurize", *args)
    trak("score", *args)
    assert seen == {"gradients": {1}, "kernel": {2}, "score": {2}}
    assert torch.get_num_threads() == 1  # the jobs restore num_threads after their linear algebra


def test_chunk_writer_keeps_order_waits_for_all_and_raises_the_first_error():
    import threading
    import time

    from trakcli.errors import StoreError
    from trakcli.jobs.runtime import ChunkWriter

    done: list[int] = []
    main = threading.get_ident()

    def write(i: int) -> None:
        assert threading.get_ident() != main  # in the background
        time.sleep(0.01 * (i % 3))
        done.append(i)

    with ChunkWriter(max_pending=2) as w:
        for i in range(7):
            w.submit(write, i)
    assert done == list(range(7))  # in submission order, all finished when the block ends

    def fail(i: int) -> None:
        done.append(i)
        raise StoreError(f"writing chunk {i} failed")

    done.clear()
    with pytest.raises(StoreError, match="chunk 1 failed"), ChunkWriter(max_pending=8) as w:
        w.submit(write, 0)
        w.submit(fail, 1)
        w.submit(fail, 2)
        w.submit(write, 3)
    assert done == [0, 1, 2, 3]  # the writes after the failed one still ran to the end

    done.clear()
    with pytest.raises(KeyError), ChunkWriter() as w:  # an error in the block: queued writes finish first
        w.submit(write, 5)
        raise KeyError("computing failed")
    assert done == [5]


def test_unset_grad_memory_is_1024_mib_on_a_cpu_and_a_quarter_of_the_gpu(monkeypatch):
    from types import SimpleNamespace

    from trakcli.jobs import runtime
    from trakcli.jobs.setup import batch_rows_for

    assert runtime.grad_memory_for(None, "cpu") == 1024
    assert runtime.grad_memory_for(7, "cpu") == runtime.grad_memory_for(7, "cuda") == 7  # a set value is kept
    # an 80 GB GPU: 20 GB; the total memory, never the free memory, so every run on that GPU cuts batches alike
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * 2**30))
    assert runtime.grad_memory_for(None, "cuda") == 20 * 1024
    def rows_per_batch(device: str) -> int:  # data.batch_size 64, data.grad_memory_mb unset, as prepare resolves them
        return batch_rows_for(64, runtime.grad_memory_for(None, device), grad_dim)

    grad_dim = 100_000_000  # 400 MB per example in float32
    assert rows_per_batch("cpu") == 2 and rows_per_batch("cuda") == 53
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=2 * 2**30))
    assert runtime.grad_memory_for(None, "cuda") == 1024  # a small GPU gets no less than a CPU
