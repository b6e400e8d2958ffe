"""``piper estimate``: memory per stage and step time of ONE parallel plan, with the full breakdown.

Thin: parse, load, call ``piper_plan.cost.evaluate.estimate``, render (rich tables on stderr; --json on
stdout). A plan that does not fit is a result (shown with its overflow), not an error; invalid degrees are
a PiperError (exit 2). ``--save`` writes plan.json after the estimate succeeded.
"""

from __future__ import annotations

import click

from piper_plan.cli.common import console, platform_calibration, print_json
from piper_plan.errors import PiperError

GiB = 2**30


@click.command("estimate")
@click.option("--model", "model_name", required=True, help="Catalog name or YAML/JSON path.")
@click.option("--platform", "platform_name", required=True, help="Catalog name or YAML/JSON path.")
@click.option("--nodes", type=int, required=True, help="Nodes of the allocation.")
@click.option("--dp", type=int, default=1, show_default=True, help="Data-parallel degree (dense weights).")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel degree.")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline stages.")
@click.option("--ep", type=int, default=1, show_default=True, help="Expert-parallel degree.")
@click.option("--etp", type=int, default=1, show_default=True, help="Tensor-parallel degree inside an expert.")
@click.option("--mbs", type=int, default=1, show_default=True, help="Micro-batch size, sequences.")
@click.option("--schedule", type=click.Choice(["gpipe", "1f1b", "interleaved"]), default="1f1b", show_default=True)
@click.option("--virtual-stages", type=int, default=None, help="Model chunks per rank (interleaved; default 2).")
@click.option("--recompute", type=click.Choice(["none", "selective", "full"]), default="none", show_default=True)
@click.option("--zero", type=click.Choice(["0", "1"]), default="1", show_default=True, help="ZeRO stage.")
@click.option("--a2a", type=click.Choice(["flat", "halo"]), default="flat", show_default=True)
@click.option("--seq", "seq_len", type=int, default=4096, show_default=True, help="Sequence length, tokens.")
@click.option("--global-batch", type=int, default=1024, show_default=True, help="Sequences per step.")
@click.option("--routing-skew", type=float, default=1.0, show_default=True,
              help="Expected max / mean tokens per expert-parallel rank.")
@click.option("--placement", type=click.Choice(["compact", "spread"]), default="compact", show_default=True)
@click.option("--no-calibration", is_flag=True, help="Ignore calibration/<platform>/ (roofline fallback).")
@click.option("--piper-runtime", is_flag=True,
              help="Price activations as piper's own runtime saves them (unfused kernels), not Megatron's fused ones.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
@click.option("--save", "save_path", type=click.Path(dir_okay=False), default=None,
              help="Write the plan as plan.json (DESIGN.md format).")
def estimate_cmd(model_name, platform_name, nodes, dp, tp, pp, ep, etp, mbs, schedule, virtual_stages, recompute,
                 zero, a2a, seq_len, global_batch, routing_skew, placement, no_calibration, piper_runtime, as_json,
                 save_path):
    """Predict memory and step time of one parallel plan."""
    from piper_plan.cost.evaluate import estimate
    from piper_plan.cost.options import DEFAULT_OPTIONS, PIPER_RUNTIME_OPTIONS

    model, platform, training = _load_inputs(model_name, platform_name, seq_len, global_batch, routing_skew)
    plan = _build_plan(model, platform, training, nodes, dp=dp, tp=tp, pp=pp, ep=ep, etp=etp, mbs=mbs,
                       schedule=schedule, virtual_stages=virtual_stages, recompute=recompute, zero=int(zero),
                       a2a=a2a)
    calibration = None if no_calibration else platform_calibration(platform.name)
    options = PIPER_RUNTIME_OPTIONS if piper_runtime else DEFAULT_OPTIONS
    result = estimate(model, platform, training, nodes, plan, calibration=calibration, placement=placement,
                      options=options)
    other = "spread" if placement == "compact" else "compact"
    alt = estimate(model, platform, training, nodes, plan, calibration=calibration, placement=other, options=options)
    if abs(alt["step_time_s"] - result["step_time_s"]) > 1e-9 * result["step_time_s"]:
        result["other_placement"] = {"placement": other, "step_time_s": alt["step_time_s"],
                                     "tokens_per_s": alt["tokens_per_s"], "scopes": alt["scopes"]}
    if save_path:
        from piper_plan.planfile import write_plan_file

        write_plan_file(save_path, model, platform, training, nodes, plan, placement, result)
    if as_json:
        print_json(result)
    else:
        render(result, model, platform, plan)
        if save_path:
            console().print(f"wrote {save_path}", markup=False)


def _load_inputs(model_name, platform_name, seq_len, global_batch, routing_skew):
    from pydantic import ValidationError

    from piper_plan.catalog import load_model, load_platform, validation_message
    from piper_plan.specs import TrainingSpec

    model, platform = load_model(model_name), load_platform(platform_name)
    try:
        training = TrainingSpec.for_device(platform.launch.device, seq_len=seq_len, global_batch=global_batch,
                                           routing_skew=routing_skew)
    except ValidationError as exc:
        raise PiperError(validation_message(exc), field="training options") from None
    return model, platform, training


def _build_plan(model, platform, training, nodes, **degrees):
    """A checked ParallelPlan; every problem is one PiperError line."""
    from pydantic import ValidationError

    from piper_plan.catalog import validation_message
    from piper_plan.specs import ParallelPlan, check_plan

    if nodes < 1:
        raise PiperError(f"nodes={nodes}; must be >= 1", field="--nodes")
    if degrees["virtual_stages"] is None:
        degrees["virtual_stages"] = 2 if degrees["schedule"] == "interleaved" else 1
    dp, mbs = degrees["dp"], degrees["mbs"]
    if dp < 1 or mbs < 1:
        raise PiperError(f"dp={dp}, mbs={mbs}; both must be >= 1", field="parallel")
    degrees["num_microbatches"] = max(training.global_batch // (dp * mbs), 1)
    try:
        plan = ParallelPlan(**degrees)
    except ValidationError as exc:
        raise PiperError(validation_message(exc), field="parallel") from None
    check_plan(plan, model, training, nodes * platform.devices_per_node)
    if plan.schedule == "interleaved" and model.num_layers % (plan.pp * plan.virtual_stages):
        raise PiperError(f"schedule=interleaved needs num_layers={model.num_layers} divisible by pp x virtual_stages "
                         f"= {plan.pp} x {plan.virtual_stages}", field="parallel")
    return plan


# ---- rendering (human output, stderr) --------------------------------------------------------------
def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f}"


def memory_table(result: dict, device_bytes: float):
    from rich.table import Table

    table = Table(title="Memory per rank, by pipeline stage (GiB; layers: all/MoE; other: framework + fragmentation)")
    for col in ("stage", "layers", "weights", "grads", "optim", "acts", "other", "total", "over"):
        table.add_column(col, justify="right", no_wrap=True)
    for s in result["memory"]["per_stage"]:
        c = s["components"]
        acts = sum(v for k, v in c.items() if k.startswith("activations/"))
        over = c["fragmentation"] + c["framework"]
        fits = "-" if s["total_bytes"] <= device_bytes else f"+{_gib(s['total_bytes'] - device_bytes)}"
        table.add_row(str(s["stage"]), f"{s['layers']}/{s['moe_layers']}", _gib(c["weights"]),
                      _gib(c["gradients"]), _gib(c["optimizer"]), _gib(acts), _gib(over), _gib(s["total_bytes"]),
                      fits)
    return table


def time_table(result: dict):
    from rich.table import Table

    step = result["step_time_s"]
    table = Table(title="Time per step, by component (bottleneck stage)")
    table.add_column("component")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for name, seconds in sorted(result["time"]["breakdown"].items(), key=lambda kv: -kv[1]):
        if seconds > 0:
            table.add_row(name, f"{seconds:.4g}", f"{seconds / step:.1%}")
    table.add_row("total", f"{step:.4g}", "100%")
    return table


def render(result: dict, model, platform, plan) -> None:
    out = console()
    device = platform.device.memory_bytes
    out.print(f"{model.name} on {result['nodes']} x {platform.name} nodes ({result['placement']}): "
              f"dp={plan.dp} tp={plan.tp} pp={plan.pp} ep={plan.ep} etp={plan.etp} edp={plan.edp} mbs={plan.mbs} "
              f"M={plan.num_microbatches} {plan.schedule} recompute={plan.recompute} zero={plan.zero} a2a={plan.a2a}",
              markup=False)
    out.print(memory_table(result, device))
    out.print(time_table(result))
    mem = result["memory"]
    verdict = "fits" if result["fits"] else f"does NOT fit: overflows by {_gib(mem['overflow_bytes'])} GiB"
    out.print(f"peak memory {_gib(mem['peak_bytes'])} of {_gib(device)} GiB per device: {verdict}", markup=False)
    tr = result["training"]
    out.print(f"step {result['step_time_s']:.4g} s | {result['tokens_per_s']:.4g} tokens/s | "
              f"{result['tflops_per_device']:.1f} TFLOPS/device | MFU {result['mfu']:.1%} | HFU {result['hfu']:.1%} | "
              f"all-to-all {result['a2a_share']:.1%} of the step", markup=False)
    out.print(f"to train {model.name} on {tr['steps']:.4g} steps: {tr['time_to_train_s'] / 86400:.2f} days, "
              f"{tr['node_hours']:.4g} node-hours | checkpoint {result['checkpoint']['total_bytes'] / 1e9:.1f} GB "
              f"total, {result['checkpoint']['per_rank_bytes'] / 1e9:.2f} GB per rank (max)", markup=False)
    out.print(f"scopes: {result['scopes']} | compute: {result['sources']['compute']}"
              + (" | some points EXTRAPOLATED beyond calibration" if result["sources"]["extrapolated"] else ""),
              markup=False)
    out.print(f"expert all-to-all ({result['sources'].get('a2a_algorithm', '')}): {result['sources']['a2a']}",
              markup=False)
    if "other_placement" in result:
        o = result["other_placement"]
        out.print(f"with a {o['placement']} allocation: step {o['step_time_s']:.4g} s, "
                  f"{o['tokens_per_s']:.4g} tokens/s (scopes {o['scopes']})", markup=False)
