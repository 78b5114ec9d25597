"""The built-in recipe: a :class:`Trainer` trains one model with the task's loss (:class:`Recipe`: the steps'
settings), holding its position (:class:`TrainState`) and resuming it bit-identically from a training-state file."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from trakcli.config import OptimizeConfig
from trakcli.errors import CheckpointError
from trakcli.files import save_training_file
from trakcli.models.forward import forward
from trakcli.progress import NULL_REPORTER, Reporter
from trakcli.tasks import Task, make_batch, resolve_task
from trakcli.train.divergence import check_loss
from trakcli.train.evaluate import validate
from trakcli.train.optimizers import lr_at, make_optimizer, optimizer_param_names, optimizer_state_numel
from trakcli.train.replay import ReplayRecorder
from trakcli.train.rows import DatasetRows, TrainRows, count_steps


@dataclass(frozen=True)
class Recipe:
    """The settings of the built-in recipe that shape its steps: the ``optimize:`` keys of the same names, and
    ``max_tokens`` (``data.batch_tokens``: most padded tokens per batch of :class:`~trakcli.train.rows.DatasetRows`)."""

    epochs: int
    batch_size: int
    lr: float
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    schedule: str = "constant"
    warmup_steps: int = 0
    warmup_fraction: float = 0.0
    projection: dict[str, Any] | None = None
    max_tokens: int | None = None
    checkpoint_every: int = 0

    @classmethod
    def from_config(cls, oc: OptimizeConfig, *, max_tokens: int | None = None) -> Recipe:
        """The recipe of a validated ``optimize:`` section, with the data's token budget ``data.batch_tokens``."""
        return cls(epochs=oc.epochs, batch_size=oc.batch_size, lr=oc.lr, optimizer=oc.optimizer, momentum=oc.momentum,
                   weight_decay=oc.weight_decay, schedule=oc.schedule, warmup_steps=oc.warmup_steps,
                   warmup_fraction=oc.warmup_fraction,
                   projection=oc.projection.model_dump() if oc.projection is not None else None,
                   max_tokens=max_tokens, checkpoint_every=oc.checkpoint_every)


@dataclass
class TrainState:
    """Where a training stands: what a training-state file holds besides the model, optimizer and generators."""

    epoch: int = 0  # epochs finished
    lo: int = 0  # rows of the current epoch done
    total: float = 0.0  # the current epoch's summed loss (loss x its terms)
    correct: int = 0  # the current epoch's right predictions (classifiers)
    units: int = 0  # the current epoch's loss terms (rows, or target tokens)
    step: int = 0  # optimizer steps over all epochs
    order: torch.Tensor | None = None  # the current epoch's row order; None at an epoch's start
    history: list[dict[str, Any]] = field(default_factory=list)  # one dict per finished epoch
    first_loss: float | None = None  # the divergence check's reference


class Trainer:
    """Train ``model`` in place on ``data`` with the task's loss (:meth:`trakcli.tasks.Task.loss`).

    The optimizer, the schedule's step count and the shuffling generator (seeded with ``seed``, one
    permutation per epoch) are set up here, once; :meth:`fit` runs the steps. ``validation`` (tensors
    ``(inputs, labels)`` or a dataset) is evaluated after every epoch without changing the training;
    ``name`` names the model in messages. The model draws no numbers from the global generator here.

    Raises:
        ValueError: an unknown optimizer or schedule.
        OptimizerError: projection settings the model cannot use.
    """

    def __init__(self, model: nn.Module, data: TrainRows, recipe: Recipe, *, task: Task | str = "classification",
                 seed: int = 0, validation: Any = None, name: str = "the model"):
        r = recipe
        self.model, self.data, self.recipe, self.seed = model, data, recipe, seed
        self.task = resolve_task(task)
        self.validation, self.name = validation, name
        self.generator = torch.Generator().manual_seed(seed)
        self.optimizer = make_optimizer(r.optimizer, [p for p in model.parameters() if p.requires_grad], lr=r.lr,
                                        momentum=r.momentum, weight_decay=r.weight_decay, projection=r.projection)
        self.scheduled = r.schedule != "constant" or bool(r.warmup_steps) or bool(r.warmup_fraction)
        self.total_steps = 0
        self.warmup_steps = r.warmup_steps
        if self.scheduled:
            self.total_steps = count_steps(data, epochs=r.epochs, batch_size=r.batch_size, max_tokens=r.max_tokens,
                                           seed=seed)
            if r.warmup_fraction:
                self.warmup_steps = math.ceil(r.warmup_fraction * self.total_steps)
        self.state = TrainState()

    def identity(self) -> dict[str, Any]:
        """What a training-state file records of the recipe; a file with another identity is not resumed."""
        r = self.recipe
        out: dict[str, Any] = {"epochs": r.epochs, "batch_size": r.batch_size, "lr": r.lr,
                               "weight_decay": r.weight_decay, "momentum": r.momentum, "optimizer": r.optimizer,
                               "seed": self.seed, "projection": r.projection, "n": self.data.n}
        # the schedule and the token budget are recorded when they shape the training
        if self.scheduled:
            out.update(schedule=r.schedule, warmup_steps=self.warmup_steps)
        if r.max_tokens is not None and isinstance(self.data, DatasetRows):
            out["max_tokens"] = r.max_tokens
        return out

    def fit(self, *, reporter: Reporter = NULL_REPORTER, description: str = "train",
            resume_path: str | Path | None = None,
            epoch_end: Callable[[int, nn.Module, torch.optim.Optimizer], None] | None = None,
            replay: ReplayRecorder | None = None) -> nn.Module:
        """Run the training's steps (those left after the training-state file's position); the model, in eval mode.

        The progress task counts optimizer steps over all epochs and shows the ``epoch``, the running ``loss``,
        ``acc`` (classifiers), ``lr`` (a schedule) and the last epoch's ``val_loss`` / ``val_acc``.

        Args:
            reporter, description: where the progress goes, and its task's name.
            resume_path: the training-state file, written atomically every ``recipe.checkpoint_every`` steps
                and at every epoch end, deleted when training ends; resumed from (bit-identically) if it exists.
            epoch_end: called as ``epoch_end(epoch, model, optimizer)`` (1-based) after every finished epoch,
                before its state is saved (a kill between the two repeats the call on resume).
            replay: records what an exact replay needs (:mod:`trakcli.train.replay`), training with
                ``torch.use_deterministic_algorithms`` (restored after).

        Raises:
            CheckpointError: the resume file cannot be read or was made with another recipe.
            TrainingError: a step's loss diverged (:func:`trakcli.train.divergence.check_loss`), or the training
                state cannot be written.
            DataError: a row of lazily read data cannot be read or tokenized.
        """
        model, data, r = self.model, self.data, self.recipe
        if resume_path is not None and Path(resume_path).exists():
            self.load_state(Path(resume_path))
        model.train()
        total_steps = self.total_steps or count_steps(data, epochs=r.epochs, batch_size=r.batch_size,
                                                      max_tokens=r.max_tokens, seed=self.seed)
        import torch.utils.deterministic as det

        deterministic, fill = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
        if replay is not None:
            replay.start(total_steps)
            torch.use_deterministic_algorithms(True, warn_only=True)
            det.fill_uninitialized_memory = False  # NaN-filling every empty tensor changes no result, only time
        try:
            self._steps(reporter, description, resume_path, epoch_end, replay, total_steps)
        finally:
            torch.use_deterministic_algorithms(deterministic)
            det.fill_uninitialized_memory = fill
        if replay is not None:
            replay.finish(self.replay_info(total_steps))
        if resume_path is not None:
            Path(resume_path).unlink(missing_ok=True)
        return model.eval()

    def replay_info(self, total_steps: int) -> dict[str, Any]:
        """What a replay record says of the steps: the recipe, every step's learning rate, the row count and the
        trainable parameters (name, dtype, shape, in the optimizer's order)."""
        r = self.recipe
        lrs = [self._lr(t) for t in range(1, total_steps + 1)]
        names = optimizer_param_names(self.model, self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return {"recipe": {**self.identity(), "schedule": r.schedule, "warmup_steps": self.warmup_steps,
                           "max_tokens": r.max_tokens},
                "total_steps": total_steps, "n": self.data.n, "lrs": lrs,
                "params": [{"name": k, "dtype": str(p.dtype).replace("torch.", ""), "shape": list(p.shape)}
                           for k, p in zip(names, params)]}

    def _lr(self, step: int) -> float:
        r = self.recipe
        if not self.scheduled:
            return r.lr
        return lr_at(step, lr=r.lr, total_steps=self.total_steps, schedule=r.schedule, warmup_steps=self.warmup_steps)

    def _steps(self, reporter: Reporter, description: str, resume_path: str | Path | None,
               epoch_end: Callable[[int, nn.Module, torch.optim.Optimizer], None] | None,
               replay: ReplayRecorder | None, total_steps: int) -> None:
        model, data, r, task, s = self.model, self.data, self.recipe, self.task, self.state
        opt, n = self.optimizer, data.n
        saves = 0  # steps since this call started, for checkpoint_every
        with_acc = task.has_accuracy
        device = next(iter(model.parameters())).device if replay is not None else None
        with reporter.task(description, total_steps) as bar:
            bar.advance(min(s.step, total_steps))  # a resumed training's steps done
            if s.history:
                _show_epoch(bar, s.history[-1])
            for epoch in range(s.epoch, r.epochs):
                bar.update(epoch=f"{epoch + 1}/{r.epochs}")
                if s.order is None:
                    s.order, s.lo, s.total, s.correct, s.units = torch.randperm(n, generator=self.generator), 0, 0.0, 0, 0
                s.epoch = epoch
                if replay is not None:
                    replay.epoch_order(epoch + 1, s.order)
                for rows, x, y in data.batches(s.order, s.lo, r.batch_size, r.max_tokens):
                    if replay is not None:
                        replay.before_step(s.step, epoch, s.lo, model, opt, device)
                    s.step += 1
                    saves += 1
                    step_lr = self._lr(s.step)
                    if self.scheduled:
                        for group in opt.param_groups:
                            group["lr"] = step_lr
                    opt.zero_grad(set_to_none=True)
                    logits = forward(model, x)  # [b, C] or [b, L, V]
                    batch = make_batch(x, y)
                    loss = task.loss(logits, batch)
                    value = loss.item()
                    s.first_loss = value if s.first_loss is None else s.first_loss
                    check_loss(value, s.first_loss, name=self.name, step=s.step, epoch=epoch + 1, lr=step_lr)
                    loss.backward()
                    opt.step()
                    count = task.loss_count(batch)
                    s.total += value * count
                    s.units += count
                    if with_acc:
                        s.correct += task.correct(logits, batch)
                    s.lo += rows
                    shown: dict[str, Any] = {"loss": s.total / max(s.units, 1)}
                    if with_acc:
                        shown["acc"] = s.correct / s.lo
                    if self.scheduled:
                        shown["lr"] = step_lr
                    bar.update(**shown)
                    bar.advance()
                    end_of_epoch = s.lo >= n
                    if end_of_epoch:
                        entry: dict[str, Any] = {"epoch": epoch + 1, "loss": s.total / max(s.units, 1)}
                        if with_acc:
                            entry["accuracy"] = s.correct / n
                        if self.validation is not None:
                            val_loss, val_acc = validate(model, self.validation, task, r.batch_size, r.max_tokens)
                            entry["val_loss"] = val_loss
                            if val_acc is not None:
                                entry["val_accuracy"] = val_acc
                        s.history.append(entry)
                        _show_epoch(bar, entry)
                        if epoch_end is not None:
                            epoch_end(epoch + 1, model, opt)
                            model.train()
                    if resume_path is not None and (end_of_epoch or (r.checkpoint_every and saves % r.checkpoint_every == 0)):
                        at = (epoch + 1, 0) if end_of_epoch else (epoch, s.lo)
                        self.save_state(Path(resume_path), epoch=at[0], lo=at[1])
                s.epoch, s.order = epoch + 1, None

    def metrics(self) -> dict[str, Any]:
        """``final_loss`` (the last epoch's mean), ``optimizer_state_numel`` and ``history``: per epoch ``epoch``
        (1-based), ``loss``, for classifiers ``accuracy`` (in train mode), and ``val_loss`` / ``val_accuracy``."""
        s = self.state
        return {"final_loss": s.total / max(s.units, 1), "optimizer_state_numel": optimizer_state_numel(self.optimizer),
                "history": s.history}

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's ``state_dict`` (``"state_dict"``) and the parameter names in its order (``"param_names"``)."""
        return {"state_dict": self.optimizer.state_dict(),
                "param_names": optimizer_param_names(self.model, self.optimizer)}

    def save_state(self, path: Path, *, epoch: int, lo: int) -> None:
        """Write the training state atomically at position ``(epoch, lo)`` (loads with ``weights_only=True``)."""
        s = self.state
        state = {"recipe": self.identity(), "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
                 "optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state(),
                 "torch_rng": torch.get_rng_state(), **vars(s), "order": s.order.cpu(), "epoch": epoch, "lo": lo}
        save_training_file(state, path, "cannot write the training state",
                           "free disk space and rerun the same command, which resumes from the last state written")

    def load_state(self, path: Path) -> None:
        """Restore the model, optimizer, generators and :attr:`state` from a training-state file.

        Raises:
            CheckpointError: the file cannot be read or was made with another recipe (names the differing keys).
        """
        recipe = self.identity()
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same problem for the user
            raise CheckpointError(f"cannot read the training state {str(path)!r} ({e.__class__.__name__}: {e}); delete "
                                  "it or rerun with --overwrite to start the model over") from None
        if state.get("recipe") != recipe:
            saved = state.get("recipe") or {}
            diff = sorted(k for k in set(saved) | set(recipe) if saved.get(k) != recipe.get(k))
            raise CheckpointError(f"the training state {str(path)!r} was made with another recipe (differs in: "
                                  f"{', '.join(diff)}); rerun with the same settings to resume, or with --overwrite to "
                                  "start over")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        at_epoch_start = state["lo"] == 0
        per_epoch = -(-recipe["n"] // recipe["batch_size"])
        # the defaults: states written before trakcli recorded accuracy, loss terms, steps (they counted rows and
        # fixed-size batches) or the divergence check's first loss (then the next step's)
        self.state = TrainState(
            epoch=state["epoch"], lo=state["lo"], total=state["total"], correct=state.get("correct", 0),
            units=state.get("units", state["lo"]),
            step=state.get("step", state["epoch"] * per_epoch + -(-state["lo"] // recipe["batch_size"])),
            order=None if at_epoch_start else state["order"], history=list(state.get("history", [])),
            first_loss=state.get("first_loss"),
        )


def _show_epoch(task: Any, entry: dict[str, Any]) -> None:
    """Put a finished epoch's values on the progress bar (validation ones only when present)."""
    if "val_accuracy" in entry:
        task.update(val_loss=entry["val_loss"], val_acc=entry["val_accuracy"])
    elif "val_loss" in entry:
        task.update(val_loss=entry["val_loss"])
