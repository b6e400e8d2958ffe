"""``piper bench``: communication benchmarks. ``piper bench a2a``: flat vs HALO all-to-all.

On one machine the command spawns ``nodes x ranks_per_node`` gloo processes with an emulated topology (over
loopback, or with ``--emulate-network`` over an emulated multi-node network: one network namespace per node,
rate-limited uplinks, scripts/netemu.sh, root); under torchrun or srun every rank runs it and the topology comes from the job. It prints a table, checks
HALO against ``all_to_all_single`` with ``--verify`` (exit 0 only when every check passed), and merges
``all_to_all`` / ``halo_all_to_all`` rows into ``calibration/<platform>/collectives.csv``.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import click

from piper_plan.cli.common import (AsciiInt, EXIT_CHECK_FAILED, diagnostics, exit_codes, json_option, note,
                                   out_dir_option, print_json, print_table)
from piper_plan.calibration.timing import MAX_CALLS
from piper_plan.errors import PiperError

@click.group("bench")
def bench_group() -> None:
    """Communication benchmarks (flat vs HALO all-to-all)."""


@bench_group.command("a2a", epilog=exit_codes({EXIT_CHECK_FAILED: "--verify found HALO different from all_to_all_single"}))
@click.option("--algo", default="flat,halo", show_default=True, help="Algorithms to time: flat, halo.")
@click.option("--nodes", type=AsciiInt(min=1), default=2, show_default=True,
              help="Nodes to emulate on one machine (ignored under torchrun/srun: the job's own).")
@click.option("--ranks-per-node", type=AsciiInt(min=1), default=4, show_default=True,
              help="Ranks per emulated node.")
@click.option("--sizes", default="4K,64K,1M", show_default=True,
              help="bytes_per_rank (nccl-tests 'size'; K = 1024).")
@click.option("--verify", is_flag=True, help="Check HALO == all_to_all_single exactly (outputs and gradients).")
@click.option("--platform", "platform_name", default=None,
              help="Platform for the NIC map, scope and calibration folder (required unless --no-save).")
@click.option("--repeats", type=AsciiInt(1, MAX_CALLS), default=5, show_default=True, help="Timed calls per size.")
@click.option("--warmup", type=AsciiInt(0, MAX_CALLS), default=1, show_default=True, help="Untimed calls first.")
@out_dir_option("output_dir", "Folder whose collectives.csv receives the rows [default: calibration/<platform>].",
                old=("--output-dir",))
@click.option("--no-save", is_flag=True, help="Do not write calibration rows.")
@click.option("--emulate-network", "network_text", default=None, metavar="uplink_GBps=R,uplinks=U",
              help="Run the ranks on an emulated multi-node network (one namespace per node, U uplinks of R GB/s "
                   "each way; root, iproute2; scripts/netemu.sh).")
@json_option(help="Print the results as JSON on stdout.")
def a2a_cmd(algo, nodes, ranks_per_node, sizes, verify, platform_name, repeats, warmup, output_dir, no_save,
            network_text, as_json):
    """Time flat vs HALO all-to-all (and verify HALO) on emulated or real nodes."""
    from piper_plan.calibration import bench_a2a as bench
    from piper_plan.calibration.netemu import parse_network
    from piper_plan.catalog import load_platform
    from piper_plan.launchenv import read_launch_env

    if platform_name is None and not no_save:
        raise PiperError("give --platform P (calibration/P/collectives.csv receives the rows), or --no-save",
                         field="--platform")
    if no_save and output_dir is not None:
        raise PiperError(f"{output_dir}: --no-save writes no rows; drop --out-dir or --no-save", field="--out-dir")
    network = parse_network(network_text) if network_text is not None else None
    platform = load_platform(platform_name) if platform_name else None
    config = bench.BenchConfig(
        algos=bench.parse_algos(algo), sizes_bytes=bench.parse_sizes(sizes), nodes=nodes,
        ranks_per_node=ranks_per_node, repeats=repeats, warmup=warmup, verify=verify,
        devices_per_node=platform.node.devices_per_node if platform else None,
        device_nic=tuple(platform.node.nic_of_device) if platform else None)
    launch = read_launch_env()
    launched = launch.launched
    if platform is not None and not no_save:
        _check_rows_are_the_platforms(platform, _backend(platform) if launched else "gloo")
    bench.check_sizes_differ(config.sizes_bytes, launch.world_size if launched else nodes * ranks_per_node)
    if launched:
        rank, result = bench.run_launched(config, _backend(platform))
    else:
        bench.check_local_spawn(nodes, ranks_per_node, config.sizes_bytes)
        where = f" on the emulated network {network.text}" if network else ""
        with diagnostics().status(f"spawning {nodes * ranks_per_node} gloo ranks ({nodes} x {ranks_per_node}){where}"):
            rank, result = 0, (bench.network_bench(config, network) if network else bench.spawn_bench(config))
    if rank != 0:
        sys.exit(0 if result.passed else EXIT_CHECK_FAILED)
    _report(result, verify, as_json)
    if result.passed and not no_save:
        _save(result, platform, Path(output_dir) if output_dir is not None else None, launched)
    sys.exit(0 if result.passed else EXIT_CHECK_FAILED)


def _check_rows_are_the_platforms(platform, backend: str) -> None:
    """Refuse, before measuring, rows that would price ``platform``'s all-to-all by another backend's timings: gloo
    ranks on this host written into a GPU platform's calibration made its expert all-to-all thousands of times
    slower (Qwen3-30B on 4 Frontier nodes: 100 s a step -> 444,100 s)."""
    if backend != platform.launch.backend:
        raise PiperError(f"{platform.name} runs {platform.launch.backend} on {platform.launch.device} devices and this "
                         f"measurement would run {backend} here: its rows are not {platform.name}'s; allowed: "
                         "--no-save, a platform of this backend (local-cpu, netemu), or a job on the platform's nodes",
                         field="--platform")


def _backend(platform) -> str:
    import torch

    wanted = platform.launch.backend if platform else "gloo"
    return "nccl" if wanted == "nccl" and torch.cuda.is_available() else "gloo"


def _report(result, verify: bool, as_json: bool) -> None:
    from rich.table import Table

    from piper_plan.calibration.schema import collective_bandwidths_GBps

    for size in result.sizes:
        for error in size.errors[:5]:
            note(f"FAILED: {error}")
    if as_json:
        from dataclasses import asdict

        print_json({**asdict(result), "passed": result.passed})
        return

    where = "emulated on one machine" if result.emulated else "from the job"
    where += f", network {result.network}" if result.network else ""
    table = Table(title=f"all-to-all, {result.num_nodes} nodes x {result.ranks_per_node} ranks "
                        f"({result.backend}, topology {where})")
    for col in ("bytes/rank", "flat ms", "halo ms", "halo/flat", "halo busbw GB/s", "verified"):
        table.add_column(col, justify="right")
    for size in result.sizes:
        flat, halo = size.seconds.get("flat"), size.seconds.get("halo")
        ratio = f"{halo / flat:.2f}" if flat and halo else "-"
        busbw = "-" if not halo else \
            f"{collective_bandwidths_GBps('all_to_all', result.num_ranks, size.bytes_per_rank, halo)[1]:.3f}"
        checked = ("yes" if not size.errors else "FAILED") if verify else "-"
        table.add_row(f"{size.bytes_per_rank:,}", _ms(flat), _ms(halo), ratio, busbw, checked)
    print_table(table)


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.3f}" if seconds is not None else "-"


def _save(result, platform, output_dir: Path | None, launched: bool) -> None:
    from piper_plan.calibration import bench_a2a as bench
    from piper_plan.calibration.bench_collectives import scope_of_nodes
    from piper_plan.catalog import calibration_dir

    scope = scope_of_nodes(result.num_nodes, platform.network)
    how = "emulated topology, one host" if result.emulated else "job topology"
    how += f", emulated network {result.network}" if result.network else ""
    command = " ".join(["piper"] + sys.argv[1:]) if sys.argv and sys.argv[0].endswith("piper") else "piper bench a2a"
    source = (f"measured: {command} on {socket.gethostname()} {time.strftime('%Y-%m-%d')} "
              f"({result.backend}, {how})")
    directory = output_dir or calibration_dir(platform.name)
    path = bench.write_collective_rows(directory, bench.collective_rows(result, scope, source))
    note(f"wrote {len(result.sizes) * len(result.sizes[0].seconds)} rows to {path}")
