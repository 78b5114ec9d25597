"""Reading a replay record (:mod:`trakcli.train.replay`) and walking its steps.

:class:`ReplayRecord` is one training's record: its recipe, the learning rate of every step, each epoch's row order and
the states stored every ``every`` steps. :meth:`ReplayRecord.steps` yields the steps from a stored state to the end,
each with its batch, exactly as :meth:`trakcli.train.Trainer.fit` ran them (the batches of
:meth:`TrainRows.batches <trakcli.train.rows.TrainRows.batches>` over the recorded order).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from trakcli.errors import CheckpointError, ConfigError
from trakcli.train.replay import RECORD_FORMAT, RECORD_NAME, order_name, state_name
from trakcli.train.rows import TrainRows

#: Optimizers whose steps :mod:`trakcli.unroll.steps` differentiates.
SUPPORTED_OPTIMIZERS = ("sgd", "adam", "adamw")


def no_record(what: str, why: str) -> CheckpointError:
    """The refusal of a checkpoint without a usable replay record, naming the command that makes one."""
    return CheckpointError(f"{what}: {why}; score.method: unroll replays the training of checkpoints that "
                           "`trak optimize` trained with optimize.replay: true: set checkpoints: "
                           "<optimize.out_dir>/manifest.json and run "
                           "`trak optimize CONFIG optimize.replay=true --overwrite`")


@dataclass(frozen=True)
class Step:
    """One optimizer step of a recorded training.

    Attributes:
        rows: ``[b]`` int64 row indices (into the trained rows) of the batch, in batch order.
        inputs, labels: the batch on the training device.
        lr: its learning rate.
    """

    rows: torch.Tensor
    inputs: Any
    labels: torch.Tensor
    lr: float


class ReplayRecord:
    """One training's replay record (a folder written by :class:`~trakcli.train.replay.ReplayRecorder`).

    Args:
        folder: the record folder (``out_dir/replay/model_000``).
        what: the checkpoint, for messages.

    Attributes:
        meta: ``record.json`` (``recipe``, ``lrs``, ``every``, ``states``, ``total_steps``, ``n``, ``params``).

    Raises:
        CheckpointError: no record there, or an unreadable one (names the `trak optimize` command).
    """

    def __init__(self, folder: Path, what: str = "the checkpoint"):
        self.folder = Path(folder)
        path = self.folder / RECORD_NAME
        if not path.is_file():
            raise no_record(what, f"its replay record {path} is missing (the training was not recorded, or did "
                                  "not finish)")
        try:
            self.meta = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise no_record(what, f"its replay record {path} is unreadable ({e})") from None
        if not isinstance(self.meta, dict) or self.meta.get("format") != RECORD_FORMAT:
            raise no_record(what, f"{path} is not a trakcli replay record")
        self.what = what
        self._orders: dict[int, torch.Tensor] = {}

    @property
    def recipe(self) -> dict[str, Any]:
        return self.meta["recipe"]

    @property
    def total_steps(self) -> int:
        return int(self.meta["total_steps"])

    @property
    def states(self) -> list[int]:
        """The steps after which a state is stored (``0`` first), ascending."""
        return [int(s) for s in self.meta["states"]]

    def segments(self) -> list[tuple[int, int]]:
        """``[(start, stop)]``: each stored state's steps ``start + 1 .. stop``, in training order."""
        starts = [s for s in self.states if s < self.total_steps]
        if not starts or starts[0] != 0:
            raise no_record(self.what, f"its replay record {self.folder} lacks the state before step 1")
        return list(zip(starts, starts[1:] + [self.total_steps]))

    def _load(self, name: str) -> Any:
        path = self.folder / name
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same problem for the user
            raise no_record(self.what, f"its replay file {path} is missing or unreadable ({e.__class__.__name__})") \
                from None

    def state(self, step: int) -> dict[str, Any]:
        """The stored state after ``step`` steps: ``model`` (state dict), ``optimizer`` (state dict), ``rng``,
        ``epoch`` (0-based), ``lo``."""
        return self._load(state_name(step))

    def order(self, epoch: int) -> torch.Tensor:
        """The row order of 1-based ``epoch``, ``[n]`` int64."""
        if epoch not in self._orders:
            self._orders[epoch] = self._load(order_name(epoch))
        return self._orders[epoch]

    def steps(self, data: TrainRows, start: dict[str, Any], stop: int | None = None) -> Iterator[Step]:
        """The steps after the stored state ``start`` (:meth:`state`) up to step ``stop`` (default: the last).

        Raises:
            CheckpointError: an order file is missing, or the rows do not match the record (its ``n``).
        """
        if data.n != int(self.meta["n"]):
            raise no_record(self.what, f"its record trained on {self.meta['n']} rows, the data has {data.n}")
        r, lrs = self.recipe, self.meta["lrs"]
        stop = self.total_steps if stop is None else stop
        t, epoch, lo = int(start["step"]), int(start["epoch"]), int(start["lo"])
        while t < stop and epoch < int(r["epochs"]):
            order = self.order(epoch + 1)
            for count, x, y in data.batches(order, lo, int(r["batch_size"]), r.get("max_tokens")):
                if t >= stop:
                    return
                t += 1
                yield Step(order[lo:lo + count], x, y, float(lrs[t - 1]))
                lo += count
            epoch, lo = epoch + 1, 0


def check_recipe_supported(record: ReplayRecord) -> None:
    """Refuse a record whose steps :mod:`trakcli.unroll` does not differentiate.

    Raises:
        ConfigError: an optimizer other than sgd / adam / adamw, a projected optimizer, or a parameter that
            is not float32 (bfloat16 / float16 training), each named.
    """
    r = record.recipe
    if r.get("optimizer") not in SUPPORTED_OPTIMIZERS:
        raise ConfigError(f"optimize.optimizer {r.get('optimizer')!r}: score.method: unroll differentiates "
                          f"{', '.join(SUPPORTED_OPTIMIZERS)} steps only; train with one of them")
    if r.get("projection"):
        raise ConfigError("optimize.projection: score.method: unroll does not differentiate the projected "
                          "optimizer's steps; train without optimize.projection")
    bad = [p for p in record.meta["params"] if p["dtype"] != "float32"]
    if bad:
        raise ConfigError(f"{record.what} was trained in {bad[0]['dtype']} (parameter {bad[0]['name']!r}): "
                          "score.method: unroll replays and differentiates float32 training only; train the model in "
                          "float32")
