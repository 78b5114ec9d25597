"""Exact curvature scores: the targets' whitened gradients against every train example's, recomputed while scoring.

With ``curvature.exact`` (the default of the kinds ``kfac`` and ``ekfac``), `trak score` does not score
through the stored ``proj_dim`` features: per checkpoint it whitens each target's gradient (or, with
``curvature.refine``, the dual of its refined inverse-Hessian-vector product) with damping
``curvature.damping``, then runs one pass of per-example gradients over ``data.train``, whitening
each and taking its inner products with the targets'. The result is the influence
g(t)ᵀ (F + δ)⁻¹ g(z) of the fitted curvature without any projection error, computed the way
kronfluence computes its pairwise scores (train gradients recomputed for the queries), and
ensembled over checkpoints like TRAK's scores:

    τ(t, z) = [(1/M) Σ_m ⟨W_m g_m(t), W_m g_m(z)⟩] · [(1/M) Σ_m Q_m(z)]

Measured on a fine-tuned GPT-2 (``benchmarks/bench_lds_finetune.py``), the projection to 4,096
dimensions cost a third of the exact scores' LDS; the stored features stay what top-k over a large
corpus needs (``curvature.exact: false``).

Memory: the targets' whitened gradients ``[n_target, grad_dim]`` float32 are held in chunks of at most
``data.grad_memory_mb`` (one pass over the train rows per chunk), and the scores ``[n_target, n_train]``
float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from trakcli.data.tensors import inputs_to
from trakcli.jobs.runtime import event
from trakcli.progress import NULL_REPORTER, Reporter


def exact_scores(s: Any, store: Any, target: Any, damping: float, memory_mb: int = 1024,
                 reporter: Reporter = NULL_REPORTER) -> np.ndarray:
    """The exact curvature scores of every target against every train row (module docstring).

    Args:
        s: the :class:`~trakcli.jobs.setup.JobSetup` (its featurizer is a ``GradientFeaturizer`` with a curvature).
        store: the open store (each checkpoint's fitted curvature is read from it).
        target: the targets.
        damping: ``curvature.damping``.
        memory_mb: most MiB of the targets' whitened gradients held at once (``data.grad_memory_mb``).
        reporter: progress over the train rows of each checkpoint and target chunk.

    Returns:
        ``[n_target, n_train]`` float32 scores.

    Raises:
        StoreError: a checkpoint's curvature is not in the store (run `trak featurize`).
        GradientError, DataError: as featurize.
    """
    feat = s.featurizer
    n_t, n = len(target), len(s.train)
    n_models = len(s.checkpoints)
    chunk = max(1, min(n_t, memory_mb * 2**20 // (4 * max(1, feat.grad_dim))))
    total = np.zeros((n_t, n), dtype=np.float64)
    q_sum = np.zeros(n, dtype=np.float64)
    for model_id in range(n_models):
        s.load(model_id)
        s.curvature.read(store, model_id)
        train_view = s.curvature.with_damping(damping)
        target_view = s.curvature.with_damping(damping)
        s.refine_targets(target_view)  # the targets' solves refined by conjugate gradients, if asked
        for t_lo in range(0, n_t, chunk):
            t_hi = min(n_t, t_lo + chunk)
            event(f"start exact {model_id} {t_lo}")
            parts = []
            for off, x, y in s.batches(target, t_lo, t_hi):
                g, _ = feat.transformed(inputs_to(x, s.device), y.to(s.device), model_id, off, curvature=target_view)
                parts.append(feat.grads.flatten(g).float())
            w_t = torch.cat(parts)  # [chunk, grad_dim]
            with reporter.task(f"exact scores model {model_id}", n) as task:
                for off, x, y in s.batches(s.train, 0, n):
                    g, q = feat.transformed(inputs_to(x, s.device), y.to(s.device), model_id, off,
                                            curvature=train_view)
                    total[t_lo:t_hi, off:off + len(y)] += (w_t @ feat.grads.flatten(g).float().T).double().cpu().numpy()
                    if t_lo == 0:
                        q_sum[off:off + len(y)] += q.double().cpu().numpy()
                    task.advance(len(y))
            event(f"done exact {model_id} {t_lo}")
    return (total / n_models * (q_sum / n_models)[None, :]).astype(np.float32)
