"""The base of every spec: frozen, no unknown fields, a docstring under each field."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


class Spec(BaseModel):
    """Frozen pydantic model; unknown fields are errors; floats must be finite (no nan / inf);
    field docstrings become descriptions."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)


def _one_line(text: str) -> str:
    import unicodedata

    if not text or any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in text):
        raise ValueError("a name is one non-empty line: no newline, tab, line separator or other control character")
    return text


Name = Annotated[str, AfterValidator(_one_line)]
"""A name that launch scripts and exported scripts print into comments and job names: one printable line."""
