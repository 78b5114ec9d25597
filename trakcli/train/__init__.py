"""Training: the built-in recipe for classifiers and causal LMs (minibatch training with the task's loss, an
optional random-subspace optimizer and learning-rate schedule, resumable bit-identically), and one model of a
config's recipe (:func:`train_one`, called by `trak optimize` and `trak eval`'s retraining)."""

from trakcli.train.evaluate import check_forward, validate
from trakcli.train.optimizers import lr_at, make_optimizer, optimizer_param_names, optimizer_state_numel
from trakcli.train.replay import ReplayRecorder, record_dir
from trakcli.train.recipe import Trained, check_init_checkpoint, check_recipe, load_training_function, train_one
from trakcli.train.rows import DatasetRows, TensorRows, TrainRows, count_steps
from trakcli.train.trainer import Recipe, Trainer, TrainState

__all__ = ["DatasetRows", "Recipe", "ReplayRecorder", "TensorRows", "TrainRows", "TrainState", "Trained", "Trainer",
           "check_forward", "check_init_checkpoint", "check_recipe", "count_steps", "load_training_function", "lr_at",
           "make_optimizer", "optimizer_param_names", "optimizer_state_numel", "record_dir", "train_one", "validate"]
