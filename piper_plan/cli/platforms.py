"""``piper platforms`` and ``piper platform show NAME|FILE``."""

from __future__ import annotations

import click

from piper_plan.cli.common import console, exit_codes, json_option, print_json, print_table

GiB = 2**30


def platform_row(spec) -> dict:
    """The catalog-listing object of one platform (SI units, or the unit in the key)."""
    peaks = spec.device.peak_flops
    return {"name": spec.name, "device": spec.device.name, "devices_per_node": spec.devices_per_node,
            "memory_bytes": spec.device.memory_bytes, "peak_bf16_flops": peaks.get("bf16", peaks.get("fp16")),
            "node_injection_GBps": spec.node.injection_GBps, "max_nodes": spec.node_limit,
            "description": spec.description}


def platform_summary(spec) -> dict:
    """Everything ``piper platform show`` reports: the spec itself plus its derived numbers."""
    return {**platform_row(spec), "min_intra_node_link_GBps": spec.node.min_link_GBps,
            "nic_of_device": spec.node.nic_of_device, "spec": spec.model_dump(mode="json")}


def _tflops(flops: float | None) -> str:
    return "-" if flops is None else f"{flops / 1e12:.1f}"


def render_platforms_table(rows: list[dict]) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="piper platform catalog")
    for col in ("name", "device", "per node", "memory GiB", "bf16 TFLOPS", "injection GB/s/node", "max nodes"):
        table.add_column(col, justify="left" if col in ("name", "device") else "right")
    for r in rows:
        table.add_row(escape(r["name"]), escape(r["device"]), str(r["devices_per_node"]),
                      f"{r['memory_bytes'] / GiB:.0f}",
                      _tflops(r["peak_bf16_flops"]), f"{r['node_injection_GBps']:g}", str(r["max_nodes"]))
    print_table(table)


def efficiency_lines(eff: dict, has_fp8: bool) -> list[str]:
    """The roofline fallback's rates as the cost model takes them: GEMM (per precision), attention, each fp8
    recipe's time (where the device has an fp8 rate), the host time per GEMM call (0: not priced), and their
    source."""
    gemm = ", ".join([f"gemm {eff['gemm']:g}"] + [f"{k} {v:g}" for k, v in eff["gemm_by_dtype"].items()])
    recipes = ", ".join(f"{k} x{v:g}" for k, v in eff["fp8_recipe_time"].items()) or "not measured (kernel rate)"
    if eff["fp8_blockwise_runs_as_mxfp8"]:
        recipes += ", blockwise runs as mxfp8"
    host = eff["host_s_per_gemm_call"]
    return [f"efficiency: {gemm}; attention {eff['attention']:g}; "
            + (f"fp8 recipe time {recipes}; " if has_fp8 else "")
            + "host per GEMM call " + (f"{host * 1e6:.1f} us" if host else "not priced"),
            f"  source: {eff['source']}"]


def render_platform_summary(s: dict) -> None:
    out, spec = console(), s["spec"]
    dev, node, net = spec["device"], spec["node"], spec["network"]
    lines = [
        f"{s['name']}: {s['description']}",
        f"device: {dev['name']}, {dev['memory_bytes'] / GiB:.1f} GiB, {dev['memory_bandwidth_GBps']:g} GB/s, peak "
        + ", ".join(f"{k} {v / 1e12:g} TFLOPS" for k, v in dev["peak_flops"].items()),
        f"  source: {dev['source']}",
        f"node: {node['devices_per_node']} devices, {node['num_nics']} NICs x {node['nic_bandwidth_GBps']:g} GB/s, "
        f"device -> NIC {s['nic_of_device']}",
    ]
    lines += [f"  link {c['name']}: {c['bandwidth_GBps']:g} GB/s ({c['source']})" for c in node["link_classes"]]
    lines.append(f"network: {net['nodes_per_switch']} nodes/switch, {net['nodes_per_group']} nodes/group, "
                 f"{net['num_groups']} groups (max {s['max_nodes']} nodes), global taper {net['global_taper']:g}")
    lines += [f"  {scope}: {v['bandwidth_GBps']:g} GB/s per rank, {v['latency_us']:g} us ({v['source']})"
              for scope, v in net["scopes"].items()]
    lines += efficiency_lines(spec["efficiency"], "fp8" in dev["peak_flops"])
    lines.append(f"launch: template {spec['launch']['template']}, backend {spec['launch']['backend']}")
    for line in lines:
        out.print(line, markup=False)


@click.command("platforms", epilog=exit_codes())
@json_option(help="Print a JSON list on stdout.")
def platforms_cmd(as_json: bool) -> None:
    """List the platform catalog (platforms/*.yaml)."""
    from piper_plan.catalog import list_platforms

    rows = [platform_row(p) for p in list_platforms()]
    if as_json:
        print_json(rows)
    else:
        render_platforms_table(rows)


@click.group("platform")
def platform_group() -> None:
    """Show one platform spec."""


@platform_group.command("show", epilog=exit_codes())
@click.argument("platform")
@json_option(help="Print one JSON object on stdout.")
def show_cmd(platform: str, as_json: bool) -> None:
    """Devices, links, NICs, network scopes and their sources (PLATFORM: catalog name or YAML file)."""
    from piper_plan.catalog import load_platform

    summary = platform_summary(load_platform(platform))
    if as_json:
        print_json(summary)
    else:
        render_platform_summary(summary)
