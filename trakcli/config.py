"""The YAML config of every trakcli command, validated by pydantic.

A config is a YAML mapping (see ``configs/*.yaml``) plus optional
``key=value`` overrides given after the config path on the command line::

    trak featurize run.yaml projector.proj_dim=512 data.batch_size=64

Override values are parsed as YAML (``512`` is an int, ``[a, b]`` a list).
Every problem (unknown keys, with a did-you-mean; wrong types; missing
files) is collected and raised at once as one :class:`~trakcli.errors.ConfigError`
whose lines each start with the dotted key concerned.

Relative paths in the config are relative to the current working directory.
"""

from __future__ import annotations

import difflib
import glob
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from trakcli.errors import ConfigError

BUILTIN_DATASETS = ("digits",)


class _Strict(BaseModel):
    """Base of config sections: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Strict):
    """Which model to build."""

    entrypoint: str = Field(
        "mlp",
        description='A built-in model name ("mlp"), "path/to/file.py:function" or '
        '"package.module:function"; called with `kwargs` it returns a torch.nn.Module. '
        '"hf:DIR" loads a Hugging Face transformers model from a local directory (or package/dir of an '
        "installed package); kwargs: num_labels, seed (of a head the checkpoint lacks), model_class "
        "(sequence_classification or causal_lm).",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the entrypoint.")


class DatasetConfig(_Strict):
    """One dataset: a built-in one, a tensor file with named keys, or a text file with named fields."""

    builtin: Literal["digits"] | None = Field(
        None, description='A bundled dataset: "digits" (scikit-learn handwritten digits).'
    )
    split: Literal["train", "target"] | None = Field(
        None, description="Which split of the built-in dataset (train: 1437 rows, target: 360 rows)."
    )
    path: Path | None = Field(
        None, description="A .pt file holding a dict of tensors, an .npz file, or (with `text`) a .jsonl / .csv file."
    )
    inputs: str | None = Field(None, description="Key of the inputs tensor in `path`, shape [n, ...].")
    labels: str | None = Field(
        None,
        description="Key of the integer class labels in `path`, shape [n]; for text, the label field "
        "(optional for task language_modeling).",
    )
    text: str | None = Field(
        None, description="Text data: the field of each .jsonl object / .csv column holding the text."
    )
    max_length: PositiveInt = Field(128, description="Text data: most tokens per text (longer ones are truncated).")
    tokenizer: str | None = Field(
        None,
        description="Text data: a local Hugging Face tokenizer directory (or package/dir); "
        "default: the directory of model.entrypoint 'hf:DIR'.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> "DatasetConfig":
        if self.builtin is not None:
            if self.path is not None:
                raise ValueError("give either `builtin` or `path`, not both")
            if self.split is None:
                raise ValueError('a built-in dataset needs `split` ("train" or "target")')
        elif self.text is not None:
            if self.inputs is not None:
                raise ValueError("give either `text` (a .jsonl / .csv text file) or `inputs` (a tensor file), not both")
            if self.path is None:
                raise ValueError("a text dataset needs `path` (a .jsonl or .csv file)")
            if self.path.suffix.lower() not in (".jsonl", ".csv"):
                raise ValueError(f"a text dataset reads .jsonl or .csv files, not {self.path.suffix!r}")
            if self.tokenizer is None:
                raise ValueError(
                    "a text dataset needs `tokenizer` (a local Hugging Face directory), or use "
                    "model.entrypoint 'hf:DIR', whose tokenizer is then taken"
                )
        else:
            missing = [k for k in ("path", "inputs", "labels") if getattr(self, k) is None]
            if missing:
                raise ValueError(
                    f"a file dataset needs {', '.join(missing)} (or use `builtin: digits`, or `text` for a text file)"
                )
        return self


class DataConfig(_Strict):
    """Training and target data."""

    train: DatasetConfig = Field(description="The training set whose examples get scores.")
    target: DatasetConfig | None = Field(None, description="The examples whose predictions are explained.")
    validation: DatasetConfig | None = Field(
        None,
        description="Held-out examples `trak optimize` evaluates after every epoch (loss and accuracy in the "
        "progress bar, the manifest and the metrics JSON); featurize and score ignore it.",
    )
    batch_size: PositiveInt = Field(128, description="Examples per gradient batch.")
    grad_memory_mb: PositiveInt = Field(
        1024,
        description="Most MiB of per-example gradients (batch rows x grad_dim float32) held at once: a batch "
        "is cut into smaller ones to fit (never changes the features). Bounds the memory of big models.",
    )


class ProjectorConfig(BaseModel):
    """The random projection; the mapping is passed to ``make_projector``.

    Keys beyond those listed are kind-specific options (``block_size``,
    ``max_chunk_size``, ``s`` ...) validated by the projector itself.
    """

    model_config = ConfigDict(extra="allow")

    kind: str = Field("rademacher", description="noop, rademacher, normal, sjlt.")
    implementation: str = Field("auto", description="auto, single_block, basic, chunked, cuda.")
    proj_dim: PositiveInt = Field(2048, description="Output dimension of the projection.")
    seed: int = Field(0, description="Seed of the random matrix (per model_id matrices derive from it).")

    def options(self) -> dict[str, Any]:
        """All keys, as the keyword arguments of ``make_projector``."""
        return self.model_dump()


class StoreConfig(_Strict):
    """Where and how features and scores are written."""

    path: Path = Field(description="The Zarr store directory, e.g. out/attrib.zarr.")
    chunk_rows: PositiveInt = Field(
        512, description="Rows per chunk of features/scores; the unit of resume (done flags)."
    )
    dtype: Literal["float32", "float16"] = Field(
        "float32", description="Storage dtype of features (float16 halves the disk; compute stays float32)."
    )
    compressor: Literal["zstd", "blosc", "none"] = Field(
        "zstd", description="Compression codec of every array (each chunk also carries a CRC32C checksum)."
    )


class ScoreConfig(_Strict):
    """Kernel and scoring options."""

    experiment: str = Field("default", description="Name of this set of targets in the store.")
    lambda_reg: float | None = Field(
        None,
        ge=0,
        description="Absolute ridge added to each checkpoint's Φᵀ Φ. Unset: lambda_rel · trace(Φᵀ Φ)/n_train.",
    )
    lambda_rel: float = Field(
        1.0,
        gt=0,
        description="Ridge as a multiple of the mean squared train-feature norm trace(Φᵀ Φ)/n_train "
        "(independent of proj_dim), used when lambda_reg is unset.",
    )
    top_k: PositiveInt = Field(5, description="Proponents and opponents shown per target.")
    show_targets: int = Field(3, ge=0, description="How many targets the summary table shows.")


class ProjectionConfig(_Strict):
    """``optimize.projection``: run the optimizer in a random subspace (:mod:`trakcli.optim`).

    The gradient is projected with a projector of :mod:`trakcli.projectors`,
    the optimizer's state lives in the projected space, and the update is
    mapped back with the adjoint (GaLore, Zhao et al. 2024, with random JL
    matrices as in Flora, Hao et al. 2024; ``global``: intrinsic dimension,
    Li et al. 2018).
    """

    mode: Literal["per_matrix", "global"] = Field(
        "per_matrix",
        description="per_matrix: each parameter of >= 2 dims gets its own rank-`rank` projection of its "
        "smaller side (1-D parameters are not projected); global: the whole parameter vector "
        "through one projection of `proj_dim`.",
    )
    kind: Literal["noop", "rademacher", "normal", "sjlt"] = Field(
        "rademacher", description="Projector kind (noop: no projection, the plain inner optimizer)."
    )
    implementation: Literal["auto", "single_block", "basic", "chunked"] = Field(
        "auto", description="Projector implementation (never changes the matrix)."
    )
    rank: PositiveInt | None = Field(
        None, description="per_matrix only: projected size of each matrix's smaller side (default 8)."
    )
    proj_dim: PositiveInt | None = Field(
        None, description="global only: dimension of the subspace (required in global mode)."
    )
    seed: int = Field(0, ge=0, description="Base seed; every matrix and refresh derives its own.")
    update_gap: int = Field(
        0, ge=0, description="Draw a new projection every this many steps (0: one fixed projection)."
    )
    on_refresh: Literal["keep", "reset", "transfer"] = Field(
        "transfer",
        description="What happens to the inner optimizer's state at a new projection: keep it as is, "
        "reset it, or transfer first moments into the new subspace (never growing their norm).",
    )
    scale: float = Field(1.0, gt=0, description="Multiplies every unprojected update (GaLore's alpha).")

    @model_validator(mode="after")
    def _dims(self) -> "ProjectionConfig":
        # rank is read in per_matrix mode only and proj_dim in global mode only, so one
        # mapping can hold both and `mode=...` alone switches between them
        if self.mode == "global" and self.kind != "noop" and self.proj_dim is None:
            raise ValueError("mode global needs proj_dim, e.g. proj_dim: 1000")
        if self.rank is None:
            self.rank = 8
        return self


class _OptimizerSettings(_Strict):
    """The optimizer settings shared by ``optimizer:`` and the flat ``optimize:`` section."""

    lr: float = Field(0.05, gt=0, description="Learning rate.")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum (ignored by adam).")
    weight_decay: float = Field(
        5e-4, ge=0, description="Weight decay (with `projection`: decoupled, in the full parameter space)."
    )
    projection: ProjectionConfig | None = Field(
        None, description="Run the optimizer in a random subspace (trakcli.optim.ProjectedOptimizer); unset: plain."
    )


_OPTIMIZER_NAME = Field("sgd", description="torch.optim optimizer (the inner optimizer when `projection` is set).")


class OptimizerConfig(_OptimizerSettings):
    """``optimizer:``: the optimizer of `trak optimize` (and of the retraining of `trak eval`).

    Equivalent to the ``optimizer`` / ``lr`` / ``momentum`` / ``weight_decay`` /
    ``projection`` keys of the flat ``optimize:`` section.
    """

    name: Literal["sgd", "adam", "adamw"] = _OPTIMIZER_NAME


class TrainingConfig(_Strict):
    """``training:``: how `trak optimize` trains its N models (and `trak eval` its retrained ones)."""

    n_models: PositiveInt = Field(10, description="How many models (checkpoints) to train.")
    epochs: PositiveInt = Field(30, description="Passes over the training set.")
    batch_size: PositiveInt = Field(64, description="Minibatch size.")
    seed: int = Field(0, description="Model i is initialized and shuffled with seed + i.")
    out_dir: Path = Field(description="Directory for the checkpoints model_000.pt, model_001.pt, ...")
    metrics: Path | None = Field(
        None, description="Write per-model metrics (seed, loss, accuracy, optimizer state size) to this JSON file."
    )
    init_checkpoint: Path | None = Field(
        None, description="Start every model from this state dict (finetuning) instead of a fresh initialization."
    )
    subset_fraction: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Train model i on a random subset of this fraction of data.train (drawn with seed + i; the "
        "indices go to the metrics JSON), e.g. 0.5 for the counterfactual models of LDS.",
    )
    checkpoint_every: int = Field(
        0,
        ge=0,
        description="Save the training state (model, optimizer, data order) every this many steps, and at every "
        "epoch end, to out_dir/.resume/; a killed run resumes from it (0: epoch ends only).",
    )
    entrypoint: str | None = Field(
        None,
        description='Your own training function, "path/to/file.py:function" or "package.module:function", used '
        "instead of the built-in recipe: called as fn(model, inputs, labels, seed=seed, **kwargs) on a freshly "
        "built (or init_checkpoint) model, it trains the model in place or returns the trained model.",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of `entrypoint`.")


class OptimizeConfig(TrainingConfig, _OptimizerSettings):
    """The flat form of ``training:`` + ``optimizer:`` in one ``optimize:`` section (N seeded models)."""

    optimizer: Literal["sgd", "adam", "adamw"] = _OPTIMIZER_NAME

    @classmethod
    def from_sections(cls, training: TrainingConfig, optimizer: OptimizerConfig) -> "OptimizeConfig":
        """The flat section equivalent to ``training:`` + ``optimizer:``."""
        opt = optimizer.model_dump()
        opt["optimizer"] = opt.pop("name")
        return cls.model_validate({**training.model_dump(), **opt})


class SweepConfig(_Strict):
    """``eval.sweep``: the grid of `trak eval sweep` (one featurization per proj_dim)."""

    proj_dims: list[PositiveInt] = Field(
        default_factory=lambda: [64, 128, 256, 512, 1024, 2048], description="Projection dimensions to featurize."
    )
    n_checkpoints: list[PositiveInt] | None = Field(
        None, description="Ensemble sizes (the first k checkpoints); unset: 1, 2, 5, 10, ... up to all."
    )
    lambda_rel: list[float] = Field(
        default_factory=lambda: [0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0],
        description="Ridges relative to trace(Φᵀ Φ)/n_train (see score.lambda_rel).",
    )
    lambda_reg: list[float] = Field(
        default_factory=list, description="Absolute ridges to add to the grid (see score.lambda_reg)."
    )
    dir: Path | None = Field(
        None, description="Where the sweep's per-proj_dim stores go; unset: <store.path>.sweep/ beside the store."
    )

    @field_validator("lambda_rel", "lambda_reg")
    @classmethod
    def _positive(cls, v: list[float]) -> list[float]:
        bad = [x for x in v if not x > 0]
        if bad:
            raise ValueError(f"every ridge must be > 0, got {bad}")
        return v


class EvalConfig(_Strict):
    """``eval:``: counterfactual retraining for the linear datamodeling score (`trak eval lds`).

    LDS (Park et al. 2023, "TRAK", Sec. 2.2; Ilyas et al. 2022, "Datamodels"):
    ``n_subsets`` models are trained with the config's training recipe on random
    ``subset_fraction`` subsets of data.train; per target, the Spearman
    correlation between ``mask @ scores[t]`` and the retrained models' outputs.
    """

    n_subsets: PositiveInt = Field(100, description="Models retrained on random subsets.")
    subset_fraction: float = Field(
        0.5, gt=0, lt=1, description="Share of data.train in each subset (exactly round(fraction * n_train) rows)."
    )
    seed: int = Field(0, ge=0, description="Seed of the subsets and of the retrained models' initializations.")
    bootstrap: PositiveInt = Field(
        1000, description="Bootstrap resamples of the targets for the 95% interval of the LDS."
    )
    sweep: SweepConfig = Field(default_factory=SweepConfig)


class Config(_Strict):
    """A whole trakcli run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    checkpoints: str | list[str] = Field(
        description="A glob or a list of .pt / .safetensors state dicts (or, for an hf: model, Hugging Face "
        "model directories); model_id = index in sorted order. Or the manifest.json `trak optimize` writes "
        "into its out_dir: its checkpoints in model_id order, checked against their recorded sha256."
    )
    data: DataConfig
    task: Literal["classification", "text_classification", "language_modeling"] = Field(
        "classification",
        description="Model output function. classification / text_classification: the margin "
        "logit_y - logsumexp_{j!=y} logit_j of the logits (of a tensor input / of a text's sequence logits); "
        "language_modeling (causal LMs): the sum over the text's tokens of each next-token margin.",
    )
    grad_wrt: list[str] | None = Field(
        None, description="fnmatch patterns of parameter names to differentiate (unset: all)."
    )
    projector: ProjectorConfig = Field(default_factory=ProjectorConfig)
    store: StoreConfig
    score: ScoreConfig = Field(default_factory=ScoreConfig)
    optimize: OptimizeConfig | None = Field(
        None, description="The training recipe in one flat section; or give `training:` and `optimizer:` instead."
    )
    training: TrainingConfig | None = Field(None, description="How `trak optimize` trains (with `optimizer:`).")
    optimizer: OptimizerConfig | None = Field(None, description="The optimizer of `trak optimize` (with `training:`).")
    eval: EvalConfig = Field(default_factory=EvalConfig)
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda if available, else cpu.")
    num_threads: PositiveInt | None = Field(
        None, description="torch intra-op CPU threads (unset: torch's default, one per core)."
    )

    @model_validator(mode="before")
    @classmethod
    def _hf_defaults(cls, raw: Any) -> Any:
        """With ``model.entrypoint: hf:DIR``: text datasets default to DIR's tokenizer, and
        ``task: language_modeling`` to ``model.kwargs.model_class: causal_lm``."""
        if not isinstance(raw, dict):
            return raw
        model = raw.get("model")
        ep = model.get("entrypoint") if isinstance(model, dict) else None
        if not (isinstance(ep, str) and ep.startswith("hf:")):
            return raw
        raw = dict(raw)
        data = raw.get("data")
        if isinstance(data, dict):
            data = dict(data)
            for name in ("train", "target", "validation"):
                ds = data.get(name)
                if isinstance(ds, dict) and ds.get("text") is not None and ds.get("tokenizer") is None:
                    data[name] = {**ds, "tokenizer": ep.removeprefix("hf:")}
            raw["data"] = data
        if raw.get("task") == "language_modeling":
            kwargs = model.get("kwargs") if isinstance(model.get("kwargs"), dict) else {}
            if "model_class" not in kwargs:
                raw["model"] = {**model, "kwargs": {**kwargs, "model_class": "causal_lm"}}
        return raw

    @model_validator(mode="after")
    def _labels_for_task(self) -> "Config":
        if self.task != "language_modeling":
            for name in ("train", "target", "validation"):
                ds = getattr(self.data, name)
                if ds is not None and ds.text is not None and ds.labels is None:
                    raise ValueError(
                        f"data.{name}.labels: task {self.task} needs the label field of the text file "
                        "(only task language_modeling reads texts without labels)"
                    )
        return self

    @model_validator(mode="after")
    def _recipe_sections(self) -> "Config":
        """``training:`` + ``optimizer:`` fill the flat ``optimize:`` section (one recipe, two spellings)."""
        if self.training is None and self.optimizer is None:
            return self
        if self.optimize is not None:
            raise ValueError(
                "give the training recipe once: either optimize: (flat) or training: + optimizer:, not both"
            )
        if self.training is None:
            raise ValueError("optimizer: needs a training: section too (at least training.out_dir)")
        self.optimize = OptimizeConfig.from_sections(self.training, self.optimizer or OptimizerConfig())
        return self

    @field_validator("store", mode="before")
    @classmethod
    def _store_path(cls, v: Any) -> Any:
        return {"path": v} if isinstance(v, (str, Path)) else v

    @field_validator("grad_wrt", mode="before")
    @classmethod
    def _one_pattern(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    def resolved(self) -> dict[str, Any]:
        """The config as plain JSON-able data (what `--print-config` shows and the store records).

        Loading it again gives the same config: a recipe given as ``training:`` +
        ``optimizer:`` is shown in that spelling only (not also as the ``optimize:`` it fills).
        """
        data = self.model_dump(mode="json")
        if self.training is not None:
            data.pop("optimize", None)
        else:
            data.pop("training", None)
            data.pop("optimizer", None)
        return data


# ----------------------------------------------------------------------------
# loading


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> tuple[dict[str, Any], list[str]]:
    """Turn ``["a.b=1", "c=[x, y]"]`` into a nested dict; values are parsed as YAML.

    Returns:
        (nested dict, list of problems).
    """
    out: dict[str, Any] = {}
    problems: list[str] = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"override {item!r}: expected key=value, e.g. projector.proj_dim=512")
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            problems.append(f"{key}: cannot parse value {raw!r} as YAML ({e.__class__.__name__})")
            continue
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                nxt = node[p] = {}
            node = nxt
        node[parts[-1]] = value
    return out, problems


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _merge(merged[k], v)
        elif isinstance(v, dict) and isinstance(merged.get(k), (str, Path)) and k == "store":
            merged[k] = _merge({"path": merged[k]}, v)
        else:
            merged[k] = v
    return merged


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the field at ``loc`` (for did-you-mean)."""
    model: Any = Config
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        args = getattr(ann, "__args__", None)
        candidates = [a for a in (args or (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        model = candidates[0] if candidates else None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _format_errors(err: ValidationError) -> list[str]:
    problems = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p in ("function-after",)))
        # pydantic adds union branch names ("str", "list[str]") to the location: drop them
        loc = tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "float"))))
        key = ".".join(str(p) for p in loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            owner = _model_at(loc[:-1])
            hint = ""
            if owner is not None:
                close = difflib.get_close_matches(str(loc[-1]), list(owner.model_fields), n=1)
                if close:
                    prefix = ".".join(str(p) for p in loc[:-1])
                    hint = f"; did you mean {prefix + '.' if prefix else ''}{close[0]}?"
                else:
                    hint = f"; known keys: {', '.join(owner.model_fields)}"
            problems.append(f"{key}: unknown key{hint}")
        elif e["type"] == "missing":
            problems.append(f"{key}: required key is missing")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = f" (got {e.get('input')!r})" if loc else ""  # a whole-config check: the input is the config
            problems.append(f"{key}: {msg}{got}")
    # a union failure is reported once per branch: keep each line once
    return list(dict.fromkeys(problems))


def load_config(
    source: str | Path | dict[str, Any],
    overrides: list[str] | tuple[str, ...] = (),
) -> Config:
    """Read, override and validate a config.

    Args:
        source: path of a YAML file, or an already-parsed mapping.
        overrides: ``key=value`` strings applied on top (values parsed as YAML).

    Returns:
        The validated :class:`Config`.

    Raises:
        ConfigError: listing every problem found, each with its dotted key.
    """
    label = None
    if isinstance(source, dict):
        raw: Any = source
    else:
        path = Path(source)
        label = str(source)
        if not path.is_file():
            raise ConfigError(
                f"config file {str(path)!r} does not exist; pass the path of a YAML file such as configs/digits.yaml"
            )
        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}", source=label) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"the config must be a YAML mapping, got {type(raw).__name__}", source=label)
    extra, problems = parse_overrides(list(overrides))
    merged = _merge(raw, extra)
    try:
        cfg = Config.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(problems + _format_errors(e), source=label) from None
    if problems:
        raise ConfigError(problems, source=label)
    return cfg


def recipe_key(cfg: Any) -> str:
    """The config key of the training recipe as the user spelled it: ``training`` or ``optimize``."""
    return "training" if getattr(cfg, "training", None) is not None else "optimize"


def resolve_checkpoints(cfg: Config) -> list[Path]:
    """The checkpoint files of ``cfg`` in model_id order (sorted paths; a list keeps its order).

    An entry ``hf:DIR`` (or ``hf:package/dir``) is a Hugging Face model directory,
    found as for ``model.entrypoint``. A single path ending in ``.json`` is the
    ``manifest.json`` of a `trak optimize` run: its checkpoints in model_id order,
    paths relative to the manifest (see :func:`trakcli.manifest.manifest_checkpoints`).

    Raises:
        ConfigError: if the glob matches nothing or a listed file is missing; for a
            manifest: missing or invalid, of an unfinished run (fewer models than its
            n_models, or than the config's n_models when its out_dir is the manifest's
            directory), a checkpoint missing, or one whose sha256 changed since the
            manifest was written.
    """
    spec = cfg.checkpoints
    from trakcli.manifest import is_manifest_path, manifest_checkpoints

    if is_manifest_path(spec):
        path = Path(spec)  # type: ignore[arg-type]
        n_models, key = None, "optimize.n_models"
        oc = cfg.optimize
        if oc is not None and oc.out_dir.resolve() == path.parent.resolve():
            n_models = oc.n_models
            key = f"{recipe_key(cfg)}.n_models"
        return manifest_checkpoints(path, n_models=n_models, n_models_key=key)
    if isinstance(spec, str) and spec.startswith("hf:") or isinstance(spec, list) and any(
        p.startswith("hf:") for p in spec
    ):
        from trakcli.errors import ModelError
        from trakcli.hf import resolve_hf_path

        out, problems = [], []
        for p in [spec] if isinstance(spec, str) else spec:
            try:
                out.append(resolve_hf_path(p) if p.startswith("hf:") else Path(p))
            except ModelError as e:
                problems.append(f"checkpoints: {e}")
        missing = [p for p in out if not p.exists()]
        problems += [f"checkpoints: file {str(p)!r} does not exist" for p in missing]
        if problems:
            raise ConfigError(problems)
        return out
    if isinstance(spec, str):
        matches = sorted(glob.glob(spec))
        if not matches and Path(spec).exists():
            matches = [spec]
        if not matches:
            raise ConfigError(
                f"checkpoints: no file matches {spec!r}; train some with `trak optimize CONFIG` "
                "or point the glob at your .pt / .safetensors files"
            )
        return [Path(m) for m in matches]
    missing = [p for p in spec if not Path(p).exists()]
    if missing:
        raise ConfigError([f"checkpoints: file {p!r} does not exist" for p in missing])
    if not spec:
        raise ConfigError("checkpoints: the list is empty; give at least one checkpoint file")
    return [Path(p) for p in spec]


def check_files(
    cfg: Config, *, need_checkpoints: bool = True, need_target: bool = False, need_validation: bool = False
) -> None:
    """Check that every file the config names exists; report all missing ones at once.

    Args:
        cfg: the validated config.
        need_checkpoints: resolve ``checkpoints`` (featurize, score).
        need_target: ``data.target`` must be given (score).
        need_validation: check ``data.validation``'s file too, if given (optimize; the
            other commands ignore it).

    Raises:
        ConfigError: one line per missing file or glob matching nothing.
    """
    problems: list[str] = []
    if need_checkpoints:
        try:
            resolve_checkpoints(cfg)
        except ConfigError as e:
            problems += e.problems
    for name in ("train", "target", "validation") if need_validation else ("train", "target"):
        ds = getattr(cfg.data, name)
        if ds is None:
            if name == "target" and need_target:
                problems.append("data.target: required to score; give a builtin split or a file")
            continue
        if ds.path is not None and not ds.path.is_file():
            problems.append(f"data.{name}.path: file {str(ds.path)!r} does not exist")
    ep = cfg.model.entrypoint
    if ep.startswith("hf:"):
        from trakcli.errors import ModelError
        from trakcli.hf import resolve_hf_path

        try:
            resolve_hf_path(ep)
        except ModelError as e:
            problems.append(str(e))
    elif ":" in ep:
        file_part = ep.rsplit(":", 1)[0]
        if file_part.endswith(".py") and not Path(file_part).is_file():
            problems.append(f"model.entrypoint: file {file_part!r} does not exist")
    if problems:
        raise ConfigError(problems)
