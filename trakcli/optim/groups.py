"""Which slots a parameter group gets (see :mod:`trakcli.optim.slots` for what a slot is)."""

from __future__ import annotations

from typing import Any

import torch

from trakcli.errors import OptimizerError
from trakcli.optim.kronecker_slot import KroneckerSlot
from trakcli.optim.slots import (
    GlobalSlot, IdentitySlot, MatrixSlot, Slot, build_projector, derive_slot_seed, global_projectors,
)
from trakcli.projectors import Projector


def build_slots(
    params: list[torch.Tensor], settings: dict[str, Any] | None, group_index: int, projector: Projector | None = None
) -> list[Slot]:
    """The slots of one parameter group: ``mode: global`` one :class:`~trakcli.optim.slots.GlobalSlot`;
    ``mode: per_matrix`` per parameter a :class:`~trakcli.optim.slots.MatrixSlot` (one-sided kinds) or a
    :class:`~trakcli.optim.kronecker_slot.KroneckerSlot` (kind ``kronecker``), or an ``IdentitySlot`` where
    projecting would not shrink it (1-D, kind ``noop``, ``rank`` at least its smaller side; kronecker: both).

    Args:
        params: the group's parameters, in order.
        settings: resolved projection settings (:func:`trakcli.optim.settings.resolve_projection`), or None.
        group_index: position of the group (part of every derived seed).
        projector: a user's projector object (mode global, ``grad_dim`` = the group's numel).

    Raises:
        OptimizerError: a projector object whose ``grad_dim`` does not fit the group.
    """
    if settings is None:
        return [IdentitySlot([p]) for p in params]
    dtype = params[0].dtype if params else torch.float32
    if settings["mode"] == "global":
        if not params:
            return []
        grad_dim = sum(p.numel() for p in params)
        if projector is not None:
            if projector.grad_dim != grad_dim:
                raise OptimizerError(f"the projector has grad_dim={projector.grad_dim} but parameter group "
                                     f"{group_index} has {grad_dim} entries; make it with grad_dim={grad_dim} or pass "
                                     "a mapping {'mode': 'global', 'proj_dim': ...}")
            return [GlobalSlot(params, single=projector)]
        single, blocks = global_projectors(settings, [p.numel() for p in params], group_index, dtype)
        return [GlobalSlot(params, single=single, blocks=blocks)]
    rank = settings["rank"]
    slots: list[Slot] = []
    for i, p in enumerate(params):
        if p.dim() < 2 or p.numel() == 0 or settings["kind"] == "noop":
            slots.append(IdentitySlot([p]))
            continue
        a = p.shape[0]
        b = p.numel() // max(a, 1)
        if settings["kind"] == "kronecker":
            if rank >= max(a, b):  # both sides kept whole: projecting would not shrink anything
                slots.append(IdentitySlot([p]))
            else:
                seed = derive_slot_seed(settings["seed"], group_index, i)
                slots.append(KroneckerSlot(p, rank, seed, torch.float64 if dtype == torch.float64 else torch.float32))
            continue
        short = min(a, b)
        if rank >= short:  # projecting would not shrink anything
            slots.append(IdentitySlot([p]))
            continue
        proj = build_projector(settings, short, rank, derive_slot_seed(settings["seed"], group_index, i), dtype)
        slots.append(MatrixSlot(p, proj))
    return slots
