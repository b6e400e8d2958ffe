"""metrics.jsonl (DESIGN.md, schema_version 1): one line per step, written by global rank 0 only."""

from __future__ import annotations

import json
from pathlib import Path

from piper_plan.metricsfile import SCHEMA_VERSION, records_of_layout, steady_steps

MEMORY_SOURCE_CPU = "tensor accounting: parameters + gradients + optimizer state + peak activations saved for backward"
MEMORY_SOURCE_GPU = "torch.cuda.max_memory_allocated"


def step_record(step: int, loss: float, step_time_s: float, tokens: int, time_s: dict, memory_bytes: list,
                expert_tokens: dict, migrations: list | None = None, parallel: dict | None = None) -> dict:
    """One metrics.jsonl line; ``parallel``: the plan's parallel block the step ran under (a resumed run may change
    it: metricsfile.records_of_layout)."""
    record = {"schema_version": SCHEMA_VERSION, "step": step, "loss": loss, "step_time_s": step_time_s,
              "tokens": tokens, "tokens_per_s": tokens / step_time_s if step_time_s > 0 else None,
              "time_s": time_s, "memory_bytes": memory_bytes, "expert_tokens": expert_tokens,
              "migrations": migrations or []}
    return record if parallel is None else {**record, "parallel": parallel}


class MetricsWriter:
    """Appends step records (line-buffered, so a killed run keeps every finished step)."""

    def __init__(self, path: Path, resume: bool) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a" if resume else "w", encoding="utf-8", buffering=1)

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.file.close()


def migration_summary(records: list[dict]) -> dict:
    """Expert migration over the whole run: events, swaps, seconds, and seconds / (steps + migrations)."""
    seconds = sum(r["time_s"].get("migration", 0.0) for r in records)
    total = sum(r["step_time_s"] for r in records) + seconds
    events = [e for r in records for e in r.get("migrations") or []]
    return {"events": len(events), "swaps": sum(e["num_swaps"] for e in events), "seconds": seconds,
            "share": seconds / total if total > 0 else 0.0}


def summarise(records: list[dict]) -> dict:
    """The final summary: steps, losses and migration over the whole run; times and memory per stage over the steps
    of the last layout (a resume may change it: records_of_layout), steady state (the first step, which includes
    warm-up, left out when possible). Records written before the runtime named their layout count as any layout's,
    so the stage count must match the last record's too."""
    all_records = records
    if records:
        last = records[-1]
        records = [r for r in records_of_layout(records, last.get("parallel"))
                   if len(r["memory_bytes"]) == len(last["memory_bytes"])]
    steady = steady_steps(records)
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    step_s = mean([r["step_time_s"] for r in steady])
    a2a = mean([r["time_s"].get("a2a", 0.0) for r in steady])
    return {"schema_version": SCHEMA_VERSION, "steps": len(all_records),
            "first_loss": all_records[0]["loss"] if all_records else None,
            "final_loss": all_records[-1]["loss"] if all_records else None,
            "step_time_s": step_s, "steps_per_s": 1 / step_s if step_s else None,
            "tokens_per_s": mean([r["tokens_per_s"] for r in steady]),
            "a2a_share": a2a / step_s if step_s else None,
            "time_s": {k: mean([r["time_s"].get(k, 0.0) for r in steady]) for k in ("a2a", "p2p", "dp_sync", "migration")},
            "migration": migration_summary(all_records),
            "peak_memory_bytes": [max(r["memory_bytes"][i]["total_bytes"] for r in records)
                                  for i in range(len(records[-1]["memory_bytes"]))] if records else []}


# ---- rank 0's progress line (step, loss, tokens/s, ETA) -----------------------------------------------------------
PROGRESS_EVERY_STEPS = 10
"""Off a terminal (a log file, a Slurm job's output) a plain line every this many steps, and at the last step."""


def eta_s(step_times_s: list[float], steps_left: int) -> float | None:
    """Seconds to the last step: the mean step time so far times the steps left; the first step (warm-up) is left
    out once there are others. None before the first step."""
    steady = step_times_s[1:] if len(step_times_s) > 1 else step_times_s
    return sum(steady) / len(steady) * steps_left if steady else None


def hms(seconds: float) -> str:
    """12 -> '12s', 192 -> '3m12s', 3725 -> '1h02m05s'."""
    total = max(int(round(seconds)), 0)
    h, m, s = total // 3600, total % 3600 // 60, total % 60
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def progress_line(record: dict, total_steps: int, eta: float | None) -> str:
    """One metrics.jsonl record as the line a person reads: 'step 12/200 | loss 6.2374 | 41,234 tokens/s | ETA 3m12s'."""
    tokens = record.get("tokens_per_s")
    return " | ".join([f"step {record['step']}/{total_steps}", f"loss {record['loss']:.4f}",
                       f"{tokens:,.0f} tokens/s" if tokens else "- tokens/s",
                       f"ETA {hms(eta)}" if eta is not None else "ETA -"])


class ProgressLine:
    """Rank 0's progress on ``stream`` (stderr): on a terminal one line rewritten in place every step, otherwise a
    plain line every ``every`` steps and at the last. ``update`` takes each metrics.jsonl record as it is written."""

    def __init__(self, total_steps: int, stream=None, every: int = PROGRESS_EVERY_STEPS,
                 is_terminal: bool | None = None) -> None:
        import sys

        self.total_steps, self.every = total_steps, max(every, 1)
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty() if is_terminal is None else is_terminal
        self.step_times_s: list[float] = []
        self.open_line = False
        """A live line is on screen without its newline."""

    def update(self, record: dict) -> None:
        self.step_times_s.append(record["step_time_s"])
        line = progress_line(record, self.total_steps, eta_s(self.step_times_s, self.total_steps - record["step"]))
        last = record["step"] >= self.total_steps
        if self.live:
            self.stream.write("\r\x1b[2K" + line + ("\n" if last else ""))
            self.open_line = not last
        elif last or record["step"] % self.every == 0:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End a live line that did not reach the last step (a run stopped on a signal)."""
        if self.open_line:
            self.stream.write("\n")
            self.stream.flush()
            self.open_line = False
