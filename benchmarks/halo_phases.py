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

``--uplink-use``: instead, how busy each node keeps its uplinks during a flat and a HALO exchange. One rank per
node samples its node's uplink byte counters (``/sys/class/net/up*/statistics/tx_bytes``, every 5 ms) through
``--repeats`` calls of each, a barrier before every call; per call, between the first and the last sample inside
the slowest rank's time (up to one sampling period short at each end): the busiest uplink's bytes against what its
rate allows in that span (utilization; the model takes it as 1), and the share of the span during which it ran
below half its rate. Prints the fastest call's figures and the median over calls. Not with ``--copies``.

``--flows``: instead, why a flat exchange leaves its busiest uplink idle. One rank per node reads the kernel's
per-connection TCP counters (``ss -tin``: bytes sent; ``busy`` = time with data unacknowledged, ``rwnd_limited``
= held back by the receiver's window, ``sndbuf_limited`` = by the send buffer) before and after each of
``--repeats`` flat calls; per call, the connections that crossed the node's busiest uplink: how long each was busy
against the call, and how much of it the receiver or the send buffer held it back. Connections of one link that
carry the same bytes yet stay busy for very different spans, held back by neither, were given the link unevenly
(by TCP's congestion control, or by senders that started late: these counters do not tell which); where even the
longest is shorter than the call, the link sat idle for part of it.
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
UPLINK_USE = "--uplink-use" in sys.argv
FLOWS = "--flows" in sys.argv


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


SAMPLE_S = 0.005
"""Uplink counter sampling period of --uplink-use."""


def sample_uplinks(stop, rows: list) -> None:
    """Thread body: (time, tx bytes of each up* interface of this node namespace) every SAMPLE_S until ``stop``."""
    import os

    devices = sorted(d for d in os.listdir("/sys/class/net") if d.startswith("up"))
    files = [open(f"/sys/class/net/{d}/statistics/tx_bytes") for d in devices]
    try:
        while not stop.is_set():
            row = [time.perf_counter()]
            for f in files:
                f.seek(0)
                row.append(int(f.read()))
            rows.append(row)
            time.sleep(SAMPLE_S)
    finally:
        for f in files:
            f.close()


def call_link_use(rows, start: float, seconds: float, rate_Bps: float) -> dict[str, float]:
    """One call's use of this node's busiest uplink from the sampled counters ``rows`` (time, bytes per uplink),
    between the first and the last sample inside [start, start + seconds]: its bytes / (rate x that span), its share
    of the node's inter-node bytes, and the share of the span during which it ran below half its rate. {} with
    fewer than two samples inside."""
    import numpy as np

    table = np.asarray(rows, float)
    t, count = table[:, 0], table[:, 1:]
    inside = (t >= start) & (t <= start + seconds)
    if inside.sum() < 2:
        return {}
    at = np.flatnonzero(inside)
    sent = count[at[-1]] - count[at[0]]
    busiest = int(np.argmax(sent))
    steps_s = np.diff(t[at])
    rates = np.diff(count[at, busiest]) / steps_s
    return {"utilization": float(sent[busiest] / (rate_Bps * (t[at[-1]] - t[at[0]]))),
            "busiest_share": float(sent[busiest] / max(sent.sum(), 1.0)),
            "below_half": float(steps_s[rates < 0.5 * rate_Bps].sum() / steps_s.sum())}


def even_exchange(halo, nbytes: int):
    """The bench's even exchange of ``nbytes`` per rank (bench_a2a.message_shape): (input rows, splits, a call of
    the flat ``all_to_all_single`` of them)."""
    import torch
    import torch.distributed as dist

    from piper_plan.calibration.bench_a2a import message_shape

    world = dist.get_world_size()
    rows, width = message_shape(nbytes, world)
    splits = [rows] * world
    x = torch.randn(rows * world, width)
    out = torch.empty_like(x)
    return x, splits, lambda: dist.all_to_all_single(out, x, splits, splits, group=halo.group)


def uplink_use(halo, nbytes: int, repeats: int, rate_GBps: float, leader: bool) -> dict[str, list]:
    """Per algorithm: the slowest rank's seconds of each call, and (on a node's first rank) the node's busiest
    uplink's use in each call (call_link_use)."""
    import threading

    import torch
    import torch.distributed as dist

    x, splits, flat = even_exchange(halo, nbytes)
    layout = halo.layout(torch.tensor(splits))
    ops = {"flat": flat, "halo": lambda: halo.exchange(x, layout.dispatch_plan)}
    samples, stop = [], threading.Event()
    sampler = threading.Thread(target=sample_uplinks, args=(stop, samples), daemon=True) if leader else None
    if sampler is not None:
        sampler.start()
    calls: dict[str, list] = {}
    for name, op in ops.items():
        op()  # warm-up
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            op()
            seconds = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            calls.setdefault(name, []).append((start, float(seconds)))
    if sampler is not None:
        stop.set()
        sampler.join()
    rate_Bps = rate_GBps * 1e9
    return {name: [{"seconds": s, **(call_link_use(samples, t0, s, rate_Bps) if leader else {})} for t0, s in got]
            for name, got in calls.items()}


TCP_FIELDS = {"busy_ms": r"busy:(\d+)ms", "rwnd_ms": r"rwnd_limited:(\d+)ms", "sndbuf_ms": r"sndbuf_limited:(\d+)ms",
              "sent": r"bytes_sent:(\d+)"}
"""Cumulative per-connection counters read from ``ss -tin`` (0 where a counter is absent)."""


def parse_tcp_flows(text: str) -> dict[str, dict[str, int]]:
    """``ss -tin`` output -> {"local>peer": counters} for the established IPv4 connections between two emulated
    nodes (10.231.*; a node's own ranks talk over one address and are left out)."""
    import re

    flows, lines = {}, text.splitlines()
    for head, info in zip(lines, lines[1:] + [""]):
        fields = head.split()
        if len(fields) < 5 or fields[0] != "ESTAB" or not fields[3].startswith("10.231."):
            continue
        local, peer = fields[3], fields[4]
        if local.rsplit(":", 1)[0] == peer.rsplit(":", 1)[0]:
            continue
        flows[f"{local}>{peer}"] = {k: int(m.group(1)) if (m := re.search(rx, info)) else 0
                                    for k, rx in TCP_FIELDS.items()}
    return flows


def tcp_flows() -> dict[str, dict[str, int]]:
    import subprocess

    return parse_tcp_flows(subprocess.run(["ss", "-tin"], capture_output=True, text=True).stdout)


def call_flows(before: dict, after: dict, seconds: float) -> dict:
    """One call's connections on the node's busiest uplink (the uplink is the peer address's third field,
    10.231.<uplink>.<node + 1>: routes go by destination) that carried the exchange (at least half the bytes of the
    link's largest: other process groups' barriers and reductions share the uplink with a few bytes): per
    connection MB sent and ms busy, and their totals of ms held back by the receiver's window and by the send
    buffer."""
    moved = {}
    for key, now in after.items():
        was = before.get(key, dict.fromkeys(TCP_FIELDS, 0))
        delta = {k: now[k] - was[k] for k in TCP_FIELDS}
        if delta["sent"] > 0:
            moved[key] = {**delta, "uplink": int(key.split(">")[1].split(".")[2])}
    if not moved:
        return {}
    per_link: dict[int, int] = {}
    for flow in moved.values():
        per_link[flow["uplink"]] = per_link.get(flow["uplink"], 0) + flow["sent"]
    busiest = max(per_link, key=per_link.get)
    on_link = [f for f in moved.values() if f["uplink"] == busiest]
    largest = max(f["sent"] for f in on_link)
    mine = [f for f in on_link if f["sent"] >= largest / 2]   # the exchange's, not another group's small messages
    return {"seconds": seconds, "uplink": busiest, "MB": [f["sent"] / 1e6 for f in mine],
            "busy_ms": [f["busy_ms"] for f in mine], "rwnd_ms": sum(f["rwnd_ms"] for f in mine),
            "sndbuf_ms": sum(f["sndbuf_ms"] for f in mine)}


def flow_use(halo, nbytes: int, repeats: int, leader: bool) -> list[dict]:
    """``repeats`` flat calls (after a warm-up), a barrier around each; on a node's first rank, each call's
    call_flows (the slowest rank's seconds)."""
    import torch
    import torch.distributed as dist

    _, _, flat = even_exchange(halo, nbytes)
    flat()   # warm-up
    calls = []
    for _ in range(repeats):
        dist.barrier()
        before = tcp_flows() if leader else {}
        dist.barrier()
        start = time.perf_counter()
        flat()
        seconds = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        if leader:
            calls.append(call_flows(before, tcp_flows(), float(seconds)))
    return calls


def flow_lines(args, nbytes: int, nodes: list[list[dict]]) -> list[str]:
    """Per node, the fastest call: its busiest uplink's connections, busy time against the call, and what held
    them back."""
    import statistics

    lines = []
    for i, calls in enumerate(nodes):
        calls = [c for c in calls if c]
        if not calls:
            continue
        c = min(calls, key=lambda call: call["seconds"])
        busy = sorted(c["busy_ms"])
        lines.append(f"{args.rate:g} GB/s {args.nodes}x{args.ranks_per_node} {nbytes:>9} B flat, node {i}, fastest of "
                     f"{len(calls)} calls {c['seconds'] * 1e3:.1f} ms: uplink {c['uplink']} carried {len(busy)} "
                     f"connections of {statistics.median(c['MB']):.2f} MB each (median), busy {busy[0]} / "
                     f"{statistics.median(busy):.0f} / {busy[-1]} ms (min / median / max); held back by the "
                     f"receiver's window {c['rwnd_ms']} ms, by the send buffer {c['sndbuf_ms']} ms (all its "
                     "connections together)")
    return lines


def rank_main(out: str, sizes: list[int], repeats: int, statistic: str, rate_GBps: float = 0.0) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from piper_plan.fileio import atomic_write_json
    from piper_plan.launchenv import read_launch_env
    from piper_plan.runtime.halo import build_halo_dispatchers
    from piper_plan.runtime.mesh import end_process_group
    from piper_plan.runtime.topology import topology_from_env

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    try:
        world = dist.get_world_size()
        per_node = read_launch_env().ranks_per_node          # scripts/netemu.sh: rank r on node r // per_node
        topology = topology_from_env(world, per_node, None)  # as bench_a2a builds it
        halo = build_halo_dispatchers([list(range(world))], topology)
        table = {}
        for nbytes in sizes:
            gathered: list = [None] * world
            if UPLINK_USE or FLOWS:
                leader = dist.get_rank() % per_node == 0
                mine = (uplink_use(halo, nbytes, repeats, rate_GBps, leader) if UPLINK_USE
                        else flow_use(halo, nbytes, repeats, leader))
                dist.all_gather_object(gathered, mine)
                table[nbytes] = gathered[::per_node]                 # each node's first rank read its counters
                continue
            probe = copy_seconds if COPIES_ONLY else probe_size
            mine = probe(halo, nbytes, repeats, statistic)
            dist.all_gather_object(gathered, mine)
            table[nbytes] = {k: max(g[k] for g in gathered) for k in mine}
        if dist.get_rank() == 0:
            atomic_write_json(out, {**table, "tbf": tbf_counters()})
    finally:
        end_process_group()
    return 0


USE_KEYS = ("seconds", "utilization", "busiest_share", "below_half")


def use_figures(nodes: list[dict], algo: str) -> tuple[dict, dict, int] | None:
    """(the fastest call's figures, the median over calls, calls) of one algorithm in an --uplink-use result for
    one size (``nodes``: each node's calls); a call's figures are the means over nodes (USE_KEYS). None: no call
    was sampled on every node."""
    import statistics

    calls = [c for c in zip(*(node[algo] for node in nodes)) if all("utilization" in n for n in c)]
    if not calls:
        return None
    rows = [{k: statistics.mean(n[k] for n in call) for k in USE_KEYS} for call in calls]
    fastest = min(rows, key=lambda r: r["seconds"])
    return fastest, {k: statistics.median(r[k] for r in rows) for k in USE_KEYS}, len(rows)


def uplink_use_lines(args, nbytes: int, nodes: list[dict]) -> list[str]:
    """Per algorithm: the fastest call and the median over calls of the nodes' busiest-uplink figures."""
    lines = []
    for algo in nodes[0]:
        found = use_figures(nodes, algo)
        if found is None:
            continue
        fast, med, calls = found
        lines.append(f"{args.rate:g} GB/s {args.nodes}x{args.ranks_per_node} {nbytes:>9} B {algo}: fastest call "
                     f"{fast['seconds'] * 1e3:.1f} ms, busiest uplink {fast['utilization']:.2f} of its rate over the "
                     f"call (share of the node's bytes {fast['busiest_share']:.2f}), below half rate "
                     f"{fast['below_half']:.0%} of it; median of {calls} calls {med['seconds'] * 1e3:.1f} ms, "
                     f"{med['utilization']:.2f}, {med['below_half']:.0%} (mean over nodes)")
    return lines


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
    ap.add_argument("--uplink-use", action="store_true", help="how busy the nodes keep their uplinks (see above)")
    ap.add_argument("--flows", action="store_true", help="flat's connections on the busiest uplink (see above)")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.copies + args.uplink_use + args.flows > 1:
        ap.error("--copies, --uplink-use and --flows measure different things: give one")
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.rank:
        return rank_main(args.out, sizes, args.repeats, args.statistic, args.rate)
    from piper_plan.calibration.netemu import NetworkSpec, run_on_network

    command = [sys.executable, str(Path(__file__).resolve()), "--rank", "--rate", str(args.rate), "--sizes",
               args.sizes, "--repeats", str(args.repeats), "--statistic", args.statistic, "--out", args.out]
    command += ["--copies"] if args.copies else []
    command += ["--uplink-use"] if args.uplink_use else []
    command += ["--flows"] if args.flows else []
    run_on_network(NetworkSpec(args.rate, 2), args.nodes, args.ranks_per_node, command, 600)
    table = json.loads(Path(args.out).read_text())
    print(f"tbf [bytes sent, dropped] over the whole run: {table.pop('tbf')}")
    if args.uplink_use or args.flows:
        for nbytes, nodes in table.items():
            for line in (uplink_use_lines if args.uplink_use else flow_lines)(args, int(nbytes), nodes):
                print(line)
        return 0
    for nbytes, row in table.items():
        print(f"{args.rate:g} GB/s {args.nodes}x{args.ranks_per_node} {int(nbytes):>9} B: "
              + "  ".join(f"{k} {v * 1e3:.2f}" for k, v in row.items() if k != "bytes") + "  (ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
