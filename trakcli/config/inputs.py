"""The ``model:`` and ``data:`` sections of the config: the model's entrypoint and the train and target data."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from trakcli.strict import StrictModel
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
        None, description="A .pt file holding a dict of tensors, an .npz file, or (with `text`, `prompt`, `messages` "
        "or `input_ids`) a .jsonl / .csv / .parquet / .arrow file or a Hugging Face datasets save_to_disk folder. Or "
        "a Hugging Face Hub dataset, hf://datasets/ORG/NAME[@REVISION][/PATH] (PATH: a file, folder or glob; without "
        "it the repo's only data file or its train split's), downloaded into the Hugging Face cache, or read from it "
        "with HF_HUB_OFFLINE=1. Or a list of such files, read as one dataset in order (the rows of the first, then of "
        "the second, ...): a corpus grown by a new file is appended to its store.",
    )

    @field_validator("path", mode="before")
    @classmethod
    def _hub_url(cls, v: Any) -> Any:
        """A Hub URL stays a string, other strings are paths; a list of one path is that path."""
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
        None, description="Tensor file: key of the integer class labels, shape [n], or (with inputs [input_ids, "
        "attention_mask, ...]) of per-token labels [n, L] shaped like input_ids (-100: not a target). With `text`: "
        "the field of the integer class label (text classification; leave it out for language modeling). With "
        "`input_ids`: the field of per-token labels, as long as input_ids (-100: not a target; leave it out to make "
        "every token a target).",
    )
    text: str | None = Field(
        None, description="Text data: the field holding the text (.jsonl / .csv / .parquet / .arrow / datasets "
        "folder); with `labels` text classification, without language modeling (every token a target).",
    )
    text_pair: str | None = Field(
        None, description="Text data: the field holding each example's second text (sentence pairs, e.g. NLI); the "
        "two are tokenized as one pair (with token_type_ids where the tokenizer makes them). Needs `text`.",
    )
    prompt: str | None = Field(
        None, description="Language-model data: the field holding the prompt (tokenized with the tokenizer's special "
        "tokens; not a target). Needs `completion`.",
    )
    completion: str | None = Field(
        None, description="Language-model data: the field holding the completion, appended to the prompt's tokens "
        "(without special tokens, plus the tokenizer's end-of-sequence token); its tokens are the targets. Needs "
        "`prompt`.",
    )
    messages: str | None = Field(
        None,
        description="Chat data: the field holding a list of {role, content} messages, rendered by the "
        "tokenizer's chat template; the tokens of the assistant turns are the targets.",
    )
    input_ids: str | None = Field(
        None, description="Pre-tokenized language-model data: the field holding each row's list of token ids (see "
        "`labels` for per-token labels). `tokenizer` is optional (its pad token and decoding; without one rows are "
        "padded with id 0).",
    )
    max_length: PositiveInt | None = Field(
        128, description="Text and language-model data: most tokens per row (longer rows are cut on the right, "
        "pre-tokenized `input_ids` too); null: no cut (a row longer than the tokenizer's model_max_length is an "
        "error). data.target may have its own (queries are often shorter than training documents): features are per "
        "example, so target and train lengths need not match.",
    )
    tokenizer: str | None = Field(
        None, description="Text and language-model data: a local Hugging Face tokenizer directory (or package/dir), "
        "or a Hub name ORG/NAME[@REVISION] (only its tokenizer files are downloaded); default: that of "
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
            raise ValueError(f"`{given}` needs `{other}` too: prompt + completion data name both fields (the "
                             "completion's tokens are the targets); for plain text use `text`")
        kinds = [name for name, on in (("text", self.text), ("prompt + completion", self.prompt),
                                       ("messages", self.messages), ("input_ids", self.input_ids)) if on is not None]
        if len(kinds) > 1:
            raise ValueError("give one of `text`, `prompt` + `completion`, `messages` or `input_ids` per dataset, not "
                             f"{' and '.join(f'`{k}`' for k in kinds)}")
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
                raise ValueError(f"give either `{kind}` (fields of a .jsonl / .csv / .parquet file) or `inputs` (keys "
                                 "of a tensor file), not both")
            if self.labels is not None and kind in ("prompt + completion", "messages"):
                target = "the completion" if kind == "prompt + completion" else "the assistant turns"
                raise ValueError(f"`labels` is not read with `{kind}` data: its targets are the tokens of {target}; "
                                 "for per-token labels give pre-tokenized `input_ids` + `labels`")
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
                raise ValueError("a text dataset needs `tokenizer` (a local Hugging Face directory), or use "
                                 "model.entrypoint 'hf:DIR', whose tokenizer is then taken")
        else:
            missing = [k for k in ("path", "inputs", "labels") if getattr(self, k) is None]
            if missing:
                raise ValueError(f"a file dataset needs {', '.join(missing)} (or use `builtin: digits`, or `text`, "
                                 "`prompt` + `completion`, `messages` or `input_ids` for a text file)")
        return self


class DataConfig(StrictModel):
    """Training and target data."""

    train: DatasetConfig = Field(description="The training set whose examples get scores.")
    target: DatasetConfig | None = Field(None, description="The examples whose predictions are explained.")
    validation: DatasetConfig | None = Field(
        None, description="Held-out examples `trak optimize` evaluates after every epoch (loss and accuracy in the "
        "progress bar, the manifest and the metrics JSON); featurize and score ignore it.",
    )
    batch_size: PositiveInt = Field(128, description="Examples per gradient batch.")
    batch_tokens: PositiveInt | None = Field(
        None, description="Most tokens per batch of text and language-model data, counted as rows x the batch's "
        "longest sequence (each batch is padded to its own longest row); a single row longer than this is a batch of "
        "its own. None: rows only (data.batch_size). Changes the features only by float32 rounding.",
    )
    grad_memory_mb: PositiveInt | None = Field(
        None, description="Most MiB of per-example gradients (batch rows x grad_dim float32) held at once: a batch is "
        "cut into smaller ones to fit (the features change only by float32 rounding). Bounds the memory of big "
        "models. projector.kind kronecker forms no per-example gradient: it bounds the layer inputs, outputs and "
        "output gradients of one forward + backward instead. Unset: 1024 on a CPU, a quarter of the GPU's memory on a "
        "CUDA GPU.",
    )
