"""The slots: what the inner optimizer sees as one parameter (:func:`trakcli.optim.groups.build_slots` picks them).

:class:`IdentitySlot` (a real parameter), :class:`MatrixSlot` (one-sided, per matrix), :class:`GlobalSlot` (a
group as one vector) and :class:`~trakcli.optim.kronecker_slot.KroneckerSlot` (two-sided, kind ``kronecker``).

Every matrix comes from :func:`trakcli.projectors.make_projector` (the kronecker factors from
:mod:`trakcli.projectors.kronecker`) with a seed derived from the projection seed and the slot's position;
the ``k``-th projection drawn (after ``k`` refreshes) is the projector's ``model_id = k``. So a matrix is a
pure function of (settings, position, k): the optimizer state stores integers, never matrices. Since
``E[PᵀP] = I`` (E‖Pg‖² = ‖g‖²), the unprojected SGD update ``-lr·PᵀPg`` is an unbiased estimate of ``-lr·g``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from trakcli.errors import OptimizerError, TrakError
from trakcli.projectors import Projector, make_projector

#: Most bytes of generated matrix one projector of the optimizer caches.
CACHE_LIMIT = 2**30

#: Inner-optimizer state entries that are linear in the gradient (first moments):
#: ``transfer`` maps these into a new subspace; every other entry is kept.
LINEAR_STATE_KEYS = ("momentum_buffer", "exp_avg", "grad_avg", "prev")


def derive_slot_seed(seed: int, *position: int) -> int:
    """The projector seed of the slot at ``position`` (e.g. ``(group, index)``): a hash, in ``[0, 2**62)``."""
    data = ",".join(str(int(v)) for v in (seed, *position)).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


def _proj_dtype(dtype: torch.dtype) -> str:
    return "float64" if dtype == torch.float64 else "float32"


def build_projector(
    settings: dict[str, Any], grad_dim: int, proj_dim: int | None, seed: int, dtype: torch.dtype
) -> Projector:
    """A projector of the settings' kind for one slot, caching about two of its matrices.

    Raises:
        OptimizerError: the projector cannot be built (the projector's message, wrapped).
    """
    kind = settings["kind"]
    implementation = settings.get("implementation", "auto")
    if implementation == "auto" and kind == "sjlt":
        implementation = "chunked"  # the same matrix, faster than basic for one row per step
    options: dict[str, Any] = {"dtype": _proj_dtype(dtype)}
    if kind != "noop":
        # room for two draws (a refresh's transfer reads the old and the new one), at most CACHE_LIMIT:
        # a bigger dense matrix is regenerated block by block at every step (use kind sjlt for such sizes)
        need = 8 * grad_dim * int(proj_dim or 1) if kind != "sjlt" else 16 * grad_dim
        options["cache_bytes"] = min(need, CACHE_LIMIT)
    try:
        return make_projector(kind, implementation, grad_dim=grad_dim, proj_dim=proj_dim, seed=seed, **options)
    except TrakError as e:
        raise OptimizerError(f"cannot build the optimizer's projector: {e}") from None


def global_projectors(
    settings: dict[str, Any], numels: list[int], group_index: int, dtype: torch.dtype
) -> tuple[Projector | None, list[Projector] | None]:
    """``(single, blocks)`` of mode global: kind noop one projector of ``Σ numels``, else one per parameter."""
    if settings["kind"] == "noop":
        return build_projector(settings, sum(numels), None, 0, dtype), None
    seeds = [derive_slot_seed(settings["seed"], group_index, i) for i in range(len(numels))]
    return None, [build_projector(settings, n, settings["proj_dim"], seed, dtype) for n, seed in zip(numels, seeds)]


def _clip_norm(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Scale ``new`` down so that its norm does not exceed ``old``'s (never up)."""
    n_old = float(old.double().norm())
    n_new = float(new.double().norm())
    if n_new > n_old:
        new = new * (n_old / n_new * (1.0 - 2.0**-20))
    return new


class Slot:
    """Base of the slots: ``params`` (the real parameters) and ``inner_param`` (what the inner optimizer steps)."""

    projected = False

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.shape = tuple(params[0].shape)  # what the inner optimizer steps

    @property
    def inner_param(self) -> torch.Tensor:
        return self.params[0]


class IdentitySlot(Slot):
    """A real parameter stepped by the inner optimizer directly (1-D in ``per_matrix`` mode, one that projecting
    would not shrink, or kind ``noop``)."""


class _ProjectedSlot(Slot):
    """A slot whose inner parameter is a shadow tensor of the projected shape.

    The shadow holds no storage between steps: at a step it is set to zeros, the inner optimizer steps it, and what it
    then holds is exactly the inner update, mapped back with the adjoint and added to the real parameters.
    """

    projected = True

    def __init__(self, params: list[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype):
        super().__init__(params)
        self.shape = shape
        self.shadow = torch.empty(0, dtype=dtype, device=params[0].device)
        self._released = self.shadow.data  # the 0-element tensor the shadow holds between steps

    @property
    def inner_param(self) -> torch.Tensor:
        return self.shadow

    def set_grad(self, grads: list[torch.Tensor | None], k: int) -> None:
        """Zero the shadow and give it the projected gradient (projection number ``k``)."""
        g = self.project(grads, k)
        self.shadow.data = torch.zeros(self.shape, dtype=self.shadow.dtype, device=self.shadow.device)
        self.shadow.grad = g if g.dtype == self.shadow.dtype else g.to(self.shadow.dtype)

    def take_update(self) -> torch.Tensor:
        """The inner update (the shadow's value), releasing the shadow's storage."""
        upd = self.shadow.data
        self.shadow.grad = None
        self.shadow.data = self._released
        return upd

    def apply_update(self, k: int, alpha: float) -> None:
        """Add ``alpha · Pᵀ u`` (``u``: the inner update, projection ``k``) to the parameters, releasing the shadow."""
        u = self.take_update()
        for p, full in zip(self.params, self.unproject(u, k)):
            if p.grad is not None:
                p.add_(full if full.dtype == p.dtype else full.to(p.dtype), alpha=alpha)

    def project(self, grads: list[torch.Tensor | None], k: int) -> torch.Tensor:
        raise NotImplementedError

    def unproject(self, u: torch.Tensor, k: int) -> list[torch.Tensor]:
        raise NotImplementedError

    def transfer(self, m: torch.Tensor, k_old: int, k_new: int) -> torch.Tensor:
        """Map a first moment ``m`` (shape ``self.shape``) from projection ``k_old`` to ``k_new``.

        ``m' = c · P_new P_oldᵀ m`` (the full-space vector ``P_oldᵀ m`` seen in the new subspace), with
        ``c = proj_dim / grad_dim`` the least-squares factor (``P Pᵀ ≈ (grad_dim / proj_dim) I``), then scaled down if
        needed so that ``‖m'‖ <= ‖m‖``: a refresh never grows a moment.
        """
        raise NotImplementedError


class MatrixSlot(_ProjectedSlot):
    """One parameter of >= 2 dims, projected along its smaller side to ``rank``.

    ``W`` is viewed as ``[a, b]`` (``W.reshape(a, -1)``) oriented as ``[L, s]``, ``L = max(a, b)``,
    ``s = min(a, b)``; its gradient ``G`` becomes ``R = G Pᵀ`` ``[L, rank]`` with ``P`` a ``[rank, s]`` JL
    matrix and an update ``U`` returns as ``U P`` (GaLore's shape, Zhao et al. 2024, Alg. 1, with a random
    projection instead of an SVD as in Flora, Hao et al. 2024). The shadow (and every state tensor the inner
    optimizer makes with ``zeros_like``) is stored rank-major, the transpose of a contiguous ``[rank, L]``
    tensor: a CPU BLAS computes ``Rᵀ = P Gᵀ`` faster than ``G Pᵀ`` for a small rank.

    Args:
        param: the parameter, viewed as ``[a, b] = [shape[0], numel / shape[0]]``.
        projector: ``grad_dim = min(a, b)``, ``proj_dim = rank``; its dtype is the shadow's.
    """

    def __init__(self, param: torch.Tensor, projector: Projector):
        a = param.shape[0]
        b = param.numel() // a
        self.transposed = a < b
        self.long, self.short = max(a, b), min(a, b)
        self.projector = projector
        self._dense: tuple[int, torch.Tensor] | None = None
        super().__init__([param], (self.long, projector.proj_dim), projector.dtype)

    def _short_major(self, g: torch.Tensor) -> torch.Tensor:  # [*shape] -> [s, L] (a view when g is contiguous)
        m = g.reshape(g.shape[0], -1)
        return m if self.transposed else m.T

    def matrix(self, k: int) -> torch.Tensor:
        """The projector's matrix ``P`` ``[rank, s]`` of draw ``k``: ``unproject(I)``, exact; the latest is kept."""
        if self._dense is not None and self._dense[0] == k:
            return self._dense[1]
        eye = torch.eye(self.projector.proj_dim, dtype=self.projector.dtype, device=self.shadow.device)
        mat = self.projector.unproject(eye, model_id=k)
        self._dense = (k, mat)
        return mat

    def project(self, grads, k):
        (g,) = grads
        p = self.matrix(k)
        gt = self._short_major(g)
        if gt.dtype != p.dtype:
            gt = gt.to(p.dtype)
        return torch.mm(p, gt).T  # [rank, s] @ [s, L] -> [rank, L], seen as [L, rank]

    def set_grad(self, grads, k):
        g = self.project(grads, k)  # [L, rank], rank-major
        self.shadow.data = torch.zeros_like(g.T).T
        self.shadow.grad = g

    def unproject(self, u, k):
        p = self.matrix(k)
        full = (u if u.dtype == p.dtype else u.to(p.dtype)) @ p  # [L, rank] -> [L, s]
        if self.transposed:
            full = full.T
        return [full.view(self.params[0].shape) if full.is_contiguous() else full.reshape(self.params[0].shape)]

    def apply_update(self, k, alpha):
        """``W += alpha · (u P)`` as one in-place addmm on the parameter's oriented view (no ``[L, s]`` temporary)."""
        param = self.params[0]
        p = self.matrix(k)
        if param.grad is None or param.dtype != p.dtype or not param.is_contiguous():
            super().apply_update(k, alpha)
            return
        u = self.take_update()
        target = param.view(param.shape[0], -1)  # [a, b]
        target = target.T if self.transposed else target  # [L, s]
        target.addmm_(u, p, alpha=alpha)

    def transfer(self, m, k_old, k_new):
        mt = m.T.to(self.projector.dtype)  # [rank, L]
        full_t = self.matrix(k_old).T @ mt  # [s, L]: (m P_old)ᵀ
        new_t = self.matrix(k_new) @ full_t * (self.projector.proj_dim / self.short)  # [rank, L]
        return _clip_norm(new_t, m).to(m.dtype).T  # [L, rank], rank-major like the shadow


class GlobalSlot(_ProjectedSlot):
    """All parameters of a group as one vector, projected to ``proj_dim`` (intrinsic dimension, Li et al. 2018;
    Aghajanyan et al. 2021).

    With one projector per parameter the matrix is ``[P_1 | P_2 | ...]``: all entries i.i.d., so one JL matrix,
    and each parameter's part of the update is computed without forming the others.

    Args:
        params: the parameters, flattened and concatenated in order (``grad_dim`` entries).
        blocks: one projector per parameter (``grad_dim = numel``, common ``proj_dim``): ``P = [P_1 | P_2 | ...]``; or
        single: one projector of ``grad_dim = Σ numel`` (a user's projector object, or ``noop``).
    """

    def __init__(self, params, *, blocks: list[Projector] | None = None, single: Projector | None = None):
        self.blocks, self.single = blocks, single
        first = single or blocks[0]  # type: ignore[index]
        self.grad_dim = sum(p.numel() for p in params)
        self.proj_dtype = first.dtype
        super().__init__(list(params), (first.proj_dim,), first.dtype)

    def project(self, grads, k):
        if self.single is not None:
            flat = [(g if g is not None else torch.zeros_like(p)).reshape(1, -1) for g, p in zip(grads, self.params)]
            return self.single.project(torch.cat(flat, dim=1), model_id=k)[0]
        out = None
        for g, proj in zip(grads, self.blocks):  # type: ignore[arg-type]
            if g is None:
                continue
            part = proj.project(g.reshape(1, -1), model_id=k)[0]
            out = part if out is None else out.add_(part)
        if out is None:
            out = torch.zeros(self.shape, dtype=self.proj_dtype, device=self.shadow.device)
        return out

    def unproject(self, u, k):
        u = u.reshape(1, -1)
        if self.single is not None:
            full = self.single.unproject(u, model_id=k)[0]
            return [part.view_as(p) for part, p in zip(full.split([p.numel() for p in self.params]), self.params)]
        blocks = self.blocks or []
        return [proj.unproject(u, model_id=k)[0].view_as(p) for proj, p in zip(blocks, self.params)]

    def transfer(self, m, k_old, k_new):
        full = [f.to(self.proj_dtype) for f in self.unproject(m.to(self.proj_dtype), k_old)]
        new = self.project(full, k_new) * (self.shape[0] / self.grad_dim)
        return _clip_norm(new, m).to(m.dtype)
