"""Build models: the built-in ``mlp``, a user's function, or a Hugging Face directory.

``model.entrypoint`` is a built-in name (``mlp``), ``"path/to/file.py:function"`` or ``"package.module:function"``; the
function is called with ``model.kwargs`` and returns a ``torch.nn.Module``. ``"hf:DIR"`` loads a Hugging Face
transformers model from a local directory (:mod:`trakcli.models.hf`).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

from torch import nn

from trakcli.errors import ModelError, UserCodeError, user_code
from trakcli.models.hf import build_hf_model


def make_mlp(in_dim: int = 64, hidden_dim: int = 128, num_classes: int = 10, depth: int = 2) -> nn.Module:
    """A ReLU multilayer perceptron, the built-in ``mlp`` (defaults fit the digits data): ``depth`` (>= 1) hidden
    layers of width ``hidden_dim``, an ``nn.Sequential`` mapping ``[n, in_dim]`` float32 (or ``[n, ...]``
    flattened to it) to logits ``[n, num_classes]``."""
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


def load_function(
    entrypoint: str, key: str = "model.entrypoint", builtins: dict[str, Callable[..., Any]] | None = None
) -> Callable[..., Any]:
    """The function named by ``entrypoint``: a name of ``builtins``, "file.py:function" or "pkg.mod:function".

    ``builtins`` defaults to the built-in models; ``key`` is the config key messages name
    (``model.entrypoint``, ``optimize.entrypoint``). A ``.py`` file is imported under a module name
    derived from its resolved path (so one file is imported once per process).

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
        raise ModelError(f"{key} {entrypoint!r} is not {what}; "
                         f'{hint}use {"a built-in name, " if builtins else ""}"path/to/file.py:function" or '
                         '"package.module:function"')
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
        with user_code(f"{key}: importing {target}", error=ModelError):
            spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ModelError(f"{key}: cannot import module {target!r} ({e}); is it installed or on "
                             "PYTHONPATH?") from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        close = difflib.get_close_matches(func_name, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ModelError(f"{key}: {target!r} has no function {func_name!r}{hint}")
    return fn


def build_model(entrypoint: str = "mlp", **kwargs: Any) -> nn.Module:
    """Build the model named by ``entrypoint`` with ``kwargs``; it remembers ``entrypoint`` (``trak_entrypoint``)
    for messages about its forward pass (:func:`model_name`).

    Raises:
        ModelError: unknown name, unimportable file/module, missing function,
            kwargs the function does not take, or a return value that is not an ``nn.Module``.
        UserCodeError: the function raised (names the exception, file and line).
    """
    if entrypoint.startswith("hf:"):
        try:
            model = build_hf_model(entrypoint, **kwargs)
        except TypeError as e:
            raise ModelError(f"model.entrypoint {entrypoint!r} rejected model.kwargs {kwargs}: {e}") from None
    else:
        fn = load_function(entrypoint)
        try:
            with user_code(f"model.entrypoint {entrypoint}"):
                model = fn(**kwargs)
        except UserCodeError as e:
            cause = e.__cause__
            if isinstance(cause, TypeError) and cause.__traceback__ is not None and _raised_by_the_call(cause):
                raise ModelError(f"model.entrypoint {entrypoint!r} rejected model.kwargs {kwargs}: {cause}") from None
            raise
        if not isinstance(model, nn.Module):
            raise ModelError(f"model.entrypoint {entrypoint!r} returned a {type(model).__name__}, not a "
                             "torch.nn.Module")
    model.trak_entrypoint = entrypoint
    return model


def _raised_by_the_call(exc: TypeError) -> bool:
    """True if ``exc`` came from calling the function (its arguments did not bind), not from inside its body."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code is not build_model.__code__:
        tb = tb.tb_next
    return tb is not None and tb.tb_next is None


def model_name(model: nn.Module) -> str:
    """How messages name a model: ``"model.entrypoint my_model.py:make_model"`` for one :func:`build_model` built."""
    entrypoint = getattr(model, "trak_entrypoint", None)
    return f"model.entrypoint {entrypoint}" if entrypoint else f"the model ({type(model).__name__})"
