"""``piper calibrate``: measure a machine, import nccl-tests output, show the curves, write a Slurm sweep job."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import click

from piper_plan.cli.common import (AsciiInt, console, diagnostics, exit_codes, json_option, note, options_given,
                                   out_dir_option, output_option, plot_option, print_json, print_table)
from piper_plan.errors import PiperError
from piper_plan.plots import check_plot_path
from piper_plan.specs.platform import MAX_DEVICES_PER_NODE, MAX_NODES


@click.group("calibrate", invoke_without_command=True, epilog=exit_codes())
@click.option("--platform", "platform_name", default=None, help="Platform catalog name or YAML path (local-cpu, frontier).")
@click.option("--quick", is_flag=True, help="A small sweep (well under 2 minutes on a 2-core machine).")
@click.option("--resume", is_flag=True, help="Skip points already in the CSVs.")
@click.option("--only", default=None, help="Comma list of gemm,attention,collectives,memory (default: all).")
@click.option("--dtype", "dtypes", default=None,
              help="Comma list of the precisions the GEMM and attention sweeps measure (default: every one the "
                   "device's sweep has: on a CPU GEMMs fp32,bf16 and attention fp32; on a GPU bf16, and GEMMs in "
                   "fp8 where the device has 8-bit GEMMs).")
@out_dir_option("out_dir", "Output directory (default calibration/<platform>/).", old=("--out",))
@json_option(help="What the sweep wrote (directory, rows per CSV, skipped points, seconds) as JSON on stdout.")
@click.pass_context
def calibrate_group(ctx: click.Context, platform_name, quick, resume, only, dtypes, out_dir, as_json) -> None:
    """Measure GEMM, attention, collectives and memory-bound kernels on this machine; write
    calibration/<platform>/*.csv. The runtime's own framework overhead, which a small model's step time on a CPU
    is mostly made of, is a sweep of its own: `piper calibrate overhead`."""
    if ctx.invoked_subcommand is not None:
        _check_no_sweep_options(ctx)
        return
    if platform_name is None:
        raise PiperError("--platform is required (for example: piper calibrate --platform local-cpu --quick)")
    from piper_plan.calibration.sweep import SweepOptions, parse_dtypes, parse_only, run_calibration

    opts = SweepOptions(platform=platform_name, out_dir=_out_dir(platform_name, out_dir), quick=quick, resume=resume,
                        only=parse_only(only), dtypes=parse_dtypes(dtypes),
                        command=_command_line(platform_name, quick, resume, only, dtypes, out_dir))
    t0 = time.perf_counter()
    with _RichReporter() as reporter:
        result = run_calibration(opts, reporter)
    for message in [*result.messages, *_planning_warnings(platform_name, opts.out_dir)]:
        note(message)
    seconds = time.perf_counter() - t0
    written = ", ".join(f"{k} {n} rows" for k, n in result.rows_written.items()) or "nothing"
    skipped = ", ".join(f"{k} {n}" for k, n in result.skipped.items() if n)
    note(f"wrote {written} to {opts.out_dir}" + (f" (skipped already measured: {skipped})" if skipped else "")
         + f" in {seconds:.1f} s")
    if as_json:
        print_json({"platform": platform_name, "out_dir": str(opts.out_dir), "dtypes": opts.dtypes,
                    "rows_written": result.rows_written,
                    "skipped": result.skipped, "seconds": seconds, "seconds_by_kind": result.seconds,
                    "messages": result.messages})


def _planning_warnings(platform_name: str, out_dir: Path) -> list[str]:
    """What keeps `plan` / `estimate` from pricing with what was just written, said at once (before: the first
    planning command refused it, or silently used none of it): rows faster than the platform file's peak, and a
    directory those commands do not read."""
    from piper_plan.calibration import load_calibration
    from piper_plan.catalog import calibration_dir, load_platform
    from piper_plan.cost.compute import Rates

    platform = load_platform(platform_name)
    try:
        calibration = load_calibration(out_dir)
    except PiperError:               # a folder a planning command cannot read yet says so there, in its own line
        calibration = None
    warnings = []
    for dtype in calibration.gemm_dtypes() if calibration is not None else ():
        try:
            Rates(platform, dtype, calibration)
        except PiperError as exc:
            warnings.append(f"warning: {exc.message}; until the platform file says so, `piper plan` and `piper "
                            "estimate` refuse this calibration")
    home = calibration_dir(platform.name).resolve()
    if out_dir != home:
        warnings.append(f"note: `piper plan`, `estimate` and `launch` read {home}, not {out_dir}: copy the CSVs "
                        "there to plan with them (`piper calibrate show --platform DIR` reads any directory)")
    return warnings


def _check_no_sweep_options(ctx: click.Context) -> None:
    """The sweep's own options before a subcommand (`piper calibrate --dtype bf16 slurm ...`) were dropped without a
    word: one line naming them and where they go."""
    given = options_given(ctx)
    if given:
        raise PiperError(f"{', '.join(given)} before `{ctx.invoked_subcommand}` is an option of `piper calibrate` "
                         f"itself, which `{ctx.invoked_subcommand}` does not read; give it after "
                         f"`{ctx.invoked_subcommand}` where that takes it (`piper calibrate {ctx.invoked_subcommand} "
                         "--help`)")


def _command_line(platform_name, quick, resume, only, dtypes, out_dir) -> str:
    """The command as a user would retype it (recorded in every row's source and in metadata.json)."""
    args = ["piper", "calibrate", "--platform", platform_name] + ["--quick"] * quick + ["--resume"] * resume
    args += ["--only", only] if only else []
    args += ["--dtype", dtypes] if dtypes else []
    args += ["--out-dir", out_dir] if out_dir else []
    return shlex.join(args)


def _out_dir(platform_name: str, out_dir: str | None) -> Path:
    from piper_plan.catalog import calibration_dir, load_platform

    platform = load_platform(platform_name)           # checked even with --out-dir: a typo is an error, not ignored
    if out_dir:
        return Path(out_dir).resolve()
    return calibration_dir(platform.name).resolve()


class _RichReporter:
    """A rich progress bar (with ETA) per sweep, on stderr."""

    def __enter__(self):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("{task.fields[name]:<11}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                 TextColumn("{task.fields[label]}", markup=False), console=diagnostics())
        self.tasks: dict[str, int] = {}
        self.shown = False
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc) if self.shown else False

    def start(self, task: str, total: int) -> None:
        if not self.shown:        # shown from the first sweep on: an error before it stays one line on stderr
            self.progress.__enter__()
            self.shown = True
        self.tasks[task] = self.progress.add_task(task, total=total, name=task, label="")

    def advance(self, task: str, label: str, done: int | None = None) -> None:
        if done is None:
            self.progress.advance(self.tasks[task])
        else:
            self.progress.update(self.tasks[task], completed=done)
        self.progress.update(self.tasks[task], label=label)

    def say(self, text: str) -> None:
        self.progress.console.print(text, markup=False)


@calibrate_group.command("import-nccl-tests", epilog=exit_codes())
@click.argument("file", type=click.Path())
@click.option("--op", required=True, help="all_to_all, all_reduce, all_gather, reduce_scatter, p2p, halo_all_to_all.")
@click.option("--nodes", "num_nodes", type=AsciiInt(1, MAX_NODES), required=True, help="Nodes the test ran on.")
@click.option("--ranks-per-node", type=AsciiInt(1, MAX_DEVICES_PER_NODE), required=True,
              help="Ranks (GPUs) per node.")
@click.option("--scope", required=True, help="Widest scope the ranks spanned: node, switch, group, system.")
@click.option("--platform", "platform_name", required=True, help="Platform whose calibration to extend.")
@out_dir_option("out_dir", "Directory (default calibration/<platform>/).", old=("--out",))
@json_option(help="Print the imported rows as JSON on stdout.")
def import_nccl_tests_cmd(file, op, num_nodes, ranks_per_node, scope, platform_name, out_dir, as_json) -> None:
    """Parse nccl-tests / rccl-tests output into collectives.csv rows."""
    from piper_plan.calibration.io import merge_rows, read_metadata, recorded_device
    from piper_plan.calibration.nccl_tests import import_file
    from piper_plan.calibration.schema import COLLECTIVES
    from piper_plan.calibration.slurm import check_nodes
    from piper_plan.catalog import load_platform

    directory = _out_dir(platform_name, out_dir)        # the platform first: a typo is named before the log
    platform = load_platform(platform_name)
    check_nodes(platform, num_nodes)                   # rows of a run the platform cannot hold would price nothing
    if ranks_per_node > platform.devices_per_node:
        raise PiperError(f"ranks_per_node={ranks_per_node}; {platform.name} has {platform.devices_per_node} devices "
                         f"per node: allowed 1 to {platform.devices_per_node}", field="--ranks-per-node")
    held = recorded_device(read_metadata(directory) if directory.is_dir() else {}, directory)
    devices = {f"platform {platform.name}'s device": platform.device.name}
    if held.get("kind") != "seed":                      # a seed's device is the platform's, named as its file does
        devices[f"{directory / 'metadata.json'}'s device"] = held.get("name")
    rows = import_file(file, op, scope, num_nodes, ranks_per_node, devices)
    path = merge_rows(directory, COLLECTIVES, rows)
    if as_json:
        print_json(rows)
    note(f"imported {len(rows)} rows ({op}, {scope}, {num_nodes} x {ranks_per_node}) into {path}")


@calibrate_group.command("show", epilog=exit_codes())
@click.option("--platform", "platform_name", required=True,
              help="Platform name, platform file or calibration directory.")
@plot_option("Write a PNG of the curves")
@json_option(help="Print the curve summary as JSON on stdout.")
def show_cmd(platform_name, plot_path, as_json) -> None:
    """The calibration curves as tables: seed vs measured rows, and the ranges beyond which the model extrapolates."""
    from piper_plan.calibration import load_calibration
    from piper_plan.calibration.report import summary, render_tables

    if plot_path:
        check_plot_path(plot_path)
    folder = Path(platform_name).is_dir()
    given = platform_name                                   # what the user typed: the hint's --platform
    if not folder and Path(platform_name).is_file():      # a platform file, as `piper calibrate --platform` takes
        from piper_plan.catalog import load_platform

        platform_name = load_platform(platform_name).name
    cal = load_calibration(Path(platform_name) if folder else platform_name)
    if cal is None:
        hint = (f"measure into it with `piper calibrate --platform P --out-dir {platform_name}`" if folder
                else f"run `piper calibrate --platform {shlex.quote(given)}`")
        raise PiperError(f"no calibration CSVs for {platform_name!r}; {hint}")
    data = summary(cal)
    if as_json:
        print_json(data)
    else:
        render_tables(cal, data, console(), print_table)
    if plot_path:
        from piper_plan.calibration.report import plot_curves

        note(f"wrote {plot_curves(cal, plot_path)}")


@calibrate_group.command("slurm", epilog=exit_codes())
@click.option("--platform", "platform_name", required=True, help="Platform catalog name or YAML path.")
@click.option("--nodes", "num_nodes", type=AsciiInt(1, MAX_NODES), required=True, help="Nodes to sweep over.")
@click.option("--quick", is_flag=True, help="The small sweep.")
@click.option("--only", default=None, help="Comma list of gemm,attention,collectives,memory (default: all; GEMM, "
              "attention and memory run on one device of the first node).")
@click.option("--dtype", "dtypes", default=None,
              help="Comma list of the precisions the GEMM and attention sweeps measure (default: every one the "
                   "device's sweep has).")
@out_dir_option("out_dir", "Directory the job writes its rows into (default calibration/<platform>/).")
@click.option("--account", default=None, help="#SBATCH -A (project account).")
@click.option("--time", "time_limit", default="00:30:00", show_default=True, help="#SBATCH -t.")
@click.option("--python", "python_cmd", default="python3", show_default=True, help="Python with piper installed, on the nodes.")
@output_option("script_path", "Script path (default calibration/<platform>/calibrate-<N>n.sbatch).")
@click.option("--submit", is_flag=True, help="Submit it with sbatch.")
@json_option(help="The script path, its rows' directory and the job id (with --submit) as JSON on stdout.")
def slurm_cmd(platform_name, num_nodes, quick, only, dtypes, out_dir, account, time_limit, python_cmd, script_path,
              submit, as_json) -> None:
    """Write (and submit) the sbatch script that calibrates on N nodes: GEMM and attention on one device, then the
    collective sweep across the N nodes."""
    from piper_plan.calibration.slurm import render_sweep_script, write_script
    from piper_plan.calibration.sweep import parse_dtypes, parse_only
    from piper_plan.catalog import load_platform
    from piper_plan.fileio import check_folder_path

    platform = load_platform(platform_name)
    directory = _out_dir(platform_name, out_dir)
    path = Path(script_path) if script_path else directory / f"calibrate-{num_nodes}n.sbatch"
    text = render_sweep_script(platform, num_nodes, directory, quick=quick, account=account,
                               time_limit=time_limit, python_cmd=python_cmd, only=parse_only(only),
                               platform_ref=_platform_ref(platform_name), dtypes=parse_dtypes(dtypes))
    check_folder_path(directory, "--out-dir")
    directory.mkdir(parents=True, exist_ok=True)          # Slurm opens the job's log there and creates no folder
    write_script(path, text)
    note(f"wrote {path}")
    job_id = _submit(path) if submit else None
    if as_json:
        print_json({"platform": platform.name, "nodes": num_nodes, "script": str(path), "out_dir": str(directory),
                    "job_id": job_id})
    elif job_id:
        console().print(job_id, markup=False)


def _platform_ref(platform_name: str) -> str:
    """How a job names the platform: a catalog name as it is, a platform file by its absolute path."""
    from piper_plan.catalog import platforms_dir, resolve

    path = resolve(platform_name, platforms_dir(), "platform")
    return platform_name if path.parent.resolve() == platforms_dir().resolve() else str(path.resolve())


def _submit(path: Path) -> str:
    """sbatch the script as `piper launch` does (launch/submit.py: the controller asked first, a timeout, Slurm's
    refusal in one line); its job id."""
    from piper_plan.launch.submit import submit

    return submit(path)


@calibrate_group.command("fit", epilog=exit_codes())
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option("--param", "params", multiple=True, help="Parameter to fit (repeatable; default: every one the runs move).")
@click.option("--no-calibration", is_flag=True, help="Predict with the roofline fallback (fit efficiency.gemm/attention).")
@click.option("--dry-run", is_flag=True, help="Show the fit; write nothing.")
@json_option(help="Machine-readable output on stdout.")
def fit_cmd(run_dirs, params, no_calibration, dry_run, as_json) -> None:
    """Fit efficiency/overlap parameters to measured runs (RUN_DIR: plan.json + metrics.jsonl); calibration/<platform>/
    fit.csv records the fit, which estimate and plan do not apply (the output says how to price with it)."""
    from piper_plan.calibration import fit as fitting
    from piper_plan.calibration import load_calibration

    check_distinct_runs(run_dirs)
    repeated = sorted({p for p in params if params.count(p) > 1})
    if repeated:
        raise PiperError(f"{repeated[0]!r} given more than once; name each parameter once", field="--param")
    runs = [fitting.read_run(d) for d in run_dirs]
    fitting.check_one_platform(runs)
    platform = runs[0].plan_file.platform
    calibration = None if no_calibration else load_calibration(platform.name)
    with diagnostics().status(f"fitting to {len(runs)} runs"):
        result = fitting.fit(runs, calibration, list(params) or None, determined=True)
    path = fitting.fit_path(platform.name)
    if not dry_run and result.values:
        fitting.write_fit(path, fitting.fit_rows(result, shlex.join(["piper", "calibrate", "fit", *run_dirs])))
        note(f"wrote {path} (platform {platform.name}, the runs' own)")
    apply = fitting.how_to_apply(result.values, platform.name) if result.values else None
    if as_json:
        print_json({**result.to_dict(), "written": None if dry_run or not result.values else str(path),
                    "how_to_apply": apply})
        return
    out = console()
    for name, value in result.values.items():
        out.print(f"{name}: {result.before[name]:.4g} -> {value:.4g}", markup=False)
    out.print(f"step time error over {len(runs)} runs: {result.mape_before_pct:.1f}% before, "
              f"{result.mape_after_pct:.1f}% after", markup=False)
    if not result.values:
        out.print("no parameter changes any prediction of these runs: nothing fitted", markup=False)
    else:
        note(apply)


@calibrate_group.command("overhead", epilog=exit_codes())
@click.option("--platform", "platform_name", required=True, help="Platform catalog name or YAML path.")
@out_dir_option("out_dir", "Output directory (default calibration/<platform>/).", old=("--out",))
@click.option("--no-concurrency", is_flag=True, help="Skip the rows that run 1, 2 and 4 processes at once.")
@json_option(help="The measured rows and the file they went to as JSON on stdout.")
def overhead_cmd(platform_name, out_dir, no_concurrency, as_json) -> None:
    """Measure the runtime's fixed per-layer / per-micro-batch / optimizer overhead on the platform's device (this
    machine's CPU, or its first GPU); write overhead.csv."""
    from piper_plan.calibration.bench_overhead import overhead_rows
    from piper_plan.calibration.io import merge_rows, read_if_present
    from piper_plan.calibration.overhead import OVERHEAD
    from piper_plan.catalog import load_platform

    platform = load_platform(platform_name)
    device = _overhead_device(platform)
    out = _out_dir(platform_name, out_dir)
    read_if_present(out, OVERHEAD)              # a malformed overhead.csv is named before the measurement, not after
    args = ["piper", "calibrate", "overhead", "--platform", platform_name] + (["--out-dir", out_dir] if out_dir else [])
    t0 = time.perf_counter()
    with diagnostics().status("measuring the runtime's overhead (about 40 s on 2 cores)"):
        rows = overhead_rows(shlex.join(args), concurrency=not no_concurrency, device=device)
    path = merge_rows(out, OVERHEAD, rows)
    note(f"wrote {len(rows)} rows to {path} in {time.perf_counter() - t0:.1f} s")
    if as_json:
        print_json({"file": str(path), "rows": rows})
        return
    for r in rows:
        console().print(f"{r['op']:18s} size {r['size']:3d}  {r['seconds'] * 1e6:10.1f} us", markup=False)


def _overhead_device(platform):
    """The device the overhead benchmark times the runtime's modules on: this machine's CPU for a CPU platform, its
    first GPU for a GPU platform (one line where torch sees none)."""
    import torch

    if platform.launch.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise PiperError(f"platform {platform.name} runs on launch.device={platform.launch.device}, but torch sees no "
                         "GPU here: the overhead benchmark times the runtime's modules on the platform's device; run it "
                         "on one of its nodes", field="--platform")
    return torch.device("cuda", 0)


def check_distinct_runs(run_dirs) -> None:
    """Each RUN_DIR once: the same run named twice (r, ./r, /abs/r) would count one measurement as several."""
    seen: dict[Path, str] = {}
    for name in run_dirs:
        key = Path(name).resolve()
        if key in seen:
            raise PiperError(f"{name!r} is the run {seen[key]!r} again; give each run once (a fit needs as many "
                             "distinct runs as parameters)", field="RUN_DIR")
        seen[key] = name
