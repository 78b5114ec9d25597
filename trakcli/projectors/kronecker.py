"""Kronecker-factored projection of layer gradients (LoGra, Choe et al. 2024, "What is Your Data Worth to GPT?").

For a layer ``y_t = W a_t (+ b)`` applied at positions ``t`` (tokens, pixels), the per-example gradient of the model
output function ``f`` is, with the bias folded in as a last column (``a_t ← [a_t, 1]``),

    G = Σ_t g_t a_tᵀ    [d_out, d_in],     g_t = ∂f/∂y_t.

With a Kronecker-structured matrix ``P = P_out ⊗ P_in`` (``P_out``
``[k_out, d_out]``, ``P_in`` ``[k_in, d_in]``, both JL matrices):

    (P_out ⊗ P_in) vec(G) = vec(P_out G P_inᵀ) = vec( Σ_t (P_out g_t)(P_in a_t)ᵀ )    [k_out · k_in]

(``vec`` row-major: grid entry ``(i, j)`` is feature ``i · k_in + j``). The right-hand side needs only the
layer's inputs and output gradients (:mod:`trakcli.gradients`), never ``G``. A model's features are the
layers' features concatenated, in layer order; the split of ``proj_dim`` among layers and factors is
:mod:`trakcli.projectors.kronecker_layers`' (part of :meth:`KroneckerProjector.spec`).

``P_out`` and ``P_in`` of layer ``l`` are :class:`~trakcli.projectors.matrices.DenseMatrix` JL matrices
(``rademacher`` ±1/√k or ``normal`` N(0, 1/k)) with the seed ``derive_seed(KRONECKER_TAG, seed, l, side)``:
a pure function of ``(seed, model_id, l, side)``. Since E[P_outᵀP_out] = I and E[P_inᵀP_in] = I
independently, E[(P_out ⊗ P_in)ᵀ(P_out ⊗ P_in)] = I, i.e. E‖P vec G‖² = ‖G‖².
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from trakcli.errors import ProjectorError
from trakcli.projectors.base import (
    Grads, Projector, accumulation_dtype, as_float_dtype, check_int, check_model_id, derive_seed, dtype_name,
    grad_items,
)
from trakcli.projectors.kronecker_layers import KroneckerLayer, LayerParam, choose_grid, split_widths
from trakcli.projectors.matrices import GENERATOR, DenseMatrix

__all__ = [
    "DISTRIBUTIONS", "IN", "KRONECKER_TAG", "OUT", "KroneckerLayer", "KroneckerProjector", "LayerParam",
    "factor_pair", "kronecker_factor",
]

#: Distributions of the factor entries.
DISTRIBUTIONS = ("rademacher", "normal")
#: Mixed into every factor seed so kronecker factors never share a stream with other matrices.
KRONECKER_TAG = 0x4B524F4E
#: ``side`` of :func:`kronecker_factor`.
OUT, IN = 0, 1


def kronecker_factor(rows: int, cols: int, *, seed: int, model_id: int, layer: int, side: int,
                     distribution: str = "rademacher", dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """One factor matrix ``[rows = k, cols = d]``, a pure function of ``(seed, model_id, layer, side)`` and its shape.

    Args:
        seed, model_id, layer: base seed (an int >= 0), checkpoint (or draw) index, the layer's index.
        side: :data:`OUT` (0) for ``P_out``, :data:`IN` (1) for ``P_in``.
        distribution: ``rademacher`` (±1/√rows) or ``normal`` (N(0, 1/rows)).
        dtype, device: float32 or float64; where to generate it.

    Returns:
        ``[rows, cols]`` in ``dtype`` on ``device`` with E[PᵀP] = I: the transpose of
        the ``[cols, rows]`` matrix that :class:`~trakcli.projectors.matrices.DenseMatrix`
        of that kind generates with seed ``derive_seed(KRONECKER_TAG, seed, layer, side)``.

    Raises:
        ProjectorError: an unknown ``distribution``.
    """
    if distribution not in DISTRIBUTIONS:
        raise ProjectorError(f"kronecker distribution must be one of {', '.join(DISTRIBUTIONS)}, got {distribution!r}")
    matrix = DenseMatrix(distribution, cols, rows, derive_seed(KRONECKER_TAG, seed, layer, side), dtype)
    return matrix.full(model_id, torch.device(device)).T


class KroneckerProjector(Projector):
    """Projects per-layer gradients with ``P = blockdiag_l(c_l · S_l (P_out,l ⊗ P_in,l))`` (LoGra, Choe et al. 2024).

    ``S_l`` keeps the first ``width_l`` rows of the ``k_out·k_in`` grid and ``c_l = √(k_out·k_in / width_l)`` (1 when
    nothing is dropped); see the module docstring for the split rule and the matrices.

    Gradient layout: ``grad_dim`` is the covered parameters' entries; ``param_names`` gives their order for a flat
    ``[n, grad_dim]`` tensor (layer by layer, weight before bias, each flattened in its own shape). :meth:`project`
    also takes a dict ``{param name: [n, *shape]}`` (any order, exactly the covered names); :meth:`unproject` returns
    the flat layout (the base-class contract, used by the projected optimizer) and :meth:`unproject_params` the dict.

    Args:
        layers: the layers, e.g. from :class:`trakcli.gradients.KroneckerFeaturizer`.
        proj_dim: total feature width (all layers together), an int >= number of layers.
        seed: base seed, an int >= 0.
        dtype: accumulation dtype, ``float32`` (default) or ``float64`` (a torch dtype or its name).
        distribution: factor entries, ``rademacher`` (default) or ``normal``.
        split: how ``proj_dim`` is shared among the layers, ``equal`` (default) or ``size``
            (:func:`~trakcli.projectors.kronecker_layers.split_widths`).

    Attributes:
        widths, grids: per layer, the width and ``(k_out, k_in)``.
        offsets: per layer, its first feature column.

    Raises:
        ProjectorError: no layers, a parameter in two layers, bad ``proj_dim``,
            ``seed``, ``dtype``, ``distribution`` or ``split``.
    """

    implementation = "kronecker"

    def __init__(self, layers: Sequence[KroneckerLayer], proj_dim: int, seed: int = 0,
                 dtype: torch.dtype | str = torch.float32, distribution: str = "rademacher", split: str = "equal"):
        layers = list(layers)
        if not layers or not all(isinstance(layer, KroneckerLayer) for layer in layers):
            raise ProjectorError("a kronecker projector needs a non-empty list of KroneckerLayer")
        names = [p.name for layer in layers for p in layer.params]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ProjectorError(f"kronecker layers share parameters {dup}; each parameter belongs to one layer")
        proj_dim = check_int("proj_dim", proj_dim, 1, "e.g. proj_dim: 2048")
        self.seed = check_int("seed", seed, 0, "use a non-negative integer such as 0")
        dtype = accumulation_dtype(dtype)
        if distribution not in DISTRIBUTIONS:
            raise ProjectorError(f"kronecker distribution must be one of {', '.join(DISTRIBUTIONS)}, "
                                 f"got {distribution!r}")
        self.distribution, self.layers, self.param_names = distribution, layers, names
        self.widths = split_widths([layer.d_out * layer.d_in for layer in layers], proj_dim, split)
        self.grids = [choose_grid(w, layer.d_out, layer.d_in) for w, layer in zip(self.widths, layers)]
        self.offsets = [sum(self.widths[:i]) for i in range(len(layers))]
        self._index = {layer.name: i for i, layer in enumerate(layers)}
        self._factors: tuple[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        super().__init__(sum(layer.grad_dim for layer in layers), proj_dim, dtype)

    def spec(self) -> dict[str, Any]:
        """Everything that fixes the matrix, as a plain JSON-able dict (kind ``kronecker``): with per layer its
        ``name``, ``kind``, ``d_out``, ``d_in``, ``k_out``, ``k_in``, ``width`` and ``params``."""
        return {
            "kind": "kronecker", "grad_dim": self.grad_dim, "proj_dim": self.proj_dim, "seed": self.seed,
            "dtype": dtype_name(self.dtype), "distribution": self.distribution, "generator": GENERATOR,
            "layers": [{**layer.describe(), "k_out": k_out, "k_in": k_in, "width": w}
                       for layer, (k_out, k_in), w in zip(self.layers, self.grids, self.widths)],
        }

    def layer_index(self, layer: int | str) -> int:
        """Index of a layer given by index or module name; :class:`ProjectorError` if there is none."""
        if isinstance(layer, str) and layer in self._index:
            return self._index[layer]
        if isinstance(layer, int) and not isinstance(layer, bool) and 0 <= layer < len(self.layers):
            return layer
        raise ProjectorError(f"no kronecker layer {layer!r}; the layers are 0..{len(self.layers) - 1}: "
                             f"{', '.join(la.name for la in self.layers[:8])}{' ...' if len(self.layers) > 8 else ''}")

    def transposed_factors(self, model_id: int, device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """All layers' ``(P_outᵀ [d_out, k_out], P_inᵀ [d_in, k_in])`` in the accumulation dtype (the last
        ``(model_id, device)``'s are kept)."""
        model_id = check_model_id(model_id)
        key = (model_id, str(torch.device(device)))
        if self._factors is not None and self._factors[0] == key:
            return self._factors[1]
        self._factors = None
        out = []
        for i, (layer, (k_out, k_in)) in enumerate(zip(self.layers, self.grids)):
            p_out, p_in = factor_pair(layer.d_out, layer.d_in, k_out, k_in, seed=self.seed, model_id=model_id,
                                      layer=i, distribution=self.distribution, dtype=self.dtype, device=device)
            out.append((p_out.T.contiguous(), p_in.T.contiguous()))
        self._factors = (key, out)
        return out

    def factors(self, layer: int | str, model_id: int = 0, device: torch.device | str = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(P_out [k_out, d_out], P_in [k_in, d_in])`` of one layer (those of :meth:`project`)."""
        p_out_t, p_in_t = self.transposed_factors(model_id, device)[self.layer_index(layer)]
        return p_out_t.T, p_in_t.T

    def scale(self, layer: int) -> float:
        """``√(k_out·k_in / width)`` of a layer: 1 unless grid entries are dropped."""
        k_out, k_in = self.grids[layer]
        return math.sqrt(k_out * k_in / self.widths[layer])

    def features_from_grids(self, grids: Sequence[torch.Tensor]) -> torch.Tensor:
        """Concatenate per-layer grids ``[n, k_out, k_in]`` into features ``[n, proj_dim]``.

        Each grid ``Σ_t (P_out g_t)(P_in a_t)ᵀ`` is flattened row-major, cut to the
        layer's width and scaled by :meth:`scale`.
        """
        parts = []
        for i, g in enumerate(grids):
            part = g.reshape(g.shape[0], -1)[:, : self.widths[i]].to(self.dtype)
            s = self.scale(i)
            parts.append(part * s if s != 1.0 else part)
        return torch.cat(parts, dim=1)

    def grids_from_features(self, z: torch.Tensor) -> list[torch.Tensor]:
        """The adjoint of :meth:`features_from_grids`: ``[n, proj_dim]`` -> per-layer ``[n, k_out, k_in]``."""
        out = []
        for i, (k_out, k_in) in enumerate(self.grids):
            part = z[:, self.offsets[i] : self.offsets[i] + self.widths[i]].to(self.dtype) * self.scale(i)
            full = torch.zeros(z.shape[0], k_out * k_in, dtype=self.dtype, device=z.device)
            full[:, : self.widths[i]] = part
            out.append(full.view(-1, k_out, k_in))
        return out

    def project_factors(self, layer: int | str, g: torch.Tensor, a: torch.Tensor, model_id: int = 0) -> torch.Tensor:
        """Features of one layer from its factors: ``vec(Σ_t (P_out g_t)(P_in a_t)ᵀ)``, never forming ``G``.

        Args:
            layer: index or module name.
            g: ``[n, T, d_out]`` output gradients (``[n, d_out]`` for T = 1), any float dtype.
            a: ``[n, T, d_in]`` inputs, bias column (ones) included when the layer has a bias.
            model_id: checkpoint index.

        Returns:
            ``[n, width]`` in the accumulation dtype: the layer's slice of :meth:`project`.

        Raises:
            ProjectorError: shapes that do not fit the layer.
        """
        i = self.layer_index(layer)
        lay = self.layers[i]
        g, a = (t.unsqueeze(1) if t.dim() == 2 else t for t in (g, a))
        shapes_ok = g.dim() == 3 and a.dim() == 3 and g.shape[:2] == a.shape[:2]
        if not shapes_ok or g.shape[2] != lay.d_out or a.shape[2] != lay.d_in:
            raise ProjectorError(f"project_factors of layer {lay.name!r} expects g [n, T, {lay.d_out}] and "
                                 f"a [n, T, {lay.d_in}], got {tuple(g.shape)} and {tuple(a.shape)}")
        as_float_dtype(g, "g")
        as_float_dtype(a, "a")
        p_out_t, p_in_t = self.transposed_factors(model_id, g.device)[i]
        grid = torch.bmm((g.to(self.dtype) @ p_out_t).transpose(1, 2), a.to(self.dtype) @ p_in_t)
        return grid.reshape(grid.shape[0], -1)[:, : self.widths[i]] * self.scale(i)

    def _split(self, grads: Grads) -> tuple[int, dict[str, torch.Tensor]]:
        """``(n, {name: [n, numel]})`` of a flat ``[n, grad_dim]`` tensor (``param_names`` order) or a dict."""
        params = [p for layer in self.layers for p in layer.params]
        if isinstance(grads, Mapping):
            missing = [n for n in self.param_names if n not in grads]
            extra = [n for n in grads if n not in set(self.param_names)]
            if missing or extra:
                raise ProjectorError(f"the gradient dict must hold exactly the kronecker layers' parameters: "
                                     f"missing {missing}, not covered {extra}")
            grads = {name: grads[name] for name in self.param_names}
            for p in params:  # each parameter's size first: the message names the parameter
                t = grads[p.name]
                if isinstance(t, torch.Tensor) and t.ndim >= 1 and t.shape[1:].numel() != p.numel:
                    raise ProjectorError(f"gradient of parameter {p.name!r} has shape {tuple(t.shape)}, "
                                         f"expected [{t.shape[0]}, *{p.shape}]")
        n, items = grad_items(grads, self.grad_dim)
        if isinstance(grads, torch.Tensor):
            return n, dict(zip(self.param_names, grads.split([p.numel for p in params], dim=1)))
        return n, dict(items)

    def _project(self, grads: Grads, model_id: int) -> torch.Tensor:
        n, items = self._split(grads)
        device = items[self.param_names[0]].device
        grids = []
        for layer, (p_out_t, p_in_t) in zip(self.layers, self.transposed_factors(model_id, device)):
            g = layer.to_matrix(items, n).to(self.dtype)  # [n, d_out, d_in]
            grids.append(p_out_t.T @ (g @ p_in_t))  # [n, k_out, k_in] = P_out G P_inᵀ
        return self.features_from_grids(grids)

    def unproject_params(self, z: torch.Tensor, model_id: int = 0) -> dict[str, torch.Tensor]:
        """The adjoint ``Pᵀ z`` as per-parameter tensors ``{name: [n, *shape]}`` (accumulation dtype).

        Raises:
            ProjectorError: ``z`` is not ``[n, proj_dim]`` or has an unsupported dtype.
        """
        model_id = check_model_id(model_id)
        self.check_features(z)
        out: dict[str, torch.Tensor] = {}
        factors = self.transposed_factors(model_id, z.device)
        for layer, grid, (p_out_t, p_in_t) in zip(self.layers, self.grids_from_features(z), factors):
            out.update(layer.from_matrix(p_out_t @ grid @ p_in_t.T))  # [n, d_out, d_in] = P_outᵀ Z P_in
        return out

    def _unproject(self, z: torch.Tensor, model_id: int) -> torch.Tensor:
        params = self.unproject_params(z, model_id)
        return torch.cat([params[n].reshape(z.shape[0], -1) for n in self.param_names], dim=1)


def factor_pair(d_out: int, d_in: int, k_out: int, k_in: int, *, seed: int, model_id: int, layer: int,
                distribution: str = "rademacher", dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(P_out [k_out, d_out], P_in [k_in, d_in])`` for a two-sided projection ``P_out G P_inᵀ``.

    The same matrices as a :class:`KroneckerProjector` whose layer ``layer`` has these dims and grid; for a projected
    optimizer (per-matrix mode) that draws ``model_id = k`` after ``k`` refreshes.

    Raises:
        ProjectorError: a ``k`` outside ``[1, d]``.
    """
    for name, k, d in (("k_out", k_out, d_out), ("k_in", k_in, d_in)):
        check_int(name, k, 1, f"use 1 <= {name} <= {d}")
        if k > d:
            raise ProjectorError(f"kronecker {name}={k} exceeds the layer's size {d}; use {name} <= {d}")
    common = dict(seed=seed, model_id=model_id, layer=layer, distribution=distribution, dtype=dtype, device=device)
    return kronecker_factor(k_out, d_out, side=OUT, **common), kronecker_factor(k_in, d_in, side=IN, **common)
