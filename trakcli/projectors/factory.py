"""``make_projector``: validate the ``projector:`` config mapping and build a projector."""

from __future__ import annotations

import difflib
import logging
from typing import Any

import torch

from trakcli.errors import ProjectorError
from trakcli.projectors.base import Projector, check_int
from trakcli.projectors.dense import BasicProjector, BasicSingleBlockProjector, NoopProjector
from trakcli.projectors.matrices import DenseMatrix

logger = logging.getLogger("trakcli.projectors")

KINDS = ("noop", "rademacher", "normal")
IMPLEMENTATIONS = ("auto", "single_block", "basic")

#: Options each accepts (beyond kind, implementation, grad_dim, proj_dim, seed).
OPTIONS = {
    "dtype": "accumulation dtype: float32 (default) or float64",
    "block_size": "basic: gradient columns processed per step (default 65536)",
    "cache_bytes": "basic: byte budget for caching generated matrix blocks (default 4 GiB)",
}

DEFAULT_BLOCK_SIZE = 65536
DEFAULT_CACHE_BYTES = 4 * 2**30

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _did_you_mean(value: str, choices: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(str(value), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ProjectorError(
            f"unknown projector {name} {value!r}{_did_you_mean(value, choices)}; "
            f"choose one of {', '.join(choices)}"
        )
    return value


def _dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    if value not in _DTYPES:
        raise ProjectorError(
            f"projector dtype must be one of {', '.join(_DTYPES)}, got {value!r}"
            f"{_did_you_mean(str(value), tuple(_DTYPES))}; half-precision gradients are "
            f"accepted as input but always accumulated in float32"
        )
    return _DTYPES[value]


def make_projector(
    kind: str = "rademacher",
    implementation: str = "auto",
    *,
    grad_dim: int,
    proj_dim: int | None = None,
    seed: int = 0,
    **options: Any,
) -> Projector:
    """Build a projector from the ``projector:`` config mapping.

    Args:
        kind: the matrix: ``noop``, ``rademacher`` (±1/√proj_dim) or ``normal``
            (N(0, 1/proj_dim)). Dense kinds satisfy E‖Pg‖² = ‖g‖²
            (Johnson & Lindenstrauss 1984; Achlioptas 2003).
        implementation: how products are computed: ``single_block`` (whole
            matrix in memory), ``basic`` (block-wise, bounded memory) or
            ``auto`` (the best available; logs its choice on the
            ``trakcli.projectors`` logger). Never changes the matrix.
        grad_dim: gradient coordinates, > 0 (from the model).
        proj_dim: features, > 0. For ``noop`` it may be omitted and must
            otherwise equal ``grad_dim``.
        seed: base seed, an int >= 0. Each ``model_id`` derives its own matrix from it.
        **options: see :data:`OPTIONS` (``dtype``, ``block_size``, ``cache_bytes``).

    Returns:
        A :class:`~trakcli.projectors.base.Projector`.

    Raises:
        ProjectorError: unknown kind, implementation or option (with a
            suggestion), non-integer or non-positive dims, bad option values.
    """
    kind = _choice("kind", kind, KINDS)
    implementation = _choice("implementation", implementation, IMPLEMENTATIONS)
    unknown = [k for k in options if k not in OPTIONS]
    if unknown:
        k = unknown[0]
        raise ProjectorError(
            f"unknown projector option {k!r}{_did_you_mean(k, list(OPTIONS))}; "
            f"known options: {', '.join(OPTIONS)}"
        )
    grad_dim = check_int("grad_dim", grad_dim, 1, "it is the number of selected parameters")
    seed = check_int("seed", seed, 0, "use a non-negative integer such as 0")
    dtype = _dtype(options.get("dtype", "float32"))
    block_size = check_int(
        "block_size", options.get("block_size", DEFAULT_BLOCK_SIZE), 1, "e.g. block_size: 65536"
    )
    cache_bytes = check_int(
        "cache_bytes", options.get("cache_bytes", DEFAULT_CACHE_BYTES), 0,
        "0 disables the cache; e.g. cache_bytes: 4294967296 for 4 GiB",
    )

    if kind == "noop":
        if proj_dim is not None and proj_dim != grad_dim:
            raise ProjectorError(
                f"projector kind 'noop' keeps every gradient coordinate, so proj_dim must equal "
                f"grad_dim={grad_dim}, got proj_dim={proj_dim!r}; set proj_dim: {grad_dim} or "
                f"choose kind 'rademacher'"
            )
        if implementation not in ("auto", "basic", "single_block"):
            raise ProjectorError(f"kind 'noop' has no implementation {implementation!r}; use auto")
        return NoopProjector(grad_dim, dtype)

    if proj_dim is None:
        raise ProjectorError(f"projector kind {kind!r} needs proj_dim, e.g. proj_dim: 2048")
    proj_dim = check_int("proj_dim", proj_dim, 1, "e.g. proj_dim: 2048")

    if implementation == "auto":
        implementation = "basic"
        logger.info(
            "projector implementation 'auto' picked 'basic' for kind %r "
            "(block-wise, cached up to %d bytes)", kind, cache_bytes,
        )
    if implementation == "single_block":
        return BasicSingleBlockProjector(DenseMatrix(kind, grad_dim, proj_dim, seed, dtype, 0))
    return BasicProjector(DenseMatrix(kind, grad_dim, proj_dim, seed, dtype, cache_bytes), block_size)
