"""`piper status JOB`: the job's Slurm state and what its run directory holds (last step, checkpoint, summary);
`piper status --dir RUN`: what a directory holds, without Slurm (a local `piper run` has no job id)."""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from piper_plan.cli.common import exit_codes, json_option, print_json
from piper_plan.errors import PiperError
from piper_plan.rundir import LOCK_FILE


JOB_DIR_MARKS = ("job.sbatch", "plan.json")
"""What `piper launch` writes into a job directory (one of them marks it as a piper job's)."""


def run_dir_of(base: Path) -> Path:
    """The run directory a --dir names: a job directory's run/, or a run directory itself (`piper run --out-dir`
    writes metrics.jsonl there, and holds its lock file from its start; a job directory holds it under run/)."""
    if not (base / "job.sbatch").is_file() and any((base / name).is_file() for name in ("metrics.jsonl", LOCK_FILE)):
        return base
    return base / "run"


SUMMARY_KEYS = ("exit_code", "steps", "first_loss", "final_loss", "tokens_per_s", "step_time_s")
"""What status shows of a run's summary.json (the runtime writes it when the run ends)."""


def run_dir_summary(run_dir: Path) -> dict:
    """Last metrics line, step count, latest checkpoint, summary.json and state of a run directory."""
    from piper_plan.rundir import latest_step

    metrics = run_dir / "metrics.jsonl"
    try:
        step = latest_step(run_dir)       # only ASCII digits: a damaged file is never printed raw
        checkpoint = None if step is None else str(step)
    except PiperError as exc:             # the job's state and metrics are still worth showing
        checkpoint = f"damaged ({exc.message})"
    out: dict = {"run_dir": str(run_dir), "steps_logged": 0, "last": None, "checkpoint": checkpoint}
    if metrics.is_file():
        from piper_plan.fileio import read_text

        lines = [ln for ln in read_text(metrics).splitlines() if ln.strip()]
        out["steps_logged"] = len(lines)
        last = _last_record(lines)
        if last is not None:
            out["last"] = {k: last.get(k) for k in ("step", "loss", "step_time_s", "tokens_per_s")}
    out["summary"] = _summary(run_dir / "summary.json")
    out["state"] = _run_state(run_dir, out)
    return out


def _summary(path: Path) -> dict | str | None:
    """SUMMARY_KEYS of a run's summary.json; None where there is none, 'damaged (...)' where it does not read."""
    from piper_plan.fileio import read_document

    if not path.exists():
        return None
    try:
        data = read_document(path)
    except PiperError as exc:
        return f"damaged ({exc.message})"
    return {k: data.get(k) for k in SUMMARY_KEYS}


def _run_state(run_dir: Path, run: dict) -> str:
    """running (a local `piper run` holds the directory), finished / checkpointed / failed (its summary's exit
    code), without a summary yet (steps but no summary: a Slurm job's ranks, which take no lock, still running, or
    a run killed before its end), or not started."""
    from piper_plan.errors import EXIT_REQUEUE
    from piper_plan.rundir import is_held

    summary = run["summary"]
    if run_dir.is_dir() and is_held(run_dir):
        return "running"
    if isinstance(summary, dict):
        code = summary.get("exit_code")
        return "finished" if code == 0 else "checkpointed" if code == EXIT_REQUEUE else f"failed (exit {code})"
    if run["steps_logged"] or run["checkpoint"]:   # a Slurm job's ranks hold no lock: running there, or stopped
        return "without a summary yet (still running under Slurm, or stopped before its end)"
    return "not started"


def _last_record(lines: list[str]) -> dict | None:
    """The last line that parses as a strict JSON object (a run killed mid-write leaves a truncated last line; a line
    with NaN is skipped too, so --json never prints NaN)."""
    from piper_plan.fileio import parse_json

    for line in reversed(lines):
        try:
            record = parse_json(line, "metrics.jsonl")
        except PiperError:
            continue
        if isinstance(record, dict):
            return record
    return None


@click.command("status", epilog=exit_codes())
@click.argument("job_id", required=False)
@click.option("--dir", "job_dir", type=click.Path(exists=True, file_okay=False),
              help="Job directory (`piper launch --out-dir`; default: the job's WorkDir), or a run directory (`piper "
                   "run --out-dir`); without JOB_ID: what it holds, Slurm not asked.")
@json_option(help="Machine output on stdout.")
def status_cmd(job_id: str | None, job_dir: str | None, as_json: bool) -> None:
    """Slurm state (squeue / scontrol) and the run directory of a piper job; `--dir RUN` alone: a local run's
    progress (a `piper run` has no Slurm job id)."""
    if job_id is None:
        if job_dir is None:
            raise click.UsageError("give JOB_ID (a Slurm job), or --dir RUN_DIR for a local `piper run` (it has no "
                                   "job id)")
        _show(None, _checked_dir(job_dir), None, as_json)
        return
    from piper_plan.launch import submit

    info = submit.job_info(job_id)
    state = submit.squeue_state(job_id) or (info or {}).get("JobState")
    if info is None and job_dir is None:
        raise PiperError(f"job {job_id}: Slurm does not know it (finished long ago?); pass --dir JOB_DIR")
    base = _checked_dir(job_dir) if job_dir else Path(info.get("WorkDir", "."))
    _show(job_id, base, {"state": state, **(info or {})} if info is not None or state else None, as_json)


def _checked_dir(job_dir: str) -> Path:
    base = Path(job_dir)
    if not any((base / name).is_file() for name in (*JOB_DIR_MARKS, "metrics.jsonl", LOCK_FILE)):
        raise PiperError(f"{job_dir!r} is not a piper job directory: it holds none of {', '.join(JOB_DIR_MARKS)} "
                         "(`piper launch --out-dir` writes them) nor a run's metrics.jsonl", field="--dir")
    return base


def _show(job_id: str | None, base: Path, info: dict | None, as_json: bool) -> None:
    """Print the job's Slurm state (``info``: scontrol's fields and ``state``; None where Slurm does not know the
    job or was not asked) and the run directory of ``base``."""
    info = info or {}
    result = {"job_id": job_id, "state": info.get("state"), "reason": info.get("Reason"),
              "nodes": info.get("NodeList"), "restarts": info.get("Restarts"), "run": run_dir_summary(run_dir_of(base))}
    if as_json:
        print_json(result)
        return
    run = result["run"]          # plain lines, never wrapped at the terminal's width: a path stays one to copy
    if job_id is None:
        click.echo(_without_job_line(base, run["state"]))
    elif result["state"] is None:
        click.echo(f"job {job_id}: not known to Slurm (finished long ago?)")
    else:
        click.echo(f"job {job_id}: {result['state']} (reason {result['reason']}, nodes {result['nodes']}, "
                   f"restarts {result['restarts']})")
    click.echo(f"run {run['run_dir']}: {run['steps_logged']} steps logged, last {run['last']}, "
               f"checkpoint {run['checkpoint']}")
    if run["summary"] is not None:
        click.echo(f"summary: {_summary_line(run['summary'])}")


def _without_job_line(base: Path, state: str) -> str:
    """What `status --dir` says first without a job id: the directory's kind and its run's state (no Slurm)."""
    if (base / "job.sbatch").is_file():
        return (f"{base}: a `piper launch` job directory, its run {state} (no job id given, Slurm not asked; "
                f"`piper status JOB_ID --dir {shlex.quote(str(base))}` adds the job's Slurm state)")
    return f"{base}: run {state} (a run directory; no Slurm job id, Slurm not asked)"


def _summary_line(summary: dict | str) -> str:
    if isinstance(summary, str):
        return summary
    return ", ".join(f"{k} {_number(summary[k])}" for k in SUMMARY_KEYS if summary.get(k) is not None)


def _number(value) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)
