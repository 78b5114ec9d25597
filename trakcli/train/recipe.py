"""One model trained with a config's recipe (:func:`train_one`): what `trak optimize` does for model i, and
`trak eval` retrains; the checks that refuse a recipe that cannot train before any model trains."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from trakcli.config import Config, OptimizeConfig
from trakcli.data.tensors import Inputs
from trakcli.errors import ConfigError, ModelError, user_code
from trakcli.progress import NULL_REPORTER, Reporter
from trakcli.tasks import resolve_task
from trakcli.train.divergence import check_weights
from trakcli.train.replay import ReplayRecorder
from trakcli.train.evaluate import check_forward
from trakcli.train.rows import DatasetRows, TensorRows, TrainRows
from trakcli.train.trainer import Recipe, Trainer


def check_recipe(cfg: Config, *, purpose: str = "trak optimize") -> OptimizeConfig:
    """``cfg.recipe``; a :class:`ConfigError` (naming the command ``purpose``) without an ``optimize:`` section."""
    oc = cfg.recipe
    if oc is None:
        example = "{n_models: 10, out_dir: ckpts, ...}" if purpose == "trak optimize" else "{epochs: 20, lr: 0.05, ...}"
        raise ConfigError(f"optimize: section missing; {purpose} needs the training recipe: add optimize: {example} "
                          "for the built-in recipe, or optimize: {entrypoint: train.py:train} to train with your own "
                          "function (called as train(model, inputs, labels, seed=...))")
    return oc


def check_init_checkpoint(oc: OptimizeConfig) -> None:
    """Refuse (:class:`ConfigError`) a recipe whose ``init_checkpoint`` names no file, before any model trains."""
    if oc.init_checkpoint is not None and not oc.init_checkpoint.is_file():
        raise ConfigError(f"optimize.init_checkpoint: file {str(oc.init_checkpoint)!r} does not exist; give a state "
                          "dict of the model (.pt / .safetensors) or remove the key to train from scratch")


def load_training_function(cfg: Config) -> Callable[..., Any] | None:
    """The user's training function of ``optimize.entrypoint``, resolved like ``model.entrypoint`` (None: the
    built-in recipe).

    Raises:
        ModelError: the file or module cannot be imported, or has no such function.
    """
    oc = cfg.recipe
    if oc is None or oc.entrypoint is None:
        return None
    from trakcli.models.build import load_function

    return load_function(oc.entrypoint, key="optimize.entrypoint", builtins={})


@dataclass
class Trained:
    """One model trained by :func:`train_one` (in eval mode, on the training device), with the built-in recipe's
    :meth:`~trakcli.train.trainer.Trainer.metrics` and :meth:`~trakcli.train.trainer.Trainer.optimizer_state`
    (empty and None for an ``optimize.entrypoint``)."""

    model: nn.Module
    metrics: dict[str, Any] = field(default_factory=dict)
    optimizer_state: dict[str, Any] | None = None


def train_one(
    cfg: Config,
    inputs: Inputs | TrainRows,
    labels: torch.Tensor | None = None,
    *,
    seed: int,
    device: torch.device | str = "cpu",
    reporter: Reporter = NULL_REPORTER,
    description: str = "train",
    resume_path: str | Path | None = None,
    validation: Any = None,
    name: str | None = None,
    epoch_end: Callable[[int, nn.Module, torch.optim.Optimizer], None] | None = None,
    replay: ReplayRecorder | None = None,
) -> Trained:
    """Build, seed and train one model with the config's recipe: what `trak optimize` does for model i.

    ``torch.manual_seed(seed)``; build ``model.entrypoint`` with ``model.kwargs`` on ``device``; load
    ``optimize.init_checkpoint`` if set; add LoRA if set; then train on ``(inputs, labels)`` (or the rows
    ``inputs``): with ``optimize.entrypoint`` by ``fn(model, inputs, labels, seed=seed, **optimize.kwargs)``
    (lazily read rows given padded, as tensors), which trains in place (returning None) or returns the trained
    model; else by a :class:`~trakcli.train.trainer.Trainer` with the task's loss and the recipe, its order drawn
    with ``seed``. `trak optimize` trains model i with ``seed = optimize.seed + i``.

    Args:
        cfg: a validated :class:`~trakcli.config.Config` with a recipe.
        inputs, labels: ``[n, ...]`` inputs (or a dict of ``[n, L]`` tensors) and ``[n]`` / ``[n, L]`` labels on
            ``device``, or the rows (:class:`TensorRows`, :class:`DatasetRows`) without labels.
        seed: seed of the initialization and of the minibatch order.
        reporter, description: progress, and a line for each slow phase.
        resume_path, epoch_end, replay: the built-in recipe's, as :meth:`Trainer.fit
            <trakcli.train.trainer.Trainer.fit>`.
        validation: evaluated after every epoch of the built-in recipe (``data.validation``).
        name: the model in messages (``"model 3"``); default ``description``.

    Raises:
        ConfigError: no recipe.
        ModelError: the model or the training function cannot be loaded, or the function returned no ``nn.Module``.
        UserCodeError: the model's entrypoint or the training function raised.
        CheckpointError: ``init_checkpoint`` or the resume file cannot be read.
        DataError: the first forward pass fails, or a label does not fit the logits.
        TrainingError: the training diverged, or left non-finite weights.
    """
    from trakcli.models.build import build_model
    from trakcli.models.checkpoints import load_checkpoint

    oc = check_recipe(cfg)
    fn = load_training_function(cfg)
    torch.manual_seed(seed)
    name = name or description
    reporter.phase(f"{name}: building the model {cfg.model.entrypoint} …")
    model = build_model(cfg.model.entrypoint, **cfg.model.kwargs).to(device)
    if oc.init_checkpoint is not None:
        reporter.phase(f"{name}: loading optimize.init_checkpoint {oc.init_checkpoint} …")
        load_checkpoint(model, oc.init_checkpoint)
        model.to(device)
    if oc.lora is not None:
        from trakcli.models.peft import add_lora

        model = add_lora(model, **oc.lora.model_dump())
    rows = inputs if isinstance(inputs, TrainRows) else TensorRows(inputs, labels)
    if fn is not None:
        inputs, labels = rows.padded() if isinstance(rows, DatasetRows) else (rows.inputs, rows.labels)
        with user_code(f"optimize.entrypoint {oc.entrypoint}"), reporter.phase(
            f"{name}: training with optimize.entrypoint {oc.entrypoint} …"
        ):
            out = fn(model, inputs, labels, seed=seed, **oc.kwargs)
        out = model if out is None else out
        if not isinstance(out, nn.Module):
            raise ModelError(f"optimize.entrypoint {oc.entrypoint!r} returned a {type(out).__name__}; it must train "
                             "the model in place and return None, or return the trained torch.nn.Module")
        model = out.to(device).eval()
        check_weights(model, name=name, how=f"optimize.entrypoint {oc.entrypoint}",
                      fix="check its learning rate and inputs")
        return Trained(model)
    task = resolve_task(cfg.task)
    reporter.phase(f"{name}: a first forward pass, and counting the optimizer steps …")
    check_forward(model, rows, task=task)
    trainer = Trainer(model, rows, Recipe.from_config(oc, max_tokens=cfg.data.batch_tokens), task=task, seed=seed,
                      validation=validation, name=name)
    model = trainer.fit(reporter=reporter, description=description, resume_path=resume_path, epoch_end=epoch_end,
                        replay=replay)
    check_weights(model, name=name, how="training", fix=f"lower the learning rate (lr {oc.lr:g})")
    return Trained(model, trainer.metrics(), trainer.optimizer_state())
