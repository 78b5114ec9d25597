"""K-FAC and EK-FAC curvature of a checkpoint, fit from layer hooks, and the whitening of gradients by it.

For a layer ``y_t = W a_t (+ b)`` (bias folded in, ``a_t ← [a_t, 1]``) applied at positions ``t``, an example's
gradient is ``G = Σ_t g_t a_tᵀ`` ``[d_out, d_in]``. The Fisher of the per-example loss restricted to the layer,
``F = E_z[vec G vec Gᵀ]`` (row-major ``vec``), is approximated by a Kronecker product (Martens & Grosse 2015,
"Optimizing Neural Networks with Kronecker-factored Approximate Curvature"):

    F ≈ S ⊗ A,   A = Σ_tokens a aᵀ / N_tokens   [d_in, d_in],
                 S = Σ_tokens g gᵀ / N_examples  [d_out, d_out]

(tokens: every real position, padding excluded by ``attention_mask``; an example without positions, a classifier's,
has one). ``g`` is the gradient of the summed loss at labels sampled from the model's own distribution
(``fisher: true``, the Fisher, as kronfluence fits it) or at the data's labels (``fisher: empirical``). With the
eigendecompositions ``A = Q_A diag(λ_A) Q_Aᵀ``, ``S = Q_S diag(λ_S) Q_Sᵀ``:

* K-FAC: ``F ≈ (Q_S ⊗ Q_A) diag(Λ) (Q_S ⊗ Q_A)ᵀ`` with ``Λ_ij = λ_S,i λ_A,j``;
* EK-FAC (George et al. 2018, "Fast Approximate Natural Gradient Descent in a Kronecker-factored Eigenbasis"; Grosse
  et al. 2023, "Studying Large Language Model Generalization with Influence Functions", Sec. 2.2.3): the same
  eigenbasis, with the eigenvalues corrected to the second moments of the examples' gradients in it,
  ``Λ_ij = E_z[(Q_Sᵀ G Q_A)_ij²]`` (one more pass over the data).

Each layer is damped by ``δ = damping · mean(Λ)`` (kronfluence's default heuristic with
``damping = 0.1``), so that the inverse is ``(Q_S ⊗ Q_A) diag(1/(Λ + δ)) (Q_S ⊗ Q_A)ᵀ``.

**Whitening.** :meth:`CurvatureFactors.whiten` maps an example's gradient to
``W vec G = diag((Λ + δ)^-1/2) vec(Q_Sᵀ G Q_A)`` per layer, so that for any two examples

    ⟨W g_t, W g_z⟩ = Σ_layers g_tᵀ (F + δ I)⁻¹ g_z,

the influence of Koh & Liang (2017) with the block-diagonal (E)K-FAC inverse. Train and
target features are JL projections of whitened gradients, so scores stay inner products.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from trakcli.errors import ConfigError, DataError, GradientError
from trakcli.gradients.hooks import HookPass, first_rows, logits_of
from trakcli.gradients.layers import Use, describe_left_out, find_uses
from trakcli.projectors.kronecker_layers import KroneckerLayer
from trakcli.tasks import IGNORE_INDEX, Task, make_batch, token_labels

#: The values of ``curvature.kind`` beyond TRAK's ``gram``.
KINDS = ("kfac", "ekfac")

#: The values of ``curvature.fisher``.
FISHERS = ("true", "empirical")

#: Largest side of a Kronecker factor (``d_out`` or ``d_in``): its eigendecomposition is dense.
MAX_FACTOR = 8192


@dataclass
class LayerFactors:
    """One layer's fitted curvature on the CPU, in :func:`factor_dtype` (float32 for a float32 model).

    Attributes:
        name: the layer's module name.
        q_out: ``[d_out, d_out]`` eigenvectors of ``S`` (columns).
        q_in: ``[d_in, d_in]`` eigenvectors of ``A`` (columns).
        eig: ``[d_out, d_in]`` eigenvalues ``Λ`` in that basis (K-FAC: ``λ_S λ_Aᵀ``; EK-FAC: corrected).
    """

    name: str
    q_out: torch.Tensor
    q_in: torch.Tensor
    eig: torch.Tensor

    def damping(self, relative: float) -> float:
        """The absolute damping ``δ = relative · mean(Λ)`` of the layer."""
        return float(relative * self.eig.mean(dtype=torch.float64))


@dataclass
class CurvatureFactors:
    """The fitted curvature of one checkpoint: one :class:`LayerFactors` per Kronecker layer, and the damping.

    Attributes:
        layers: the :class:`~trakcli.projectors.kronecker_layers.KroneckerLayer` of each entry of ``factors``.
        factors: per layer, its :class:`LayerFactors`.
        damping: relative damping (module docstring).
    """

    layers: list[KroneckerLayer]
    factors: list[LayerFactors]
    damping: float

    def __post_init__(self) -> None:
        self._cache: dict[tuple[Any, Any], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def _on(self, device: torch.device, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        key = (torch.device(device), dtype)
        if key not in self._cache:
            # contiguous: factors fitted here (eigh gives column-major eigenvectors) and factors read from the
            # store then take the same matmul path, so every process computes the same features bit for bit
            whitening = [(f.q_out, f.q_in, (f.eig + f.damping(self.damping)).rsqrt()) for f in self.factors]
            self._cache[key] = [tuple(t.to(device=device, dtype=dtype).contiguous() for t in w) for w in whitening]
        return self._cache[key]

    def whiten(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whitened per-example gradients: per layer ``diag((Λ + δ)^-1/2) vec(Q_Sᵀ G Q_A)`` (module docstring).

        Args:
            grads: per selected parameter ``[n, *shape]`` (every one in a layer of :attr:`layers`).

        Returns:
            New tensors of the same names, shapes, dtype and device, holding the whitened gradient in the layer's
            eigenbasis (rotations keep inner products, so the parameters' entries are the eigenbasis coordinates, laid
            out as :meth:`KroneckerLayer.from_matrix` lays out a matrix).
        """
        return self._rotated(grads, torch.mul)

    def dual(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``W⁻ᵀ x`` per layer: ``diag((Λ + δ)^1/2) vec(Q_Sᵀ X Q_A)``, laid out as :meth:`whiten` lays out its result.

        For a vector ``x`` in parameter space, ``⟨W⁻ᵀ x, W g⟩ = xᵀ g``: the feature of a target whose
        inverse-Hessian-vector product ``x`` was computed otherwise (:mod:`trakcli.curvature.refine`),
        to be compared with whitened train features. ``dual(inverse_hvp(g)) = whiten(g)``.

        Args:
            grads: per selected parameter ``[n, *shape]``.
        """
        return self._rotated(grads, torch.div)

    def _rotated(self, grads: dict[str, torch.Tensor], op: Callable) -> dict[str, torch.Tensor]:
        """Per layer ``op(Q_Sᵀ G Q_A, (Λ + δ)^-1/2)`` laid out as the parameters (:meth:`whiten`, :meth:`dual`)."""
        first = next(iter(grads.values()))
        n, out = first.shape[0], dict(grads)
        for layer, (q_out, q_in, scale) in zip(self.layers, self._on(first.device, first.dtype)):
            out.update(layer.from_matrix(op(q_out.T @ layer.to_matrix(grads, n) @ q_in, scale)))
        return out

    def inverse_hvp(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``(F + δ I)⁻¹ g`` per layer, in the parameters' own coordinates (float64 math, ``grads``' dtype out).

        Args:
            grads: per selected parameter ``[n, *shape]``.
        """
        first = next(iter(grads.values()))
        n, out = first.shape[0], dict(grads)
        for layer, f in zip(self.layers, self.factors):
            g = layer.to_matrix(grads, n).to(torch.float64).cpu()
            q_out, q_in, eig = f.q_out.double(), f.q_in.double(), f.eig.double()
            inv = 1.0 / (eig + f.damping(self.damping))
            h = q_out @ ((q_out.T @ g @ q_in) * inv) @ q_in.T
            out.update({k: v.to(device=first.device, dtype=first.dtype) for k, v in layer.from_matrix(h).items()})
        return out

    def arrays(self) -> dict[str, Any]:
        """Plain numpy arrays (the factors' dtype) by name (``<i>/q_out``, ``<i>/q_in``, ``<i>/eig``) for the store."""
        return {f"{i}/{k}": getattr(f, k).numpy() for i, f in enumerate(self.factors) for k in ("q_out", "q_in", "eig")}

    @classmethod
    def from_arrays(cls, layers: Sequence[KroneckerLayer], arrays: dict[str, Any], damping: float) -> CurvatureFactors:
        """The inverse of :meth:`arrays` (shapes checked against ``layers``).

        Raises:
            DataError: an array is missing or has another shape than its layer needs.
        """
        factors = []
        for i, layer in enumerate(layers):
            want = {"q_out": (layer.d_out, layer.d_out), "q_in": (layer.d_in, layer.d_in),
                    "eig": (layer.d_out, layer.d_in)}
            got = {}
            for key, shape in want.items():
                a = arrays.get(f"{i}/{key}")
                if a is None or tuple(a.shape) != shape:
                    raise DataError(f"curvature of layer {layer.name}: array {i}/{key} is "
                                    f"{'missing' if a is None else f'of shape {list(a.shape)}'}, expected {list(shape)}")
                t = torch.as_tensor(a)
                got[key] = t if t.dtype in (torch.float32, torch.float64) else t.float()
            factors.append(LayerFactors(layer.name, **got))
        return cls(list(layers), factors, damping)


def curvature_layers(model: nn.Module, param_names: Sequence[str], kind: str) -> tuple[list[KroneckerLayer], list[Use]]:
    """The Kronecker layers (and their module calls) a K-FAC curvature of the selected parameters has.

    Args:
        model: the model.
        param_names: the selected parameters (every one must be in such a layer).
        kind: ``kfac`` or ``ekfac`` (for messages).

    Returns:
        ``(layers, uses)``, one use per layer.

    Raises:
        ConfigError: a selected parameter outside every matrix layer (a norm, a bare parameter), a
            weight shared by several modules (tied embeddings), or a factor wider than :data:`MAX_FACTOR`;
            each names the parameters and says to leave them out with ``grad_wrt``.
    """
    layers, uses, left_out = find_uses(model, list(param_names))
    fix = "leave them out with grad_wrt (e.g. grad_wrt: ['transformer.h.*'] for a GPT-2's blocks)"
    if left_out:
        raise ConfigError(f"curvature.kind {kind} fits Kronecker factors of linear, convolution and embedding layers; "
                          f"these selected parameters are outside them: {describe_left_out(left_out)}; {fix}, or use "
                          "curvature.kind gram")
    counts: dict[int, list[str]] = {}
    for use in uses:
        counts.setdefault(use.layer, []).append(use.name)
    shared = [f"{layers[j].name} (used by {', '.join(names)})" for j, names in counts.items() if len(names) > 1]
    if shared:
        raise ConfigError(f"curvature.kind {kind}: a weight shared by several modules has no Kronecker factorization: "
                          f"{'; '.join(shared)}; {fix}")
    wide = [f"{layer.name} [{layer.d_out}, {layer.d_in}]" for layer in layers if max(layer.d_out, layer.d_in) > MAX_FACTOR]
    if wide:
        raise ConfigError(f"curvature.kind {kind}: the factors of {', '.join(wide)} exceed {MAX_FACTOR} rows "
                          f"(a dense eigendecomposition each); {fix}")
    by_layer = {use.layer: use for use in uses}
    return layers, [by_layer[j] for j in range(len(layers))]


def default_curvature_params(model: nn.Module, kind: str) -> tuple[list[str], str]:
    """The parameters a curvature fits when ``grad_wrt`` is unset, and one line saying what it leaves out.

    The weights and biases of every linear and convolution layer (the modules kronfluence tracks) whose weight
    no other module shares and whose factors are at most :data:`MAX_FACTOR` wide; left out, counted by why:
    parameters outside such layers, embeddings (select them with ``grad_wrt``), tied weights and wider layers.

    Args:
        model: the model.
        kind: ``kfac`` or ``ekfac`` (for the line).

    Returns:
        ``(param_names, info)``.

    Raises:
        ConfigError: the model has no such layer.
    """
    from trakcli.gradients.vmap import select_parameters

    names = select_parameters(model, None)  # a PEFT model: its adapter's parameters
    layers, uses, left_out = find_uses(model, names)
    counts = Counter(use.layer for use in uses)
    why: dict[str, list[str]] = {}
    for n, reason in left_out.items():
        why.setdefault(reason, []).append(n)
    keep: list[str] = []
    covered = 0
    for j, layer in enumerate(layers):
        params = [p.name for p in layer.params]
        if layer.kind == "embedding":
            why.setdefault("embeddings (select them with grad_wrt)", []).extend(params)
        elif counts.get(j, 0) > 1:
            why.setdefault("tied weights", []).extend(params)
        elif max(layer.d_out, layer.d_in) > MAX_FACTOR:
            why.setdefault(f"layers wider than {MAX_FACTOR}", []).extend(params)
        else:
            keep.extend(params)
            covered += layer.grad_dim
    if not keep:
        raise ConfigError(f"curvature.kind {kind}: the model has no linear or convolution layer it can factor "
                          f"(left out: {'; '.join(f'{r}: {len(v)}' for r, v in why.items())}); select layers with "
                          "grad_wrt, or use curvature.kind gram")
    params = dict(model.named_parameters())
    total = sum(params[n].numel() for n in names)
    line = (f"curvature {kind}: {len(keep)} parameters of linear and convolution layers, {covered:,} of the model's "
            f"{total:,} selectable parameter entries ({100.0 * covered / max(1, total):.1f}%)")
    if why:
        line += "; left out: " + "; ".join(f"{len(v)} parameters ({r})" for r, v in why.items())
    return keep, line


def fisher_loss(task: Task, logits: torch.Tensor, batch: dict[str, torch.Tensor], fisher: str,
                generator: torch.Generator | None) -> torch.Tensor:
    """The summed loss whose gradients the factors are fit on.

    ``true``: labels drawn from the model's own predictive distribution (the Fisher; Martens & Grosse 2015, Sec. 5): a
    class per row of ``[n, C]`` logits, a next token at every target position of a language model. ``empirical``: the
    data's labels. Either way the task's :meth:`~trakcli.tasks.Task.loss` with ``reduction="sum"``.

    Raises:
        ConfigError: ``true`` with a task that is neither token-level nor reads ``[n]`` class labels.
    """
    if fisher == "empirical":
        return task.loss(logits, batch, reduction="sum")
    if task.token_level:
        labels = token_labels(batch)  # [n, L]
        nxt = labels[:, 1:].clone()
        target = nxt != IGNORE_INDEX  # only the target positions are sampled: a copy of their logits, not of all
        pred = logits.detach().reshape(*labels.shape, -1)[:, :-1][target]  # [n_targets, V]
        probs = torch.softmax(pred.double(), dim=-1)
        nxt[target] = torch.multinomial(probs, 1, generator=generator).reshape(-1).to(labels)
        sampled = torch.cat([labels[:, :1], nxt], dim=1)
    else:
        labels = batch.get("labels")
        if labels is None or labels.dim() != 1 or logits.dim() != 2:
            raise ConfigError(f"curvature.fisher true samples class labels of [n, C] logits or next tokens; task "
                              f"{task.name} has neither; set curvature.fisher: empirical")
        probs = torch.softmax(logits.detach().double(), dim=-1)
        sampled = torch.multinomial(probs, 1, generator=generator).reshape(-1).to(labels)
    return task.loss(logits, {**batch, "labels": sampled}, reduction="sum")


class SameInput:
    """What one batch's layers that read the same input tensor share (a transformer's query, key and value
    projections; its gate and up projections): a result computed for the first of them is reused by the others.

    Entries hold the input tensor itself, so its memory cannot be reused for another tensor while they live;
    :meth:`clear` after each batch."""

    def __init__(self) -> None:
        self._seen: dict[tuple[Any, ...], tuple[torch.Tensor, Any]] = {}

    def take(self, x: torch.Tensor, how: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        """The result for input ``x`` (that tensor, unchanged since) computed ``how``: ``make()`` on first use."""
        key = (x.data_ptr(), tuple(x.shape), x.stride(), x._version, *how)
        hit = self._seen.get(key)
        if hit is None:
            hit = self._seen[key] = (x, make())
        return hit[1]

    def clear(self) -> None:
        self._seen = {}


def input_how(layer: KroneckerLayer, use: Use) -> tuple[Any, ...]:
    """What a layer's ``a_t`` depends on besides its input tensor (:meth:`~trakcli.gradients.kinds.Kind.layer_input`)."""
    return use.kind.name, layer.d_in, layer.weight_cols, use.weight is not None, use.bias is not None


class _Covariances:
    """Hook consumer of pass 1: adds ``Σ_t a aᵀ`` and ``Σ_t g gᵀ`` per layer to ``a`` and ``s`` in ``dtype``
    (:func:`factor_dtype`), starting from the sums of ``resume`` if given, and counts the tokens."""

    keeps_input = False

    def __init__(self, layers: Sequence[KroneckerLayer], device: torch.device, dtype: torch.dtype,
                 resume: PassState | None):
        self.layers, self.device, self.dtype, self.inputs = layers, device, dtype, None
        if resume is None:
            self.a = [torch.zeros(layer.d_in, layer.d_in, dtype=dtype, device=device) for layer in layers]
            self.s = [torch.zeros(layer.d_out, layer.d_out, dtype=dtype, device=device) for layer in layers]
            self.tokens = [0] * len(layers)
        else:
            self.a = [resume.sums[f"{i}/a"].to(device=device, dtype=dtype).clone() for i in range(len(layers))]
            self.s = [resume.sums[f"{i}/s"].to(device=device, dtype=dtype).clone() for i in range(len(layers))]
            self.tokens = list(resume.tokens)
        self.same = SameInput()  # Σ_t a aᵀ of an input several layers read, taken once per batch

    def state(self, rows: int, generator: torch.Generator) -> PassState:
        """The :class:`PassState` after ``rows`` rows (on the CPU: :data:`OnBatch`)."""
        sums = {f"{i}/a": x.detach().cpu() for i, x in enumerate(self.a)}
        sums.update({f"{i}/s": x.detach().cpu() for i, x in enumerate(self.s)})
        return PassState(rows, sums, list(self.tokens), generator.get_state(), self.device.type)

    def take_input(self, use: Use, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        how = input_how(self.layers[use.layer], use)
        product, tokens, n = self.same.take(x, how, lambda: self._second_moment(use, x, output))
        self.a[use.layer] += product
        self.tokens[use.layer] += tokens
        return torch.empty(n, 0, device=x.device)

    def _second_moment(self, use: Use, x: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """``(Σ_t a aᵀ [d_in, d_in], tokens counted, rows)`` of one call."""
        layer = self.layers[use.layer]
        a = use.kind.layer_input(use.module, x, output, layer.d_in, layer.weight_cols, use.weight is not None,
                                 use.bias is not None, self.dtype)  # [b, T, d_in]: a_t itself
        rows = first_rows(self.inputs).shape[0]
        if a.shape[0] != rows:  # a batch-broadcast call (position embeddings): the same a_t in every example
            a = a.expand(rows, *a.shape[1:])
        mask = self.inputs.get("attention_mask") if isinstance(self.inputs, dict) else None
        if mask is not None and mask.dim() == 2 and mask.shape[1] == a.shape[1]:  # the call's positions are the tokens
            real = mask != 0  # [n, T]
            a = a * real.unsqueeze(-1).to(a)
            tokens = int(real.sum())
        else:
            tokens = a.shape[0] * a.shape[1]
        flat = a.reshape(-1, a.shape[-1])
        return flat.T @ flat, tokens, a.shape[0]

    def take_grad(self, use: Use, kept: torch.Tensor, g: torch.Tensor) -> None:
        gt = use.kind.out_grads(g, kept.shape[0]).to(self.dtype)  # [n, T, d_out]
        flat = gt.reshape(-1, gt.shape[-1])
        self.s[use.layer].addmm_(flat.T, flat)


class _Rotated:
    """Hook consumer of the EK-FAC pass: per example ``Q_Sᵀ G Q_A`` ``[n, d_out, d_in]``, squared and added to
    ``sums`` as its output gradient arrives (one layer at a time); a layer whose module runs more than once keeps
    its grid until :meth:`finish` (the square is of the sum over the calls)."""

    keeps_input = False

    def __init__(self, factors: Sequence[LayerFactors], layers: Sequence[KroneckerLayer], sums: list[torch.Tensor],
                 device: torch.device):
        self.layers, self.sums = layers, sums
        self.dtype = sums[0].dtype if sums else torch.float32
        self.q = [(f.q_out.to(device, self.dtype), f.q_in.to(device, self.dtype)) for f in factors]
        self.calls = [0] * len(layers)
        self.grids: dict[int, torch.Tensor] = {}
        self.same = SameInput()  # layers reading the same input in the same eigenbasis rotate it once

    def take_input(self, use: Use, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        self.calls[use.layer] += 1
        q_in = self.q[use.layer][1]
        cols = self.layers[use.layer].weight_cols
        p_w = q_in[:cols] if use.weight is not None else None
        p_b = q_in[cols] if use.bias is not None else None
        # [b, T, d_in]: Q_Aᵀ a_t (read, never changed, by each layer that shares it)
        return self.same.take(x, (*input_how(self.layers[use.layer], use), id(q_in)),
                              lambda: use.kind.project_input(use.module, x, output, p_w, p_b, self.dtype))

    def take_grad(self, use: Use, kept: torch.Tensor, g: torch.Tensor) -> None:
        gq = use.kind.out_grads(g, kept.shape[0]).to(self.dtype) @ self.q[use.layer][0]  # [n, T, d_out]
        grid = gq.transpose(1, 2) @ kept  # [n, d_out, d_in]
        if self.calls[use.layer] == 1:
            self.sums[use.layer] += grid.square().sum(0).cpu()
        else:
            self.grids[use.layer] = self.grids[use.layer] + grid if use.layer in self.grids else grid

    def finish(self) -> None:
        """Add the squares of the layers called more than once."""
        for j, grid in self.grids.items():
            self.sums[j] += grid.square().sum(0).cpu()
        self.grids = {}
        self.same.clear()


def factor_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the factors are accumulated and kept in: float64 for a float64 model (the closed-form tests),
    else float32 (as kronfluence keeps them: a language model's factors are gigabytes; each eigendecomposition
    runs in float64)."""
    p = next(model.parameters(), None)
    return torch.float64 if p is not None and p.dtype == torch.float64 else torch.float32


#: One batch of the fitting data: ``(model inputs on the device, labels or None)``.
Batch = tuple[Any, "torch.Tensor | None"]


def _hook_pass(model: nn.Module, uses: Sequence[Use], task: Task, inputs: Any, labels: torch.Tensor | None,
               consumer: Any, fisher: str, generator: torch.Generator | None) -> int:
    """One forward + backward of the Fisher loss over a batch through the hooks; returns its rows."""
    first = first_rows(inputs)
    n, device = first.shape[0], first.device
    with HookPass(model, uses, n, device, consumer) as hooks:
        logits = logits_of(model, inputs)
        batch = make_batch(inputs, labels)
        task.check(logits, batch)
        loss = fisher_loss(task, logits, batch, fisher, generator)
        if hooks.problem is None and loss.requires_grad:
            hooks.backward(loss.reshape(1))
        if hooks.problem is not None:
            raise GradientError(f"{hooks.problem.text}; curvature factors cannot be taken there: leave it out with "
                                "grad_wrt")
    return n


@dataclass
class PassState:
    """The running sums of a fitting pass over its first ``rows`` rows: what a resumed pass starts from.

    Saved at batch boundaries (:func:`fit_covariances`, :func:`correct_eigenvalues` hand one to ``on_batch``); a
    pass resumed from it skips the batches of those rows and adds the others to the sums as an uninterrupted
    pass would, so it ends with the same factors bit for bit.

    Attributes:
        rows: rows (examples) in the sums, the end of a batch.
        sums: the running sums on the CPU in :func:`factor_dtype`, by name: pass 1 ``<i>/a`` ``[d_in, d_in]``
            (``Σ_tokens a aᵀ``) and ``<i>/s`` ``[d_out, d_out]`` (``Σ_tokens g gᵀ``); pass 2 ``<i>/eig``
            ``[d_out, d_in]`` (``Σ_z (Q_Sᵀ G_z Q_A)²``).
        tokens: pass 1: per layer, the tokens counted in ``A``; pass 2: empty.
        rng: the label sampler's state after those rows (``torch.Generator.get_state()``, ``[k]`` uint8), or None.
        device: the type of the sampler's device (``cpu``, ``cuda``): a state resumes only on the same.
    """

    rows: int
    sums: dict[str, torch.Tensor]
    tokens: list[int]
    rng: torch.Tensor | None
    device: str


class ResumeMismatch(Exception):
    """A saved :class:`PassState` does not fit this pass's batches (another batching, device or data): a fresh pass."""


#: ``on_batch(lo, hi, state)``: called after the rows ``[lo, hi)`` of a pass are added; ``state()`` gives the
#: :class:`PassState` after them, made only when called: on the CPU, where a CPU pass's running sums are the
#: tensors themselves (no copy of gigabytes of factors per save), valid until the next batch is added.
OnBatch = Callable[[int, int, Callable[[], PassState]], None]


def _skip(batches: Iterable[Batch], resume: PassState | None) -> Iterator[tuple[int, Any, Any]]:
    """``(first row, inputs, labels)`` of the batches after ``resume.rows`` (all without ``resume``).

    Raises:
        ResumeMismatch: a batch straddles ``resume.rows``, or there are fewer rows.
    """
    rows, want = 0, resume.rows if resume is not None else 0
    for inputs, labels in batches:
        n = first_rows(inputs).shape[0]
        if rows < want:
            rows += n
            if rows > want:
                raise ResumeMismatch(f"a batch ends at row {rows}, the saved sums at row {want}")
            continue
        yield rows, inputs, labels
        rows += n
    if rows < want:
        raise ResumeMismatch(f"{rows} rows, the saved sums hold {want}")


def _sampler(device: torch.device, seed: int, resume: PassState | None) -> torch.Generator:
    """The label sampler of a pass: seeded, or at the saved state of ``resume``."""
    generator = torch.Generator(device=device).manual_seed(seed)
    if resume is not None and resume.rng is not None:
        if resume.device != device.type:
            raise ResumeMismatch(f"the saved sampler ran on {resume.device}, this pass on {device.type}")
        generator.set_state(resume.rng)
    return generator


def fit_covariances(model: nn.Module, layers: Sequence[KroneckerLayer], uses: Sequence[Use], task: Task,
                    batches: Iterable[Batch], fisher: str = "true", seed: int = 0,
                    resume: PassState | None = None, on_batch: OnBatch | None = None
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Pass 1: the Kronecker factors ``A`` (per token) and ``S`` (per example) of every layer.

    Args:
        model: the model, loaded with the checkpoint (switched to eval mode).
        layers, uses: from :func:`curvature_layers`.
        task: the model output function (its :meth:`~trakcli.tasks.Task.loss` is differentiated).
        batches: the fitting data, ``(inputs, labels)`` on the model's device, the same batches on every call.
        fisher: ``true`` (sampled labels) or ``empirical``.
        seed: seed of the label sampling.
        resume: the sums of an interrupted pass over the first batches (those are skipped, not computed).
        on_batch: called after each batch computed (:data:`OnBatch`), e.g. to save the sums.

    Returns:
        ``(A, S)``: per layer ``[d_in, d_in]`` and ``[d_out, d_out]`` on the CPU, in :func:`factor_dtype`
        (module docstring: ``A = Σ a aᵀ / N_tokens``, ``S = Σ g gᵀ / N_examples``).

    Raises:
        DataError: no rows, or data the model or task refuses.
        GradientError: a module whose calls cannot give per-example factors.
        ResumeMismatch: ``resume`` does not fit the batches (its rows end inside a batch, another device).
    """
    model.eval()
    dtype = factor_dtype(model)
    generator, acc, n_examples = None, None, resume.rows if resume is not None else 0
    for lo, inputs, labels in _skip(batches, resume):
        device = first_rows(inputs).device
        if acc is None:
            acc = _Covariances(layers, device, dtype, resume)
            generator = _sampler(device, seed, resume)
        acc.inputs = inputs
        acc.same.clear()
        n_examples += _hook_pass(model, uses, task, inputs, labels, acc, fisher, generator)
        if on_batch is not None:
            on_batch(lo, n_examples, lambda: acc.state(n_examples, generator))
    if n_examples == 0:
        raise DataError("curvature: no training rows to fit the factors on")
    if acc is None:  # every row was in the saved sums
        acc = _Covariances(layers, torch.device("cpu"), dtype, resume)
    return [x.cpu() / max(1, t) for x, t in zip(acc.a, acc.tokens)], [x.cpu() / n_examples for x in acc.s]


def eigenbases(layers: Sequence[KroneckerLayer], a: Sequence[torch.Tensor], s: Sequence[torch.Tensor],
               decompose: bool = True) -> list[LayerFactors]:
    """K-FAC per layer: eigendecompositions of ``A`` and ``S`` (in float64) and ``Λ = λ_S λ_Aᵀ`` (eigenvalues
    clamped at 0). A factor equal to one decomposed already (layers that read the same input, as a
    transformer's query, key and value projections do) reuses that decomposition.

    With ``decompose`` False: the standard basis and each factor's diagonal, no decomposition (a trial of the
    passes and features, :meth:`trakcli.jobs.setup.JobSetup.check_curvature`: a language model's hundreds of
    decompositions take minutes).
    """
    done: dict[tuple[Any, ...], list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]] = {}
    eyes: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}  # one per size: bases are only read

    def eigh(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not decompose:
            key = (m.shape[0], m.dtype, m.device)
            if key not in eyes:
                eyes[key] = torch.eye(m.shape[0], dtype=m.dtype, device=m.device)
            return m.diagonal().double(), eyes[key]
        key = (tuple(m.shape), float(m.diagonal().sum()), float(m[0].sum()))  # equal matrices, equal keys
        for seen, result in done.get(key, []):
            if torch.equal(seen, m):
                return result
        values, vectors = torch.linalg.eigh(m.double())
        result = (values, vectors.to(m.dtype).contiguous())
        done.setdefault(key, []).append((m, result))
        return result

    out = []
    for layer, a_i, s_i in zip(layers, a, s):
        la, qa = eigh(a_i)
        ls, qs = eigh(s_i)
        eig = ls.clamp(min=0)[:, None] * la.clamp(min=0)[None, :]
        out.append(LayerFactors(layer.name, qs, qa, eig.to(a_i.dtype)))
    return out


def correct_eigenvalues(model: nn.Module, layers: Sequence[KroneckerLayer], uses: Sequence[Use], task: Task,
                        factors: Sequence[LayerFactors], batches: Iterable[Batch], fisher: str = "true",
                        seed: int = 1, resume: PassState | None = None, on_batch: OnBatch | None = None
                        ) -> list[LayerFactors]:
    """Pass 2 of EK-FAC: ``Λ = E_z[(Q_Sᵀ G_z Q_A)²]`` over the examples, in the K-FAC eigenbases.

    Args:
        As :func:`fit_covariances`; ``factors`` the K-FAC eigenbases (:func:`eigenbases`); ``resume`` holds
        the sums ``<i>/eig``.

    Returns:
        New :class:`LayerFactors` with the same eigenvectors and corrected ``eig``.

    Raises:
        As :func:`fit_covariances`.
    """
    model.eval()
    sums = [resume.sums[f"{i}/eig"].clone() if resume is not None else torch.zeros_like(f.eig)
            for i, f in enumerate(factors)]
    generator, n_examples = None, resume.rows if resume is not None else 0
    for lo, inputs, labels in _skip(batches, resume):
        device = first_rows(inputs).device
        if generator is None:
            generator = _sampler(device, seed, resume)
        rot = _Rotated(factors, layers, sums, device)
        n_examples += _hook_pass(model, uses, task, inputs, labels, rot, fisher, generator)
        rot.finish()
        if on_batch is not None:
            on_batch(lo, n_examples, lambda: PassState(n_examples, {f"{i}/eig": x for i, x in enumerate(sums)}, [],
                                                       generator.get_state(), device.type))
    if n_examples == 0:
        raise DataError("curvature: no training rows to fit the factors on")
    return [LayerFactors(f.name, f.q_out, f.q_in, acc / n_examples) for f, acc in zip(factors, sums)]
