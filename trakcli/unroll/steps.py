"""One optimizer step as a pure function of (parameters, optimizer state, gradient), differentiable.

The update rules are ``torch.optim``'s (the ones :func:`trakcli.train.make_optimizer` builds), written out so that
reverse mode runs through them (Ilyas & Engstrom 2025, "MAGIC: Near-Optimal Data Attribution for Deep Learning":
metagradients by reverse-mode differentiation through the optimizer's steps):

* ``sgd`` (momentum μ, weight decay λ, no dampening, no Nesterov): ``d = g + λθ``;
  ``b ← μ b + d`` (``b = d`` on the first step); ``θ ← θ − lr·b`` (``θ ← θ − lr·d`` when μ = 0).
* ``adam`` (β1, β2, ε; coupled decay): ``g ← g + λθ``; ``m ← β1 m + (1−β1) g``;
  ``v ← β2 v + (1−β2) g²``; ``θ ← θ − (lr / (1−β1ᵗ)) · m / (√v / √(1−β2ᵗ) + ε)``.
* ``adamw`` (Loshchilov & Hutter 2019): ``θ ← θ(1 − lr·λ)``, then Adam's update without the decay in ``g``.

The square root is taken where ``v > 0`` only (``√0 = 0`` with a zero derivative), so a coordinate whose
gradients are all zero gives finite adjoints.

State layout: ``{"buf": {name: tensor}}`` (sgd with momentum), ``{}`` (sgd without), ``{"m": ..., "v": ...}``
(adam / adamw); tensors shaped like their parameter, float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trakcli.errors import ConfigError

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Hyper:
    """The optimizer's constant settings (its ``param_groups[0]`` as recorded).

    Attributes:
        kind: ``sgd``, ``adam`` or ``adamw``.
        momentum, weight_decay: as torch.optim's.
        betas, eps: Adam's.
    """

    kind: str
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    @classmethod
    def of(cls, kind: str, group: dict[str, Any]) -> Hyper:
        """From a recorded ``param_groups`` entry of ``torch.optim.SGD`` / ``Adam`` / ``AdamW``.

        Raises:
            ConfigError: a setting the update rules above do not cover (dampening, nesterov, amsgrad,
                maximize, a complex or capturable variant), named.
        """
        off = {"dampening": 0, "nesterov": False, "amsgrad": False, "maximize": False}
        for key, plain in off.items():
            if key in group and group[key] != plain:
                raise ConfigError(f"the optimizer was run with {key}={group[key]!r}: score.method: unroll "
                                  f"differentiates {kind} with {key}={plain!r} only")
        if kind == "sgd":
            return cls(kind, momentum=float(group.get("momentum", 0.0)), weight_decay=float(group["weight_decay"]))
        b1, b2 = group.get("betas", (0.9, 0.999))
        return cls(kind, weight_decay=float(group["weight_decay"]), betas=(float(b1), float(b2)),
                   eps=float(group.get("eps", 1e-8)))


def initial_state(hyper: Hyper, params: Tensors, recorded: dict[str, Any], names: list[str]) -> tuple[dict, int]:
    """The functional state and step count from a recorded ``optimizer.state_dict()``.

    Args:
        params: the trainable parameters by name.
        recorded: the optimizer's ``state_dict`` (``state`` keyed by the position in ``names``).
        names: the parameter names in the optimizer's order.

    Returns:
        (state as in the module docstring, steps taken so far).
    """
    if hyper.kind == "sgd" and not hyper.momentum:
        return {}, 0
    keys = {"buf": "momentum_buffer"} if hyper.kind == "sgd" else {"m": "exp_avg", "v": "exp_avg_sq"}
    out = {name: {k: torch.zeros_like(p) for k, p in params.items()} for name in keys}
    step = 0
    for i, k in enumerate(names):
        st = recorded.get("state", {}).get(i) or {}
        for name, key in keys.items():
            if st and (hyper.kind != "sgd" or st.get(key) is not None):  # adam's moments must be recorded
                out[name][k] = st[key].to(params[k].device, params[k].dtype)
        if st and hyper.kind != "sgd":
            step = max(step, int(float(st["step"])))
    return out, step


def _safe_sqrt(v: torch.Tensor) -> torch.Tensor:
    """``√v`` with a finite derivative at 0 (taken as 0 there)."""
    pos = v > 0
    return torch.where(pos, torch.sqrt(torch.where(pos, v, torch.ones_like(v))), torch.zeros_like(v))


def update(hyper: Hyper, params: Tensors, state: dict, grads: Tensors, lr: float, t: int) -> tuple[Tensors, dict]:
    """One step of the optimizer, out of place (differentiable in ``params``, ``state`` and ``grads``).

    Args:
        params, grads: ``{name: tensor}`` float32.
        state: as :func:`initial_state` returned (or the previous call).
        lr: this step's learning rate.
        t: this step's count for Adam's bias corrections (1 on the first step).

    Returns:
        (new parameters, new state).
    """
    wd = hyper.weight_decay
    if hyper.kind == "sgd":
        d = {k: grads[k] + wd * p if wd else grads[k] for k, p in params.items()}
        if not hyper.momentum:
            return {k: p - lr * d[k] for k, p in params.items()}, {}
        buf = {k: hyper.momentum * state["buf"][k] + d[k] for k in params}
        return {k: p - lr * buf[k] for k, p in params.items()}, {"buf": buf}
    b1, b2 = hyper.betas
    if hyper.kind == "adam" and wd:
        grads = {k: grads[k] + wd * p for k, p in params.items()}
    elif hyper.kind == "adamw" and wd:
        params = {k: p * (1 - lr * wd) for k, p in params.items()}
    m = {k: b1 * state["m"][k] + (1 - b1) * grads[k] for k in params}
    v = {k: b2 * state["v"][k] + (1 - b2) * grads[k] * grads[k] for k in params}
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    step = lr / bc1
    new = {k: p - step * m[k] / (_safe_sqrt(v[k]) / bc2 ** 0.5 + hyper.eps) for k, p in params.items()}
    return new, {"m": m, "v": v}
