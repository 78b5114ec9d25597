"""``TrakCallback``: checkpoints, their AdamW state and a manifest, written while ``transformers.Trainer`` trains,
in the layout of `trak optimize` (what TrackStar-style attribution, Chang et al. 2025, and LESS-style selection,
Xia et al. 2024, read with ``second_moment.kind: adam``). This module imports transformers.
"""

from __future__ import annotations

import enum
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from trakcli.jobs.inputs import OPTIMIZER_STATE_DIR
from trakcli.errors import ArgumentError, ConfigError
from trakcli.gradients.second_moment import optimizer_state_record
from trakcli.files import atomic_torch_save
from trakcli.train import optimizer_param_names
from trakcli.models.peft import is_peft_model, save_adapter
from trakcli.store.manifest import (FORMAT, FORMAT_VERSION, MANIFEST_NAME, SOURCE_TRAINER, checkpoint_file_name,
                                    checkpoint_sha256, read_manifest, write_manifest)

#: The values of ``save``: after every ``every``-th epoch, or every ``every`` optimizer steps.
SAVE_WHEN = ("epoch", "steps")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside ``DistributedDataParallel`` / ``DataParallel`` (``.module``) and ``torch.compile``
    (``._orig_mod``) wrappers, whose ``named_parameters()`` are the names a trakcli model has."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (``.optimizer``, repeatedly), or None."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def _plain(obj: Any) -> Any:
    """``obj`` as JSON-able values: enums as their value, sets as sorted lists, other objects as strings."""
    if isinstance(obj, enum.Enum):
        return _plain(obj.value)
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return sorted(_plain(v) for v in obj)
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return str(obj)


#: The training arguments the manifest's ``recipe.trainer`` records (those that exist on the arguments object).
RECIPE_ARGS = ("learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size",
               "gradient_accumulation_steps", "optim", "lr_scheduler_type", "warmup_steps", "warmup_ratio",
               "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "seed", "data_seed", "bf16",
               "fp16", "max_length", "packing", "completion_only_loss", "assistant_only_loss")


class TrakCallback(TrainerCallback):
    """Writes checkpoints, their optimizer state and a trakcli manifest while a ``transformers.Trainer`` trains.

    Pass it to ``Trainer(..., callbacks=[TrakCallback("ckpts")])`` (or TRL's ``SFTTrainer``). At the
    saves it is asked for, on the main process only, it writes into ``out_dir``:

    * the model: a plain model's state dict on the CPU (``torch.save``, ``model_000_epoch1.pt``),
      loadable with :func:`trakcli.models.load_checkpoint`; a ``peft.PeftModel`` (what ``SFTTrainer``
      makes from a ``peft_config``) as its adapter folder (``save_pretrained``: ``adapter_config.json``
      and ``adapter_model.safetensors``, ``model_000_epoch1/``);
    * with ``save_optimizer_state``, ``optimizer_state/<the checkpoint's name>``: ``{"optimizer",
      "projection": None, "param_names", "state_dict"}``, the torch optimizer's ``state_dict()``
      (inside accelerate's wrapper) on the CPU, and ``param_names[i]`` the name in the unwrapped
      model's ``named_parameters()`` of optimizer index ``i`` (a PeftModel's names, e.g.
      ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``): what
      ``second_moment.kind: adam`` reads (:func:`trakcli.gradients.second_moment.read_second_moments`);
    * ``manifest.json`` (:mod:`trakcli.store.manifest`, with ``"source": "trainer"``), rewritten after every save: one
      model (model_id 0) whose ``epoch_checkpoints`` list the saves in training order and whose final checkpoint is the
      last save; ``complete: true`` once training ends (``on_train_end``), so a config with
      ``checkpoints: out_dir/manifest.json`` refuses the saves of an unfinished training. It records the Trainer's
      arguments (``recipe.trainer``), the model, the task and what is known of the training data.

    Every file is written atomically (a temporary file renamed into place), the manifest after the files it lists. A
    save at the last optimizer step (``state.max_steps``) is the final checkpoint ``model_000.pt`` (``model_000/`` for
    an adapter); training stopped early by another callback ends with the last save as the final checkpoint. A training
    resumed with ``trainer.train(resume_from_checkpoint=...)`` keeps the saves of the manifest up to the step it resumes
    from. One training per ``out_dir``: a new training from step 0 starts a new manifest.

    Args:
        out_dir: the folder to write to (created).
        save: ``"epoch"``: after every ``every``-th epoch (``on_epoch_end``); ``"steps"``: every
            ``every`` optimizer steps (``on_step_end``, ``state.global_step``).
        every: epochs or steps between saves, >= 1.
        save_optimizer_state: also write each save's optimizer state (needed by ``second_moment``).
        final: also save the model at the end of training when the last save was earlier (at the
            last step, or at ``on_train_end``); False: the last save is the final checkpoint.
        task: the trakcli task the manifest records (``"language_modeling"`` for causal LMs).

    Attributes:
        out_dir, save, every, save_optimizer_state, final, task: as given.
        saves: the manifest entries of this training's saves so far, in training order
            (``{"step", "epoch" (epoch saves), "checkpoint", "sha256", "optimizer_state"}``; main process).

    Raises:
        ArgumentError: ``save`` not one of :data:`SAVE_WHEN`, ``every`` below 1, ``out_dir`` not a
            folder that can be written (at the first save, naming the file and the fix), training
            under DeepSpeed or FSDP (sharded weights and optimizer state; at ``on_train_begin``), or
            ``save_optimizer_state`` without an optimizer in the callback's arguments.
    """

    def __init__(self, out_dir: str | Path, *, save: str = "epoch", every: int = 1,
                 save_optimizer_state: bool = True, final: bool = True, task: str = "language_modeling"):
        if save not in SAVE_WHEN:
            raise ArgumentError(f"TrakCallback save={save!r}: use \"epoch\" (after every `every`-th epoch) or "
                                "\"steps\" (every `every` optimizer steps)")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            unit = "epochs" if save == "epoch" else "optimizer steps"
            raise ArgumentError(f"TrakCallback every={every!r}: give a whole number of {unit} >= 1 between saves")
        self.out_dir = Path(out_dir)
        self.save, self.every = save, every
        self.save_optimizer_state, self.final, self.task = bool(save_optimizer_state), bool(final), task
        self.saves: list[dict[str, Any]] = []  # the manifest entries of this training's saves, in order
        self._header: dict[str, Any] = {}
        self._warned = False

    # -- the Trainer's events -------------------------------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """Refuse sharded training; on the main process start (or, resumed, continue) the manifest."""
        for key in ("deepspeed", "fsdp"):
            if getattr(args, key, None):
                raise ArgumentError(f"TrakCallback: training with {key} shards the weights and the optimizer state "
                                    f"over the processes, and the callback saves whole ones; train without {key} (one "
                                    "process or DDP), or save the model with the Trainer and its optimizer state with "
                                    "trakcli's format yourself")
        if not state.is_world_process_zero:
            return
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ArgumentError(f"TrakCallback out_dir {str(self.out_dir)!r} cannot be created: {e}; choose a "
                                "folder this process can write") from None
        self.saves = self._resumed_saves(state.global_step) if state.global_step > 0 else []
        model = unwrap_model(kwargs["model"]) if kwargs.get("model") is not None else None
        self._header = self._describe(args, state, model, kwargs.get("train_dataloader"),
                                      unwrap_optimizer(kwargs.get("optimizer")))
        self._write_manifest(state, complete=False)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """Save every ``every`` steps (``save="steps"``), and at the last step with ``final``."""
        if not state.is_world_process_zero:
            return
        last = state.max_steps and state.global_step >= state.max_steps or control.should_training_stop
        if self.final and last:  # the last step of the training, or another callback stops it
            self._save(state, kwargs)
        elif self.save == "steps" and state.global_step % self.every == 0:
            self._save(state, kwargs, step=state.global_step)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """Save after every ``every``-th epoch (``save="epoch"``)."""
        if not state.is_world_process_zero or self.save != "epoch":
            return
        epoch = max(1, math.ceil(round(float(state.epoch or 0), 6)))  # 1-based; a partial last epoch counts
        if epoch % self.every == 0:
            self._save(state, kwargs, epoch=epoch)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """With ``final``, save the model if the last save was earlier; mark the manifest complete."""
        if not state.is_world_process_zero:
            return
        if self.final and (not self.saves or self.saves[-1]["step"] != state.global_step):
            self._save(state, kwargs)
        if not self.saves:
            warnings.warn(f"TrakCallback: training ended without a save (save={self.save!r}, every={self.every}, "
                          f"final=False), so {self.out_dir / MANIFEST_NAME} lists no checkpoint; lower `every` or set "
                          "final=True", stacklevel=2)
            return
        history = [_plain(h) for h in state.log_history if "loss" in h or "train_loss" in h]
        self._write_manifest(state, complete=True, history=history)

    # -- saving -----------------------------------------------------------------------------------------------------

    def _save(self, state: TrainerState, kwargs: dict[str, Any], *, epoch: int | None = None,
              step: int | None = None) -> None:
        """Write the model (and its optimizer state) at this step, then the manifest; once per step."""
        if self.saves and self.saves[-1]["step"] == state.global_step:
            return  # saved at this step already (the last step is also an epoch's end)
        model = kwargs.get("model")
        if model is None:
            raise ArgumentError("TrakCallback: the Trainer passed no model to the callback; use it with "
                                "transformers.Trainer (or a subclass such as trl.SFTTrainer)")
        model = unwrap_model(model)
        adapter = is_peft_model(model)
        final = bool(state.max_steps) and state.global_step >= state.max_steps or epoch is None and step is None
        name = checkpoint_file_name(0, adapter=adapter) if final else checkpoint_file_name(
            0, epoch=epoch, step=step, adapter=adapter)
        path = self.out_dir / name
        entry: dict[str, Any] = {"step": int(state.global_step)}
        if epoch is not None:
            entry["epoch"] = int(epoch)
        elif final and state.epoch is not None and round(float(state.epoch), 6).is_integer():
            entry["epoch"] = int(round(float(state.epoch), 6))  # the final checkpoint: its epoch, when one just ended
        self._write_model(model, path)
        entry.update(checkpoint=name, sha256=checkpoint_sha256(path))
        if self.save_optimizer_state:
            optimizer = unwrap_optimizer(kwargs.get("optimizer"))
            if optimizer is None:
                raise ArgumentError("TrakCallback: save_optimizer_state=True but the Trainer passed no torch optimizer "
                                    f"to the callback (got {type(kwargs.get('optimizer')).__name__}); set "
                                    "save_optimizer_state=False")
            self._write_optimizer_state(model, optimizer, path)
            entry["optimizer_state"] = f"{OPTIMIZER_STATE_DIR}/{name}"
        self.saves = [s for s in self.saves if s["checkpoint"] != name] + [entry]
        self._write_manifest(state, complete=False)

    def _write_model(self, model: nn.Module, path: Path) -> None:
        """The state dict on the CPU at ``path`` (atomically), or a PeftModel's adapter folder."""
        try:
            if is_peft_model(model):
                save_adapter(model, path)
            else:
                atomic_torch_save({k: v.detach().cpu() for k, v in model.state_dict().items()}, path)
        except OSError as e:
            raise _write_error(f"cannot write the checkpoint {str(path)!r}: {e}") from None

    def _write_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
        """``out_dir/optimizer_state/<checkpoint's name>`` in the format `trak optimize` writes, atomically."""
        path = checkpoint.parent / OPTIMIZER_STATE_DIR / checkpoint.name
        state_dict = optimizer.state_dict()
        if not self._warned and not any("exp_avg_sq" in s for s in state_dict["state"].values()):
            self._warned = True
            warnings.warn(f"TrakCallback: the optimizer {type(optimizer).__name__} keeps no exp_avg_sq (Adam's second "
                          "moments); its state is written, but second_moment: adam / adafactor reads AdamW's: train "
                          "with optim=\"adamw_torch\" (or another AdamW) to use them", stacklevel=3)
        state = optimizer_state_record(type(optimizer).__name__.lower(), None,
                                       optimizer_param_names(model, optimizer), state_dict)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_torch_save(state, path)
        except OSError as e:
            raise _write_error(f"cannot write the optimizer state {str(path)!r}: {e}") from None

    # -- the manifest ---------------------------------------------------------------------------------------------

    def _write_manifest(self, state: TrainerState, *, complete: bool, history: list | None = None) -> None:
        """``out_dir/manifest.json`` of the saves so far (atomically): the last one is the final checkpoint."""
        models = []
        if self.saves:
            *earlier, last = self.saves
            model: dict[str, Any] = {"model_id": 0, **last, "seed": self._header.get("recipe", {}).get(
                "trainer", {}).get("seed"), "origin": "trainer"}
            if earlier:
                model["epoch_checkpoints"] = earlier
            if history is not None:
                model["metrics"] = {"history": history}
            models.append(model)
        manifest = {**self._header, "complete": bool(complete and models), "models": models}
        try:
            write_manifest(self.out_dir / MANIFEST_NAME, manifest)
        except ConfigError as e:
            raise _write_error(e.problems[0].split(": ", 1)[-1]) from None

    def _resumed_saves(self, global_step: int) -> list[dict[str, Any]]:
        """The saves an earlier run of this training recorded in ``out_dir``'s manifest up to ``global_step``
        (a training resumed from a Trainer checkpoint), whose files are still there."""
        try:
            old = read_manifest(self.out_dir / MANIFEST_NAME, key="TrakCallback out_dir")
        except ConfigError:
            return []
        if old.get("source") != SOURCE_TRAINER or not old["models"]:
            return []
        model = old["models"][0]
        listed = list(model.get("epoch_checkpoints") or [])
        listed.append({k: model[k] for k in ("step", "epoch", "checkpoint", "sha256", "optimizer_state") if k in model})
        return [s for s in listed if isinstance(s.get("step"), int) and s["step"] <= global_step
                and (self.out_dir / s["checkpoint"]).exists()]

    def _describe(self, args: TrainingArguments, state: TrainerState, model: nn.Module | None, loader: Any,
                  optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """The manifest's fields besides ``complete`` and ``models``: format, recipe, model, task, data."""
        from trakcli import __version__

        trainer = {k: _plain(getattr(args, k)) for k in RECIPE_ARGS if hasattr(args, k)}
        trainer.update(arguments=type(args).__name__, world_size=int(getattr(args, "world_size", 1) or 1),
                       max_steps=int(state.max_steps or 0),
                       optimizer=type(optimizer).__name__ if optimizer is not None else None)
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION, "trakcli_version": __version__,
            "source": SOURCE_TRAINER, "n_models": 1, "complete": False,
            "recipe": {"trainer": trainer, "callback": {"save": self.save, "every": self.every,
                                                        "save_optimizer_state": self.save_optimizer_state,
                                                        "final": self.final}},
            "model": _describe_model(model), "task": self.task,
            "train_data": _describe_data(getattr(loader, "dataset", None)), "validation_data": None,
        }


def _write_error(problem: str) -> ArgumentError:
    return ArgumentError(f"TrakCallback out_dir: {problem}; free disk space or give TrakCallback another out_dir")


def _describe_model(model: nn.Module | None) -> dict[str, Any] | None:
    """The model's class, ``name_or_path``, parameter counts and, for a PeftModel, the adapter's config."""
    if model is None:
        return None
    base = model.get_base_model() if is_peft_model(model) else model
    config = getattr(base, "config", None)
    out: dict[str, Any] = {"class": type(base).__name__, "name_or_path": getattr(config, "_name_or_path", None) or None,
                           "n_params": sum(p.numel() for p in model.parameters()),
                           "n_trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    if is_peft_model(model):
        adapter = model.peft_config.get(model.active_adapter)
        out["adapter"] = _plain(adapter.to_dict() if hasattr(adapter, "to_dict") else adapter)
    return out


def _describe_data(dataset: Any) -> dict[str, Any] | None:
    """What is known of the training dataset: rows, columns, a ``datasets`` fingerprint."""
    if dataset is None:
        return None
    out: dict[str, Any] = {"class": type(dataset).__name__}
    try:
        out["n"] = len(dataset)
    except TypeError:  # an iterable dataset
        pass
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, list):
        out["columns"] = [str(c) for c in columns]
    fingerprint = getattr(dataset, "_fingerprint", None)
    if isinstance(fingerprint, str):
        out["fingerprint"] = fingerprint
    return out
