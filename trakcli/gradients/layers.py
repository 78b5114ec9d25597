"""Which modules the hooks cover, and how their calls feed the selected parameters and Kronecker layers.

The covered modules are those of a kind in :mod:`trakcli.gradients.kinds` (with the ``forward`` of its class). A
Kronecker-factored projection covers the matrix kinds (:data:`SUPPORTED`); exact per-example gradients also the
normalizations (:data:`HOOKED`). Every other selected parameter (a bare ``nn.Parameter``, a refused module) is left
out and named, with why, in one info line or message.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from trakcli.gradients.kinds import KINDS, KRONECKER_KINDS, Kind, describe, kind_of
from trakcli.projectors.kronecker_layers import KroneckerLayer, LayerParam

#: What the kronecker projection covers (for messages).
SUPPORTED = describe(KRONECKER_KINDS)

#: What the layer hooks of exact per-example gradients cover (for messages).
HOOKED = describe(KINDS)


@dataclass(frozen=True)
class Use:
    """One module whose calls feed selected parameters (and, for a matrix kind, one Kronecker layer).

    Attributes:
        name: the module's name in the model.
        module: the module.
        kind: its :class:`~trakcli.gradients.kinds.Kind`.
        weight: name of the selected parameter its weight feeds (a tied weight: the owner's name), or None.
        bias: name of the selected parameter its bias feeds, or None.
        layer: index of the Kronecker layer it feeds; None for a normalization (exact gradients only).
        transposed: the module's (out, in) sides are the layer's (in, out): a weight
            tied to a layer of the other orientation (GPT-2's ``lm_head`` and ``wte``).
    """

    name: str
    module: nn.Module
    kind: Kind
    weight: str | None
    bias: str | None
    layer: int | None = None
    transposed: bool = False


def find_uses(model: nn.Module, selected: list[str], kinds: tuple[Kind, ...] = KRONECKER_KINDS
              ) -> tuple[list[KroneckerLayer], list[Use], dict[str, str]]:
    """The Kronecker layers, the module calls feeding the selected parameters, and why the others are left out.

    Layers come in ``model.named_modules()`` order. A weight shared by several modules (tied embeddings) is one layer
    fed by each of them, in its owner's orientation. ``nn.MultiheadAttention`` uses its ``out_proj`` weight without
    calling the module, so that projection is left out.

    Args:
        model: the model.
        selected: names of the selected parameters (:func:`trakcli.gradients.vmap.select_parameters`).
        kinds: the covered kinds: :data:`~trakcli.gradients.kinds.KRONECKER_KINDS` (the Kronecker
            projection) or :data:`~trakcli.gradients.kinds.KINDS` (exact gradients, normalizations too).

    Returns:
        ``(layers, uses, left_out)`` with ``left_out`` mapping each selected
        parameter no use feeds to a reason (its module's type, mostly).
    """
    name_of = {id(p): n for n, p in model.named_parameters()}
    chosen = set(selected)
    layers: list[KroneckerLayer] = []
    uses: list[Use] = []
    owner: dict[str, int | None] = {}
    reasons: dict[str, str] = {}
    functional: set[int] = set()
    for mname, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            reasons.setdefault(name_of[id(p)], type(mod).__name__)
        if isinstance(mod, nn.MultiheadAttention):
            functional.add(id(mod.out_proj))
        kind, why = kind_of(mod, kinds)
        if kind is not None and id(mod) in functional:
            kind, why = None, "out_proj of nn.MultiheadAttention (used without calling the module)"
        if kind is None:
            for p in mod.parameters(recurse=False):
                reasons[name_of[id(p)]] = why or reasons[name_of[id(p)]]
            continue
        weight, bias = getattr(mod, "weight", None), kind.bias(mod)
        wn = name_of[id(weight)] if isinstance(weight, nn.Parameter) else None
        bn = name_of[id(bias)] if bias is not None else None
        if not kind.kronecker:  # a normalization: its own weight and bias, no Kronecker layer
            names = [n if n in chosen and n not in owner else None for n in (wn, bn)]
            if any(names):
                uses.append(Use(mname, mod, kind, *names))
                owner.update({n: None for n in names if n is not None})
            continue
        d_out = kind.d_out(mod)
        use_w, use_b = wn in chosen, bn in chosen
        if use_w and wn in owner:  # a tied weight: feed the owner's layer
            j = owner[wn]
            lay = layers[j]
            same = lay.params[0].role == kind.role and lay.d_out == d_out
            if not same and (kind.name.startswith("conv") or lay.kind.startswith("conv")):
                reasons[wn] = f"{type(mod).__name__} sharing a convolution weight in another orientation"
                continue
            shared_bias = use_b and same and owner.get(bn) == j
            uses.append(Use(mname, mod, kind, wn, bn if shared_bias else None, j, not same))
            use_w, use_b = False, use_b and not shared_bias
        if use_b and bn in owner:
            reasons[bn] = "a bias shared with another layer without its weight"
            use_b = False
        params = []
        if use_w:
            params.append(LayerParam(wn, tuple(weight.shape), kind.role))
        if use_b:
            params.append(LayerParam(bn, (d_out,), "bias"))
        if params:
            layers.append(KroneckerLayer(mname, kind.name if use_w else "bias", d_out, tuple(params)))
            for p in params:
                owner[p.name] = len(layers) - 1
            uses.append(Use(mname, mod, kind, wn if use_w else None, bn if use_b else None, len(layers) - 1))
    left_out = {n: reasons.get(n, "parameter") for n in selected if n not in owner}
    return layers, uses, left_out


def describe_left_out(left_out: dict[str, str], limit: int = 6) -> str:
    """``"a.weight (MultiheadAttention), b (parameter)"``: the first ``limit`` uncovered parameters and why."""
    shown = ", ".join(f"{n} ({why})" for n, why in list(left_out.items())[:limit])
    return shown + (f" and {len(left_out) - limit} more" if len(left_out) > limit else "")


def coverage_info(layers: list[KroneckerLayer], left_out: dict[str, str], selected_numel: int) -> str:
    """One line: how many layers and parameter entries are covered, and which selected parameters are left out
    (grouped by reason; a group of more than three named by its count and its first two)."""
    covered = sum(layer.grad_dim for layer in layers)
    line = (f"kronecker projection: {len(layers)} layers cover {covered:,} of the {selected_numel:,} selected "
            f"parameter entries ({100.0 * covered / max(1, selected_numel):.2f}%)")
    if not left_out:
        return line
    groups: dict[str, list[str]] = {}
    for name, why in left_out.items():
        groups.setdefault(why, []).append(name)
    return line + "; left out: " + "; ".join(f"{why}: {_names(names)}" for why, names in groups.items())


def _names(names: list[str], limit: int = 3) -> str:
    """Up to ``limit`` names in full; more as their count and the first two (``"61 parameters: a, b, ..."``)."""
    if len(names) <= limit:
        return ", ".join(names)
    return f"{len(names)} parameters: {names[0]}, {names[1]}, ..."
