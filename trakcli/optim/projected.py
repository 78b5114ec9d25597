"""``ProjectedOptimizer``: any torch optimizer, run in a random subspace of the gradient.

At every step the gradient of each slot (see :mod:`trakcli.optim.slots`) is projected, ``R = project(G)``; the inner
optimizer steps a shadow parameter of the projected shape with ``R`` as its gradient, so its state (momenta, second
moments) has the projected size; the inner update ``ΔZ`` comes back through the adjoint,
``W ← W + scale · unproject(ΔZ)``. This is GaLore's step (Zhao et al. 2024, Alg. 2) with random JL projections of
:mod:`trakcli.projectors` in place of SVD factors (Flora, Hao et al. 2024), or in ``global`` mode intrinsic-dimension
training (Li et al. 2018). Kind ``kronecker`` (per_matrix) projects each matrix from both sides, ``R = P_out G P_inᵀ``
(:mod:`trakcli.optim.kronecker_slot`).

Weight decay is applied in the full space, decoupled (``W ← W (1 - lr·wd)``, Loshchilov & Hutter 2019) or as L2 added to
the full gradient before the projection (``weight_decay_mode="l2"``); the inner optimizer always gets
``weight_decay=0``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Callable

import torch

from trakcli.errors import OptimizerError
from trakcli.optim.settings import ProjectionSettings, resolve_projection
from trakcli.optim.groups import build_slots
from trakcli.optim.slots import LINEAR_STATE_KEYS, Slot, _ProjectedSlot
from trakcli.optim.transforms import Transform, apply_transform
from trakcli.projectors import Projector

_OWN_KEYS = ("params", "projection", "weight_decay", "weight_decay_mode", "param_ndim")


def _external_settings(projector: Projector) -> dict[str, Any]:
    """The plain settings recorded for a user's projector object (global mode, one fixed matrix)."""
    spec = projector.spec()
    return {"mode": "global", "kind": spec.get("kind", "custom"), "implementation": "auto", "rank": None,
            "proj_dim": projector.proj_dim, "seed": int(spec.get("seed", 0)), "update_gap": 0,
            "on_refresh": "keep", "scale": 1.0, "external": True}


class ProjectedOptimizer(torch.optim.Optimizer):
    """Compose an inner ``torch.optim`` optimizer with random projections of the gradient.

    Example::

        opt = ProjectedOptimizer(model.parameters(), inner=torch.optim.AdamW,
                                 projection={"mode": "per_matrix", "rank": 8, "update_gap": 200},
                                 lr=1e-3, weight_decay=0.01)
        loss.backward(); opt.step(); opt.zero_grad()

    Args:
        params: parameters or param-group dicts (torch.optim convention). A group may set its own ``projection`` (a
            mapping whose keys override the default projection's, a :class:`ProjectionSettings`, a projector object, or
            ``None`` for no projection), ``weight_decay``, ``weight_decay_mode``, ``param_ndim`` and any hyperparameter
            of the inner optimizer.
        inner: the inner optimizer class (or a callable ``inner(param_groups,
            **inner_kwargs)`` returning a ``torch.optim.Optimizer``).
        projection: a :class:`~trakcli.optim.settings.ProjectionSettings` or a mapping of its keys (the YAML's
            ``optimize.projection``: ``mode`` per_matrix or global, ``kind`` (``kronecker``: per_matrix, two-sided),
            ``rank`` / ``proj_dim``, ``seed``, ``update_gap``, ``on_refresh`` keep/reset/transfer, ``scale``), or a
            projector object (mode global, fixed, ``grad_dim`` = the group's numel). ``None``: per_matrix, rank 8,
            rademacher.
        weight_decay: decay in the full space; ``None``: the inner optimizer's default (AdamW: 0.01, SGD/Adam: 0).
        weight_decay_mode: ``decoupled`` (``W ← W(1 - lr·wd)``, AdamW's) or
            ``l2`` (``G ← G + wd·W`` before projecting, SGD's/Adam's).
        param_ndim: how ``grad_transform`` / ``param_transform`` broadcast
            (rai_toolbox's meaning, see :mod:`trakcli.optim.transforms`).
        grad_transform: applied to each full-space gradient before the
            projection (e.g. :func:`~trakcli.optim.transforms.sign_`).
        param_transform: applied to each parameter after the update (e.g.
            :func:`~trakcli.optim.transforms.clamp_`, ``max_norm_``).
        **inner_kwargs: hyperparameters of the inner optimizer (``lr``, ``betas``, ``momentum`` ...).

    Raises:
        OptimizerError: invalid projection settings, an inner optimizer that
            rejects the keyword arguments, or a projector that does not fit.
    """

    def __init__(
        self,
        params: Iterable[Any],
        inner: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
        projection: Mapping[str, Any] | ProjectionSettings | Projector | None = None,
        *,
        weight_decay: float | None = None,
        weight_decay_mode: str = "decoupled",
        param_ndim: int | None = -1,
        grad_transform: Transform | None = None,
        param_transform: Transform | None = None,
        **inner_kwargs: Any,
    ):
        try:
            probe = inner([torch.zeros(1, requires_grad=True)], **inner_kwargs)
        except (TypeError, ValueError) as e:
            name = getattr(inner, "__name__", repr(inner))
            raise OptimizerError(f"the inner optimizer {name} rejects the arguments {sorted(inner_kwargs)}: {e}; "
                                 "pass only its own hyperparameters (lr, momentum, betas, ...)") from None
        if not isinstance(probe, torch.optim.Optimizer):
            raise OptimizerError(f"inner must build a torch.optim.Optimizer, got {type(probe).__name__}")
        self._inner_keys = set(probe.defaults)
        self._default_projector: Projector | None = None
        if isinstance(projection, Projector):
            self._default_projector = projection
            settings = _external_settings(projection)
        else:
            settings = resolve_projection({} if projection is None else projection)
        if weight_decay is None:
            weight_decay = float(probe.defaults.get("weight_decay", 0.0))
        defaults = dict(probe.defaults)
        defaults.update(projection=settings, weight_decay=weight_decay, weight_decay_mode=weight_decay_mode,
                        param_ndim=param_ndim)
        self.grad_transform = grad_transform
        self.param_transform = param_transform
        self._slots: list[list[Slot]] = []
        self._projected: list[bool] = []  # per group: has a projected slot (and so a step counter)
        self._pending_inner_groups: list[dict[str, Any]] = []
        self.inner: torch.optim.Optimizer | None = None
        super().__init__(params, defaults)
        self.inner = inner(self._pending_inner_groups, **inner_kwargs)
        self._pending_inner_groups = []

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (torch.optim convention); it gets its own slots and inner group."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        gi = len(self.param_groups) - 1
        proj = group["projection"]
        obj = None
        default = self.defaults["projection"]
        if isinstance(proj, Projector):
            obj, group["projection"] = proj, _external_settings(proj)
        elif proj is default:
            obj = self._default_projector
        elif proj is not None:
            # a group's mapping overrides the keys it names; the others come from the default projection
            base = {} if default.get("external") else dict(default)
            own = proj.model_dump() if isinstance(proj, ProjectionSettings) else proj  # a settings object sets all keys
            group["projection"] = resolve_projection({**base, **own}, where=f"param_groups[{gi}].projection")
        if group["weight_decay_mode"] not in ("decoupled", "l2"):
            raise OptimizerError(f"weight_decay_mode must be 'decoupled' or 'l2', got {group['weight_decay_mode']!r}")
        if float(group["weight_decay"]) < 0:
            raise OptimizerError(f"weight_decay must be >= 0, got {group['weight_decay']!r}")
        slots = build_slots(list(group["params"]), group["projection"], gi, obj)
        self._slots.append(slots)
        self._projected.append(any(s.projected for s in slots))
        inner_group = {"params": [s.inner_param for s in slots], **self._inner_hyper(group)}
        if self.inner is None:
            self._pending_inner_groups.append(inner_group)
        else:
            self.inner.add_param_group(inner_group)
        if self._projected[gi]:
            st = self.state[self._anchor(gi)]
            st.setdefault("step", 0)
            st.setdefault("proj_index", 0)

    def _inner_hyper(self, group: dict[str, Any]) -> dict[str, Any]:
        hyper = {k: v for k, v in group.items() if k in self._inner_keys and k not in _OWN_KEYS}
        if "weight_decay" in self._inner_keys:
            hyper["weight_decay"] = 0.0
        return hyper

    def _anchor(self, gi: int) -> torch.Tensor:
        return self.param_groups[gi]["params"][0]

    def _group_state(self, gi: int) -> dict[str, Any] | None:
        if not self._projected[gi]:
            return None
        return self.state[self._anchor(gi)]

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimization step (``closure`` re-evaluates the loss, torch.optim convention).

        Per group: refresh the projection if ``update_gap`` says so, decay the parameters (decoupled mode, one
        ``_foreach_mul_``), project each slot's gradient onto its shadow; then one step of the inner optimizer over
        every group, and each shadow's update mapped back into its parameters.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inner = self.inner
        assert inner is not None
        active: list[tuple[_ProjectedSlot, int, float]] = []
        swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
        for gi, group in enumerate(self.param_groups):
            inner.param_groups[gi].update(self._inner_hyper(group))
            settings = group["projection"]
            k = 0
            st = self._group_state(gi)
            if st is not None:
                gap = settings["update_gap"] or 0
                if gap and st["step"] > 0 and st["step"] % gap == 0:
                    self._refresh_group(gi)
                st["step"] += 1
                k = st["proj_index"]
            wd, mode = float(group["weight_decay"]), group["weight_decay_mode"]
            if wd and mode == "decoupled":
                decay = [p for p in group["params"] if p.grad is not None]
                if decay:
                    torch._foreach_mul_(decay, 1.0 - group.get("lr", 0.0) * wd)
            plain = self.grad_transform is None and not (wd and mode == "l2")
            scale = float(settings.get("scale", 1.0)) if settings is not None else 1.0
            for slot in self._slots[gi]:
                if isinstance(slot, _ProjectedSlot):
                    grads = [self._full_grad(p, group) for p in slot.params]
                    if all(g is None for g in grads):
                        continue
                    slot.set_grad(grads, k)
                    active.append((slot, k, scale))
                elif not plain:
                    p = slot.params[0]
                    g = self._full_grad(p, group)
                    if g is not None and g is not p.grad:
                        swapped.append((p, p.grad))
                        p.grad = g
        inner.step()
        for p, g in swapped:
            p.grad = g
        for slot, k, scale in active:
            slot.apply_update(k, scale)
        if self.param_transform is not None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        apply_transform(self.param_transform, p, group["param_ndim"])
        return loss

    def _full_grad(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor | None:
        """The full-space gradient after the grad transform and L2 decay (a copy if either applies); dense only."""
        g = p.grad
        if g is None:
            return None
        if g.is_sparse:
            raise OptimizerError("ProjectedOptimizer does not support sparse gradients; use dense embeddings")
        wd = float(group["weight_decay"])
        if self.grad_transform is None and not (wd and group["weight_decay_mode"] == "l2"):
            return g
        g = g.clone()
        if self.grad_transform is not None:
            apply_transform(self.grad_transform, g, group["param_ndim"])
        if wd and group["weight_decay_mode"] == "l2":
            g.add_(p, alpha=wd)
        return g

    # ------------------------------------------------------------------ refresh

    def refresh(self, group_index: int | None = None) -> None:
        """Draw the next projection now (of one group, or all), handling the inner state per ``on_refresh``.

        ``keep``: the inner state stays as it is (GaLore's choice). ``reset``: the inner state of the projected slots is
        dropped (it restarts, step counts included). ``transfer``: first moments (``exp_avg``, ``momentum_buffer``, ...)
        are mapped into the new subspace by :meth:`~trakcli.optim.slots._ProjectedSlot.transfer`, which never grows
        their norm; second moments and counters are kept.
        """
        groups = range(len(self.param_groups)) if group_index is None else [group_index]
        for gi in groups:
            if self._group_state(gi) is not None:
                self._refresh_group(gi)

    @torch.no_grad()
    def _refresh_group(self, gi: int) -> None:
        assert self.inner is not None
        st = self.state[self._anchor(gi)]
        k_old, k_new = st["proj_index"], st["proj_index"] + 1
        policy = self.param_groups[gi]["projection"]["on_refresh"]
        for slot in self._slots[gi]:
            if not isinstance(slot, _ProjectedSlot):
                continue
            if policy == "reset":
                self.inner.state.pop(slot.shadow, None)
            elif policy == "transfer":
                inner_st = self.inner.state.get(slot.shadow, {})
                for key in LINEAR_STATE_KEYS:
                    val = inner_st.get(key)
                    if isinstance(val, torch.Tensor) and tuple(val.shape) == slot.shape:
                        inner_st[key] = slot.transfer(val, k_old, k_new)
        st["proj_index"] = k_new

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's ``{"state", "param_groups"}`` plus ``"inner"`` (the inner optimizer's state dict).

        Only tensors, numbers, strings, lists and dicts: it loads with ``torch.load(weights_only=True)``. Projections
        are stored as their settings, seeds and the index ``proj_index`` of the current draw.
        """
        assert self.inner is not None
        sd = super().state_dict()
        sd["inner"] = self.inner.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (the same parameters and projection settings).

        Raises:
            OptimizerError: the state dict has no ``inner`` entry, or was saved
                with other projection settings (another matrix would be used).
        """
        assert self.inner is not None
        if "inner" not in state_dict:
            raise OptimizerError("this state dict has no 'inner' entry: it was not saved by "
                                 "ProjectedOptimizer.state_dict()")
        saved_groups = state_dict.get("param_groups", [])
        for gi, (mine, saved) in enumerate(zip(self.param_groups, saved_groups)):
            a = {k: v for k, v in (mine["projection"] or {}).items() if k not in ("on_refresh", "scale")}
            b = {k: v for k, v in (saved.get("projection") or {}).items() if k not in ("on_refresh", "scale")}
            if a != b:
                diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                raise OptimizerError(f"param group {gi}: the state was saved with other projection settings "
                                     f"({', '.join(f'{k}: saved {b.get(k)!r}, now {a.get(k)!r}' for k in diff)}); "
                                     "resume with the settings of the saved run")
        outer = {k: v for k, v in state_dict.items() if k != "inner"}
        super().load_state_dict(outer)
        self.inner.load_state_dict(state_dict["inner"])

    # ------------------------------------------------------------------ info

    def state_numel(self) -> int:
        """Floats held as optimizer state: every tensor in the inner state (step counters excluded).

        Shadow parameters hold no storage between steps and are not counted.
        """
        assert self.inner is not None
        states = self.inner.state.values()
        return sum(v.numel() for st in states for k, v in st.items() if isinstance(v, torch.Tensor) and k != "step")

    def describe(self) -> list[dict[str, Any]]:
        """One row per slot: which parameters, projected or not, and the shape the inner optimizer sees."""
        return [{"group": gi, "kind": type(slot).__name__, "param_shapes": [tuple(p.shape) for p in slot.params],
                 "inner_shape": tuple(slot.shape)} for gi, slots in enumerate(self._slots) for slot in slots]
