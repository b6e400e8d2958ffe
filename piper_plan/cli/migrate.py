"""``piper migrate simulate``: run the expert-migration planners on synthetic or measured loads."""

from __future__ import annotations

import math

import click

from piper_plan.cli.common import AsciiInt, console, exit_codes, json_option, print_json, print_table
from piper_plan.errors import PiperError

MAX_EXPERTS = 16_384
"""Largest --experts: the planners' memory grows as E^2 (measured: E=65,536 took 1.7 GB for one layer);
published MoE models have at most 384 routed experts (Kimi K2)."""
MAX_LOAD_CELLS = 2**20
"""Largest layers x experts simulated (measured: 1,024 x 1,000 took ~10 s on a 2-core CPU)."""
MAX_SWAP_CELLS = 2**30
"""Largest hill-climbing work: layers x swaps x (experts per rank)^2 load pairs, swaps counted as min(--max-iters,
E) per layer (each swap compares every expert of the most loaded rank with every one of the least loaded; measured:
16 swaps of 8,192 experts per rank, 2^30 pairs, took 5.7 s on a 2-core CPU)."""
OPTIMAL_MAX_PARTITIONS = 20_000
"""The exact optimum is added when one layer has at most this many equal partitions (milliseconds each)."""


@click.group("migrate")
def migrate_group() -> None:
    """Expert migration: simulate the swap planner."""


@migrate_group.command("simulate", epilog=exit_codes())
@click.option("--experts", "num_experts", type=AsciiInt(min=1, max=MAX_EXPERTS),
              help="Experts per MoE layer (E); default: the model's.")
@click.option("--ep", type=AsciiInt(min=1), required=True,
              help="Ranks in the expert-parallel group (G); must divide E.")
@click.option("--layers", "num_layers", type=AsciiInt(min=1),
              help="MoE layers to simulate (default 1; a FILE sets its own).")
@click.option("--skew", default="zipf:1.2", show_default=True,
              help="Loads: zipf:S, dirichlet:A, uniform, or a runtime metrics.jsonl (expert_tokens summed over steps).")
@click.option("--threshold", type=click.FloatRange(min=1.0), default=1.1, show_default=True,
              help="Migrate a layer only when its max/mean rank load exceeds this.")
@click.option("--max-iters", type=AsciiInt(min=0), default=16, show_default=True,
              help="Hill-climbing swaps per layer (T).")
@click.option("--seed", type=AsciiInt(min=0), default=0, show_default=True, help="Seed of the synthetic loads.")
@click.option("--model", help="Model (catalog name or file): prices bytes per expert.")
@click.option("--platform", help="Platform (catalog name or file): prices the intra-group bandwidth.")
@click.option("--placement", type=click.Choice(["compact", "spread"]), default="compact", show_default=True,
              help="Node allocation when the EP group spans nodes (sets its network scope).")
@click.option("--with-grads", is_flag=True, help="Also move gradients (the paper's 16 B/param); default: weights + master + optimizer.")
@json_option(help="Machine output on stdout.")
def simulate_cmd(num_experts, ep, num_layers, skew, threshold, max_iters, seed, model, platform, placement,
                 with_grads, as_json):
    """Imbalance before/after, swaps, experts and bytes moved, per planning algorithm."""
    from piper_plan.placement import migration

    if not math.isfinite(threshold):
        raise PiperError(f"--threshold {threshold}: must be a finite number >= 1.0")
    model_spec = _load_model(model)
    loads_LE, skew_spec = _loads(skew, num_experts, num_layers, seed, model_spec, model)
    if loads_LE.shape[1] % ep:
        raise PiperError(f"--ep {ep} must divide the number of experts {loads_LE.shape[1]}")
    _check_swap_work(*loads_LE.shape, ep, max_iters)
    pricing = _pricing(model_spec, platform, ep, with_grads, placement)
    placement = migration.contiguous_placement(loads_LE.shape[1], ep)
    results = _run_planners(loads_LE, placement, ep, threshold, max_iters)
    report = {
        "experts": loads_LE.shape[1], "ep": ep, "layers": loads_LE.shape[0], "skew": skew_spec.describe(),
        "seed": seed, "threshold": threshold, "max_iters": max_iters,
        "pricing": None if pricing is None else _pricing_dict(pricing, model_spec, platform),
        "algorithms": {r.algorithm: migration.summary(r, pricing) for r in results},
        "bound": {"max_over_mean": migration.bound_max_over_mean(loads_LE, ep),
                  "mean_load_max_over_mean": 1.0},
    }
    if as_json:
        print_json(report)
    else:
        _render(report)


def _load_model(model: str | None):
    if model is None:
        return None
    from piper_plan.catalog import load_model

    spec = load_model(model)
    if spec.moe is None:
        raise PiperError(f"--model {model}: field moe is not set (a dense model has no experts to migrate)")
    return spec


def _loads(skew: str, num_experts, num_layers, seed: int, model_spec, model: str | None = None):
    """-> (loads float [L, E], Skew); E and L from the options, else the model, else the file."""
    from piper_plan.placement.loads import parse_skew, read_metrics_loads, synthetic_loads

    spec = parse_skew(skew)
    if model_spec is not None:
        if num_experts is not None and num_experts != model_spec.moe.num_experts:
            raise PiperError(f"--experts {num_experts} contradicts --model {model_spec.name} "
                             f"(moe.num_experts = {model_spec.moe.num_experts})")
        num_experts = model_spec.moe.num_experts
        if num_experts > MAX_EXPERTS:
            raise PiperError(f"--model {model}: moe.num_experts = {num_experts:,}; the planners simulate at most "
                             f"{MAX_EXPERTS:,} experts (as --experts)")
    if spec.kind == "file":
        loads = read_metrics_loads(spec.path)
        _check_file_shape(loads, num_experts, num_layers, spec)
        return loads, spec
    if num_experts is None:
        raise PiperError("--experts is required (or --model, or a metrics.jsonl as --skew)")
    if num_experts * (num_layers or 1) > MAX_LOAD_CELLS:
        raise PiperError(f"experts {num_experts} x --layers {num_layers} = {num_experts * num_layers} load cells; "
                         f"allowed at most {MAX_LOAD_CELLS}")
    return synthetic_loads(spec, num_experts, num_layers or 1, seed), spec


def _check_swap_work(num_layers: int, num_experts: int, ep: int, max_iters: int) -> None:
    """One line when the hill climb would compare more load pairs than MAX_SWAP_CELLS (minutes and GBs)."""
    swaps, per_rank = min(max_iters, num_experts), num_experts // ep
    if num_layers * swaps * per_rank**2 > MAX_SWAP_CELLS:
        raise PiperError(f"{num_layers:,} layers x {swaps:,} swaps x ({per_rank:,} experts per rank)^2 = "
                         f"{num_layers * swaps * per_rank**2:,} load pairs to compare; allowed at most "
                         f"{MAX_SWAP_CELLS:,}: fewer --layers or --max-iters, or a larger --ep", field="--ep")


def _check_file_shape(loads, num_experts, num_layers, spec) -> None:
    layers, experts = loads.shape
    if experts > MAX_EXPERTS or layers * experts > MAX_LOAD_CELLS:
        raise PiperError(f"expert_tokens has {layers:,} MoE layers x {experts:,} experts; the planners simulate at "
                         f"most {MAX_EXPERTS:,} experts and {MAX_LOAD_CELLS:,} load cells (as --experts, --layers)",
                         path=str(spec.path))
    if num_experts is not None and experts != num_experts:
        raise PiperError(f"expert_tokens has {experts} experts per layer, --experts/--model say {num_experts}",
                         path=str(spec.path))
    if num_layers is not None and layers != num_layers:
        raise PiperError(f"expert_tokens has {layers} MoE layers, --layers says {num_layers}", path=str(spec.path))


def _pricing(model_spec, platform: str | None, ep: int, with_grads: bool, placement: str):
    """MovePricing when both --model and --platform are given; None when neither."""
    if model_spec is None and platform is None:
        return None
    if model_spec is None or platform is None:
        raise PiperError("--model and --platform go together (bytes per expert need the model, time the platform)")
    from piper_plan.catalog import load_platform
    from piper_plan.placement.migration import expert_move_pricing
    from piper_plan.specs import TrainingSpec

    return expert_move_pricing(model_spec, load_platform(platform), TrainingSpec(), ep, with_grads, placement)


def _pricing_dict(pricing, model_spec, platform: str) -> dict:
    return {"model": model_spec.name, "platform": platform, "params_per_expert": pricing.params_per_expert,
            "bytes_per_param": pricing.bytes_per_param, "counted": pricing.counted,
            "bytes_per_expert": pricing.bytes_per_expert, "scope": pricing.scope,
            "bandwidth_GBps": pricing.bandwidth_GBps, "bandwidth_source": pricing.source}


def _run_planners(loads_LE, placement, ep: int, threshold: float, max_iters: int) -> list:
    from piper_plan.placement import migration

    results = [migration.hill_climb(loads_LE, placement, ep, threshold, max_iters),
               migration.greedy_replacement(loads_LE, placement, ep, threshold)]
    if migration.num_equal_partitions(loads_LE.shape[1], ep) <= OPTIMAL_MAX_PARTITIONS:
        results.append(migration.optimal_replacement(loads_LE, placement, ep, threshold))
    return results


def _render(report: dict) -> None:
    from rich.table import Table

    out = console()
    out.print(f"loads {report['skew']}: E={report['experts']} experts, ep={report['ep']}, "
              f"{report['layers']} layer(s); threshold {report['threshold']:g}, max {report['max_iters']} swaps/layer",
              markup=False)
    p = report["pricing"]
    if p:
        out.print(f"{p['model']}: {p['params_per_expert'] / 1e6:.1f}M params/expert x {p['counted']} = "
                  f"{p['bytes_per_expert'] / 1e9:.3f} GB/expert; {p['platform']} {p['scope']} scope "
                  f"{p['bandwidth_GBps']:g} GB/s ({p['bandwidth_source']})", markup=False)
    table = Table("algorithm", "max/mean before", "after", "swaps", "experts moved", "GB moved", "time ms")
    for name, r in report["algorithms"].items():
        gb = "-" if r["bytes_moved"] is None else f"{r['bytes_moved'] / 1e9:.3f}"
        ms = "-" if r["time_s"] is None else f"{r['time_s'] * 1e3:.1f}"
        table.add_row(name, f"{r['before']['max_over_mean']:.3f}", f"{r['after']['max_over_mean']:.3f}",
                      str(r["num_swaps"]), str(r["experts_moved"]), gb, ms)
    table.add_row("bound", "", f"{report['bound']['max_over_mean']:.3f}", "", "", "", "")
    print_table(table)
