"""The pydantic base of the config sections and of the optimizer's projection settings.

Unknown keys are errors, and booleans are not numbers. Imports nothing of trakcli.
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationInfo, field_validator


def _local_path(value: Any) -> Any:
    """A local path as given; a URL string (``SCHEME://...``) raises ``ValueError`` (``Path`` would collapse its
    ``//``)."""
    if isinstance(value, str) and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", value):
        raise ValueError("this key takes a local file or folder path, not a URL (Hugging Face Hub datasets "
                         "hf://datasets/ORG/NAME go in data paths such as data.train.path; object storage in "
                         "store.path)")
    return value


#: A config key that names a local file or folder (a :class:`~pathlib.Path`); a URL is refused as written.
LocalPath = Annotated[Path, BeforeValidator(_local_path)]


def admits_bool(annotation: Any) -> bool:
    """Whether a field typed ``annotation`` takes a boolean value (``bool``, ``Any``, a union or Literal with one)."""
    if annotation in (bool, Any, object):
        return True
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return any(isinstance(a, bool) for a in args)
    if origin in (typing.Union, types.UnionType):
        return any(admits_bool(a) for a in args)
    if origin is typing.Annotated:
        return admits_bool(args[0])
    return False


def _number_kind(annotation: Any) -> str | None:
    """``"an integer"`` / ``"a number"`` if a field typed ``annotation`` takes ints or floats (and not bools), else None."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _number_kind(args[0])
    if origin in (typing.Union, types.UnionType):
        kinds = [k for k in map(_number_kind, args) if k]
        return kinds[0] if kinds and not admits_bool(annotation) else None
    return "an integer" if annotation is int else "a number" if annotation is float else None


def _element_annotation(annotation: Any) -> Any:
    """The element type of a ``list[X]`` annotation (also inside ``Optional``), else None."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (list, tuple, set) and args:
        return args[0]
    if origin in (typing.Union, types.UnionType):
        return next((e for e in map(_element_annotation, args) if e is not None), None)
    return None


class NoBoolNumbers(BaseModel):
    """Refuses a boolean where a field takes a number (also in a list of numbers): YAML reads ``on``, ``yes``,
    ``true`` ... as booleans, and pydantic would take ``proj_dim: on`` as proj_dim 1."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is None:
            return value
        annotation = field.annotation
        if isinstance(value, bool):
            kind = _number_kind(annotation)
        elif isinstance(value, (list, tuple)) and any(isinstance(v, bool) for v in value):
            element = _element_annotation(annotation)
            kind = _number_kind(element) if element is not None else None
        else:
            return value
        if kind is None:
            return value
        raise ValueError(
            f"must be {kind}, not a boolean (YAML reads on/off, yes/no and true/false as booleans); give a number"
        )


class StrictModel(NoBoolNumbers):
    """Base of config sections: unknown keys are errors; a boolean is never taken as a number."""

    model_config = ConfigDict(extra="forbid")
