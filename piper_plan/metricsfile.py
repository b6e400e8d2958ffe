"""Reading metrics.jsonl (DESIGN.md: one JSON object per step, written by the runtime's rank 0). Torch-free, so
the planner side (compare, migrate simulate, calibrate fit) reads runs without importing the runtime.

Every line goes through the input boundary (``fileio.json_lines``: strict JSON, no NaN / Infinity, bounded
integers and depth) and is then validated as a ``StepRecord`` (pydantic, strict: a boolean or a string is not a
number); an error names the file, the line and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from piper_plan.errors import PiperError
from piper_plan.fileio import json_lines

SCHEMA_VERSION = 1
"""metrics.jsonl's schema_version (runtime/metrics.py writes it)."""

MAX_SECONDS = 1e7
"""Longest step (or step component) accepted: 1e7 s, 116 days; larger is a corrupt record, not a measurement."""
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]
Bytes = Annotated[float, Field(ge=0, le=2.0**70)]


class StageMemory(BaseModel):
    """One stage's entry of ``memory_bytes`` (docs/design-notes.md); further byte counts may follow."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)
    total_bytes: Bytes | None = None
    peak_bytes: Bytes | None = None
    source: str | None = None


class StepRecord(BaseModel):
    """One step record: the fields readers index into, typed; the rest (expert_tokens, migrations, ...) kept."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)
    schema_version: Literal[1] = SCHEMA_VERSION
    step: int = Field(ge=0)
    loss: float | None = None
    step_time_s: float | None = Field(default=None, ge=1e-9, le=MAX_SECONDS)
    """Seconds of the step: 1 ns .. MAX_SECONDS (shorter is a corrupt record)."""
    tokens: int | None = Field(default=None, ge=1)
    """Tokens of the step: the run's global batch x sequence length (runtime/metrics.py); at least 1."""
    tokens_per_s: float | None = Field(default=None, ge=0, le=1e18)
    time_s: dict[str, Seconds] | None = None
    memory_bytes: list[StageMemory | Bytes] | None = None
    expert_tokens: Any = None
    migrations: Any = None


def read_metrics(path: str | Path) -> list[dict]:
    """The step records of a metrics.jsonl, each validated as a StepRecord; at least one. The records come back
    as the parsed dicts (readers index into them)."""
    records = [check_record(obj, f"line {number}", str(path)) for number, obj in json_lines(path)]
    if not records:
        raise PiperError("no step records", path=str(path))
    return records


def check_record(record: dict, where: str, path: str) -> dict:
    """One step record, validated (schema_version, step, the types and ranges of the fields readers use)."""
    version = record.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise PiperError(f"{where}: schema_version={version!r}; this piper reads {SCHEMA_VERSION}", path=path)
    try:
        StepRecord.model_validate(record)
    except ValidationError as exc:
        from piper_plan.catalog import validation_message

        raise PiperError(f"{where}: {validation_message(exc)}", path=path) from None
    return record
