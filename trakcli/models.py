"""Build models and load checkpoints.

``model.entrypoint`` is a built-in name (``mlp``), ``"path/to/file.py:function"``
or ``"package.module:function"``; the function is called with
``model.kwargs`` and returns a ``torch.nn.Module``. ``"hf:DIR"`` loads a
Hugging Face transformers model from a local directory (:mod:`trakcli.hf`).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from trakcli.errors import CheckpointError, ModelError


def make_mlp(in_dim: int = 64, hidden_dim: int = 128, num_classes: int = 10, depth: int = 2) -> nn.Module:
    """A ReLU multilayer perceptron, the built-in ``mlp`` (defaults fit the digits data).

    Args:
        in_dim: input features (inputs ``[n, in_dim]`` or ``[n, ...]`` flattened to it).
        hidden_dim: width of each hidden layer.
        num_classes: number of logits.
        depth: number of hidden layers (>= 1).

    Returns:
        ``nn.Sequential`` mapping ``[n, in_dim]`` float32 to logits ``[n, num_classes]``.
    """
    if depth < 1:
        raise ModelError(f"mlp: depth must be >= 1, got {depth}; set model.kwargs.depth")
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_dim
    for _ in range(depth):
        layers += [nn.Linear(width, hidden_dim), nn.ReLU()]
        width = hidden_dim
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


BUILTIN_MODELS: dict[str, Callable[..., nn.Module]] = {"mlp": make_mlp}


def _load_function(
    entrypoint: str, key: str = "model.entrypoint", builtins: dict[str, Callable[..., Any]] | None = None
) -> Callable[..., Any]:
    """The function named by ``entrypoint``: a name of ``builtins``, "file.py:function" or "pkg.mod:function".

    Args:
        entrypoint: the spec.
        key: the config key, for messages (``model.entrypoint``, ``training.entrypoint``).
        builtins: built-in names (default: the built-in models).

    Raises:
        ModelError: unknown name, unimportable file/module, or no such function.
    """
    builtins = BUILTIN_MODELS if builtins is None else builtins
    if entrypoint in builtins:
        return builtins[entrypoint]
    if ":" not in entrypoint:
        close = difflib.get_close_matches(entrypoint, list(builtins), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        what = f"a built-in model ({', '.join(builtins)})" if builtins else "a function spec"
        raise ModelError(
            f"{key} {entrypoint!r} is not {what}; "
            f'{hint}use {"a built-in name, " if builtins else ""}"path/to/file.py:function" or "package.module:function"'
        )
    target, func_name = entrypoint.rsplit(":", 1)
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ModelError(f"{key}: file {target!r} does not exist")
        mod_name = f"_trakcli_user_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise ModelError(f"{key}: cannot import {target!r} as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise ModelError(f"{key}: importing {target!r} failed: {e.__class__.__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ModelError(
                f"{key}: cannot import module {target!r} ({e}); is it installed or on PYTHONPATH?"
            ) from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        close = difflib.get_close_matches(func_name, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ModelError(f"{key}: {target!r} has no function {func_name!r}{hint}")
    return fn


def build_model(entrypoint: str = "mlp", **kwargs: Any) -> nn.Module:
    """Build the model named by ``entrypoint`` with ``kwargs``.

    Raises:
        ModelError: unknown name, unimportable file/module, missing function,
            a failing call, or a return value that is not an ``nn.Module``.
    """
    if entrypoint.startswith("hf:"):
        from trakcli.hf import build_hf_model

        try:
            return build_hf_model(entrypoint, **kwargs)
        except TypeError as e:
            raise ModelError(f"model.entrypoint {entrypoint!r} rejected model.kwargs {kwargs}: {e}") from None
    fn = _load_function(entrypoint)
    try:
        model = fn(**kwargs)
    except ModelError:
        raise
    except TypeError as e:
        raise ModelError(f"model.entrypoint {entrypoint!r} rejected model.kwargs {kwargs}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ModelError(
            f"model.entrypoint {entrypoint!r} returned a {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks.

    For a Hugging Face model directory: of its weight files' names and bytes,
    in sorted order (config and tokenizer files are not included).
    """
    path = Path(path)
    if not path.is_dir():
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()
    from trakcli.hf import checkpoint_files

    h = hashlib.sha256()
    for f in checkpoint_files(path):
        h.update(f.name.encode() + b"\0" + file_sha256(f).encode())
    return h.hexdigest()


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a ``.pt``/``.pth`` (``torch.load(weights_only=True)``) or ``.safetensors`` state dict.

    A directory is a Hugging Face model directory: its ``model.safetensors`` or
    ``pytorch_model.bin`` (or their shards), merged. A ``.pt`` holding ``{"state_dict": ...}`` or ``{"model": ...}`` is unwrapped.

    Raises:
        CheckpointError: unreadable file, unknown suffix, or not a dict of tensors.
    """
    path = Path(path)
    if path.is_dir():
        from trakcli.hf import checkpoint_files

        merged: dict[str, torch.Tensor] = {}
        for f in checkpoint_files(path):
            merged.update(read_state_dict(f))
        return merged
    suffix = path.suffix.lower()
    try:
        if suffix == ".safetensors":
            from safetensors.torch import load_file

            sd: Any = load_file(str(path), device="cpu")
        elif suffix in (".pt", ".pth", ".bin"):
            sd = torch.load(path, map_location="cpu", weights_only=True)
        else:
            raise CheckpointError(f"checkpoint {path} has suffix {suffix!r}; use .pt, .pth or .safetensors")
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.__class__.__name__}: {e}") from None
    if isinstance(sd, dict):
        for key in ("state_dict", "model", "model_state_dict"):
            if key in sd and isinstance(sd[key], dict):
                sd = sd[key]
                break
    if not isinstance(sd, dict) or not all(torch.is_tensor(v) for v in sd.values()):
        raise CheckpointError(f"checkpoint {path} is not a state dict (a dict of tensors)")
    return sd


def describe_mismatch(
    own: dict[str, torch.Tensor], sd: dict[str, torch.Tensor], *, missing: list[str], unexpected: list[str]
) -> str | None:
    """The first shape-mismatched, missing and unexpected keys of a state dict, or None if it fits.

    Args:
        own: the model's state dict.
        sd: the checkpoint's state dict (keys already mapped to the model's).
        missing, unexpected: the keys the caller counts as missing / unexpected.
    """
    shapes = [
        f"{k}: checkpoint {list(sd[k].shape)} vs model {list(own[k].shape)}"
        for k in own
        if k in sd and sd[k].shape != own[k].shape
    ]
    parts = []
    if shapes:
        parts.append("shape mismatch " + "; ".join(shapes[:3]) + (" ..." if len(shapes) > 3 else ""))
    if missing:
        parts.append(f"missing keys {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
    if unexpected:
        parts.append(f"unexpected keys {unexpected[:5]}" + (" ..." if len(unexpected) > 5 else ""))
    return ", ".join(parts) or None


def load_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Load a state dict into ``model`` in place, checking keys and shapes first.

    Raises:
        CheckpointError: naming the first missing, unexpected and shape-mismatched keys.
    """
    sd = read_state_dict(path)
    from trakcli.hf import is_hf_model, load_hf_checkpoint

    if is_hf_model(model):
        load_hf_checkpoint(model, sd, Path(path))
        return
    own = model.state_dict()
    missing, unexpected = [k for k in own if k not in sd], [k for k in sd if k not in own]
    problem = describe_mismatch(own, sd, missing=missing, unexpected=unexpected)
    if problem:
        raise CheckpointError(
            f"checkpoint {path} does not fit the model: {problem}; "
            "check model.entrypoint and model.kwargs against how the checkpoint was trained"
        )
    model.load_state_dict(sd, strict=True)
