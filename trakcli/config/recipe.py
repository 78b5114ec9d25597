"""The ``optimize:`` section (:class:`OptimizeConfig`): the training recipe of `trak optimize` and of `trak eval`'s
retraining: how many models, how they are trained, the optimizer."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt, model_validator

from trakcli.optim.settings import ProjectionSettings
from trakcli.strict import LocalPath, StrictModel


class _OptimizerSettings(StrictModel):
    """The optimizer keys of ``optimize:``."""

    lr: float = Field(0.05, gt=0, description="Learning rate.")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum (ignored by adam).")
    weight_decay: float = Field(
        5e-4, ge=0, description="Weight decay (with `projection`: decoupled, in the full parameter space)."
    )
    projection: ProjectionSettings | None = Field(
        None, description="Run the optimizer in a random subspace (trakcli.optim.ProjectedOptimizer); unset: plain."
    )
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="Learning rate after the warmup: constant (lr throughout), or a linear / cosine decay from lr "
        "to 0 over the remaining steps of the training.",
    )
    warmup_steps: int = Field(
        0, ge=0, description="Steps of linear warmup: step s (1-based) uses lr * s / warmup_steps (0: no warmup)."
    )
    warmup_fraction: float = Field(
        0.0, ge=0, lt=1, description="The warmup as a fraction of all training steps (rounded up to whole steps), in "
        "place of warmup_steps: e.g. 0.05 for retrained models whose subsets have fewer steps.",
    )

    @model_validator(mode="after")
    def _one_warmup(self) -> "_OptimizerSettings":
        if self.warmup_steps and self.warmup_fraction:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) and warmup_fraction ({self.warmup_fraction}) both "
                             "set; give one of them")
        return self


class LoraSettings(StrictModel):
    """``optimize.lora``: train LoRA adapters (Hu et al. 2022) with ``peft`` instead of every weight."""

    r: PositiveInt = Field(8, description="Rank of each adapter (LoRA's r).")
    alpha: float = Field(16.0, gt=0, description="LoRA's alpha: the adapter's output is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input while training.")
    target_modules: list[str] | str = Field(
        "all-linear",
        description='The layers that get adapters: peft\'s "all-linear" (every linear layer but the output '
        'layer), or module names / name suffixes such as [q_proj, v_proj] or [c_attn] (GPT-2).',
    )


_OPTIMIZER_NAME = Field("sgd", description="torch.optim optimizer (the inner optimizer when `projection` is set).")


class _TrainingSettings(StrictModel):
    """The training keys of ``optimize:``: how `trak optimize` trains its N models (and `trak eval` its retrained ones)."""

    n_models: PositiveInt = Field(10, description="How many models (checkpoints) to train.")
    epochs: PositiveInt = Field(30, description="Passes over the training set.")
    batch_size: PositiveInt = Field(64, description="Minibatch size.")
    seed: int = Field(0, description="Model i is initialized and shuffled with seed + i.")
    out_dir: LocalPath | None = Field(
        None, description="Directory for the checkpoints model_000.pt, model_001.pt, ... and manifest.json of `trak "
        "optimize` (required there); `trak eval` keeps its retrained models' outputs in the store and writes nothing "
        "here.",
    )
    metrics: LocalPath | None = Field(
        None, description="Write per-model metrics (seed, loss, accuracy, optimizer state size) to this JSON file."
    )
    init_checkpoint: LocalPath | None = Field(
        None, description="Start every model from this state dict (finetuning) instead of a fresh initialization."
    )
    subset_fraction: float = Field(
        1.0, gt=0, le=1, description="Train model i on a random subset of this fraction of data.train (drawn with "
        "seed + i; the indices go to the metrics JSON), e.g. 0.5 for the counterfactual models of LDS.",
    )
    checkpoint_every: int = Field(
        0, ge=0, description="Save the training state (model, optimizer, data order) every this many steps, and at "
        "every epoch end, to out_dir/.resume/; a killed run resumes from it (0: epoch ends only).",
    )
    entrypoint: str | None = Field(
        None,
        description='Your own training function, "path/to/file.py:function" or "package.module:function", used '
        "instead of the built-in recipe: called as fn(model, inputs, labels, seed=seed, **kwargs); it trains the "
        "model in place or returns the trained model. model: built by model.entrypoint after "
        "torch.manual_seed(seed), so freshly initialized for a function entrypoint, but the pretrained weights "
        "of DIR for hf:DIR; then init_checkpoint's weights if set. inputs: a float tensor [n, ...] for tensor "
        "data; for text data a dict of [n, L] tensors (input_ids, attention_mask, ...; every row padded to the "
        "longest). labels: [n] int64 class labels, or [n, L] per-token labels (-100: not a target) for "
        "language-model data. trak optimize passes all rows, trak eval each retrained model's subset.",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of `entrypoint`.")
    lora: LoraSettings | None = Field(
        None, description="Train LoRA adapters (peft) on the frozen model.entrypoint instead of every weight: each "
        "checkpoint is then an adapter folder (out_dir/model_000/, peft's save_pretrained), which featurize and score "
        "read with model.entrypoint as the base model; features default to the adapter's parameters. Not with "
        "init_checkpoint (the adapter is saved without the base weights).",
    )
    save_optimizer_state: bool = Field(
        False, description="Also write each model's final optimizer state (torch.optim state_dict and the parameter "
        "names in its order) to out_dir/optimizer_state/model_000.pt, ... (built-in recipe only).",
    )
    epoch_checkpoints: bool = Field(
        False, description="Also write each model's checkpoint at the end of every epoch but the last "
        "(out_dir/model_000_epoch1.pt, ...; with save_optimizer_state its optimizer state too), listed in the "
        "manifest, so featurize and score ensemble over checkpoints along training: model 0's epochs 1, 2, ..., its "
        "final checkpoint, then model 1's (TracIn, Pruthi et al. 2020). Built-in recipe only.",
    )
    replay: bool = Field(
        False, description="Record what an exact replay of each model's training needs, for `score.method: unroll` "
        "(metagradients through the training): the data order of every epoch and the model and optimizer state every "
        "replay_every steps, in out_dir/replay/model_000/, ... (listed in the manifest), with deterministic kernels. "
        "Disk: about (total_steps / replay_every + 1) x (parameters + optimizer state) floats per model. Built-in "
        "recipe, float32, sgd / adam / adamw without projection.",
    )
    replay_every: int = Field(
        0, ge=0, description="With replay: steps between two recorded states (the segment length of the unrolled "
        "scoring, whose memory holds one segment's states). 0: ceil(sqrt(total_steps)), which minimizes states on "
        "disk plus states in memory.",
    )


class OptimizeConfig(_TrainingSettings, _OptimizerSettings):
    """``optimize:``: the training recipe of `trak optimize` (N seeded models) and of the retraining of `trak eval`."""

    optimizer: Literal["sgd", "adam", "adamw"] = _OPTIMIZER_NAME

    @model_validator(mode="after")
    def _lora_base(self) -> "OptimizeConfig":
        if self.lora is not None and self.init_checkpoint is not None:
            raise ValueError(f"lora with init_checkpoint {str(self.init_checkpoint)!r}: an adapter is saved without "
                             "the base weights, and featurize builds the base from model.entrypoint alone; save the "
                             "fine-tuned base as a Hugging Face folder (model.save_pretrained(DIR)) and set "
                             "model.entrypoint: hf:DIR instead")
        return self


#: Recipe keys that never change what a model trains to: a rerun may change them and keep its models.
RUN_ONLY_KEYS = ("n_models", "out_dir", "metrics", "checkpoint_every", "save_optimizer_state", "epoch_checkpoints",
                 "replay", "replay_every")


def recipe_identity(recipe: OptimizeConfig | dict[str, Any]) -> dict[str, Any]:
    """The recipe (validated, or plain data as a manifest holds it) as JSON-able data without the run-only keys
    (:data:`RUN_ONLY_KEYS`): two recipes with equal identities train the same models.

    Raises:
        pydantic.ValidationError: plain data that does not validate.
    """
    if not isinstance(recipe, OptimizeConfig):
        recipe = OptimizeConfig.model_validate(recipe)
    return {k: v for k, v in recipe.model_dump(mode="json").items() if k not in RUN_ONLY_KEYS}
