"""Render an sbatch script from a plan and its platform: a PURE function of (JobSpec, template text).

``job_spec`` derives every count from the plan (nodes, ranks per node, world, steps) and validates every value;
``render_sbatch`` fills a reviewed template (``platforms/templates/<platform.launch.template>``) whose
placeholders are ``{{name}}``. Bash's own ``$VAR`` syntax passes through untouched. A template that names an
unknown placeholder is an error (so a template and this code cannot drift).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from piper_plan.errors import EXIT_REQUEUE, PiperError
from piper_plan.launch import validate as v

REQUEUE_EXIT_CODE = EXIT_REQUEUE
"""The runtime exits with this (errors.EXIT_REQUEUE) after checkpointing on SIGUSR1/SIGTERM."""
SIGNAL_LEAD_S = 180
"""Seconds before the time limit at which Slurm sends USR1 (``--signal=B:USR1@180``): time to write a checkpoint."""
MASTER_PORT_BASE = 29500
"""torch.distributed's default port; the job adds SLURM_JOB_ID % 1000 so jobs sharing a node differ."""
SWITCH_WAIT = "00:30:00"
"""How long Slurm may hold the job for a compact (fewest-switch) allocation before taking any (``--switches=N@T``)."""
STARTUP_S = 600.0
"""Wall-time allowance for module loads, imports and rendezvous when --time is not given (an assumption)."""
TIME_MARGIN = 2.0
"""Predicted training time is multiplied by this for the default --time (predictions are estimates)."""

PLACEHOLDER_RE = re.compile(r"\{\{([a-z_]+)\}\}")
SBATCH_ONLY = ("out_dir",)
"""Placeholders written as sbatch reads a word (validate.sbatch_word: double quotes, in which bash would expand
'$'), not shell-quoted: a template may use them on #SBATCH lines only (the body has {{run_dir}}, {{plan_file}})."""
PYTHON_SOURCE = "the Python running piper, which the job's command runs"


@dataclass(frozen=True)
class LaunchOptions:
    """What the user may set on the command line; None = derive from the plan / platform."""

    steps: int | None = None
    account: str | None = None
    partition: str | None = None
    time: str | None = None
    job_name: str | None = None
    template_dir: str | None = None
    """The folder of a platform file the user named on the command line: its template may sit there. A plan.json
    alone never chooses a folder (its template is a name from platforms/templates/)."""
    out_dir_source: str | None = None
    """Where the job directory came from when the user did not give it (--dry-run's default): errors name that, not
    --out-dir."""


@dataclass(frozen=True)
class JobSpec:
    """Every validated value a template may need. Counts come from the plan."""

    platform: str
    template: str
    job_name: str
    nodes: int
    ranks_per_node: int
    world: int
    cpus_per_task: int
    gpus_per_task: int
    steps: int
    time: str
    partition: str | None
    account: str | None
    switches: int | None
    out_dir: str
    run_dir: str
    plan_file: str
    python: str
    plan_summary: str
    platform_description: str = ""
    """The plan's platform as its spec describes it (name: description), one line: a shared template's header."""
    modules: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    srun_extra: tuple[str, ...] = ()
    sbatch_extra: tuple[str, ...] = ()
    command: tuple[str, ...] = field(default=())
    segment: int | None = None
    """Nodes per ``--segment`` (Slurm topology/block): set where the platform places jobs in rack-aligned segments
    (network.segment_nodes), as the planner's layout assumes."""
    segment_warning: str | None = None
    """Set where ``segment`` is smaller than the platform's segments (a job that is not a multiple of them): the
    placement Slurm gives differs from the one the plan was priced on (segment_size)."""


def expert_groups_span_nodes(plan, devices_per_node: int) -> bool:
    """True when some expert-parallel group (ep x etp consecutive ranks of a stage's dp x cp x tp block, DESIGN.md
    rank order) holds ranks of more than one node."""
    group = plan.ep * plan.etp
    block = plan.dp * plan.cp * plan.tp
    for stage in range(plan.pp):
        for start in range(stage * block, (stage + 1) * block, group):
            if start // devices_per_node != (start + group - 1) // devices_per_node:
                return True
    return False


def switches_needed(nodes: int, nodes_per_switch: int) -> int:
    """Fewest leaf switches that can hold ``nodes`` nodes."""
    return math.ceil(nodes / nodes_per_switch)


def segment_size(nodes: int, segment_nodes: int) -> int:
    """``--segment`` for a job of ``nodes`` on a platform placing jobs in segments of ``segment_nodes``: the whole job
    when it fits one segment, else the largest segment that divides the job (slurm.schedmd.com/topology.html, User
    Options: a node count larger than the segment must be evenly divisible by it). Below ``segment_nodes`` for a job
    that is not a multiple of it: its segments are smaller than the planner's layout assumed."""
    return nodes if nodes <= segment_nodes else math.gcd(nodes, segment_nodes)


def segment_warning(nodes: int, segment_nodes: int | None) -> str | None:
    """What a job loses when its ``--segment`` is below the platform's: the planner priced ``segment_nodes`` nodes
    per NVLink domain (placement/layout.py), Slurm then only keeps ``segment_size`` nodes together."""
    if not segment_nodes or nodes <= segment_nodes or nodes % segment_nodes == 0:
        return None
    size = segment_size(nodes, segment_nodes)
    below, above = nodes // segment_nodes * segment_nodes, -(-nodes // segment_nodes) * segment_nodes
    return (f"{nodes} nodes is not a multiple of the platform's {segment_nodes}-node segment: Slurm keeps only "
            f"{size} nodes together (--segment={size}), fewer than the plan was priced with; {below} or {above} "
            "nodes keep whole segments")


def default_time(steps: int, step_time_s: float | None) -> str:
    """Wall time for ``steps`` predicted steps: TIME_MARGIN x steps x step time + STARTUP_S + SIGNAL_LEAD_S,
    rounded up to whole minutes, at least 10 minutes; more than 365 days is refused (validate.MAX_WALL_S)."""
    if step_time_s is not None and (isinstance(step_time_s, bool) or not isinstance(step_time_s, (int, float))
                                    or not 0 <= step_time_s < math.inf):
        raise PiperError(f"prediction.step_time_s={step_time_s!r} is not a finite number >= 0; give --time",
                         field="prediction.step_time_s")
    train_s = TIME_MARGIN * steps * (step_time_s or 0.0)
    if train_s > v.MAX_WALL_S:
        raise PiperError(f"{steps:,} steps x {step_time_s:.3g} s predicted = {train_s / 86400:,.0f} days, beyond "
                         "365 days; lower --steps (or give --time)", field="steps")
    minutes = max(10, math.ceil((train_s + STARTUP_S + SIGNAL_LEAD_S) / 60))
    return v.format_wall_time(minutes * 60)


def _given(value, default):
    """The option when the user gave one (an empty string is given, and refused by validation)."""
    return default if value is None else value


def _optional_name(value: str | None, field: str) -> str | None:
    return None if value is None else v.slurm_name(value, field)


def plan_summary(plan_file) -> str:
    p, t = plan_file.parallel, plan_file.training
    virtual = f" virtual_stages={p.virtual_stages}" if p.virtual_stages > 1 else ""
    replicas = f" dp_replicate={p.dp_replicate}" if p.dp_replicate > 1 else ""          # HSDP
    return (f"model={plan_file.model.name} platform={plan_file.platform.name} nodes={plan_file.nodes} "
            f"pp={p.pp} dp={p.dp} cp={p.cp} tp={p.tp} ep={p.ep} etp={p.etp} edp={p.edp} mbs={p.mbs} "
            f"num_microbatches={p.num_microbatches} schedule={p.schedule}{virtual} zero={p.zero}{replicas} "
            f"recompute={p.recompute} a2a={p.a2a} dtype={t.dtype}")


def job_spec(plan_file, *, plan_path: str, out_dir: str, python: str, options: LaunchOptions,
             command: tuple[str, ...] | None = None, source: str | None = None) -> JobSpec:
    """Derive and validate everything a template needs from a plan file (``planfile.PlanFile``).

    ``plan_path`` is where the job will read the plan; ``source`` (default: plan_path) is the file the user
    gave, named in errors."""
    platform, plan, nodes = plan_file.platform, plan_file.parallel, v.positive_int(plan_file.nodes, "nodes")
    dpn = platform.devices_per_node
    if plan.world != nodes * dpn:
        raise PiperError(f"parallel: pp x dp x cp x tp = {plan.world} ranks, but nodes x devices_per_node = "
                         f"{nodes} x {dpn} = {nodes * dpn}; the plan must fill its nodes", path=source or plan_path)
    launch = platform.launch
    steps = v.positive_int(_given(options.steps, plan_file.runtime.steps), "steps")
    out_dir = v.sbatch_path(out_dir, "--out-dir", options.out_dir_source)      # #SBATCH --chdir, --output
    plan_path = v.body_path(plan_path, "plan_path", "where the job reads its plan")
    run_dir = f"{out_dir}/run"
    python = v.body_path(python, "python", PYTHON_SOURCE)         # only in the command, shell-quoted
    settings = launch_settings(launch, source or plan_path)
    span = nodes > 1 and platform.network.nodes_per_switch > 1 and expert_groups_span_nodes(plan, dpn)
    segment_nodes = platform.network.segment_nodes
    return JobSpec(
        platform=platform.name, template=launch.template,
        job_name=v.job_name(_given(options.job_name, v.default_job_name(plan_file.model.name, nodes))),
        nodes=nodes, ranks_per_node=dpn, world=plan.world,
        cpus_per_task=launch.cpus_per_task, gpus_per_task=launch.gpus_per_task, steps=steps,
        time=v.wall_time(options.time) if options.time is not None
        else default_time(steps, plan_file.prediction.step_time_s if plan_file.prediction else None),
        partition=_optional_name(options.partition, "partition") if options.partition is not None
        else settings["partition"],
        account=_optional_name(options.account, "account"),
        switches=switches_needed(nodes, platform.network.nodes_per_switch) if span and not segment_nodes else None,
        segment=segment_size(nodes, segment_nodes) if segment_nodes and nodes > 1 else None,
        segment_warning=segment_warning(nodes, segment_nodes),
        out_dir=out_dir, run_dir=run_dir, plan_file=plan_path, python=python,
        plan_summary=plan_summary(plan_file),
        platform_description=" ".join(f"{platform.name}: {platform.description}".split()),
        modules=settings["modules"], env=settings["env"], srun_extra=settings["srun_extra"],
        sbatch_extra=settings["sbatch_extra"],
        command=command or (python, "-m", "piper_plan.runtime.train", "--plan", plan_path,
                            "--steps", str(steps), "--out", run_dir),
    )


def launch_settings(launch, source: str) -> dict:
    """The plan's ``platform.launch`` block, validated (checked_launch_block); a bad value is one line naming the
    plan file ``source`` and its field there (``platform.launch.env.NAME``)."""
    from piper_plan.planfile import in_plan_file

    try:
        return checked_launch_block(launch)
    except PiperError as exc:
        raise in_plan_file(exc, source) from None


def checked_launch_block(launch) -> dict:
    """A platform's ``launch`` block, validated (launch/validate.py launch_block; a platform file's is checked when
    it is read too)."""
    return v.launch_block(launch)


def _optional_sbatch(job: JobSpec) -> str:
    lines = []
    if job.partition:
        lines.append(f"--partition={job.partition}")
    if job.account:
        lines.append(f"--account={job.account}")
    if job.switches:
        lines.append(f"--switches={job.switches}@{SWITCH_WAIT}")
    if job.segment:
        lines.append(f"--segment={job.segment}")
    lines.extend(job.sbatch_extra)
    return "\n".join(f"#SBATCH {line}" for line in lines)


def template_values(job: JobSpec) -> dict[str, str]:
    """Placeholder -> text. Values in ``#SBATCH`` lines are validated tokens, the job directory an sbatch word
    (SBATCH_ONLY); body values are shell-quoted."""
    q = v.shell_quote
    return {
        "job_name": job.job_name, "nodes": str(job.nodes), "ranks_per_node": str(job.ranks_per_node),
        "world": str(job.world), "cpus_per_task": str(job.cpus_per_task), "gpus_per_task": str(job.gpus_per_task),
        "gpu_sbatch": "", "time": job.time, "out_dir": v.sbatch_word(job.out_dir), "signal_lead_s": str(SIGNAL_LEAD_S),
        "optional_sbatch": _optional_sbatch(job),
        "module_lines": "\n".join(f"module load {q(m)}" for m in job.modules),
        "env_lines": "\n".join(f'export {k}="{val}"' for k, val in job.env),
        "master_port_base": str(MASTER_PORT_BASE), "run_dir": q(job.run_dir), "plan_file": q(job.plan_file),
        "plan_summary": job.plan_summary, "platform_description": job.platform_description,
        "srun_extra": " ".join(q(o) for o in job.srun_extra),
        "command": " ".join(q(a) for a in job.command), "requeue_exit_code": str(REQUEUE_EXIT_CODE),
        "steps": str(job.steps), "python": q(job.python),
    }


def fill_template(template: str, values: dict[str, str]) -> str:
    """Replace every ``{{name}}``; an unknown name is an error."""
    unknown = sorted(set(PLACEHOLDER_RE.findall(template)) - set(values))
    if unknown:
        raise PiperError(f"template names unknown placeholders {unknown}; known: {sorted(values)}")
    return PLACEHOLDER_RE.sub(lambda m: values[m.group(1)], template)


def render_sbatch(job: JobSpec, template: str) -> str:
    """The sbatch script text for ``job`` (pure)."""
    return fill_template(template, template_values(job))


def template_path(template: str, template_dir: str | None = None) -> Path:
    """The template file: <template_dir>/<name> (a platform file's folder given on the command line) if it exists,
    else platforms/templates/<name>. ``template`` must be a bare name (PlatformSpec checks it; checked again here)."""
    from piper_plan.catalog import platforms_dir
    from piper_plan.specs.platform import TEMPLATE_NAME_RE

    if not TEMPLATE_NAME_RE.fullmatch(template):
        raise PiperError(f"launch.template={template!r} is not a template name (a file name ending in .sbatch, "
                         "no folders)", field="launch.template")
    folders = ([Path(template_dir)] if template_dir else []) + [platforms_dir() / "templates"]
    return next((f / template for f in folders if (f / template).is_file()), folders[-1] / template)


def load_template(template: str, template_dir: str | None = None) -> str:
    """The template file's text (I/O; kept apart from the pure render)."""
    from piper_plan.fileio import read_text

    path = template_path(template, template_dir)
    if not path.is_file():
        raise PiperError(f"launch.template={template!r}: no such file {path}", field="launch.template")
    text = read_text(path)
    check_sbatch_only(text, path)
    return text


def check_sbatch_only(template: str, path: Path) -> None:
    """Refuse a template that writes a SBATCH_ONLY placeholder into a line bash runs."""
    for number, line in enumerate(template.splitlines(), 1):
        misplaced = sorted(set(PLACEHOLDER_RE.findall(line)) & set(SBATCH_ONLY))
        if misplaced and not line.startswith("#SBATCH"):
            raise PiperError(f"line {number} uses {{{{{misplaced[0]}}}}} outside an #SBATCH line; it is written for "
                             "sbatch, not shell-quoted: use {{run_dir}} or {{plan_file}} in the script's body",
                             path=str(path), field="launch.template")
