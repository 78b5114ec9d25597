"""When training has gone wrong: a diverged loss, non-finite weights. Both stop with a :class:`TrainingError`
before a checkpoint is written, so a diverged run never leaves a NaN checkpoint behind."""

from __future__ import annotations

import math

from torch import nn

from trakcli.errors import TrainingError
from trakcli.models.checkpoints import nonfinite_parameters

#: A step whose loss exceeds this many times the first step's stops training (:func:`check_loss`).
DIVERGED_FACTOR = 1000.0
#: The first step's loss counts as at least this (nats) in that test: from a near-perfect
#: ``init_checkpoint`` (first loss 1e-4) a loss of 0.5 is not divergence.
DIVERGED_FLOOR = 1e-2


def check_loss(loss: float, first_loss: float, *, name: str, step: int, epoch: int, lr: float) -> None:
    """Stop a diverged training (:class:`TrainingError`): a non-finite loss, or one above ``DIVERGED_FACTOR`` x
    the first step's (floored at :data:`DIVERGED_FLOOR`); ``name``, ``step``, ``epoch``, ``lr`` for the message."""
    if not math.isfinite(first_loss):
        raise TrainingError(f"{name}: the loss of its first step is {first_loss}; check the training data for NaN/inf "
                            "inputs and the init_checkpoint for NaN/inf weights")
    if math.isfinite(loss) and loss <= DIVERGED_FACTOR * max(first_loss, DIVERGED_FLOOR):
        return
    if math.isfinite(loss):
        what = f"the loss {loss:.4g} is over {DIVERGED_FACTOR:g}x the first step's ({first_loss:.4g})"
    else:
        what = f"the loss is {loss} (the first step's was {first_loss:.4g})"
    raise TrainingError(f"{name} diverged at step {step} (epoch {epoch}): {what}; lower the learning rate (lr {lr:g}) "
                        "and rerun")


def check_weights(model: nn.Module, *, name: str, how: str, fix: str) -> None:
    """Refuse (:class:`TrainingError`) a trained model with NaN or inf parameters, naming ``name``, ``how`` it
    was trained, the parameters and the ``fix``."""
    bad = nonfinite_parameters(model)
    if bad:
        raise TrainingError(f"{name}: {how} left non-finite weights ({', '.join(bad)}); {fix} and rerun")
