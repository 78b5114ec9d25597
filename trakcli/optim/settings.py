"""The projection settings of the optimizer, the one schema of the config's ``optimize.projection`` too.

:class:`ProjectionSettings` holds what fixes the optimizer's matrices and how they are refreshed;
:func:`resolve_projection` validates a mapping (or a settings object) into the plain dict the optimizer stores in its
param groups and state dicts. The YAML config validates ``optimize.projection`` with the same model
(:class:`trakcli.config.OptimizeConfig`); this module knows nothing of the config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, PositiveInt, ValidationError, model_validator

from trakcli.errors import OptimizerError
from trakcli.strict import StrictModel

#: ``rank`` when unset (per_matrix mode only reads it).
DEFAULT_RANK = 8


class ProjectionSettings(StrictModel):
    """``optimize.projection``: run the optimizer in a random subspace (:mod:`trakcli.optim`).

    Constructing one validates it (``pydantic.ValidationError``, a ``ValueError``, listing every problem; a boolean is
    not taken as a number); :func:`resolve_projection`, which :class:`~trakcli.optim.ProjectedOptimizer` and
    :func:`~trakcli.optim.subspace.attach` call on a mapping, raises :class:`~trakcli.errors.OptimizerError` instead.
    """

    mode: Literal["per_matrix", "global"] = Field(
        "per_matrix", description="per_matrix: each parameter of >= 2 dims gets its own rank-`rank` projection of its "
        "smaller side (kind kronecker: of both sides; 1-D parameters are not projected); global: the whole "
        "parameter vector through one projection of `proj_dim`.")
    kind: Literal["noop", "rademacher", "normal", "sjlt", "kronecker"] = Field(
        "rademacher", description="Projector kind (noop: no projection, the plain inner optimizer; kronecker, "
        "per_matrix only: each [d_out, d_in] weight's gradient G projected from both sides, P_out G P_inᵀ of "
        "[min(rank, d_out), min(rank, d_in)], rademacher factors).")
    implementation: Literal["auto", "single_block", "basic", "chunked"] = Field(
        "auto", description="Projector implementation (never changes the matrix; kronecker ignores it).")
    rank: PositiveInt | None = Field(
        None, description="per_matrix only: projected size of each matrix's smaller side, with kind kronecker of "
        f"each side (default {DEFAULT_RANK}).")
    proj_dim: PositiveInt | None = Field(None, description="global only: dimension of the subspace (required in "
                                         "global mode).")
    seed: int = Field(0, ge=0, description="Base seed; every matrix and refresh derives its own.")
    update_gap: int = Field(0, ge=0, description="Draw a new projection every this many steps (0: one fixed "
                            "projection).")
    on_refresh: Literal["keep", "reset", "transfer"] = Field(
        "transfer", description="What happens to the inner optimizer's state at a new projection: keep it as is, "
        "reset it, or transfer first moments into the new subspace (never growing their norm).")
    scale: float = Field(1.0, gt=0, description="Multiplies every unprojected update (GaLore's alpha).")

    @model_validator(mode="after")
    def _dims(self) -> "ProjectionSettings":
        # rank is read in per_matrix mode only and proj_dim in global mode only, so one
        # mapping can hold both and `mode=...` alone switches between them
        if self.mode == "global" and self.kind == "kronecker":
            raise ValueError("kind kronecker projects each weight matrix from both sides (P_out G P_inᵀ) and has no "
                             "global form; use mode: per_matrix with it (rank: the size of each side), or a global "
                             "kind: rademacher, normal or sjlt")
        if self.mode == "global" and self.kind != "noop" and self.proj_dim is None:
            raise ValueError("mode global needs proj_dim, e.g. proj_dim: 1000")
        if self.rank is None:
            self.rank = DEFAULT_RANK
        return self


def _problems(err: ValidationError, where: str, raw: Any) -> str:
    """The one message listing every problem of ``err`` (one line per key, with the value given)."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        got = e.get("input") if key else raw
        lines.append(f"{where}{'.' + key if key else ''}: {e['msg'].removeprefix('Value error, ')} (got {got!r})")
    return "invalid projection settings:\n  " + "\n  ".join(lines)


def resolve_projection(value: Any, where: str = "projection") -> dict[str, Any] | None:
    """Validate projection settings into the plain dict the optimizer stores.

    Args:
        value: a mapping with keys of :class:`ProjectionSettings` (the YAML's
            ``optimize.projection``), a :class:`ProjectionSettings`, or ``None`` (no projection).
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
        return value.model_dump()
    if not isinstance(value, Mapping):
        raise OptimizerError(f"{where} must be a mapping such as {{'mode': 'per_matrix', 'rank': 8}} or a projector "
                             f"object, got {type(value).__name__}")
    raw = dict(value)
    try:
        return ProjectionSettings.model_validate(raw).model_dump()
    except ValidationError as e:
        raise OptimizerError(_problems(e, where, raw)) from None
