"""The pydantic schema of the YAML config: one model per section, :class:`Config` for the whole run."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

from pydantic_core import PydanticCustomError
from pydantic import (
    ConfigDict,
    Field,
    PositiveInt,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from trakcli.errors import ProjectorError
from trakcli.projectors.kinds import KRONECKER_OPTIONS as _KRONECKER_OPTIONS
from trakcli.projectors.registry import DEFAULT_KIND, IMPLEMENTATIONS, OPTIONS, kind_names, projector_kind
from trakcli.strict import LocalPath, NoBoolNumbers, StrictModel
from trakcli.config.recipe import OptimizeConfig

#: The built-in tasks by name (``trakcli.tasks.BUILTIN``; config does not import torch) and the labels
#: each reads: ``"classes"`` (class indices ``[n]``) or ``"tokens"`` (per-token labels of a causal LM).
BUILTIN_TASK_LABELS = {"classification": "classes", "text_classification": "classes", "language_modeling": "tokens"}
#: The built-in model output functions (``trakcli.tasks.TASKS``).
BUILTIN_TASKS = tuple(BUILTIN_TASK_LABELS)


def builtin_task_labels(task: Any) -> str | None:
    """The labels a built-in task reads (:data:`BUILTIN_TASK_LABELS`); None for a task of one's own."""
    return BUILTIN_TASK_LABELS.get(task) if isinstance(task, str) else None


BUILTIN_DATASETS = ("digits",)

#: Error type of a validator that finds keys no field takes (ctx: ``keys``, ``choices``); reported
#: like pydantic's ``extra_forbidden``, one line per key with a did-you-mean.
UNKNOWN_KEYS = "unknown_keys"

#: Top-level keys that are not sections, and what the user writes instead.
NOT_SECTIONS = {
    "training": "the training recipe is the optimize: section: write training.KEY as optimize.KEY",
    "optimizer": "the optimizer is set in the optimize: section: write optimizer.name as optimize.optimizer and "
                 "optimizer.KEY (lr, momentum, weight_decay, projection, ...) as optimize.KEY",
}

#: Options of ``projector:`` that kind ``kronecker`` takes besides proj_dim and seed (that kind's ``options``).
KRONECKER_OPTIONS = _KRONECKER_OPTIONS


class ModelConfig(StrictModel):
    """Which model to build."""

    entrypoint: str = Field(
        "mlp",
        description='A built-in model name ("mlp"), "path/to/file.py:function" or '
        '"package.module:function"; called with `kwargs` it returns a torch.nn.Module. '
        '"hf:DIR" loads a Hugging Face transformers model from a local directory (or package/dir of an '
        'installed package), or, where no such directory exists, "hf:ORG/NAME[@REVISION]" from the Hugging Face '
        "Hub (downloaded into the Hugging Face cache; read from it with HF_HUB_OFFLINE=1); "
        "kwargs: num_labels, seed (of a head the checkpoint lacks), model_class "
        "(sequence_classification or causal_lm).",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the entrypoint.")


class DatasetConfig(StrictModel):
    """One dataset: a built-in one, a tensor file with named keys, or a text / language-model file with named fields.

    Text and language-model data (a ``.jsonl`` / ``.csv`` / ``.parquet`` / ``.arrow`` file or a
    Hugging Face datasets folder) name their fields in exactly one of four ways:

    * ``text`` (+ ``text_pair``): with ``labels``, text classification (class label per row);
      without, language modeling with every real token a target;
    * ``prompt`` + ``completion``: language modeling, the completion's tokens are the targets;
    * ``messages``: chat conversations rendered by the tokenizer's chat template, the
      assistant turns' tokens are the targets;
    * ``input_ids`` (+ ``labels``): pre-tokenized rows, with per-token labels (-100: not a
      target) or every token a target.
    """

    builtin: Literal["digits"] | None = Field(
        None, description='A bundled dataset: "digits" (scikit-learn handwritten digits).'
    )
    split: Literal["train", "target"] | None = Field(
        None, description="Which split of the built-in dataset (train: 1437 rows, target: 360 rows)."
    )
    path: Path | str | list[Path | str] | None = Field(
        None,
        description="A .pt file holding a dict of tensors, an .npz file, or (with `text`, `prompt`, `messages` or "
        "`input_ids`) a .jsonl / .csv / .parquet / .arrow file or a Hugging Face datasets save_to_disk folder. "
        "Or a Hugging Face Hub dataset, hf://datasets/ORG/NAME[@REVISION][/PATH] (PATH: a file, folder or glob; "
        "without it the repo's only data file or its train split's), downloaded into the Hugging Face cache, "
        "or read from it with HF_HUB_OFFLINE=1. Or a list of such files, read as one dataset in order (the rows "
        "of the first, then of the second, ...): a corpus grown by a new file is appended to its store.",
    )

    @field_validator("path", mode="before")
    @classmethod
    def _hub_url(cls, v: Any) -> Any:
        """A Hub URL stays the string it is (``Path`` would turn ``hf://`` into ``hf:/``); other strings are paths.
        A list of one path is that path; a list must not be empty."""
        def one(p: Any) -> Any:
            return Path(p) if isinstance(p, str) and not p.startswith("hf://") else p

        if isinstance(v, (list, tuple)):
            if not v:
                raise ValueError("an empty list of files; name at least one")
            return one(v[0]) if len(v) == 1 else [one(p) for p in v]
        return one(v)

    @property
    def paths(self) -> list[Path | str]:
        """``path`` as a list of the files it names (``[]`` without a path)."""
        if self.path is None:
            return []
        return list(self.path) if isinstance(self.path, list) else [self.path]
    inputs: str | list[str] | None = Field(
        None,
        description="Key of the inputs tensor in `path`, shape [n, ...]; or a list of keys: a dict of tensors "
        "[n, ...] passed to the model as keyword arguments (model(**{key: tensor})); a 2-D `attention_mask` "
        "is passed as the 4-D additive mask text models get.",
    )
    labels: str | None = Field(
        None,
        description="Tensor file: key of the integer class labels, shape [n], or (with inputs [input_ids, "
        "attention_mask, ...]) of per-token labels [n, L] shaped like input_ids (-100: not a target). "
        "With `text`: the field of the integer class label (text classification; leave it out for "
        "language modeling). With `input_ids`: the field of per-token labels, as long as input_ids "
        "(-100: not a target; leave it out to make every token a target).",
    )
    text: str | None = Field(
        None,
        description="Text data: the field holding the text (.jsonl / .csv / .parquet / .arrow / datasets folder); "
        "with `labels` text classification, without language modeling (every token a target).",
    )
    text_pair: str | None = Field(
        None,
        description="Text data: the field holding each example's second text (sentence pairs, e.g. NLI); "
        "the two are tokenized as one pair (with token_type_ids where the tokenizer makes them). Needs `text`.",
    )
    prompt: str | None = Field(
        None,
        description="Language-model data: the field holding the prompt (tokenized with the tokenizer's special "
        "tokens; not a target). Needs `completion`.",
    )
    completion: str | None = Field(
        None,
        description="Language-model data: the field holding the completion, appended to the prompt's tokens "
        "(without special tokens, plus the tokenizer's end-of-sequence token); its tokens are the targets. "
        "Needs `prompt`.",
    )
    messages: str | None = Field(
        None,
        description="Chat data: the field holding a list of {role, content} messages, rendered by the "
        "tokenizer's chat template; the tokens of the assistant turns are the targets.",
    )
    input_ids: str | None = Field(
        None,
        description="Pre-tokenized language-model data: the field holding each row's list of token ids "
        "(see `labels` for per-token labels). `tokenizer` is optional (its pad token and decoding; "
        "without one rows are padded with id 0).",
    )
    max_length: PositiveInt | None = Field(
        128,
        description="Text and language-model data: most tokens per row (longer rows are cut on the right, "
        "pre-tokenized `input_ids` too); null: no cut (a row longer than the tokenizer's model_max_length is an "
        "error). data.target may have its own (queries are often shorter than training documents): features are "
        "per example, so target and train lengths need not match.",
    )
    tokenizer: str | None = Field(
        None,
        description="Text and language-model data: a local Hugging Face tokenizer directory (or package/dir), or "
        "a Hub name ORG/NAME[@REVISION] (only its tokenizer files are downloaded); default: that of "
        "model.entrypoint 'hf:DIR' / 'hf:ORG/NAME'. `messages` need one with a chat template.",
    )

    @property
    def text_source(self) -> str | None:
        """Which kind of text / language-model data this is: ``"text"``, ``"prompt"``, ``"messages"``,
        ``"input_ids"``, or ``None`` (built-in or tensor-file data)."""
        for name in ("text", "prompt", "messages", "input_ids"):
            if getattr(self, name) is not None:
                return name
        return "prompt" if self.completion is not None else None

    @model_validator(mode="after")
    def _one_source(self) -> "DatasetConfig":
        if self.text_pair is not None and self.text is None:
            raise ValueError("`text_pair` is the second text of a pair: give `text` (the first) too")
        if (self.prompt is None) != (self.completion is None):
            given, other = ("prompt", "completion") if self.prompt is not None else ("completion", "prompt")
            raise ValueError(
                f"`{given}` needs `{other}` too: prompt + completion data name both fields (the completion's "
                "tokens are the targets); for plain text use `text`"
            )
        kinds = [name for name, on in (("text", self.text), ("prompt + completion", self.prompt),
                                       ("messages", self.messages), ("input_ids", self.input_ids)) if on is not None]
        if len(kinds) > 1:
            raise ValueError(
                f"give one of `text`, `prompt` + `completion`, `messages` or `input_ids` per dataset, not "
                f"{' and '.join(f'`{k}`' for k in kinds)}"
            )
        if self.builtin is not None:
            if self.path is not None:
                raise ValueError("give either `builtin` or `path`, not both")
            if self.split is None:
                raise ValueError('a built-in dataset needs `split` ("train" or "target")')
            if kinds:
                raise ValueError(f"`{kinds[0]}` names fields of a file in `path`; a built-in dataset has none")
        elif kinds:
            kind = kinds[0]
            if self.inputs is not None:
                raise ValueError(
                    f"give either `{kind}` (fields of a .jsonl / .csv / .parquet file) or `inputs` (keys of a "
                    "tensor file), not both"
                )
            if self.labels is not None and kind in ("prompt + completion", "messages"):
                target = "the completion" if kind == "prompt + completion" else "the assistant turns"
                raise ValueError(
                    f"`labels` is not read with `{kind}` data: its targets are the tokens of {target}; "
                    "for per-token labels give pre-tokenized `input_ids` + `labels`"
                )
            if self.path is None:
                raise ValueError(f"a text dataset needs `path` (a .jsonl or .csv file) holding the `{kind}` field")
            for path in self.paths:
                if isinstance(path, Path) and path.suffix.lower() not in (  # a Hub URL's files: checked when read
                        ".jsonl", ".csv", ".parquet", ".arrow", ""):  # "": a datasets folder
                    raise ValueError(f"a text dataset reads .jsonl or .csv files (or .parquet, .arrow, a datasets "
                                     f"folder), not {path.suffix!r}"
                                     + ("; a tensor file takes inputs: [input_ids, attention_mask] (+ labels)"
                                        if kind == "input_ids" else ""))
            if self.tokenizer is None and kind != "input_ids":
                raise ValueError(
                    "a text dataset needs `tokenizer` (a local Hugging Face directory), or use "
                    "model.entrypoint 'hf:DIR', whose tokenizer is then taken"
                )
        else:
            missing = [k for k in ("path", "inputs", "labels") if getattr(self, k) is None]
            if missing:
                raise ValueError(
                    f"a file dataset needs {', '.join(missing)} (or use `builtin: digits`, or `text`, "
                    "`prompt` + `completion`, `messages` or `input_ids` for a text file)"
                )
        return self


class DataConfig(StrictModel):
    """Training and target data."""

    train: DatasetConfig = Field(description="The training set whose examples get scores.")
    target: DatasetConfig | None = Field(None, description="The examples whose predictions are explained.")
    validation: DatasetConfig | None = Field(
        None,
        description="Held-out examples `trak optimize` evaluates after every epoch (loss and accuracy in the "
        "progress bar, the manifest and the metrics JSON); featurize and score ignore it.",
    )
    batch_size: PositiveInt = Field(128, description="Examples per gradient batch.")
    batch_tokens: PositiveInt | None = Field(
        None,
        description="Most tokens per batch of text and language-model data, counted as rows x the batch's "
        "longest sequence (each batch is padded to its own longest row); a single row longer than this is a "
        "batch of its own. None: rows only (data.batch_size). Changes the features only by float32 rounding.",
    )
    grad_memory_mb: PositiveInt | None = Field(
        None,
        description="Most MiB of per-example gradients (batch rows x grad_dim float32) held at once: a batch "
        "is cut into smaller ones to fit (the features change only by float32 rounding). Bounds the memory of big models. "
        "projector.kind kronecker forms no per-example gradient: it bounds the layer inputs, outputs and "
        "output gradients of one forward + backward instead. Unset: 1024 on a CPU, a quarter of the GPU's "
        "memory on a CUDA GPU.",
    )


def _kind_description() -> str:
    """The ``projector.kind`` description: the registered kinds at import, the default first."""
    default = "; the default: the LDS of dense rademacher at a fraction of its cost, docs/guides/projectors.md"
    kinds = sorted(kind_names(), key=lambda n: n != DEFAULT_KIND)
    described = [f"{n} ({projector_kind(n).summary}{default if n == DEFAULT_KIND else ''})" for n in kinds]
    return "; ".join(described) + ". A kind registered with trakcli.projectors.register_projector_kind is accepted too."


class ProjectorConfig(NoBoolNumbers):
    """The random projection.

    ``kind`` names a registered projector kind (:mod:`trakcli.projectors.registry`). For a kind
    built from a gradient dimension the mapping is passed to ``make_projector``; keys beyond
    those listed are options (``block_size``, ``max_chunk_size``, a kind's own ones such as
    sjlt's ``s`` ...) validated by the projector itself.

    A kind built from the model (``kind: kronecker``, LoGra, Choe et al. 2024, projects each
    covered layer's gradient with ``P_out ⊗ P_in`` from the layer's inputs and output
    gradients, :class:`trakcli.gradients.KroneckerFeaturizer`) checks ``implementation`` itself
    (kronecker has a single one, so ``implementation`` other than ``auto`` is refused), and
    its only options are the kind's own (:data:`KRONECKER_OPTIONS`).
    """

    model_config = ConfigDict(extra="allow")

    kind: str = Field(DEFAULT_KIND, description=_kind_description())
    implementation: str = Field(
        "auto", description=f"{', '.join(IMPLEMENTATIONS)} (each kind supports some; kind kronecker: auto only)."
    )
    proj_dim: PositiveInt = Field(2048, description="Output dimension of the projection.")
    seed: int = Field(0, description="Seed of the random matrix (per model_id matrices derive from it).")

    @field_validator("kind")
    @classmethod
    def _registered_kind(cls, v: str) -> str:
        try:
            projector_kind(v)
        except ProjectorError as e:
            raise ValueError(str(e)) from None
        return v

    @field_validator("implementation")
    @classmethod
    def _kind_implementation(cls, v: str, info: ValidationInfo) -> str:
        kind = info.data.get("kind")
        problem = projector_kind(kind).implementation_error(v) if kind is not None else None
        if problem:
            raise ValueError(problem)
        return v

    @property
    def built_from_model(self) -> bool:
        """Whether ``kind`` is built from the model (``kronecker``), not by ``make_projector``."""
        return projector_kind(self.kind).built_from_model is not None

    @model_validator(mode="after")
    def _known_options(self) -> "ProjectorConfig":
        """Unknown keys get the did-you-mean of every other config key (:func:`trakcli.config.load.load_config`).

        A key is unknown if it is no field and no option of the kind: the options of
        :data:`trakcli.projectors.OPTIONS`, or for a kind built from the model (whose other
        options :meth:`_model_kind_options` refuses with its own message) a key closer to
        a field than to any of its options.
        """
        extra = list(self.model_extra or {})
        if not extra:
            return self
        fields = list(type(self).model_fields)
        own = projector_kind(self.kind).options
        if self.built_from_model:
            choices = fields + list(own)
            closest = {k: difflib.get_close_matches(k, choices, n=1) for k in extra if k not in own}
            unknown = [k for k, close in closest.items() if close and close[0] in fields]
        else:
            choices = fields + list(OPTIONS)
            unknown = [k for k in extra if k not in OPTIONS]
            for k in unknown:
                owners = [n for n in kind_names() if projector_kind(n).built_from_model and k in projector_kind(n).options]
                if owners:
                    raise ValueError(
                        f"option {k} applies to kind {' or '.join(owners)} only; remove it or set projector.kind: "
                        f"{owners[0]}"
                    )
        if unknown:
            raise PydanticCustomError(
                UNKNOWN_KEYS, "unknown keys {keys}", {"keys": unknown, "choices": choices}
            )
        return self

    @model_validator(mode="after")
    def _model_kind_options(self) -> "ProjectorConfig":
        if not self.built_from_model:
            return self
        own = projector_kind(self.kind).options
        unknown = [k for k in (self.model_extra or {}) if k not in own]
        if unknown:
            shown = []
            for k in unknown:
                close = difflib.get_close_matches(k, list(own), n=1)
                shown.append(f"{k} (did you mean {close[0]}?)" if close else k)
            known = "; ".join(f"{k}: {v}" for k, v in own.items())
            if len(unknown) == 1:
                head = f"option {shown[0]} does not apply to kind {self.kind}; remove it"
            else:
                head = f"options {', '.join(shown)} do not apply to kind {self.kind}; remove them"
            raise ValueError(f"{head}. kind {self.kind} takes proj_dim, seed and {known}")
        return self

    def options(self) -> dict[str, Any]:
        """All keys, as the keyword arguments of ``make_projector`` (not for a kind built from the model)."""
        return self.model_dump()

    def kronecker_options(self) -> dict[str, Any]:
        """``proj_dim``, ``seed`` and the given options of the kind (kind ``kronecker``: :data:`KRONECKER_OPTIONS`),
        as keyword arguments of :class:`trakcli.gradients.KroneckerFeaturizer`."""
        own = projector_kind(self.kind).options
        extra = {k: v for k, v in (self.model_extra or {}).items() if k in own}
        return {"proj_dim": self.proj_dim, "seed": self.seed, **extra}


class KindSection(StrictModel):
    """A section whose value may be its kind alone: ``second_moment: adafactor`` is
    ``second_moment: {kind: adafactor}``, ``curvature: ekfac`` is ``curvature: {kind: ekfac}``."""

    @model_validator(mode="before")
    @classmethod
    def _kind_alone(cls, raw: Any) -> Any:
        return {"kind": raw} if isinstance(raw, str) else raw


class SecondMomentConfig(KindSection):
    """``second_moment:``: the optimizer second-moment correction of the per-example gradients (TrackStar).

    Each per-example gradient is divided elementwise by the square root of the
    bias-corrected second-moment estimate ``v`` (``exp_avg_sq``) that Adam/AdamW kept for
    that checkpoint, before it is projected, so the features live in the geometry the
    optimizer used (Chang et al., ICLR 2025, "Scalable Influence and Fact Tracing for Large
    Language Model Pretraining", Sec. 3). ``adafactor`` uses the rank-1 factorization of
    ``v`` per layer (Shazeer & Stern 2018), a diagonal scaling on each side of the layer's
    gradient matrix, which the Kronecker projection applies to its factors; ``adam`` the
    exact ``1/sqrt(v + eps)`` (needs whole per-example gradients: not kind kronecker).
    README "Optimizer second-moment correction" gives the formulas.
    """

    kind: Literal["adafactor", "adam"] | None = Field(
        None,
        description="null: no correction (TRAK). adafactor: G -> D_out G D_in per layer with D_out = (row means "
        "of v + eps)^-1/2, D_in = (mean of v + eps)^1/2 (column means of v + eps)^-1/2 (the bias is one more "
        "column; vectors outside layers: elementwise); every projector kind. adam: G / sqrt(v + eps) elementwise; "
        "every kind but kronecker.",
    )
    optimizer_state: str | list[str] | None = Field(
        None,
        description="The optimizer state file of each checkpoint, in model_id order: a glob (sorted) or a list. "
        "Unset: for checkpoints from a manifest.json, the file its entry records; otherwise "
        "<checkpoint's folder>/optimizer_state/<checkpoint's file name>, where `trak optimize` with "
        "optimize.save_optimizer_state: true writes it.",
    )
    eps: float | None = Field(
        None,
        ge=0,
        description="Added to the second moments (inside the square root). Unset: the saved optimizer's eps "
        "squared (AdamW adds eps to sqrt(v)), so 1e-16 for AdamW's default.",
    )


    @field_validator("optimizer_state", mode="before")
    @classmethod
    def _paths(cls, v: Any) -> Any:
        return str(v) if isinstance(v, Path) else v


class RefineConfig(StrictModel):
    """``curvature.refine``: conjugate gradients on each target's (G + D) x = g_t (docs/guides/curvature.md)."""

    iterations: int = Field(
        0, ge=0, description="Most conjugate-gradient steps per target (0: the curvature's own solve, no refinement). "
        "Each step costs one Gauss-Newton-vector product over `samples` train rows.",
    )
    samples: PositiveInt = Field(
        256, description="Train rows (a seeded random subset, curvature.seed) over which the Gauss-Newton matrix is "
        "taken.",
    )
    tol: float = Field(1e-4, gt=0, lt=1, description="Stop a target's iterations when its residual norm is below "
                       "tol times its gradient's.")

    def spec(self) -> dict[str, Any] | None:
        """What the target features depend on (None: no refinement)."""
        return None if self.iterations == 0 else {"iterations": self.iterations, "samples": self.samples,
                                                  "tol": self.tol}


class CurvatureConfig(KindSection):
    """``curvature:``: the preconditioner of the scores (docs/guides/curvature.md).

    ``gram`` is TRAK's kernel (Φᵀ Φ + λ I)⁻¹ of the projected train features (``score.lambda_*``).
    ``kfac`` and ``ekfac`` fit, per checkpoint, per-layer Kronecker factors of the Fisher
    (Martens & Grosse 2015) and, for ``ekfac``, its eigenvalues corrected in their eigenbasis
    (George et al. 2018; Grosse et al. 2023); every gradient, train and target, is whitened by
    the damped inverse before it is projected, so scores are inner products of ``proj_dim``
    floats and approximate g_tᵀ (F + δ I)⁻¹ g_z. Fit over the training data, stored per
    checkpoint in the store (resumable).
    """

    kind: Literal["gram", "kfac", "ekfac"] = Field(
        "gram",
        description="gram: TRAK's kernel over the projected features. kfac / ekfac: Kronecker-factored Fisher "
        "(ekfac: eigenvalue-corrected) per linear, convolution or embedding layer, fitted from layer hooks; with "
        "grad_wrt unset, every linear and convolution layer it can factor (one info line names what is left out). "
        "The projector is kind kronecker unless set (the curvature folded into its per-layer factors).",
    )
    output: Literal["loss", "margin"] = Field(
        "loss",
        description="kfac / ekfac: the function whose gradients are scored. loss: each example's training loss "
        "(summed token cross-entropy for a language model, cross-entropy for a classifier), as influence "
        "functions and kronfluence define them, no out-to-loss weighting. margin: TRAK's margin times its "
        "out-to-loss term.",
    )
    query_rank: int | None = Field(
        None,
        ge=1,
        description="kfac / ekfac exact scores: rank each target's preconditioned per-layer gradient is kept at "
        "(truncated SVD; kronfluence's query_gradient_low_rank). None: full rank where every target fits "
        "data.grad_memory_mb, else the largest rank that fits (said in an info line).",
    )
    fit_rows: int | None = Field(
        None,
        ge=1,
        description="kfac / ekfac: fit the curvature on a seeded random sample of this many train rows "
        "(curvature.seed) instead of all of them; None: every train row.",
    )
    damping: float = Field(
        1e-5,
        gt=0,
        description="kfac / ekfac: each layer's damping of the influence, δ = damping x the mean of its eigenvalues, "
        "in exact scores and the refinement (1e-5 to 1e-4 scored best; kronfluence's default is an absolute 1e-8).",
    )
    exact: bool = Field(
        True,
        description="kfac / ekfac: `trak score` takes exact influences g(t)ᵀ (F + δ)⁻¹ g(z): each target's "
        "preconditioned layer gradients once (query_rank), then one hooked forward + backward over the train rows "
        "meets every target per layer and streams into the top-k or the score matrix (resumable by chunk, split "
        "over torchrun ranks); with score.rescore_multiplier only the candidates of the stored features are "
        "re-scored so. false: inner products of the stored proj_dim features (corpus scale), whitened with "
        "feature_damping.",
    )
    feature_damping: float = Field(
        0.1,
        gt=0,
        description="kfac / ekfac: the damping (x the mean eigenvalue, per layer) of the whitening of the stored "
        "projected features; the projection's error grows as it shrinks (0.1 to 0.3 scored best at proj_dim 4096).",
    )
    fisher: Literal["true", "empirical"] = Field(
        "true",
        description="kfac / ekfac: true: gradients at labels sampled from the model's own predictions (the "
        "Fisher); empirical: at the data's labels.",
    )
    seed: int = Field(0, ge=0, description="kfac / ekfac: seed of the sampled labels and of the refinement's sample.")
    refine: RefineConfig = Field(
        default_factory=lambda: RefineConfig(),
        description="kfac / ekfac: conjugate-gradient refinement of each target's inverse-Hessian-vector product "
        "with the Gauss-Newton matrix, preconditioned by the fitted curvature (`trak score`; iterations 0: off).",
    )


    def spec(self) -> dict[str, Any] | None:
        """What the stored features depend on (part of the store identity); None for ``gram``, which changes only the
        kernel. ``damping`` and ``exact`` change only the scores (the experiment's settings)."""
        if self.kind == "gram":
            return None
        spec = {"kind": self.kind, "feature_damping": self.feature_damping, "fisher": self.fisher, "seed": self.seed}
        if self.output != "margin":  # stores made before the key existed scored the margin
            spec["output"] = self.output
        if self.fit_rows is not None:
            spec["fit_rows"] = self.fit_rows
        return spec

    @model_validator(mode="after")
    def _refine_needs_curvature(self) -> "CurvatureConfig":
        if self.kind == "gram" and self.refine.iterations:
            raise ValueError("curvature.refine.iterations refines a kfac or ekfac solve; set curvature.kind: ekfac "
                             "(or kfac), or curvature.refine.iterations: 0")
        return self


class StoreConfig(StrictModel):
    """Where and how features and scores are written."""

    path: Path | str = Field(
        description="The Zarr store: a local directory (out/attrib.zarr) or an object store URL "
        "(s3://bucket/prefix/attrib.zarr; credentials and endpoint from the AWS_* environment variables, see "
        "storage_options)."
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the file system of a store.path URL (fsspec; for s3:// those of "
        "s3fs.S3FileSystem, e.g. {endpoint_url: http://127.0.0.1:8333, key: ..., secret: ...}); over the "
        "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_REGION environment variables. "
        "Secrets are never written to the store or printed.",
    )
    chunk_rows: PositiveInt = Field(
        512, description="Rows per chunk of features/scores; the unit of resume (done flags)."
    )
    save_every_s: float = Field(
        30.0,
        ge=0,
        description="Seconds of work between two saves of the train rows computed so far in a chunk not yet done "
        "(their count goes to train/<model_id>/rows_done), so that a killed `trak featurize` loses at most about "
        "this much work and the rerun starts after the saved rows; Ctrl-C saves them at once. 0: after every "
        "batch. Each save rewrites the chunk's file: keep it well above the time one save takes.",
    )
    dtype: Literal["float32", "float16", "bfloat16", "int8", "binary"] = Field(
        "float32",
        description="Storage dtype of train and target features: float16 or bfloat16 halve the disk (bfloat16 "
        "keeps float32's range, float16 three more bits of precision); compute stays float32, kernels float64. "
        "int8 (per-row scale) or binary (1-bit signs, per-row scale) add compressed codes beside a bfloat16 copy: "
        "score.top_k then finds candidates from the codes and re-ranks them exactly from the bfloat16 copy "
        "(two-stage top-k); the kernel and the full score matrix use the bfloat16 copy.",
    )
    compressor: Literal["zstd", "blosc", "none"] = Field(
        "zstd", description="Compression codec of every array (each chunk also carries a CRC32C checksum)."
    )

    @field_validator("path", mode="before")
    @classmethod
    def _names_a_directory(cls, v: Any) -> Any:
        """The store is a directory (or prefix) of its own: its lock and caches go beside it, named after it.

        A URL (``s3://...``) stays text and is opened, or refused with its reason, when a command uses the
        store (:func:`trakcli.store.location.store_location`); anything else is a local :class:`Path`.
        """
        from trakcli.store.location import broken_url, is_url

        if isinstance(v, str) and broken_url(v):
            scheme = broken_url(v)
            rest = v.split(":", 1)[1].lstrip("/")
            raise ValueError(f"{v!r} reads as a {scheme}:// URL missing a slash; write {scheme}://{rest} (a local "
                             f"folder named '{v.split(':', 1)[0]}:' is never made of it)")
        if isinstance(v, str) and v[:7].lower() == "file://":
            v = v[7:]
        if isinstance(v, str) and is_url(v):
            name = v.split("://", 1)[1].rstrip("/").rsplit("/", 1)[-1]
            if not name or name in (".", ".."):
                raise ValueError("must name the store's own prefix below the bucket, e.g. "
                                 "store.path=s3://bucket/attrib.zarr")
            return v.rstrip("/")
        if not isinstance(v, (str, Path)):
            return v
        path = Path(v)
        if not path.name or path.name == "..":
            raise ValueError(
                "must name the store's own directory (its lock file goes beside it), not '.', '..' or a root; "
                "e.g. store.path=out/attrib.zarr"
            )
        return path

    @field_serializer("storage_options")
    def _hide_secrets(self, v: dict[str, Any]) -> dict[str, Any]:
        """Credentials in ``storage_options`` are masked wherever the config is written or printed."""
        return _masked(v)

    @property
    def location(self) -> Any:
        """The store as a :class:`~pathlib.Path`, or a :class:`upath.UPath` for a URL.

        Raises:
            StoreError: a URL no installed file system opens (names the scheme or the package to install).
        """
        from trakcli.store.location import store_location

        return store_location(self.path, self.storage_options)


_SECRET = ("secret", "token", "password", "key", "credential")


def _masked(v: Any) -> Any:
    """``v`` with the values of secret-like keys (``key``, ``secret``, ``token``, ...) replaced by ``"***"``."""
    if isinstance(v, dict):
        return {k: "***" if isinstance(k, str) and any(s in k.lower() for s in _SECRET) and not isinstance(val, dict)
                else _masked(val) for k, val in v.items()}
    return v



def group_name(v: str, example: str) -> str:
    """``v`` if it names one group of the store: non-empty, no ``/`` or ``\\``, not ``.`` or ``..``, not
    starting with ``__``, no surrounding spaces.

    Raises:
        ValueError: it does not (pydantic reports it with the key), naming ``example``.
    """
    if not v or "/" in v or "\\" in v or v in (".", "..") or v.startswith("__") or v != v.strip():
        raise ValueError(
            "must name one group of the store: a non-empty name without '/' or '\\', not '.' or '..', not "
            f"starting with '__' and without surrounding spaces, e.g. {example}"
        )
    return v

class ScoreConfig(StrictModel):
    """Kernel and scoring options."""

    experiment: str = Field("default", description="Name of this set of targets in the store.")
    method: Literal["kernel", "unroll"] = Field(
        "kernel",
        description="kernel: the scores of the stored features (TRAK's kernel, or the curvature's influence). "
        "unroll: metagradients through the recorded training of each checkpoint, -d loss(target) / d w_i with "
        "w_i the weight of example i's loss in every step (MAGIC; needs checkpoints: <out_dir>/manifest.json "
        "of a trak optimize run with optimize.replay: true, and no trak featurize; docs/guides/unroll.md).",
    )
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
    top_k: PositiveInt | None = Field(
        None,
        description="Per target, keep the K highest-scoring train rows (proponents) and the K lowest (opponents), "
        "from one streamed pass over the train features: [n_target, K] arrays in the store, memory independent "
        "of n_train. Unset: the full [n_target, n_train] score matrix.",
    )
    full: bool | None = Field(
        None,
        description="Also write the full [n_target, n_train] score matrix (trak eval lds needs it). "
        "Unset: only when top_k is unset.",
    )
    normalize: Literal["unit"] | None = Field(
        None,
        description="unit: cosine scores in the kernel's space, cos(A^½φ(t), A^½φ(z)) averaged over checkpoints, "
        "without Q (TrackStar; for retrieving source documents). Unset: TRAK's scores (for predicting "
        "counterfactual retraining).",
    )
    per_token: bool = Field(
        False,
        description="Language models: split each top document's score over the target's tokens and over the "
        "document's tokens (which completion tokens it explains, which of its tokens carry it); needs top_k. "
        "Stored beside the top-k; trak score --out answers.jsonl and trak report show them.",
    )
    rescore_multiplier: PositiveInt | None = Field(
        None,
        description="Two-stage top-k (store.dtype int8 or binary; or curvature kfac / ekfac with exact scores, "
        "whose candidates come from the stored features and are re-scored by exact influence), "
        "K' = rescore_multiplier · top_k: per target, "
        "the K' train rows with the highest (and lowest) scores from the compressed codes are re-scored exactly "
        "from the bfloat16 copy (FAISS's k_factor, sentence-transformers' rescore_multiplier). Larger: higher "
        "recall, slower. Unset: the default of the store's dtype: int8 2 (recall@100 1.0 measured at 10^6 "
        "rows), binary 16 (recall@100 only 0.35 / 0.10 there: prefer int8). Every run reports its measured recall.",
    )
    rerank: Literal["auto", "scan"] = Field(
        "auto",
        description="Two-stage top-k: how the candidates are re-ranked. scan: one pass reads each row's codes and "
        "float copy together, in order, and scores every candidate exactly as its block passes. auto: scan where "
        "it can start from a sampled floor (a store of more than about 3 · K' chunks); on a smaller store the "
        "plain streamed pass over the float copy, which is faster there (one info line says so).",
    )
    recall_queries: PositiveInt = Field(
        16,
        description="Two-stage top-k: targets (evenly spaced) whose exact top-k is also computed from the bfloat16 "
        "copy, to measure and report the recall of the two-stage top-k against it (recorded in the store).",
    )
    show_top: PositiveInt = Field(5, description="Proponents and opponents the summary table shows per target.")
    show_targets: int = Field(3, ge=0, description="How many targets the summary table shows.")

    @field_validator("experiment")
    @classmethod
    def _experiment_name(cls, v: str) -> str:
        return group_name(v, "score.experiment=test_set")

    @model_validator(mode="after")
    def _something_to_write(self) -> "ScoreConfig":
        if self.full is False and self.top_k is None:
            raise ValueError("score.full is false and score.top_k is unset: nothing to compute; set score.top_k "
                             "(e.g. score.top_k=100) or leave score.full unset")
        if self.per_token and self.top_k is None:
            raise ValueError("score.per_token is true and score.top_k is unset: the scores of each target's top "
                             "documents are split over tokens; set score.top_k (e.g. score.top_k=20)")
        return self


class SelectConfig(StrictModel):
    """``select:``: `trak select`, data selection for a target task (LESS: Xia et al. 2024, "LESS: Selecting
    Influential Data for Targeted Instruction Tuning").

    Every data.train row (the pool) gets one score against the data.target rows (a handful of examples of the
    task): per checkpoint the cosine (``normalize: unit``) of its features with each target's, summed over
    checkpoints, aggregated over the targets; the top rows are written to ``out`` in data.train's format.
    """

    fraction: float | None = Field(
        None, gt=0, le=1, description="Share of data.train to keep: round(fraction * n_train) rows (Python's round, "
        "at least 1). Unset together with count: 0.05 (LESS's 5%).",
    )
    count: PositiveInt | None = Field(None, description="Rows of data.train to keep (instead of fraction; at most "
                                      "n_train).")
    out: LocalPath | None = Field(
        None, description="The file the selected rows go to, in data.train's format: .jsonl lines (or .csv records) "
        "copied verbatim, .parquet / .arrow tables, .pt / .npz tensors under data.train's keys, in pool order. Their "
        "scores go beside it to <out stem>.scores.jsonl. Required by trak select.",
    )
    aggregate: Literal["max_mean", "mean", "sum"] = Field(
        "max_mean", description="How a row's scores against the targets become one: max_mean, the highest over the "
        "target groups (group_by) of the mean over the group's targets (LESS); mean or sum over all targets.",
    )
    group_by: str | None = Field(
        None, description="max_mean: the field (text data) or key (tensor file, [n_target]) of data.target whose "
        "values group the targets, e.g. one group per task; a row's score is its best group's. It groups the "
        "targets, not the pool, and does not by itself give every group rows: quota: equal does. Unset: all "
        "targets are one group.",
    )
    quota: Literal["equal"] | None = Field(
        None, description="With group_by. equal: every target group gets an equal share of the kept rows (k // "
        "n_groups each, one more for the first k % n_groups groups in order of appearance; at least one row per "
        "group, so k >= n_groups), the groups taking turns, each its highest-scoring row (mean over its targets) "
        "not yet taken. null: one ranking by each row's best group score (LESS), so a group whose targets match the "
        "pool more closely may take most or all of the rows.",
    )
    normalize: Literal["unit"] | None = Field(
        "unit", description="unit: cosines of the features (LESS). null: their inner products (longer or "
        "higher-loss rows then weigh more).",
    )
    experiment: str = Field(
        "select", description="Name of the target features in the store (targets/<experiment>); a rerun with the "
        "same targets reuses them.",
    )
    show: int = Field(5, ge=0, description="Top selected rows the summary shows, with their texts.")

    @field_validator("experiment")
    @classmethod
    def _experiment_name(cls, v: str) -> str:
        return group_name(v, "select.experiment=task_a")

    @model_validator(mode="after")
    def _one_size(self) -> "SelectConfig":
        if self.fraction is not None and self.count is not None:
            raise ValueError(f"select.fraction ({self.fraction}) and select.count ({self.count}) are both set: give "
                             "one, a share of data.train (fraction) or a number of rows (count)")
        if self.group_by is not None and self.aggregate != "max_mean":
            raise ValueError(f"select.group_by groups the targets of aggregate max_mean; aggregate {self.aggregate} "
                             "takes every target alike: unset group_by, or set aggregate: max_mean")
        if self.quota is not None and self.group_by is None:
            raise ValueError(f"select.quota: {self.quota} shares the kept rows among the target groups of "
                             "select.group_by, which is unset: set group_by (e.g. a task field), or unset quota")
        return self



class SweepConfig(StrictModel):
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
    dir: LocalPath | None = Field(
        None, description="Where the sweep's per-proj_dim stores go; unset: <store.path>.sweep/ beside the store."
    )

    @field_validator("lambda_rel", "lambda_reg")
    @classmethod
    def _positive(cls, v: list[float]) -> list[float]:
        bad = [x for x in v if not x > 0]
        if bad:
            raise ValueError(f"every ridge must be > 0, got {bad}")
        return v


class QLDConfig(StrictModel):
    """``eval.qld``: `trak eval qld`, retraining without each query's top proponents (the query loss difference)."""

    queries: PositiveInt = Field(20, description="Targets taken as queries (a seeded random choice, eval.seed).")
    fraction: float = Field(
        0.01, gt=0, lt=1, description="Share of data.train left out per query: its top proponents, and as many "
        "random rows (round(fraction * n_train), at least 1).",
    )
    seeds: PositiveInt = Field(1, description="Training seeds per model (the three models of a query share each).")
    per_token: bool = Field(
        False,
        description="Leave out training tokens instead of rows: the round(fraction * n_tokens) train tokens with "
        "the highest per-token scores for the query are masked out of the loss while retraining, against as many "
        "random tokens (language models; needs the featurized and scored store).",
    )


class RecallConfig(StrictModel):
    """``eval.recall``: fact tracing (`trak eval recall`): do the top proponents hold each query's source?

    Every row of data.target names, in the field ``sources``, the 0-based rows of
    data.train that hold its fact; the ranking is the experiment's top-k
    proponents (``score.top_k``), or its full score matrix ranked.
    """

    sources: str = Field(
        "sources",
        description="Field of each data.target row listing its source documents: 0-based row indices of "
        "data.train (a JSON list of integers; in a .csv cell its JSON text, e.g. \"[3, 17]\").",
    )
    k: list[PositiveInt] | None = Field(
        None,
        description="The k of recall@k, each at most score.top_k. Unset: 1, 5, 10, 20, 50, 100 up to K, and K.",
    )

    @field_validator("k", mode="before")
    @classmethod
    def _one_k(cls, v: Any) -> Any:
        return [v] if isinstance(v, (int, str)) else v


class EvalConfig(StrictModel):
    """``eval:``: counterfactual retraining for the linear datamodeling score (`trak eval lds`)
    and fact tracing (`trak eval recall`).

    LDS (Park et al. 2023, "TRAK", Sec. 2.2; Ilyas et al. 2022, "Datamodels"):
    ``n_subsets`` models are trained with the config's training recipe on random
    ``subset_fraction`` subsets of data.train; per target, the Spearman
    correlation between ``mask @ scores[t]`` and the retrained models' outputs.
    """

    n_subsets: PositiveInt = Field(100, description="Models retrained on random subsets.")
    subset_fraction: float = Field(
        0.5, gt=0, lt=1, description="Share of data.train in each subset (exactly round(fraction * n_train) rows)."
    )
    seed: int = Field(
        0, ge=0, description="Seed of the subsets, of the retrained models' initializations and of the bootstrap "
        "resamples (lds and recall)."
    )
    bootstrap: PositiveInt = Field(
        1000, description="Bootstrap resamples of the targets for the 95% interval of the LDS (and of MRR and "
        "recall@k)."
    )
    retrain_seed: Literal["other", "same"] = Field(
        "other", description="Seed of each retrained model. other: model k gets 10**6 + 100003 * eval.seed + k, "
        "unlike any checkpoint's (the LDS of the question 'what if the data were different and the run "
        "retrained'). same: model k reuses the seed of checkpoint k mod optimize.n_models, optimize.seed + "
        "(k mod n_models): the attributed run's initialization and order generator, only the rows differ "
        "(toward the same-seed LDS of MAGIC, Ilyas & Engstrom 2025; docs/guides/unroll.md measures both)."
    )
    sweep: SweepConfig = Field(
        default_factory=SweepConfig, description="The grid of `trak eval sweep` (one featurization per proj_dim)."
    )
    recall: RecallConfig = Field(
        default_factory=RecallConfig, description="`trak eval recall`: where each query's sources are, the k of recall@k."
    )
    qld: QLDConfig = Field(
        default_factory=QLDConfig, description="`trak eval qld`: queries, the share of rows left out, seeds."
    )
    bm25: bool = Field(
        True, description="On text data, report BM25 word-overlap scores (bm25s) beside the scores' LDS, QLD and "
        "recall: a result BM25 matches measures word overlap.",
    )


class Config(StrictModel):
    """A whole trakcli run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    checkpoints: str | list[str] = Field(
        description="A glob or a list of .pt / .safetensors state dicts (or, for an hf: model, Hugging Face "
        "model directories or Hub names hf:ORG/NAME[@REVISION][/FOLDER], or PEFT adapter folders "
        "(adapter_config.json; model.entrypoint is then the base model and features default to the adapter's "
        "parameters)); model_id = index in sorted order. Or the manifest.json `trak optimize` writes into its "
        "out_dir: its checkpoints in model_id order, checked against their recorded sha256."
    )
    data: DataConfig
    task: str = Field(
        "classification",
        description="Model output function. classification / text_classification: the margin "
        "logit_y - logsumexp_{j!=y} logit_j of the logits (of a tensor input / of a text's sequence logits); "
        "language_modeling (causal LMs): the sum over the target tokens (per-token labels != -100: every token "
        "of plain text, the completion, the assistant turns) of each next-token margin; "
        'or your own "path/to/file.py:fn" / "package.module:fn", fn(logits, batch) -> (f [n], Q [n]) where '
        'batch holds every tensor of the batch (input_ids, attention_mask, labels, ...) '
        '(docs/guides/own-models.md, "Custom model outputs").',
    )
    grad_wrt: list[str] | None = Field(
        None, description="fnmatch patterns of parameter names to differentiate (unset: all)."
    )
    gradient_method: Literal["auto", "hooks", "vmap"] = Field(
        "auto", description="Per-example gradients: hooks (layer hooks, one batched forward + backward), vmap "
        "(torch.func), auto (hooks where they cover the model, else vmap). Not in the store identity (same to rounding).",
    )
    projector: ProjectorConfig = Field(default_factory=ProjectorConfig)
    second_moment: SecondMomentConfig = Field(
        default_factory=SecondMomentConfig,
        description="Optimizer second-moment correction of the gradients (TrackStar): kind null, adafactor or adam.",
    )
    curvature: CurvatureConfig = Field(
        default_factory=CurvatureConfig,
        description="The preconditioner: kind gram (TRAK's kernel, the default), kfac or ekfac (Kronecker-factored "
        "Fisher per layer, fit per checkpoint).",
    )
    store: StoreConfig
    score: ScoreConfig = Field(default_factory=ScoreConfig)
    select: SelectConfig = Field(
        default_factory=SelectConfig,
        description="`trak select`: the share of data.train to keep for the data.target task, how scores are "
        "aggregated, where the selected rows go.",
    )
    optimize: OptimizeConfig | None = Field(
        None, description="The training recipe of `trak optimize` (and of the retrained models of `trak eval`)."
    )
    eval: EvalConfig = Field(default_factory=EvalConfig)
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda if available, else cpu.")
    num_threads: PositiveInt | None = Field(
        None, description="torch intra-op CPU threads (unset: torch's default, one per core)."
    )
    linalg_threads: PositiveInt | None = Field(None, description="torch CPU threads for the dense linear algebra "
                                               "of kernels and scores, not limited by num_threads (unset: one per core).")

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
                if (isinstance(ds, dict) and ds.get("tokenizer") is None
                        and any(ds.get(k) is not None for k in ("text", "prompt", "completion", "messages", "input_ids"))):
                    data[name] = {**ds, "tokenizer": ep.removeprefix("hf:")}
            raw["data"] = data
        if builtin_task_labels(raw.get("task")) == "tokens":
            kwargs = model.get("kwargs") if isinstance(model.get("kwargs"), dict) else {}
            if "model_class" not in kwargs:
                raw["model"] = {**model, "kwargs": {**kwargs, "model_class": "causal_lm"}}
        return raw

    @model_validator(mode="after")
    def _second_moment_kind(self) -> "Config":
        """``adam`` scales entries of the whole per-example gradient, which a kind built from the model
        (kronecker) never forms."""
        if self.second_moment.kind == "adam" and self.projector.built_from_model:
            raise ValueError(
                "second_moment.kind: adam scales each entry of the whole per-example gradient, which projector.kind "
                f"{self.projector.kind} never forms; use second_moment.kind: adafactor (factored per layer) or another projector kind"
            )
        return self

    @model_validator(mode="after")
    def _rescore_needs_codes(self) -> "Config":
        """``score.rescore_multiplier`` and ``score.rerank`` tune the two-stage top-k, which needs codes and a
        top-k."""
        if self.score.rescore_multiplier is None and self.score.rerank != "auto":
            if self.store.dtype not in ("int8", "binary") or self.score.top_k is None:
                raise ValueError(
                    f"score.rerank ({self.score.rerank}) sets how the two-stage top-k re-ranks its candidates, which "
                    f"needs store.dtype int8 or binary (here {self.store.dtype}) and score.top_k "
                    f"(here {self.score.top_k}); set both, or unset score.rerank")
        if self.score.rescore_multiplier is None:
            return self
        exact_curvature = self.curvature.kind != "gram" and self.curvature.exact
        if self.store.dtype not in ("int8", "binary") and not exact_curvature:
            raise ValueError(
                f"score.rescore_multiplier ({self.score.rescore_multiplier}) sets the candidates of the two-stage "
                f"top-k, which finds them from int8 or binary codes, but store.dtype is {self.store.dtype}; set "
                "store.dtype: int8 (or binary) and featurize again, or unset score.rescore_multiplier"
            )
        if self.score.top_k is None:
            raise ValueError(
                f"score.rescore_multiplier ({self.score.rescore_multiplier}) sets the candidates of the two-stage "
                "top-k, but score.top_k is unset; set score.top_k (e.g. score.top_k=100) or unset "
                "score.rescore_multiplier"
            )
        return self

    @model_validator(mode="after")
    def _curvature_projector(self) -> "Config":
        """kfac / ekfac take projector kind kronecker unless a kind is set: its per-layer factors carry the
        curvature, with no whole per-example gradient. Another kind whitens whole per-example gradients (what
        ``curvature.refine`` needs)."""
        if self.curvature.kind == "gram":
            return self
        if "kind" not in self.projector.model_fields_set and not self.projector.built_from_model:
            self.projector = self.projector.model_copy(update={"kind": "kronecker"})
        if self.curvature.refine.iterations and self.projector.built_from_model:
            raise ValueError(
                f"curvature.refine.iterations refines each target's solve over whole per-example gradients, which "
                f"projector.kind {self.projector.kind} never forms; set projector.kind: {DEFAULT_KIND} with the "
                "refinement, or curvature.refine.iterations: 0"
            )
        return self

    @model_validator(mode="after")
    def _labels_for_task(self) -> "Config":
        """A built-in classification task needs class labels: text without ``labels``, prompt + completion,
        chat and token data carry per-token labels, which only ``language_modeling`` (or a custom task) reads."""
        if builtin_task_labels(self.task) != "classes":
            return self
        for name in ("train", "target", "validation"):
            ds = getattr(self.data, name)
            source = ds.text_source if ds is not None else None
            if source == "text" and ds.labels is None:
                raise ValueError(
                    f"data.{name}.labels: task {self.task} needs the label field of the text file "
                    "(only task language_modeling reads texts without labels)"
                )
            if source in ("prompt", "messages") or (source == "input_ids" and ds.labels is None):
                what = {"prompt": "prompt + completion", "messages": "chat (messages)"}.get(source, "token")
                raise ValueError(
                    f"data.{name}: {what} data is language-model data with per-token targets; set task: "
                    "language_modeling (or your own task reading batch['labels'])"
                )
        return self

    @model_validator(mode="before")
    @classmethod
    def _not_sections(cls, raw: Any) -> Any:
        """Refuse ``training:`` and ``optimizer:`` naming the ``optimize:`` keys that replace them
        (a did-you-mean would suggest ``optimize.optimizer`` for the whole section)."""
        if isinstance(raw, dict):
            for key, fix in NOT_SECTIONS.items():
                if key in raw:
                    raise ValueError(f"{key}: is not a config section; {fix}")
        return raw

    @field_validator("second_moment", mode="before")
    @classmethod
    def _second_moment_off(cls, v: Any) -> Any:
        """``second_moment: null`` is no correction."""
        return {} if v is None else v

    @field_validator("store", mode="before")
    @classmethod
    def _store_path(cls, v: Any) -> Any:
        return {"path": v} if isinstance(v, (str, Path)) else v

    @field_validator("task")
    @classmethod
    def _task_name(cls, v: str) -> str:
        """A built-in task or a function spec (imported when featurizing, not when the config is read)."""
        if v in BUILTIN_TASKS or (":" in v and all(v.rsplit(":", 1))):
            return v
        close = difflib.get_close_matches(v, BUILTIN_TASKS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"{v!r} is not a task; {hint}use one of {', '.join(BUILTIN_TASKS)} or your own output function "
            'as "path/to/file.py:fn" or "package.module:fn"'
        )

    @field_validator("grad_wrt", mode="before")
    @classmethod
    def _one_pattern(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @property
    def recipe(self) -> OptimizeConfig | None:
        """The training recipe (``optimize:``); ``None``: the config has none."""
        return self.optimize

    def resolved(self) -> dict[str, Any]:
        """The config as plain JSON-able data (what `--print-config` shows and the store records)."""
        return self.model_dump(mode="json")
