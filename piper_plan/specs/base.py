"""The base of every spec: frozen, no unknown fields, a docstring under each field."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


class Spec(BaseModel):
    """Frozen pydantic model; unknown fields are errors; floats must be finite (no nan / inf);
    field docstrings become descriptions."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)


def _plain_name(text: str) -> str:
    import unicodedata

    if not text or any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in text):
        raise ValueError("a name is one non-empty line: no newline, tab, line separator or other control character")
    if "/" in text or "\\" in text or text.strip() in (".", ".."):
        raise ValueError("a name names a folder (calibration/<platform>/): no '/' or '\\', and not '.' or '..'")
    return text


Name = Annotated[str, AfterValidator(_plain_name)]
"""A name that launch scripts and exported scripts print into comments and job names, and that calibration folders
are named after: one printable line, no path separator, not '.' or '..'."""
