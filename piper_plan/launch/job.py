"""Prepare, write and submit one job directory (the I/O around the pure render)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from piper_plan.errors import PiperError
from piper_plan.fileio import atomic_write_text, read_text
from piper_plan.launch import render, submit
from piper_plan.launch.render import JobSpec, LaunchOptions
from piper_plan.planfile import PlanFile, read_plan_file


@dataclass(frozen=True)
class PreparedJob:
    """A rendered job, not yet written."""

    out_dir: Path
    plan_text: str
    job: JobSpec
    script: str
    readme: str

    @property
    def script_path(self) -> Path:
        return self.out_dir / "job.sbatch"


def check_runnable(plan_file: PlanFile, path: Path) -> None:
    """Refuse a plan outside the runtime's capability list, naming each unsupported feature."""
    from piper_plan.capability import unsupported_features

    problems = unsupported_features(plan_file.parallel, plan_file.model)
    if problems:
        raise PiperError(f"the runtime cannot run this plan: {'; '.join(problems)} "
                         f"(re-plan with `piper plan --runnable`)", path=str(path))


def prepare(plan_path: Path, out_dir: Path, options: LaunchOptions, python: str,
            command: tuple[str, ...] | None = None) -> PreparedJob:
    """Read and check the plan, render the script; nothing is written."""
    plan_file = read_plan_file(plan_path)
    check_runnable(plan_file, plan_path)
    out_dir = out_dir.expanduser().absolute()
    job = render.job_spec(plan_file, plan_path=str(out_dir / "plan.json"), out_dir=str(out_dir),
                          python=python, options=options, command=command, source=str(plan_path))
    script = render.render_sbatch(job, render.load_template(job.template, options.template_dir))
    return PreparedJob(out_dir=out_dir, plan_text=read_text(plan_path), job=job,
                       script=script, readme=readme_text(job, plan_file))


def check_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise PiperError("--out exists and is not a directory", path=str(out_dir))
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise PiperError("--out is not empty; pass --force to overwrite job.sbatch, plan.json and README.md there",
                         path=str(out_dir))


def write_job(prepared: PreparedJob) -> None:
    """Write plan.json, job.sbatch (executable) and README.md, each atomically."""
    out = prepared.out_dir
    atomic_write_text(out / "plan.json", prepared.plan_text)
    atomic_write_text(prepared.script_path, prepared.script).chmod(0o755)
    atomic_write_text(out / "README.md", prepared.readme)


def submit_job(prepared: PreparedJob) -> str:
    return submit.submit(prepared.script_path)


BLOCKING_REASONS = ("PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints",
                    "ReqNodeNotAvail", "InvalidAccount", "InvalidQOS", "AssocMaxNodesPerJobLimit")
"""squeue reasons that mean the job, as submitted, will not start without someone changing something."""


def pending_reason(job_id: str) -> str | None:
    """Slurm's reason when a just-submitted job is held for a reason in BLOCKING_REASONS, else None."""
    info = submit.job_info(job_id) or {}
    reason = info.get("Reason", "")
    return reason if info.get("JobState") == "PENDING" and reason.startswith(BLOCKING_REASONS) else None


def _prediction_lines(plan_file: PlanFile) -> list[str]:
    pred = plan_file.prediction
    keys = ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu")
    lines = [f"- {k}: {pred[k]:.4g}" for k in keys if isinstance(pred.get(k), (int, float))]
    memory = pred.get("memory")
    peak = memory.get("peak_bytes") if isinstance(memory, dict) else None
    if isinstance(peak, (int, float)):
        lines.append(f"- peak memory per rank: {peak / 2**30:.2f} GiB")
    return lines or ["- (the plan carries no prediction)"]


def readme_text(job: JobSpec, plan_file: PlanFile) -> str:
    return "\n".join([
        f"# piper job `{job.job_name}`", "",
        f"Platform `{job.platform}`: {job.nodes} nodes x {job.ranks_per_node} ranks = {job.world} ranks, "
        f"{job.steps} steps, wall time {job.time}.", "",
        f"Plan: {job.plan_summary}", "",
        "Predicted (from plan.json):", *_prediction_lines(plan_file), "",
        "Submit and follow:", "```",
        f"sbatch {job.out_dir}/job.sbatch", "piper status JOB_ID", f"piper compare {job.run_dir}", "```", "",
        f"The runtime writes `{job.run_dir}/metrics.jsonl` and its checkpoints there. Near the time limit Slurm sends",
        f"USR1 ({render.SIGNAL_LEAD_S} s ahead); the runtime checkpoints and exits {render.REQUEUE_EXIT_CODE}, the "
        "script requeues the job, and the restarted job resumes (`--resume`).", "",
    ])
