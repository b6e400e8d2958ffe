"""``piper estimate``: memory per stage and step time of ONE parallel plan, with the full breakdown.

Thin: parse, load, call ``piper_plan.cost.evaluate.estimate``, render (tables on stdout, or --json
instead). A plan that does not fit is a result (shown with its overflow), not an error; an invalid plan is
a PiperError from the one validity check (exit 2). ``-o/--output`` writes plan.json after the estimate succeeded.
"""

from __future__ import annotations

import click

from piper_plan.cli.common import (AsciiInt, console, exit_codes, json_option, note, options_given, output_option,
                                   platform_calibration, platform_show_command, plot_option, print_json, print_table,
                                   short_compute_source)
from piper_plan.cli.options import (build_plan, cost_options, cost_knobs, load_setting, model_options_or_plan,
                                    migration_option, parallel_options, placement_option, precision_text,
                                    state_knobs, training_options, unused_modules_note, capacity_note)

GiB = 2**30


@click.command("estimate", epilog=exit_codes())
@click.option("--plan", "plan_path", type=click.Path(), default=None,
              help="A saved plan.json, priced again as it states itself (model, platform, training, degrees, "
                   "placement, cost options; the calibration where its prediction used one); takes no setting "
                   "option beside it. Says where the stored prediction differs.")
@model_options_or_plan
@click.option("--nodes", type=AsciiInt(), default=None, help="Nodes of the allocation (required without --plan).")
@parallel_options
@training_options
@click.option("--routing-skew", type=float, default=1.0, show_default=True,
              help="Expected max / mean tokens per expert-parallel rank.")
@placement_option
@migration_option
@click.option("--no-calibration", is_flag=True, help="Ignore calibration/<platform>/ (roofline fallback).")
@click.option("--piper-runtime", is_flag=True,
              help="Price activations as piper's own runtime saves them (unfused kernels), not Megatron's fused ones.")
@state_knobs
@cost_knobs
@json_option
@output_option("save_path", "Write the plan to FILE as plan.json (what launch, run, export and estimate --plan read).", old=("--save",))
@plot_option("Write memory per pipeline stage, stacked by component, against the device limit as a PNG")
@click.pass_context
def estimate_cmd(ctx, plan_path, model_name, platform_name, mtp_layers, capacity_factor, nodes, seq_len, global_batch,
                 dtype, fp8_recipe, grad_bytes, routing_skew, placement, migration, no_calibration, piper_runtime,
                 flash_attention, master_bytes, dropout, recompute_modules, cost_option, as_json, save_path,
                 plot_path, **parallel):
    """Predict memory and step time of one parallel plan (the same numbers `piper plan` ranks it by)."""
    from piper_plan.cost.evaluate import estimate
    from piper_plan.planfile import MigrationBlock
    from piper_plan.plots import check_plot_path

    if plot_path:
        check_plot_path(plot_path)
    if plan_path is not None:
        _estimate_saved(ctx, plan_path, as_json, save_path, plot_path)
        return
    for value, flag in ((model_name, "--model"), (platform_name, "--platform"), (nodes, "--nodes")):
        if value is None:
            raise click.UsageError(f"Missing option '{flag}' (or give a saved plan: --plan plan.json).")

    model, platform, training = load_setting(model_name, platform_name, seq_len, global_batch, routing_skew,
                                             mtp_layers, dtype, grad_bytes, fp8_recipe, capacity_factor, master_bytes,
                                             flash_attention)
    plan = build_plan(model, platform, training, nodes, **parallel)
    calibration = None if no_calibration else platform_calibration(platform.name)
    options = cost_options(piper_runtime, dropout, recompute_modules, cost_option)
    result = estimate(model, platform, training, nodes, plan, calibration=calibration, placement=placement,
                      options=options)
    result = with_other_placement(result, model, platform, training, nodes, plan, calibration, options)
    unused = unused_modules_note(options, recompute_modules, cost_option, parallel["recompute"], model)
    _show(result, model, platform, training, plan, save_path, plot_path, as_json,
          platform_show_command(platform_name), [unused], {"migration": MigrationBlock(enabled=migration)})


def _show(result, model, platform, training, plan, save_path, plot_path, as_json, cited_at: str, notes: list,
          blocks: dict) -> None:
    """What every estimate prints and writes once priced: its notes, plan.json (``blocks``: the file's moe,
    migration and runtime blocks), the plot, then --json or the tables."""
    _note_capped_skew(model, training, plan)               # notes once priced: an error stays the one line
    for line in (*notes, capacity_note(model)):
        if line:
            note(line)
    if save_path:
        from piper_plan.planfile import write_plan_file

        written = write_plan_file(save_path, model, platform, training, result.nodes, plan, result.placement, result,
                                  **blocks)
        note(f"wrote {written}")
        if not result.fits:
            note(f"warning: the saved plan does not fit: peak {_gib(result.memory.peak_bytes)} of "
                 f"{_gib(platform.device.memory_bytes)} GiB per device (`piper launch` will refuse it)")
    if plot_path:
        note(f"wrote {_plot(plot_path, result, model, platform, plan)}")
    refusal = _runtime_refusal(result, model, platform, training, plan, blocks)
    if as_json:
        from piper_plan.planfile import parallel_block

        print_json({**result.to_json(), "parallel": parallel_block(model, plan, result),
                    "dtype": training.dtype, "fp8_recipe": training.fp8_recipe,
                    "runnable_by_piper": refusal is None, "runtime_refusal": refusal})
        return
    render(result, model, platform, plan, training, cited_at)
    console().print("piper's runtime: runs this plan (`piper launch` / `piper run`)" if refusal is None
                    else f"piper's runtime: `piper launch` / `piper run` refuse this plan: {refusal}",
                    markup=False, soft_wrap=True)        # part of the result, beside its 'fits' line: stdout


def _runtime_refusal(result, model, platform, training, plan, blocks: dict) -> str | None:
    """launch's and run's verdict on the plan as it would be saved (launch/job.py check_runnable), or None."""
    from piper_plan.errors import PiperError
    from piper_plan.launch.job import runtime_refusal
    from piper_plan.planfile import parse_plan_dict, plan_file_dict

    try:
        return runtime_refusal(parse_plan_dict(plan_file_dict(model, platform, training, result.nodes, plan,
                                                              result.placement, result, **blocks), "the estimate"))
    except PiperError as exc:            # a plan no file can hold: launch cannot take it either
        return exc.message


SAVED_PLAN_OUTPUTS = ("plan_path", "as_json", "save_path", "plot_path")
"""What `estimate --plan` takes beside the file: how to show the result and where to write it."""


def _estimate_saved(ctx, plan_path: str, as_json: bool, save_path: str | None, plot_path: str | None) -> None:
    """A saved plan.json priced again as `piper launch` and `piper export` price it (launch/job.py repriced), shown
    as any estimate is; where its stored prediction differs, a note says so."""
    from piper_plan.cost.options import cost_options as saved_cost_options
    from piper_plan.errors import PiperError
    from piper_plan.launch.job import repriced, saved_calibration, stale_note
    from piper_plan.planfile import read_plan_file

    given = options_given(ctx, but=SAVED_PLAN_OUTPUTS)
    if given:
        raise PiperError(f"{', '.join(given)} with --plan: the plan file states its own setting; allowed beside "
                         "--plan: --json, -o/--output, --plot (or drop --plan and state the plan as options)")
    if not plan_path.strip():
        raise PiperError("--plan names no file; give a plan.json (`piper plan -o` / `estimate -o` write one)")
    stored = read_plan_file(plan_path)
    pf, changed = repriced(stored)
    if stored.prediction is None:
        note(f"note: {plan_path}: holds no prediction; priced now with the default cost options")
    if changed:
        note(f"note: {plan_path}: {stale_note(stored.prediction, pf.prediction)}")
    result = with_other_placement(pf.prediction, pf.model, pf.platform, pf.training, pf.nodes, pf.parallel,
                                  saved_calibration(pf), saved_cost_options(dict(pf.prediction.options)))
    _show(result, pf.model, pf.platform, pf.training, pf.parallel, save_path, plot_path, as_json,
          f"the plan file's platform.efficiency.source ({plan_path})", [],
          {"moe": pf.moe, "migration": pf.migration, "runtime": pf.runtime})


def _plot(path, result, model, platform, plan):
    from piper_plan.plots import estimate_plot

    import textwrap

    title = "\n".join([f"{model.name} on {result.nodes} x {platform.name}", *textwrap.wrap(plan.settings_text(), 100),
                       f"peak {_gib(result.memory.peak_bytes)} of {_gib(platform.device.memory_bytes)} GiB per device"])
    return estimate_plot(path, [s.components for s in result.memory.per_stage], platform.device.memory_bytes, title)


def with_other_placement(result, model, platform, training, nodes, plan, calibration, options):
    """``result`` with the other allocation shape's figures when its step time differs."""
    from piper_plan.cost.evaluate import estimate

    other = "spread" if result.placement == "compact" else "compact"
    alt = estimate(model, platform, training, nodes, plan, calibration=calibration, placement=other, options=options)
    if abs(alt.step_time_s - result.step_time_s) <= 1e-9 * result.step_time_s:
        return result
    from piper_plan.specs.estimate import OtherPlacement

    return result.model_copy(update={"other_placement": OtherPlacement(
        placement=other, step_time_s=alt.step_time_s, tokens_per_s=alt.tokens_per_s, scopes=alt.scopes)})


# ---- rendering (human output, stdout) --------------------------------------------------------------
def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f}"


def memory_table(result, device_bytes: float):
    from rich.table import Table

    table = Table(title="Memory per rank, by pipeline stage (GiB; layers: all/MoE; other: framework + fragmentation)")
    for col in ("stage", "layers", "weights", "grads", "optim", "acts", "other", "total", "over"):
        table.add_column(col, justify="right", no_wrap=True)
    for s in result.memory.per_stage:
        c = s.components
        acts = sum(v for k, v in c.items() if k.startswith("activations/"))
        over = c["fragmentation"] + c["framework"]
        fits = "-" if s.total_bytes <= device_bytes else f"+{_gib(s.total_bytes - device_bytes)}"
        table.add_row(str(s.stage), f"{s.layers}/{s.moe_layers}", _gib(c["weights"]),
                      _gib(c["gradients"]), _gib(c["optimizer"]), _gib(acts), _gib(over), _gib(s.total_bytes), fits)
    return table


def time_table(result):
    from rich.table import Table

    step = result.step_time_s
    table = Table(title="Time per step, by component (bottleneck stage)")
    table.add_column("component")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for name, seconds in sorted(result.time.breakdown.items(), key=lambda kv: -kv[1]):
        if seconds > 0:
            table.add_row(name, f"{seconds:.4g}", f"{seconds / step:.1%}")
    table.add_row("total", f"{step:.4g}", "100%")
    return table


def render(result, model, platform, plan, training, cited_at: str) -> None:
    """The estimate's tables and lines; ``cited_at``: where a reader finds the platform's efficiency citation."""
    from piper_plan.cost.evaluate import host_warning

    out = console()
    device = platform.device.memory_bytes
    out.print(f"{model.name} on {result.nodes} x {platform.name} nodes ({result.placement}), "
              f"{precision_text(training)}: "
              f"{plan.settings_text()} layers per stage {result.layers_per_stage}", markup=False)
    print_table(memory_table(result, device))
    print_table(time_table(result))
    mem = result.memory
    verdict = "fits" if result.fits else f"does NOT fit: overflows by {_gib(mem.overflow_bytes)} GiB"
    out.print(f"peak memory {_gib(mem.peak_bytes)} of {_gib(device)} GiB per device: {verdict}", markup=False)
    tr = result.training
    out.print(f"step {result.step_time_s:.4g} s | {result.tokens_per_s:.4g} tokens/s | "
              f"{result.tflops_per_device:.4g} TFLOPS/device | MFU {result.mfu:.1%} | HFU {result.hfu:.1%} (PaLM) | "
              f"MFU {result.mfu_megatron:.1%} | HFU {result.hfu_megatron:.1%} (Megatron: causal attention) | "
              f"all-to-all {result.a2a_share:.1%} of the step", markup=False)
    out.print(f"MFU and HFU against the {platform.peak_dtype(training.dtype)} peak, "
              f"{platform.peak_flops(training.dtype) / 1e12:.4g} TFLOPS/device (device.peak_flops)", markup=False)
    out.print(f"to train {model.name} on {training.tokens_to_train:.3g} tokens (training.tokens_to_train; "
              f"{tr.steps:.4g} steps): {tr.time_to_train_s / 86400:.2f} days, "
              f"{tr.node_hours:.4g} node-hours | checkpoint {result.checkpoint.total_bytes / 1e9:.1f} GB "
              f"total, {result.checkpoint.per_rank_bytes / 1e9:.2f} GB per rank (max)", markup=False)
    scopes = ", ".join(f"{k} {v}" for k, v in result.scopes.items())
    out.print(f"scopes: {scopes} | compute: {short_compute_source(result.sources.compute, platform, cited_at)}"
              + (" | some points EXTRAPOLATED beyond calibration" if result.sources.extrapolated else ""),
              markup=False)
    out.print(f"host time: {result.sources.host}", markup=False)
    warning = host_warning(platform, result.time.breakdown.get("host/launch", 0.0), result.step_time_s,
                           framework_s=result.time.breakdown.get("host/framework", 0.0))
    if warning:
        note(warning)
    out.print(f"expert all-to-all ({result.sources.a2a_algorithm}): {result.sources.a2a}", markup=False)
    if result.other_placement is not None:
        o = result.other_placement
        scopes = ", ".join(f"{k} {v}" for k, v in o.scopes.items())
        out.print(f"with a {o.placement} allocation: step {o.step_time_s:.4g} s, "
                  f"{o.tokens_per_s:.4g} tokens/s (scopes {scopes})", markup=False)


def _note_capped_skew(model, training, plan) -> None:
    """A routing skew beyond what the plan's ep group can see is priced at that most (cost/memory.py): say so."""
    if model.moe is None or training.routing_skew == 1.0:
        return
    from piper_plan.cost.memory import max_routing_skew

    most = float(max_routing_skew(model.moe, plan.ep))
    if training.routing_skew > most:
        copies = min(model.moe.top_k, model.moe.num_experts // plan.ep)
        note(f"note: --routing-skew {training.routing_skew:g} is priced as {most:g}, the most an ep={plan.ep} group "
             f"can see (each token's copies on one rank: {copies} of its {model.moe.top_k}, one per expert there)")
