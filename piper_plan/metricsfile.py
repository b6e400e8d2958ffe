"""Reading metrics.jsonl (DESIGN.md: one JSON object per step, written by the runtime's rank 0). Torch-free, so
the planner side (compare, migrate simulate, calibrate fit) reads runs without importing the runtime.

Every line goes through the input boundary (``fileio.json_lines``: strict JSON, no NaN / Infinity, bounded
integers and depth) and is then validated as a ``StepRecord`` (pydantic, strict: a boolean or a string is not a
number); then checked against itself (tokens_per_s = tokens / step_time_s, no component timed inside the step
longer than the step) and the lines before it (steps increase); an error names the file, the line and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from piper_plan.errors import PiperError
from piper_plan.fileio import json_lines

SCHEMA_VERSION = 1
"""metrics.jsonl's schema_version (runtime/metrics.py writes it)."""

MAX_SECONDS = 1e7
"""Longest step (or step component) accepted: 1e7 s, 116 days; larger is a corrupt record, not a measurement."""
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]
Bytes = Annotated[float, Field(ge=0, le=2.0**70)]
RATE_TOLERANCE = 0.01
"""tokens_per_s is tokens / step_time_s (runtime/metrics.py): off by more than 1 % (relative), a record contradicts
itself."""
STEP_SLACK = (0.01, 1e-3)
"""A time_s component may exceed its step by 1 % + 1 ms (timer resolution); longer is a component of another step."""
OUTSIDE_STEP = ("migration",)
"""time_s components timed after the step's clock stops (runtime/train.py: migration runs at the step boundary):
they may exceed step_time_s."""


PROCESS_RSS_KEY = "process_peak_rss_bytes"
"""A stage memory entry's extra field on CPU ranks: the largest peak resident set size of the stage's rank
processes (getrusage), the whole process the plan's per-device peak stands for there (runtime/train.py)."""


class StageMemory(BaseModel):
    """One stage's entry of ``memory_bytes`` (docs/design-notes.md): the stage, where its figures come from, and
    byte counts (the runtime's parameters_bytes ... total_bytes, process_peak_rss_bytes; further counts may follow,
    each a number of bytes: ``__pydantic_extra__`` types them)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)
    __pydantic_extra__: dict[str, Bytes]
    stage: int | None = Field(default=None, ge=0)
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
    memory_bytes: list[StageMemory] | None = None
    """One entry per stage: an object (StageMemory) or, from older runs, its total as a plain number."""
    expert_tokens: Any = None
    migrations: Any = None

    warmup: bool | None = None
    """The first step of a run or of a resume (allocation, connections), which compare leaves out."""

    @field_validator("memory_bytes", mode="before")
    @classmethod
    def _totals_as_entries(cls, value):
        """A plain number is a stage's total_bytes, checked as one (one message, not one per form of an entry)."""
        if not isinstance(value, list):
            return value
        return [{"total_bytes": v} if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in value]


def read_metrics(path: str | Path) -> list[dict]:
    """The step records of a metrics.jsonl, each validated as a StepRecord; at least one. The records come back
    as the parsed dicts (readers index into them)."""
    records: list[dict] = []
    for number, obj in json_lines(path):
        record = check_record(obj, f"line {number}", str(path))
        if records and record["step"] <= records[-1]["step"]:
            raise PiperError(f"line {number}: step={record['step']} after step {records[-1]['step']}; steps must "
                             "increase line by line (the runtime writes one record per step, in order)", path=str(path))
        records.append(record)
    if not records:
        raise PiperError("no step records", path=str(path))
    return records


def records_of_layout(records: list[dict], parallel: dict | None) -> list[dict]:
    """The records run under ``parallel`` (a plan's parallel block as plan.json holds it; runtime/metrics.py writes it
    into each record): a run resumed under another layout keeps the earlier layout's records, whose step times and
    memory_bytes (one entry per stage) are of another plan. A record without ``parallel`` (written before the runtime
    recorded it) counts as any layout's; fields one side lacks (another piper version's) are not compared."""
    if parallel is None:
        return records
    return [r for r in records if _same_layout(r.get("parallel"), parallel)]


def _same_layout(recorded, parallel: dict) -> bool:
    if not isinstance(recorded, dict):
        return recorded is None
    return all(recorded[key] == parallel[key] for key in recorded.keys() & parallel.keys())


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
    _check_rate(record, where, path)
    _check_components(record, where, path)
    return record


def _check_rate(record: dict, where: str, path: str) -> None:
    """tokens_per_s must be tokens / step_time_s (where all three are given)."""
    tokens, seconds, rate = record.get("tokens"), record.get("step_time_s"), record.get("tokens_per_s")
    if None in (tokens, seconds, rate) or seconds <= 0:
        return
    derived = tokens / seconds
    if abs(rate - derived) > RATE_TOLERANCE * derived:
        raise PiperError(f"{where}: tokens_per_s={rate:g}, but tokens / step_time_s = {tokens:,} / {seconds:g} s = "
                         f"{derived:g}; allowed within {RATE_TOLERANCE:.0%} of it", path=path)


def _check_components(record: dict, where: str, path: str) -> None:
    """No time_s component timed inside the step (all but OUTSIDE_STEP) may be longer than the step."""
    seconds = record.get("step_time_s")
    if seconds is None:
        return
    relative, absolute = STEP_SLACK
    for name, value in (record.get("time_s") or {}).items():
        if name not in OUTSIDE_STEP and value > seconds * (1 + relative) + absolute:
            raise PiperError(f"{where}: time_s.{name}={value:g} s is longer than its step (step_time_s={seconds:g} s); "
                             f"a component timed inside the step is at most the step (+{relative:.0%} + "
                             f"{absolute * 1e3:g} ms)", path=path)


def steady_steps(records: list[dict]) -> list[dict]:
    """Records without their warm-up steps (the run's first, and the first of each resume: ``warmup`` in the
    record; all kept when nothing else is left), by step; the last record per step wins (read_metrics refuses a
    file whose steps do not increase; records built in code may repeat one)."""
    by_step = {r["step"]: r for r in records}
    ordered = [by_step[s] for s in sorted(by_step)]
    steady = [r for i, r in enumerate(ordered) if i > 0 and not r.get("warmup")]
    return steady or ordered
