"""What every job needs from the machine it runs on: device, threads, the store lock, the test event hook.

Each function takes the one setting it uses (no config), so `trak eval`'s worker processes and the jobs share it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from trakcli.distributed import Dist
from trakcli.errors import ConfigError
from trakcli.files import event  # noqa: F401  (the jobs' events: trakcli.files.event)
from trakcli.progress import Reporter
from trakcli.store import Store, StoreLock
from trakcli.store.hashes import HashCache
from trakcli.store.location import store_location


def resolve_device(name: str, dist: Dist | None = None) -> torch.device:
    """The torch device of the ``device`` setting: ``auto`` is cuda if available, else cpu; under torchrun each
    process takes the GPU of its ``LOCAL_RANK`` (``dist.local_rank``).

    Raises:
        ConfigError: ``cuda`` was asked for and no CUDA GPU is available.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device: 'cuda' was asked for but no CUDA GPU is available; use device=cpu or auto")
        return torch.device("cuda", dist.local_rank if dist else 0)
    return torch.device(name)


#: ``data.grad_memory_mb`` when it is unset and the job runs on a CPU (MiB).
CPU_GRAD_MEMORY_MB = 1024


def grad_memory_for(value: int | None, device: torch.device | str) -> int:
    """``data.grad_memory_mb`` in MiB: ``value`` when set; unset, 1024 on a CPU and a quarter of a CUDA GPU's
    *total* memory (not its free memory, so that a resumed run or another rank cuts batches into the same passes
    and computes the same features bit for bit)."""
    if value is not None:
        return value
    device = torch.device(device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return max(CPU_GRAD_MEMORY_MB, total // 4 // 2**20)
    return CPU_GRAD_MEMORY_MB


#: torch's intra-op thread count when the jobs were first imported, before any ``num_threads``
#: setting: one per core, or ``OMP_NUM_THREADS`` (which torchrun sets to 1 when it starts
#: several processes). The default of :func:`torch_threads`.
DEFAULT_THREADS = torch.get_num_threads()


def apply_threads(num_threads: int | None) -> None:
    """``torch.set_num_threads(num_threads)`` when set (the ``num_threads`` setting); None leaves torch's default."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)


@contextmanager
def torch_threads(num_threads: int | None) -> Iterator[int]:
    """Run the block with ``num_threads`` torch threads (None: :data:`DEFAULT_THREADS`), then restore the count:
    the ``linalg_threads`` setting of the few large BLAS/LAPACK calls of kernels and scores, which scale with
    threads unlike the many small operations of per-example gradients (``num_threads``).

    Yields:
        The thread count in effect inside the block.
    """
    before = torch.get_num_threads()
    n = num_threads or DEFAULT_THREADS
    if n != before:
        torch.set_num_threads(n)
    try:
        yield n
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


@contextmanager
def locked_store(path: str | Path, dist: Dist, reporter: Reporter) -> Iterator[None]:
    """Hold ``<store>.lock`` for the duration of a run (rank 0 only; other ranks follow rank 0), after creating
    the store's parent and saving this process's checkpoint sha256s (:class:`trakcli.store.hashes.HashCache`);
    a note from the lock (a stale lock taken over) goes to ``reporter.info``.

    Raises:
        StoreError: the store is in use by a live run, or its parent cannot be created.
    """
    lock = StoreLock.for_store(store_location(path)) if dist.is_main else None
    if lock is not None:
        Store.prepare_parent(store_location(path))
        note = lock.acquire()
        if note:
            reporter.info(note)
        HashCache.for_store(path).save()
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


class ChunkWriter:
    """Store writes in one background thread, in submission order, while the caller computes on.

    At most ``max_pending`` writes wait (:meth:`submit` blocks beyond that). As a context manager, leaving the
    block waits for every write and raises the first write's error; on an error inside the block the writes
    already submitted still finish first, so no thread outlives the lock half-way through a write.
    """

    def __init__(self, max_pending: int = 4) -> None:
        self.max_pending = max_pending
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trak-writer")
        self._pending: list[Future[Any]] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)``; first waits for the oldest writes while ``max_pending`` are queued.

        Raises:
            Whatever a finished write raised (the first one).
        """
        while len(self._pending) >= self.max_pending:
            self._pending.pop(0).result()
        self._pending.append(self._pool.submit(fn, *args))

    def __enter__(self) -> "ChunkWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Wait for every queued write; raise the first write's error unless an error is already in flight."""
        try:
            errors = [e for e in (f.exception() for f in self._pending) if e is not None]
            self._pending = []
            if errors and exc_type is None:
                raise errors[0]
        finally:
            self._pool.shutdown(wait=True)
