"""Reading metrics.jsonl (DESIGN.md: one JSON object per step, written by the runtime's rank 0). Torch-free, so
the planner side (compare, migrate simulate, calibrate fit) reads runs without importing the runtime."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from piper_plan.errors import PiperError

SCHEMA_VERSION = 1
"""metrics.jsonl's schema_version (runtime/metrics.py writes it)."""
RECORD_TYPES = {"step": (int, "integer"), "step_time_s": ((int, float), "number"),
                "tokens_per_s": ((int, float), "number"), "time_s": (dict, "object"), "memory_bytes": (list, "array")}
"""Step-record fields readers index into, and the JSON type each must have when present."""


def json_lines(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-empty line; an unreadable file, bad JSON or a non-object is a PiperError."""
    from piper_plan.catalog import read_text

    path = Path(path)
    for number, raw in enumerate(read_text(path).splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise PiperError(f"line {number}: malformed JSON: {exc.msg}", path=str(path)) from None
        if not isinstance(obj, dict):
            raise PiperError(f"line {number}: expected a JSON object, got {type(obj).__name__}", path=str(path))
        yield number, obj


def read_metrics(path: str | Path) -> list[dict]:
    """The step records of a metrics.jsonl, each checked (schema_version, step, field types); at least one."""
    records = [check_record(obj, f"line {number}", str(path)) for number, obj in json_lines(path)]
    if not records:
        raise PiperError("no step records", path=str(path))
    return records


def check_record(record: dict, where: str, path: str) -> dict:
    """One step record: its schema_version (when given) and the types of the fields readers index into."""
    version = record.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise PiperError(f"{where}: schema_version={version!r}; this piper reads {SCHEMA_VERSION}", path=path)
    if "step" not in record:
        raise PiperError(f"{where}: field step: missing", path=path)
    for field, (kind, name) in RECORD_TYPES.items():
        value = record.get(field)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise PiperError(f"{where}: field {field}: {value!r} is not a JSON {name}", path=path)
    return record
