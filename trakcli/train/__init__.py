"""Training: the built-in recipe for classifiers and causal LMs, and one model of a config's recipe.

The built-in recipe is ordinary minibatch training with the task's loss
(:meth:`trakcli.tasks.Task.loss`: cross-entropy of a classifier's logits, or the
next-token cross-entropy over the target tokens of a causal LM) and a
``torch.optim`` optimizer, or that optimizer run in a random subspace by
:class:`trakcli.optim.ProjectedOptimizer` when a ``projection`` is given, with
an optional warmup and linear / cosine decay of the learning rate (:func:`lr_at`).
A model killed mid-training resumes from its training state file bit-identically.

Modules:

- :mod:`~trakcli.train.trainer`: :class:`Recipe` (the ``optimize:`` settings of the steps) and
  :class:`Trainer` (optimizer, schedule and shuffling set up once; :meth:`Trainer.fit` runs the
  steps; the resume state lives on the trainer).
- :mod:`~trakcli.train.recipe`: :func:`train_one` builds, seeds and trains one model with a
  config's recipe or the user's ``optimize.entrypoint``; `trak optimize` and the retraining of
  `trak eval` both call it.
- :mod:`~trakcli.train.rows`: the rows trained on: tensors (:class:`TensorRows`) or text read and
  tokenized batch by batch (:class:`DatasetRows`), each batch padded to its own longest row.
- :mod:`~trakcli.train.optimizers`: the optimizer by name and the learning-rate schedule.
- :mod:`~trakcli.train.evaluate`: loss and accuracy without gradients; the first forward pass's check.
- :mod:`~trakcli.train.divergence`: a diverged loss or non-finite weights stop training.
- :mod:`~trakcli.train.replay`: the replay record of a training (``optimize.replay``), read by
  :mod:`trakcli.unroll` for metagradients.
"""

from trakcli.train.evaluate import check_forward, evaluate, evaluate_dataset, validate
from trakcli.train.optimizers import lr_at, make_optimizer, optimizer_param_names, optimizer_state_numel
from trakcli.train.replay import ReplayRecorder, record_dir
from trakcli.train.recipe import Trained, check_init_checkpoint, check_recipe, load_training_function, train_one
from trakcli.train.rows import DatasetRows, TensorRows, TrainRows, count_steps
from trakcli.train.trainer import Recipe, Trainer, TrainState

__all__ = [
    "DatasetRows",
    "Recipe",
    "ReplayRecorder",
    "TensorRows",
    "TrainRows",
    "TrainState",
    "Trained",
    "Trainer",
    "check_forward",
    "check_init_checkpoint",
    "check_recipe",
    "count_steps",
    "evaluate",
    "evaluate_dataset",
    "load_training_function",
    "lr_at",
    "make_optimizer",
    "optimizer_param_names",
    "optimizer_state_numel",
    "record_dir",
    "train_one",
    "validate",
]
