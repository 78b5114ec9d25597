"""Per-example gradients of the model output function, with torch.func.

For classification (Park et al. 2023, TRAK, Sec. 3 and App. E) the model output
function of an example ``z = (x, y)`` is the margin

    f(z; θ) = logit_y − logsumexp_{j≠y} logit_j  = log(p_y / (1 − p_y)),

and the out-to-loss term is ``Q(z) = 1 − p_y`` (``∂loss/∂f`` for the
cross-entropy loss). Gradients are ``vmap(grad(f))`` over the batch with
``torch.func.functional_call``; only the parameters selected by ``grad_wrt``
are differentiated, the rest (and the buffers) are passed as constants. The
model is put in eval mode, so dropout and batch-norm statistics are fixed.

For text (``task: text_classification``) the inputs of an example are a dict
``{"input_ids": [L], "attention_mask": [L]}`` and the margin is taken over the
sequence's logits of a transformers model (called as in :mod:`trakcli.models.forward`).
For causal language models (``task: language_modeling``) the output function
of a text ``x_1..x_L`` sums the margins of its next-token predictions,

    f(z; θ) = Σ_{t<L, x_{t+1} not padding} [logit_t(x_{t+1}) − logsumexp_{j≠x_{t+1}} logit_t(j)],

and the out-to-loss term is the mean over those tokens of ``1 − p_t(x_{t+1})``
(for a single token it is the classification case; Park et al. 2023 App. E).

Gradients are returned per parameter, as a dict of named tensors, so that a
projector can consume them chunk by chunk (and so that factored projections
can plug in later). The same gradients from layer hooks, one ordinary batched
forward + backward without torch.func (whose first call imports torch._dynamo,
1-3 s), are :class:`trakcli.factors.LayerGradients`; ``gradient_method`` chooses
(:func:`trakcli.factors.per_example_gradients`).
"""

from __future__ import annotations

import fnmatch
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from trakcli.errors import ConfigError, DataError, GradientError, user_code
from trakcli.models.build import load_function, model_name
from trakcli.models.checkpoints import file_sha256
from trakcli.models.forward import forward_errors

#: How to fix a forward pass that runs on a batch but not under ``torch.func.vmap`` (per-example gradients).
VMAP_HINT = (
    "per-example gradients run the forward pass of one example under torch.func.vmap, which refuses "
    "Python control flow on tensor values (if x.sum() > 0), .item() and in-place changes of the inputs; "
    "write those with torch.where / masks, or use projector.kind kronecker (no vmap)"
)

TASKS = ("classification", "text_classification", "language_modeling")

#: What the store records as ``output_function`` for each task.
OUTPUT_FUNCTIONS = {
    "classification": "margin: logit_y - logsumexp_{j!=y} logit_j; out_to_loss 1 - p_y",
    "text_classification": "margin of the sequence logits: logit_y - logsumexp_{j!=y} logit_j; out_to_loss 1 - p_y",
    "language_modeling": "sum over tokens t of logit_t(x_{t+1}) - logsumexp_{j!=x_{t+1}} logit_t(j); "
    "out_to_loss mean over tokens of 1 - p_t(x_{t+1})",
}


@dataclass(frozen=True)
class CustomOutput:
    """A user's model output function ``fn(logits, labels) -> (f [n], Q [n])`` (``task:`` a spec or a callable).

    ``f`` is what TRAK attributes and differentiates, ``Q`` the out-to-loss term
    (``∂loss/∂f``; for the built-in classification margin ``1 - p_y``). Both are
    row-wise: row ``i`` depends only on ``logits[i]`` and ``labels[i]`` (the
    per-example gradients call ``fn`` on one example at a time, ``n = 1``,
    under ``torch.func.vmap``, so no data-dependent indexing such as
    ``logits[range(n), labels]``: use masks, see :func:`classification_margin`).

    Attributes:
        fn: the function.
        spec: ``"file.py:fn"`` / ``"pkg.mod:fn"`` as configured, or ``"module:qualname"`` of a callable.
        file, sha256: the source file of ``fn`` and its sha256 (None when it has no file), recorded
            in the store identity so that a changed function is refused.
    """

    fn: Callable[[torch.Tensor, torch.Tensor], Any]
    spec: str
    file: str | None
    sha256: str | None

    @classmethod
    def of(cls, fn: Callable[..., Any], spec: str | None = None) -> "CustomOutput":
        """Wrap ``fn``, reading its source file and that file's sha256."""
        try:
            file = inspect.getsourcefile(fn)
        except TypeError:
            file = None
        name = spec or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
        sha = file_sha256(file) if file is not None and Path(file).is_file() else None
        return cls(fn, name, file, sha)

    def identity(self) -> dict[str, Any]:
        """What the store records as ``output_function``: the spec, its file and the file's sha256."""
        return {"function": self.spec, "file": self.file, "sha256": self.sha256}

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``fn`` on ``logits [n, ...]`` and ``labels [n]``; on one example under vmap (``labels []``),
        called with ``labels [1]`` and its ``(f [1], Q [1])`` returned as scalars."""
        if labels.ndim == 0:
            f, q = self.fn(logits, labels.reshape(1))
            return f.reshape(()), q.reshape(())
        return self.fn(logits, labels)


#: A task: a built-in name of :data:`TASKS` or a user's output function.
Task = Union[str, CustomOutput]


def resolve_task(task: str | Callable[..., Any] | CustomOutput) -> Task:
    """The task as the featurizers use it: a built-in name, or a :class:`CustomOutput`.

    Args:
        task: a name of :data:`TASKS`, ``"path/to/file.py:fn"`` or ``"pkg.module:fn"``
            (imported like ``model.entrypoint``), or a callable ``fn(logits, labels) -> (f, Q)``.

    Raises:
        ConfigError: an unknown name that is not a function spec.
        ModelError: the file or module cannot be imported or has no such function.
    """
    if isinstance(task, CustomOutput):
        return task
    if callable(task):
        return CustomOutput.of(task)
    if task in TASKS:
        return task
    if ":" not in str(task):
        raise ConfigError(
            f"task: {task!r} is not supported; use one of {', '.join(TASKS)}, or your own output function "
            'as "path/to/file.py:fn" or "package.module:fn" (README "Custom model outputs")'
        )
    return CustomOutput.of(load_function(task, key="task", builtins={}), spec=task)


def task_identity(task: str | Callable[..., Any] | CustomOutput) -> dict[str, Any]:
    """``{"task", "output_function"}`` of a store identity: the name and formula of a built-in task, or a
    custom function's spec with its file's sha256 (:meth:`CustomOutput.identity`)."""
    t = resolve_task(task)
    if isinstance(t, CustomOutput):
        return {"task": t.spec, "output_function": t.identity()}
    return {"task": t, "output_function": OUTPUT_FUNCTIONS[t]}


def check_custom_output(task: CustomOutput, logits: torch.Tensor, labels: torch.Tensor, row_offset: int = 0) -> None:
    """Call a custom output function on a batch and refuse results of the wrong shape or not finite.

    Args:
        task: the function.
        logits: ``[n, ...]`` the model's logits of a batch.
        labels: ``[n]`` the batch's labels.
        row_offset: index of the batch's first example (for messages).

    Raises:
        DataError: ``fn`` raised (its file and line), did not return a pair of tensors of shape
            ``[n]``, or returned NaN / inf (naming the first examples).
    """
    n = logits.shape[0]
    with user_code(lambda: f"task {task.spec}", error=DataError):
        out = task.fn(logits, labels[:n])
    shapes = [list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in out] if isinstance(
        out, (tuple, list)) else type(out).__name__
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
            and all(tuple(t.shape) == (n,) for t in out)):
        raise DataError(
            f"task {task.spec} must return (f, Q), two tensors of shape [n] (one value per example); for logits "
            f"{list(logits.shape)} and labels [{n}] it returned {shapes}; reduce over every dimension but the first "
            '(README "Custom model outputs")'
        )
    for name, t in zip(("f", "Q"), out):
        bad = ~torch.isfinite(t.detach())
        if bad.any():
            rows = (torch.nonzero(bad).flatten()[:5] + row_offset).tolist()
            raise DataError(
                f"task {task.spec} returned non-finite {name} for examples {rows}; "
                "compute it stably (e.g. torch.logsumexp, torch.sigmoid) and check those inputs"
            )


def select_parameters(model: nn.Module, grad_wrt: list[str] | None) -> list[str]:
    """Names of the parameters to differentiate, in ``model.named_parameters()`` order.

    Args:
        model: the model.
        grad_wrt: ``fnmatch`` patterns (``"2.*"``, ``"*.weight"``); ``None`` selects all.

    Raises:
        ConfigError: a pattern that matches no parameter (names the parameters),
            or a selection that is empty.
    """
    names = [n for n, p in model.named_parameters()]
    if grad_wrt is None:
        selected = names
    else:
        unmatched = [pat for pat in grad_wrt if not any(fnmatch.fnmatchcase(n, pat) for n in names)]
        if unmatched:
            shown = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "")
            raise ConfigError(
                [f"grad_wrt: pattern {pat!r} matches no parameter; the model's parameters are: {shown}" for pat in unmatched]
            )
        selected = [n for n in names if any(fnmatch.fnmatchcase(n, pat) for pat in grad_wrt)]
    if not selected:
        raise ConfigError("grad_wrt: no parameter selected; the model has no parameters to differentiate")
    return selected


def selected_shapes(model: nn.Module, grad_wrt: list[str] | None) -> tuple[list[str], dict[str, tuple[int, ...]], int]:
    """The differentiated parameters of ``model``: names (:func:`select_parameters`), shapes and ``grad_dim``.

    Returns:
        ``(param_names, param_shapes, grad_dim)``: names in ``named_parameters()`` order, each one's
        shape, and the total number of entries.

    Raises:
        ConfigError: as :func:`select_parameters`.
    """
    names = select_parameters(model, grad_wrt)
    params = dict(model.named_parameters())
    shapes = {n: tuple(params[n].shape) for n in names}
    return names, shapes, int(sum(params[n].numel() for n in names))


def classification_margin(logits: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Margin and out-to-loss term of one example or a batch (vmap-safe: no data-dependent indexing).

    Args:
        logits: ``[..., C]`` float logits (``[C]`` for one example, ``[n, C]`` for a batch).
        label: ``[...]`` int64 class indices (``[]`` or ``[n]``).

    Returns:
        ``(margin [...], out_to_loss [...])`` where margin = logit_y − logsumexp_{j≠y} logit_j
        and out_to_loss = 1 − softmax(logits)_y (Park et al. 2023, Eq. 13 and App. E).
    """
    mask = torch.arange(logits.shape[-1], device=logits.device) == label.unsqueeze(-1)  # [..., C]
    logit_y = (logits * mask).sum(-1)
    others = logits.masked_fill(mask, float("-inf"))
    margin = logit_y - torch.logsumexp(others, dim=-1)
    # 1 - p_y = sigmoid(-margin), computed stably
    out_to_loss = torch.sigmoid(-margin)
    return margin, out_to_loss


def language_modeling_margin(
    logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token margin and mean out-to-loss of one text or a batch of texts (vmap-safe).

    Args:
        logits: ``[..., L, V]`` float logits of a causal LM (position t predicts token t+1).
        input_ids: ``[..., L]`` int64 token ids.
        attention_mask: ``[..., L]`` 0/1, 1 on real tokens (padding on the right).

    Returns:
        ``(margin [...], out_to_loss [...])``: the sum over predicted real tokens
        of their margins, and the mean over them of ``1 − p_t(x_{t+1})`` (0 for
        a text of one token).
    """
    pred, nxt = logits[..., :-1, :], input_ids[..., 1:]  # [..., L-1, V], [..., L-1]
    valid = (attention_mask[..., 1:] != 0) & (attention_mask[..., :-1] != 0)  # [..., L-1]
    mask = torch.arange(pred.shape[-1], device=pred.device) == nxt.unsqueeze(-1)  # [..., L-1, V]
    logit_y = (pred * mask).sum(-1)
    others = pred.masked_fill(mask, float("-inf"))
    margins = logit_y - torch.logsumexp(others, dim=-1)  # [..., L-1]
    w = valid.to(margins.dtype)
    margin = (margins * w).sum(-1)
    out_to_loss = (torch.sigmoid(-margins) * w).sum(-1) / w.sum(-1).clamp(min=1.0)
    return margin, out_to_loss


def output_function(
    task: Task, logits: torch.Tensor, labels: torch.Tensor, inputs: torch.Tensor | dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model output function f and out-to-loss term Q of a task: the one definition of the margins.

    Works on a plain batch (``labels [n]``, text inputs ``[n, L]``) and on one
    example under ``torch.func.vmap`` (``labels []``, text inputs ``[L]``): the
    logits are reshaped to the labels' (classification) or the tokens' (language
    modeling) leading shape, so both the per-example gradients
    (:class:`PerExampleGradients`) and the retrained models' outputs of
    `trak eval` evaluate exactly this function.

    Args:
        task: ``classification`` or ``text_classification`` (:func:`classification_margin`
            of the ``[..., C]`` logits), ``language_modeling`` (:func:`language_modeling_margin`),
            or a :class:`CustomOutput` (its function of the logits and labels; a spec string is resolved).
        logits: the model's logits, ``[n, C]`` / ``[n, L, V]`` (or with extra size-1
            dimensions, e.g. ``[1, C]`` for one example under vmap).
        labels: ``[n]`` (or ``[]``) int64 class indices; ignored by ``language_modeling``.
        inputs: the model inputs; ``language_modeling`` reads ``input_ids`` and
            ``attention_mask`` (``[n, L]`` or ``[L]``) from the dict.

    Returns:
        ``(f, Q)``, each of the labels' (or texts') leading shape, in the logits' dtype.
    """
    if isinstance(task, CustomOutput):
        return task(logits, labels)
    if task not in TASKS:
        return output_function(resolve_task(task), logits, labels, inputs)
    if task == "language_modeling":
        ids = inputs["input_ids"]  # type: ignore[index]
        return language_modeling_margin(logits.reshape(*ids.shape, -1), ids, inputs["attention_mask"])  # type: ignore[index]
    return classification_margin(logits.reshape(*labels.shape, -1), labels)


def check_logits(task: Task, logits: torch.Tensor, labels: torch.Tensor, n: int, row_offset: int = 0) -> None:
    """Turn logits of the wrong shape and labels out of range into clear errors.

    Args:
        task: ``cfg.task`` (resolved): a custom one is called on the logits and its results checked
            (:func:`check_custom_output`).
        logits: the model's logits for a batch of ``n`` examples: ``[n, C]``
            (classification) or ``[n, L, V]`` (language_modeling).
        labels: ``[m]`` int64 class labels of the batch (``m`` may exceed ``n``
            when only the first rows were run); ignored by ``language_modeling``.
        n: the rows the model was given.
        row_offset: index of the batch's first example in its dataset (for messages).

    Raises:
        DataError: the logits do not have the task's shape, or a label is not a
            class of the model (naming the first offending examples and labels).
    """
    if isinstance(task, CustomOutput):
        if logits.ndim < 1 or logits.shape[0] != n:
            raise DataError(f"the model must return logits [n, ...]; for a batch of {n} it returned {list(logits.shape)}")
        check_custom_output(task, logits, labels, row_offset)
        return
    if task == "language_modeling":
        if logits.ndim != 3 or logits.shape[0] != n:
            raise DataError(
                "task language_modeling needs a causal LM returning logits [n, L, vocab]; for a batch of "
                f"{n} the model returned shape {list(logits.shape)} (set model.kwargs.model_class: causal_lm)"
            )
        return
    if logits.ndim != 2 or logits.shape[0] != n:
        raise DataError(
            f"the model must return logits [n, num_classes]; for a batch of {n} it returned shape {list(logits.shape)}"
        )
    n_classes = logits.shape[1]
    bad = (labels < 0) | (labels >= n_classes)
    if bad.any():
        rows = (torch.nonzero(bad).flatten()[:5] + row_offset).tolist()
        raise DataError(
            f"labels out of range: the model has {n_classes} classes but examples {rows} have labels "
            f"{labels[bad][:5].tolist()}; labels must be in [0, {n_classes - 1}]"
        )


def _call(model: nn.Module, params: dict[str, torch.Tensor], x) -> torch.Tensor:
    """Logits of a batch through ``functional_call``: a tensor input, or a dict (transformers)."""
    if isinstance(x, dict):
        from trakcli.models.forward import logits_of, model_kwargs

        return logits_of(functional_call(model, params, args=(), kwargs=model_kwargs(model, x)))
    return functional_call(model, params, (x,))


def _first(x):
    return {k: v[:1] for k, v in x.items()} if isinstance(x, dict) else x[:1]


class PerExampleGradients:
    """Computes ``∇_θ f(z; θ)`` for each example of a batch, and ``Q(z)``.

    Args:
        model: the model; it is switched to eval mode.
        grad_wrt: parameter name patterns (see :func:`select_parameters`).
        task: model output function: ``classification``, ``text_classification``
            (both the margin of ``[C]`` logits), ``language_modeling``, or a custom one
            (:func:`resolve_task`: a ``"file.py:fn"`` spec or a callable).

    Attributes:
        param_names: the differentiated parameters, in order.
        param_shapes: their shapes.
        grad_dim: total number of differentiated entries.
        method: ``"vmap"`` (:class:`trakcli.factors.LayerGradients` has ``"hooks"``).
        reason: why vmap was chosen over layer hooks (set by :func:`trakcli.factors.per_example_gradients`
            under ``gradient_method: auto``), for the caller to report once; None otherwise.
    """

    method = "vmap"
    reason: str | None = None

    def __init__(self, model: nn.Module, grad_wrt: list[str] | None = None, task: Any = "classification"):
        self.task = resolve_task(task)
        self.model = model.eval()
        self.param_names, self.param_shapes, self.grad_dim = selected_shapes(model, grad_wrt)
        self._fn: Callable | None = None

    def _constants(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        chosen = set(self.param_names)
        params = {n: p.detach() for n, p in self.model.named_parameters() if n in chosen}
        const = {n: p.detach() for n, p in self.model.named_parameters() if n not in chosen}
        const.update({n: b.detach() for n, b in self.model.named_buffers()})
        return params, const

    def __call__(
        self, inputs, labels: torch.Tensor, row_offset: int = 0
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Per-example gradients of the model output function and the out-to-loss terms of a batch.

        Args:
            inputs: ``[n, ...]`` model inputs on the model's device, or a dict of
                ``[n, L]`` tensors (``input_ids``, ``attention_mask``) for a transformers model.
            labels: ``[n]`` int64 class indices (ignored by ``language_modeling``).
            row_offset: dataset index of the batch's first row (for error messages).

        Returns:
            ``(grads, out_to_loss)``: ``grads[name]`` is ``[n, *param.shape]``
            in the parameter's dtype; ``out_to_loss`` is ``[n]`` float32.

        Raises:
            DataError: inputs of a shape the model cannot take (any exception of one plain
                forward pass, named with the user's file and line), or labels out of range.
            GradientError: the forward pass runs on the batch but fails under ``torch.func.vmap``
                (names the file and line, and :data:`VMAP_HINT`).
        """
        params, const = self._constants()
        model = self.model
        task = self.task

        def f(p: dict[str, torch.Tensor], x, y: torch.Tensor):
            one = {k: v.unsqueeze(0) for k, v in x.items()} if isinstance(x, dict) else x.unsqueeze(0)
            margin, q = output_function(task, _call(model, {**p, **const}, one), y, x)
            return margin, q.detach()

        self._check_batch(inputs, labels, params, const, row_offset)
        of_task = f" and task {task.spec}" if isinstance(task, CustomOutput) else ""
        what = lambda: f"per-example gradients (torch.func.vmap) of the forward pass of {model_name(model)}{of_task}"  # noqa: E731
        with user_code(what, hint=VMAP_HINT, error=GradientError):
            grads, q = vmap(grad(f, has_aux=True), in_dims=(None, 0, 0))(params, inputs, labels)
        if isinstance(task, CustomOutput):
            check_finite(q, row_offset, what=f"out-to-loss terms Q of task {task.spec}")
        return grads, q.to(torch.float32)

    def _check_batch(self, inputs, labels, params, const, row_offset: int) -> None:
        """One plain forward pass to turn shape errors into clear messages."""
        lm = self.task == "language_modeling"
        if lm and not (isinstance(inputs, dict) and "input_ids" in inputs and "attention_mask" in inputs):
            raise DataError(
                "task language_modeling needs text data (input_ids and attention_mask): give data.*.text "
                "and a tokenizer, or use task classification for tensor inputs"
            )
        with torch.no_grad(), forward_errors(self.model, inputs):
            logits = _call(self.model, {**params, **const}, _first(inputs))
        check_logits(self.task, logits, labels, 1, row_offset)

    def flatten(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        """Concatenate per-parameter gradients into ``[n, grad_dim]`` (in ``param_names`` order)."""
        return torch.cat([grads[n].reshape(grads[n].shape[0], -1) for n in self.param_names], dim=1)


def check_finite(rows: torch.Tensor, row_offset: int, what: str = "gradients") -> None:
    """Raise if any example's row has NaN or inf entries.

    Called on the projected features ``[n, proj_dim]`` rather than on the
    ``[n, grad_dim]`` gradients: a non-finite gradient entry meets nonzero
    matrix entries and makes its features non-finite, and the check then costs
    O(proj_dim) instead of O(grad_dim) per example.

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
        raise GradientError(
            f"non-finite {what} for examples {rows[:10]}{' ...' if len(rows) > 10 else ''}; "
            "check those inputs and the checkpoint for NaN/inf values"
        )
