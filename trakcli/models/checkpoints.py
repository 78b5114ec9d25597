"""Checkpoint files: reading state dicts, their sha256, and loading them into a model with checked keys and shapes.

A checkpoint is a ``.pt`` / ``.pth`` / ``.bin`` file (read with ``torch.load(weights_only=True)``), a ``.safetensors``
file, or a Hugging Face model directory (its weight files, merged).
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trakcli.errors import CheckpointError, exception_text
from trakcli.models.hf import fit_hf_state_dict, is_hf_model
from trakcli.models.peft import ADAPTER_WEIGHTS, is_adapter_dir, load_adapter

#: key prefixes of wrapped models: ``DistributedDataParallel`` / ``DataParallel`` and ``torch.compile``
WRAPPER_PREFIXES = ("module.", "_orig_mod.")

#: weight files of a Hugging Face directory, in the order they are looked for (the last two: a PEFT adapter folder)
WEIGHT_PATTERNS = ("model.safetensors", "model-*.safetensors", "pytorch_model.bin", "pytorch_model-*.bin",
                   *ADAPTER_WEIGHTS)


def checkpoint_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint: the file itself, or a Hugging Face directory's weights.

    Raises:
        CheckpointError: a directory without ``model.safetensors`` / ``pytorch_model.bin`` (or shards).
    """
    if not path.is_dir():
        return [path]
    for pattern in WEIGHT_PATTERNS:
        files = sorted(path.glob(pattern))
        if files:
            return files
    raise CheckpointError(f"checkpoint directory {path} has no weights ({', '.join(WEIGHT_PATTERNS)}); save it with "
                          "model.save_pretrained(dir) or give a .pt / .safetensors state dict")


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes; for a Hugging Face model directory, of its weight files' names and
    bytes in sorted order (config and tokenizer files are not included).

    Raises:
        CheckpointError: the file cannot be read (permissions, an I/O error), naming it and the fix.
    """
    path = Path(path)
    if not path.is_dir():
        try:
            with open(path, "rb") as f:
                return hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as e:
            raise CheckpointError(f"cannot read {path}: {e.strerror or e}; make it readable by this user (e.g. chmod "
                                  "u+r) or point the config at a readable copy") from None
    h = hashlib.sha256()
    for f in checkpoint_files(path):
        h.update(f.name.encode() + b"\0" + file_sha256(f).encode())
    return h.hexdigest()


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a ``.pt``/``.pth``/``.bin`` (``torch.load(weights_only=True)``) or ``.safetensors`` state dict, or a
    Hugging Face model directory's weight files merged (:func:`checkpoint_files`). A ``.pt`` holding
    ``{"state_dict": ...}``, ``{"model": ...}`` or ``{"model_state_dict": ...}`` is unwrapped.

    Raises:
        CheckpointError: unreadable file, unknown suffix, or not a dict of tensors.
    """
    path = Path(path)
    if path.is_dir():
        merged: dict[str, torch.Tensor] = {}
        for f in checkpoint_files(path):
            merged.update(read_state_dict(f))
        return merged
    suffix = path.suffix.lower()
    if suffix not in (".safetensors", ".pt", ".pth", ".bin"):
        raise CheckpointError(f"checkpoint {path} has suffix {suffix!r}; use .pt, .pth or .safetensors")
    try:
        if suffix == ".safetensors":
            from safetensors.torch import load_file

            sd: Any = load_file(str(path), device="cpu")
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "unsupported global" not in str(e).lower():  # not pickled objects: a damaged or foreign file
            raise CheckpointError(f"cannot read checkpoint {path}: {exception_text(e)}") from None
        raise CheckpointError(f"checkpoint {path} holds pickled Python objects (e.g. a whole model saved with "
                              "torch.save(model)), not a state dict; save the weights with "
                              "torch.save(model.state_dict(), PATH) and use that file") from None
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {exception_text(e)}") from None
    if isinstance(sd, dict):
        for key in ("state_dict", "model", "model_state_dict"):
            if key in sd and isinstance(sd[key], dict):
                sd = sd[key]
                break
    if not isinstance(sd, dict) or not all(torch.is_tensor(v) for v in sd.values()):
        raise CheckpointError(f"checkpoint {path} is not a state dict (a dict of tensors)")
    return sd


def strip_wrapper_prefixes(
    sd: dict[str, torch.Tensor], own_keys: set[str] | list[str]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``sd`` without the key prefixes model wrappers add (``module.``: DDP, ``_orig_mod.``: ``torch.compile``),
    and the prefixes removed in order.

    A prefix is stripped only when every key of ``sd`` starts with it and none of the model's
    ``own_keys`` does; repeated (``_orig_mod.module.``) until none is left.
    """
    own = list(own_keys)
    removed: list[str] = []
    while sd:
        prefix = next((p for p in WRAPPER_PREFIXES
                       if all(k.startswith(p) for k in sd) and not any(k.startswith(p) for k in own)), None)
        if prefix is None:
            break
        sd = {k[len(prefix):]: v for k, v in sd.items()}
        removed.append(prefix)
    return sd, removed


def describe_mismatch(
    own: dict[str, torch.Tensor], sd: dict[str, torch.Tensor], *, missing: list[str], unexpected: list[str]
) -> str | None:
    """The first shape-mismatched keys of ``sd`` (keys mapped to the model's) against the model's ``own`` state
    dict, and the first of the ``missing`` and ``unexpected`` keys the caller counts; None if it fits."""
    shapes = [f"{k}: checkpoint {list(sd[k].shape)} vs model {list(own[k].shape)}"
              for k in own if k in sd and sd[k].shape != own[k].shape]
    parts = []
    if shapes:
        parts.append("shape mismatch " + "; ".join(shapes[:3]) + (" ..." if len(shapes) > 3 else ""))
    if missing:
        parts.append(f"missing keys {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
    if unexpected:
        parts.append(f"unexpected keys {unexpected[:5]}" + (" ..." if len(unexpected) > 5 else ""))
    return ", ".join(parts) or None


def nonfinite_parameters(model: nn.Module, limit: int = 3) -> list[str]:
    """The first ``limit`` parameters of ``model`` holding NaN or inf entries, as ``"name (k NaN, m inf)"``.

    Buffers are not checked (a model may keep ``-inf`` attention masks as buffers).
    """
    out = []
    for name, p in model.named_parameters():
        if p.is_floating_point() or p.is_complex():
            finite = torch.isfinite(p.detach())
            if not bool(finite.all()):
                n_nan = int(torch.isnan(p.detach()).sum())
                out.append(f"{name} ({n_nan} NaN, {int((~finite).sum()) - n_nan} inf)")
                if len(out) == limit:
                    break
    return out


def load_checkpoint(model: nn.Module, path: str | Path, *, model_id: int | None = None) -> list[str]:
    """Load a state dict into ``model`` in place, checking keys and shapes first, and finite weights after.

    A PEFT adapter folder sets the adapter weights of a ``peft.PeftModel`` only
    (:func:`trakcli.models.peft.load_adapter`). Otherwise the checkpoint (:func:`read_state_dict`) loses
    the key prefixes of wrapped models first (:func:`strip_wrapper_prefixes`); a transformers model takes
    the keys of its bare base model too, and keeps the seeded initialization of a head the checkpoint
    lacks (:func:`trakcli.models.hf.fit_hf_state_dict`).

    Returns:
        The wrapper prefixes stripped from the keys (empty for a plain state dict), for the caller to report.

    Raises:
        CheckpointError: naming the file (and ``model_id``, its index among the run's checkpoints) and
            the first missing, unexpected and shape-mismatched keys, or the parameters holding NaN / inf.
    """
    stripped: list[str] = []
    if is_adapter_dir(path):
        load_adapter(model, Path(path))
    else:
        own = model.state_dict()
        sd, stripped = strip_wrapper_prefixes(read_state_dict(path), own.keys())
        if is_hf_model(model):
            sd, missing, unexpected = fit_hf_state_dict(model, sd)
            which = f"the model {getattr(model, 'trak_hf_path', type(model).__name__)}"
            fix = "check model.entrypoint and model.kwargs (num_labels, model_class)"
        else:
            missing, unexpected = [k for k in own if k not in sd], [k for k in sd if k not in own]
            which, fix = "the model", "check model.entrypoint and model.kwargs against how the checkpoint was trained"
        problem = describe_mismatch(own, sd, missing=missing, unexpected=unexpected)
        if problem:
            raise CheckpointError(f"checkpoint {path} does not fit {which}: {problem}; {fix}")
        model.load_state_dict({k: v for k, v in sd.items() if k in own}, strict=False)
    bad = nonfinite_parameters(model)
    if bad:
        which = f"checkpoint {path}" + (f" (model_id {model_id})" if model_id is not None else "")
        raise CheckpointError(f"{which} has non-finite weights: {', '.join(bad)}; it comes from a diverged training: "
                              "retrain it (with a lower learning rate) or remove it from checkpoints")
    return stripped
