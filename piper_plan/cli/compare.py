"""`piper compare RUN_DIR`: measured (metrics.jsonl) vs predicted (plan.json) as a table or --json."""

from __future__ import annotations

from pathlib import Path

import click

from piper_plan.cli.common import exit_codes, json_option, note, plot_option, print_json, print_table
from piper_plan.errors import PiperError
from piper_plan.metricsfile import read_metrics


def find_plan(run_dir: Path) -> Path:
    """plan.json in the run directory, else beside it (launch writes DIR/plan.json and runs in DIR/run)."""
    for candidate in (run_dir / "plan.json", run_dir.parent / "plan.json"):
        if candidate.is_file():
            return candidate
    raise PiperError(f"no plan.json in {run_dir} or {run_dir.parent}", path=str(run_dir))


def find_metrics(run_dir: Path) -> Path:
    for candidate in (run_dir / "metrics.jsonl", run_dir / "run" / "metrics.jsonl"):
        if candidate.is_file():
            return candidate
    raise PiperError("no metrics.jsonl (has the run written a step yet?)", path=str(run_dir))


def prediction_of(plan_file, path: Path) -> dict:
    """The prediction of plan.json at ``path`` (``plan_file``: read and validated by read_plan_file), priced again
    from the file as `launch`, `run` and `estimate --plan` price it (launch/job.py repriced): a hand-edited plan is
    compared with what it costs, not with the figures written beside it (a note says where they differ); and as
    piper's runtime, which made the measurements, runs it (for_the_runtime), where the file assumed another
    engine's kernels (a note says so)."""
    from piper_plan.launch.job import figures_differ, for_the_runtime, repriced, stale_note

    fresh, changed = repriced(plan_file)          # a file without a prediction is priced now
    if changed:
        note(f"note: {path}: {stale_note(plan_file.prediction, fresh.prediction)}; compared with the new figures")
    ran, runtime_note = for_the_runtime(fresh)
    if runtime_note and figures_differ(fresh.prediction, ran.prediction):
        note(f"note: {path}: the run ran piper's runtime, {runtime_note}; compared with these figures")
    return ran.prediction.to_json()


@click.command("compare", epilog=exit_codes())
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@json_option(help="Each quantity as {predicted, measured, rel_error} on stdout.")
@plot_option("Write predicted vs measured step time per step and per time term as a PNG")
def compare_cmd(run_dir: str, as_json: bool, plot_path: str | None) -> None:
    """Measured vs predicted step time, tokens/s, all-to-all share and memory per stage."""
    from piper_plan.compare import check_same_job, check_stage_count, compare, layout_records
    from piper_plan.planfile import read_plan_file
    from piper_plan.plots import check_plot_path

    if plot_path:
        check_plot_path(plot_path)
    run = Path(run_dir)
    metrics_path = find_metrics(run)
    plan_path = find_plan(metrics_path.parent)
    records = read_metrics(metrics_path)
    plan_file = read_plan_file(plan_path)
    check_same_job(plan_file, records, str(metrics_path), str(plan_path))
    kept = layout_records(plan_file, records, str(metrics_path), str(plan_path))
    if len(kept) < len(records):
        note(f"note: {len(records) - len(kept)} of {len(records)} steps ran under another parallel layout than "
             f"{plan_path}'s (the run was resumed under a new one) and are left out")
    records = kept
    check_stage_count(plan_file.parallel.pp, records, str(metrics_path), str(plan_path))
    result = compare(prediction_of(plan_file, plan_path), records)
    result = {"run_dir": str(metrics_path.parent), "plan": str(plan_path), **result}
    if plot_path:
        note(f"wrote {_plot(plot_path, result, records)}")
    hint = _calibration_hint(plan_file, result["step_time_s"]["rel_error"])
    result["calibration_note"] = hint
    if hint:
        note(f"note: {hint}")
    for said in result["time_notes"]:
        note(f"note: {said}")
    rss_note = _process_memory_note(plan_file, result.get("process_rss_bytes_per_stage") or [])
    if rss_note:
        note(f"note: {rss_note}")
    if as_json:
        print_json(result)
    else:
        _table(result)


def _process_memory_note(plan_file, rss: list[dict]) -> str | None:
    """Where a CPU rank's resident memory is well above the plan's per-device peak: by how much, and the platform
    figure that falls short (its framework memory), so the plan's 'fits' is read with that margin."""
    worst = min((q for q in rss if q.get("rel_error") is not None), key=lambda q: q["rel_error"], default=None)
    if worst is None or worst["rel_error"] >= -PROCESS_MEMORY_ABOVE:
        return None
    framework = plan_file.platform.memory.framework_bytes
    return (f"the ranks' resident memory peaked at {worst['measured'] / 2**30:.3g} GiB against the plan's "
            f"{worst['predicted'] / 2**30:.3g} GiB per device ({worst['rel_error']:+.0%}): "
            f"{plan_file.platform.name}'s memory.framework_bytes ({framework / 2**20:.0f} MiB) is less than a running "
            "rank holds beside its tensors; read the plan's fits verdict with that margin")


PROCESS_MEMORY_ABOVE = 0.15
"""A CPU rank's resident memory this far above the predicted per-device peak (as compare's error, below -15%) is
said in a note."""


RECALIBRATE_ABOVE = 0.25
"""A step-time error beyond this (either way) names the calibration the prediction used and how to measure anew."""


def _calibration_hint(plan_file, step_error: float | None) -> str | None:
    """Where the step time is far off and the prediction was priced from a calibration folder: which one and when it
    was measured (its metadata.json), and the commands that measure this machine. A calibration measured on another
    machine (the committed local-cpu one, say) prices this one's GEMMs and framework overhead wrongly."""
    import shlex

    from piper_plan.calibration.io import read_metadata, recorded_device
    from piper_plan.calibration.timing import cpu_isa_flags, cpu_name
    from piper_plan.catalog import calibration_dir, catalog_names, platforms_dir
    from piper_plan.planfile import priced_from_calibration

    if step_error is None or abs(step_error) <= RECALIBRATE_ABOVE or not priced_from_calibration(plan_file):
        return None
    name = plan_file.platform.name
    ref = shlex.quote(name) if name in catalog_names(platforms_dir()) else "PLATFORM.yaml"
    host = (plan_file.prediction.sources.host or "") if plan_file.prediction is not None else ""
    if host.startswith("not priced"):                 # the cause to name first: no host time in the prediction
        return (f"the step time is {step_error:+.0%} off, and the plan priced no host time ({host}): a small "
                f"model's step on this machine is mostly its framework's; measure it (`piper calibrate overhead "
                f"--platform {ref}`), re-plan, and run again")
    folder = calibration_dir(name)
    metadata = read_metadata(folder) if folder.is_dir() else {}
    device = recorded_device(metadata, folder)
    when = metadata.get("date")
    measure = f"`piper calibrate --platform {ref} --quick`, then `piper calibrate overhead --platform {ref}`"
    where = "" if plan_file.platform.launch.device == "cpu" else " on one of its GPUs"
    said = (f"the step time is {step_error:+.0%} off; the plan was priced from {folder} when it was saved"
            + (f" (its metadata.json now says measured {when})" if when else ""))
    cpu = _cpu_against_this_one(plan_file, device)
    recorded = _cpu_words(device.get("name", ""), device.get("isa_flags"))
    if cpu == "this":                       # the advice to measure here would loop
        return (f"{said}, on this machine's CPU ({recorded}): not another machine's rates; a host busy with other "
                "work during the run, or the model itself, is what remains (docs/closed-loop.md)")
    if cpu == "another":
        this = _cpu_words(cpu_name(), cpu_isa_flags())
        return (f"{said}, on another machine's CPU ({recorded}; this one is {this}): measure this one ({measure}), "
                "re-plan, and run again")
    return (f"{said}. If that calibration is another machine's, measure this one ({measure}{where}), re-plan, and "
            "run again")


def _cpu_words(name: str, isa_flags: str | None) -> str:
    return name + (f" with {isa_flags}" if isa_flags else "")


def _cpu_against_this_one(plan_file, device: dict) -> str | None:
    """Whether a CPU platform's calibration (its metadata.json device section) was measured on this machine's CPU:
    "this" (the model name and instruction sets it recorded are this CPU's), "another" (either differs), or None
    (not a CPU platform, or nothing recorded to tell: a VM may name different CPUs alike, 'AMD EPYC')."""
    from piper_plan.calibration.timing import cpu_isa_flags, cpu_name

    if plan_file.platform.launch.device != "cpu" or not device.get("name"):
        return None
    if device["name"] != cpu_name():
        return "another"
    if not device.get("isa_flags"):
        return None
    return "this" if device["isa_flags"] == cpu_isa_flags() else "another"


def _plot(path, result: dict, records: list[dict]):
    from piper_plan.plots import compare_plot

    by_step = {r["step"]: r["step_time_s"] for r in records if isinstance(r.get("step_time_s"), (int, float))}
    steps = sorted(by_step)
    return compare_plot(path, steps, [by_step[s] for s in steps], result["step_time_s"]["predicted"], result["time_s"],
                        f"{result['run_dir']}: predicted vs measured")


def _fmt(value, scale: float = 1.0, digits: int = 4) -> str:
    return "-" if value is None else f"{value * scale:.{digits}g}"


def _table(result: dict) -> None:
    from rich.table import Table

    kind = "warm-up steps only (allocation, connections; no steady step yet)" if result.get("warmup_only") \
        else "steady steps"
    table = Table(title=f"{result['run_dir']}: predicted vs measured (medians of {result['steps_measured']} {kind}; "
                        "migration: their mean)")
    for col in ("quantity", "predicted", "measured", "error %"):
        table.add_column(col, justify="left" if col == "quantity" else "right")
    rows = [("step time (s)", result["step_time_s"], 1.0), ("tokens/s", result["tokens_per_s"], 1.0),
            ("all-to-all share (%)", result["a2a_share"], 100.0)]
    rows += [(f"{term} time per step (s)", q, 1.0) for term, q in result["time_s"].items()]
    rows += [(f"memory stage {i} (GiB)", q, 1 / 2**30) for i, q in enumerate(result["memory_bytes_per_stage"])]
    rows += [(f"process peak RSS stage {i} (GiB)", q, 1 / 2**30)
             for i, q in enumerate(result.get("process_rss_bytes_per_stage") or [])]
    for name, q, scale in rows:
        table.add_row(name, _fmt(q["predicted"], scale), _fmt(q["measured"], scale), _fmt(q["rel_error"], 100.0, 3))
    table.caption = "error % = (predicted - measured) / measured"
    if result["memory_bytes_per_stage"]:     # CPU ranks report their tensors, not a process's resident memory
        table.caption += f"; memory: {result['memory_basis']}" + (
            "; process peak RSS: the ranks' resident memory (getrusage) against the whole per-device prediction"
            if result.get("process_rss_bytes_per_stage") else "")
    print_table(table)
