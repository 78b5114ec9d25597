"""The replay record of one training (``optimize.replay``): what an exact replay of its steps needs.

A :class:`ReplayRecorder`, given to :meth:`trakcli.train.Trainer.fit`, writes into one folder
(``out_dir/replay/model_000/`` for `trak optimize`'s model 0):

* ``order_001.pt``, ...: each epoch's row order, ``[n]`` int64 (a step's batches are those of
  :meth:`TrainRows.batches <trakcli.train.rows.TrainRows.batches>` over it);
* ``step_000000.pt``, ``step_000050.pt``, ...: the state *before* step ``s + 1`` for every ``s`` divisible by
  ``every`` (model and optimizer ``state_dict``, global RNG states, position ``epoch`` / ``lo``);
* ``record.json`` (written last): the recipe, every step's learning rate, ``every``, ``total_steps``, the
  states written and the trainable parameters' names, dtypes and shapes.

``every = 0`` takes ``ceil(sqrt(total_steps))``, which makes states on disk plus one segment's states in
memory smallest (Griewank & Walther 2000; MAGIC, Ilyas & Engstrom 2025). Every file is written atomically; a
resumed training keeps the files written before the kill and writes the rest.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from trakcli.errors import TrainingError
from trakcli.files import save_training_file, write_text

#: Folder of the replay records in `trak optimize`'s out_dir.
REPLAY_DIR = "replay"
#: The record's description file, written when the training ends.
RECORD_NAME = "record.json"
#: ``format`` of :data:`RECORD_NAME`.
RECORD_FORMAT = "trakcli.replay"
RECORD_VERSION = 1


def record_dir(out_dir: Path, model_id: int) -> Path:
    """The replay record folder of model ``model_id`` of a `trak optimize` run: ``out_dir/replay/model_000``."""
    return Path(out_dir) / REPLAY_DIR / f"model_{model_id:03d}"


def state_name(step: int) -> str:
    """File of the state before step ``step + 1`` (after ``step`` steps): ``step_000050.pt``."""
    return f"step_{step:06d}.pt"


def order_name(epoch: int) -> str:
    """File of the row order of ``epoch`` (1-based): ``order_001.pt``."""
    return f"order_{epoch:03d}.pt"


def rng_states(device: torch.device | None = None) -> dict[str, Any]:
    """The global RNG states a step may draw from (dropout): the CPU one, and CUDA's when ``device`` is CUDA."""
    out: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_states(states: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore what :func:`rng_states` returned."""
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)


class ReplayRecorder:
    """Writes a training's replay record (module docstring) into ``folder`` as :meth:`Trainer.fit` runs, a state
    every ``every`` steps (0: ``ceil(sqrt(total_steps))``); its methods raise :class:`TrainingError` on a failed write."""

    def __init__(self, folder: Path, every: int = 0):
        self.folder = Path(folder)
        self.every = every

    def start(self, total_steps: int) -> None:
        """Fix the interval from the training's ``total_steps`` (before the first step)."""
        if not self.every:
            self.every = max(1, math.ceil(math.sqrt(max(1, total_steps))))

    def _save(self, obj: Any, name: str) -> None:
        save_training_file(obj, self.folder / name, "cannot write the replay record file",
                           "free disk space (optimize.replay_every larger writes fewer states) and rerun the same "
                           "command, which resumes")

    def epoch_order(self, epoch: int, order: torch.Tensor) -> None:
        """Record the row order of ``epoch`` (1-based), ``[n]`` int64."""
        if not (self.folder / order_name(epoch)).exists():
            self._save(order.detach().cpu().clone(), order_name(epoch))

    def before_step(self, step: int, epoch: int, lo: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    device: torch.device | None) -> None:
        """Record the state after ``step`` steps when ``step`` is a multiple of ``every`` (not yet written)."""
        if step % self.every or (self.folder / state_name(step)).exists():
            return
        self._save({"step": step, "epoch": epoch, "lo": lo,
                    "model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                    "optimizer": optimizer.state_dict(), "rng": rng_states(device)}, state_name(step))

    def finish(self, info: dict[str, Any]) -> None:
        """Write :data:`RECORD_NAME` (last): ``info`` (the recipe, lrs, parameters) with the states on disk."""
        states = sorted(int(p.stem.split("_")[1]) for p in self.folder.glob("step_*.pt"))
        record = {"format": RECORD_FORMAT, "format_version": RECORD_VERSION, "every": self.every,
                  "states": states, **info}
        try:
            write_text(self.folder / RECORD_NAME, json.dumps(record, indent=1) + "\n")
        except OSError as e:
            raise TrainingError(f"cannot write the replay record {self.folder / RECORD_NAME}: {e}; free disk space "
                                "and rerun the same command") from None
