"""The projection settings of the optimizer: a plain dataclass, and their validation.

:class:`ProjectionSettings` holds what fixes the optimizer's matrices and how
they are refreshed; :func:`resolve_projection` validates a mapping (or a
settings object) into the plain dict the optimizer stores in its param groups
and state dicts. This module knows nothing of the YAML config: the config's
``projection`` section (``trakcli.config.ProjectionConfig``, same keys and
defaults) is passed as a mapping by the caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, PositiveInt, TypeAdapter, ValidationError

from trakcli.errors import OptimizerError

#: ``rank`` when unset (per_matrix mode only reads it).
DEFAULT_RANK = 8

#: Why ``mode: global`` with ``kind: kronecker`` is refused, and the fix (the config says the same).
GLOBAL_KRONECKER = (
    "kind kronecker projects each weight matrix from both sides (P_out G P_inᵀ) and has no global form; "
    "use mode: per_matrix with it (rank: the size of each side), or a global kind: rademacher, normal or sjlt"
)


@dataclasses.dataclass(frozen=True)
class ProjectionSettings:
    """How the optimizer projects: GaLore (Zhao et al. 2024) with random JL matrices (Flora, Hao et al. 2024),
    or one projection of the whole parameter vector (intrinsic dimension, Li et al. 2018).

    Constructing one does not validate it; :func:`resolve_projection` (which
    :class:`~trakcli.optim.ProjectedOptimizer` and
    :func:`~trakcli.optim.subspace.attach` call) does.

    Attributes:
        mode: ``per_matrix``: each parameter of >= 2 dims gets its own rank-``rank``
            projection of its smaller side (kind ``kronecker``: of both sides; 1-D
            parameters are not projected); ``global``: the whole parameter vector
            through one projection of ``proj_dim``.
        kind: projector kind: ``noop`` (no projection: the plain inner optimizer),
            ``rademacher``, ``normal``, ``sjlt``; or ``kronecker`` (per_matrix only):
            ``R = P_out G P_inᵀ`` of ``[min(rank, d_out), min(rank, d_in)]`` with
            rademacher factors (:mod:`trakcli.optim.kronecker_slot`).
        implementation: projector implementation (``auto``, ``single_block``, ``basic``,
            ``chunked``); never changes the matrix (kind ``kronecker`` ignores it).
        rank: per_matrix only: projected size of each matrix's smaller side, or with
            kind ``kronecker`` of each side (unset: 8).
        proj_dim: global only: dimension of the subspace (required in global mode,
            unless ``kind`` is ``noop``).
        seed: base seed (>= 0); every matrix and refresh derives its own.
        update_gap: draw a new projection every this many steps (0: one fixed projection).
        on_refresh: what happens to the inner optimizer's state at a new projection:
            ``keep`` it, ``reset`` it, or ``transfer`` first moments into the new
            subspace (never growing their norm).
        scale: multiplies every unprojected update (GaLore's alpha), > 0.
    """

    __pydantic_config__ = ConfigDict(extra="forbid")

    mode: Literal["per_matrix", "global"] = "per_matrix"
    kind: Literal["noop", "rademacher", "normal", "sjlt", "kronecker"] = "rademacher"
    implementation: Literal["auto", "single_block", "basic", "chunked"] = "auto"
    rank: PositiveInt | None = None
    proj_dim: PositiveInt | None = None
    seed: Annotated[int, Field(ge=0)] = 0
    update_gap: Annotated[int, Field(ge=0)] = 0
    on_refresh: Literal["keep", "reset", "transfer"] = "transfer"
    scale: Annotated[float, Field(gt=0)] = 1.0


_ADAPTER = TypeAdapter(ProjectionSettings)


def resolve_projection(value: Any, where: str = "projection") -> dict[str, Any] | None:
    """Validate projection settings into the plain dict the optimizer stores.

    Args:
        value: a mapping with keys of :class:`ProjectionSettings` (the YAML's
            ``optimize.projection``), a :class:`ProjectionSettings`, an object with
            ``model_dump()`` giving such a mapping (a pydantic model such as the
            config's ``ProjectionConfig``), or ``None`` (no projection).
        where: name shown in error messages.

    Returns:
        A plain dict (mode, kind, implementation, rank, proj_dim, seed,
        update_gap, on_refresh, scale) with ``rank`` filled in, or ``None``.

    Raises:
        OptimizerError: not a mapping, unknown keys or invalid values, all listed.
    """
    if value is None:
        return None
    if isinstance(value, ProjectionSettings):
        value = dataclasses.asdict(value)
    elif not isinstance(value, Mapping) and callable(getattr(value, "model_dump", None)):
        value = value.model_dump()
    if not isinstance(value, Mapping):
        raise OptimizerError(
            f"{where} must be a mapping such as {{'mode': 'per_matrix', 'rank': 8}} or a projector "
            f"object, got {type(value).__name__}"
        )
    raw = dict(value)
    lines = []
    try:
        settings = _ADAPTER.validate_python(raw)
    except ValidationError as e:
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"])
            # a dataclass names an unknown key "Unexpected keyword argument": say it as for the config
            msg = "Extra inputs are not permitted" if err["type"] == "unexpected_keyword_argument" else err["msg"]
            lines.append(f"{where}{'.' + key if key else ''}: {msg} (got {err.get('input')!r})")
    else:
        # rank is read in per_matrix mode only and proj_dim in global mode only, so one
        # mapping can hold both and `mode=...` alone switches between them
        if settings.mode == "global" and settings.kind == "kronecker":
            lines.append(f"{where}: {GLOBAL_KRONECKER} (got {raw!r})")
        elif settings.mode == "global" and settings.kind != "noop" and settings.proj_dim is None:
            lines.append(f"{where}: mode global needs proj_dim, e.g. proj_dim: 1000 (got {raw!r})")
    if lines:
        raise OptimizerError("invalid projection settings:\n  " + "\n  ".join(lines))
    out = dataclasses.asdict(settings)
    if out["rank"] is None:
        out["rank"] = DEFAULT_RANK
    return out


def projection_mapping(value: Any) -> Any:
    """A group's ``projection`` as a mapping of the keys it sets (settings objects give all their keys).

    Mappings and anything else (projector objects, ``None``) are returned as they are.
    """
    if isinstance(value, ProjectionSettings):
        return dataclasses.asdict(value)
    if not isinstance(value, Mapping) and callable(getattr(value, "model_dump", None)):
        return value.model_dump()
    return value
