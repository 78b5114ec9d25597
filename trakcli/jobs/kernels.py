"""The per-checkpoint kernels ``train/<model_id>/kernel``: made at the end of `trak featurize`, used by `trak score`.

A kernel depends only on the train features ``Φ_m`` and the ridge (``score.lambda_reg``, ``score.lambda_rel``),
so `trak featurize` makes each once its features are complete (as MadryLab's TRAK's ``finalize_features``);
a score run with another ridge, or a store whose kernels are missing or corrupt, makes them there
(:func:`kernel_of`). Math: :mod:`trakcli.scoring`.
"""

from __future__ import annotations

import numpy as np
import torch

from trakcli.distributed import Dist
from trakcli.jobs.runtime import event, torch_threads
from trakcli.progress import NULL_REPORTER, Reporter
from trakcli.scoring import DUAL, dual_gram, dual_solved_features, gram_matrix, kernel_form, solve_kernel
from trakcli.store import ChunkedRows, Store
from trakcli.store.kernel import drop_gram_prefix, kernel_done, read_gram_prefix, read_kernel, write_kernel


def ridge_settings(lambda_reg: float | None, lambda_rel: float) -> dict[str, float | None]:
    """The settings a stored kernel is made with and checked against (``score.lambda_reg``, ``score.lambda_rel``)."""
    return {"lambda_reg": lambda_reg, "lambda_rel": lambda_rel}


def report_notes(store: Store, reporter: Reporter) -> None:
    """Send the store's notes (repairs made while reading) to ``reporter.info`` and clear them."""
    for note in store.notes:
        reporter.info(note)
    store.notes.clear()


def kernel_of(store: Store, rows: ChunkedRows, model_id: int, *, lambda_reg: float | None,
              lambda_rel: float) -> tuple[torch.Tensor, float]:
    """Checkpoint ``model_id``'s kernel: the stored one (verified; a corrupt or missing one is deleted and made
    again, noted in ``store.notes``), else computed from ``rows`` (``Φ_m``, complete) and stored. After an
    append, a primal kernel's Gram starts from the old rows' (:func:`trakcli.store.kernel.save_gram_prefix`).

    Returns:
        ``(kernel, λ)``, the kernel by :func:`trakcli.scoring.kernel_form`: the ``[proj_dim, proj_dim]`` float64
        lower Cholesky factor of ``Φ_mᵀΦ_m + λI`` (:data:`~trakcli.scoring.PRIMAL`), or when ``n_train <
        proj_dim`` the ``[n_train, proj_dim]`` float32 ``(Φ_mΦ_mᵀ + λI)⁻¹Φ_m`` (:data:`~trakcli.scoring.DUAL`).

    Raises:
        TrakError: the kernel is not positive definite (:func:`trakcli.scoring.kernel_factor`).
        StoreError: the kernel could not be written.
    """
    settings = ridge_settings(lambda_reg, lambda_rel)
    stored = read_kernel(store, model_id, settings, rebuild=True)
    if stored is not None:
        return torch.from_numpy(stored[0]), stored[1]
    event(f"start kernel {model_id}")
    proj_dim = store.layout.proj_dim
    form = kernel_form(rows.n_rows, proj_dim)
    if form == DUAL:
        phi = torch.from_numpy(rows.read("features", 0, rows.n_rows).astype(np.float32, copy=False))
        factor, lam = solve_kernel(dual_gram(phi), rows.n_rows, lambda_reg, lambda_rel, proj_dim)
        kernel = dual_solved_features(phi, factor)
        del phi, factor
    else:
        gram = _gram(store, rows, model_id)
        kernel, lam = solve_kernel(gram, rows.n_rows, lambda_reg, lambda_rel, proj_dim)
        del gram
    write_kernel(store, model_id, kernel.numpy(), settings, lam, form=form)
    drop_gram_prefix(store, model_id)
    return kernel, lam


def _gram(store: Store, rows: ChunkedRows, model_id: int) -> torch.Tensor:
    """``Φ_mᵀΦ_m`` ``[proj_dim, proj_dim]`` float64: the Gram kept of the rows before an append
    (:func:`trakcli.store.kernel.read_gram_prefix`) plus the new rows' products, else every chunk's."""
    prefix = read_gram_prefix(store, model_id)
    if prefix is None or not 0 < prefix[1] < rows.n_rows:
        return gram_matrix(torch.from_numpy(c.astype(np.float32, copy=False)) for _, _, c in rows.iter_chunks("features"))
    start = prefix[1]

    def new_rows():
        for c in range(start // rows.chunk_rows, rows.n_chunks):
            lo, hi = rows.rows(c)
            yield torch.from_numpy(rows.read("features", max(lo, start), hi).astype(np.float32, copy=False))

    return torch.from_numpy(prefix[0]) + gram_matrix(new_rows())


def finalize_kernels(
    store: Store, train_rows: list[ChunkedRows], *, lambda_reg: float | None, lambda_rel: float,
    dist: Dist | None = None, reporter: Reporter = NULL_REPORTER, verify: bool = True,
    linalg_threads: int | None = None,
) -> int:
    """Make every missing kernel (:func:`kernel_of`): checkpoint ``m`` on rank ``m mod world_size``; then a barrier.

    Args:
        store, train_rows: the open store; per model_id, complete train features.
        lambda_reg, lambda_rel: the ridge (``score:`` of the config).
        dist: the process group (default: one process).
        reporter: a progress bar over the kernels made, and repair notes.
        verify: read and verify kernels already stored (`trak score`), or trust a finished kernel's
            attributes (`trak featurize`, :func:`trakcli.store.kernel.kernel_done`).
        linalg_threads: torch threads of the Gram matrices and factors (None:
            :data:`trakcli.jobs.runtime.DEFAULT_THREADS`).

    Returns:
        Kernels computed by this process.
    """
    dist = dist or Dist()
    settings = ridge_settings(lambda_reg, lambda_rel)
    mine = list(range(dist.rank, len(train_rows), dist.world_size))
    if not verify:
        mine = [m for m in mine if not kernel_done(store, m, settings)]
    made = 0
    if mine:
        with reporter.task("kernels", len(mine)) as task, torch_threads(linalg_threads):
            for model_id in mine:
                if not (verify and read_kernel(store, model_id, settings, rebuild=True) is not None):
                    kernel_of(store, train_rows[model_id], model_id, lambda_reg=lambda_reg, lambda_rel=lambda_rel)
                    made += 1
                task.advance()
    report_notes(store, reporter)
    dist.barrier()
    return made
