"""Shared machinery of the projectors: the base class, input handling, seeds, the block cache.

A projector maps gradients ``g`` ``[n, grad_dim]`` to features ``φ = P g`` ``[n, proj_dim]`` with a random
Johnson-Lindenstrauss matrix ``P`` ``[proj_dim, grad_dim]`` (docs/concepts.md); code holds ``Pᵀ`` and computes
``g @ Pᵀ``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from trakcli.errors import ProjectorError

_MASK64 = (1 << 64) - 1

Grads = torch.Tensor | Mapping[str, torch.Tensor]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def splitmix64(x: int) -> int:
    """One step of the SplitMix64 mixer (Steele, Lea, Flood 2014): ``x`` modulo 2**64 -> a mixed 64-bit int."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(*values: int) -> int:
    """Hash non-negative integers (e.g. ``(tag, seed, model_id)``) into a seed in ``[0, 2**63)``."""
    h = 0x6A09E667F3BCC909
    for v in values:
        h = splitmix64(h ^ (int(v) & _MASK64))
    return h >> 1


def check_int(name: str, value: Any, minimum: int, hint: str) -> int:
    """``value`` as an int >= ``minimum``, else :class:`ProjectorError` naming option ``name`` and ``hint``.

    Raises:
        ProjectorError: ``value`` is not an integer (bools and integral floats too) or is below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProjectorError(f"projector {name} must be an integer >= {minimum}, got {value!r} "
                             f"({type(value).__name__}); {hint}")
    if value < minimum:
        raise ProjectorError(f"projector {name} must be >= {minimum}, got {value}; {hint}")
    return int(value)


class BlockCache:
    """A cache of generated matrix blocks, bounded in bytes.

    Keys are ``(model_id, block, device)``. A full cache makes room by evicting blocks of *other* matrices
    (``(model_id, device)`` pairs, least recently used first) but never blocks of the matrix being stored: when one
    matrix is larger than the budget, its first blocks stay cached and the rest are regenerated, so a cyclic scan over
    the matrix (one per batch) still hits ``budget / matrix size`` of the time instead of never, as LRU would.

    Args:
        max_bytes: total size the cached tensors may take; 0 disables caching.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes, self._bytes = int(max_bytes), 0
        self._items: OrderedDict[Any, torch.Tensor] = OrderedDict()

    def get(self, key: Any) -> torch.Tensor | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key: Any, item: torch.Tensor) -> None:
        size = item.nbytes
        if size > self.max_bytes or key in self._items:
            return
        if self._bytes + size > self.max_bytes:
            owner = (key[0], key[-1])
            for other in [k for k in self._items if (k[0], k[-1]) != owner]:
                self._bytes -= self._items.pop(other).nbytes
                if self._bytes + size <= self.max_bytes:
                    break
        if self._bytes + size <= self.max_bytes:
            self._items[key] = item
            self._bytes += size

    @property
    def nbytes(self) -> int:
        """Bytes currently held."""
        return self._bytes


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as the config spells it: ``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def accumulation_dtype(value: Any) -> torch.dtype:
    """The accumulation dtype named by ``value`` (``"float32"``, ``"float64"`` or the torch dtype).

    Raises:
        ProjectorError: any other value.
    """
    from trakcli.projectors.registry import did_you_mean

    name = dtype_name(value) if isinstance(value, torch.dtype) else value
    choices = ("float32", "float64")
    if name not in choices:
        raise ProjectorError(f"projector dtype must be one of {', '.join(choices)}, got {name!r}"
                             f"{did_you_mean(str(name), choices)}; half-precision gradients are accepted as input "
                             "but always accumulated in float32")
    return getattr(torch, name)


def as_float_dtype(t: torch.Tensor, what: str) -> None:
    """Raise :class:`ProjectorError` unless ``t`` has a supported floating dtype."""
    if t.dtype not in _FLOAT_DTYPES:
        raise ProjectorError(f"{what} has dtype {t.dtype}; projectors accept float16, bfloat16, float32 or "
                             "float64 tensors: convert it with .float()")


def grad_items(grads: Grads, grad_dim: int) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    """Validate a gradient batch and return it as named ``[n, numel]`` 2-D views.

    Args:
        grads: a tensor ``[n, grad_dim]``, or a mapping of parameter name to a per-example gradient
            ``[n, *param_shape]``; flattened and concatenated in mapping order they form ``[n, grad_dim]``.
        grad_dim: the projector's ``grad_dim``.

    Returns:
        ``(n, items)`` with ``items`` a list of ``(name, tensor [n, numel])``.

    Raises:
        ProjectorError: wrong type, dtype, number of dimensions, inconsistent
            batch sizes, or sizes that do not add up to ``grad_dim``.
    """
    if isinstance(grads, torch.Tensor):
        if grads.dim() != 2:
            raise ProjectorError(f"gradients must have shape [n, grad_dim] = [n, {grad_dim}], got shape "
                                 f"{tuple(grads.shape)}; flatten per-example gradients with .reshape(n, -1)")
        as_float_dtype(grads, "the gradient tensor")
        if grads.shape[1] != grad_dim:
            raise ProjectorError(f"gradients have {grads.shape[1]} columns but the projector was made for "
                                 f"grad_dim={grad_dim}; make the projector with the model's grad_dim")
        return grads.shape[0], [("", grads)]
    if not isinstance(grads, Mapping):
        raise ProjectorError(f"gradients must be a torch.Tensor [n, grad_dim] or a dict of per-parameter "
                             f"tensors, got {type(grads).__name__}")
    if not grads:
        raise ProjectorError("the gradient dict is empty; select at least one parameter")
    n, items = None, []
    for name, t in grads.items():
        if not isinstance(t, torch.Tensor):
            raise ProjectorError(f"gradient of parameter {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.dim() < 1:
            raise ProjectorError(f"gradient of parameter {name!r} is a scalar; per-example gradients have "
                                 "shape [n, *param_shape]")
        as_float_dtype(t, f"the gradient of parameter {name!r}")
        if n is None:
            n = t.shape[0]
        elif t.shape[0] != n:
            raise ProjectorError(f"gradient of parameter {name!r} has batch size {t.shape[0]}, the first one "
                                 f"has {n}; every per-parameter gradient needs the same leading dimension n")
        items.append((str(name), t.reshape(n, -1)))
    total = sum(flat.shape[1] for _, flat in items)
    if total != grad_dim:
        raise ProjectorError(f"the per-parameter gradients hold {total} entries per example but the projector "
                             f"was made for grad_dim={grad_dim}; make the projector with the model's grad_dim "
                             "(sum of the selected parameters' numel)")
    return int(n), items


def flatten_grads(grads: Grads, grad_dim: int) -> torch.Tensor:
    """Return ``grads`` as one ``[n, grad_dim]`` tensor (concatenating a dict in its order)."""
    n, items = grad_items(grads, grad_dim)
    if len(items) == 1:
        return items[0][1]
    dtypes = {t.dtype for _, t in items}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    return torch.cat([t.to(dtype) for _, t in items], dim=1)


def check_model_id(model_id: Any) -> int:
    """Validate ``model_id`` (an int >= 0) and return it."""
    return check_int("model_id", model_id, 0, "pass the checkpoint index 0, 1, ...")


class Projector:
    """Base class: a linear map ``P`` of shape ``[proj_dim, grad_dim]`` and its adjoint.

    Subclasses implement :meth:`_project` and :meth:`_unproject` on validated input.

    Attributes:
        grad_dim: number of gradient coordinates (columns of ``P``).
        proj_dim: number of features (rows of ``P``).
        implementation: how the product is computed (``"single_block"``, ``"basic"``, ``"chunked"``, ``"cuda"``,
            ``"noop"``); not part of :meth:`spec` because it never changes the matrix.
    """

    implementation: str = "base"

    def __init__(self, grad_dim: int, proj_dim: int, dtype: torch.dtype = torch.float32):
        self.grad_dim, self.proj_dim, self.dtype = int(grad_dim), int(proj_dim), dtype

    def spec(self) -> dict[str, Any]:
        """Everything that fixes the matrix, as a plain JSON-able dict.

        Two projectors with equal specs compute the same matrix for every ``model_id``.
        """
        raise NotImplementedError

    def project(self, grads: Grads, model_id: int = 0) -> torch.Tensor:
        """Project per-example gradients: ``φ = P g`` row by row, i.e. ``g @ Pᵀ`` (TRAK, Park et al. 2023).

        Args:
            grads: ``[n, grad_dim]`` tensor, or a dict of per-parameter gradients ``[n, *param_shape]`` (flattened and
                concatenated in dict order); float16, bfloat16, float32 or float64, any device.
            model_id: index of the checkpoint; each ``model_id`` has its own independent matrix.

        Returns:
            ``[n, proj_dim]`` features, float32 (float64 if the projector's
            ``dtype`` is float64), on the gradients' device.

        Raises:
            ProjectorError: the gradients do not fit ``grad_dim`` or have an
                unsupported type/dtype, or ``model_id`` is not an int >= 0.
        """
        return self._project(grads, check_model_id(model_id))

    def unproject(self, z: torch.Tensor, model_id: int = 0) -> torch.Tensor:
        """Apply the adjoint: ``z P`` (i.e. ``Pᵀ`` applied to each row of ``z``).

        Exactly the transpose of :meth:`project`: ``<P g, z> = <g, Pᵀ z>``.

        Args:
            z: ``[n, proj_dim]`` tensor, any float dtype, any device.
            model_id: index of the checkpoint (same matrix as :meth:`project`).

        Returns:
            ``[n, grad_dim]`` tensor, float32 (float64 for a float64 projector), on ``z``'s device.

        Raises:
            ProjectorError: ``z`` is not ``[n, proj_dim]`` or has an unsupported dtype.
        """
        model_id = check_model_id(model_id)
        self.check_features(z)
        return self._unproject(z, model_id)

    def check_features(self, z: Any) -> None:
        """Check that ``z`` is a ``[n, proj_dim]`` float tensor, the input of :meth:`unproject`.

        Raises:
            ProjectorError: ``z`` is not a tensor of shape ``[n, proj_dim]`` or has an unsupported dtype.
        """
        if not isinstance(z, torch.Tensor) or z.dim() != 2 or z.shape[1] != self.proj_dim:
            shape = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
            raise ProjectorError(f"unproject expects a tensor of shape [n, proj_dim] = [n, {self.proj_dim}], "
                                 f"got {shape}")
        as_float_dtype(z, "the tensor passed to unproject")

    def _project(self, grads: Grads, model_id: int) -> torch.Tensor:
        raise NotImplementedError

    def _unproject(self, z: torch.Tensor, model_id: int) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        spec = ", ".join(f"{k}={v!r}" for k, v in self.spec().items())
        return f"{type(self).__name__}({spec}, implementation={self.implementation!r})"
