"""One model trained with a config's recipe: what `trak optimize` does for model i, and `trak eval` retrains.

:func:`train_one` builds, seeds and trains one model with a config's recipe (``optimize:``,
through a :class:`~trakcli.train.trainer.Trainer`) or with the user's ``optimize.entrypoint``;
`trak optimize` (:func:`trakcli.jobs.optimize.optimize`) and the retraining of `trak eval` both
call it. :func:`check_recipe`, :func:`check_init_checkpoint` and :func:`load_training_function`
refuse a recipe that cannot train before any model trains.
"""

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
    """Refuse configs whose recipe cannot train: no recipe section.

    Args:
        cfg: a :class:`~trakcli.config.Config`.
        purpose: the command, for messages.

    Returns:
        ``cfg.recipe``, the :class:`~trakcli.config.OptimizeConfig` recipe.

    Raises:
        ConfigError: no ``optimize:`` section.
    """
    oc = cfg.recipe
    if oc is None:
        example = "{n_models: 10, out_dir: ckpts, ...}" if purpose == "trak optimize" else "{epochs: 20, lr: 0.05, ...}"
        raise ConfigError(
            f"optimize: section missing; {purpose} needs the training recipe: add optimize: {example} for the "
            "built-in recipe, or optimize: {entrypoint: train.py:train} to train with your own function "
            "(called as train(model, inputs, labels, seed=...))"
        )
    return oc


def check_init_checkpoint(oc: OptimizeConfig) -> None:
    """Refuse a recipe whose ``init_checkpoint`` names no file, before any model trains.

    Args:
        oc: the recipe (``cfg.recipe``).

    Raises:
        ConfigError: ``init_checkpoint`` is set and is not a file.
    """
    if oc.init_checkpoint is not None and not oc.init_checkpoint.is_file():
        raise ConfigError(
            f"optimize.init_checkpoint: file {str(oc.init_checkpoint)!r} does not exist; give a state dict of "
            "the model (.pt / .safetensors) or remove the key to train from scratch"
        )


def load_training_function(cfg: Config) -> Callable[..., Any] | None:
    """The user's training function of ``optimize.entrypoint`` (None: the built-in recipe).

    Resolved like ``model.entrypoint`` (:func:`trakcli.models.load_function`):
    ``"path/to/file.py:function"`` or ``"package.module:function"``.

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
    """One model trained by :func:`train_one`.

    Attributes:
        model: the trained model, in eval mode, on the training device.
        metrics: the built-in recipe's ``final_loss``, ``optimizer_state_numel`` and per-epoch
            ``history`` (:meth:`~trakcli.train.trainer.Trainer.metrics`); empty for an ``optimize.entrypoint``.
        optimizer_state: the built-in recipe's final optimizer ``state_dict`` and ``param_names``
            (:meth:`~trakcli.train.trainer.Trainer.optimizer_state`); ``None`` for an ``optimize.entrypoint``,
            which keeps its optimizer to itself.
    """

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

    Steps: ``torch.manual_seed(seed)``; build ``model.entrypoint`` with
    ``model.kwargs`` on ``device``; load ``optimize.init_checkpoint`` if set;
    then train it on ``(inputs, labels)`` (or the rows ``inputs``):

    * with ``optimize.entrypoint``: call the user's
      function ``fn(model, inputs, labels, seed=seed, **optimize.kwargs)`` (lazily
      read rows are given to it padded, as tensors); it trains the model in place
      (returns None) or returns the trained model;
    * else a :class:`~trakcli.train.trainer.Trainer` with the task's loss (``cfg.task``) and the
      recipe (:meth:`Recipe.from_config <trakcli.train.trainer.Recipe.from_config>`: epochs, batch size,
      optimizer, lr and its schedule, momentum, weight decay and projection), its minibatch order drawn
      with ``seed``; batches of lazily read text hold at most ``data.batch_tokens`` padded tokens.

    `trak optimize` trains model i with ``seed = optimize.seed + i``, so
    calling this with the same seed and rows reproduces its checkpoint.

    Args:
        cfg: a validated :class:`~trakcli.config.Config` with a recipe (``cfg.recipe``).
        inputs: ``[n, ...]`` float32 inputs on ``device`` (or a dict of ``[n, L]`` tensors for text), or the
            rows (:class:`TensorRows`; :class:`DatasetRows` of lazily read text, batches moved to ``device``).
        labels: ``[n]`` int64 class labels or ``[n, L]`` per-token labels on ``device`` (with tensor ``inputs``).
        seed: seed of the initialization and of the minibatch order.
        device: where the model lives.
        reporter, description: progress of the built-in recipe (one step per optimizer step, with
            the epoch and its running loss and accuracy), and a line for each slow phase (building
            the model, a training function's whole run).
        resume_path: the built-in recipe's training-state file (see
            :meth:`Trainer.fit <trakcli.train.trainer.Trainer.fit>`); the state is saved every
            ``optimize.checkpoint_every`` steps and at epoch ends.
        validation: ``(inputs, labels)`` on ``device`` or a dataset, evaluated after every epoch of the
            built-in recipe (``data.validation``); ignored by a ``optimize.entrypoint``.
        name: the model in messages (``"model 3"``); default ``description``.
        epoch_end: called by the built-in recipe after every epoch (see
            :meth:`Trainer.fit <trakcli.train.trainer.Trainer.fit>`).
        replay: the built-in recipe's replay recorder (``optimize.replay``, :mod:`trakcli.train.replay`); None:
            no record.

    Returns:
        The trained model (in eval mode, on ``device``), with the built-in recipe's metrics and
        optimizer state (:class:`Trained`).

    Raises:
        ConfigError: no recipe (see :func:`check_recipe`).
        ModelError: the model or the training function cannot be loaded, or the
            training function returned something that is not an ``nn.Module``.
        UserCodeError: the model's entrypoint or the training function raised (file and line named).
        CheckpointError: ``init_checkpoint`` or the resume file cannot be read.
        DataError: the built-in recipe's first forward pass fails, or a label does not fit the
            model's logits (:func:`~trakcli.train.evaluate.check_forward`).
        TrainingError: the training diverged (see :meth:`Trainer.fit <trakcli.train.trainer.Trainer.fit>`),
            or it left non-finite weights (named).
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
        if isinstance(inputs, DatasetRows):
            inputs, labels = inputs.padded()
        elif isinstance(inputs, TensorRows):
            inputs, labels = inputs.inputs, inputs.labels
        with user_code(f"optimize.entrypoint {oc.entrypoint}"), reporter.phase(
            f"{name}: training with optimize.entrypoint {oc.entrypoint} …"
        ):
            out = fn(model, inputs, labels, seed=seed, **oc.kwargs)
        if out is None:
            out = model
        if not isinstance(out, nn.Module):
            raise ModelError(
                f"optimize.entrypoint {oc.entrypoint!r} returned a {type(out).__name__}; it must train "
                "the model in place and return None, or return the trained torch.nn.Module"
            )
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
