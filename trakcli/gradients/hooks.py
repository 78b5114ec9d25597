"""One forward + backward with hooks on the covered modules: each call's input ``a`` and output gradient ``g``.

Exact per-example gradients (:class:`trakcli.gradients.LayerGradients`), Kronecker-projected ones
(:class:`trakcli.gradients.KroneckerFeaturizer`) and the curvature passes are sums over a module's calls and
positions of terms in ``(a_t, g_t)`` (Goodfellow 2015; Choe et al. 2024, Sec. 3). A :class:`HookPass` gets
them from ONE ordinary batched forward and ONE backward of ``Σ_i f_i``: a forward hook hands each call's
input to :meth:`Consumer.take_input`, which keeps what it needs, and a tensor hook on the call's output hands
``g = ∂(Σ_i f_i)/∂y`` (row ``i`` is example ``i``'s own when examples do not interact, eval mode) with what
was kept to :meth:`Consumer.take_grad`, which accumulates over calls.

A module run on a batch-broadcast input (BERT's and GPT-2's position embeddings see ``position_ids [1, T]``) has its
output, and what was kept, expanded to the batch inside the hook, so each example receives its own gradient; this is
exact when that output is broadcast against per-example tensors, and a pass in which only the first example's copy
receives a gradient is a :class:`Problem`. During the pass no parameter requires grad (unless asked for), so no weight
gradient is computed; an anchor tensor gives every hooked output a gradient path.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterator, Protocol, Sequence

import torch
from torch import nn

from trakcli.gradients.layers import Use
from trakcli.models.forward import forward, forward_errors

#: A batch's model inputs: ``[n, ...]``, or a dict of ``[n, L]`` tensors (transformers models).
Inputs = Any


def first_rows(inputs: Inputs) -> torch.Tensor:
    """The tensor whose first dim is the batch's rows: ``input_ids`` of a dict (else its first value), or ``inputs``."""
    if isinstance(inputs, dict):
        return inputs["input_ids"] if "input_ids" in inputs else next(iter(inputs.values()))
    return inputs


def batch_rows(inputs: Inputs, labels: torch.Tensor | None, rows: slice) -> tuple[Inputs, torch.Tensor | None]:
    """``(inputs[rows], labels[rows])`` of a batch (every tensor of a dict; labels may be None)."""
    part = {k: v[rows] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[rows]
    return part, None if labels is None else labels[rows]


def logits_of(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    """The model's logits on detached inputs (:func:`trakcli.models.forward.forward`: for a transformers model
    the 4-D additive mask, eager attention), its exceptions reported as one ``DataError`` line."""
    with forward_errors(model, inputs):
        return forward(model, {k: v.detach() for k, v in inputs.items()} if isinstance(inputs, dict)
                       else inputs.detach())


@dataclass(frozen=True)
class Problem:
    """Why the hooks cannot give per-example terms in this pass.

    Attributes:
        code: ``input`` (a call without a tensor input), ``batch`` (a call whose input or output
            does not have the batch first), ``in_place`` (a kept input changed after the call) or
            ``broadcast`` (only the first row of a broadcast output received a gradient).
        text: the message, naming the module.
    """

    code: str
    text: str


class Consumer(Protocol):
    """What a :class:`HookPass` hands each call to; ``keeps_input``: :meth:`take_input` keeps the input itself,
    so a change made to it in place after the call (which the backward would read) is a :class:`Problem`."""

    keeps_input: bool

    def take_input(self, use: Use, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """What to keep of one call: a tensor ``[b, ...]`` (``b`` the call's batch dimension, ``n`` or 1),
        given the call's detached input ``x`` ``[b, ...]`` and its output."""

    def take_grad(self, use: Use, kept: torch.Tensor, g: torch.Tensor) -> None:
        """One call's output gradient ``g`` ``[n, ...]`` (the output's shape) with what was kept ``[n, ...]``."""


@contextmanager
def grad_flags(model: nn.Module, chosen: Sequence[torch.Tensor] = ()) -> Iterator[None]:
    """Grad mode on; only the parameters in ``chosen`` require grad; the flags are restored after."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)  # output gradients only: no weight gradient is computed
        for p in chosen:
            p.requires_grad_(True)
        with torch.enable_grad():
            yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


class HookPass:
    """Hooks on the covered modules for one forward + backward of a batch of ``n`` rows (a context manager).

    ``with HookPass(model, uses, n, device, consumer) as hooks: f = task(model(x)); hooks.backward(f)``.

    Args:
        model: the model (its parameters' ``requires_grad`` flags are set for the pass and restored).
        uses: the covered module calls (:func:`trakcli.gradients.layers.find_uses`).
        n: rows of the batch.
        device: the batch's device.
        consumer: receives each call (:class:`Consumer`).
        chosen: parameters that require grad during the pass (a batch gradient alongside).

    Attributes:
        calls: per use, how many times its module ran.
        problem: the first :class:`Problem` seen (the hooks do nothing more once one is seen), or None.
        nbytes: bytes held for the backward: inputs, outputs and their gradients, and what was kept.
        anchor: ``[]`` float32 tensor that requires grad, added to outputs that would have no gradient path.
    """

    def __init__(self, model: nn.Module, uses: Sequence[Use], n: int, device: torch.device, consumer: Consumer,
                 chosen: Sequence[torch.Tensor] = ()):
        self.model, self.uses, self.n, self.consumer, self.chosen = model, list(uses), n, consumer, list(chosen)
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        self.calls = [0] * len(self.uses)
        self.problem: Problem | None = None
        self.nbytes = 0
        self._kept: list[tuple[torch.Tensor, int] | None] = []
        self._stack = ExitStack()

    def __enter__(self) -> HookPass:
        with ExitStack() as stack:
            stack.enter_context(grad_flags(self.model, self.chosen))
            for i, use in enumerate(self.uses):
                hook = partial(self._forward_hook, i)
                stack.callback(use.module.register_forward_hook(hook, with_kwargs=True).remove)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def backward(self, f: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """Backward of ``f.sum()`` (``f`` ``[n]``) through the hooks; returns the gradients of ``chosen`` (None if unused)."""
        return torch.autograd.grad(f.sum(), [self.anchor, *self.chosen], allow_unused=True)[1:]

    def _forward_hook(self, i: int, module: nn.Module, args, kwargs, output):
        if self.problem is not None:
            return None
        use = self.uses[i]
        x = args[0] if args else kwargs.get("input", kwargs.get("hidden_states"))
        if not torch.is_tensor(x) or not torch.is_tensor(output) or x.dim() == 0:
            self.problem = Problem("input", f"module {use.name} was called without a tensor input")
            return None
        self.calls[i] += 1
        b, n = x.shape[0], self.n
        if b not in (n, 1) or output.dim() == 0 or output.shape[0] != b:
            self.problem = Problem("batch", f"module {use.name} ran on a tensor of batch dimension {b} (output "
                                            f"{list(output.shape)}) in a batch of {n} rows")
            return None
        if not torch.is_grad_enabled():
            return None  # run under no_grad: no gradient reaches its parameters
        kept = self.consumer.take_input(use, x.detach(), output)
        broadcast = b == 1 and n > 1
        if broadcast:
            kept, output = kept.expand(n, *kept.shape[1:]), output.expand(n, *output.shape[1:])
        out = output if output.requires_grad and not broadcast else output + self.anchor
        self._kept.append((kept, x._version))
        out.register_hook(partial(self._grad_hook, use, len(self._kept) - 1, broadcast))
        self.nbytes += x.numel() * x.element_size() * (n if broadcast else 1)
        self.nbytes += 2 * out.numel() * out.element_size() + kept.numel() * kept.element_size()
        return out

    def _grad_hook(self, use: Use, slot: int, broadcast: bool, g: torch.Tensor) -> None:
        (kept, version), self._kept[slot] = self._kept[slot], None  # type: ignore[misc]
        if self.problem is not None:
            return
        if self.consumer.keeps_input and kept._version != version:
            self.problem = Problem("in_place", f"the input of module {use.name} was changed in place after the "
                                               "module ran")
            return
        if broadcast and not bool(g[1:].any()) and bool(g[0].any()):
            self.problem = Problem("broadcast", f"module {use.name} ran on a batch-broadcast input and only the first "
                                                "row of its output received a gradient")
            return
        self.consumer.take_grad(use, kept, g)
