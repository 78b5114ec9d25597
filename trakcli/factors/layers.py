"""Which modules a Kronecker-factored projection covers, and how their calls feed its layers.

Supported: ``nn.Linear`` (any leading dims), ``nn.Conv1d`` / ``nn.Conv2d`` with
``groups=1``, ``nn.Embedding`` (without ``scale_grad_by_freq``) and
transformers' ``Conv1D`` (GPT-2; weight stored ``[in, out]``), each with the
``forward`` of its class. Every other selected parameter (LayerNorm, BatchNorm,
a bare ``nn.Parameter``) is left out and named in one info line.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from trakcli.projectors.kronecker_layers import KroneckerLayer, LayerParam

#: What the kronecker projection covers (for messages).
SUPPORTED = "nn.Linear, nn.Conv1d/nn.Conv2d with groups=1, nn.Embedding and transformers' Conv1D"


@dataclass(frozen=True)
class LayerUse:
    """One module whose calls contribute to a layer's gradient matrix.

    Attributes:
        layer: index of the layer in the projector.
        name: the module's name.
        module: the module.
        kind: how its input is read: ``linear`` (also transformers ``Conv1D``), ``conv`` or ``embedding``.
        transposed: the module's (out, in) sides are the layer's (in, out): a weight
            tied to a layer of the other orientation (GPT-2's ``lm_head`` and ``wte``).
        weight: contributes to the layer's weight columns.
        bias: contributes to the layer's bias column.
    """

    layer: int
    name: str
    module: nn.Module
    kind: str
    transposed: bool
    weight: bool
    bias: bool


def module_kind(module: nn.Module) -> tuple[str | None, str]:
    """``(kind, reason)``: the layer kind of a module, or ``None`` and why it is not supported ("" if not a layer)."""
    if isinstance(module, nn.Linear):
        kind = "linear"
    elif isinstance(module, (nn.Conv1d, nn.Conv2d)):
        if module.groups != 1:
            return None, f"{type(module).__name__} with groups={module.groups} (only groups=1 is supported)"
        kind = "conv1d" if isinstance(module, nn.Conv1d) else "conv2d"
    elif isinstance(module, nn.Embedding):
        if module.scale_grad_by_freq:
            return None, "nn.Embedding with scale_grad_by_freq (batch-dependent gradient)"
        kind = "embedding"
    elif type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers"):
        return "hf_conv1d", ""
    else:
        return None, ""
    base = {"linear": nn.Linear, "conv1d": nn.Conv1d, "conv2d": nn.Conv2d, "embedding": nn.Embedding}[kind]
    if type(module).forward is not base.forward:
        return None, f"{type(module).__name__} overrides the forward of {base.__name__}"
    return kind, ""


def _d_out(module: nn.Module, kind: str) -> int:
    if kind == "linear":
        return module.out_features
    if kind in ("conv1d", "conv2d"):
        return module.out_channels
    if kind == "embedding":
        return module.embedding_dim
    return module.nf  # transformers Conv1D: weight [in, out], out = nf


def find_layers(model: nn.Module, selected: list[str]) -> tuple[list[KroneckerLayer], list[LayerUse], dict[str, str]]:
    """The covered layers, the module calls feeding them, and why the other selected parameters are left out.

    Layers come in ``model.named_modules()`` order. A weight shared by several
    modules (tied embeddings) is one layer fed by each of them, in its owner's
    orientation. ``nn.MultiheadAttention`` uses its ``out_proj`` weight without
    calling the module, so that projection is left out.

    Args:
        model: the model.
        selected: names of the selected parameters (:func:`trakcli.gradients.select_parameters`).

    Returns:
        ``(layers, uses, left_out)`` with ``left_out`` mapping each selected
        parameter outside every layer to a reason (its module's type, mostly).
    """
    name_of = {id(p): n for n, p in model.named_parameters()}
    chosen = set(selected)
    layers: list[KroneckerLayer] = []
    uses: list[LayerUse] = []
    owner: dict[str, int] = {}
    reasons: dict[str, str] = {}
    functional: set[int] = set()
    for mname, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            reasons.setdefault(name_of[id(p)], type(mod).__name__)
        if isinstance(mod, nn.MultiheadAttention):
            functional.add(id(mod.out_proj))
        kind, why = module_kind(mod)
        if kind is not None and id(mod) in functional:
            kind, why = None, "out_proj of nn.MultiheadAttention (used without calling the module)"
        if kind is None:
            for p in mod.parameters(recurse=False):
                reasons[name_of[id(p)]] = why or reasons[name_of[id(p)]]
            continue
        d_out = _d_out(mod, kind)
        role = "weight_t" if kind in ("embedding", "hf_conv1d") else "weight"
        read = {"conv1d": "conv", "conv2d": "conv", "hf_conv1d": "linear"}.get(kind, kind)
        wn = name_of[id(mod.weight)]
        bias = getattr(mod, "bias", None) if kind != "embedding" else None
        bn = name_of[id(bias)] if isinstance(bias, nn.Parameter) else None
        use_w, use_b = wn in chosen, bn is not None and bn in chosen
        if use_w and wn in owner:  # a tied weight: feed the owner's layer
            j = owner[wn]
            lay = layers[j]
            same = lay.params[0].role == role and lay.d_out == d_out
            if not same and (read == "conv" or lay.kind.startswith("conv")):
                reasons[wn] = f"{type(mod).__name__} sharing a convolution weight in another orientation"
                continue
            shared_bias = use_b and same and owner.get(bn) == j
            uses.append(LayerUse(j, mname, mod, read, not same, True, shared_bias))
            use_w, use_b = False, use_b and not shared_bias
        if use_b and bn in owner:
            reasons[bn] = "a bias shared with another layer without its weight"
            use_b = False
        params = []
        if use_w:
            params.append(LayerParam(wn, tuple(mod.weight.shape), role))
        if use_b:
            params.append(LayerParam(bn, (d_out,), "bias"))
        if params:
            layers.append(KroneckerLayer(mname, kind if use_w else "bias", d_out, tuple(params)))
            for p in params:
                owner[p.name] = len(layers) - 1
            uses.append(LayerUse(len(layers) - 1, mname, mod, read, False, use_w, use_b))
    left_out = {n: reasons.get(n, "parameter") for n in selected if n not in owner}
    return layers, uses, left_out


def coverage_info(layers: list[KroneckerLayer], left_out: dict[str, str], selected_numel: int) -> str:
    """One line: how many layers and parameter entries are covered, and which selected parameters are left out
    (grouped by reason; a group of more than three named by its count and its first two)."""
    covered = sum(layer.grad_dim for layer in layers)
    line = (
        f"kronecker projection: {len(layers)} layers cover {covered:,} of the {selected_numel:,} selected "
        f"parameter entries ({100.0 * covered / max(1, selected_numel):.2f}%)"
    )
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
