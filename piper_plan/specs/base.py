"""The base of every spec: frozen, no unknown fields, a docstring under each field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Spec(BaseModel):
    """Frozen pydantic model; unknown fields are errors; floats must be finite (no nan / inf);
    field docstrings become descriptions."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)
