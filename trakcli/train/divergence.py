"""When training has gone wrong: a diverged loss, non-finite weights. Both stop with a :class:`TrainingError`.

`trak optimize` (and the retraining of `trak eval`) checks every step's loss
(:func:`check_loss`, called by :meth:`trakcli.train.trainer.Trainer.fit`) and
the weights of every trained model (:func:`check_weights`, called by
:func:`trakcli.train.recipe.train_one`) before a checkpoint is written, so a
diverged run never leaves a NaN checkpoint behind.
"""

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
    """Stop a diverged training: a non-finite loss, or one above ``DIVERGED_FACTOR`` x the first step's.

    Args:
        loss: this step's mean minibatch loss (nats).
        first_loss: the first step's loss of this training (floored at :data:`DIVERGED_FLOOR`).
        name: the model, for the message (``"model 3"``).
        step: 1-based step of the training (over all epochs); epoch: 1-based.
        lr: the learning rate, for the message.

    Raises:
        TrainingError: naming the model, the step, the loss and the fix (a lower learning rate).
    """
    if not math.isfinite(first_loss):
        raise TrainingError(
            f"{name}: the loss of its first step is {first_loss}; check the training data for NaN/inf inputs "
            "and the init_checkpoint for NaN/inf weights"
        )
    if math.isfinite(loss) and loss <= DIVERGED_FACTOR * max(first_loss, DIVERGED_FLOOR):
        return
    if math.isfinite(loss):
        what = f"the loss {loss:.4g} is over {DIVERGED_FACTOR:g}x the first step's ({first_loss:.4g})"
    else:
        what = f"the loss is {loss} (the first step's was {first_loss:.4g})"
    raise TrainingError(
        f"{name} diverged at step {step} (epoch {epoch}): {what}; lower the learning rate (lr {lr:g}) and rerun"
    )


def check_weights(model: nn.Module, *, name: str, how: str, fix: str) -> None:
    """Refuse a trained model whose parameters hold NaN or inf values.

    Args:
        model: the trained model.
        name: the model, for the message (``"model 3"``).
        how: what trained it (``"training"``, ``"optimize.entrypoint my_train.py:train"``).
        fix: what to change, e.g. ``"lower the learning rate (lr 0.1)"``.

    Raises:
        TrainingError: naming the model and the first non-finite parameters
            (:func:`trakcli.models.checkpoints.nonfinite_parameters`).
    """
    bad = nonfinite_parameters(model)
    if bad:
        raise TrainingError(f"{name}: {how} left non-finite weights ({', '.join(bad)}); {fix} and rerun")
