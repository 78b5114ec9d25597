"""The task: the model output function ``f`` and out-to-loss term ``Q`` of a batch.

A task receives the model's output (the logits) and the whole batch, and returns
one ``f`` (differentiable) and one ``Q`` per example::

    f, q = task(logits, batch)          # [n], [n]

The batch is every tensor the data yields, with the examples as the first dimension:

* tensor data: ``{"inputs": [n, ...], "labels": [n, ...]}``, the labels as the data holds them
  (class indices ``[n]`` for the built-in tasks; float targets, several columns, a choice's
  index for a task of one's own, which checks them: :meth:`Task.check_labels`);
* several input tensors (``data.*.inputs: [a, b]``): ``{"a": ..., "b": ..., "labels": [n, ...]}``;
* text: ``{"input_ids": [n, L], "attention_mask": [n, L], ("token_type_ids"), "labels": ...}`` with ``labels`` the class
  indices ``[n]`` (text classification) or the per-token labels ``[n, L]`` of language modeling, ``-100`` where a token
  is not a target (the prompt, the user turns of a chat, padding), otherwise the token itself (unshifted, as in
  transformers: the prediction at ``t - 1`` is scored against ``labels[t]``).

Every featurizer calls the task the same way: torch.func.vmap calls it on one example at a time (every tensor with a
leading dimension of 1, returning ``[1]``), the layer hooks and Kronecker factors on whole batches, `trak eval` on the
retrained models' outputs. So a row's ``f`` and ``Q`` must depend on that row only, and the function must be vmap-safe
(no ``.item()``, no Python branching on tensor values, no data-dependent indexing such as ``logits[range(n), y]``: use
``gather`` or masks).

Built-in tasks (Park et al. 2023, TRAK, Sec. 3 and App. E):

* ``classification`` / ``text_classification``: the margin
  ``f = logit_y − logsumexp_{j≠y} logit_j = log(p_y / (1 − p_y))``, ``Q = 1 − p_y``.
* ``language_modeling``: the sum of the next-token margins over the target tokens,
  ``f = Σ_{t: labels[t] ≠ −100} [logit_{t−1}(x_t) − logsumexp_{j≠x_t} logit_{t−1}(j)]``,
  and ``Q`` the mean over them of ``1 − p_{t−1}(x_t)`` (0 for a text without targets).

A user's task is a function ``fn(logits, batch) -> (f, Q)`` (``task: "file.py:fn"``,
``"pkg.mod:fn"`` or a callable from Python) or a :class:`Task` subclass.

A store records the task's identity (:meth:`Task.identity`): a function's file and its
sha256, a class's name, formula and the sha256 of its source (and of its bases'), so a
store made with one version of a task refuses features or scores of another.
"""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from trakcli.errors import ConfigError, DataError, user_code
from trakcli.config.schema import BUILTIN_TASKS
from trakcli.labels import IGNORE_INDEX, any_labels, class_labels

#: A batch: every tensor the data yields, examples first.
Batch = Mapping[str, torch.Tensor]


def classification_margin(logits: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Margin and out-to-loss term of one example or a batch (vmap-safe: no data-dependent indexing).

    Args:
        logits: ``[..., C]`` float logits (``[C]`` for one example, ``[n, C]`` for a batch).
        label: ``[...]`` int64 class indices (``[]`` or ``[n]``).

    Returns:
        ``(margin [...], out_to_loss [...])`` where margin = logit_y − logsumexp_{j≠y} logit_j
        and out_to_loss = 1 − softmax(logits)_y (Park et al. 2023, Eq. 13 and App. E).
    """
    idx = label.unsqueeze(-1)  # [..., 1]
    logit_y = logits.gather(-1, idx).squeeze(-1)
    others = logits.scatter(-1, idx, float("-inf"))  # one copy of the logits, y masked out
    margin = logit_y - torch.logsumexp(others, dim=-1)
    return margin, torch.sigmoid(-margin)  # 1 - p_y = sigmoid(-margin), computed stably


def token_labels(batch: Batch) -> torch.Tensor:
    """The per-token labels ``[n, L]`` of a language-modeling batch.

    ``batch["labels"]`` when it has the shape of ``input_ids``; otherwise every real
    token (``attention_mask`` 1, or every token without a mask) is a target.

    Raises:
        DataError: the batch has no ``input_ids``.
    """
    ids = batch.get("input_ids")
    if ids is None:
        raise DataError("task language_modeling needs token data (input_ids): give data.*.text, prompt + completion, "
                        "messages or input_ids (docs/guides/language-models.md), or use task classification for "
                        f"tensor inputs; the batch has {sorted(batch)}")
    labels = batch.get("labels")
    if labels is not None and tuple(labels.shape) == tuple(ids.shape):
        return labels
    mask = batch.get("attention_mask")
    return ids if mask is None else torch.where(mask != 0, ids, IGNORE_INDEX)


def language_modeling_margin(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token margin and mean out-to-loss over the target tokens (vmap-safe).

    Args:
        logits: ``[..., L, V]`` float logits of a causal LM (position t predicts token t+1).
        labels: ``[..., L]`` int64 unshifted per-token labels: the token where it is a target,
            ``-100`` elsewhere (prompt, user turns, padding).

    Returns:
        ``(margin [...], out_to_loss [...])``: the sum over target tokens ``t`` (``t ≥ 1``) of
        ``logit_{t−1}(x_t) − logsumexp_{j≠x_t} logit_{t−1}(j)``, and the mean over them of
        ``1 − p_{t−1}(x_t)`` (0 without targets).
    """
    pred, nxt = logits[..., :-1, :], labels[..., 1:]  # [..., L-1, V], [..., L-1]
    valid = nxt != IGNORE_INDEX
    margins, q = classification_margin(pred, torch.where(valid, nxt, 0))  # [..., L-1]
    w = valid.to(margins.dtype)
    return (margins * w).sum(-1), (q * w).sum(-1) / w.sum(-1).clamp(min=1.0)


def classification_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``[n, C]`` logits at the class labels ``[n]`` int64: mean (or sum) over rows, a float scalar."""
    return torch.nn.functional.cross_entropy(logits, labels, reduction=reduction)


def language_modeling_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy over the target tokens of a causal LM (the loss its margin comes from).

    Args:
        logits: ``[n, L, V]`` float logits (position t predicts token t+1).
        labels: ``[n, L]`` int64 unshifted per-token labels, ``-100`` where a token is not a target.
        reduction: ``"mean"``: over the target tokens of the batch (0 when there are none); ``"sum"``: their sum.

    Returns:
        A float scalar in nats, differentiable.
    """
    pred, nxt = logits[:, :-1, :], labels[:, 1:]  # [n, L-1, V], [n, L-1]
    total = torch.nn.functional.cross_entropy(pred.reshape(-1, pred.shape[-1]), nxt.reshape(-1),
                                              ignore_index=IGNORE_INDEX, reduction="sum")
    if reduction == "sum":
        return total
    return total / (nxt != IGNORE_INDEX).sum().clamp(min=1)


class Task:
    """A model output function: ``task(logits, batch) -> (f [n], Q [n])``.

    Subclass it for a new loss; the built-in tasks are subclasses too. A subclass overrides :meth:`__call__` (``f`` and
    ``Q``, row-wise and vmap-safe) and, as it needs: :meth:`loss` (what `trak optimize` and `trak eval` retraining
    minimize; default the cross-entropy of ``[n, C]`` logits at class labels), :meth:`check_labels` (the dataset's
    labels when they are loaded; default any ``[n, ...]`` numbers), :meth:`check` (the logits and labels of each batch,
    for clear errors), :attr:`has_accuracy` and :meth:`correct` (the accuracy training reports). Whatever it overrides,
    its ``(f, Q)`` are checked to be two tensors ``[n]`` of finite values (:func:`check_outputs`), and its store
    identity holds the sha256 of its source (:meth:`identity`).

    Attributes:
        name: the task's name (a built-in name, the ``"file.py:fn"`` / ``"file.py:Class"`` spec, or a
            subclass's class name).
        formula: the formula the store records as ``output_function``.
        token_level: whether the task reads per-token labels (language modeling).
    """

    name = "task"
    formula = ""
    token_level = False
    #: What the labels must be, as messages on labels that are not numbers name it.
    label_values = "numbers"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:  # a subclass that names itself nothing else: its class name
            cls.name = cls.__qualname__

    def __call__(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(f [n], Q [n])`` of a batch: ``f`` differentiable, ``Q`` the out-to-loss term (∂loss/∂f)."""
        raise NotImplementedError

    def check_labels(self, labels: Any, *, n: int, key: str = "data", what: str = "labels", source: str = "",
                     token_shape: list[int] | None = None) -> torch.Tensor:
        """The labels of a dataset as the task reads them, checked once when the data is loaded.

        The default takes any numbers of shape ``[n, ...]`` (:func:`trakcli.labels.any_labels`: floats as float32,
        integers as int64); the built-in tasks take class indices (:func:`trakcli.labels.class_labels`). Override it to
        refuse labels early, with the ``key``, ``what`` and ``source`` given for messages.

        Args:
            labels: a tensor, array or nested list of numbers.
            n: the number of examples (rows of the inputs).
            key, what, source: for messages: ``"data.train"``, ``"labels 'y'"``, ``" of data.pt"``.
            token_shape: ``[n, L]`` of the ``input_ids`` input, for token data (None otherwise).

        Returns:
            The labels as a tensor ``[n, ...]``.

        Raises:
            DataError: labels the task cannot read.
        """
        return any_labels(labels, what, source, key, n, token_shape)

    def check(self, logits: torch.Tensor, batch: Batch, row_offset: int = 0) -> None:
        """Raise :class:`DataError` when ``logits`` or ``batch`` do not fit the task (before any gradient).

        Called on every batch before the task, with the whole batch's logits (or the first example's, expanded to the
        batch). The default refuses logits without the examples as their first dimension. Whatever it checks, the task's
        ``(f, Q)`` are then checked to be two tensors ``[n]`` of finite values (:func:`check_outputs`).
        """
        n = _n(batch)
        if logits.ndim < 1 or logits.shape[0] != n:
            raise DataError(f"the model must return logits [n, ...]; for a batch of {n} it returned "
                            f"{list(logits.shape)}")

    def loss(self, logits: torch.Tensor, batch: Batch, reduction: str = "mean") -> torch.Tensor:
        """The training loss of a batch, the one the built-in recipe of `trak optimize` minimizes.

        The cross-entropy of ``[n, C]`` logits at ``batch["labels"] [n]`` (:func:`classification_loss`);
        :class:`LanguageModeling` overrides it with the next-token cross-entropy. Override it for
        another loss (and :meth:`loss_count` when its mean is not over rows).

        Args:
            logits: the model's output for the batch.
            batch: the batch (see the module docstring).
            reduction: ``"mean"`` over the :meth:`loss_count` terms, or ``"sum"``.

        Returns:
            A float scalar in nats, differentiable.
        """
        return classification_loss(logits, batch["labels"], reduction)

    #: Whether training reports an accuracy (:meth:`correct`): classifiers do, a language model or a
    #: regression does not.
    has_accuracy = False

    def correct(self, logits: torch.Tensor, batch: Batch) -> int:
        """How many rows of a batch the model gets right (read when :attr:`has_accuracy`): the rows whose
        argmax logit (``[n, C]`` logits) is the class label ``batch["labels"] [n]``."""
        return int((logits.detach().argmax(-1) == batch["labels"]).sum())

    def loss_count(self, batch: Batch) -> int:
        """How many terms the mean :meth:`loss` of ``batch`` is over: its rows (target tokens for
        :class:`LanguageModeling`)."""
        return _n(batch)

    def identity(self) -> dict[str, Any]:
        """``{"task", "output_function"}`` as the store records them.

        A task of one's own: ``output_function`` is ``{"class", "formula", "sha256"}``: the class's qualified
        name, its :attr:`formula` and the sha256 of its source (:func:`source_sha256`), so that a store
        made with one version of a task refuses another (``output_function.sha256: store has …``).
        A built-in task (a class of this module): ``output_function`` is its :attr:`formula`, which names
        what its results follow, so stores do not depend on how this module is written.
        """
        cls = type(self)
        if cls.__module__ == __name__:
            return {"task": self.name, "output_function": self.formula or f"{cls.__module__}.{cls.__qualname__}"}
        return {"task": self.name, "output_function": {"class": cls.__qualname__, "formula": self.formula,
                                                       "sha256": source_sha256(cls)}}

    def __repr__(self) -> str:
        return f"<task {self.name}>"


def source_sha256(cls: type) -> str:
    """sha256 of the source of ``cls`` and of its bases up to the first built-in one (what its results depend on).

    A built-in base (a class of this module, :class:`Task` or a built-in task) counts by its name and
    :attr:`~Task.formula`, not its source. A class whose source cannot be read (defined in an interactive
    session, or from a compiled file) is hashed by its qualified name instead, so its identity still names it.

    Returns:
        64 hex digits.
    """
    h = hashlib.sha256()
    for c in cls.__mro__:
        if c.__module__ == __name__ or c is object:
            h.update(f"{c.__qualname__}: {getattr(c, 'formula', None)}".encode())
            break
        try:
            text = inspect.getsource(c)
        except (OSError, TypeError):  # no source file: the name is all there is
            text = f"{c.__module__}.{c.__qualname__}"
        h.update(text.encode())
    return h.hexdigest()


def _n(batch: Batch) -> int:
    return int(next(iter(batch.values())).shape[0])


class Classification(Task):
    """The margin of ``[n, C]`` logits at the class labels ``batch["labels"] [n]`` (:func:`classification_margin`)."""

    formula = "margin: logit_y - logsumexp_{j!=y} logit_j; out_to_loss 1 - p_y"

    label_values = "integer class indices"
    has_accuracy = True

    def __init__(self, name: str = "classification", formula: str | None = None):
        self.name = name
        self.formula = formula or self.formula

    def check_labels(self, labels, *, n, key="data", what="labels", source="", token_shape=None):
        """Class indices ``[n]`` int64 >= 0 (:func:`trakcli.labels.class_labels`; ``[n, L]`` per-token
        labels beside ``input_ids``, which the config refuses for this task)."""
        return class_labels(labels, what, source, key, n, token_shape)

    def __call__(self, logits, batch):
        labels = batch["labels"]
        return classification_margin(logits.reshape(*labels.shape, -1), labels)

    def check(self, logits, batch, row_offset=0):
        n = _n(batch)
        labels = batch.get("labels")
        if logits.ndim != 2 or logits.shape[0] != n:
            raise DataError(f"the model must return logits [n, num_classes]; for a batch of {n} it returned shape "
                            f"{list(logits.shape)}")
        if labels is None or labels.ndim != 1:
            got = "none" if labels is None else f"shape {list(labels.shape)}"
            raise DataError(f"task {self.name} needs class labels [n] (data.*.labels); the batch has {got}")
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise DataError(f"task {self.name} needs integer class labels [n]; the batch has {labels.dtype} labels: "
                            "give class indices 0, 1, ... (or write a task of your own for other targets)")
        n_classes = logits.shape[1]
        bad = (labels < 0) | (labels >= n_classes)
        if bad.any():
            rows = (torch.nonzero(bad).flatten()[:5] + row_offset).tolist()
            raise DataError(f"labels out of range: the model has {n_classes} classes but examples {rows} have labels "
                            f"{labels[bad][:5].tolist()}; labels must be in [0, {n_classes - 1}]")


class LanguageModeling(Task):
    """The summed next-token margin over the target tokens of a causal LM (:func:`language_modeling_margin`)."""

    name = "language_modeling"
    formula = ("sum over target tokens t (labels != -100) of logit_{t-1}(x_t) - logsumexp_{j!=x_t} logit_{t-1}(j); "
               "out_to_loss mean over them of 1 - p_{t-1}(x_t)")
    token_level = True
    label_values = "integer class indices"

    def check_labels(self, labels, *, n, key="data", what="labels", source="", token_shape=None):
        """Per-token labels ``[n, L]`` int64 (token ids or -100) beside ``input_ids``, or ``[n]`` ints
        (:func:`trakcli.labels.class_labels`)."""
        return class_labels(labels, what, source, key, n, token_shape)

    def __call__(self, logits, batch):
        labels = token_labels(batch)
        return language_modeling_margin(logits.reshape(*labels.shape, -1), labels)

    def loss(self, logits, batch, reduction="mean"):
        """The next-token cross-entropy over the target tokens (:func:`language_modeling_loss`, labels from
        :func:`token_labels`)."""
        labels = token_labels(batch)
        return language_modeling_loss(logits.reshape(*labels.shape, -1), labels, reduction)

    def loss_count(self, batch):
        """The target tokens of the batch (labels != -100 after the first position)."""
        return int((token_labels(batch)[:, 1:] != IGNORE_INDEX).sum())

    def check(self, logits, batch, row_offset=0):
        labels = token_labels(batch)
        if logits.ndim != 3 or logits.shape[:2] != labels.shape:
            raise DataError(f"task language_modeling needs a causal LM returning logits [n, L, vocab]; for input_ids "
                            f"{list(labels.shape)} the model returned shape {list(logits.shape)} (set "
                            "model.kwargs.model_class: causal_lm)")
        vocab = logits.shape[-1]
        bad = ((labels < 0) & (labels != IGNORE_INDEX)) | (labels >= vocab)
        if bad.any():
            rows = sorted(set((torch.nonzero(bad)[:, 0] + row_offset).tolist()))[:5]
            raise DataError(f"token labels out of range in examples {rows} (e.g. {labels[bad][:5].tolist()}): labels "
                            f"must be a token id in [0, {vocab - 1}] or -100 (not a target)")


#: The built-in tasks by name (the names and the labels they read: :data:`trakcli.config.schema.BUILTIN_TASK_LABELS`).
BUILTIN = {
    "classification": Classification(),
    "text_classification": Classification("text_classification", "margin of the sequence logits: logit_y - "
                                          "logsumexp_{j!=y} logit_j; out_to_loss 1 - p_y"),
    "language_modeling": LanguageModeling(),
}

#: Names of the built-in tasks.
TASKS = BUILTIN_TASKS  # one table of names: the config's, which validates `task:` without importing torch


class CustomTask(Task):
    """A user's function ``fn(logits, batch) -> (f [n], Q [n])``, with its source file's sha256 for the store identity.

    Attributes:
        fn: the function (or a callable object).
        name: ``"file.py:fn"`` / ``"pkg.mod:fn"`` as configured, or ``"module:qualname"`` of a callable.
        file, sha256: the source file of ``fn`` and its sha256 (None when it has no file), so that a
            changed function is refused by a store made with the old one.
    """

    def __init__(self, fn: Callable[..., Any], spec: str | None = None):
        from trakcli.models.checkpoints import file_sha256

        target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)
        try:
            file = inspect.getsourcefile(target)
        except TypeError:
            file = None
        self.fn = fn
        self.name = spec or f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(fn))}"
        self.file = file
        self.sha256 = file_sha256(file) if file is not None and Path(file).is_file() else None
        self.token_level = bool(getattr(fn, "token_level", False))
        self.has_accuracy = not self.token_level  # trained with the classification loss

    def identity(self) -> dict[str, Any]:
        return {"task": self.name, "output_function": {"function": self.name, "file": self.file, "sha256": self.sha256}}

    def __call__(self, logits, batch):
        return self.fn(logits, batch)

    def trained_as(self) -> Task:
        """The built-in task whose loss trains a function's model (a function declares no loss)."""
        return BUILTIN["language_modeling" if self.token_level else "classification"]

    def loss(self, logits, batch, reduction="mean"):
        """The loss of the built-in task of the function's kind: next-token cross-entropy when the function has
        ``token_level = True``, else the cross-entropy at class labels."""
        return self.trained_as().loss(logits, batch, reduction)

    def loss_count(self, batch):
        return self.trained_as().loss_count(batch)


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each position's next-token cross-entropy over the target tokens of a causal LM (vmap-safe).

    Args:
        logits: ``[..., L, V]`` float logits (position t predicts token t+1).
        labels: ``[..., L]`` int64 unshifted per-token labels, ``-100`` where a token is not a target.

    Returns:
        ``[..., L-1]``: at ``t`` the loss ``−log p_t(x_{t+1})`` in nats where ``labels[t+1]`` is a target, 0 elsewhere.
    """
    nxt = labels[..., 1:]
    valid = nxt != IGNORE_INDEX
    logp = torch.log_softmax(logits[..., :-1, :], dim=-1)
    tok = torch.where(valid, nxt, torch.zeros_like(nxt)).unsqueeze(-1)
    nll = -logp.gather(-1, tok).squeeze(-1)
    return nll * valid.to(nll.dtype)


def example_losses(task: Task, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Each example's training loss ``[n]``, summed over its terms (vmap-safe for the built-in tasks).

    A task that defines ``example_loss(logits, batch) -> [n]`` gives its own. Otherwise: for a token-level task the
    next-token cross-entropy summed over each row's target tokens (labels != -100), for any other the cross-entropy of
    ``[n, C]`` logits at the class labels ``[n]`` (a :class:`CustomTask` is trained with one of those two,
    :meth:`CustomTask.trained_as`); a subclass of :class:`Task` with its own :meth:`Task.loss` is called row by row
    (``reduction="sum"``).

    Returns:
        ``[n]`` float, differentiable, in nats.
    """
    own = getattr(task, "example_loss", None)
    if callable(own):
        return own(logits, batch)
    base = task.trained_as() if isinstance(task, CustomTask) else task
    if base.token_level:
        labels = token_labels(batch)
        return token_losses(logits.reshape(*labels.shape, -1), labels).sum(-1)
    if type(base).loss is Task.loss or isinstance(base, Classification):
        labels = batch["labels"]
        logp = torch.log_softmax(logits.reshape(*labels.shape, -1), dim=-1)
        return -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return torch.stack([base.loss(logits[i:i + 1], {k: v[i:i + 1] for k, v in batch.items()}, reduction="sum")
                        for i in range(_n(batch))])


class LossOutput(Task):
    """The output function of influence functions: ``f = −loss(z)`` per example, ``Q = 1``.

    Influence functions (Koh & Liang 2017; kronfluence; Grosse et al. 2023) differentiate the training loss on both
    sides, g(t)ᵀ (F + δ)⁻¹ g(z) with g = ∇ loss; TRAK's margin and its out-to-loss weighting belong to TRAK's kernel.
    With ``f = −loss`` the sign stays trakcli's (a positive score: upweighting z lowers the target's loss), since the
    two minus signs cancel in the product. The loss is :func:`example_losses` of the wrapped task. What `trak featurize`
    and `trak score` use for ``curvature.kind`` kfac / ekfac with ``curvature.output: loss``.

    Args:
        task: the configured task (its labels, checks and loss).
    """

    formula = "f = -(training loss of the example, summed over its target tokens); out_to_loss 1"

    def __init__(self, task: Task):
        self.task = task
        self.name = f"loss of {task.name}"
        self.token_level = task.token_level
        self.label_values = task.label_values
        self.has_accuracy = task.has_accuracy

    def identity(self) -> dict[str, Any]:
        inner = self.task.identity()
        return {"task": inner["task"], "output_function": {"loss_of": inner["output_function"],
                                                           "formula": self.formula}}

    def check_labels(self, labels, **kwargs):
        return self.task.check_labels(labels, **kwargs)

    def check(self, logits, batch, row_offset=0):
        self.task.check(logits, batch, row_offset)

    def __call__(self, logits, batch):
        f = -example_losses(self.task, logits, batch)
        return f, torch.ones_like(f.detach())

    def loss(self, logits, batch, reduction="mean"):
        return self.task.loss(logits, batch, reduction)

    def loss_count(self, batch):
        return self.task.loss_count(batch)

    def correct(self, logits, batch):
        return self.task.correct(logits, batch)


def is_builtin(task: Task) -> bool:
    """Whether ``task`` is one of :data:`BUILTIN` (messages name a task of one's own, a built-in goes unnamed)."""
    return any(task is t for t in BUILTIN.values())


def check_outputs(task: Task, out: Any, logits: torch.Tensor, batch: Batch, row_offset: int = 0) -> None:
    """Refuse a task's result that is not ``(f [n], Q [n])`` of finite values: every task's outputs are checked so.

    A built-in task's outputs are checked for their shape only: they are finite wherever the
    logits are, and non-finite logits make non-finite features, which are refused naming the rows.

    Args:
        task: the task (named in messages).
        out: what ``task(logits, batch)`` returned.
        logits, batch: what it got (their shapes are named in messages).
        row_offset: dataset index of the batch's first row (for messages).

    Raises:
        DataError: not a pair of tensors of shape ``[n]``, or NaN / inf (naming the first examples).
    """
    n = _n(batch)
    ok = (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
          and all(tuple(t.shape) == (n,) for t in out))
    if not ok:
        shapes = ([list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in out]
                  if isinstance(out, (tuple, list)) else type(out).__name__)
        given = ", ".join(f"{k} {list(v.shape)}" for k, v in batch.items())
        raise DataError(f"task {task.name} must return (f, Q), two tensors of shape [n] (one value per example); for "
                        f"logits {list(logits.shape)} and a batch of {given} it returned {shapes}; reduce over every "
                        'dimension but the first (docs/guides/own-models.md, "Custom model outputs")')
    if is_builtin(task):  # a built-in f is finite where the logits are: the features' own check names the rows
        return
    for what, t in zip(("f", "Q"), out):
        bad = ~torch.isfinite(t.detach())
        if bad.any():
            rows = (torch.nonzero(bad).flatten()[:5] + row_offset).tolist()
            raise DataError(f"task {task.name} returned non-finite {what} for examples {rows}; "
                            "compute it stably (e.g. torch.logsumexp, torch.sigmoid) and check those inputs")


def checked_outputs(task: Task, logits: torch.Tensor, batch: Batch, row_offset: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``task.check`` on the batch, then ``(f [n], Q [n])`` of the task, checked (:func:`check_outputs`).

    Raises:
        DataError: as ``task.check`` and :func:`check_outputs`; the task raised (its file and line).
    """
    task.check(logits, batch, row_offset)
    with user_code(lambda: f"task {task.name}", error=DataError):
        out = task(logits, batch)
    check_outputs(task, out, logits, batch, row_offset)
    return out[0], out[1]


def resolve_task(task: str | Callable[..., Any] | Task) -> Task:
    """The task object of ``task:``.

    Args:
        task: a :class:`Task`; a name of :data:`TASKS`; ``"path/to/file.py:fn"`` or ``"pkg.module:fn"``
            (imported like ``model.entrypoint``: a function or a :class:`Task` subclass / instance);
            or a callable ``fn(logits, batch) -> (f, Q)``.

    Raises:
        ConfigError: an unknown name that is not a function spec.
        ModelError: the file or module cannot be imported or has no such function.
    """
    if isinstance(task, Task):
        return task
    if isinstance(task, str):
        if task in BUILTIN:
            return BUILTIN[task]
        if ":" not in task:
            raise ConfigError(f"task: {task!r} is not supported; use one of {', '.join(TASKS)}, or your own output "
                              'function as "path/to/file.py:fn" or "package.module:fn" (docs/guides/own-models.md, '
                              '"Custom model outputs")')
        from trakcli.models.build import load_function

        fn = load_function(task, key="task", builtins={})
        if isinstance(fn, type) and issubclass(fn, Task):
            with user_code(f"task {task}: {fn.__qualname__}()", error=ConfigError):
                fn = fn()
        if isinstance(fn, Task):
            if fn.name == type(fn).__qualname__:  # a subclass that names itself nothing else: by its spec
                fn.name = task
            return fn
        return CustomTask(fn, spec=task)
    if callable(task):
        return CustomTask(task)
    raise ConfigError(f"task: {task!r} is neither a task name, a \"file.py:fn\" spec nor a callable")


def task_identity(task: str | Callable[..., Any] | Task) -> dict[str, Any]:
    """``{"task", "output_function"}`` of a store identity (:meth:`Task.identity`)."""
    return resolve_task(task).identity()


def make_batch(inputs: torch.Tensor | Mapping[str, torch.Tensor], labels: torch.Tensor | None
               ) -> dict[str, torch.Tensor]:
    """The batch a task sees: the input tensors by name (a tensor is ``"inputs"``) and ``"labels"``.

    Args:
        inputs: ``[n, ...]`` or a dict of ``[n, ...]`` tensors.
        labels: ``[n]`` class labels, ``[n, L]`` per-token labels, or None (no labels).
    """
    batch = dict(inputs) if isinstance(inputs, Mapping) else {"inputs": inputs}
    if labels is not None:
        batch["labels"] = labels
    return batch


def check_by_first(task: Task, logits: torch.Tensor, inputs: torch.Tensor | Mapping[str, torch.Tensor],
                   labels: torch.Tensor | None, row_offset: int = 0) -> None:
    """Check a whole batch against the logits of its first example alone (one cheap forward pass).

    ``task.check`` sees every row's labels against the first example's logits, expanded to the batch
    (a view, no copy); then the task is called on the first example, as ``torch.func.vmap`` will call
    it, and its ``(f, Q)`` checked (:func:`checked_outputs`).

    Args:
        task: the task.
        logits: ``[1, ...]`` the first example's logits.
        inputs, labels: the whole batch (``[n, ...]``; labels ``[n]``, ``[n, L]`` or None).
        row_offset: dataset index of the batch's first row (for messages).

    Raises:
        DataError: as ``task.check``.
    """
    batch = make_batch(inputs, labels)
    task.check(logits.expand(_n(batch), *logits.shape[1:]), batch, row_offset)
    checked_outputs(task, logits[:1], {k: v[:1] for k, v in batch.items()}, row_offset)
