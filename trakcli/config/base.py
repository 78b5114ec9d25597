"""The base class of the strict config sections."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Base of config sections: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")
