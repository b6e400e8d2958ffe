"""The base of every spec: frozen, no unknown fields, a docstring under each field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Spec(BaseModel):
    """Frozen pydantic model; unknown fields are errors; field docstrings become descriptions."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)
