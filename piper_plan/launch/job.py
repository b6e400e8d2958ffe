"""Prepare, write and submit one job directory (the I/O around the pure render)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from piper_plan.errors import PiperError
from piper_plan.fileio import atomic_write_text, check_writable, read_text
from piper_plan.launch import render, submit
from piper_plan.launch.render import JobSpec, LaunchOptions
from piper_plan.planfile import PlanFile, does_not_fit, in_plan_file, priced_from_calibration, read_plan_file


@dataclass(frozen=True)
class PreparedJob:
    """A rendered job, not yet written."""

    out_dir: Path
    plan_text: str
    job: JobSpec
    script: str
    readme: str
    repriced_note: str | None = None
    """Where the file's stored prediction is not what its plan costs now: what changed (the CLI notes it)."""

    @property
    def script_path(self) -> Path:
        return self.out_dir / "job.sbatch"


def check_runnable(plan_file: PlanFile, path: Path) -> None:
    """Refuse a plan the runtime cannot run (invalid, outside its capability list, or with cost options that
    change the training the runtime does not do: each problem named), a plan whose own prediction says it does not
    fit, and one priced for another engine's kernels that does not fit as piper's runtime runs it: every reason
    that holds, in one line."""
    from piper_plan.capability import options_problems, runnable_problems
    from piper_plan.cost.options import cost_options

    pf = plan_file
    problems = runnable_problems(pf.model, pf.platform, pf.training, pf.nodes, pf.parallel)
    if pf.prediction is not None:
        problems = problems + options_problems(cost_options(dict(pf.prediction.options)), pf.parallel,
                                               pf.model, pf.training)
    overflow = does_not_fit(pf.prediction)
    runtime_overflow = None if overflow else does_not_fit(
        _as_the_runtime_runs_it(pf), "priced as piper's runtime runs it (its unfused kernels, as `estimate "
        "--piper-runtime` prices it), the plan")
    reasons = ([f"the runtime cannot run this plan: {'; '.join(problems)}"] if problems else []) + \
        [why for why in (overflow, runtime_overflow) if why]
    if not reasons:
        return
    replan = "piper plan" if overflow and not problems else "piper plan --runnable"
    raise PiperError(f"{'; and '.join(reasons)} (re-plan with `{replan}`)", path=str(path),
                     field=None if problems else "prediction.fits")


def runtime_refusal(plan_file: PlanFile) -> str | None:
    """Why `piper launch` and `piper run` would refuse this plan (check_runnable's line, without a file name), or
    None where they run it: what `piper estimate` says beside its figures."""
    try:
        check_runnable(plan_file, Path("plan.json"))
    except PiperError as exc:
        return exc.message
    return None


def _as_the_runtime_runs_it(pf: PlanFile):
    """The plan priced with piper's runtime's kernels (cost/options.PIPER_RUNTIME_OPTIONS, with the file's runtime
    block and migration share) where its prediction assumed another engine's; None where it already is, or is not
    priced."""
    from piper_plan.cost.options import as_the_runtime_runs, cost_options

    stored = pf.prediction
    if stored is None:
        return None
    options = cost_options(dict(stored.options))
    if options.unfused_kernels:
        return None
    return _priced(pf, as_the_runtime_runs(options, pf.runtime.loss_chunk_rows, pf.runtime.shared_expert_overlap))


def for_the_runtime(plan_file: PlanFile) -> tuple[PlanFile, str | None]:
    """``plan_file`` with its prediction as piper's runtime runs the plan (its unfused kernels) where the file's
    assumed another engine's, and a note that says so; the file as it is where its prediction already is (or it has
    none). What a job of piper's runtime is sized by (`piper launch`) and a run of it is measured against
    (`piper compare`)."""
    fresh = _as_the_runtime_runs_it(plan_file)
    if fresh is None:
        return plan_file, None
    note = (f"priced as piper's runtime runs the plan (its unfused kernels, as `estimate --piper-runtime` prices "
            f"it): {_figures(fresh)}, against the file's {_figures(plan_file.prediction)} (another engine's fused "
            "kernels)")
    return plan_file.model_copy(update={"prediction": fresh}), note


def saved_calibration(pf: PlanFile):
    """calibration/<platform>/ where the file's prediction was priced from a calibration (a file without a
    prediction: where the folder holds one, as `piper estimate` prices by default), else None."""
    from piper_plan.calibration.curves import load_calibration

    return load_calibration(pf.platform.name) if pf.prediction is None or priced_from_calibration(pf) else None


def _priced(pf: PlanFile, options):
    """The plan file's plan priced with ``options`` (calibration where its prediction used one)."""
    from piper_plan.cost.evaluate import estimate

    return estimate(pf.model, pf.platform, pf.training, pf.nodes, pf.parallel, calibration=saved_calibration(pf),
                    placement=pf.placement, options=options)


def checked_as_priced_now(stored: PlanFile, plan_path: Path) -> tuple[PlanFile, bool]:
    """``stored`` priced again (repriced) and checked (check_runnable): what `piper launch` and `piper run` both
    refuse, in the same line; returns the repriced plan file and whether its figures changed."""
    try:
        plan_file, changed = repriced(stored)
    except PiperError as exc:        # a check of the plan's platform or options, which knows no file
        raise in_plan_file(exc, plan_path) from None
    try:
        check_runnable(plan_file, plan_path)
    except PiperError as exc:         # one line: why, and that the file's own figures said otherwise
        if stored.prediction is None:       # priced now: the verdict is not the file's field
            raise PiperError(exc.message, path=exc.path) from None
        if not changed:
            raise
        raise PiperError(f"{exc.message} ({stale_note(stored.prediction, plan_file.prediction)})", path=exc.path,
                         field=exc.field) from None
    return plan_file, changed


def repriced(plan_file: PlanFile) -> tuple[PlanFile, bool]:
    """``plan_file`` with its prediction priced again from what the file holds (model, platform, training, plan,
    placement, the stored cost options and calibration use), and whether its step time or peak memory changed by
    more than REPRICE_TOLERANCE: a hand-edited file, or one saved by another piper, is sized
    by what its plan costs now, not by the figures written beside it. A file without a prediction is priced with
    the default cost options (and is not "changed"): before, launch and run checked no memory of it at all."""
    from piper_plan.cost.options import cost_options

    pf, stored = plan_file, plan_file.prediction
    if stored is None:      # a file written before its plan was priced: priced now, as `piper estimate` does by
        return pf.model_copy(update={"prediction": _priced(pf, cost_options({}))}), False      # default
    fresh = _priced(pf, cost_options(dict(stored.options)))
    return pf.model_copy(update={"prediction": fresh}), figures_differ(stored, fresh)


REPRICE_TOLERANCE = 0.005
"""Relative difference in step time or peak memory below which a stored prediction counts as the one priced now: the
same switch-base plan, with the same calibration, priced at 0.607 s on the H200 machine that saved it (numpy 2.5.2)
and at 0.6079 s on this machine (numpy 2.4.6): the note called that file edited. A hand edit that matters moves a figure by
more."""


VERDICTS = ("fits", "placement", "scopes")
"""What a prediction says besides its figures, compared as they are (scopes on the groups both name): a hand edit of
any is noted as the figures' are."""


def figures_differ(stored, fresh) -> bool:
    pairs = ((stored.step_time_s, fresh.step_time_s), (stored.memory.peak_bytes, fresh.memory.peak_bytes))
    beyond = any(abs(a - b) > REPRICE_TOLERANCE * max(abs(a), abs(b)) for a, b in pairs)
    moved = beyond and _figures(stored) != _figures(fresh)        # never a note that prints the same figures twice
    return moved or bool(_verdicts_differ(stored, fresh))


def _verdicts_differ(stored, fresh) -> list[str]:
    return [name for name in VERDICTS if _differs(getattr(stored, name), getattr(fresh, name))]


def _differs(stored, fresh) -> bool:
    """A verdict edited: scopes compared on the groups both name (a file saved before a group was named, cp before
    2026-12-01, is not edited for lacking it)."""
    if isinstance(stored, dict) and isinstance(fresh, dict):
        return any(stored[k] != fresh[k] for k in stored.keys() & fresh.keys())
    return stored != fresh


def _figures(prediction, also: list[str] | tuple = ()) -> str:
    """Step time and peak memory as the launch note prints them, and the VERDICTS named in ``also``."""
    def shown(value) -> str:
        return " ".join(f"{k} {v}" for k, v in value.items()) if isinstance(value, dict) else str(value)

    figures = [f"step {prediction.step_time_s:.4g} s", f"peak {prediction.memory.peak_bytes / 2**30:.2f} GiB"]
    return ", ".join(figures + [f"{name} {shown(getattr(prediction, name))}" for name in also])


def stale_note(stored, fresh) -> str:
    """Why a saved prediction differs from the plan priced now: the rates it is priced from changed (a calibration
    measured since: its sources say so), else the file itself (edited, or saved by another piper)."""
    moved = [f"{name}: {getattr(fresh.sources, name)}" for name in ("compute", "host")
             if getattr(stored.sources, name) != getattr(fresh.sources, name)]
    why = (f"the rates it is priced from changed since it was saved (now {'; '.join(moved)})" if moved
           else "the file was edited or saved by another piper")
    also = _verdicts_differ(stored, fresh)
    return (f"its stored prediction ({_figures(stored, also)}) is not what its plan costs now "
            f"({_figures(fresh, also)}): {why}")


def prepare(plan_path: Path, out_dir: Path, options: LaunchOptions, python: str,
            command: tuple[str, ...] | None = None) -> PreparedJob:
    """Read the plan, price it again (repriced), check it, render the script; nothing is written."""
    stored = read_plan_file(plan_path)
    plan_file, changed = checked_as_priced_now(stored, plan_path)
    repriced_note = f"{plan_path}: {stale_note(stored.prediction, plan_file.prediction)}; the job is sized and " \
        "checked by the new figures" if changed else None
    sized = plan_file
    if command is None:                 # piper's runtime: the job is sized by its own pricing
        sized, runtime_note = for_the_runtime(plan_file)
        if runtime_note and figures_differ(plan_file.prediction, sized.prediction):
            repriced_note = "; ".join(filter(None, (repriced_note, f"{plan_path}: the job runs piper's runtime, "
                                                    f"{runtime_note}; the job is sized by these figures (`piper "
                                                    "compare` measures it by them)")))
    out_dir = out_dir.expanduser().absolute()
    job = render.job_spec(sized, plan_path=str(out_dir / "plan.json"), out_dir=str(out_dir),
                          python=python, options=options, command=command, source=str(plan_path))
    script = render.render_sbatch(job, render.load_template(job.template, options.template_dir))
    others = None if sized is plan_file else _figures(plan_file.prediction)     # what the job's plan.json holds
    return PreparedJob(out_dir=out_dir, plan_text=job_plan_text(plan_path, plan_file), job=job, script=script,
                       readme=readme_text(job, sized, others), repriced_note=repriced_note)


def job_plan_text(plan_path: Path, plan_file: PlanFile) -> str:
    """The job's plan.json: the file as given, its prediction replaced by the one piper computes now (``repriced``;
    ``piper compare`` reads it as the prediction) where the two differ in any figure."""
    import json

    text = read_text(plan_path)
    data = json.loads(text)
    fresh = None if plan_file.prediction is None else plan_file.prediction.to_json()
    if fresh is None or data.get("prediction") == fresh:
        return text
    data["prediction"] = fresh
    return json.dumps(data, indent=2) + "\n"


def check_out_dir(out_dir: Path, force: bool, source: str | None = None) -> None:
    """The job's folder can be made or is empty (or --force); --dry-run checks it as the real launch does.
    ``source``: where the folder came from when the user gave no --out-dir (LaunchOptions.out_dir_source)."""
    from piper_plan.fileio import check_folder_path

    named = "--out-dir" if source is None else f"the job directory ({source})"
    if out_dir.exists() and not out_dir.is_dir():
        raise PiperError(f"{named} exists and is not a directory", path=str(out_dir))
    check_folder_path(out_dir, named)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise PiperError("--out-dir is not empty; pass --force to overwrite job.sbatch, plan.json and README.md there",
                         path=str(out_dir))


def write_job(prepared: PreparedJob) -> None:
    """Write plan.json, job.sbatch (executable) and README.md, each atomically, once all three can be written; a
    write that fails on the way (a full disk) takes back the ones before it: each file as it was (none of them
    behind where there was none), so the folder is not left half a job."""
    out = prepared.out_dir
    files = {out / "plan.json": prepared.plan_text, prepared.script_path: prepared.script,
             out / "README.md": prepared.readme}
    for path in files:
        check_writable(path)
    before = {path: path.read_bytes() if path.is_file() else None for path in files}
    try:
        for path, text in files.items():
            atomic_write_text(path, text)
        prepared.script_path.chmod(0o755)
    except BaseException:
        _restore(before)
        raise


def _restore(before: dict) -> None:
    """Each file as it was (bytes), or gone where it was not; best effort (the disk that failed a write may refuse)."""
    for path, content in before.items():
        try:
            if content is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(content)
        except OSError:
            pass


def submit_job(prepared: PreparedJob) -> str:
    return submit.submit(prepared.script_path)


def check_with_slurm(prepared: PreparedJob) -> None:
    """``sbatch --test-only`` of the written script; Slurm's refusal is one PiperError line."""
    answer = submit.would_accept(prepared.script_path)
    if not answer.ok:
        raise PiperError(f"sbatch --test-only refused the job: {answer.message}", path=str(prepared.script_path))


BLOCKING_REASONS = ("PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints",
                    "ReqNodeNotAvail", "InvalidAccount", "InvalidQOS", "AssocMaxNodesPerJobLimit")
"""squeue reasons that mean the job, as submitted, will not start without someone changing something."""


def pending_reason(job_id: str) -> str | None:
    """Slurm's reason when a just-submitted job is held for a reason in BLOCKING_REASONS, else None (also when
    Slurm does not answer: the job is submitted, and its id must still be reported)."""
    try:
        info = submit.job_info(job_id) or {}
    except PiperError:
        return None
    reason = info.get("Reason", "")
    return reason if info.get("JobState") == "PENDING" and reason.startswith(BLOCKING_REASONS) else None


def _prediction_lines(plan_file: PlanFile) -> list[str]:
    pred = plan_file.prediction
    if pred is None:
        return ["- (the plan carries no prediction)"]
    lines = [f"- {k}: {getattr(pred, k):.4g}" for k in ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu")]
    return lines + [f"- peak memory per rank: {pred.memory.peak_bytes / 2**30:.2f} GiB"]


def readme_text(job: JobSpec, plan_file: PlanFile, file_figures: str | None = None) -> str:
    """The job's README; ``file_figures``: the job's plan.json's own prediction where it assumed another engine's
    kernels (the README's figures are then not the file's)."""
    return "\n".join([
        f"# piper job `{job.job_name}`", "",
        f"Platform `{job.platform}`: {job.nodes} nodes x {job.ranks_per_node} ranks = {job.world} ranks, "
        f"{job.steps} steps, wall time {job.time}.", "",
        f"Plan: {job.plan_summary}", "",
        *([f"Placement: `--segment={job.segment}` (Slurm topology/block): each {job.segment}-node segment of the job "
           "lies inside one NVLink domain"
           + (f". Warning: {job.segment_warning}." if job.segment_warning else ", as the plan was priced."), ""]
          if job.segment else []),
        "Predicted (plan.json's plan, priced as piper's runtime runs it: what `piper compare` measures the run "
        "against):",
        *_prediction_lines(plan_file), "",
        *([f"plan.json's own prediction assumed another engine's fused kernels ({file_figures}); the job is sized "
           "by the figures above.", ""] if file_figures else []),
        "Submit and follow:", "```",
        f"sbatch {shlex.quote(job.out_dir + '/job.sbatch')}", "piper status JOB_ID",
        f"piper compare {shlex.quote(job.run_dir)}", "```", "",
        f"The runtime writes `{job.run_dir}/metrics.jsonl` and its checkpoints there. Near the time limit Slurm sends",
        f"USR1 ({render.SIGNAL_LEAD_S} s ahead); the runtime checkpoints and exits {render.REQUEUE_EXIT_CODE}, the "
        "script requeues the job, and the restarted job resumes (`--resume`).", "",
    ])
