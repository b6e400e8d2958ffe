"""Where the time of a flat and a HALO all-to-all goes on the emulated network: phase by phase, per rank.

A probe for the all-to-all model (piper_plan/cost/comm.py; docs/halo-measured.md). Run as root:

    .venv/bin/python benchmarks/halo_phases.py --rate 0.2 --nodes 2 --ranks-per-node 2 --out /tmp/phases.json

Each rank (gloo, 2 uplinks per node, scripts/netemu.sh) times, per message size, with a barrier before every
sample (so each figure is one operation from a common start, not a pipelined stream):

- ``flat``: ``all_to_all_single`` on all ranks (as benchmarks/halo_network.py measures it);
- ``flat_remote``: the same with the rows for the rank's own node left out (inter-node part only);
- ``flat_local``: only the rows for the rank's own node (intra-node part only);
- ``halo``: HALO's exchange, and inside it the seconds from the start to the end of phase II (``halo_to_II``)
  and to the end of phase III (``halo_to_III``);
- ``phase_I`` / ``phase_II`` / ``phase_III``: each phase alone.

Prints and writes the slowest rank's median (``--statistic min``: fastest call) of each, in seconds, per size, and the tbf counters of every
uplink over the whole run (bytes sent, packets dropped).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from piper_plan.calibration.timing import STATISTICS  # noqa: E402

SIZES = (4096, 1024 * 1024, 16 * 1024 * 1024)
REPEATS = 5
COPIES_ONLY = "--copies" in sys.argv


def timed(fn, repeats: int) -> list[float]:
    """``repeats`` samples of fn(), each after a barrier; fn returns a dict of named durations."""
    import torch.distributed as dist

    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        dist.barrier()
        samples.append(fn())
    return samples


def probe_size(halo, nbytes: int, repeats: int, statistic: str) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from piper_plan.calibration.bench_a2a import message_shape

    world = dist.get_world_size()
    rows, width = message_shape(nbytes, world)
    splits = [rows] * world
    x = torch.randn(rows * world, width)
    out = torch.empty_like(x)
    mine = set(i for i in range(world) if halo.node_of[i] == halo.node_of[halo.me])
    remote = [0 if i in mine else rows for i in range(world)]
    local = [rows if i in mine else 0 for i in range(world)]
    layout = halo.layout(torch.tensor(splits))
    plan = layout.dispatch_plan

    def clock(fn):
        def run():
            t0 = time.perf_counter()
            fn()
            return {"t": time.perf_counter() - t0}
        return run

    def part(splits_):
        buf = x[:sum(splits_)].contiguous()
        res = torch.empty_like(buf)
        return lambda: dist.all_to_all_single(res, buf, splits_, splits_, group=halo.group)

    def halo_phases():
        t0 = time.perf_counter()
        intra_out, intra_work = halo._phase_local(x, plan)
        relay_in = halo._phase_inter(x, plan)
        t2 = time.perf_counter()
        relay_out, relay_work = halo._phase_redistribute(relay_in, plan)
        if relay_work is not None:
            relay_work.wait()
        t3 = time.perf_counter()
        if intra_work is not None:
            intra_work.wait()
        torch.cat([intra_out, relay_out])[torch.from_numpy(plan.output_index)]
        return {"t": time.perf_counter() - t0, "to_II": t2 - t0, "to_III": t3 - t0}

    def phase_one():
        _, work = halo._phase_local(x, plan)
        if work is not None:
            work.wait()

    relay_in = halo._phase_inter(x, plan)

    def phase_three():
        _, work = halo._phase_redistribute(relay_in, plan)
        if work is not None:
            work.wait()

    runs = {"flat": clock(lambda: dist.all_to_all_single(out, x, splits, splits, group=halo.group)),
            "flat_remote": clock(part(remote)), "flat_local": clock(part(local)), "halo": halo_phases,
            "phase_I": clock(phase_one), "phase_II": clock(lambda: halo._phase_inter(x, plan)),
            "phase_III": clock(phase_three)}
    result = {}
    for name, fn in runs.items():
        samples = timed(fn, repeats)
        for key in samples[0]:
            label = name if key == "t" else f"{name}_{key}"
            result[label] = STATISTICS[statistic]([s[key] for s in samples])
    return result


def copy_seconds(halo, nbytes: int, repeats: int, statistic: str) -> dict[str, float]:
    """HALO's row copies alone (no communication): the gathers before phases I and II and III and the final
    cat + reorder, on buffers of the sizes one exchange of ``nbytes`` per rank uses; every rank at once."""
    import torch

    from piper_plan.calibration.bench_a2a import message_shape
    from piper_plan.runtime.halo import _index

    world = len(halo.ep_ranks)
    rows, width = message_shape(nbytes, world)
    x = torch.randn(rows * world, width)
    layout = halo.layout(torch.tensor([rows] * world))
    plan = layout.dispatch_plan
    relay_in = x.new_empty((sum(k for _, k in plan.inter_recvs), width))
    intra_out = x.new_empty((sum(plan.intra_recv_splits), width))
    relay_out = x.new_empty((sum(plan.relay_recv_splits), width))

    def copies():
        t0 = time.perf_counter()
        x[_index(plan.intra_send_index, x.device)]
        x[_index(plan.inter_send_index, x.device)]
        relay_in[_index(plan.relay_send_index, x.device)]
        torch.cat([intra_out, relay_out])[_index(plan.output_index, x.device)]
        return {"t": time.perf_counter() - t0}

    return {"copies": STATISTICS[statistic]([s["t"] for s in timed(copies, repeats)]), "bytes": x.numel() * 4}


def tbf_counters() -> dict[str, list[int]]:
    """[bytes sent, packets dropped] of every tbf qdisc of this run's network (scripts/netemu.sh), per device."""
    import os
    import re
    import subprocess

    name, counters = os.environ.get("PIPER_NETEMU", ""), {}
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for ns in (x for x in spaces if name and x.startswith(f"{name}-")):
        text = subprocess.run(["tc", "-s", "-n", ns, "qdisc", "show"], capture_output=True, text=True).stdout
        for dev, sent, dropped in re.findall(r"qdisc tbf \S+ dev (\S+) .*?\n\s*Sent (\d+) bytes \d+ pkt \(dropped (\d+)",
                                             text):
            counters[f"{ns}/{dev}"] = [int(sent), int(dropped)]
    return counters


def rank_main(out: str, sizes: list[int], repeats: int, statistic: str) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from piper_plan.fileio import atomic_write_json
    from piper_plan.launchenv import read_launch_env
    from piper_plan.runtime.halo import build_halo_dispatchers
    from piper_plan.runtime.topology import topology_from_env

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    try:
        world = dist.get_world_size()
        topology = topology_from_env(world, read_launch_env().ranks_per_node, None)  # as bench_a2a builds it
        halo = build_halo_dispatchers([list(range(world))], topology)
        table = {}
        for nbytes in sizes:
            probe = copy_seconds if COPIES_ONLY else probe_size
            mine = probe(halo, nbytes, repeats, statistic)
            gathered: list = [None] * world
            dist.all_gather_object(gathered, mine)
            table[nbytes] = {k: max(g[k] for g in gathered) for k in mine}
        if dist.get_rank() == 0:
            atomic_write_json(out, {**table, "tbf": tbf_counters()})
    finally:
        dist.destroy_process_group()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, required=True, help="GB/s per uplink")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--out", required=True)
    ap.add_argument("--statistic", choices=sorted(STATISTICS), default="median", help="per rank: median or fastest call")
    ap.add_argument("--copies", action="store_true", help="time HALO's row copies only (no network: local ranks)")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.rank:
        return rank_main(args.out, sizes, args.repeats, args.statistic)
    from piper_plan.calibration.netemu import NetworkSpec, run_on_network

    command = [sys.executable, str(Path(__file__).resolve()), "--rank", "--rate", str(args.rate), "--sizes",
               args.sizes, "--repeats", str(args.repeats), "--statistic", args.statistic, "--out", args.out]
    command += ["--copies"] if args.copies else []
    run_on_network(NetworkSpec(args.rate, 2), args.nodes, args.ranks_per_node, command, 600)
    table = json.loads(Path(args.out).read_text())
    print(f"tbf [bytes sent, dropped] over the whole run: {table.pop('tbf')}")
    for nbytes, row in table.items():
        print(f"{args.rate:g} GB/s {args.nodes}x{args.ranks_per_node} {int(nbytes):>9} B: "
              + "  ".join(f"{k} {v * 1e3:.2f}" for k, v in row.items() if k != "bytes") + "  (ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
