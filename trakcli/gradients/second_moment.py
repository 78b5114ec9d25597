"""The optimizer second-moment correction of per-example gradients (TrackStar), read from a saved optimizer state.

TrackStar (Chang et al., ICLR 2025, "Scalable Influence and Fact Tracing for Large Language Model Pretraining",
Sec. 3) divides each per-example gradient elementwise by the square root of the second-moment estimate ``v`` that Adam
kept for the checkpoint, before projecting it. ``v`` is Adam's ``exp_avg_sq`` divided by its bias correction
``1 - β₂^step`` (Kingma & Ba 2015, Alg. 1). Two kinds (``second_moment.kind``):

* ``adam``: ``g ↦ g / sqrt(v + eps)`` entry by entry (every projector kind but ``kronecker``);
* ``adafactor``: per layer, ``v`` of the layer's gradient matrix ``[d_out, d_in]`` (weight columns, then
  the bias column: :mod:`trakcli.projectors.kronecker_layers`) is replaced by its rank-1 factorization ``v̂ = r cᵀ / S``
  (``r`` row sums, ``c`` column sums, ``S`` the total; Shazeer & Stern 2018, "Adafactor", Sec. 3), so
  ``G ↦ D_out G D_in`` with ``D_out = diag((r̄ + eps)^-1/2)``, ``D_in = (v̄ + eps)^1/2 · diag((c̄ + eps)^-1/2)`` (row,
  column and overall means; with ``eps = 0`` exactly ``1/sqrt(v̂)``). A Kronecker projection ``P_out ⊗ P_in`` then
  becomes ``(P_out D_out) ⊗ (P_in D_in)`` (:meth:`SecondMoment.factors`): nothing per example. A selected parameter
  outside every layer is scaled elementwise (a vector) or factored as ``param.reshape(shape[0], -1)`` (a matrix).

The state file is what `trak optimize` writes with ``optimize.save_optimizer_state: true``
(:func:`optimizer_state_record`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from trakcli.errors import ConfigError
from trakcli.gradients.layers import find_uses
from trakcli.projectors.kronecker_layers import KroneckerLayer

#: The values of ``second_moment.kind`` that correct (None: no correction).
KINDS = ("adafactor", "adam")

#: How a missing state is fixed (every message about one names it).
SAVE_HINT = ("train with optimize.save_optimizer_state: true so `trak optimize` "
             "writes it, or name the files with second_moment.optimizer_state")


def optimizer_state_record(optimizer: str, projection: dict[str, Any] | None, param_names: list[str],
                           state_dict: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state file's contents that :func:`read_second_moments` reads (written with ``torch.save``).

    Args:
        optimizer: the optimizer's name (``adamw``, ...), for messages.
        projection: the projected optimizer's settings, or None.
        param_names: the model's name of each parameter, in the optimizer's ``state_dict`` order.
        state_dict: the torch optimizer's ``state_dict()``; its tensors are detached and copied to the CPU.

    Returns:
        ``{"optimizer", "projection", "param_names", "state_dict"}``.
    """
    on_cpu = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), state_dict)
    return {"optimizer": optimizer, "projection": projection, "param_names": list(param_names), "state_dict": on_cpu}


def read_second_moments(path: Path, param_names: Sequence[str], shapes: dict[str, tuple[int, ...]]
                        ) -> tuple[dict[str, torch.Tensor], float]:
    """The bias-corrected second moments ``v`` of the named parameters from a saved optimizer state.

    Args:
        path: a file written by `trak optimize` with ``save_optimizer_state``.
        param_names: the parameters whose ``v`` is needed.
        shapes: each one's shape (the state's ``exp_avg_sq`` must have it).

    Returns:
        ``(v, eps)``: ``v[name]`` ``[*shape]`` float64 on the CPU, ``exp_avg_sq / (1 - β₂^step)``;
        ``eps`` the optimizer's ``eps`` (of the first parameter's group; 1e-8 if it has none).

    Raises:
        ConfigError: the file is missing or unreadable, not an optimizer state of `trak optimize`,
            or lacks ``exp_avg_sq`` of the right shape for a parameter (an optimizer other
            than Adam/AdamW, or the projected optimizer); one line naming the file and the fix.
    """
    where = f"second_moment: optimizer state {str(path)!r}"
    if not path.is_file():
        raise ConfigError(f"{where} does not exist; {SAVE_HINT}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is one message
        raise ConfigError(f"{where} cannot be read ({type(e).__name__}: {e}); {SAVE_HINT}") from None
    sd, names = (state.get("state_dict"), state.get("param_names")) if isinstance(state, dict) else (None, None)
    if not isinstance(sd, dict) or not isinstance(names, list) or "state" not in sd or "param_groups" not in sd:
        raise ConfigError(f"{where} is not an optimizer state written by `trak optimize` "
                          f"(keys param_names and state_dict expected); {SAVE_HINT}")
    index = {n: i for i, n in enumerate(names)}
    group_of = {i: g for g in sd["param_groups"] for i in g.get("params", [])}
    out: dict[str, torch.Tensor] = {}
    eps = None
    for name in param_names:
        i = index.get(name)
        entry = sd["state"].get(i, {}) if i is not None else {}
        v = entry.get("exp_avg_sq")
        if i is None or v is None or tuple(v.shape) != tuple(shapes[name]):
            optimizer = state.get("optimizer")
            why = ("has no entry for it" if i is None else
                   "has no exp_avg_sq for it" if v is None else
                   f"has exp_avg_sq of shape {list(v.shape)}, the parameter has {list(shapes[name])}")
            raise ConfigError(f"{where} (optimizer {optimizer!r}) {why}: parameter {name!r}; the correction reads "
                              "Adam/AdamW's exp_avg_sq of every selected parameter: train with optimizer adamw (or "
                              "adam) without projection, or leave the parameter out with grad_wrt")
        group = group_of.get(i, {})
        beta2 = float(group.get("betas", (0.9, 0.999))[1])
        step = float(entry.get("step", 0.0))
        correction = 1.0 - beta2**step if step > 0 else 1.0
        out[name] = v.detach().to(torch.float64) / correction
        if eps is None:
            eps = float(group.get("eps", 1e-8))
    return out, 1e-8 if eps is None else eps


def factored(v: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(D_out [d_out], D_in [d_in])``: the Adafactor scaling of a gradient matrix with second moments ``v``.

    ``D_out = (r̄ + eps)^-1/2`` and ``D_in = (v̄ + eps)^1/2 (c̄ + eps)^-1/2`` from the row means ``r̄``, column means
    ``c̄`` and mean ``v̄`` of ``v`` (Shazeer & Stern 2018, Sec. 3): with ``eps = 0``,
    ``D_out,i D_in,j = 1/sqrt(r_i c_j / S)``, one over the square root of the rank-1 factorization of ``v``.

    Args:
        v: ``[d_out, d_in]`` float64 second moments (>= 0).
        eps: >= 0.
    """
    return (v.mean(1) + eps).rsqrt(), (v.mean() + eps).sqrt() * (v.mean(0) + eps).rsqrt()


def embedding_note(model: nn.Module, param_names: Sequence[str]) -> str | None:
    """A one-line hint when the correction would scale an ``nn.Embedding`` weight, else None.

    An embedding's rows of rare tokens get gradients in few steps, so their second moments
    are near zero and their scalings ``1/sqrt(v)`` huge; with a tied output layer they enter
    every example's gradient through the softmax (measured: ``benchmarks/bench_recall.py``).

    Args:
        model: the model.
        param_names: the selected parameters (``grad_wrt``).
    """
    chosen = set(param_names)
    weights = (f"{m}.weight" if m else "weight" for m, mod in model.named_modules() if isinstance(mod, nn.Embedding))
    names = [w for w in weights if w in chosen]
    if not names:
        return None
    return (f"second_moment: the embedding weight(s) {', '.join(names)} are corrected too; rows of rare tokens "
            "have second moments near zero and their scalings can swamp every example's features (with a tied "
            "output layer, through the softmax); if retrieval looks random, leave them out with grad_wrt")


class SecondMoment:
    """The second-moment correction of a model's selected parameters, per checkpoint.

    Args:
        model: the model (its parameters' shapes and layers).
        param_names: the selected parameters (``grad_wrt``), in order.
        kind: ``adafactor`` or ``adam`` (module docstring).
        states: the optimizer state file of each checkpoint, by model_id.
        eps: added to the second moments; None: the saved optimizer's ``eps`` squared.
        layers: the Kronecker layers the parameters are factored by (default:
            :func:`~trakcli.gradients.layers.find_uses` of ``param_names``).

    Attributes:
        kind, eps, states, layers: as given.

    Raises:
        ConfigError: ``kind`` not one of :data:`KINDS`, or ``eps`` negative.
    """

    def __init__(self, model: nn.Module, param_names: Sequence[str], kind: str, states: Sequence[Path],
                 eps: float | None = None, layers: Sequence[KroneckerLayer] | None = None):
        if kind not in KINDS:
            raise ConfigError(f"second_moment.kind must be one of {', '.join(KINDS)} or null, got {kind!r}")
        if eps is not None and not eps >= 0:
            raise ConfigError(f"second_moment.eps must be >= 0, got {eps!r}")
        params = dict(model.named_parameters())
        self.kind, self.eps, self.states = kind, eps, [Path(p) for p in states]
        self.param_names = list(param_names)
        self.shapes = {n: tuple(params[n].shape) for n in self.param_names}
        self.layers = list(layers) if layers is not None else find_uses(model, self.param_names)[0]
        self._cache: dict[tuple[int, str], Any] = {}

    def spec(self) -> dict[str, Any]:
        """What the features depend on besides the files: ``{"kind", "eps"}`` (part of the store identity)."""
        return {"kind": self.kind, "eps": self.eps}

    def _read(self, model_id: int) -> tuple[dict[str, torch.Tensor], float]:
        """``(v, eps)`` of checkpoint ``model_id``: its second moments and the eps in effect."""
        if not 0 <= model_id < len(self.states):
            raise ConfigError(f"second_moment: no optimizer state for model_id {model_id} "
                              f"({len(self.states)} state files); {SAVE_HINT}")

        def make():
            v, opt_eps = read_second_moments(self.states[model_id], self.param_names, self.shapes)
            return v, opt_eps**2 if self.eps is None else self.eps

        return self._cached("read", model_id, "cpu", make)

    def _cached(self, what: str, model_id: int, device: torch.device | str, make):
        key = (model_id, f"{what}:{torch.device(device)}")
        if key not in self._cache:
            self._cache = {k: c for k, c in self._cache.items() if k[0] == model_id}  # one checkpoint at a time
            self._cache[key] = make()
        return self._cache[key]

    def _checked(self, t: torch.Tensor, name: str, model_id: int) -> torch.Tensor:
        if not bool(torch.isfinite(t).all()):
            raise ConfigError(f"second_moment: {name!r} has a row or column of second moments 0 in the optimizer "
                              f"state {str(self.states[model_id])!r} of model_id {model_id}, so its scaling is "
                              "infinite with eps 0; set second_moment.eps > 0 (e.g. 1e-16)")
        return t

    def layer_scales(self, model_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (``layers`` order) the Adafactor ``(D_out [d_out], D_in [d_in])``, float64 on the CPU.

        Raises:
            ConfigError: as :func:`read_second_moments`, or infinite scalings (eps 0 and a zero row or column).
        """
        def make():
            v, eps = self._read(model_id)
            out = []
            for layer in self.layers:
                d_out, d_in = factored(layer.to_matrix({n: t[None] for n, t in v.items()}, 1)[0], eps)
                out.append((self._checked(d_out, layer.name, model_id), self._checked(d_in, layer.name, model_id)))
            return out

        return self._cached("layers", model_id, "cpu", make)

    def factors(self, factors: Sequence[tuple[torch.Tensor, torch.Tensor]], model_id: int
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Kronecker factors with the correction folded in: ``(D_out P_outᵀ, D_in P_inᵀ)`` per layer.

        Args:
            factors: per layer ``(P_outᵀ [d_out, k_out], P_inᵀ [d_in, k_in])``
                (:meth:`~trakcli.projectors.kronecker.KroneckerProjector.transposed_factors`), for ``layers``.
            model_id: the checkpoint.

        Returns:
            The scaled factors, in the factors' dtype and device (new tensors), so that
            ``(P_out D_out ⊗ P_in D_in) vec(G) = (P_out ⊗ P_in) vec(D_out G D_in)``.
        """
        p = factors[0][0]
        return self._cached(f"factors:{p.dtype}", model_id, p.device, lambda: [
            (po * d_out.to(po)[:, None], pi * d_in.to(pi)[:, None])
            for (po, pi), (d_out, d_in) in zip(factors, self.layer_scales(model_id))])

    def param_scales(self, model_id: int, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Per selected parameter the elementwise scaling ``[*shape]`` of its gradient, in ``dtype`` on ``device``.

        ``adam``: ``1/sqrt(v + eps)``. ``adafactor``: ``D_out,i D_in,j`` of the parameter's entries in its
        layer's matrix (the bias: ``D_out,i`` times the bias column's ``D_in``); outside layers a vector's
        ``1/sqrt(v + eps)``, a matrix's Adafactor scaling of ``v.reshape(shape[0], -1)``.

        Raises:
            ConfigError: as :meth:`layer_scales`.
        """
        def make():
            v, eps = self._read(model_id)
            out: dict[str, torch.Tensor] = {}
            if self.kind == "adafactor":
                for layer, (d_out, d_in) in zip(self.layers, self.layer_scales(model_id)):
                    out.update(layer.from_matrix((d_out[:, None] * d_in[None, :])[None]))  # [1, *shape] each
            scales = {}
            for name in self.param_names:
                if name in out:
                    scales[name] = out[name].reshape(self.shapes[name])
                elif self.kind == "adafactor" and v[name].dim() >= 2:
                    d_out, d_in = factored(v[name].reshape(v[name].shape[0], -1), eps)
                    scales[name] = (d_out[:, None] * d_in[None, :]).reshape(self.shapes[name])
                else:
                    scales[name] = (v[name] + eps).rsqrt()
                self._checked(scales[name], name, model_id)
            return {n: t.to(device=device, dtype=dtype) for n, t in scales.items()}

        return self._cached(f"params:{dtype}", model_id, device, make)

    def scale_gradients(self, grads: dict[str, torch.Tensor], model_id: int) -> dict[str, torch.Tensor]:
        """Per-example gradients ``[n, *shape]`` times :meth:`param_scales` (new tensors, same dtype and device)."""
        first = grads[self.param_names[0]]
        scales = self.param_scales(model_id, first.device, first.dtype)
        return {n: g * scales[n] if n in scales else g for n, g in grads.items()}
