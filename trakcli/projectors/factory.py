"""``make_projector``: validate the ``projector:`` config mapping and build a projector of a registered kind.

The kinds are :class:`~trakcli.projectors.registry.ProjectorKind` classes looked up by name in
:mod:`trakcli.projectors.registry`; this module checks the arguments every kind shares and names no kind.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

import torch

from trakcli.errors import ProjectorError
from trakcli.projectors.base import Projector, accumulation_dtype, check_int, dtype_name
from trakcli.projectors.registry import (
    ARGUMENTS, COMMON_OPTIONS, DEFAULT_KIND, IMPLEMENTATIONS, OPTIONS, KindNames, ProjectorKind, did_you_mean,
    option_owner, projector_kind,
)

logger = logging.getLogger("trakcli.projectors")

#: The kinds ``make_projector`` builds (a live view of the registry; kinds built from a model are not among them).
KINDS = KindNames(lambda cls: cls.built_from_model is None)
#: The kinds with a ``cuda`` implementation (a live view of the registry).
DENSE_KINDS = KindNames(lambda cls: "cuda" in cls.implementations)

AUTO_CACHE_LIMIT = 4 * 2**30


def _total_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on Linux/macOS
        return 4 * AUTO_CACHE_LIMIT


def make_projector(kind: str = DEFAULT_KIND, implementation: str = "auto", *, grad_dim: int,
                   proj_dim: int | None = None, seed: int = 0, **options: Any) -> Projector:
    """Build a projector from the ``projector:`` config mapping.

    Args:
        kind: a registered kind (:mod:`trakcli.projectors.registry`); built in: ``noop`` (identity), ``rademacher``
            (±1/√proj_dim), ``normal`` (N(0, 1/proj_dim)) or ``sjlt`` (sparse JL / CountSketch, ``s`` entries ±1/√s
            per column). All satisfy E‖Pg‖² = ‖g‖² (Johnson & Lindenstrauss 1984; Achlioptas 2003; Kane &
            Nelson 2014). The default, as for ``projector.kind`` in a config, is ``sjlt``: the digits LDS of dense
            rademacher at a fraction of its cost (docs/guides/projectors.md).
        implementation: how products are computed, never what they are: ``single_block`` (whole matrix at once),
            ``basic`` (block-wise, bounded memory, cached), ``chunked`` (per-parameter chunks of at most
            ``max_chunk_size`` entries), ``cuda`` (fused Triton kernel, dense kinds, needs a CUDA GPU and
            ``pip install 'trakcli-attribution[cuda]'``) or ``auto`` (the best available; logs its choice and why the
            others were skipped on the ``trakcli.projectors`` logger). Each kind lists the ones it supports
            (``ProjectorKind.implementations``).
        grad_dim: gradient coordinates, an int > 0 (from the model).
        proj_dim: features, an int > 0. Ignored by ``noop`` (whose features are the ``grad_dim`` gradient entries; a
            warning is logged when it differs).
        seed: base seed, an int >= 0. Each ``model_id`` derives its own independent matrix from it.
        **options: see :data:`OPTIONS`: ``dtype``, ``block_size``, ``max_chunk_size``,
            ``cache_bytes`` and the kinds' own options (``s`` of ``sjlt``).

    Returns:
        A :class:`~trakcli.projectors.base.Projector`; its ``spec()`` fixes the
        matrix, its ``implementation`` attribute names the implementation used.

    Raises:
        ProjectorError: unknown kind, implementation or option (with a suggestion), an option of another kind, a kind
            built from a model (``kronecker``), non-integer or non-positive dims, bad option values, an implementation
            the kind lacks, ``cuda`` asked for where it cannot run, or a ``proj_dim`` whose smallest working set
            exceeds this machine's memory (:meth:`~trakcli.projectors.registry.ProjectorKind.check_memory`).
    """
    cls = projector_kind(kind)
    if cls.built_from_model is not None:
        raise ProjectorError(cls.built_from_model)
    if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
        raise ProjectorError(f"unknown projector implementation {implementation!r}"
                             f"{did_you_mean(implementation, IMPLEMENTATIONS)}; "
                             f"choose one of {', '.join(IMPLEMENTATIONS)}")
    unknown = [k for k in options if k not in OPTIONS]
    if unknown:
        choices = [*ARGUMENTS, *OPTIONS]
        raise ProjectorError(f"unknown projector option {unknown[0]!r}{did_you_mean(unknown[0], choices)}; "
                             f"known options: {', '.join(choices)}")
    grad_dim = check_int("grad_dim", grad_dim, 1, "it is the number of selected parameters")
    seed = check_int("seed", seed, 0, "use a non-negative integer such as 0")
    dtype = accumulation_dtype(options.get("dtype", "float32"))
    # columns per step of basic, entries per chunk of chunked: 2**18 unless given
    block_size, max_chunk_size = (check_int(k, options.get(k, 2**18), 1, f"e.g. {k}: 262144")
                                  for k in ("block_size", "max_chunk_size"))
    cache_bytes = options.get("cache_bytes", "auto")
    if cache_bytes != "auto":
        cache_bytes = check_int("cache_bytes", cache_bytes, 0,
                                "use 'auto', 0 to disable the cache, or a byte count such as 4294967296 (4 GiB)")
    for k in options:
        if k not in COMMON_OPTIONS and k not in cls.options:
            owner = option_owner(k)
            raise ProjectorError(f"projector option {k}={options[k]!r} only applies to kind {owner!r}, not {kind!r}; "
                                 f"remove it or set kind: {owner}")

    if cls.needs_proj_dim:
        if proj_dim is None:
            raise ProjectorError(f"projector kind {kind!r} needs proj_dim, e.g. proj_dim: 2048")
        proj_dim = check_int("proj_dim", proj_dim, 1, "e.g. proj_dim: 2048")
    own = {k: v for k, v in options.items() if k in cls.options}
    spec = cls(grad_dim=grad_dim, proj_dim=proj_dim, seed=seed, dtype=dtype, **own)

    implementation = spec.resolve_implementation(implementation)
    spec.check_memory(implementation)
    if implementation == "cuda":
        reason = _cuda_unavailable(kind, dtype)
        if reason:
            raise ProjectorError(f"projector implementation 'cuda' cannot run here: {reason}. Use implementation: "
                                 "basic or chunked (same matrix, so features stay comparable) or auto")

    if cache_bytes == "auto":  # the whole matrix if it fits min(4 GiB, RAM/4), else nothing
        matrix_bytes, budget = spec.matrix_bytes(), min(AUTO_CACHE_LIMIT, _total_ram() // 4)
        cache_bytes = budget if matrix_bytes <= budget else 0
        if implementation in ("basic", "chunked"):
            if cache_bytes:
                logger.info("projector caches its matrix (%.2f GiB)", matrix_bytes / 2**30)
            else:
                logger.info("projector matrix (%.2f GiB) exceeds the cache budget min(4 GiB, RAM/4): blocks are "
                            "regenerated for every batch (set cache_bytes to cache part of it)", matrix_bytes / 2**30)
    return spec.build(implementation, cache_bytes=cache_bytes, block_size=block_size, max_chunk_size=max_chunk_size)


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``"3.0 GiB"``, ``"5.8 TiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def refuse_over_memory(proj_dim: int, need: int, what: str) -> None:
    """Raise if ``need`` bytes (``what``: the piece a projector holds) exceed this machine's memory.

    Raises:
        ProjectorError: naming ``proj_dim``, the memory it would need and the memory here.
    """
    ram = _total_ram()
    if need > ram:
        raise ProjectorError(f"projector proj_dim={proj_dim} needs at least {format_bytes(need)} of memory to project "
                             f"one example ({what}), more than this machine's {format_bytes(ram)}; use a smaller "
                             "proj_dim, e.g. 2048")


def _cuda_unavailable(kind: str, dtype: torch.dtype = torch.float32) -> str | None:
    """Why the cuda implementation cannot run for ``kind`` accumulating in ``dtype`` here, or None if it can."""
    if kind not in DENSE_KINDS:
        return f"it implements the dense kinds {', '.join(DENSE_KINDS)}, not {kind!r}"
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'trakcli-attribution[cuda]')"
    if dtype != torch.float32:
        return f"it accumulates in float32, not {dtype_name(dtype)}"
    return None


def pick_auto(spec: ProjectorKind) -> str:
    """What ``implementation: auto`` builds for the kind ``spec``: ``cuda`` where it runs, else ``basic`` (else
    the kind's first implementation); logs the choice and why ``cuda`` was skipped."""
    kind = spec.name
    reason = _cuda_unavailable(kind, spec.dtype)
    if reason is None:
        logger.info("projector implementation 'auto' picked 'cuda' for kind %r", kind)
        return "cuda"
    fallback = "basic" if "basic" in spec.implementations else spec.implementations[0]
    logger.info("projector implementation 'auto' picked %r for kind %r (block-wise, cached); skipped 'cuda': %s; "
                "'single_block' and 'chunked' are never picked automatically (same matrix, choose them for tiny "
                "models or for memory)", fallback, kind, reason)
    return fallback
