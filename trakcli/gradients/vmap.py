"""Per-example gradients of the model output function, with torch.func.

The model output function ``f`` and out-to-loss term ``Q`` are the task's (:mod:`trakcli.tasks`: the classification
margin, the language-modeling margin over target tokens, or a user's function of the logits and the whole batch).
Gradients are ``vmap(grad(f))`` over the batch with ``torch.func.functional_call``; only the parameters selected by
``grad_wrt`` are differentiated, the rest (and the buffers) are passed as constants. The model is put in eval mode, so
dropout and batch-norm statistics are fixed.

Gradients are returned per parameter, as a dict of named tensors, so that a projector can consume them chunk by chunk.
The same gradients from layer hooks are :class:`trakcli.gradients.LayerGradients`; ``gradient_method`` chooses
(:func:`trakcli.gradients.per_example_gradients`).
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import re
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from trakcli.errors import ConfigError, GradientError, user_code
from trakcli.models.build import model_name
from trakcli.models.forward import forward_errors
from trakcli.models.peft import is_peft_model
from trakcli.tasks import check_by_first, is_builtin, make_batch, resolve_task

#: How to fix a forward pass that runs on a batch but not under ``torch.func.vmap`` (per-example gradients).
VMAP_HINT = ("per-example gradients run the forward pass of one example under torch.func.vmap, which refuses Python "
             "control flow on tensor values (if x.sum() > 0), .item() and in-place changes of the inputs; write those "
             "with torch.where / masks, or use projector.kind kronecker (no vmap)")

def select_parameters(model: nn.Module, grad_wrt: list[str] | None) -> list[str]:
    """Names of the parameters to differentiate, in ``model.named_parameters()`` order.

    Args:
        model: the model.
        grad_wrt: ``fnmatch`` patterns (``"2.*"``, ``"*.weight"``); ``None`` selects all, or for a
            PEFT model (adapter checkpoints, :mod:`trakcli.models.peft`) the adapter's trainable parameters.

    Raises:
        ConfigError: a pattern that matches no parameter (:func:`unmatched_problems`: the pattern that
            would match, and every parameter name, grouped), or a selection that is empty.
    """
    names = [n for n, p in model.named_parameters()]
    if grad_wrt is None:
        selected = names
        if is_peft_model(model):  # its adapter's parameters (the base model's are frozen)
            trainable = set(getattr(model, "trak_trainable", None) or
                            [n for n, p in model.named_parameters() if p.requires_grad])
            selected = [n for n in names if n in trainable]
            if not selected:
                raise ConfigError("grad_wrt: the PEFT model has no trainable parameter to differentiate (loaded for "
                                  "inference); load it with peft.PeftModel.from_pretrained(base, folder, "
                                  "is_trainable=True), or name the parameters with grad_wrt (e.g. ['*lora_*'])")
    else:
        unmatched = [pat for pat in grad_wrt if not any(fnmatch.fnmatchcase(n, pat) for n in names)]
        if unmatched:
            raise ConfigError(unmatched_problems(unmatched, names))
        selected = [n for n in names if any(fnmatch.fnmatchcase(n, pat) for pat in grad_wrt)]
    if not selected:
        raise ConfigError("grad_wrt: no parameter selected; the model has no parameters to differentiate")
    return selected


#: A model with at most this many parameters has each named in a ``grad_wrt`` error; more are grouped
#: (:func:`group_names`).
LISTED_PARAMETERS = 12

#: A whole dotted part of a parameter name that is an index (``layers.28.``, ``0.weight``).
_INDEX = re.compile(r"0|[1-9][0-9]*")


def _slot(values: list[int]) -> str:
    """An index part of a group of names: ``[4]`` -> ``"4"``; ``[0, 1, 2, 3, 5, 7, 8]`` -> ``"{0..3,5,7,8}"`` (runs of
    three or more as ``a..b``)."""
    if len(values) == 1:
        return str(values[0])
    runs = [[v for _, v in run] for _, run in itertools.groupby(enumerate(values), lambda p: p[1] - p[0])]
    return "{" + ",".join(f"{r[0]}..{r[-1]}" if len(r) >= 3 else ",".join(map(str, r)) for r in runs) + "}"


def group_names(names: list[str]) -> list[str]:
    """Parameter names with their index parts collapsed, one line per kind of parameter, in first-seen order.

    ``model.layers.0.self_attn.q_proj.weight`` ... ``model.layers.29.self_attn.q_proj.weight`` become
    ``model.layers.{0..29}.self_attn.q_proj.weight``; a name with several index parts that do not form
    a full grid says how many names it stands for (``blocks.{0,1}.mlp.{0,2}.weight (3)``). A name alone
    in its group is shown as it is. Nothing is left out: every name is in exactly one line.
    """
    groups: dict[tuple[str | None, ...], list[tuple[int, ...]]] = {}
    for name in names:
        parts = name.split(".")
        key = tuple(None if _INDEX.fullmatch(p) else p for p in parts)
        groups.setdefault(key, []).append(tuple(int(p) for p in parts if _INDEX.fullmatch(p)))
    lines = []
    for key, indices in groups.items():
        per_slot = [sorted({ix[k] for ix in indices}) for k in range(len(indices[0]))]
        slots = iter(per_slot)
        parts = [p if p is not None else _slot(next(slots)) for p in key]
        grid = math.prod(len(values) for values in per_slot)
        lines.append(".".join(parts) + (f" ({len(indices)})" if grid != len(indices) else ""))
    return lines


def _did_you_mean(pattern: str, names: list[str]) -> tuple[str, int] | None:
    """The pattern nearest ``pattern`` that matches a parameter (a trailing ``.*`` or ``*``, a leading ``*``,
    as a name ending in ``.weight`` or a PEFT model's ``base_model.model.`` prefix needs) and how many it matches."""
    for candidate in (f"{pattern}.*", f"{pattern}*", f"*{pattern}", f"*{pattern}.*", f"*{pattern}*"):
        if "**" in candidate or candidate == pattern:
            continue
        n = sum(fnmatch.fnmatchcase(name, candidate) for name in names)
        if n:
            return candidate, n
    return None


def unmatched_problems(unmatched: list[str], names: list[str]) -> list[str]:
    """The lines of a ``grad_wrt`` error: per pattern that matches no parameter, the pattern that would
    (:func:`_did_you_mean`); after the last, every parameter name of the model (grouped past
    :data:`LISTED_PARAMETERS`, :func:`group_names`), never a cut-off list.

    Args:
        unmatched: the ``grad_wrt`` patterns that match no parameter.
        names: every parameter name of the model, in ``named_parameters()`` order.
    """
    problems = []
    for pat in unmatched:
        line = f"grad_wrt: pattern {pat!r} matches no parameter"
        near = _did_you_mean(pat, names)
        if near is not None:
            fix, n = near
            line += f"; did you mean {fix!r}? it matches {n} parameter{'s' if n != 1 else ''}"
        problems.append(line)
    if len(names) <= LISTED_PARAMETERS:
        problems[-1] += f"; the model's parameters are: {', '.join(names)}"
    else:
        grouped = group_names(names)
        problems[-1] += (f"; the model's {len(names)} parameters, in {len(grouped)} groups (index parts "
                         "collapsed):" + "".join(f"\n      {line}" for line in grouped))
    return problems


def selected_shapes(model: nn.Module, grad_wrt: list[str] | None) -> tuple[list[str], dict[str, tuple[int, ...]], int]:
    """``(param_names, param_shapes, grad_dim)`` of ``model``: the names of :func:`select_parameters` (which
    raises ConfigError), each one's shape and the total number of entries."""
    names = select_parameters(model, grad_wrt)
    params = dict(model.named_parameters())
    shapes = {n: tuple(params[n].shape) for n in names}
    return names, shapes, int(sum(params[n].numel() for n in names))


def split_parameters(model: nn.Module, names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(params, constants)`` for ``functional_call``: the detached parameters ``names``, and every other
    parameter and buffer, detached."""
    chosen = set(names)
    params = {n: p.detach() for n, p in model.named_parameters() if n in chosen}
    const = {n: p.detach() for n, p in model.named_parameters() if n not in chosen}
    const.update({n: b.detach() for n, b in model.named_buffers()})
    return params, const


def functional_logits(model: nn.Module, params: dict[str, torch.Tensor], x) -> torch.Tensor:
    """Logits of a batch through ``functional_call``: a tensor input, or a dict (transformers)."""
    if isinstance(x, dict):
        from trakcli.models.forward import logits_of, model_kwargs

        return logits_of(functional_call(model, params, args=(), kwargs=model_kwargs(model, x)))
    return functional_call(model, params, (x,))


class PerExampleGradients:
    """Computes ``∇_θ f(z; θ)`` for each example of a batch, and ``Q(z)``.

    Args:
        model: the model; it is switched to eval mode.
        grad_wrt: parameter name patterns (see :func:`select_parameters`).
        task: the model output function (:func:`trakcli.tasks.resolve_task`: a built-in name,
            a ``"file.py:fn"`` spec, a callable ``fn(logits, batch)`` or a :class:`~trakcli.tasks.Task`).

    Attributes:
        param_names: the differentiated parameters, in order.
        param_shapes: their shapes.
        grad_dim: total number of differentiated entries.
        method: ``"vmap"`` (:class:`trakcli.gradients.LayerGradients` has ``"hooks"``).
        reason: why vmap was chosen over layer hooks (set by :func:`trakcli.gradients.per_example_gradients`
            under ``gradient_method: auto``), for the caller to report once; None otherwise.
    """

    method = "vmap"
    reason: str | None = None

    def __init__(self, model: nn.Module, grad_wrt: list[str] | None = None, task: Any = "classification"):
        self.task, self.model = resolve_task(task), model.eval()
        self.param_names, self.param_shapes, self.grad_dim = selected_shapes(model, grad_wrt)

    def __call__(self, inputs, labels: torch.Tensor | None, row_offset: int = 0
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Per-example gradients of the model output function and the out-to-loss terms of a batch.

        Args:
            inputs: ``[n, ...]`` model inputs on the model's device, or a dict of
                ``[n, L]`` tensors (``input_ids``, ``attention_mask``) for a transformers model.
            labels: ``[n]`` int64 class indices, ``[n, L]`` per-token labels (``-100``: not a target),
                or None; the task reads them from its batch (:func:`trakcli.tasks.make_batch`).
            row_offset: dataset index of the batch's first row (for error messages).

        Returns:
            ``(grads, out_to_loss)``: ``grads[name]`` is ``[n, *param.shape]``
            in the parameter's dtype; ``out_to_loss`` is ``[n]`` float32.

        Raises:
            DataError: inputs of a shape the model cannot take (any exception of one plain
                forward pass, named with the user's file and line), or labels the task refuses.
            GradientError: the forward pass runs on the batch but fails under ``torch.func.vmap``
                (names the file and line, and :data:`VMAP_HINT`).
        """
        params, const = split_parameters(self.model, self.param_names)
        model, task = self.model, self.task

        def f(p: dict[str, torch.Tensor], x, y):
            one = {k: v.unsqueeze(0) for k, v in x.items()} if isinstance(x, dict) else x.unsqueeze(0)
            logits = functional_logits(model, {**p, **const}, one)
            margin, q = task(logits, make_batch(one, None if y is None else y.unsqueeze(0)))
            return margin.reshape(()), q.detach().reshape(())

        self._check_batch(inputs, labels, params, const, row_offset)
        of_task = "" if is_builtin(task) else f" and task {task.name}"
        what = lambda: f"per-example gradients (torch.func.vmap) of the forward pass of {model_name(model)}{of_task}"  # noqa: E731
        with user_code(what, hint=VMAP_HINT, error=GradientError):
            grads, q = vmap(grad(f, has_aux=True), in_dims=(None, 0, None if labels is None else 0))(
                params, inputs, labels)
        if not is_builtin(task):  # a built-in Q is finite where the features are
            check_finite(q, row_offset, what=f"out-to-loss terms Q of task {task.name}")
        return grads, q.to(torch.float32)

    def _check_batch(self, inputs, labels, params, const, row_offset: int) -> None:
        """One plain forward pass of the first example, for clear messages on shapes and labels."""
        first = {k: v[:1] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[:1]
        with torch.no_grad(), forward_errors(self.model, inputs):
            logits = functional_logits(self.model, {**params, **const}, first)
        check_by_first(self.task, logits, inputs, labels, row_offset)

    def flatten(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        """Concatenate per-parameter gradients into ``[n, grad_dim]`` (in ``param_names`` order)."""
        return torch.cat([grads[n].reshape(grads[n].shape[0], -1) for n in self.param_names], dim=1)


def check_finite(rows: torch.Tensor, row_offset: int, what: str = "gradients") -> None:
    """Raise if any example's row has NaN or inf entries (called on the projected features rather than on the
    gradients: a non-finite gradient entry makes its features non-finite, at O(proj_dim) per example).

    Args:
        rows: ``[n, ...]`` per-example values (features or gradients).
        row_offset: dataset index of the first row.
        what: what the rows are, for the message.

    Raises:
        GradientError: naming the (global) indices of the offending examples.
    """
    bad = ~torch.isfinite(rows.reshape(rows.shape[0], -1)).all(dim=1)
    if bad.any():
        rows = (torch.nonzero(bad).flatten() + row_offset).tolist()
        raise GradientError(f"non-finite {what} for examples {rows[:10]}{' ...' if len(rows) > 10 else ''}; "
                            "check those inputs and the checkpoint for NaN/inf values")
