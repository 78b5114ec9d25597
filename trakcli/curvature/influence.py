"""Exact (E)K-FAC influence of many queries on every train example, per layer, from layer hooks.

For a layer ``y_t = W a_t (+ b)`` (bias folded in, ``a_t ← [a_t, 1]``) an example's gradient is
``G = Σ_t g_t a_tᵀ`` ``[d_out, d_in]``; with the layer's fitted curvature (``Q_S``, ``Q_A``, ``Λ``,
:mod:`.kfac`) and damping ``δ`` the influence of train example ``z`` on query ``q`` is

    I(q, z) = Σ_layers ⟨H_q, G_z⟩,   H_q = Q_S [(Q_Sᵀ G_q Q_A) / (Λ + δ)] Q_Aᵀ

(Koh & Liang 2017 with the block-diagonal EK-FAC inverse; Grosse et al. 2023, Eq. 15-16).
Nothing here forms a whole-model per-example gradient:

* :class:`QueryLayerGrads` takes each query's ``G_q`` per layer from one hooked forward +
  backward, preconditions it (:func:`precondition_layer`), and keeps it at full rank or, with a
  ``rank``, as ``U Vᵀ`` from its truncated SVD (kronfluence's ``query_gradient_low_rank``;
  per layer the smaller of the two forms, exact when ``rank >= min(d_out, d_in)``).
* :class:`InfluencePass` is the hook consumer of a train batch: each layer's ``(a_t, g_t)`` meet every query at once,
  ``⟨H_q, G_z⟩`` from ``G_z = Σ_t g_t a_tᵀ`` (one batched product, then a GEMM against all queries) or, for low-rank
  queries, ``Σ_t (Uᵀ g_t)·(Vᵀ a_t)`` when that costs fewer operations (``T (d_out + d_in) R`` against
  ``T d_out d_in + d_out d_in R`` per example, ``R = n_query · rank``). One pass over the train rows scores every query.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from trakcli.curvature.kfac import CurvatureFactors, SameInput, input_how
from trakcli.errors import GradientError
from trakcli.gradients.hooks import HookPass, first_rows, logits_of
from trakcli.gradients.layers import Use
from trakcli.projectors.kronecker_layers import KroneckerLayer
from trakcli.tasks import Task, checked_outputs, make_batch


class _Inputs:
    """What both consumers share: each layer's ``a_t`` ``[b, T, d_in]`` float32 (bias column included) kept from its
    forward call (:meth:`~trakcli.gradients.kinds.Kind.layer_input`), and the calls of each layer's module (one
    run more than once sums its gradient over the calls in ``_grids`` until ``finish``)."""

    keeps_input = False

    def __init__(self, layers: Sequence[KroneckerLayer]):
        self.layers = layers
        self.same = SameInput()  # one copy of an input several layers read (read, never changed)
        self.calls = [0] * len(layers)
        self._grids: dict[int, torch.Tensor] = {}

    def take_input(self, use: Use, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        self.calls[use.layer] += 1
        layer = self.layers[use.layer]
        return self.same.take(x, input_how(layer, use), lambda: use.kind.layer_input(
            use.module, x, output, layer.d_in, layer.weight_cols, use.weight is not None, use.bias is not None,
            torch.float32))


class QueryLayerGrads(_Inputs):
    """Hook consumer of the queries' pass: each layer's ``G = Σ_t g_t a_tᵀ`` ``[n, d_out, d_in]``, preconditioned
    and cut to ``rank`` (:func:`precondition_layer`) as soon as its output gradient arrives, so that one layer's
    gradients exist at a time, never the whole model's (a module run more than once waits for :meth:`finish`).

    Args:
        layers: the curvature's layers.
        factors: the checkpoint's fitted curvature, with the damping of the scores.
        n: the queries of the batch.
        rank: the low rank, or None (full).
    """

    def __init__(self, layers: Sequence[KroneckerLayer], factors: CurvatureFactors, n: int, rank: int | None):
        super().__init__(layers)
        self.factors, self.n, self.rank = factors, n, rank
        self.done: dict[int, tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, int]] = {}

    def take_grad(self, use: Use, kept: torch.Tensor, g: torch.Tensor) -> None:
        j = use.layer
        f = self.factors.factors[j]
        dtype = f.q_out.dtype
        gt = use.kind.out_grads(g, kept.shape[0]).to(dtype=dtype, device="cpu")  # [n, T, d_out]
        a = kept.to(dtype=dtype, device="cpu")  # [n, T, d_in]
        d_out, d_in, t = f.q_out.shape[0], f.q_in.shape[0], gt.shape[1]
        if t * (d_out * d_out + d_in * d_in) < d_out * d_in * (d_out + d_in):  # few tokens: rotate them, not G
            x = (gt @ f.q_out).transpose(1, 2) @ (a @ f.q_in)  # Q_Sᵀ G Q_A  [n, d_out, d_in]
        else:
            x = f.q_out.T @ (gt.transpose(1, 2) @ a) @ f.q_in
        if self.calls[j] == 1:
            self.done[j] = precondition_layer(self.layers[j], self.factors, j, x, self.rank, rotated=True)
        else:
            self._grids[j] = x if j not in self._grids else self._grids[j] + x

    def finish(self) -> QueryGradients:
        """The batch's :class:`QueryGradients` (a layer no call reached: zeros)."""
        for j, x in self._grids.items():
            self.done[j] = precondition_layer(self.layers[j], self.factors, j, x, self.rank, rotated=True)
        self._grids = {}
        self.same.clear()
        for j, layer in enumerate(self.layers):
            if j not in self.done:
                zero = torch.zeros(self.n, layer.d_out, layer.d_in)
                self.done[j] = precondition_layer(layer, self.factors, j, zero, self.rank)
        return QueryGradients(self.n, *map(list, zip(*(self.done[j] for j in range(len(self.layers))))))


def hooked_pass(model: torch.nn.Module, uses: Sequence[Use], task: Task, inputs: Any, labels: torch.Tensor | None,
                consumer: Any, row_offset: int = 0) -> torch.Tensor:
    """One forward + backward of ``Σ_i f_i`` (the task's output function) through the hooks.

    Returns:
        ``[n]`` float32 out-to-loss terms ``Q`` of the batch (1 for :class:`~trakcli.tasks.LossOutput`).

    Raises:
        DataError: data the model or task refuses.
        GradientError: a module whose calls cannot give per-example terms.
    """
    first = first_rows(inputs)
    n, device = first.shape[0], first.device
    model.eval()
    with HookPass(model, uses, n, device, consumer) as hooks:
        logits = logits_of(model, inputs)
        f, q = checked_outputs(task, logits, make_batch(inputs, labels), row_offset)
        if hooks.problem is None and f.requires_grad:
            hooks.backward(f)
        if hooks.problem is not None:
            raise GradientError(f"{hooks.problem.text}; exact curvature scores cannot be taken there: leave it out "
                                "with grad_wrt")
    return q.detach().to(torch.float32)


@dataclass
class QueryGradients:
    """Every query's preconditioned gradient ``H_q`` per layer, at full or low rank (module docstring).

    Attributes:
        n_query: the queries.
        full: per layer ``[n_query, d_out · d_in]`` float32, or None where the layer is kept at low rank.
        left, right: per layer ``[d_out, n_query · r]`` and ``[d_in, n_query · r]`` float32 (query-major
            columns, ``U Σ`` and ``V``), or None where the layer is at full rank.
        ranks: per layer the rank kept (``min(d_out, d_in)`` at full rank).
    """

    n_query: int
    full: list[torch.Tensor | None]
    left: list[torch.Tensor | None]
    right: list[torch.Tensor | None]
    ranks: list[int]

    def to(self, device: torch.device) -> QueryGradients:
        """The same on ``device``."""
        move = lambda ts: [None if t is None else t.to(device) for t in ts]  # noqa: E731
        return QueryGradients(self.n_query, move(self.full), move(self.left), move(self.right), self.ranks)


def query_bytes(layers: Sequence[KroneckerLayer], n_query: int, rank: int | None) -> int:
    """Bytes of :class:`QueryGradients` of ``n_query`` queries at ``rank`` (None: full rank)."""
    total = 0
    for layer in layers:
        full = layer.d_out * layer.d_in
        total += full if rank is None else min(full, rank * (layer.d_out + layer.d_in))
    return 4 * n_query * total


def fitting_rank(layers: Sequence[KroneckerLayer], n_query: int, budget_bytes: int) -> int | None:
    """The rank :class:`QueryLayerGrads` keeps by default: None (full) when every query fits ``budget_bytes``,
    else the largest rank that fits (at least 1)."""
    if query_bytes(layers, n_query, None) <= budget_bytes:
        return None
    per_rank = 4 * n_query * sum(layer.d_out + layer.d_in for layer in layers)
    return max(1, budget_bytes // max(1, per_rank))


#: Extra columns of the randomized SVD (Halko, Martinsson & Tropp 2011) of a query's layer gradient kept at a rank
#: far below its smaller side (torch.svd_lowrank, two power iterations).
LOWRANK_OVERSAMPLE = 10


def precondition_layer(layer: KroneckerLayer, factors: CurvatureFactors, j: int, grads: torch.Tensor,
                       rank: int | None, rotated: bool = False
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, int]:
    """``H = Q_S [(Q_Sᵀ G Q_A) / (Λ + δ)] Q_Aᵀ`` of layer ``j`` (in the factors' dtype), kept at ``rank`` (None: full):
    the truncated SVD of the bracket (the rotations keep singular values), randomized where the rank is far
    below the layer's smaller side, its factors then rotated back (``Q_S U Σ``, ``Q_A V``: no full back-rotation).

    Args:
        layer: the layer.
        factors: the checkpoint's fitted curvature, with the damping of the scores.
        j: the layer's index in ``factors``.
        grads: ``[n, d_out, d_in]`` the queries' gradients of the layer, or with ``rotated`` already ``Q_Sᵀ G Q_A``.
        rank: the low rank, or None.

    Returns:
        ``(full [n, d_out · d_in], None, None, min(d_out, d_in))`` at full rank (also when ``rank`` would not
        save memory), else ``(None, U Σ [d_out, n · r], V [d_in, n · r], r)`` with query-major columns; float32.
    """
    f = factors.factors[j]
    n, q_out, q_in = grads.shape[0], f.q_out, f.q_in
    x = grads.to(dtype=q_out.dtype, device="cpu")  # the factors' dtype (a float32 model's: half the time of float64)
    if not rotated:
        x = q_out.T @ x @ q_in
    x = x / (f.eig + f.damping(factors.damping))  # [n, d_out, d_in], in the eigenbasis
    r_max = min(layer.d_out, layer.d_in)
    if rank is None or rank * (layer.d_out + layer.d_in) >= layer.d_out * layer.d_in:
        return (q_out @ x @ q_in.T).reshape(n, -1).float(), None, None, r_max
    r = min(rank, r_max)
    if r + LOWRANK_OVERSAMPLE < r_max // 4:  # a randomized range finder: O(d_out d_in r), not O(d_out d_in²)
        u, s, v = torch.svd_lowrank(x, q=r + LOWRANK_OVERSAMPLE, niter=2)  # [n, d_out, q], [n, q], [n, d_in, q]
        us, v = u[..., :r] * s[:, None, :r], v[..., :r]
    else:
        u, s, vh = torch.linalg.svd(x, full_matrices=False)  # [n, d_out, k], [n, k], [n, k, d_in]
        us = u[..., :r] * s[:, None, :r]  # [n, d_out, r]
        v = vh[:, :r, :].transpose(1, 2)  # [n, d_in, r]
    us, v = q_out @ us, q_in @ v  # back to the parameters' coordinates
    return (None, us.permute(1, 0, 2).reshape(layer.d_out, n * r).float().contiguous(),
            v.permute(1, 0, 2).reshape(layer.d_in, n * r).float().contiguous(), r)


class InfluencePass(_Inputs):
    """Hook consumer of a train batch: adds ``Σ_layers ⟨H_q, G_z⟩`` to ``scores`` ``[n, n_query]`` (float64).

    Args:
        layers: the curvature's layers.
        queries: :class:`QueryGradients` on the batch's device.
        n: rows of the batch.
        device: their device.
    """

    def __init__(self, layers: Sequence[KroneckerLayer], queries: QueryGradients, n: int, device: torch.device):
        super().__init__(layers)
        self.queries = queries
        self.scores = torch.zeros(n, queries.n_query, dtype=torch.float64, device=device)

    def take_grad(self, use: Use, kept: torch.Tensor, g: torch.Tensor) -> None:
        j, q = use.layer, self.queries
        gt = use.kind.out_grads(g, kept.shape[0]).to(torch.float32)  # [n, T, d_out]
        n, t = gt.shape[0], gt.shape[1]
        if self.calls[j] > 1:  # a module run several times: its G is the sum over the calls
            grid = gt.transpose(1, 2) @ kept
            self._grids[j] = grid if j not in self._grids else self._grids[j] + grid
            return
        layer, r = self.layers[j], q.ranks[j]
        big_r = q.n_query * r
        token_cost = t * (layer.d_out + layer.d_in) * big_r
        grid_cost = t * layer.d_out * layer.d_in + layer.d_out * layer.d_in * big_r
        if q.full[j] is None and token_cost <= grid_cost:
            prod = (gt @ q.left[j]) * (kept @ q.right[j])  # [n, T, n_query · r]
            self.scores += prod.sum(1).reshape(n, q.n_query, r).sum(-1).double()
        else:
            self.scores += self._grid_scores(j, gt.transpose(1, 2) @ kept)  # [n, d_out, d_in]

    def _grid_scores(self, j: int, grid: torch.Tensor) -> torch.Tensor:
        """``⟨H_q, G⟩`` ``[n, n_query]`` float64 of whole per-example layer gradients ``[n, d_out, d_in]``."""
        q = self.queries
        n = grid.shape[0]
        if q.full[j] is not None:
            return (grid.reshape(n, -1) @ q.full[j].T).double()
        r = q.ranks[j]
        gv = grid @ q.right[j]  # [n, d_out, n_query · r]
        return (gv * q.left[j]).sum(1).reshape(n, q.n_query, r).sum(-1).double()

    def finish(self) -> torch.Tensor:
        """The batch's scores ``[n, n_query]`` float64 (layers called more than once added now)."""
        for j, grid in self._grids.items():
            self.scores += self._grid_scores(j, grid)
        self._grids = {}
        self.same.clear()
        return self.scores
