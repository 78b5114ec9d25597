"""Intrinsic-dimension training by reparametrization: ``W = W0 + unproject(z)``, only ``z`` trainable.

Li et al. 2018 ("Measuring the intrinsic dimension of objective landscapes") and Aghajanyan et al. 2021
("Intrinsic dimensionality explains the effectiveness of language model fine-tuning"): every selected
parameter becomes, through :mod:`torch.nn.utils.parametrize`, its frozen initial value plus its part of
``Pᵀ z``, with ``z`` ``[proj_dim]`` (zeros at the start) and ``P`` a ``[proj_dim, grad_dim]`` JL matrix of
:mod:`trakcli.projectors`. The gradient with respect to ``z`` is ``P g``: the backward is the projector's
``project``, the exact adjoint of its ``unproject``. With a projection mapping, ``P = [P_1 | P_2 | ...]`` is
the matrix of :class:`~trakcli.optim.ProjectedOptimizer` in ``global`` mode for a group of the same parameters
(group 0, before any refresh), so SGD on ``z`` and that optimizer with SGD take the same steps.

Example::

    sub = subspace.attach(model, {"mode": "global", "proj_dim": 1000, "seed": 0})
    opt = torch.optim.SGD(sub.parameters(), lr=0.1)   # only z
    ... train ...
    torch.save(sub.merged_state_dict(), "model.pt")   # the model's own keys: "0.weight", ...
    sub.merge()                                      # plain parameters again
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from trakcli.errors import OptimizerError
from trakcli.optim.settings import ProjectionSettings, resolve_projection
from trakcli.optim.slots import global_projectors
from trakcli.projectors import Projector


class _Unproject(torch.autograd.Function):
    """``z [proj_dim] -> Pᵀ z [grad_dim]``; backward ``g -> P g`` (the adjoint pair of a projector)."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, projector: Projector, model_id: int) -> torch.Tensor:  # type: ignore[override]
        ctx.projector, ctx.model_id = projector, model_id
        return projector.unproject(z.reshape(1, -1), model_id=model_id)[0].to(z.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        gz = ctx.projector.project(grad.reshape(1, -1), model_id=ctx.model_id)[0].to(grad.dtype)
        return gz, None, None


class _Offset(nn.Module):
    """The parametrization of one parameter: ``W0 -> W0 + (its part of Pᵀ z)``."""

    def __init__(self, sub: "Subspace", index: int):
        super().__init__()
        object.__setattr__(self, "_sub", sub)  # a plain reference: z is not a parameter of the model
        self.index = index

    def forward(self, w0: torch.Tensor) -> torch.Tensor:
        return w0 + self._sub.delta(self.index).view_as(w0).to(w0.dtype)  # type: ignore[attr-defined]


class Subspace(nn.Module):
    """The trainable ``z`` of a model reparametrized as ``W = W0 + unproject(z)``; see :func:`attach`.

    Attributes:
        z: ``[proj_dim]`` parameter, zeros at the start.
        names: the reparametrized parameters (the model's own keys), in order.
        grad_dim: their total number of entries.
    """

    def __init__(
        self, model: nn.Module, projection: Mapping[str, Any] | ProjectionSettings | Projector, names: list[str]
    ):
        super().__init__()
        object.__setattr__(self, "model", model)
        params = dict(model.named_parameters())
        self.names = names
        self.numels = [params[n].numel() for n in names]
        self.grad_dim = sum(self.numels)
        dtype = params[names[0]].dtype
        self._blocks: list[Projector] | None = None
        self._single: Projector | None = None
        if isinstance(projection, Projector):
            if projection.grad_dim != self.grad_dim:
                raise OptimizerError(f"the projector has grad_dim={projection.grad_dim} but the selected parameters "
                                     f"have {self.grad_dim} entries; make it with grad_dim={self.grad_dim}")
            self._single = projection
        else:
            settings = resolve_projection(projection, where="subspace projection")
            if settings is None:
                raise OptimizerError("subspace training needs a projection, got None; pass a projector or a mapping "
                                     "such as {'mode': 'global', 'kind': 'sjlt', 'proj_dim': 1000}")
            if settings["mode"] != "global":
                raise OptimizerError("subspace training needs mode 'global' (one z for the whole model), got "
                                     f"{settings['mode']!r}; set mode: global and proj_dim")
            self._single, self._blocks = global_projectors(settings, self.numels, 0, dtype)
        proj_dim = (self._single or self._blocks[0]).proj_dim  # type: ignore[index]
        self.z = nn.Parameter(torch.zeros(proj_dim, dtype=dtype, device=params[names[0]].device))
        self._offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]

    def delta(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s part of ``Pᵀ z``, flat ``[numel_i]``, differentiable in ``z``."""
        if self._blocks is not None:
            return _Unproject.apply(self.z, self._blocks[i], 0)
        full = _Unproject.apply(self.z, self._single, 0)
        return full[self._offsets[i] : self._offsets[i] + self.numels[i]]

    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict under its own keys (``"0.weight"``, ...), with ``W0 + unproject(z)`` merged in.

        Loads into a fresh copy of the model (e.g. by ``trak featurize``) without any of this module.
        """
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for key, value in self.model.state_dict().items():  # type: ignore[attr-defined]
                if key.startswith("parametrizations.") or ".parametrizations." in key:
                    if not key.endswith(".original"):
                        continue
                    prefix, _, rest = key.partition("parametrizations.")
                    own = prefix + rest.removesuffix(".original")
                    value = getattr(*_owner(self.model, own))  # type: ignore[arg-type]
                    key = own
                out[key] = value.detach().clone()
        return out

    def merge(self) -> nn.Module:
        """Write ``W0 + unproject(z)`` into plain parameters and remove the parametrizations.

        Returns:
            The model, with its original parameter names and ``requires_grad=True``.
        """
        model: nn.Module = self.model  # type: ignore[assignment]
        for name in self.names:
            module, attr = _owner(model, name)
            parametrize.remove_parametrizations(module, attr, leave_parametrized=True)
            getattr(module, attr).requires_grad_(True)
        return model


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def attach(
    model: nn.Module, projection: Mapping[str, Any] | ProjectionSettings | Projector, params: list[str] | None = None
) -> Subspace:
    """Reparametrize ``model`` in place as ``W = W0 + unproject(z)`` and return the :class:`Subspace` holding ``z``.

    Args:
        model: any module; its selected parameters are frozen at their current values ``W0``.
        projection: a :class:`~trakcli.optim.settings.ProjectionSettings` or a mapping of
            its keys, with ``mode: global``, ``proj_dim``, ``kind``, ``seed``; or a projector
            object with ``grad_dim`` = the selected parameters' numel.
        params: fnmatch patterns of parameter names to reparametrize (default:
            every parameter that requires grad); the others are frozen too.

    Returns:
        The :class:`Subspace`; optimize ``sub.parameters()`` (only ``z``).

    Raises:
        OptimizerError: no parameter selected, a model already reparametrized, or invalid projection settings.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if any(".parametrizations." in n for n, _ in named):
        raise OptimizerError("the model is already parametrized; call merge() on its Subspace first")
    names = [n for n, _ in named if params is None or any(fnmatch.fnmatchcase(n, pat) for pat in params)]
    if not names:
        raise OptimizerError(f"no parameter matches {params!r}; parameter names are {[n for n, _ in named][:8]}...")
    sub = Subspace(model, projection, names)
    for _, p in named:
        p.requires_grad_(False)
    for i, name in enumerate(names):
        module, attr = _owner(model, name)
        parametrize.register_parametrization(module, attr, _Offset(sub, i))
        getattr(module.parametrizations, attr).original.requires_grad_(False)
    return sub
