"""PEFT adapters (LoRA and the other kinds of the ``peft`` package) as checkpoints.

Each entry of ``checkpoints:`` may be a folder peft's ``save_pretrained`` writes (recognized by its
``adapter_config.json``). The base model (``model.entrypoint``) is wrapped once, with
``peft.get_peft_model`` and the first folder's adapter config, and each checkpoint then sets the
adapter weights only (``peft.set_peft_model_state_dict``).

The parameters differentiated by default (``grad_wrt`` unset) are the adapter's trainable ones (LoRA's ``lora_A`` /
``lora_B`` weights, and ``modules_to_save``), named as the wrapped model's ``named_parameters()`` and an optimizer state
of the adapter name them: ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``. LoRA's ``A`` and
``B`` are ``nn.Linear`` layers of their own, so ``projector.kind: kronecker`` factors each as the layer it is: ``B``'s
input is ``A x``, and the output gradient of ``B`` carries LoRA's ``alpha / r`` scaling (Hu et al. 2022, "LoRA", Eq. 3:
``h = W₀x + (alpha/r)·B A x``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from trakcli.errors import CheckpointError, ConfigError, ModelError

ADAPTER_CONFIG = "adapter_config.json"
#: the weight files of an adapter folder, in the order they are looked for
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
PEFT_INSTALL = "pip install peft (keep torch==2.13.0 on the same pip line)"


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` is a folder of a PEFT adapter (holds ``adapter_config.json``)."""
    p = Path(path)
    return p.is_dir() and (p / ADAPTER_CONFIG).is_file()


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (it has a ``peft_config``)."""
    return isinstance(getattr(model, "peft_config", None), dict) and hasattr(model, "active_adapter")


def import_peft() -> Any:
    """The ``peft`` module, or a :class:`~trakcli.errors.ModelError` naming the pip command."""
    try:
        import peft
    except ImportError:
        raise ModelError(f"checkpoints: PEFT adapter folders need the peft package; install it with {PEFT_INSTALL}"
                         ) from None
    return peft


def with_adapters(model: nn.Module, checkpoints: Sequence[Path]) -> nn.Module:
    """``model`` (the base model, on the CPU) wrapped for the adapter folders among the run's ``checkpoints``.

    Returns:
        A ``peft.PeftModel`` around ``model`` built from the first folder's adapter config, in eval mode, with the base
        model's ``trak_*`` attributes and ``trak_trainable`` (the names of the adapter's trainable parameters, what
        ``grad_wrt`` defaults to); ``model`` unchanged when no checkpoint is an adapter folder.

    Raises:
        ConfigError: adapter folders mixed with other checkpoints, or adapters of another kind
            of model (peft refuses to wrap it: its message).
        ModelError: peft is not installed.
    """
    adapters = [is_adapter_dir(c) for c in checkpoints]
    if not any(adapters):
        return model
    if not all(adapters):
        full = next(c for c, a in zip(checkpoints, adapters) if not a)
        raise ConfigError(f"checkpoints: {sum(adapters)} of {len(adapters)} are PEFT adapter folders, but "
                          f"{str(full)!r} is not; give adapter folders only (the base model is model.entrypoint) or "
                          "whole checkpoints only")
    if is_peft_model(model):
        return model
    peft = import_peft()
    first = Path(checkpoints[0])
    try:
        config = peft.PeftConfig.from_pretrained(str(first))
    except Exception as e:  # noqa: BLE001 - any unreadable adapter config is one message
        raise CheckpointError(f"cannot read the adapter config of {first}: {type(e).__name__}: {e}") from None
    config.inference_mode = False  # the adapter's parameters are differentiated
    try:
        with torch.random.fork_rng(devices=[]):  # peft initializes with the global RNG
            wrapped = _wrap(peft, model, config)
    except Exception as e:  # noqa: BLE001 - peft's refusal (target modules not in the model) is the message
        raise ConfigError(f"checkpoints: the adapter {first} does not fit model.entrypoint "
                          f"({getattr(model, 'trak_entrypoint', type(model).__name__)}): {type(e).__name__}: {e}; the "
                          f"adapter was trained on {config.base_model_name_or_path!r}") from None
    return wrapped.eval()


def load_adapter(model: nn.Module, path: Path) -> None:
    """Set the adapter weights of a ``PeftModel`` from the adapter folder ``path``, checking keys and shapes.

    Raises:
        CheckpointError: the model is no PEFT model, the folder has no weights, or its weights miss adapter parameters
            of the model, have keys the model lacks, or other shapes (another ``r``, other target modules).
    """
    from trakcli.models.checkpoints import read_state_dict

    if not is_peft_model(model):
        raise CheckpointError(f"checkpoint {path} is a PEFT adapter folder but the model is not a PEFT model; build "
                              "the base model with model.entrypoint and give the adapter folders as checkpoints (they "
                              "are wrapped with peft), or pass a peft.PeftModel to the Python API")
    peft = import_peft()
    weights = next((path / name for name in ADAPTER_WEIGHTS if (path / name).is_file()), None)
    if weights is None:  # a folder may hold full-model weights beside the adapter's: those are not read
        raise CheckpointError(f"adapter folder {path} has {ADAPTER_CONFIG} but no weights "
                              f"({' or '.join(ADAPTER_WEIGHTS)}); save the adapter with model.save_pretrained(folder)")
    sd = read_state_dict(weights)
    own = dict(model.named_parameters())
    try:
        result = peft.set_peft_model_state_dict(model, sd)
    except RuntimeError as e:  # shape mismatches from load_state_dict
        raise CheckpointError(f"adapter {path} does not fit the model's adapter: {' '.join(str(e).split())[:400]}; "
                              "every adapter checkpoint must have the same adapter config (r, "
                              "target_modules)") from None
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    trainable = set(getattr(model, "trak_trainable", [n for n, p in own.items() if p.requires_grad]))
    missing = [k for k in (getattr(result, "missing_keys", []) or []) if k in trainable]
    if unexpected or missing:
        parts = ([f"keys the model's adapter lacks {unexpected[:5]}"] if unexpected else []) + (
            [f"adapter parameters it lacks {missing[:5]}"] if missing else [])
        raise CheckpointError(f"adapter {path} does not fit the model's adapter: {', '.join(parts)}; every adapter "
                              "checkpoint must have the same adapter config (r, target_modules) as the first")


def _wrap(peft: Any, model: nn.Module, config: Any) -> nn.Module:
    """``peft.get_peft_model(model, config)`` with ``model``'s ``trak_*`` attributes and ``trak_trainable`` (its
    trainable parameters)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecations, raised inside peft
        wrapped = peft.get_peft_model(model, config)
    for key, value in vars(model).items():
        if key.startswith("trak_"):
            setattr(wrapped, key, value)
    wrapped.trak_trainable = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    return wrapped


def add_lora(model: nn.Module, r: int, alpha: float, dropout: float, target_modules: list[str] | str) -> nn.Module:
    """``model`` wrapped with fresh LoRA adapters (``optimize.lora``), its other weights frozen.

    The adapters are initialized by peft from the global RNG (seeded by the caller): ``A`` as
    Kaiming-uniform, ``B`` zero, so the wrapped model first computes what ``model`` computes.

    ``model`` is changed (its weights get ``requires_grad=False``); ``r``, ``alpha``, ``dropout`` and ``target_modules``
    are LoRA's rank, scaling numerator, dropout and layers (:class:`trakcli.config.recipe.LoraSettings`). Returns the
    ``peft.PeftModel``, with ``trak_trainable`` naming the adapter's parameters.

    Raises:
        ModelError: peft missing, or peft refuses the target modules (its message and the fix).
    """
    peft = import_peft()
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules)
    try:
        return _wrap(peft, model, config)
    except Exception as e:  # noqa: BLE001 - peft's refusal is the message
        raise ModelError(f"optimize.lora.target_modules {target_modules!r}: peft cannot add LoRA adapters to "
                         f"{getattr(model, 'trak_entrypoint', type(model).__name__)}: {type(e).__name__}: {e}; name "
                         "linear layers of the model (their names or name suffixes) or use \"all-linear\"") from None


def save_adapter(model: nn.Module, path: Path) -> None:
    """Write the adapter of a ``PeftModel`` to the folder ``path`` (peft's ``save_pretrained``), atomically.

    It is written into a temporary sibling folder and renamed into place, so ``path`` is a
    whole adapter or absent; an existing folder at ``path`` is replaced.

    Raises:
        OSError: the folder cannot be written (``path`` is then unchanged).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    old = None
    try:
        model.save_pretrained(str(tmp))
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            os.replace(path, old)
        os.replace(tmp, path)
    finally:
        for leftover in (tmp, old):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
