"""Polling helpers of the Slurm tests (a uniquely named module: `from conftest import ...` would pick up
whichever conftest.py pytest imported last)."""

from __future__ import annotations

import subprocess
import time


def wait_for_job(job_id: str, timeout_s: float = 180.0) -> dict:
    """Poll until the job has left the queue; returns `scontrol show job` fields."""
    from piper_plan.launch import submit

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if submit.squeue_state(job_id) is None:
            return submit.job_info(job_id) or {}
        time.sleep(1.0)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} did not finish in {timeout_s} s: {submit.job_info(job_id)}")


def wait_until(predicate, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
