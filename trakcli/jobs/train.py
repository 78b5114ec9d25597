"""Training: the plain recipe for classifiers, and one model of a config's recipe.

:func:`train_classifier` is ordinary minibatch training with the cross-entropy
loss and a ``torch.optim`` optimizer, or that optimizer run in a random
subspace by :class:`trakcli.optim.ProjectedOptimizer` when a ``projection`` is
given. :func:`train_one` builds, seeds and trains one model with a config's
recipe (``optimize:``, or ``training:`` + ``optimizer:``) or with the user's
``training.entrypoint``; `trak optimize` (:func:`trakcli.jobs.optimize.optimize`)
and the retraining of `trak eval` both call it. A model killed mid-training
resumes from its training state file bit-identically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from trakcli.config import Config, OptimizeConfig
from trakcli.data.tensors import Inputs, index_inputs, slice_inputs
from trakcli.errors import ConfigError, ModelError, TrainingError, user_code
from trakcli.files import atomic_torch_save
from trakcli.tasks import BUILTIN, check_by_first, resolve_task
from trakcli.jobs.divergence import check_loss, check_weights
from trakcli.models.forward import forward, forward_errors
from trakcli.progress import NULL_REPORTER, Reporter


_INNER = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def make_optimizer(
    name: str,
    params,
    *,
    lr: float,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    projection: dict[str, Any] | None = None,
) -> torch.optim.Optimizer:
    """``torch.optim`` optimizer by name: ``sgd`` (with momentum), ``adam`` or ``adamw``.

    With ``projection`` (the ``optimize.projection`` mapping), the named
    optimizer becomes the inner optimizer of a
    :class:`~trakcli.optim.ProjectedOptimizer`, and ``weight_decay`` is applied
    decoupled in the full parameter space (``W ← W(1 - lr·wd)``).
    """
    if name not in _INNER:
        raise ValueError(f"unknown optimizer {name!r}")
    kwargs: dict[str, Any] = {"lr": lr}
    if name == "sgd":
        kwargs["momentum"] = momentum
    if projection is not None:
        from trakcli.optim import ProjectedOptimizer

        return ProjectedOptimizer(params, inner=_INNER[name], projection=projection, weight_decay=weight_decay, **kwargs)
    return _INNER[name](params, weight_decay=weight_decay, **kwargs)


def train_classifier(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    weight_decay: float = 0.0,
    momentum: float = 0.9,
    optimizer: str = "sgd",
    seed: int = 0,
    reporter: Reporter = NULL_REPORTER,
    description: str = "train",
    projection: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    resume_path: str | Path | None = None,
    checkpoint_every: int = 0,
    validation: tuple[Inputs, torch.Tensor] | None = None,
    name: str = "the model",
) -> nn.Module:
    """Train ``model`` in place with cross-entropy on ``(inputs, labels)``.

    The minibatch order is drawn from a ``torch.Generator`` seeded with
    ``seed``, so a run is reproducible on one machine. The progress task
    (one step per epoch) shows the epoch's running mean ``loss`` and training
    accuracy ``acc`` (of the minibatches' own forward passes, in train mode: no
    extra pass), and with ``validation`` the ``val_loss`` / ``val_acc`` of the
    last finished epoch.

    Args:
        model: the classifier, logits ``[n, C]``.
        inputs: ``[n, ...]`` float32, or a dict of ``[n, L]`` tensors for a
            transformers model (``input_ids``, ``attention_mask``).
        labels: ``[n]`` int64.
        epochs, batch_size, lr, weight_decay, momentum, optimizer: the recipe.
        seed: seed of the shuffling generator (initialize the model before calling).
        projection: run the optimizer in a random subspace (``optimize.projection``,
            see :func:`make_optimizer`); ``None``: plain.
        metrics: if given, filled with ``final_loss`` (mean loss of the last
            epoch), ``optimizer_state_numel`` (floats of optimizer state) and
            ``history``: one dict per epoch with ``epoch`` (1-based), ``loss``
            (mean minibatch loss) and ``accuracy`` (share of the epoch's
            minibatch predictions that were right, in train mode), plus
            ``val_loss`` and ``val_accuracy`` with ``validation``.
        resume_path: a file for the training state (model, optimizer, shuffling
            generator, position), written atomically every ``checkpoint_every``
            steps and at every epoch end, and deleted when training ends. If it
            exists at the start, training resumes from it, and the result is
            bit-identical to an uninterrupted run.
        checkpoint_every: steps between training-state checkpoints (0: at epoch ends only).
        validation: ``(inputs, labels)`` evaluated after every epoch (eval mode, no
            gradients, batches of ``batch_size``); never changes the training.
        name: the model in messages, e.g. ``"model 3"``.

    Returns:
        The same model, trained, in eval mode.

    Raises:
        CheckpointError: the resume file cannot be read or was made with another recipe.
        TrainingError: a step's loss is not finite or above ``DIVERGED_FACTOR`` times
            the first step's (:func:`trakcli.jobs.divergence.check_loss`): names the model and the step.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = make_optimizer(
        optimizer, model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay, projection=projection
    )
    loss_fn = nn.CrossEntropyLoss()
    n = labels.shape[0]
    recipe = {
        "epochs": epochs, "batch_size": batch_size, "lr": lr, "weight_decay": weight_decay, "momentum": momentum,
        "optimizer": optimizer, "seed": seed, "projection": projection, "n": n,
    }
    pos: dict[str, Any] = {
        "epoch": 0, "lo": 0, "total": 0.0, "correct": 0, "order": None, "history": [], "first_loss": None,
    }
    if resume_path is not None and Path(resume_path).exists():
        pos = _load_training_state(Path(resume_path), recipe, model, opt, gen)
    model.train()
    step = 0
    total, correct, history, first_loss = pos["total"], pos["correct"], pos["history"], pos["first_loss"]
    steps_per_epoch = -(-n // batch_size)
    with reporter.task(description, epochs) as task:
        task.advance(pos["epoch"])
        if history:
            _show_epoch(task, history[-1])
        for epoch in range(pos["epoch"], epochs):
            if pos["order"] is not None:
                order, lo0, total, correct = pos["order"], pos["lo"], pos["total"], pos["correct"]
                pos["order"] = None
            else:
                order, lo0, total, correct = torch.randperm(n, generator=gen), 0, 0.0, 0
            for lo in range(lo0, n, batch_size):
                idx = order[lo : lo + batch_size]
                opt.zero_grad(set_to_none=True)
                logits = forward(model, index_inputs(inputs, idx))  # [b, C]
                loss = loss_fn(logits, labels[idx])
                value = loss.item()
                first_loss = value if first_loss is None else first_loss
                check_loss(value, first_loss, name=name, step=epoch * steps_per_epoch + lo // batch_size + 1,
                           epoch=epoch + 1, lr=lr)
                loss.backward()
                opt.step()
                total += value * len(idx)
                correct += int((logits.detach().argmax(1) == labels[idx]).sum())
                step += 1
                seen = min(lo + batch_size, n)  # rows of this epoch so far
                task.update(loss=total / seen, acc=correct / seen)
                end_of_epoch = lo + batch_size >= n
                if end_of_epoch:
                    entry: dict[str, Any] = {"epoch": epoch + 1, "loss": total / n, "accuracy": correct / n}
                    if validation is not None:
                        entry["val_loss"], entry["val_accuracy"] = evaluate(
                            model, validation[0], validation[1], batch_size=batch_size
                        )
                    history.append(entry)
                    _show_epoch(task, entry)
                if resume_path is not None and (end_of_epoch or (checkpoint_every and step % checkpoint_every == 0)):
                    at = {"epoch": epoch + 1, "lo": 0} if end_of_epoch else {"epoch": epoch, "lo": lo + batch_size}
                    _save_training_state(
                        Path(resume_path), recipe, model, opt, gen, order, total, correct=correct, history=history,
                        first_loss=first_loss, **at,
                    )
            task.advance()
    if metrics is not None:
        metrics["final_loss"] = total / n
        metrics["optimizer_state_numel"] = optimizer_state_numel(opt)
        metrics["history"] = history
    if resume_path is not None:
        Path(resume_path).unlink(missing_ok=True)
    return model.eval()


def _show_epoch(task: Any, entry: dict[str, Any]) -> None:
    """Put a finished epoch's values on the progress bar (validation ones only when present)."""
    if "val_loss" in entry:
        task.update(val_loss=entry["val_loss"], val_acc=entry["val_accuracy"])


def evaluate(
    model: nn.Module, inputs: Inputs, labels: torch.Tensor, *, batch_size: int = 256
) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy of a classifier, without gradients, in eval mode.

    The model's train/eval mode is restored afterwards; no random numbers are drawn
    (by standard layers: dropout is off in eval mode), so calling this between
    training steps leaves the training unchanged.

    Args:
        model: classifier with logits ``[n, C]``, on the device of ``inputs``.
        inputs: ``[n, ...]`` float32 (or a dict of ``[n, L]`` tensors for a transformers model).
        labels: ``[n]`` int64 class labels, on the same device.
        batch_size: rows per forward pass (bounds the memory).

    Returns:
        ``(loss, accuracy)``: mean loss in nats, share of rows whose argmax logit is the label.
    """
    was_training = model.training
    model.eval()
    n = labels.shape[0]
    loss_sum, right = 0.0, 0
    try:
        with torch.no_grad():
            for lo in range(0, n, batch_size):
                hi = min(lo + batch_size, n)
                batch = slice_inputs(inputs, lo, hi)
                with forward_errors(model, batch):
                    logits = forward(model, batch)  # [b, C]
                loss_sum += nn.functional.cross_entropy(logits, labels[lo:hi], reduction="sum").item()
                right += int((logits.argmax(1) == labels[lo:hi]).sum())
    finally:
        model.train(was_training)
    return loss_sum / max(n, 1), right / max(n, 1)


def check_forward(model: nn.Module, inputs: Inputs, labels: torch.Tensor) -> None:
    """One forward pass of the first example (eval mode, no gradients) before training starts.

    Any exception of it (a shape the model rejects, a bug in the user's
    ``forward``) becomes one :class:`~trakcli.errors.DataError` line naming the
    file and line (:func:`trakcli.models.forward.forward_errors`), and every label
    must be one of the model's classes. Draws no random numbers (eval mode), so
    the training that follows is unchanged.

    Args:
        model: the classifier, logits ``[n, C]``.
        inputs: ``[n, ...]`` (or a dict of ``[n, L]`` tensors); labels: ``[n]`` int64.

    Raises:
        DataError: the forward pass raised, the logits are not ``[1, C]``, or a label is not in ``[0, C)``.
    """
    was_training = model.training
    model.eval()
    try:
        first = slice_inputs(inputs, 0, 1)
        with torch.no_grad(), forward_errors(model, first):
            logits = forward(model, first)  # [1, C]
        check_by_first(BUILTIN["classification"], logits, inputs, labels)
    finally:
        model.train(was_training)


def check_recipe(cfg: Config, *, purpose: str = "trak optimize") -> OptimizeConfig:
    """Refuse configs whose recipe cannot train: no recipe section, or the built-in recipe on an LM task.

    Args:
        cfg: a :class:`~trakcli.config.Config`.
        purpose: the command, for messages.

    Returns:
        ``cfg.recipe``, the flat :class:`~trakcli.config.OptimizeConfig` recipe (either spelling).

    Raises:
        ConfigError: no ``optimize:`` / ``training:`` section, or task ``language_modeling``
            with the built-in recipe (it trains classifiers; a ``training.entrypoint`` may train anything).
    """
    oc = cfg.recipe
    if oc is None:
        raise ConfigError(
            f"optimize: section missing; {purpose} needs the training recipe: add optimize: "
            "{n_models: 10, out_dir: ckpts, ...} (or training: + optimizer:)"
        )
    if oc.entrypoint is None and resolve_task(cfg.task).token_level:
        raise ConfigError(
            f"task: {purpose} trains classifiers (cross-entropy on [n, C] logits); task language_modeling is "
            "for featurize and score only: train the language model elsewhere and point checkpoints at it, "
            f"or give your own training function as {cfg.recipe_key}.entrypoint"
        )
    return oc


def check_init_checkpoint(oc: OptimizeConfig, key: str = "optimize") -> None:
    """Refuse a recipe whose ``init_checkpoint`` names no file, before any model trains.

    Args:
        oc: the flat recipe (``cfg.recipe``).
        key: the config section the user wrote it in (``cfg.recipe_key``).

    Raises:
        ConfigError: ``init_checkpoint`` is set and is not a file.
    """
    if oc.init_checkpoint is not None and not oc.init_checkpoint.is_file():
        raise ConfigError(
            f"{key}.init_checkpoint: file {str(oc.init_checkpoint)!r} does not exist; give a state dict of "
            "the model (.pt / .safetensors) or remove the key to train from scratch"
        )


def load_training_function(cfg: Config) -> Callable[..., Any] | None:
    """The user's training function of ``training.entrypoint`` (None: the built-in recipe).

    Resolved like ``model.entrypoint`` (:func:`trakcli.models.load_function`):
    ``"path/to/file.py:function"`` or ``"package.module:function"``.

    Raises:
        ModelError: the file or module cannot be imported, or has no such function.
    """
    oc = cfg.recipe
    if oc is None or oc.entrypoint is None:
        return None
    from trakcli.models.build import load_function

    return load_function(oc.entrypoint, key=f"{cfg.recipe_key}.entrypoint", builtins={})


def train_one(
    cfg: Config,
    inputs: Inputs,
    labels: torch.Tensor,
    *,
    seed: int,
    device: torch.device | str = "cpu",
    reporter: Reporter = NULL_REPORTER,
    description: str = "train",
    metrics: dict[str, Any] | None = None,
    resume_path: str | Path | None = None,
    validation: tuple[Inputs, torch.Tensor] | None = None,
    name: str | None = None,
) -> nn.Module:
    """Build, seed and train one model with the config's recipe: what `trak optimize` does for model i.

    Steps: ``torch.manual_seed(seed)``; build ``model.entrypoint`` with
    ``model.kwargs`` on ``device``; load ``optimize.init_checkpoint`` if set;
    then train it on ``(inputs, labels)``:

    * with ``optimize.entrypoint`` (``training.entrypoint``): call the user's
      function ``fn(model, inputs, labels, seed=seed, **optimize.kwargs)``; it
      trains the model in place (returns None) or returns the trained model;
    * else :func:`train_classifier` with the recipe's epochs, batch size,
      optimizer, lr, momentum, weight decay and projection, its minibatch
      order drawn with ``seed``.

    `trak optimize` trains model i with ``seed = optimize.seed + i``, so
    calling this with the same seed and rows reproduces its checkpoint.

    Args:
        cfg: a validated :class:`~trakcli.config.Config` with a recipe (``cfg.recipe``).
        inputs: ``[n, ...]`` float32 inputs on ``device`` (or a dict of ``[n, L]`` tensors for text).
        labels: ``[n]`` int64 class labels on ``device``.
        seed: seed of the initialization and of the minibatch order.
        device: where the model lives.
        reporter, description: progress of the built-in recipe (one step per epoch, with
            the running loss and accuracy).
        metrics: filled with ``final_loss``, ``optimizer_state_numel`` and the per-epoch
            ``history`` by the built-in recipe (see :func:`train_classifier`).
        resume_path: the built-in recipe's training-state file (see :func:`train_classifier`);
            the state is saved every ``optimize.checkpoint_every`` steps and at epoch ends.
        validation: ``(inputs, labels)`` on ``device``, evaluated after every epoch of the
            built-in recipe (``data.validation``); ignored by a ``training.entrypoint``.
        name: the model in messages (``"model 3"``); default ``description``.

    Returns:
        The trained model, in eval mode, on ``device``.

    Raises:
        ConfigError: no recipe (see :func:`check_recipe`).
        ModelError: the model or the training function cannot be loaded, or the
            training function returned something that is not an ``nn.Module``.
        UserCodeError: the model's entrypoint or the training function raised (file and line named).
        CheckpointError: ``init_checkpoint`` or the resume file cannot be read.
        DataError: the built-in recipe's first forward pass fails, or a label is not a class
            of the model (:func:`check_forward`).
        TrainingError: the training diverged (see :func:`train_classifier`), or it left
            non-finite weights (named).
    """
    from trakcli.models.build import build_model
    from trakcli.models.checkpoints import load_checkpoint

    oc = check_recipe(cfg)
    fn = load_training_function(cfg)
    torch.manual_seed(seed)
    model = build_model(cfg.model.entrypoint, **cfg.model.kwargs).to(device)
    if oc.init_checkpoint is not None:
        load_checkpoint(model, oc.init_checkpoint)
        model.to(device)
    name = name or description
    if fn is not None:
        with user_code(f"{cfg.recipe_key}.entrypoint {oc.entrypoint}"):
            out = fn(model, inputs, labels, seed=seed, **oc.kwargs)
        if out is None:
            out = model
        if not isinstance(out, nn.Module):
            raise ModelError(
                f"{cfg.recipe_key}.entrypoint {oc.entrypoint!r} returned a {type(out).__name__}; it must train "
                "the model in place and return None, or return the trained torch.nn.Module"
            )
        model = out.to(device).eval()
    else:
        projection = oc.projection.model_dump() if oc.projection is not None else None
        check_forward(model, inputs, labels)
        model = train_classifier(
            model, inputs, labels,
            epochs=oc.epochs, batch_size=oc.batch_size, lr=oc.lr, weight_decay=oc.weight_decay,
            momentum=oc.momentum, optimizer=oc.optimizer, seed=seed,
            reporter=reporter, description=description, projection=projection, metrics=metrics,
            resume_path=resume_path, checkpoint_every=oc.checkpoint_every, validation=validation, name=name,
        )
    if fn is not None:
        check_weights(model, name=name, how=f"{cfg.recipe_key}.entrypoint {oc.entrypoint}",
                      fix="check its learning rate and inputs")
    else:
        check_weights(model, name=name, how="training", fix=f"lower the learning rate (lr {oc.lr:g})")
    return model


def _save_training_state(
    path: Path, recipe, model, opt, gen, order, total, *, correct: int, history: list, first_loss: float | None,
    epoch: int, lo: int,
) -> None:
    """Write the training state atomically (plain tensors and numbers: loads with ``weights_only=True``)."""
    state = {
        "recipe": recipe,
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "generator": gen.get_state(),
        "torch_rng": torch.get_rng_state(),
        "order": order.cpu(),
        "epoch": epoch,
        "lo": lo,
        "total": total,
        "correct": correct,
        "history": history,
        "first_loss": first_loss,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(state, path)
    except OSError as e:
        raise TrainingError(
            f"cannot write the training state {path}: {e}; free disk space and rerun the same command, "
            "which resumes from the last state written"
        ) from None


def _load_training_state(path: Path, recipe, model, opt, gen) -> dict[str, Any]:
    from trakcli.errors import CheckpointError

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same problem for the user
        raise CheckpointError(
            f"cannot read the training state {str(path)!r} ({e.__class__.__name__}: {e}); delete it or "
            "rerun with --overwrite to start the model over"
        ) from None
    if state.get("recipe") != recipe:
        saved = state.get("recipe") or {}
        diff = sorted(k for k in set(saved) | set(recipe) if saved.get(k) != recipe.get(k))
        raise CheckpointError(
            f"the training state {str(path)!r} was made with another recipe (differs in: {', '.join(diff)}); "
            "rerun with the same settings to resume, or with --overwrite to start over"
        )
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    gen.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    at_epoch_start = state["lo"] == 0
    return {
        "epoch": state["epoch"],
        "lo": state["lo"],
        "total": state["total"],
        "correct": state.get("correct", 0),  # states written before trakcli recorded accuracy
        "order": None if at_epoch_start else state["order"],
        "history": list(state.get("history", [])),
        "first_loss": state.get("first_loss"),  # states written before the divergence check: the next step's
    }


def optimizer_state_numel(opt: torch.optim.Optimizer) -> int:
    """Floats an optimizer holds as state (tensors other than step counters)."""
    if hasattr(opt, "state_numel"):
        return int(opt.state_numel())
    return sum(
        v.numel() for st in opt.state.values() for k, v in st.items() if isinstance(v, torch.Tensor) and k != "step"
    )
