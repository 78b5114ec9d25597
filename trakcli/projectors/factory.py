"""``make_projector``: validate the ``projector:`` config mapping and build a projector."""

from __future__ import annotations

import difflib
import importlib.util
import logging
import os
from typing import Any

import torch

from trakcli.errors import ProjectorError
from trakcli.projectors.base import Projector, check_int
from trakcli.projectors.dense import BasicProjector, BasicSingleBlockProjector, NoopProjector
from trakcli.projectors.chunked import ChunkedProjector
from trakcli.projectors.matrices import GEN_ROWS, DenseMatrix, SJLTMatrix

logger = logging.getLogger("trakcli.projectors")

KINDS = ("noop", "rademacher", "normal", "sjlt")
DENSE_KINDS = ("rademacher", "normal")
IMPLEMENTATIONS = ("auto", "single_block", "basic", "chunked", "cuda")

#: Options ``make_projector`` accepts beyond kind, implementation, grad_dim, proj_dim, seed.
OPTIONS = {
    "dtype": "accumulation dtype: float32 (default) or float64",
    "s": "sjlt: nonzeros per gradient coordinate, 1 <= s <= proj_dim (default 1)",
    "block_size": "basic: gradient columns processed per step (default 262144)",
    "max_chunk_size": "chunked: most gradient entries per chunk (default 262144)",
    "cache_bytes": (
        "basic/chunked: byte budget for caching generated matrix blocks; 'auto' (default) caches "
        "the whole matrix of a model when it fits min(4 GiB, RAM/4), else nothing; 0 disables"
    ),
}

DEFAULT_BLOCK_SIZE = 2**18
DEFAULT_MAX_CHUNK_SIZE = 2**18
AUTO_CACHE_LIMIT = 4 * 2**30

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _total_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on Linux/macOS
        return 4 * AUTO_CACHE_LIMIT


def auto_cache_bytes(matrix_bytes: int) -> int:
    """The ``cache_bytes: auto`` rule: the whole matrix if it fits min(4 GiB, RAM/4), else 0."""
    budget = min(AUTO_CACHE_LIMIT, _total_ram() // 4)
    return budget if matrix_bytes <= budget else 0


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
    kind: str = "sjlt",
    implementation: str = "auto",
    *,
    grad_dim: int,
    proj_dim: int | None = None,
    seed: int = 0,
    **options: Any,
) -> Projector:
    """Build a projector from the ``projector:`` config mapping.

    Args:
        kind: the matrix: ``noop`` (identity), ``rademacher`` (±1/√proj_dim),
            ``normal`` (N(0, 1/proj_dim)) or ``sjlt`` (sparse JL /
            CountSketch, ``s`` entries ±1/√s per column). All satisfy
            E‖Pg‖² = ‖g‖² (Johnson & Lindenstrauss 1984; Achlioptas 2003;
            Kane & Nelson 2014). The default, as for ``projector.kind`` in a config, is
            ``sjlt``: the digits LDS of dense rademacher at a fraction of its cost (docs/guides/projectors.md).
        implementation: how products are computed, never what they are:
            ``single_block`` (whole matrix at once), ``basic`` (block-wise,
            bounded memory, cached), ``chunked`` (per-parameter chunks of at
            most ``max_chunk_size`` entries), ``cuda`` (fused Triton kernel,
            dense kinds, needs a CUDA GPU and ``pip install trakcli[cuda]``) or
            ``auto`` (the best available; logs its choice and why the others
            were skipped on the ``trakcli.projectors`` logger).
        grad_dim: gradient coordinates, an int > 0 (from the model).
        proj_dim: features, an int > 0. Ignored by ``noop`` (whose features
            are the ``grad_dim`` gradient entries; a warning is logged when
            it differs).
        seed: base seed, an int >= 0. Each ``model_id`` derives its own
            independent matrix from it.
        **options: see :data:`OPTIONS`: ``dtype``, ``s``, ``block_size``,
            ``max_chunk_size``, ``cache_bytes``.

    Returns:
        A :class:`~trakcli.projectors.base.Projector`; its ``spec()`` fixes the
        matrix, its ``implementation`` attribute names the implementation used.

    Raises:
        ProjectorError: unknown kind, implementation or option (with a
            suggestion), kind ``kronecker`` (built from a model instead), non-integer
            or non-positive dims, bad option values, ``cuda`` asked for where it
            cannot run, or a ``proj_dim`` whose smallest working set exceeds this
            machine's memory (:func:`check_memory`).
    """
    if kind == "kronecker":
        raise ProjectorError(
            "projector kind 'kronecker' is built from the model, not from a gradient dimension: use "
            "trakcli.factors.KroneckerFeaturizer(model, proj_dim=..., seed=...) (projector.kind: kronecker in a "
            "config), or trakcli.projectors.kronecker.KroneckerProjector(layers, proj_dim) for given layer shapes"
        )
    kind = _choice("kind", kind, KINDS)
    implementation = _choice("implementation", implementation, IMPLEMENTATIONS)
    unknown = [k for k in options if k not in OPTIONS]
    if unknown:
        k = unknown[0]
        arguments = ["kind", "implementation", "grad_dim", "proj_dim", "seed"]
        raise ProjectorError(
            f"unknown projector option {k!r}{_did_you_mean(k, arguments + list(OPTIONS))}; "
            f"known options: {', '.join(arguments + list(OPTIONS))}"
        )
    grad_dim = check_int("grad_dim", grad_dim, 1, "it is the number of selected parameters")
    seed = check_int("seed", seed, 0, "use a non-negative integer such as 0")
    dtype = _dtype(options.get("dtype", "float32"))
    block_size = check_int(
        "block_size", options.get("block_size", DEFAULT_BLOCK_SIZE), 1, "e.g. block_size: 262144"
    )
    max_chunk_size = check_int(
        "max_chunk_size", options.get("max_chunk_size", DEFAULT_MAX_CHUNK_SIZE), 1,
        "e.g. max_chunk_size: 262144",
    )
    cache_bytes = options.get("cache_bytes", "auto")
    if cache_bytes != "auto":
        cache_bytes = check_int(
            "cache_bytes", cache_bytes, 0,
            "use 'auto', 0 to disable the cache, or a byte count such as 4294967296 (4 GiB)",
        )
    if "s" in options and kind != "sjlt":
        raise ProjectorError(
            f"projector option s={options['s']!r} only applies to kind 'sjlt', not {kind!r}; "
            f"remove it or set kind: sjlt"
        )

    if kind == "noop":
        if proj_dim is not None and proj_dim != grad_dim:
            # a config always carries a proj_dim (default 2048): say it is unused, do not fail
            logger.warning(
                "projector kind 'noop' keeps every gradient coordinate: features have "
                "grad_dim=%d columns, proj_dim=%r is ignored", grad_dim, proj_dim,
            )
        if implementation == "cuda":
            raise ProjectorError("kind 'noop' has no cuda implementation; use implementation: auto")
        return NoopProjector(grad_dim, dtype)

    if proj_dim is None:
        raise ProjectorError(f"projector kind {kind!r} needs proj_dim, e.g. proj_dim: 2048")
    proj_dim = check_int("proj_dim", proj_dim, 1, "e.g. proj_dim: 2048")

    if kind == "sjlt":
        s = check_int("s", options.get("s", 1), 1, "e.g. s: 1 (CountSketch) or s: 4")
        if s > proj_dim:
            raise ProjectorError(
                f"projector option s={s} is larger than proj_dim={proj_dim}; sjlt puts s nonzeros "
                f"in distinct features, so use s <= proj_dim"
            )
        matrix_bytes = s * grad_dim * 8
    else:
        matrix_bytes = grad_dim * proj_dim * (4 if dtype == torch.float32 else 8)

    if implementation == "auto":
        implementation = _pick_auto(kind, dtype)
    check_memory(kind, implementation, grad_dim, proj_dim, dtype, matrix_bytes)
    if implementation == "cuda":
        reason = _cuda_unavailable(kind)
        if reason is None and dtype != torch.float32:
            reason = f"it accumulates in float32, not {_dtype_name(dtype)}"
        if reason:
            raise ProjectorError(
                f"projector implementation 'cuda' cannot run here: {reason}. Use implementation: "
                f"basic or chunked (same matrix, so features stay comparable) or auto"
            )

    if cache_bytes == "auto":
        cache_bytes = auto_cache_bytes(matrix_bytes)
        if implementation in ("basic", "chunked"):
            if cache_bytes:
                logger.info("projector caches its matrix (%.2f GiB)", matrix_bytes / 2**30)
            else:
                logger.info(
                    "projector matrix (%.2f GiB) exceeds the cache budget min(4 GiB, RAM/4): blocks "
                    "are regenerated for every batch (set cache_bytes to cache part of it)",
                    matrix_bytes / 2**30,
                )

    def matrix(cache: int):
        if kind == "sjlt":
            return SJLTMatrix(grad_dim, proj_dim, seed, dtype, cache, s=s)
        return DenseMatrix(kind, grad_dim, proj_dim, seed, dtype, cache)

    if implementation == "single_block":
        return BasicSingleBlockProjector(matrix(0))
    if implementation == "chunked":
        return ChunkedProjector(matrix(cache_bytes), max_chunk_size)
    if implementation == "cuda":
        from trakcli.projectors.cuda import CudaProjector

        return CudaProjector(matrix(0))
    return BasicProjector(matrix(cache_bytes), block_size)


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``"3.0 GiB"``, ``"5.8 TiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"  # not reached


def check_memory(
    kind: str, implementation: str, grad_dim: int, proj_dim: int, dtype: torch.dtype, matrix_bytes: int
) -> None:
    """Refuse a projector that cannot project even one example in this machine's memory.

    The least a projector holds at once: one example's accumulator (``proj_dim``
    entries, ``2 * proj_dim`` for sjlt) and a piece of the matrix: all of it for
    ``single_block``, else one generated block of ``GEN_ROWS`` gradient coordinates
    (dense kinds; sjlt's block is ``s`` indices per coordinate, small).

    Args:
        kind, implementation: as resolved by :func:`make_projector` (not ``auto``).
        grad_dim, proj_dim: the dimensions.
        dtype: the accumulation dtype.
        matrix_bytes: bytes of the whole matrix (sjlt: its indices).

    Raises:
        ProjectorError: naming ``proj_dim``, the memory it would need and the memory here.
    """
    item = torch.empty((), dtype=dtype).element_size()
    row = proj_dim * item * (2 if kind == "sjlt" else 1)
    if implementation == "single_block":
        piece, what = matrix_bytes, f"the whole {grad_dim} x {proj_dim} matrix"
    elif kind == "sjlt":
        piece, what = 0, f"a {proj_dim}-wide accumulator per example"
    else:
        rows = min(GEN_ROWS, grad_dim)
        piece, what = rows * proj_dim * item, f"a {rows} x {proj_dim} block of the matrix"
    need, ram = row + piece, _total_ram()
    if need > ram:
        raise ProjectorError(
            f"projector proj_dim={proj_dim} needs at least {format_bytes(need)} of memory to project one example "
            f"({what}), more than this machine's {format_bytes(ram)}; use a smaller proj_dim, e.g. 2048"
        )


def _cuda_unavailable(kind: str) -> str | None:
    """Why the cuda implementation cannot run for ``kind`` here, or None if it can."""
    if kind not in DENSE_KINDS:
        return f"it implements the dense kinds {', '.join(DENSE_KINDS)}, not {kind!r}"
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'trakcli[cuda]')"
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _pick_auto(kind: str, dtype: torch.dtype) -> str:
    reason = _cuda_unavailable(kind)
    if reason is None and dtype != torch.float32:
        reason = f"it accumulates in float32, not {_dtype_name(dtype)}"
    if reason is None:
        logger.info("projector implementation 'auto' picked 'cuda' for kind %r", kind)
        return "cuda"
    logger.info(
        "projector implementation 'auto' picked 'basic' for kind %r (block-wise, cached); "
        "skipped 'cuda': %s; 'single_block' and 'chunked' are never picked automatically "
        "(same matrix, choose them for tiny models or for memory)", kind, reason,
    )
    return "basic"
