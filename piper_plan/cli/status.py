"""`piper status JOB`: the job's Slurm state and what its run directory holds (last step, checkpoint)."""

from __future__ import annotations

from pathlib import Path

import click

from piper_plan.cli.common import console, exit_codes, json_option, print_json
from piper_plan.errors import PiperError


JOB_DIR_MARKS = ("job.sbatch", "plan.json")
"""What `piper launch` writes into a job directory (one of them marks it as a piper job's)."""


def run_dir_of(base: Path) -> Path:
    """The run directory a --dir names: a job directory's run/, or a run directory itself (`piper run --out-dir`
    writes metrics.jsonl there; a job directory holds it under run/)."""
    if not (base / "job.sbatch").is_file() and (base / "metrics.jsonl").is_file():
        return base
    return base / "run"


def run_dir_summary(run_dir: Path) -> dict:
    """Last metrics line, step count and latest checkpoint of a run directory."""
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
    return out


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
@click.argument("job_id")
@click.option("--dir", "job_dir", type=click.Path(exists=True, file_okay=False),
              help="Job directory (`piper launch --out-dir`; default: the job's WorkDir), or a run directory.")
@json_option(help="Machine output on stdout.")
def status_cmd(job_id: str, job_dir: str | None, as_json: bool) -> None:
    """Slurm state (squeue / scontrol) and the run directory of a piper job."""
    from piper_plan.launch import submit

    info = submit.job_info(job_id)
    state = submit.squeue_state(job_id) or (info or {}).get("JobState")
    if info is None and job_dir is None:
        raise PiperError(f"job {job_id}: Slurm does not know it (finished long ago?); pass --dir JOB_DIR")
    base = Path(job_dir) if job_dir else Path(info.get("WorkDir", "."))
    if job_dir and not any((base / name).is_file() for name in (*JOB_DIR_MARKS, "metrics.jsonl")):
        raise PiperError(f"{job_dir!r} is not a piper job directory: it holds none of {', '.join(JOB_DIR_MARKS)} "
                         "(`piper launch --out-dir` writes them) nor a run's metrics.jsonl", field="--dir")
    result = {"job_id": job_id, "state": state, "reason": (info or {}).get("Reason"),
              "nodes": (info or {}).get("NodeList"), "restarts": (info or {}).get("Restarts"),
              "run": run_dir_summary(run_dir_of(base))}
    if as_json:
        print_json(result)
        return
    c, run = console(), result["run"]
    if info is None and state is None:
        c.print(f"job {job_id}: not known to Slurm (finished long ago?)", markup=False)
    else:
        c.print(f"job {job_id}: {state} (reason {result['reason']}, nodes {result['nodes']}, "
                f"restarts {result['restarts']})", markup=False)
    c.print(f"run {run['run_dir']}: {run['steps_logged']} steps logged, last {run['last']}, "
            f"checkpoint {run['checkpoint']}", markup=False)
