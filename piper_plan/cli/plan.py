"""``piper plan``: search every valid parallel configuration and rank it by predicted throughput.

Thin: parse, load, call ``piper_plan.search``, render (rich on stderr; --json / --csv on stdout).
Exit codes: 0 a plan fits; 2 user error; 3 nothing fits (the closest candidates and what would make them fit
are shown).
"""

from __future__ import annotations

import csv
import io

import click
import numpy as np

from piper_plan.cli.common import console, platform_calibration, print_json
from piper_plan.errors import PiperError
from piper_plan.fileio import check_writable

EXIT_NOTHING_FITS = 3
MIGRATION_DEFAULTS = {"enabled": True, "threshold": 1.1, "interval": 50, "max_iters": 16}
"""DESIGN.md's plan.json migration block; --migration records it enabled, otherwise enabled=false."""


@click.command("plan")
@click.option("--model", "model_name", required=True, help="Catalog name or YAML/JSON path.")
@click.option("--platform", "platform_name", required=True, help="Catalog name or YAML/JSON path.")
@click.option("--nodes", "nodes_text", default=None, help="Node count N, or a range A..B to sweep (doubling).")
@click.option("--min-nodes", is_flag=True, help="Find the smallest node count that fits (from --nodes, default 1).")
@click.option("--seq", "seq_len", type=int, default=4096, show_default=True, help="Sequence length, tokens.")
@click.option("--global-batch", type=int, default=1024, show_default=True, help="Sequences per step.")
@click.option("--strategy", type=click.Choice(["general", "piper"]), default="general", show_default=True,
              help="piper: the paper's PP x EP mesh (tp=1, dp=ep, ep <= devices per switch group).")
@click.option("--a2a", type=click.Choice(["flat", "halo", "any"]), default="any", show_default=True)
@click.option("--migration", is_flag=True, help="Record expert migration as enabled in the saved plan.")
@click.option("--runnable", is_flag=True, help="Keep only plans the piper runtime can execute.")
@click.option("--placement", type=click.Choice(["compact", "spread"]), default="compact", show_default=True)
@click.option("--memory-headroom", type=float, default=0.0, show_default=True,
              help="Fraction of device memory to keep free (0.1 = plans must fit in 90%).")
@click.option("--top", type=click.IntRange(min=0), default=10, show_default=True, help="Plans to show (0 = all).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
@click.option("--csv", "as_csv", is_flag=True, help="The ranked plans as CSV on stdout.")
@click.option("--save", "save_path", type=click.Path(dir_okay=False), default=None,
              help="Write the best plan as plan.json (DESIGN.md format).")
@click.option("--explain", is_flag=True, help="The winner's time breakdown vs the runner-up.")
@click.pass_context
def plan_cmd(ctx, model_name, platform_name, nodes_text, min_nodes, seq_len, global_batch, strategy, a2a, migration,
             runnable, placement, memory_headroom, top, as_json, as_csv, save_path, explain):
    """Search and rank every valid parallel configuration."""
    from piper_plan.search import engine
    from piper_plan.search.space import SearchOptions

    if as_json and as_csv:
        raise PiperError("--json and --csv both write stdout; choose one", field="--csv")
    if save_path:
        check_writable(save_path)
    model, platform, training = _load_inputs(model_name, platform_name, seq_len, global_batch)
    if not 0.0 <= memory_headroom < 1.0:
        raise PiperError(f"memory headroom {memory_headroom}; allowed 0 <= h < 1", field="--memory-headroom")
    options = SearchOptions(strategy=strategy, a2a=a2a, memory_headroom=memory_headroom)
    kwargs = {"calibration": platform_calibration(platform.name), "placement": placement,
              "unsupported": _unsupported_fn() if runnable else None, "cost_options": _cost_options(runnable)}
    counts = _node_counts(nodes_text, min_nodes)
    if len(counts) > 1:
        if save_path:
            raise PiperError("--save needs one node count (use --nodes N or --min-nodes)", field="--save")
        results = engine.sweep(model, platform, training, counts, options, **kwargs)
        _emit_sweep(results, training, as_json)
        return
    if min_nodes:
        _, result = engine.min_nodes(model, platform, training, options, start=counts[0], **kwargs)
        if result is None:
            _emit_nothing_at_any_size(model, platform, as_json)
            ctx.exit(EXIT_NOTHING_FITS)
    else:
        result = engine.search(model, platform, training, counts[0], options, **kwargs)
    if not result.feasible:
        _emit_nothing_fits(model, platform, training, result, options, kwargs, as_json)
        ctx.exit(EXIT_NOTHING_FITS)
    _emit_result(result, model, platform, training, top, as_json, as_csv, explain, runnable)
    if save_path:
        _save(save_path, model, platform, training, result, placement, migration, kwargs["calibration"],
              kwargs["cost_options"])


# ---- loading ------------------------------------------------------------------------------------------
def _load_inputs(model_name, platform_name, seq_len, global_batch):
    from piper_plan.catalog import load_model, load_platform
    from piper_plan.specs import TrainingSpec

    if seq_len < 1:
        raise PiperError(f"seq_len={seq_len}; must be >= 1", field="--seq")
    if global_batch < 1:
        raise PiperError(f"global_batch={global_batch}; must be >= 1", field="--global-batch")
    platform = load_platform(platform_name)
    training = TrainingSpec.for_device(platform.launch.device, seq_len=seq_len, global_batch=global_batch)
    return load_model(model_name), platform, training


def _unsupported_fn():
    try:
        from piper_plan.capability import unsupported_features
    except ImportError:
        raise PiperError("--runnable: the runtime capability list (piper_plan.capability) is not available yet") from None
    return unsupported_features


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


# ---- output: one search -------------------------------------------------------------------------------
def plan_rows(result, training, top: int) -> list[dict]:
    """The best ``top`` plans as dicts (degrees, figures, node-hours to train)."""
    rows = []
    for rank_index, i in enumerate(result.order[:top] if top > 0 else result.order, start=1):
        row = {"rank": rank_index, **result.row(int(i))}
        row["node_hours_to_train"] = training.tokens_to_train / row["tokens_per_s"] / 3600.0 * result.nodes
        rows.append(row)
    return rows


def result_json(result, model, platform, training, top: int) -> dict:
    return {
        "model": model.name, "platform": platform.name, "nodes": result.nodes, "world": result.world,
        "seq_len": training.seq_len, "global_batch": training.global_batch,
        "candidates_evaluated": result.candidates_total,
        "cost_model_evaluations": len(result.fields["dp"]),
        "feasible": result.feasible,
        "infeasible_reasons": result.reasons,
        "unsupported_features": result.unsupported,
        "search_seconds": result.search_seconds,
        "memory_limit_bytes": result.memory_limit_bytes,
        "plans": plan_rows(result, training, top),
        "pareto": [result.row(int(i)) for i in result.pareto],
    }


def _emit_result(result, model, platform, training, top, as_json, as_csv, explain, runnable) -> None:
    if as_json:
        obj = result_json(result, model, platform, training, top)
        if explain:
            obj["explain"] = explain_json(result)
        print_json(obj)
        return
    if as_csv:
        click.echo(_csv(plan_rows(result, training, top)), nl=False)
        return
    out = console()
    out.print(_plans_table(result, platform, training, top), width=_table_width(out))
    out.print(f"{result.candidates_total:,} candidates, {len(result.fields['dp']):,} evaluated by the cost model, "
              f"{result.feasible:,} fit, in {result.search_seconds:.3f} s"
              + (" (runnable by the piper runtime only)" if runnable else ""), markup=False)
    out.print(_reasons_table(result.reasons))
    if explain:
        out.print(_explain_table(result))


COLUMNS = (("dp", "dp"), ("tp", "tp"), ("pp", "pp"), ("ep", "ep"), ("etp", "etp"), ("mbs", "mbs"),
           ("num_microbatches", "M"), ("schedule", "schedule"), ("recompute", "recompute"), ("zero", "zero"),
           ("a2a", "a2a"))


def _plans_table(result, platform, training, top: int):
    from rich import box
    from rich.table import Table

    cap_GiB = platform.device.memory_bytes / 2**30
    table = Table(title=f"top plans: {result.nodes} nodes, {result.world} devices", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    for label in ("#", "dp tp pp ep etp", "mbs x M", "sched", "recomp", "z", "a2a", f"GiB/{cap_GiB:.0f}", "step s",
                  "tokens/s", "TF/dev", "MFU", "a2a%", "node-h"):
        table.add_column(label, justify="left" if label in ("sched", "recomp", "a2a") else "right", no_wrap=True)
    for row in plan_rows(result, training, top):
        table.add_row(str(row["rank"]), " ".join(str(row[k]) for k in ("dp", "tp", "pp", "ep", "etp")),
                      f"{row['mbs']} x {row['num_microbatches']}",
                      _short_schedule(row) + (" bal" if row.get("layers_split") == "balanced" else ""),
                      row["recompute"][:4],
                      str(row["zero"]), row["a2a"], f"{row['peak_memory_bytes'] / 2**30:.1f}",
                      f"{row['step_time_s']:.2f}", f"{row['tokens_per_s']:,.0f}", f"{row['tflops_per_device']:.1f}",
                      f"{100 * row['mfu']:.1f}%", f"{100 * row['a2a_share']:.0f}%", f"{row['node_hours_to_train']:,.0f}")
    table.caption = "bal = FLOP-balanced layers per stage (the split --save writes)"
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
        writer.writerows(rows)
    return buf.getvalue()


# ---- --explain ----------------------------------------------------------------------------------------
def runner_up(result) -> int | None:
    """The best plan with other degrees (dp, tp, pp, ep, etp) than the winner; else simply the second plan.

    Plans that differ only in a setting the model predicts no effect for (selective recompute with flash
    attention, say) tie with the winner and say nothing about what separates it from the alternatives."""
    if result.feasible < 2:
        return None
    f, order = result.fields, result.order
    w = order[0]
    differs = np.zeros(len(order) - 1, dtype=bool)
    for k in ("dp", "tp", "pp", "ep", "etp"):
        differs |= f[k][order[1:]] != f[k][w]
    hits = np.flatnonzero(differs)
    return int(order[1 + hits[0]]) if len(hits) else int(order[1])


def explain_json(result) -> dict:
    """The winner's breakdown (seconds per step by component) beside the runner-up's, and what differs."""
    winner = int(result.order[0])
    runner = runner_up(result)
    breakdown = result.evaluation.breakdown
    out = {"winner": result.row(winner), "runner_up": result.row(runner) if runner is not None else None,
           "breakdown": {}}
    for name in sorted(breakdown):
        values = np.asarray(breakdown[name])
        w = float(values[winner])
        r = float(values[runner]) if runner is not None else None
        out["breakdown"][name] = {"winner_s": w, "runner_up_s": r, "delta_s": None if r is None else r - w}
    if runner is not None:
        a, b = out["winner"], out["runner_up"]
        out["differences"] = {k: [a[k], b[k]] for k, _ in COLUMNS if a[k] != b[k]}
    return out


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
def nothing_fits_json(model, platform, training, result, options, kwargs) -> dict:
    """The closest candidates, their overflow, and the node count that would fit (if any)."""
    from piper_plan.search import engine, rank

    closest = [result.row(int(i)) for i in rank.closest_to_fitting(result.evaluation, result.memory_limit_bytes, 5)]
    for row in closest:
        row["overflow_bytes"] = max(0, row["peak_memory_bytes"] - int(result.memory_limit_bytes))
    start = result.nodes + 1
    needed = None
    if start <= platform.node_limit:
        needed, _ = engine.min_nodes(model, platform, training, options, start=start, **kwargs)
    return {"model": model.name, "platform": platform.name, "nodes": result.nodes, "feasible": 0,
            "candidates_evaluated": result.candidates_total, "infeasible_reasons": result.reasons,
            "search_seconds": result.search_seconds, "memory_limit_bytes": result.memory_limit_bytes,
            "plans": [], "closest": closest, "nodes_needed": needed,
            "all_closest_use_full_recompute": all(r["recompute"] == "full" for r in closest)}


def _emit_nothing_fits(model, platform, training, result, options, kwargs, as_json) -> None:
    info = nothing_fits_json(model, platform, training, result, options, kwargs)
    if as_json:
        print_json(info)
        return
    out = console()
    out.print(f"nothing fits: {model.name} on {result.nodes} {platform.name} nodes "
              f"({result.candidates_total:,} candidates)", markup=False)
    out.print(_reasons_table(result.reasons))
    from rich.table import Table

    table = Table(title="closest candidates")
    keys = ("dp", "tp", "pp", "ep", "etp", "mbs", "schedule", "recompute", "zero", "a2a")
    for label in (*keys, "peak GiB", "over by GiB"):
        table.add_column(label, justify="right")
    for r in info["closest"]:
        table.add_row(*(str(r[k]) for k in keys),
                      f"{r['peak_memory_bytes'] / 2**30:.1f}", f"{r['overflow_bytes'] / 2**30:.1f}")
    out.print(table)
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
def _emit_sweep(results, training, as_json) -> None:
    from piper_plan.search.engine import scaling_rows

    rows = scaling_rows(results)
    if as_json:
        print_json({"sweep": rows, "search_seconds": sum(r.search_seconds for r in results),
                    "candidates_evaluated": sum(r.candidates_total for r in results),
                    "feasible": sum(r.feasible for r in results)})
        return
    from rich.table import Table

    table = Table(title="scaling: best plan per node count (efficiency = tokens/s per device vs the first that fits)")
    for label in ("nodes", "devices", "dp", "tp", "pp", "ep", "tokens/s", "TFLOPS/dev", "MFU", "speedup", "efficiency"):
        table.add_column(label, justify="right")
    for row in rows:
        b = row["best"]
        if b is None:
            table.add_row(str(row["nodes"]), str(row["world"]), *["-"] * 8, "nothing fits")
            continue
        table.add_row(str(row["nodes"]), str(row["world"]), *(str(b[k]) for k in ("dp", "tp", "pp", "ep")),
                      f"{b['tokens_per_s']:,.0f}", f"{b['tflops_per_device']:.1f}", f"{100 * b['mfu']:.1f}%",
                      f"{row['speedup']:.2f}x", f"{100 * row['efficiency']:.0f}%")
    console().print(table, width=_table_width(console()))


# ---- --save ---------------------------------------------------------------------------------------------
def _save(path, model, platform, training, result, placement, migration, calibration, cost_options) -> None:
    from piper_plan.planfile import write_plan_file

    plan, prediction = choose_stage_split(model, platform, training, result, placement, calibration, cost_options)
    migration_block = dict(MIGRATION_DEFAULTS, enabled=bool(migration))
    write_plan_file(path, model, platform, training, result.nodes, plan, placement, prediction,
                    migration=migration_block)
    split = "FLOP-balanced" if plan.layers_per_stage is not None else "even"
    console().print(f"saved {path} ({split} layers per stage: {plan.stage_layers(model.num_layers)})", markup=False)


def choose_stage_split(model, platform, training, result, placement, calibration, cost_options=None):
    """The best plan with the layer split the search priced it with (cost/pipeline.py's rule: even or
    FLOP-balanced), and ``estimate``'s prediction of it, which equals its row in the ranking."""
    from piper_plan.cost.evaluate import estimate

    plan = result.plan(model, training, result.best)
    extra = {} if cost_options is None else {"options": cost_options}
    prediction = estimate(model, platform, training, result.nodes, plan, calibration=calibration, placement=placement,
                          **extra)
    return plan, prediction


def _cost_options(runnable: bool):
    """--runnable plans are for piper's own runtime: price them as it runs (cost/options.py)."""
    if not runnable:
        return None
    from piper_plan.cost.options import PIPER_RUNTIME_OPTIONS

    return PIPER_RUNTIME_OPTIONS
