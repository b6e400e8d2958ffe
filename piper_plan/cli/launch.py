"""`piper launch`: write (and with --submit, submit) a Slurm job that runs piper's runtime on a plan."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from piper_plan.cli.common import (AsciiInt, console, diagnostics, exit_codes, json_option, note, out_dir_option,
                                   print_json)
from piper_plan.cli.options import load_setting, training_options
from piper_plan.errors import PiperError
from piper_plan.planfile import MAX_STEPS


DRY_RUN_DIR = "job"
"""The job directory a `--dry-run` without --out-dir names in its script (nothing is written there)."""
DRY_RUN_SOURCE = "--dry-run's default job directory ./job, as no --out-dir was given"
"""How errors name that directory (the user gave no --out-dir)."""


@click.command("launch", epilog=exit_codes())
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), help="plan.json from `piper plan -o` / `estimate -o`.")
@click.option("--model", help="Model name or path (plan from options: runs the search).")
@click.option("--platform", help="Platform name or path (plan from options).")
@click.option("--nodes", type=AsciiInt(), help="Nodes (plan from options).")
@training_options
@click.option("--strategy", type=click.Choice(["general", "piper"]), default="general", show_default=True,
              help="Plan from options: search strategy (see piper plan).")
@click.option("--a2a", type=click.Choice(["flat", "halo", "any"]), default="any", show_default=True,
              help="Plan from options: all-to-all algorithm.")
@click.option("--migration", is_flag=True, help="Plan from options: enable expert migration.")
@out_dir_option("out_dir", "Job directory to write (required but with --dry-run, whose script then names ./job).",
                old=("--out",))
@click.option("--submit", is_flag=True, help="Submit with sbatch and print the job id.")
@click.option("--check", is_flag=True, help="Ask Slurm whether it would accept the job (sbatch --test-only).")
@click.option("--dry-run", is_flag=True,
              help="Print the script on stdout (with --json: the script and the job's facts); write nothing.")
@click.option("--steps", type=AsciiInt(min=1, max=MAX_STEPS),
              help="Training steps (default: the plan's runtime.steps).")
@click.option("--account", help="Slurm account (#SBATCH --account).")
@click.option("--partition", help="Slurm partition (default: the platform's).")
@click.option("--time", "time_", help="Wall time [D-]HH:MM:SS (default: from the predicted step time).")
@click.option("--job-name", help="Slurm job name.")
@click.option("--force", is_flag=True, help="Write into a non-empty --out-dir directory.")
@json_option
def launch_cmd(plan_path, model, platform, nodes, seq_len, global_batch, dtype, fp8_recipe, grad_bytes, strategy, a2a,
               migration, out_dir, submit, check, dry_run, steps, account, partition, time_, job_name, force, as_json):
    """Write DIR/job.sbatch, DIR/plan.json and DIR/README.md for a plan; --submit sends it to Slurm.

    The plan is --plan plan.json, or the best runnable plan `piper plan` finds for --model/--platform/--nodes."""
    import tempfile

    from piper_plan.launch.render import LaunchOptions

    if dry_run and (submit or check):
        raise PiperError("--dry-run prints the script and writes nothing; drop --submit / --check", field="--dry-run")
    out_dir_source = None
    if out_dir is None:
        if not dry_run:
            raise click.UsageError("Missing option '--out-dir' (the job directory to write; only --dry-run, which "
                                   "writes nothing, goes without it).")
        out_dir, out_dir_source = DRY_RUN_DIR, DRY_RUN_SOURCE
    with tempfile.TemporaryDirectory(prefix="piper-launch-") as tmp:
        if _plan_source(plan_path, model, platform, nodes) is None:
            plan_path = str(Path(tmp) / "plan.json")
            _search_plan(plan_path, model, platform, nodes, (seq_len, global_batch, dtype, grad_bytes, fp8_recipe),
                         strategy, a2a, migration)
        template_dir = str(Path(platform).parent) if platform and Path(platform).is_file() else None
        options = LaunchOptions(steps=steps, account=account, partition=partition, time=time_, job_name=job_name,
                                template_dir=template_dir, out_dir_source=out_dir_source)
        _launch(plan_path, out_dir, options, submit, check, dry_run, force, as_json)


def _search_plan(save_path, model, platform, nodes, training_args, strategy, a2a, migration) -> None:
    """The best plan the runtime can run (piper plan's search with runnable=True), saved to ``save_path``.
    ``training_args``: (seq_len, global_batch, dtype, grad_bytes, fp8_recipe) from the shared training options."""
    from piper_plan.catalog import platforms_dir, resolve
    from piper_plan.cli.plan import save_best, search_kwargs, search_options
    from piper_plan.launch.render import checked_launch_block
    from piper_plan.search import engine

    seq_len, global_batch, dtype, grad_bytes, fp8_recipe = training_args
    model_spec, platform_spec, training = load_setting(model, platform, seq_len, global_batch, dtype=dtype,
                                                       grad_bytes=grad_bytes, fp8_recipe=fp8_recipe)
    try:                     # before the search, naming the platform's file (not the temporary plan.json made here)
        checked_launch_block(platform_spec.launch)
    except PiperError as exc:
        where = str(resolve(platform, platforms_dir(), "platform"))
        raise PiperError(exc.message, path=where, field=exc.field) from None
    kwargs = search_kwargs(platform_spec, "compact", runnable=True)
    with diagnostics().status(f"searching the best runnable plan for {model_spec.name}"):
        result = engine.search(model_spec, platform_spec, training, nodes, search_options(strategy, a2a, 0.0),
                               **kwargs)
    if not result.feasible and result.unsupported:     # plans fit, the runtime lacks what each needs
        missing = ", ".join(result.unsupported)
        raise PiperError(f"every plan of {model_spec.name} that fits on {nodes} {platform_spec.name} nodes needs what "
                         f"piper's runtime lacks: {missing} (see `piper plan --runnable`)", field="--model")
    if not result.feasible:
        raise PiperError(f"no plan piper's runtime can run fits {model_spec.name} on {nodes} {platform_spec.name} "
                         "nodes (see `piper plan --runnable`)", field="--nodes")
    _, plan = save_best(save_path, model_spec, platform_spec, training, result, kwargs, migration)
    note(f"plan: the best runnable of {result.feasible:,} that fit: dp={plan.dp} tp={plan.tp} pp={plan.pp} ep={plan.ep}")


def _launch(plan_path, out_dir, options, submit, check, dry_run, force, as_json):
    from piper_plan.launch import job as joblib

    prepared = joblib.prepare(Path(plan_path), Path(out_dir), options, python=sys.executable)
    joblib.check_out_dir(prepared.out_dir, force or dry_run,     # a dry run writes nothing: only the path matters
                         options.out_dir_source)
    if prepared.repriced_note:
        note(prepared.repriced_note)
    if prepared.job.segment_warning:              # every mode: a dry run is where a script checks first
        note(f"warning: {prepared.job.segment_warning}")
    if dry_run:
        if as_json:
            print_json({"script": prepared.script, **_job_facts(prepared)})
        else:
            click.echo(prepared.script, nl=False)
        return
    joblib.write_job(prepared)
    if check:
        joblib.check_with_slurm(prepared)
    job_id = joblib.submit_job(prepared) if submit else None
    _report(prepared, job_id, joblib.pending_reason(job_id) if job_id else None, as_json)


def _plan_source(plan_path, model, platform, nodes) -> str | None:
    """--plan, or None when the plan comes from --model/--platform/--nodes (all three needed)."""
    if plan_path and (model or platform or nodes is not None):
        raise PiperError("give either --plan or --model/--platform/--nodes, not both")
    if plan_path:
        return plan_path
    if model and platform and nodes is not None:
        return None
    raise PiperError("give --plan plan.json (from `piper plan -o plan.json`), or all of --model, --platform and --nodes")


def _job_facts(prepared) -> dict:
    """What the job asks Slurm for (the same keys with and without --dry-run)."""
    job = prepared.job
    return {"nodes": job.nodes, "ranks_per_node": job.ranks_per_node, "world": job.world, "steps": job.steps,
            "time": job.time, "partition": job.partition, "account": job.account, "job_name": job.job_name,
            "platform": job.platform, "run_dir": job.run_dir, "segment": job.segment,
            "segment_warning": job.segment_warning}


def _report(prepared, job_id: str | None, blocked: str | None, as_json: bool) -> None:
    out = str(prepared.out_dir)
    if as_json:
        print_json({"job_id": job_id, "out": out, "blocked_reason": blocked, "script": str(prepared.script_path),
                    **_job_facts(prepared)})
        return
    note(f"wrote {prepared.script_path}, {prepared.out_dir / 'plan.json'}, {prepared.out_dir / 'README.md'}")
    facts = (f"{prepared.job.nodes} nodes x {prepared.job.ranks_per_node} ranks = {prepared.job.world}, "
             f"{prepared.job.steps} steps, time {prepared.job.time}")
    if job_id:                  # stdout is the job id alone, for JOB=$(piper launch --submit ...)
        note(facts)
        note(f"submitted job {job_id}; follow it with: piper status {job_id}")
        if blocked:
            note(f"warning: Slurm holds job {job_id} with Reason={blocked}: it may never start as requested")
        click.echo(job_id)
    else:
        c = console()
        c.print(facts, markup=False)
        c.print(f"submit with: sbatch {shlex.quote(str(prepared.script_path))}", markup=False)
