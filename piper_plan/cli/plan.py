"""``piper plan``: search every valid parallel configuration and rank it by predicted throughput.

Thin: parse, load, call ``piper_plan.search``, render (the table on stdout, or --json / --csv instead).
Exit codes: 0 a plan fits; 2 user error; 3 nothing fits (the closest candidates and what would make them fit
are shown).
"""

from __future__ import annotations

import csv
import io

import click

from piper_plan.cli.common import (EXIT_NOTHING_FITS, AsciiInt, console, diagnostics, exit_codes, json_option, note,
                                   output_option, platform_calibration, platform_show_command, plot_option, print_json,
                                   print_table, short_compute_source)
from piper_plan.cli.options import (cost_options, cost_knobs, load_setting, migration_option, model_options,
                                    placement_option, precision_text, state_knobs, training_options, capacity_note)
from piper_plan.errors import PiperError
from piper_plan.fileio import ascii_int, check_writable
from piper_plan.plots import check_plot_path
from piper_plan.search.report import explain_json, nothing_fits_json, plan_rows, result_json


@click.command("plan", epilog=exit_codes({EXIT_NOTHING_FITS: "nothing fits (the closest candidates are shown)"}))
@model_options
@click.option("--nodes", "nodes_text", default=None, help="Node count N, or a range A..B to sweep (doubling).")
@click.option("--min-nodes", is_flag=True, help="Find the smallest node count that fits (from --nodes, default 1).")
@training_options
@click.option("--strategy", type=click.Choice(["general", "piper"]), default="general", show_default=True,
              help="piper: the paper's PP x EP mesh (tp=1, dp=ep, ep <= devices per switch group).")
@click.option("--a2a", type=click.Choice(["flat", "halo", "any"]), default="any", show_default=True)
@migration_option
@click.option("--runnable", is_flag=True,
              help="Keep only plans the piper runtime can execute, priced as it runs them (unfused PyTorch kernels, "
                   "its chunked loss and shared-expert overlap: step times and memory differ from the default "
                   "Megatron-style pricing).")
@state_knobs
@cost_knobs
@placement_option
@click.option("--memory-headroom", type=float, default=0.0, show_default=True,
              help="Fraction of device memory to keep free (0.1 = plans must fit in 90%).")
@click.option("--cp", "cp_text", default=None,
              help="Context-parallel degrees to search, e.g. 1,2,4 (default: 1, and 2, 4, 8 from 16k-token sequences).")
@click.option("--virtual-stages", "vp_text", default=None,
              help="Model chunks per rank to try with the interleaved schedule, e.g. 2,4,6 (default: 2,3,4; 2 under "
                   "--strategy piper; one chunk per rank is 1F1B, searched as its own schedule).")
@click.option("--expert-tp", is_flag=True,
              help="Also search expert tensor parallelism etp > 1 (piper's runtime runs etp = 1 only).")
@click.option("--top", type=AsciiInt(min=0), default=10, show_default=True, help="Plans to show (0 = all).")
@json_option
@click.option("--csv", "as_csv", is_flag=True, help="The ranked plans as CSV on stdout.")
@output_option("save_path", "Write the best plan to FILE as plan.json (what launch, run, export and estimate --plan read).", old=("--save",))
@click.option("--explain", is_flag=True, help="The winner's time breakdown vs the runner-up.")
@plot_option("Write tokens/s vs peak memory of every evaluated plan (Pareto set and chosen plan marked, rejected "
             "ones coloured by reason) as a PNG")
@click.pass_context
def plan_cmd(ctx, model_name, platform_name, mtp_layers, capacity_factor, nodes_text, min_nodes, seq_len, global_batch,
             dtype, fp8_recipe, grad_bytes, strategy, a2a, migration, runnable, flash_attention, master_bytes, dropout,
             recompute_modules, cost_option,
             placement, memory_headroom, cp_text, vp_text, expert_tp, top, as_json, as_csv, save_path, explain,
             plot_path):
    """Search and rank every valid parallel configuration."""
    from piper_plan.search import engine

    if as_json and as_csv:
        raise PiperError("--json and --csv both write stdout; choose one", field="--csv")
    if save_path:
        check_writable(save_path)
    if plot_path:
        check_plot_path(plot_path)
    dtypes = precisions(dtype, platform_name)
    if dtype == "any" and len(dtypes) == 1:
        note(f"--dtype any: {platform_name} has no peak for fp8 or mxfp8 (device.peak_flops): {dtypes[0]} only")
    check_fp8_recipe(fp8_recipe, dtypes)
    recipe = {"fp8": fp8_recipe}                  # the recipe of each searched precision (fp8's only)
    state = {"grad_bytes": grad_bytes, "master_bytes": master_bytes, "flash_attention": flash_attention}
    model, platform, training = load_setting(model_name, platform_name, seq_len, global_batch, mtp_layers=mtp_layers,
                                             dtype=dtypes[0], fp8_recipe=recipe.get(dtypes[0]),
                                             capacity_factor=capacity_factor, **state)
    options = search_options(strategy, a2a, memory_headroom, expert_tp, parse_degrees(cp_text, "--cp"),
                             parse_degrees(vp_text, "--virtual-stages", least=2))
    kwargs = search_kwargs(platform, placement, runnable, dropout, recompute_modules, cost_option)
    counts = within_platform(_node_counts(nodes_text, min_nodes), nodes_text, platform)
    searching = diagnostics().status(f"searching {model.name} on {platform.name}")
    if len(dtypes) > 1:
        if len(counts) > 1 or min_nodes or plot_path or explain:
            raise PiperError(f"{dtype!r}: several precisions are searched at one node count (--nodes N), without "
                             "--min-nodes, --plot and --explain", field="--dtype")
        trainings = [training] + [load_setting(model_name, platform_name, seq_len, global_batch, mtp_layers=mtp_layers,
                                               dtype=d, fp8_recipe=recipe.get(d), **state)[2]
                                  for d in dtypes[1:]]
        with searching:
            searches = [(t, engine.search(model, platform, t, counts[0], options, **kwargs)) for t in trainings]
        _notes_once_searched(model, platform, training, options, counts[0])
        _emit_precisions(ctx, searches, model, platform, options, kwargs, top, as_json, as_csv, runnable, save_path,
                         migration, platform_show_command(platform_name))
        return
    if len(counts) > 1:
        for given, option in ((save_path, "--output"), (plot_path, "--plot"), (as_csv, "--csv"), (explain, "--explain")):
            if given:
                raise PiperError(f"{option} needs one node count (use --nodes N or --min-nodes)", field=option)
        with searching:
            results = engine.sweep(model, platform, training, counts, options, **kwargs)
        _notes_once_searched(model, platform, training, options, None)
        _emit_sweep(results, model, training, as_json)
        if not any(r.feasible for r in results):    # every count's row says so; the exit code too
            ctx.exit(EXIT_NOTHING_FITS)
        return
    if min_nodes:
        from piper_plan.plans import check_setting

        check_setting(model, platform, training, counts[0])   # a start beyond the platform: not "nothing fits"
        with searching:
            _, result = engine.min_nodes(model, platform, training, options, start=counts[0], **kwargs)
        if result is None:
            _emit_nothing_at_any_size(model, platform, as_json)
            ctx.exit(EXIT_NOTHING_FITS)
    else:
        with searching:
            result = engine.search(model, platform, training, counts[0], options, **kwargs)
    _notes_once_searched(model, platform, training, options, None if min_nodes else counts[0])
    if plot_path:
        note(f"wrote {_plot(plot_path, result, model, platform)}")
    if not result.feasible:
        if as_csv:          # stdout stays CSV (no rows); what happened goes to stderr
            note(f"nothing fits: {model.name} on {result.nodes} {platform.name} nodes (piper plan without --csv "
                 "shows the reasons and the closest candidates)")
        else:
            _emit_nothing_fits(model, platform, training, result, options, kwargs, as_json)
        ctx.exit(EXIT_NOTHING_FITS)
    _emit_result(result, model, platform, training, top, as_json, as_csv, explain, runnable,
                 platform_show_command(platform_name))
    if save_path:
        path, plan = save_best(save_path, model, platform, training, result, kwargs, migration)
        note(f"saved {path} (layers per stage: {plan.layers_per_stage})")


def _notes_once_searched(model, platform, training, options, nodes: int | None) -> None:
    """Notes printed once the search ran (an error before them stays the one stderr line): what the model's
    capacity factor does to the figures, and at one node count (``nodes``) the --cp degrees no plan can have where
    others were searched (none left: the search refused)."""
    from piper_plan.search.space import cp_left_out

    lines = [capacity_note(model)]
    if nodes is not None:
        left_out = cp_left_out(options, nodes * platform.devices_per_node, training.seq_len)
        if left_out and len(left_out) < len(options.cp):
            lines.append(f"--cp: {'; '.join(left_out)}: not searched")
    for line in filter(None, lines):
        note(line)


def _plot(path, result, model, platform):
    from piper_plan.plots import plan_plot
    from piper_plan.search.report import candidate_status

    ev = result.evaluation
    title = (f"{model.name} on {result.nodes} {platform.name} nodes ({result.world} devices): "
             f"{result.evaluated:,} plans evaluated, {result.feasible:,} fit\n"
             f"({result.candidates_total - len(result.fields['dp']):,} more refused by the structural rules before "
             "pricing: not shown)")
    return plan_plot(path, ev.tokens_per_s, ev.peak_memory_bytes, candidate_status(result), result.pareto, result.best,
                     result.memory_limit_bytes, title)


def precisions(text: str | None, platform_name: str) -> list[str | None]:
    """--dtype of ``piper plan``: [None] (the device's default), one precision, a comma-separated list, or 'any':
    the device's default precision and every 8-bit recipe (fp8, mxfp8) the platform has a peak for."""
    from piper_plan.catalog import load_platform
    from piper_plan.cli.options import check_dtype
    from piper_plan.specs import TrainingSpec
    from piper_plan.specs.training import LOW_PRECISION_GEMM_DTYPES

    if text is None:
        return [None]
    if text == "any":
        platform = load_platform(platform_name)
        default = TrainingSpec.for_device(platform.launch.device).dtype
        return [default] + [d for d in LOW_PRECISION_GEMM_DTYPES if d in platform.device.peak_flops]
    parts = [part.strip() for part in text.split(",")]
    if "any" in parts:
        raise PiperError(f"{text!r}: 'any' stands alone (the device's precision and every 8-bit one the platform "
                         "has a peak for); or list precisions, e.g. bf16,fp8", field="--dtype")
    return list(dict.fromkeys(check_dtype(part) for part in parts))


def check_fp8_recipe(fp8_recipe: str | None, dtypes: list[str | None]) -> None:
    """A --fp8-recipe where no precision searched is fp8 is one error line, not a silently unused option (the
    recipe prices the fp8 search of a list only)."""
    if fp8_recipe is not None and "fp8" not in dtypes:
        searched = ", ".join(d or "the device's default" for d in dtypes)
        raise PiperError(f"{fp8_recipe}: no fp8 precision is searched ({searched}); give --dtype fp8 (or a list or "
                         "'any' holding it)", field="--fp8-recipe")


def search_options(strategy: str, a2a: str, memory_headroom: float, expert_tp: bool = False,
                   cp: tuple[int, ...] | None = None, virtual_stages: tuple[int, ...] | None = None):
    from piper_plan.search.space import SearchOptions

    if not 0.0 <= memory_headroom < 1.0:
        raise PiperError(f"memory headroom {memory_headroom}; allowed 0 <= h < 1", field="--memory-headroom")
    return SearchOptions(strategy=strategy, a2a=a2a, memory_headroom=memory_headroom, expert_tp=expert_tp, cp=cp,
                         virtual_stages=virtual_stages)


def parse_degrees(text: str | None, field: str, least: int = 1) -> tuple[int, ...] | None:
    """'1,2,4' -> (1, 2, 4) for the list option ``field``, each at least ``least``; None keeps the default space."""
    if text is None:
        return None
    try:
        values = tuple(ascii_int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < least:
        example = ",".join(str(least * k) for k in (1, 2, 4))
        raise PiperError(f"{text!r}; allowed: comma-separated whole numbers >= {least}, e.g. {example}", field=field)
    return values


def search_kwargs(platform, placement: str, runnable: bool, dropout: bool = False,
                  recompute_modules: str | None = None, cost_option: tuple[str, ...] = ()) -> dict:
    """engine.search's keyword arguments: the platform's calibration, and for runnable plans the runtime's own
    way of running (cost/options.py: unfused kernels), with dropout and recompute modules where asked."""
    return {"calibration": platform_calibration(platform.name), "placement": placement, "runnable": runnable,
            "cost_options": cost_options(runnable, dropout, recompute_modules, cost_option=cost_option)}


def save_best(path, model, platform, training, result, kwargs: dict, migration: bool):
    """Write the search's best plan, priced as ranked, to plan.json; returns (path, plan)."""
    from piper_plan.planfile import MigrationBlock, write_plan_file
    from piper_plan.search.report import best_plan

    plan, prediction = best_plan(model, platform, training, result, kwargs["placement"], kwargs["calibration"],
                                 kwargs["cost_options"])
    written = write_plan_file(path, model, platform, training, result.nodes, plan, kwargs["placement"], prediction,
                              migration=MigrationBlock(enabled=bool(migration)))
    return written, plan


def _node_counts(nodes_text: str | None, min_nodes: bool) -> list[int]:
    from piper_plan.search.engine import parse_node_range

    if nodes_text is None:
        if not min_nodes:
            raise PiperError("give --nodes N (or A..B), or --min-nodes", field="--nodes")
        return [1]
    counts = parse_node_range(nodes_text)
    if counts[0] < 1:
        raise PiperError(f"nodes={counts[0]}; must be >= 1", field="--nodes")
    if min_nodes and len(counts) > 1:
        raise PiperError("--min-nodes takes one starting count, not a range", field="--nodes")
    return counts


def within_platform(counts: list[int], nodes_text: str | None, platform) -> list[int]:
    """A range that runs past the platform's node count ends at it, and the user is told (a count beyond it is
    left to the validity check: that number is one the user typed)."""
    limit = platform.node_limit
    if len(counts) < 2 or counts[-1] <= limit or counts[0] > limit:
        return counts
    note(f"--nodes {nodes_text}: {platform.name} has at most {limit} nodes; the range ends at {limit}")
    return [n for n in counts if n < limit] + [limit]


# ---- output: one search -------------------------------------------------------------------------------
def _emit_result(result, model, platform, training, top, as_json, as_csv, explain, runnable,
                 cited_at: str) -> None:
    if as_json:
        obj = result_json(result, model, platform, training, top)
        if explain:
            obj["explain"] = explain_json(result)
        print_json(obj)
        return
    if as_csv:
        click.echo(_csv(plan_rows(result, model, training, top)), nl=False)
        return
    out = console()
    print_table(_plans_table(result, platform, plan_rows(result, model, training, top), training.tokens_to_train),
                width=_table_width(out))
    out.print(_counts_line(result.candidates_total, result.evaluated, result.feasible, result.search_seconds,
                           runnable), markup=False)
    out.print(_sources_line(result.sources, platform, cited_at), markup=False)
    _note_host_bound(result, platform)
    print_table(_reasons_table(result.reasons))
    if explain:
        print_table(_explain_table(result))


def _note_host_bound(result, platform) -> None:
    """The top plan's host-time warning (cost/evaluate.py host_warning), where it has one."""
    from piper_plan.cost.evaluate import host_warning

    if len(result.order):
        best, ev = int(result.order[0]), result.evaluation
        host, framework = (float(ev.breakdown[k][best]) if k in ev.breakdown else 0.0
                           for k in ("host/launch", "host/framework"))
        warning = host_warning(platform, host, float(ev.step_time_s[best]), "the top plan's step", framework)
        if warning:
            note(warning)


def _counts_line(candidates: int, evaluated: int, feasible: int, seconds: float, runnable: bool) -> str:
    return (f"{candidates:,} candidates, {evaluated:,} evaluated by the cost model, {feasible:,} fit, in "
            f"{seconds:.3f} s" + (" (runnable by the piper runtime only)" if runnable else ""))


def _sources_line(sources: dict[str, str], platform, cited_at: str) -> str:
    return f"compute: {short_compute_source(sources['compute'], platform, cited_at)} | host time: {sources['host']}"


# ---- output: one search per precision (--dtype LIST|any) -------------------------------------------------
def _emit_precisions(ctx, searches, model, platform, options, kwargs, top, as_json, as_csv, runnable, save_path,
                     migration, cited_at: str) -> None:
    from piper_plan.search.report import best_search, precision_rows, precisions_json

    winner = best_search(searches)
    mixed = mixed_rate_sources(searches, platform)
    if mixed:
        note(mixed)
    if winner is None:
        training, result = searches[0]
        _emit_nothing_fits(model, platform, training, result, options, kwargs, as_json)
        ctx.exit(EXIT_NOTHING_FITS)
    if as_json:
        print_json(precisions_json(searches, model, platform, top))
    elif as_csv:
        click.echo(_csv(precision_rows(searches, model, top)), nl=False)
    else:
        out = console()
        print_table(_plans_table(winner[1], platform, precision_rows(searches, model, top),
                                 winner[0].tokens_to_train), width=_table_width(out))
        for training, result in searches:
            counts = _counts_line(result.candidates_total, result.evaluated, result.feasible,
                                  result.search_seconds, runnable)
            out.print(f"{precision_text(training)}: {counts}", markup=False)
            out.print(f"{precision_text(training)}: " + _sources_line(result.sources, platform, cited_at),
                      markup=False)
    if save_path:
        path, plan = save_best(save_path, model, platform, winner[0], winner[1], kwargs, migration)
        note(f"saved {path} ({precision_text(winner[0])}; layers per stage: {plan.layers_per_stage})")


def mixed_rate_sources(searches, platform) -> str | None:
    """A warning where the searched precisions' GEMMs are priced from different kinds of rates, measured rows for one
    and the roofline fallback for another (h200: bf16 measured, fp16 not): their ranking then compares a
    measurement with a peak, and the fallback's precision leads by that alone. The advice: measure those the
    calibration sweep measures on this device, else compare within one precision or from the roofline alone."""
    from piper_plan.calibration.bench_gemm import gemm_points
    from piper_plan.cost.compute import ROOFLINE_FALLBACK

    fallback = [t.dtype for t, r in searches if ROOFLINE_FALLBACK in r.sources.get("compute", "")]
    measured = [t.dtype for t, _ in searches if t.dtype not in fallback]
    if not fallback or not measured:
        return None
    sweeps = {p.dtype for p in gemm_points(platform.launch.device, False)}
    can = [d for d in fallback if d in sweeps]
    advice = (f"measure them: `piper calibrate --platform {platform.name} --only gemm --dtype {','.join(can)}`" if can
              else f"piper calibrate measures no {', '.join(fallback)} GEMM on a {platform.launch.device} device: "
                   "rank one precision at a time, or price a plan of each from the roofline alone with `piper "
                   "estimate ... --no-calibration`")
    return (f"warning: {', '.join(measured)} GEMMs are priced from {platform.name}'s measured rows and "
            f"{', '.join(fallback)} from the roofline fallback: ranked together, a measurement meets a peak rate "
            f"({advice})")


def _plans_table(result, platform, rows: list[dict], tokens_to_train: float):
    """The ranked ``rows`` (plan_rows, or precision_rows with a dtype column) of a search at result.nodes."""
    from rich import box
    from rich.table import Table

    cap_GiB = platform.device.memory_bytes / 2**30
    nodes = f"{result.nodes} node" + ("s" if result.nodes != 1 else "")
    table = Table(title=f"top plans: {nodes}, {result.world} devices", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    with_dtype = any("dtype" in row for row in rows)
    degrees = ("dp", *(("cp",) if any(row.get("cp", 1) > 1 for row in rows) else ()), "tp", "pp", "ep", "etp")
    for label in ("#", *(("dtype",) if with_dtype else ()), *degrees, "mbs x M", "sched", "recomp", "z",
                  "a2a", f"GiB/{cap_GiB:.0f}", "step s", "tokens/s", "TF/dev", "MFU", "HFU", "a2a%", "node-h"):
        table.add_column(label, justify="left" if label in ("sched", "recomp", "a2a", "dtype") else "right",
                         no_wrap=True)
    for row in rows:
        table.add_row(str(row["rank"]) + ("" if row["runnable_by_piper"] else "*"),
                      *((row["dtype"],) if with_dtype else ()),
                      *(str(row.get(k, 1)) for k in degrees),
                      f"{row['mbs']} x {row['num_microbatches']}",
                      _short_schedule(row) + (" bal" if row.get("layers_split") == "balanced" else ""),
                      row["recompute"][:4],
                      str(row["zero"]), row["a2a"], f"{row['peak_memory_bytes'] / 2**30:.1f}",
                      f"{row['step_time_s']:.3g}", f"{row['tokens_per_s']:,.0f}", f"{row['tflops_per_device']:.3g}",
                      f"{100 * row['mfu']:.1f}%", f"{100 * row['hfu']:.1f}%", f"{100 * row['a2a_share']:.0f}%",
                      f"{row['node_hours_to_train']:,.0f}")
    notes = ["MFU, HFU: PaLM's FLOP count (attention non-causal, no MTP), of the peak of "
             + ("each plan's dtype" if with_dtype else "the training dtype")
             + "; --json and `piper estimate` add Megatron's (causal attention, MTP counted)",
             f"node-h: node-hours to train on {tokens_to_train:.3g} tokens at that speed (training.tokens_to_train)"]
    if any(row.get("layers_split") == "balanced" for row in rows):
        notes.append("'bal' after the schedule: FLOP-balanced layers per stage (the split -o writes); else even")
    missing = sorted({m for row in rows for m in row["runtime_missing"]})
    if missing:
        notes.append("* piper's runtime cannot run it (`piper launch` refuses): " + "; ".join(missing))
    table.caption = "\n".join(notes) or None
    return table


def _table_width(out) -> int | None:
    """A terminal keeps its own width; a pipe or a file gets the whole table rather than rich's 80 columns."""
    if not out.is_terminal and out.width < 150:
        out.width = 150     # Console.print(width=) can only narrow, so widen the (per-process) console itself
    return None


def _short_schedule(row: dict) -> str:
    if row["schedule"] == "interleaved":
        return f"int.v{row['virtual_stages']}"
    return row["schedule"]


def _reasons_table(reasons: dict[str, int]):
    from rich.table import Table

    table = Table(title="rejected candidates by reason")
    table.add_column("reason")
    table.add_column("count", justify="right")
    for name, count in reasons.items():
        table.add_row(name, f"{count:,}")
    return table


def _csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: "; ".join(v) if isinstance(v, list) else v for k, v in row.items()} for row in rows)
    return buf.getvalue()


# ---- --explain ----------------------------------------------------------------------------------------
def _explain_table(result):
    from rich.table import Table

    ex = explain_json(result)
    diff = ex.get("differences") or {}
    title = "winner vs runner-up" + (": " + ", ".join(f"{k} {a} vs {b}" for k, (a, b) in diff.items()) if diff else "")
    table = Table(title=title)
    for label in ("component", "winner s", "runner-up s", "runner-up - winner s"):
        table.add_column(label, justify="right" if label != "component" else "left")
    rows = [(n, v) for n, v in ex["breakdown"].items() if v["winner_s"] or v["runner_up_s"]]
    for name, v in sorted(rows, key=lambda kv: (-abs(kv[1]["delta_s"] or 0.0), -kv[1]["winner_s"])):
        table.add_row(name, f"{v['winner_s']:.4f}", "-" if v["runner_up_s"] is None else f"{v['runner_up_s']:.4f}",
                      "-" if v["delta_s"] is None else f"{v['delta_s']:+.4f}")
    return table


# ---- nothing fits ---------------------------------------------------------------------------------------
def _emit_nothing_fits(model, platform, training, result, options, kwargs, as_json) -> None:
    info = nothing_fits_json(model, platform, training, result, options, kwargs)
    if as_json:
        print_json(info)
        return
    out = console()
    out.print(f"nothing fits: {model.name} on {result.nodes} {platform.name} nodes "
              f"({result.candidates_total:,} candidates)", markup=False)
    print_table(_reasons_table(result.reasons))
    if info["fit_but_not_runnable"]:
        missing = ", ".join(f"{name} ({count:,})" for name, count in info["runtime_missing"].items())
        out.print(f"{info['fit_but_not_runnable']:,} candidates fit in memory, but piper's runtime cannot run them "
                  f"(--runnable): it lacks {missing}; without --runnable they are ranked", markup=False)
        return
    if not info["closest"]:
        out.print("no candidate is a valid plan: each is rejected for a reason counted above", markup=False)
        return
    from rich.table import Table

    table = Table(title="closest candidates")
    keys = ("dp", "cp", "tp", "pp", "ep", "etp", "mbs", "schedule", "recompute", "zero", "a2a")
    for label in (*keys, "peak GiB", "over by GiB"):
        table.add_column(label, justify="right")
    for r in info["closest"]:
        table.add_row(*(str(r[k]) for k in keys),
                      f"{r['peak_memory_bytes'] / 2**30:.1f}", f"{r['overflow_bytes'] / 2**30:.1f}")
    print_table(table)
    if info["nodes_needed"]:
        out.print(f"it fits on {info['nodes_needed']} nodes (piper plan --min-nodes)", markup=False)
    elif not info["all_closest_use_full_recompute"]:
        out.print("full activation recomputation is among the options and does not make it fit", markup=False)
    else:
        out.print(f"no node count up to {platform.node_limit} makes it fit", markup=False)


def _emit_nothing_at_any_size(model, platform, as_json) -> None:
    msg = f"nothing fits: {model.name} does not fit on any node count up to {platform.node_limit} of {platform.name}"
    if as_json:
        print_json({"model": model.name, "platform": platform.name, "feasible": 0, "plans": [],
                    "nodes_needed": None, "message": msg})
    else:
        console().print(msg, markup=False)


# ---- sweep ----------------------------------------------------------------------------------------------
def _emit_sweep(results, model, training, as_json) -> None:
    from piper_plan.search.engine import RefusedCount, scaling_rows
    from piper_plan.search.report import with_runtime_marks

    rows = scaling_rows(results)
    for row, result in zip(rows, results):
        if row["best"] is not None:
            row["best"] = with_runtime_marks(row["best"], model, training, result.options)
    if as_json:
        print_json({"sweep": rows, "search_seconds": sum(r.search_seconds for r in results),
                    "candidates_enumerated": sum(r.candidates_total for r in results),
                    "cost_model_evaluations": sum(r.evaluated for r in results
                                                  if not isinstance(r, RefusedCount)),
                    "feasible": sum(r.feasible for r in results)})
        return
    from rich.table import Table

    table = Table(title="scaling: best plan per node count (efficiency = tokens/s per device vs the first that fits)")
    labels = ("nodes", "devices", "dp", "cp", "tp", "pp", "ep", "tokens/s", "TFLOPS/dev", "MFU", "HFU", "speedup",
              "efficiency")
    for label in labels:
        table.add_column(label, justify="right")
    for row in rows:
        b = row["best"]
        if b is None:
            table.add_row(str(row["nodes"]), str(row["world"]), *["-"] * (len(labels) - 3),
                          "no valid plan (--json: why)" if row["refused"] else "nothing fits")
            continue
        table.add_row(str(row["nodes"]) + ("" if b["runnable_by_piper"] else "*"), str(row["world"]),
                      *(str(b[k]) for k in ("dp", "cp", "tp", "pp", "ep")),
                      f"{b['tokens_per_s']:,.0f}", f"{b['tflops_per_device']:.1f}", f"{100 * b['mfu']:.1f}%",
                      f"{100 * b['hfu']:.1f}%", f"{row['speedup']:.2f}x", f"{100 * row['efficiency']:.0f}%")
    missing = sorted({m for row in rows if row["best"] for m in row["best"]["runtime_missing"]})
    if missing:
        table.caption = "* piper's runtime cannot run it (`piper launch` refuses): " + "; ".join(missing)
    print_table(table, width=_table_width(console()))
