"""Refinement of the targets' inverse-Hessian-vector products by conjugate gradients, preconditioned by (E)K-FAC.

(E)K-FAC is a block-diagonal, Kronecker-factored approximation of the curvature. For the targets a user cares about,
the product ``x = (G + D)⁻¹ g_t`` with the Gauss-Newton matrix itself,

    G = (1/N) Σ_z J_zᵀ H_z J_z        (J_z: Jacobian of the logits in the selected parameters,
                                       H_z: Hessian of the summed loss in the logits, diag(p) − p pᵀ
                                       at every target position of a cross-entropy)

and the (E)K-FAC damping ``D = blockdiag(δ_l I)``, is solved by preconditioned conjugate gradients (Hestenes & Stiefel
1952; Martens 2010, "Deep learning via Hessian-free optimization"), with the (E)K-FAC inverse as the preconditioner
and its solution as the start, over a fixed sample of ``N`` training rows. Products ``G v`` come from one forward-mode
and one reverse-mode pass through the model (``torch.func.jvp`` and ``vjp``); no matrix is formed. With the
Gauss-Newton matrix of a cross-entropy, ``G`` is the Fisher that (E)K-FAC approximates (Martens 2014, "New insights
and perspectives on the natural gradient method"), so the iterations refine the same quantity.

The refined ``x`` is compared with the train features through the whitening ``W`` that
made them: the target's feature is ``P W⁻ᵀ x`` (:meth:`~trakcli.curvature.kfac.CurvatureFactors.dual`),
so that ``⟨P W⁻ᵀ x, P W g_z⟩ ≈ xᵀ g_z``; with no iterations it equals ``P W g_t``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.func import jvp, vjp

from trakcli.curvature.kfac import CurvatureFactors
from trakcli.gradients.hooks import first_rows
from trakcli.gradients.vmap import functional_logits, split_parameters
from trakcli.tasks import IGNORE_INDEX, Task, make_batch, token_labels

Vector = dict[str, torch.Tensor]


def _positions(task: Task, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [P, V], weight [P])``: the rows of the logits the loss is taken at (LM: the positions whose next
    token is a target), float64 weights 1 there."""
    if task.token_level:
        labels = token_labels(batch)
        pred = logits.reshape(*labels.shape, -1)[:, :-1]
        keep = (labels[:, 1:] != IGNORE_INDEX).reshape(-1)
        return pred.reshape(-1, pred.shape[-1]), keep.to(torch.float64)
    return logits.reshape(-1, logits.shape[-1]), torch.ones(logits.shape[0], dtype=torch.float64, device=logits.device)


class GaussNewton:
    """Products ``G v`` with the Gauss-Newton matrix of the loss over a fixed sample of training batches.

    Args:
        model: the model (eval mode), loaded with the checkpoint.
        param_names: the selected parameters ``v`` lives on.
        task: the task (token-level or ``[n, C]`` logits; cross-entropy).
        batches: the sample, ``(inputs, labels)`` on the model's device.

    Attributes:
        n_examples: rows of the sample (``N``).
    """

    def __init__(self, model: nn.Module, param_names: Sequence[str], task: Task, batches: Sequence[tuple[Any, Any]]):
        self.model, self.task, self.batches = model.eval(), task, list(batches)
        self.names = list(param_names)
        self.params, self.const = split_parameters(model, self.names)
        self.n_examples = sum(int(first_rows(x).shape[0]) for x, _ in self.batches)

    def __call__(self, v: Vector) -> Vector:
        """``G v``: ``v`` per parameter ``[*shape]`` (the parameters' dtype), the product likewise."""
        out = {n: torch.zeros_like(self.params[n]) for n in self.names}
        for inputs, labels in self.batches:
            def logits_of(p: Vector) -> torch.Tensor:
                return functional_logits(self.model, {**p, **self.const}, inputs)

            batch = make_batch(inputs, labels)
            logits, jv = jvp(logits_of, (self.params,), ({n: v[n].to(self.params[n]) for n in self.names},))
            rows, weight = _positions(self.task, logits, batch)
            jv_rows = _positions(self.task, jv, batch)[0].double()
            p = torch.softmax(rows.detach().double(), -1)
            hjv = (p * jv_rows - p * (p * jv_rows).sum(-1, keepdim=True)) * weight[:, None]
            _, pull = vjp(logits_of, self.params)
            (grads,) = pull(_unpositions(self.task, hjv.to(logits.dtype), logits, batch))
            for n in self.names:
                out[n] += grads[n]
        return {n: t / max(1, self.n_examples) for n, t in out.items()}


def _unpositions(task: Task, rows: torch.Tensor, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The inverse of :func:`_positions`: rows ``[P, V]`` back into a tensor of the logits' shape (0 elsewhere)."""
    if not task.token_level:
        return rows.reshape(logits.shape)
    labels = token_labels(batch)
    full = torch.zeros(*labels.shape, rows.shape[-1], dtype=rows.dtype, device=rows.device)
    full[:, :-1] = rows.reshape(labels.shape[0], labels.shape[1] - 1, -1)
    return full.reshape(logits.shape)


def _dot(a: Vector, b: Vector) -> torch.Tensor:
    return sum((a[n].double() * b[n].double()).sum() for n in a)


def refine(curvature: CurvatureFactors, gnvp: Callable[[Vector], Vector], g: Vector, iterations: int,
           tol: float = 1e-6) -> Vector:
    """``(G + D)⁻¹ g`` of one vector by preconditioned conjugate gradients (module docstring).

    Args:
        curvature: the fitted (E)K-FAC of the checkpoint: preconditioner ``M = (F̂ + D)⁻¹``, damping ``D``.
        gnvp: ``v ↦ G v`` (:class:`GaussNewton`).
        g: the right-hand side, per parameter ``[*shape]`` (one target's gradient).
        iterations: most CG steps (0: the (E)K-FAC solution ``M g``).
        tol: stop when the residual's norm falls below ``tol`` times ``g``'s.

    Returns:
        ``x`` per parameter, float64 on ``g``'s device.
    """
    damp = {p.name: f.damping(curvature.damping) for layer, f in zip(curvature.layers, curvature.factors)
            for p in layer.params}
    g = {n: t.double() for n, t in g.items()}

    def precondition(r: Vector) -> Vector:
        one = curvature.inverse_hvp({n: t[None] for n, t in r.items()})
        return {n: t[0].double() for n, t in one.items()}

    def apply(v: Vector) -> Vector:
        gv = gnvp(v)
        return {n: gv[n].double() + damp[n] * v[n] for n in v}

    x = precondition(g)
    if iterations <= 0:
        return x
    ax = apply(x)
    r = {n: g[n] - ax[n] for n in g}
    z = precondition(r)
    p = dict(z)
    rz = _dot(r, z)
    stop = tol * float(_dot(g, g).sqrt())
    for _ in range(iterations):
        if float(_dot(r, r).sqrt()) <= stop or float(rz) == 0.0:
            break
        ap = apply(p)
        alpha = rz / _dot(p, ap)
        x = {n: x[n] + alpha * p[n] for n in x}
        r = {n: r[n] - alpha * ap[n] for n in r}
        z = precondition(r)
        rz_new = _dot(r, z)
        p = {n: z[n] + (rz_new / rz) * p[n] for n in p}
        rz = rz_new
    return x
