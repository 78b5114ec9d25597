"""The two-sided per-matrix projection of the optimizer (``kind: kronecker``): ``R = P_out G P_inᵀ``.

A parameter ``W`` is viewed as the matrix ``[d_out, d_in] = [shape[0], numel / shape[0]]`` like every
``per_matrix`` kind; its gradient ``G`` is projected from both sides to ``[k_out, k_in]``,
``k_out = min(rank, d_out)``, ``k_in = min(rank, d_in)``, so each inner state tensor has ``k_out · k_in``
entries, and the update ``U`` comes back through the exact adjoint, ``W ← W + scale · P_outᵀ U P_in``.
Row-major, ``vec(R) = (P_out ⊗ P_in) vec(G)``: the Kronecker-structured projection of LoGra (Choe et al. 2024,
"What is Your Data Worth to GPT?") for the optimizer's state.

The factors are :func:`trakcli.projectors.kronecker.factor_pair`'s (Philox, rademacher ±1/√k) with the seed
``derive_slot_seed(seed, group, index)``, ``layer = 0`` and ``model_id`` = the number of refreshes. A side with
``k = d`` is not projected (its factor is the identity: a square ±1/√d matrix would compress nothing and only
distort the step). Each factor has ``E[PᵀP] = I``, hence ``E[(P_out ⊗ P_in)ᵀ(P_out ⊗ P_in)] = I``: the SGD update
is an unbiased estimate of ``-lr · G``, as for the one-sided kinds.
"""

from __future__ import annotations

import torch

from trakcli.optim.slots import _clip_norm, _ProjectedSlot
from trakcli.projectors.kronecker import IN, OUT, kronecker_factor

#: The distribution of the optimizer's kronecker factors.
DISTRIBUTION = "rademacher"

Factor = torch.Tensor | None  # None: the identity (a side that is not projected)


def _t(x: Factor) -> Factor:
    return None if x is None else x.T


def sandwich(left: Factor, m: torch.Tensor, right: Factor) -> torch.Tensor:
    """``left @ m @ right`` (``[a, b] @ [b, c] @ [c, e]``), ``None`` an identity factor, in the cheaper order."""
    if left is None:
        return m if right is None else m @ right
    if right is None:
        return left @ m
    (a, b), (c, e) = left.shape, right.shape
    if a * b * c + a * c * e <= b * c * e + a * b * e:
        return (left @ m) @ right
    return left @ (m @ right)


class KroneckerSlot(_ProjectedSlot):
    """One parameter of >= 2 dims projected from both sides to ``[k_out, k_in]`` (see the module doc).

    Args:
        param: the parameter, viewed as ``[d_out, d_in] = [shape[0], numel / shape[0]]``.
        rank: ``k`` of each side, capped at the side's size.
        seed: the slot's seed (``derive_slot_seed(seed, group, index)``).
        dtype: float32 or float64: the factors', the projection's and the shadow's.
    """

    def __init__(self, param: torch.Tensor, rank: int, seed: int, dtype: torch.dtype):
        self.d_out = param.shape[0]
        self.d_in = param.numel() // self.d_out
        self.k_out, self.k_in = min(rank, self.d_out), min(rank, self.d_in)
        self.seed = seed
        self.proj_dtype = dtype
        self._draws: dict[int, tuple[Factor, Factor]] = {}
        super().__init__([param], (self.k_out, self.k_in), dtype)

    def factors(self, k: int) -> tuple[Factor, Factor]:
        """``(P_out [k_out, d_out], P_in [k_in, d_in])`` of draw ``k`` (those of
        :func:`~trakcli.projectors.kronecker.factor_pair`), ``None`` for an unprojected side; the two latest
        draws are kept (a refresh's transfer reads both)."""
        if k in self._draws:
            return self._draws[k]
        pair = tuple(None if kk == d else kronecker_factor(kk, d, seed=self.seed, model_id=k, layer=0, side=side,
                                                           distribution=DISTRIBUTION, dtype=self.proj_dtype,
                                                           device=self.shadow.device)
                     for side, kk, d in ((OUT, self.k_out, self.d_out), (IN, self.k_in, self.d_in)))
        for old in sorted(self._draws)[:-1]:
            del self._draws[old]
        self._draws[k] = pair  # type: ignore[assignment]
        return pair  # type: ignore[return-value]

    def _matrix(self, t: torch.Tensor) -> torch.Tensor:  # [*shape] -> [d_out, d_in] in the projection dtype
        m = t.reshape(self.d_out, self.d_in)
        return m if m.dtype == self.proj_dtype else m.to(self.proj_dtype)

    def project(self, grads, k):
        """``R = P_out G P_inᵀ`` ``[k_out, k_in]``."""
        (g,) = grads
        p_out, p_in = self.factors(k)
        return sandwich(p_out, self._matrix(g), _t(p_in)).contiguous()

    def unproject(self, u, k):
        """``P_outᵀ U P_in``, shaped as the parameter."""
        p_out, p_in = self.factors(k)
        u = u if u.dtype == self.proj_dtype else u.to(self.proj_dtype)
        return [sandwich(_t(p_out), u, p_in).reshape(self.params[0].shape)]

    def apply_update(self, k, alpha):
        """``W += alpha · P_outᵀ U P_in`` ending in one in-place addmm on the parameter's ``[d_out, d_in]`` view."""
        param = self.params[0]
        if param.grad is None or param.dtype != self.proj_dtype or not param.is_contiguous():
            super().apply_update(k, alpha)
            return
        p_out, p_in = self.factors(k)
        u = self.take_update()
        target = param.view(self.d_out, self.d_in)
        if p_out is None:
            target.addmm_(u, p_in, alpha=alpha)  # type: ignore[arg-type]
        elif p_in is None:
            target.addmm_(p_out.T, u, alpha=alpha)
        else:  # multiply-adds of P_outᵀ (U P_in) and of (P_outᵀ U) P_in
            (k_o, k_i), (d_o, d_i) = (self.k_out, self.k_in), (self.d_out, self.d_in)
            if k_o * k_i * d_i + d_o * k_o * d_i <= d_o * k_o * k_i + d_o * k_i * d_i:
                target.addmm_(p_out.T, u @ p_in, alpha=alpha)
            else:
                target.addmm_(p_out.T @ u, p_in, alpha=alpha)

    def transfer(self, m, k_old, k_new):
        """``m' = c · (P_out,new P_out,oldᵀ) m (P_in,old P_in,newᵀ)``, ``c = (k_out/d_out)(k_in/d_in)``, clipped.

        The full-space ``P_out,oldᵀ m P_in,old`` seen in the new subspace with the least-squares factor of each side
        (``P Pᵀ ≈ (d/k) I``), computed through the ``[k, k]`` products of the factors, then scaled down if needed so
        that ``‖m'‖ <= ‖m‖``. An unprojected side contributes ``I`` and factor 1.
        """
        (o_out, o_in), (n_out, n_in) = self.factors(k_old), self.factors(k_new)
        left = None if n_out is None else n_out @ o_out.T  # type: ignore[union-attr]
        right = None if n_in is None else o_in @ n_in.T  # type: ignore[union-attr]
        c = (self.k_out / self.d_out) * (self.k_in / self.d_in)
        new = sandwich(left, m.to(self.proj_dtype), right) * c
        return _clip_norm(new, m).to(m.dtype)
