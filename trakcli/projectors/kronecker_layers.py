"""Layers of a Kronecker-factored projection and how ``proj_dim`` is split among them.

A layer's per-example gradient is one matrix ``G`` ``[d_out, d_in]`` (weight columns, then a folded-in bias column);
:class:`KroneckerLayer` says which parameters make it up and how. :func:`split_widths` and :func:`choose_grid` decide
each layer's features for :class:`~trakcli.projectors.kronecker.KroneckerProjector` (LoGra, Choe et al. 2024, "What is
Your Data Worth to GPT?").

**Split rule** (how ``proj_dim``, the total feature width, is shared):

1. *Widths.* ``split: equal`` (the default): every layer gets an equal share of ``proj_dim`` (water-filling): a layer
   whose capacity ``d_out · d_in`` is below its share gets its capacity, and what it leaves is shared equally among
   the others; an integer remainder goes one feature each to the first layers (in layer order). ``split: size``:
   shares in proportion to the capacities, as a projection of the whole gradient (sjlt) spreads its entries, each at
   least 1 (largest remainders round up; a layer lifted to 1 is paid for by the widest). Either way
   ``Σ width = proj_dim`` exactly.
2. *Grid.* A layer of width ``w`` uses the near-square grid ``k_in = min(d_in, ⌈√w⌉)``, ``k_out = ⌈w / k_in⌉``; when
   that ``k_out`` exceeds ``d_out``, ``k_out = d_out`` and ``k_in = ⌈w / d_out⌉`` instead (both fit because
   ``w ≤ d_out · d_in``). Near-square because the relative variance of ‖P vec G‖² for a rank-one ``G`` is about
   ``2/k_out + 2/k_in``. Its features are the first ``w`` entries of the row-major grid, scaled by
   ``√(k_out·k_in / w)`` so that E‖φ‖² = ‖G‖² still holds (every row of ``P_out ⊗ P_in`` has the same expected squared
   norm). Fewer than ``max(k_out, k_in)`` grid entries are dropped; when ``w = k_out·k_in`` (e.g. ``w = 64`` → 8 × 8)
   it is the plain Kronecker product.
3. ``proj_dim`` larger than ``Σ d_out·d_in`` (more features than gradient entries), or smaller than the number of
   layers (a layer without a feature), raises :class:`~trakcli.errors.ProjectorError` naming the limit: padding with
   constant zero features would only add singular directions to the kernel and store bytes, so it is refused rather
   than done silently.

The per-layer dims and grids are part of :meth:`KroneckerProjector.spec`, so a
store refuses features made with another split.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trakcli.errors import ProjectorError

@dataclass(frozen=True)
class LayerParam:
    """One parameter of a layer and where it sits in the layer's gradient matrix ``[d_out, d_in]``.

    Attributes:
        name: the parameter's name in ``model.named_parameters()``.
        shape: its shape.
        role: ``"weight"``: the matrix's first columns are ``param.reshape(d_out, -1)`` (``nn.Linear`` ``[out, in]``,
            ``nn.Conv*d`` ``[out, in, *kernel]``); ``"weight_t"``: they are ``param.reshape(-1, d_out).T``
            (``nn.Embedding`` ``[V, dim]``, transformers ``Conv1D`` ``[in, out]``); ``"bias"``: the last column is the
            ``[d_out]`` parameter (the folded-in 1 of ``a_t``).
    """

    name: str
    shape: tuple[int, ...]
    role: str

    @property
    def numel(self) -> int:
        """Number of entries."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class KroneckerLayer:
    """A layer whose per-example gradient is one matrix ``G`` ``[d_out, d_in]``.

    Attributes:
        name: the module's name (for messages and ``trak inspect``).
        kind: ``linear``, ``conv1d``, ``conv2d``, ``embedding``, ``hf_conv1d``
            (transformers ``Conv1D``) or ``bias`` (a bias whose weight is not covered).
        d_out: rows of ``G`` (output features / channels; the embedding dim).
        params: the covered parameters, at most one weight (role ``weight`` or
            ``weight_t``) followed by at most one bias.

    Raises:
        ProjectorError: an empty or badly ordered parameter list, an unknown role, or shapes that do not fit ``d_out``.
    """

    name: str
    kind: str
    d_out: int
    params: tuple[LayerParam, ...]

    def __post_init__(self) -> None:
        roles = [p.role for p in self.params]
        if roles not in (["weight"], ["weight_t"], ["bias"], ["weight", "bias"], ["weight_t", "bias"]):
            raise ProjectorError(f"kronecker layer {self.name!r}: parameters must be one weight (role weight or "
                                 f"weight_t) and/or one bias, in that order; got roles {roles}")
        if isinstance(self.d_out, bool) or not isinstance(self.d_out, int) or self.d_out < 1:
            raise ProjectorError(f"kronecker layer {self.name!r}: d_out must be an int >= 1, got {self.d_out!r}")
        for p in self.params:
            if p.role == "bias" and tuple(p.shape) != (self.d_out,):
                raise ProjectorError(f"kronecker layer {self.name!r}: bias {p.name!r} has shape {tuple(p.shape)}, "
                                     f"expected ({self.d_out},)")
            if p.role != "bias" and (p.numel == 0 or p.numel % self.d_out):
                raise ProjectorError(f"kronecker layer {self.name!r}: weight {p.name!r} of shape {tuple(p.shape)} "
                                     f"is not a matrix with d_out={self.d_out} rows")

    @property
    def weight_cols(self) -> int:
        """Columns of ``G`` that hold the weight (``d_in`` without the bias column)."""
        return sum(p.numel // self.d_out for p in self.params if p.role != "bias")

    @property
    def has_bias(self) -> bool:
        """Whether the last column of ``G`` is a bias."""
        return self.params[-1].role == "bias"

    @property
    def d_in(self) -> int:
        """Columns of ``G``: the weight's input size plus 1 for a folded-in bias."""
        return self.weight_cols + int(self.has_bias)

    @property
    def grad_dim(self) -> int:
        """Gradient entries of the layer's parameters (``d_out · d_in``)."""
        return sum(p.numel for p in self.params)

    def to_matrix(self, grads: Mapping[str, torch.Tensor], n: int) -> torch.Tensor:
        """Per-example gradient matrices ``[n, d_out, d_in]`` from per-parameter gradients ``[n, *shape]``."""
        cols = []
        for p in self.params:
            t = grads[p.name]
            if p.role == "weight":
                cols.append(t.reshape(n, self.d_out, -1))
            elif p.role == "weight_t":
                cols.append(t.reshape(n, -1, self.d_out).transpose(1, 2))
            else:
                cols.append(t.reshape(n, self.d_out, 1))
        return cols[0] if len(cols) == 1 else torch.cat(cols, dim=2)

    def from_matrix(self, g: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-parameter tensors ``[n, *shape]`` from matrices ``[n, d_out, d_in]`` (inverse of :meth:`to_matrix`)."""
        n, out = g.shape[0], {}
        for p in self.params:
            if p.role == "bias":
                out[p.name] = g[:, :, -1].reshape(n, *p.shape)
                continue
            w = g[:, :, : self.weight_cols]
            out[p.name] = (w if p.role == "weight" else w.transpose(1, 2)).reshape(n, *p.shape)
        return out

    def describe(self) -> dict[str, Any]:
        """Plain dict of the layer (name, kind, d_out, d_in, parameter names)."""
        return {"name": self.name, "kind": self.kind, "d_out": self.d_out, "d_in": self.d_in,
                "params": [p.name for p in self.params]}


#: The rules of :func:`split_widths`.
SPLITS = ("equal", "size")


def split_widths(capacities: Sequence[int], proj_dim: int, split: str = "equal") -> list[int]:
    """Share ``proj_dim`` features among layers of ``capacities`` (``d_out · d_in`` each) by the rule ``split``
    (``equal`` or ``size``, rule 1 of the module docstring).

    Returns:
        Per-layer widths, each in ``[1, capacity]``, summing to ``proj_dim``.

    Raises:
        ProjectorError: ``proj_dim`` below the number of layers or above ``Σ capacities``; an unknown ``split``.
    """
    if split not in SPLITS:
        raise ProjectorError(f"kronecker split must be one of {', '.join(SPLITS)}, got {split!r}")
    n_layers, total = len(capacities), sum(capacities)
    if proj_dim < n_layers:
        raise ProjectorError(f"projector proj_dim={proj_dim} is smaller than the {n_layers} layers of the kronecker "
                             f"projection (each needs at least one feature); use proj_dim >= {n_layers} or select "
                             "fewer layers with grad_wrt")
    if proj_dim > total:
        raise ProjectorError(f"projector proj_dim={proj_dim} exceeds {total}, the widest kronecker projection of these "
                             f"layers (the sum of d_out*d_in, their number of gradient entries); use proj_dim <= "
                             f"{total} (or kind noop to keep every gradient entry)")
    if split == "size":
        return _proportional(capacities, proj_dim)
    widths, open_layers, budget = [0] * n_layers, list(range(n_layers)), proj_dim
    while open_layers:
        share, extra = divmod(budget, len(open_layers))
        target = {i: share + (r < extra) for r, i in enumerate(open_layers)}
        capped = [i for i in open_layers if capacities[i] <= target[i]]
        if not capped:
            for i in open_layers:
                widths[i] = target[i]
            break
        for i in capped:
            widths[i] = capacities[i]
            budget -= capacities[i]
        open_layers = [i for i in open_layers if i not in capped]
    return widths


def _proportional(capacities: Sequence[int], proj_dim: int) -> list[int]:
    """Widths ``∝ capacities`` summing to ``proj_dim``, each in ``[1, capacity]`` (needs ``n <= proj_dim <= Σ``):
    ``proj_dim · c_i / Σ c <= c_i``, so its ceiling fits too; a layer lifted to 1 takes a feature from the widest."""
    total = sum(capacities)
    exact = [proj_dim * c / total for c in capacities]
    widths = [max(1, math.floor(x)) for x in exact]
    by_fraction = sorted(range(len(widths)), key=lambda i: (-(exact[i] - math.floor(exact[i])), i))
    for i in by_fraction[:max(0, proj_dim - sum(widths))]:  # the largest remainders round up
        widths[i] += 1
    while sum(widths) > proj_dim:  # layers lifted to 1: the widest pays
        widest = max(range(len(widths)), key=lambda i: (widths[i], -i))
        widths[widest] -= 1
    return widths


def choose_grid(width: int, d_out: int, d_in: int) -> tuple[int, int]:
    """The ``(k_out, k_in)`` grid of a ``[d_out, d_in]`` layer of ``1 <= width <= d_out · d_in`` features (rule 2
    of the module docstring).

    Returns:
        ``(k_out, k_in)`` with ``k_out <= d_out``, ``k_in <= d_in`` and
        ``width <= k_out·k_in < width + max(k_out, k_in)``.
    """
    k_in = min(d_in, math.isqrt(width - 1) + 1)  # ⌈√w⌉
    k_out = -(-width // k_in)
    if k_out > d_out:
        k_out, k_in = d_out, -(-width // d_out)
    return k_out, k_in
