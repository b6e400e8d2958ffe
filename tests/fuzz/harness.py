"""Run one hostile case through the real CLI and sort what happened into the sweep's classes.

Most cases run in-process through click's ``CliRunner`` (fast: no interpreter start per case): an exception that
escapes the command is what a user would see as a traceback. A case marked ``subprocess`` runs ``piper`` in a
child process with an address-space limit, for the inputs that could hang or exhaust memory before the fix.
Each case has ``CASE_LIMIT_S`` seconds (an interval timer interrupts an in-process case that runs longer).
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

CASE_LIMIT_S = 10.0
SUBPROCESS_MEMORY_BYTES = 4 * 2**30
NONFINITE_JSON = re.compile(r"\b(NaN|Infinity)\b")
CLASSES = ("ok", "traceback", "hang", "nan_in_json", "wrong_exit", "silent_accept", "bad_message", "partial_file")
"""Sweep outcome classes; 'ok' = the case behaved as the README promises."""


class CaseTimeout(BaseException):
    """Raised by the interval timer inside a case that ran past CASE_LIMIT_S (BaseException: no handler eats it)."""


@dataclass
class Case:
    """One hostile input: the argv after ``piper``, what must happen, and how to build its files.

    ``args`` may hold ``{tmp}`` (the case's own empty folder). ``expect``: 2 (bad input), 3 (nothing fits) or 0
    (arguably valid input, accepted on purpose). ``outputs``: paths (under {tmp}) a failed command must not leave.
    ``setup(tmp)`` writes the case's files; ``env`` is added to the environment (``{tmp}`` expanded)."""

    id: str
    args: list[str]
    expect: int = 2
    setup: Callable[[Path], None] | None = None
    outputs: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    subprocess: bool = False
    check: Callable[[Path, "Outcome"], str | None] | None = None
    """Extra check after the run (returns a failure class, or None): e.g. no injected line in job.sbatch."""


@dataclass
class Outcome:
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float
    exception: str | None = None

    def classify(self, case: Case, tmp: Path) -> str:
        """The sweep class of this outcome (the first that applies)."""
        if self.exception == "timeout":
            return "hang"
        if self.exception is not None or "Traceback (most recent call last)" in self.stderr:
            return "traceback"
        if NONFINITE_JSON.search(self.stdout):
            return "nan_in_json"
        if self.exit_code == 0 and case.expect != 0:
            return "silent_accept"
        if self.exit_code != case.expect and not (case.expect == 0 and self.exit_code == 2):
            return "wrong_exit"
        if self.exit_code != 0 and any(_exists(tmp, out) for out in case.outputs):
            return "partial_file"
        if self.exit_code == 2 and not _one_error_line(self.stderr):
            return "bad_message"
        if case.check is not None:
            extra = case.check(tmp, self)
            if extra:
                return extra
        return "ok"


def _exists(tmp: Path, out: str) -> bool:
    path = Path(out.format(tmp=tmp))
    leftovers = list(path.parent.glob(f".{path.name}.*.tmp")) if path.parent.is_dir() else []
    return path.exists() or bool(leftovers)


def _one_error_line(stderr: str) -> bool:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    return len(lines) == 1 and lines[0].startswith("error: ")


def expand(value: str, tmp: Path) -> str:
    return value.replace("{tmp}", str(tmp))


def run_case(case: Case, tmp: Path) -> Outcome:
    """Build the case's files in ``tmp`` and run it (in-process or as a child process)."""
    tmp.mkdir(parents=True, exist_ok=True)
    if case.setup is not None:
        case.setup(tmp)
    args = [expand(a, tmp) for a in case.args]
    env = {k: expand(v, tmp) for k, v in case.env.items()}
    return _run_subprocess(args, env) if case.subprocess else _run_in_process(args, env)


def _run_in_process(args: list[str], env: dict[str, str]) -> Outcome:
    from click.testing import CliRunner

    from piper_plan.cli.main import cli

    def on_alarm(signum, frame):
        raise CaseTimeout()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, CASE_LIMIT_S)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")           # a warning is printed every time, not once per process
            result = CliRunner(env=env).invoke(cli, args, catch_exceptions=True)
    except CaseTimeout:
        return Outcome(None, "", "", time.perf_counter() - t0, "timeout")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    seconds = time.perf_counter() - t0
    exc = result.exception
    if exc is not None and not isinstance(exc, SystemExit):
        return Outcome(result.exit_code, result.stdout, result.stderr, seconds, f"{type(exc).__name__}: {exc}"[:300])
    return Outcome(result.exit_code, result.stdout, result.stderr, seconds)


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (SUBPROCESS_MEMORY_BYTES, SUBPROCESS_MEMORY_BYTES))


def _run_subprocess(args: list[str], env: dict[str, str]) -> Outcome:
    piper = Path(sys.executable).with_name("piper")
    t0 = time.perf_counter()
    try:
        done = subprocess.run([str(piper), *args], capture_output=True, text=True, timeout=CASE_LIMIT_S,
                              env={**os.environ, **env}, preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired:
        return Outcome(None, "", "", time.perf_counter() - t0, "timeout")
    return Outcome(done.returncode, done.stdout, done.stderr, time.perf_counter() - t0)


def describe(case: Case, outcome: Outcome, verdict: str) -> str:
    """One line for a failing case: what ran, what came back."""
    err = outcome.exception or " | ".join(outcome.stderr.strip().splitlines()[-2:])
    return (f"{case.id}: {verdict} (exit {outcome.exit_code}, want {case.expect}, {outcome.seconds:.1f} s): "
            f"piper {' '.join(case.args)[:160]} -> {err[:240]}")


def summary_json(rows: list[tuple[Case, Outcome, str]]) -> str:
    counts = {c: 0 for c in CLASSES}
    for _, _, verdict in rows:
        counts[verdict] += 1
    return json.dumps(counts)
