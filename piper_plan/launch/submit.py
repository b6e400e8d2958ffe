"""A thin wrapper around Slurm's sbatch / squeue / scontrol. Slurm's own refusal reason is passed on verbatim."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from piper_plan.errors import PiperError

TIMEOUT_S = 60.0
UNKNOWN_JOB = "Invalid job id specified"
"""What squeue and scontrol say (slurm_load_jobs error) about a job id Slurm does not know."""


def _slurm(tool: str, args: list[str], cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which(tool)
    if exe is None:
        raise PiperError(f"{tool} not found on PATH: this machine has no Slurm client; " + NO_CLIENT_ADVICE.get(
            tool, "ask about the job on a login node of the cluster (`piper status --dir DIR` shows what a job or "
                  "run directory holds without Slurm)"))
    _check_controller(tool)
    return _run(exe, args, cwd)


def _run(exe: str, args: list[str], cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PiperError(f"{Path(exe).name} did not answer in {TIMEOUT_S:g} s: is the Slurm controller up?") from None


NO_CLIENT_ADVICE = {"sbatch": "copy the job directory to a login node of the cluster and run `sbatch job.sbatch` "
                               "there"}
"""What to do where a Slurm tool is missing: submit advice for sbatch alone (squeue and scontrol ask about a job,
which may be a local run that was never submitted)."""


def _check_controller(tool: str) -> None:
    """``scontrol ping`` before a command that asks the controller: ping tries once and answers in milliseconds,
    where sbatch, squeue and scontrol show retry an unreachable controller for about 18 s each (Slurm 22.05,
    measured here) before failing. Refuses only on ping's own verdict that every controller is DOWN."""
    exe = shutil.which("scontrol")
    if exe is None:
        return
    proc = _run(exe, ["ping"])
    text = proc.stdout + proc.stderr
    if proc.returncode != 0 and " is DOWN" in text and " is UP" not in text:
        first = next(ln.strip() for ln in text.splitlines() if " is DOWN" in ln)
        raise PiperError(f"{tool} not run: the Slurm controller does not answer (scontrol ping: {first})")


def _reason(proc: subprocess.CompletedProcess) -> str:
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    return " / ".join(lines) or f"exit code {proc.returncode}"


JOB_ID = re.compile(r"[0-9]{1,10}")
"""A Slurm job id: a 32-bit number in ASCII digits (str.isdigit also takes superscripts and other scripts' digits)."""


def submit(script: str | Path, extra_args: list[str] | None = None) -> str:
    """``sbatch --parsable script``; returns the job id. Slurm's refusal becomes a PiperError with its reason."""
    script = Path(script)
    proc = _slurm("sbatch", ["--parsable", *(extra_args or []), str(script)], cwd=script.parent)
    if proc.returncode != 0:
        raise PiperError(f"sbatch refused the job: {_reason(proc)}", path=str(script))
    job_id = proc.stdout.strip().split(";")[0]
    if not JOB_ID.fullmatch(job_id):
        raise PiperError(f"sbatch printed no job id: {proc.stdout.strip()!r}", path=str(script))
    return job_id


@dataclass(frozen=True)
class SlurmAnswer:
    """The answer of ``sbatch --test-only``."""

    ok: bool
    message: str


def would_accept(script: str | Path) -> SlurmAnswer:
    """``sbatch --test-only script``: would Slurm accept and schedule this job? (runs nothing; `launch --check`)"""
    script = Path(script)
    proc = _slurm("sbatch", ["--test-only", str(script)], cwd=script.parent)
    return SlurmAnswer(ok=proc.returncode == 0, message=_reason(proc))


def job_info(job_id: str) -> dict[str, str] | None:
    """``scontrol show job -o JOB`` as a dict (JobState, WorkDir, StdOut, NodeList, Reason, RestartCnt, ...);
    None when Slurm no longer knows the job."""
    if not JOB_ID.fullmatch(str(job_id)):
        shown = ascii(str(job_id)[:40]) + ("..." if len(str(job_id)) > 40 else "")
        raise PiperError(f"job id {shown} is not allowed; allowed: a job number (ASCII digits, at most 10)")
    proc = _slurm("scontrol", ["show", "job", "-o", str(job_id)])
    if proc.returncode != 0:
        return _unknown_job(proc, "scontrol")
    return parse_scontrol(proc.stdout)


def _unknown_job(proc: subprocess.CompletedProcess, command: str) -> None:
    """None where Slurm answered that it does not know the job; any other failure (no controller to ask) is a
    PiperError with Slurm's reason, not "unknown job"."""
    if UNKNOWN_JOB in proc.stderr + proc.stdout:
        return None
    raise PiperError(f"{command} failed, so the job's state is unknown: {_reason(proc)}")


def parse_scontrol(text: str) -> dict[str, str]:
    """``Key=Value Key=Value ...`` (one line, values without spaces except the last keys) -> dict."""
    info: dict[str, str] = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep:
            info[key] = value
    return info


def squeue_state(job_id: str) -> str | None:
    """The job's state as squeue prints it (PENDING, RUNNING, ...); None when it left the queue."""
    proc = _slurm("squeue", ["-h", "-j", str(job_id), "-o", "%T"])
    if proc.returncode != 0:
        return _unknown_job(proc, "squeue")
    state = proc.stdout.strip()
    return state or None
