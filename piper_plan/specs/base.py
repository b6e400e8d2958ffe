"""The base of every spec: frozen, no unknown fields, a docstring under each field."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict


class Spec(BaseModel):
    """Frozen pydantic model; unknown fields are errors; floats must be finite (no nan / inf);
    field docstrings become descriptions."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)


MAX_NAME_CHARS = 256
"""The longest name: a model's or platform's name is printed in tables, comments and job names."""


def plain_name(text: str) -> str:
    """``text`` if it is a Name (one printable line, at most MAX_NAME_CHARS), else ValueError saying what is allowed."""
    import unicodedata

    if not text.strip() or any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in text):
        raise ValueError("a name is one line, not blank: no newline, tab, line separator, other control character "
                         "or format character (a right-to-left override reorders what a terminal shows)")
    if len(text) > MAX_NAME_CHARS:
        raise ValueError(f"a name is at most {MAX_NAME_CHARS} characters, not {len(text):,}")
    return text


def _folder_name(text: str) -> str:
    if "/" in text or "\\" in text or text.strip() in (".", ".."):
        raise ValueError("a platform name names its calibration folder (calibration/<platform>/): no '/' or '\\', "
                         "and not '.' or '..'")
    return text


def _cited(text: str) -> str:
    if not text.strip():
        raise ValueError("a source is required (a datasheet, paper or measurement)")
    if "from memory" in text.lower():
        raise ValueError("'from memory' is not a source: cite one, or leave the value out")
    return text


def _not_a_bool(value):
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    return value


NotBool = BeforeValidator(_not_a_bool)
"""For a Literal of numbers, which even strict validation matches by equality (True == 1)."""
Citation = Annotated[str, AfterValidator(_cited)]
"""Where a spec's figures come from: not blank, and never 'from memory'."""
Name = Annotated[str, AfterValidator(plain_name)]
"""A name that launch scripts and exported scripts print into comments and job names: one printable line."""
FolderName = Annotated[str, AfterValidator(plain_name), AfterValidator(_folder_name)]
"""A Name that is also a folder's (a platform's: calibration/<platform>/): no path separator, not '.' or '..'."""
