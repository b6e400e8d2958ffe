"""HALO vs flat all-to-all on an emulated multi-node network, measured beside the cost model's prediction.

Needs root and iproute2 (scripts/netemu.sh). Per uplink rate (2 uplinks per node, tc tbf):

1. shaping: one-way p2p between two nodes (one uplink) and inside a node (loopback), 16 MiB
   (piper_plan.calibration.bench_shaping), checked again after the rate's points (fastest_check);
2. calibration on that network, 2 nodes x 4 ranks (piper_plan.calibration.bench_collectives --quick: p2p,
   all_reduce, all_to_all; then all_to_all in full, whose node rows at 2 and 4 ranks up to 16 MiB replace the quick
   ones; every node's intra-node rows of an exchange share this one host: node.nodes_share_host, priced
   nodes x one node's time); the all_to_all rows that span nodes are dropped, so no prediction reads back an
   all-to-all measured across nodes; flat's NIC use (the share of a node's inter-node bytes on its busiest uplink)
   comes from the tc counters of a flat all-to-all at another rate (SHARE_RATE_GBps, not a test rate); how busy
   flat and HALO keep each node's busiest uplink (its bytes against what its rate allows, sampled in the exchange) is
   measured at that rate on every shape (benchmarks/halo_phases.py --uplink-use) and reported, not priced (flat's
   link use on 3+ nodes is priced from the 3 x 2 exchange of item 4 instead);
3. flat and HALO (piper_plan.calibration.bench_a2a over the network) on 2 x 2, 2 x 4 and 4 x 2, 4 KiB - 16 MiB;
4. prediction: piper_plan.cost.comm.Network with the platform built from (2) and what the script set, the
   host's cost per dependent step (node.host_step_us, node.halo_step_us) from 4 KiB flat and HALO all-to-alls at
   SHARE_RATE_GBps (timed together; the median of rounds taken at the start and before each rate's points), the
   share of that step which runs under an inter-node transfer (node.host_step_hidden) from the flat 1 MiB exchange
   at SHARE_RATE_GBps, and from flat and HALO at 16 MiB on IN_EXCHANGE_SHAPE (3 x 2: no predicted point's shape)
   at each test rate, timed before, amid and after the rate's points (the median kept): flat's link use on 3 or more
   nodes (modelled / measured flat time there, priced on 4 x 2) and HALO's copy rate inside an exchange (HALO's time
   less its modelled phases).

Every all-to-all figure (test point, tiny exchange, copies inside an exchange) is the fastest of its calls (the
uncontended time on this shared host) of one call's time over all ranks, from the first rank's start to the last
rank's end (one host, one clock), flat and HALO timed in alternation with a barrier before each call
(calibration/bench_a2a.py); a test point is measured in POINT_ROUNDS rounds and its figure is the median of the
rounds' figures; calibration rows are per rank the fastest of REPEATS calls, the slowest rank's. The host's load
average is kept per point. ``--from FIRST`` measures flat and
HALO again on FIRST's calibration; ``--repeat OTHER`` (with ``--reuse``) reports the spread between two sweeps.

Then the closed loop with two plans (dp4 ep4 flat / halo, tiny-moe, 2 nodes x 2 ranks) on the slowest network:
the framework overhead measured right before (its 4-rank lockstep rows by 2 x 2 ranks on that network), then
predicted vs measured step time and its parts (the runtime's a2a and dp_sync timers, the rest). Writes docs/halo-measured.md and docs/halo-measured.png.

Run: .venv/bin/python benchmarks/halo_network.py [--out /tmp/piper-halo-net] [--reuse [--rerun-closed-loop]]
     [--no-hidden-step] [--no-link-use] [--no-network-host-work]
     [--from DIR] [--repeat DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from piper_plan.calibration.netemu import NetworkSpec, run_on_network  # noqa: E402

UPLINKS = 2
RATES_GBps = (0.05, 0.2)
SHARE_RATE_GBps = 0.1
SHAPES = ((2, 2), (2, 4), (4, 2))
SIZES = tuple(4096 * 4**i for i in range(7))  # 4 KiB .. 16 MiB per rank
BIG = 256 * 1024  # the sizes that matter for the 15% target
RATIO_NO_COMMON_15 = 1.15 / 0.85  # two times further apart than this have no value within 15% of both
REPEATS = 10  # timed calls per point, after one warm-up
POINT_ROUNDS = 3  # every test point is measured this many times, each round of a rate's points after the whole round
#                   before it (one bench run per shape and round), and its figure is the median of the rounds'
#                   fastest calls, the statistic of the host-step rounds (TINY_ROUNDS): a slow spell on this shared
#                   host that lasts a whole run of REPEATS calls moves one round, not the point (two single-round
#                   sweeps, AD and AE, differed by up to 33% at >= 256 KiB)
STATISTIC = "min"  # the fastest call: the uncontended time on this shared host (calibration.timing)
OTHER_RATE_SIZES = (4096, 2**20, 4 * 2**20, 16 * 2**20)  # flat alone at SHARE_RATE_GBps, reported
HOST_STEP_BYTES = 4096  # the tiny flat exchange whose time beyond the latency terms is the host's step cost
HIDDEN_FIT_BYTES = 2**20  # the flat exchange at SHARE_RATE_GBps that node.host_step_hidden is fitted on
TINY_ROUNDS = 3  # that tiny exchange is timed this many times (REPEATS calls each, as a test point) and the median
#                 of the rounds' figures kept: one slow wake-up moves a single figure (the same flat 4 KiB exchange
#                 took 1.3 - 2.6 ms across runs), and more calls in one figure would lower its fastest call below
#                 what a test point's REPEATS calls find
USE_BYTES = 16 * 2**20  # flat's and HALO's uplink use is measured at SHARE_RATE_GBps with this much per rank
PLATFORM_FILE = ROOT / "platforms" / "netemu.yaml"
UPLINK_BYTES = re.compile(r"n(\d+)/up(\d+)=(\d+)")
COPY_NODES, COPY_RANKS, COPY_BYTES = 2, 2, 16 * 2**20  # the relay-copy calibration (relay_copies)
IN_EXCHANGE_SHAPE = (3, 2)  # nodes x ranks of the copy rate inside an exchange: no predicted point's shape
IN_EXCHANGE_WHEN = ("", "-mid", "-after")  # that exchange is timed before a rate's points, between their first and
#                                            second rounds, and after them; the median is kept (in_exchange_seconds)
HALF_DUPLEX_BELOW = 0.75  # two ways on one connection below this share of one way: half duplex


def module(name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", name, *args]


def shaping(spec: NetworkSpec, tmp: Path, when: str = "") -> dict:
    """The shaping check at ``spec``'s rate (``when``: "" before the rate's points, "after" once they are taken)."""
    out = tmp / f"shaping-{spec.uplink_GBps:g}{'-' + when if when else ''}.json"
    if out.is_file():  # measured by an earlier, interrupted run of this script into the same OUT
        return json.loads(out.read_text())
    run_on_network(spec, 2, 2, module("piper_plan.calibration.bench_shaping", str(out), str(16 * 2**20)), 300)
    return json.loads(out.read_text())


SHAPING_GBPS = ("inter_node_GBps", "intra_node_GBps", "two_way_one_connection_GBps", "two_way_two_connections_GBps")


def fastest_check(before: dict, after: dict) -> dict:
    """The two shaping checks of a rate as one: each column (GB/s figure) the larger of its two readings, so one
    merged row may take its one-way and its two-way figures from different checks. A slow spell of this shared host
    only lowers a measured rate, and one spell can span a whole check (five transfers in two seconds): checking
    again once the rate's points are taken, minutes later, keeps it from passing for a slower link. ``after`` with
    the same figures as ``before`` (a repeat sweep of an OUT that had one check): ``before`` as it is."""
    seen = {"before": {k: before.get(k) for k in SHAPING_GBPS}, "after": {k: after.get(k) for k in SHAPING_GBPS}}
    if seen["before"] == seen["after"]:
        return before
    merged = {**before, **{k: max(seen["before"][k] or 0.0, seen["after"][k] or 0.0) or None for k in SHAPING_GBPS}}
    merged["statistic"] = (f"faster of two checks (before and after the rate's points), each the "
                           f"{before.get('statistic', 'median of 3')} after a warm-up; each column its larger reading")
    merged["checks"] = seen
    return merged


def busiest_uplink_share(stderr: str, nodes: int) -> float:
    """Mean over nodes of (bytes on the node's busiest uplink / bytes on all its uplinks), from the tc counters."""
    per_node: dict[int, list[int]] = {}
    for node, _uplink, count in UPLINK_BYTES.findall(stderr):
        per_node.setdefault(int(node), []).append(int(count))
    return statistics.mean(max(v) / sum(v) for v in per_node.values())


def nic_shares(tmp: Path) -> dict:
    """Per algorithm and ranks per node: the busiest uplink's share of a node's inter-node bytes (2 nodes)."""
    from piper_plan.calibration.bench_a2a import BenchConfig

    spec, shares = NetworkSpec(SHARE_RATE_GBps, UPLINKS), {}
    for algo in ("flat", "halo"):
        for g in (2, 4):
            config = BenchConfig((algo,), (4 * 2**20,), 2, g, repeats=3)
            done = run_on_network(spec, 2, g, module("piper_plan.calibration.bench_a2a", json.dumps(asdict(config)),
                                                     str(tmp / "share.json")), 300)
            shares[f"{algo} {g}"] = busiest_uplink_share(done.stderr, 2)
    return shares


def measured_uplink_use(out: Path, measure: bool = True) -> dict[str, dict]:
    """Per shape ("2x4") and algorithm: the fastest call of USE_BYTES at SHARE_RATE_GBps and how busy it kept each
    node's busiest uplink (benchmarks/halo_phases.py --uplink-use, REPEATS calls; kept in OUT), None where no call
    was sampled on every node. A shape is left out where OUT has no such file (``measure=False``, or an OUT from
    before this was taken) or the file holds no USE_BYTES row."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from halo_phases import use_figures

    found = {}
    for nodes, g in SHAPES:
        path = out / f"uplink-use-{SHARE_RATE_GBps:g}-{nodes}x{g}.json"
        if not path.is_file() and measure:
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "halo_phases.py"), "--uplink-use", "--rate",
                            f"{SHARE_RATE_GBps:g}", "--nodes", str(nodes), "--ranks-per-node", str(g), "--sizes",
                            str(USE_BYTES), "--repeats", str(REPEATS), "--out", str(path)], check=True, cwd=ROOT,
                           timeout=900)
        per_size = json.loads(path.read_text()).get(str(USE_BYTES)) if path.is_file() else None
        if per_size:
            figures = {algo: use_figures(per_size, algo) for algo in ("flat", "halo")}
            found[f"{nodes}x{g}"] = {algo: f[0] if f else None for algo, f in figures.items()}
    return found


def at_other_rate(out: Path, measure: bool = True) -> dict[str, dict]:
    """Flat all-to-all alone at SHARE_RATE_GBps (not a test rate) on every shape, OTHER_RATE_SIZES: how far a large
    exchange stays above its busiest uplink's time (reported beside the host steps, which come from tiny_round; its
    HIDDEN_FIT_BYTES row sets node.host_step_hidden, with_hidden_step; kept in OUT/flat-<rate>-<shape>.json)."""
    from piper_plan.calibration.bench_a2a import BenchConfig, network_bench
    from piper_plan.fileio import atomic_write_json

    spec, found = NetworkSpec(SHARE_RATE_GBps, UPLINKS), {}
    for nodes, g in SHAPES:
        path = out / f"flat-{SHARE_RATE_GBps:g}-{nodes}x{g}.json"
        if not path.is_file() and not measure:
            continue
        if not path.is_file():
            config = BenchConfig(("flat",), OTHER_RATE_SIZES, nodes, g, repeats=REPEATS, statistic=STATISTIC)
            atomic_write_json(path, asdict(network_bench(config, spec, timeout_s=600)))
        found[f"{nodes}x{g}"] = json.loads(path.read_text())
    return found


def calibrate(spec: NetworkSpec, directory: Path) -> None:
    """bench_collectives on 2 x 4 ranks of the network (--quick), then its all_to_all at every node group size (2
    and 4 ranks) and message size up to 16 MiB, whose node rows replace the quick ones: HALO's phases I and III
    are 2-rank exchanges of up to 16 MiB here, which the quick rows (4 ranks, <= 1 MiB) only extrapolate. Keep no
    all_to_all row that spans nodes."""
    import pandas as pd

    from piper_plan.calibration.io import read_table, render_csv
    from piper_plan.calibration.schema import COLLECTIVES
    from piper_plan.fileio import atomic_write_text

    if (directory / "done").is_file():
        return
    shutil.rmtree(directory, ignore_errors=True)
    source = f"measured: benchmarks/halo_network.py on the emulated network {spec.text} {time.strftime('%Y-%m-%d')}"
    node_dir = directory / "node-all-to-all"
    for out, options in ((directory, ("--quick", "--ops", "p2p,all_reduce,all_to_all")), (node_dir, ("--ops", "all_to_all"))):
        run_on_network(spec, 2, 4, module("piper_plan.calibration.bench_collectives", "--platform", str(PLATFORM_FILE),
                                          "--out", str(out), *options, "--statistic", STATISTIC, "--repeats",
                                          str(REPEATS), "--source", source), 900)
    path = directory / "collectives.csv"
    quick, full = read_table(path, COLLECTIVES), read_table(node_dir / "collectives.csv", COLLECTIVES)
    frame = pd.concat([quick[quick["op"] != "all_to_all"], full[(full["op"] == "all_to_all") & (full["scope"] == "node")]])
    atomic_write_text(path, render_csv(frame, COLLECTIVES))
    (directory / "done").write_text("")


def link_figures(directory: Path) -> dict:
    """Node and switch figures from the calibration rows: best node all_to_all busbw, fastest small p2p."""
    from piper_plan.calibration.io import read_table
    from piper_plan.calibration.schema import COLLECTIVES

    f = read_table(directory / "collectives.csv", COLLECTIVES)
    p2p = f[f["op"] == "p2p"]
    small = p2p[p2p["bytes_per_rank"] <= 4096]
    return {"node_GBps": float(f[(f["op"] == "all_to_all") & (f["scope"] == "node")]["busbw_GBps"].max()),
            "node_latency_us": float(small[small["scope"] == "node"]["seconds"].min() * 1e6),
            "switch_latency_us": float(small[small["scope"] == "switch"]["seconds"].min() * 1e6),
            "p2p_switch_GBps": float(p2p[p2p["scope"] == "switch"]["algbw_GBps"].max())}


def relay_copies(out: Path, reuse: bool = False) -> dict:
    """HALO's row copies alone (benchmarks/halo_phases.py --copies: no communication) on COPY_NODES x COPY_RANKS
    ranks at once, COPY_BYTES per rank: the host's copy rate, all ranks together (kept in OUT/copies.json)."""
    from piper_plan.cost.comm import relay_copy_bytes
    from piper_plan.fileio import atomic_write_json

    path, probe = out / "copies.json", out / "copies-probe.json"
    if path.is_file():
        return json.loads(path.read_text())
    command = [sys.executable, str(ROOT / "benchmarks" / "halo_phases.py"), "--copies", "--rate", f"{SHARE_RATE_GBps:g}",
               "--nodes", str(COPY_NODES), "--ranks-per-node", str(COPY_RANKS), "--sizes", str(COPY_BYTES),
               "--statistic", STATISTIC, "--repeats", str(REPEATS), "--out", str(probe)]
    if not probe.is_file() and reuse:
        sys.exit(f"halo_network.py --reuse: {path} missing (HALO's copy rate); measure it as root with "
                 f"{' '.join(command[1:])}, or run without --reuse")
    if not probe.is_file():
        subprocess.run(command, check=True, timeout=600)
    seconds = json.loads(probe.read_text())[str(COPY_BYTES)]["copies"]
    ranks = COPY_NODES * COPY_RANKS
    copied = float(relay_copy_bytes(ranks, COPY_NODES, COPY_BYTES))
    result = {"ranks": ranks, "bytes_per_rank": COPY_BYTES, "copy_bytes_per_rank": copied, "seconds": seconds,
              "host_GBps": ranks * copied / seconds / 1e9, "host_cores": os.cpu_count() or 1}
    atomic_write_json(path, result)
    return result


def in_exchange_seconds(out: Path, spec: NetworkSpec, when: str | None) -> dict[str, float]:
    """Flat's and HALO's seconds at COPY_BYTES per rank on IN_EXCHANGE_SHAPE at ``spec``'s rate (timed in alternation,
    as the test points are): measured into OUT/halo-copies-<rate>-<shape><when>.json where ``when`` is given ("" before
    the rate's points, "-mid" between their first and second rounds, "-after" after them) and that file is missing;
    per algorithm the median of the files OUT holds (of two, their mean), as a test point's rounds: one slow spell
    once made HALO there 47% slower than in its repeat, and one fast call 31% faster than the timing before the
    points (sweep AF at 0.2 GB/s: 119.0 ms after them against 173.1 before, and 158.7 and 161.2 in its repeat)."""
    from piper_plan.calibration.bench_a2a import BenchConfig, network_bench
    from piper_plan.fileio import atomic_write_json

    nodes, g = IN_EXCHANGE_SHAPE
    stem = f"halo-copies-{spec.uplink_GBps:g}-{nodes}x{g}"
    if when is not None and not (out / f"{stem}{when}.json").is_file():
        config = BenchConfig(("flat", "halo"), (COPY_BYTES,), nodes, g, repeats=REPEATS, statistic=STATISTIC)
        atomic_write_json(out / f"{stem}{when}.json", asdict(network_bench(config, spec, timeout_s=600)))
    figures = [json.loads(path.read_text())["sizes"][0]["seconds"]
               for path in (out / f"{stem}{suffix}.json" for suffix in IN_EXCHANGE_WHEN) if path.is_file()]
    return {algo: statistics.median(f[algo] for f in figures if algo in f) for algo in ("flat", "halo")
            if any(algo in f for f in figures)}


def copies_in_exchange(out: Path, spec: NetworkSpec, check: dict, shares: dict, calibration,
                       price_link_use: bool = True, when: str | None = None) -> dict:
    """Two figures of flat and HALO on IN_EXCHANGE_SHAPE (in_exchange_seconds, measured ``when``), at ``spec``'s rate:

    - flat's link use on three or more nodes (``flat_link_use``): the model's flat time there over the measured one,
      at most 1 (an OUT measured before flat was timed beside HALO there has none); priced (with_link_use) unless
      ``price_link_use`` is False (the with / without comparison of the analysis);
    - HALO's copy rate inside an exchange: HALO's time less the model's time for it without copies (its phases,
      priced with that link use; no host step: none is calibrated for that shape) is the copies' time there; the
      host's rate = ranks x copy bytes per rank / it."""
    from piper_plan.cost.comm import relay_copy_bytes

    nodes, g = IN_EXCHANGE_SHAPE
    measured = in_exchange_seconds(out, spec, when)
    no_copies = {"host_GBps": 1.0, "host_cores": os.cpu_count() or 1}  # relay_copy_GBps set to 0 below
    platform = platform_for(spec.uplink_GBps, nodes, g, check["figures"], shares[f"flat {g}"], check, no_copies)
    data = platform.model_dump()
    data["node"]["relay_copy_GBps"] = 0.0
    platform = type(platform).model_validate(data)
    use = link_use(predict(platform, calibration, nodes, g, COPY_BYTES)["flat"], measured.get("flat"))
    priced = use if price_link_use else None
    phases_s = predict(with_link_use(platform, nodes, priced), calibration, nodes, g, COPY_BYTES)["halo"]
    copied = float(relay_copy_bytes(nodes * g, nodes, COPY_BYTES))
    copies_s = measured["halo"] - phases_s
    return {"shape": f"{nodes}x{g}", "measured_s": measured["halo"], "phases_s": phases_s,
            "flat_measured_s": measured.get("flat"), "flat_link_use": use, "link_use_priced": priced,
            "copy_bytes_per_rank": copied,
            "host_GBps": nodes * g * copied / copies_s / 1e9 if copies_s > 0 else None}


def link_use(modelled_s: float, measured_s: float | None) -> float | None:
    """How busy flat keeps its busiest uplink, as the model sees it: its time for an exchange over the measured
    time, at most 1 (noise and turn-taking only add time); None where not measured."""
    return min(modelled_s / measured_s, 1.0) if measured_s else None


def with_link_use(platform, nodes: int, use: float | None):
    """``platform`` with flat's inter-node rate (the switch scope) times ``use`` where the exchange spans at least
    IN_EXCHANGE_SHAPE's node count, the shape ``use`` is measured on: there each uplink's flows go to several
    nodes, which take turns on it (benchmarks/halo_network_analysis.md, "Flat's turn-taking"); between two nodes
    the model has no such bias. Unchanged elsewhere or where ``use`` is None."""
    if use is None or nodes < IN_EXCHANGE_SHAPE[0]:
        return platform
    data = platform.model_dump()
    data["network"]["scopes"]["switch"]["bandwidth_GBps"] *= use
    return type(platform).model_validate(data)


def copy_host_GBps(copies: dict, check: dict) -> float:
    """The host's copy rate the model prices HALO's copies at: measured inside an exchange at this rate
    (copies_in_exchange) where that is known, else the copies alone (relay_copies). Never faster than alone: inside
    an exchange the copies share the host with its other work, so a faster figure there is the error of what it is
    derived from (the exchange's time less its modelled phases; sweep AJ: 7.30 GB/s inside, 6.03 alone)."""
    inside = (check.get("copies_in_exchange") or {}).get("host_GBps")
    return min(inside, copies["host_GBps"]) if inside else copies["host_GBps"]


def copies_beside_network_GBps(copies: dict, check: dict, nodes: int, g: int) -> float:
    """The host's copy rate for HALO on ``nodes`` x ``g``, with the emulated network's own host work priced.

    Every emulated node runs on this one host, so each byte that crosses the emulated network costs the host kernel
    work (veth, bridge, tbf) on the cores HALO's row copies run on. The copies alone run at ``copies["host_GBps"]``
    (relay_copies); inside the IN_EXCHANGE_SHAPE exchange at its in-exchange rate (copies_in_exchange). The gap is
    that work: kappa = (C / rate_in x rate_alone - C) / N host-byte equivalents per byte crossing the network, C the
    exchange's copy bytes (all ranks), N its inter-node bytes. On another shape the copies then take
    (C_x + kappa N_x) / rate_alone: the rate returned is rate_alone x C_x / (C_x + kappa N_x). On IN_EXCHANGE_SHAPE
    it is the in-exchange rate itself; elsewhere a shape sending more of its bytes across the network than it
    copies (4 x 2) gets a slower rate, one sending fewer (2 x 2, 2 x 4) a faster one. Without both measurements, or
    with ``copies["network_host_work"]`` False (--no-network-host-work), copy_host_GBps's one rate."""
    from piper_plan.cost.comm import relay_copy_bytes

    inside = check.get("copies_in_exchange") or {}
    alone, rate_in = copies["host_GBps"], inside.get("host_GBps")
    if not copies.get("network_host_work", True) or not rate_in or alone <= rate_in:
        return copy_host_GBps(copies, check)

    def copied_and_sent(shape_nodes: int, ranks_per_node: int) -> tuple[float, float]:
        n = shape_nodes * ranks_per_node      # per byte sent by each rank: copy bytes and inter-node bytes, all ranks
        return n * float(relay_copy_bytes(n, shape_nodes, 1.0)), float(n - ranks_per_node)
    c_in, n_in = copied_and_sent(*IN_EXCHANGE_SHAPE)
    kappa = (c_in * alone / rate_in - c_in) / n_in
    c_x, n_x = copied_and_sent(nodes, g)
    return alone * c_x / (c_x + kappa * n_x)


def half_duplex(check: dict) -> bool:
    """Whether one connection carries one direction at a time: both ways on one communicator get clearly less
    per direction than one way (shaping check)."""
    return check["two_way_one_connection_GBps"] < HALF_DUPLEX_BELOW * check["inter_node_GBps"]


def platform_for(rate_GBps: float, nodes: int, ranks_per_node: int, figures: dict, flat_share: float, check: dict,
                 copies: dict):
    """platforms/netemu.yaml with this network's figures: NICs as the script set them, each at what it carries per
    direction while both directions are busy (shaping check, two communicators), node figures and latencies from
    the calibration, switch bandwidth = what a flat exchange gets per rank (busiest-uplink share); gloo's
    all-to-all posts all messages at once; half duplex from the shaping check; HALO's copies at the host's copy
    rate shared by all ranks of the job (every emulated node runs on this one host), HALO's phases in series
    where the job has more ranks than the host has cores."""
    import yaml

    from piper_plan.specs.platform import PlatformSpec

    data = yaml.safe_load(PLATFORM_FILE.read_text())
    g = ranks_per_node
    nic_GBps = min(rate_GBps, check.get("two_way_two_connections_GBps") or rate_GBps)  # an all-to-all loads both ways
    host_GBps = copies_beside_network_GBps(copies, check, nodes, g)
    data["node"].update(devices_per_node=g, num_nics=UPLINKS, nic_bandwidth_GBps=nic_GBps,
                        device_nic=[j % UPLINKS for j in range(g)], relay_copy_GBps=host_GBps / (nodes * g),
                        serial_phases=nodes * g > copies["host_cores"],
                        nodes_share_host=copies.get("nodes_share_host", True))
    data["network"].update(a2a_posts_all=True, half_duplex_connections=half_duplex(check),
                           link_burst_bytes=NetworkSpec(rate_GBps, UPLINKS).burst_bytes)
    data["network"]["scopes"]["node"].update(bandwidth_GBps=figures["node_GBps"], latency_us=figures["node_latency_us"])
    data["network"]["scopes"]["switch"].update(bandwidth_GBps=nic_GBps / (g * flat_share),
                                               latency_us=figures["switch_latency_us"])
    return PlatformSpec.model_validate(data)


def tiny_round(out: Path, nodes: int, g: int, tag: str) -> Path:
    """Flat's and HALO's HOST_STEP_BYTES exchange at SHARE_RATE_GBps on one shape, timed together as the test points
    are (in alternation, a barrier before each call, REPEATS calls), TINY_ROUNDS times in a row: one round of the
    host-step calibration (kept in OUT/tiny-<rate>-<shape>-<tag>.json; measured once per OUT and tag)."""
    from piper_plan.calibration.bench_a2a import BenchConfig, network_bench
    from piper_plan.fileio import atomic_write_json

    path = out / f"tiny-{SHARE_RATE_GBps:g}-{nodes}x{g}-{tag}.json"
    if not path.is_file():
        config = BenchConfig(("flat", "halo"), (HOST_STEP_BYTES,) * TINY_ROUNDS, nodes, g, repeats=REPEATS,
                             statistic=STATISTIC)
        atomic_write_json(path, asdict(network_bench(config, NetworkSpec(SHARE_RATE_GBps, UPLINKS), timeout_s=600)))
    return path


def tiny_seconds(out: Path, measure: bool = False) -> dict[str, dict[str, float]]:
    """Per shape ("2x4") and algorithm, the seconds of the HOST_STEP_BYTES exchange measured at SHARE_RATE_GBps: the
    median over every tiny_round in OUT (``measure``: the "start" rounds are taken first; sweep takes one more before
    each rate's points, so the figure spans the run and a slow spell of the host moves one round, not the step). A
    shape without rounds is left out, and its predictions take no host step."""
    if measure:
        for nodes, g in SHAPES:
            tiny_round(out, nodes, g, "start")
    together = {}
    for nodes, g in SHAPES:
        sizes = [size for path in sorted(out.glob(f"tiny-{SHARE_RATE_GBps:g}-{nodes}x{g}-*.json"))
                 for size in json.loads(path.read_text())["sizes"]]
        if sizes:
            together[f"{nodes}x{g}"] = {algo: statistics.median(size["seconds"][algo] for size in sizes)
                                        for algo in ("flat", "halo")}
    return together


def with_host_step(platform, calibration, nodes: int, g: int, tiny_s: dict[str, float] | None):
    """``platform`` with node.host_step_us: what the tiny flat exchange measured at another rate on this shape took
    beyond the model's time for it without a host step (its latency terms); and node.halo_step_us likewise from
    the tiny HALO exchange (its three phases' latency and copy terms; the model's HALO time grows linearly with
    the step, so one more evaluation gives the step that matches). Unchanged where not measured."""
    if not tiny_s:
        return platform
    data = platform.model_dump()
    data["node"]["host_step_us"] = max(tiny_s["flat"] - predict(platform, calibration, nodes, g, HOST_STEP_BYTES)["flat"],
                                       0.0) * 1e6
    if "halo" in tiny_s:
        halo_at = {}
        for step_us in (0.0, 1000.0):
            data["node"]["halo_step_us"] = step_us
            halo_at[step_us] = predict(type(platform).model_validate(data), calibration, nodes, g, HOST_STEP_BYTES)["halo"]
        per_us = (halo_at[1000.0] - halo_at[0.0]) / 1000.0
        data["node"]["halo_step_us"] = max(tiny_s["halo"] - halo_at[0.0], 0.0) / per_us if per_us > 0 else None
    return type(platform).model_validate(data)


def at_rate(platform, rate_GBps: float, to_GBps: float):
    """``platform`` (built for ``rate_GBps`` uplinks) with its uplinks at ``to_GBps``: the NIC and switch figures
    scaled by to / rate (the shaping efficiency of the test rate kept), the burst of a link at that rate."""
    data = platform.model_dump()
    scale = to_GBps / rate_GBps
    data["node"]["nic_bandwidth_GBps"] *= scale
    data["network"]["scopes"]["switch"]["bandwidth_GBps"] *= scale
    data["network"]["link_burst_bytes"] = NetworkSpec(to_GBps, UPLINKS).burst_bytes
    return type(platform).model_validate(data)


def with_hidden_step(platform, calibration, nodes: int, g: int, rate_GBps: float, other_rate: dict | None):
    """``platform`` with node.host_step_hidden fitted on the flat exchange of HIDDEN_FIT_BYTES measured at
    SHARE_RATE_GBps on this shape (at_other_rate: a rate no predicted point uses), priced at that rate with this
    test rate's calibration: the share of min(host step, wire time) the measurement did not take (the model's
    time falls linearly with it), in [0, 1]. Unchanged where that row was not measured or there is no host step."""
    sizes = (other_rate or {}).get("sizes", [])
    measured = [size["seconds"]["flat"] for size in sizes if size["bytes_per_rank"] == HIDDEN_FIT_BYTES]
    if not measured or platform.node.host_step_us <= 0:
        return platform
    data = platform.model_dump()
    at = {}
    for hidden in (0.0, 1.0):
        data["node"]["host_step_hidden"] = hidden
        there = at_rate(type(platform).model_validate(data), rate_GBps, SHARE_RATE_GBps)
        at[hidden] = predict(there, calibration, nodes, g, HIDDEN_FIT_BYTES)["flat"]
    span = at[0.0] - at[1.0]
    data["node"]["host_step_hidden"] = min(max((at[0.0] - measured[0]) / span, 0.0), 1.0) if span > 0 else 0.0
    return type(platform).model_validate(data)


def predict(platform, calibration, nodes: int, g: int, nbytes: int) -> dict[str, float]:
    from piper_plan.cost.comm import Network

    net = Network(platform, calibration)
    return {algo: float(sum(net.a2a_seconds(code, nodes * g, nodes, nbytes, 1))) for code, algo in enumerate(("flat", "halo"))}


def measure(spec: NetworkSpec, nodes: int, g: int, out: Path, round_no: int = 1):
    """flat and HALO at every size, round ``round_no`` of POINT_ROUNDS (kept in OUT: an interrupted run resumes
    where it stopped; round 1's file has the name a single-round sweep gave it)."""
    from piper_plan.calibration.bench_a2a import BenchConfig, network_bench, result_from_dict
    from piper_plan.fileio import atomic_write_json

    path = out / f"measured-{spec.uplink_GBps:g}-{nodes}x{g}{'' if round_no == 1 else f'-r{round_no}'}.json"
    if path.is_file():
        return result_from_dict(json.loads(path.read_text()))
    config = BenchConfig(("flat", "halo"), SIZES, nodes, g, repeats=REPEATS, statistic=STATISTIC)
    result = network_bench(config, spec, timeout_s=600)
    atomic_write_json(path, asdict(result))
    return result


def sweep(out: Path, shares: dict, price_link_use: bool = True) -> tuple[list[dict], dict]:
    """Per test rate: the shaping check, the calibration, the copies inside an exchange, flat and HALO at every
    shape and size (measured rows; priced afterwards by repredict, once the host-step rounds taken here are in),
    then the shaping check again (fastest_check) and the copies inside an exchange priced with the merged check."""
    from piper_plan.calibration import load_calibration

    rows, checks = [], {}
    for rate in RATES_GBps:
        spec = NetworkSpec(rate, UPLINKS)
        checks[rate] = shaping(spec, out)
        print(f"shaping {spec.text}: {checks[rate]}", flush=True)
        cal_dir = out / f"calibration-{rate:g}"
        calibrate(spec, cal_dir)
        checks[rate]["figures"] = link_figures(cal_dir)
        calibration = load_calibration(cal_dir)
        checks[rate]["copies_in_exchange"] = copies_in_exchange(out, spec, checks[rate], shares, calibration,
                                                                price_link_use, when="")
        rounds: dict[tuple[int, int], list] = {shape: [] for shape in SHAPES}
        for round_no in range(1, POINT_ROUNDS + 1):
            for nodes, g in SHAPES:
                if round_no == 1:
                    tiny_round(out, nodes, g, f"before-{rate:g}")    # the host-step calibration, spread over the run
                rounds[(nodes, g)].append(measure(spec, nodes, g, out, round_no))
            if round_no == 1:
                in_exchange_seconds(out, spec, "-mid")   # the copies inside an exchange, timed once more
        for (nodes, g), results in rounds.items():
            for row in point_rows(rate, nodes, g, results):
                rows.append(row)
                print(f"{rate:g} GB/s {nodes}x{g} {row['bytes']:>9} B: flat {row['flat_s'] * 1e3:8.2f} ms  halo "
                      f"{row['halo_s'] * 1e3:8.2f} ms (rounds: flat {rounds_ms(row['flat_rounds_s'])}, halo "
                      f"{rounds_ms(row['halo_rounds_s'])})", flush=True)
        checks[rate] = {**fastest_check(checks[rate], shaping(spec, out, "after")), "figures": checks[rate]["figures"]}
        print(f"shaping {spec.text}, after its points: {checks[rate]['checks']['after']}", flush=True)
        checks[rate]["copies_in_exchange"] = copies_in_exchange(out, spec, checks[rate], shares, calibration,
                                                                price_link_use, when="-after")
        print(f"copies inside an exchange: {checks[rate]['copies_in_exchange']}", flush=True)
    return rows, checks


def point_rows(rate: float, nodes: int, g: int, results: list) -> list[dict]:
    """One row per size of a shape: per algorithm the median of the rounds' figures (``results``: one bench result
    per round), each round's figure kept beside it; the load average is the highest any round saw."""
    rows = []
    for sizes in zip(*(result.sizes for result in results)):
        row = {"rate_GBps": rate, "nodes": nodes, "ranks_per_node": g, "bytes": sizes[0].bytes_per_rank}
        for algo in ("flat", "halo"):
            row[f"{algo}_rounds_s"] = [size.seconds[algo] for size in sizes]
            row[f"{algo}_s"] = statistics.median(row[f"{algo}_rounds_s"])
        loads = [size.load_avg for size in sizes if size.load_avg is not None]
        row["load_avg"] = max(loads) if loads else None
        rows.append(row)
    return rows


def rounds_ms(seconds: list[float]) -> str:
    return " / ".join(f"{s * 1e3:.2f}" for s in seconds)


def predict_row(row: dict, check: dict, shares: dict, copies: dict, calibration, tiny: dict, other: dict) -> dict:
    """``row`` (one measured point) with the model's flat and HALO seconds for it; ``other``: at_other_rate's
    figures of the calibrating OUT."""
    g, nodes = row["ranks_per_node"], row["nodes"]
    platform = platform_for(row["rate_GBps"], nodes, g, check["figures"], shares[f"flat {g}"], check, copies)
    platform = with_link_use(platform, nodes, (check.get("copies_in_exchange") or {}).get("link_use_priced"))
    platform = with_host_step(platform, calibration, nodes, g, tiny.get(f"{nodes}x{g}"))
    platform = with_hidden_step(platform, calibration, nodes, g, row["rate_GBps"], other.get(f"{nodes}x{g}"))
    row["host_step_us"] = platform.node.host_step_us
    row["halo_step_us"] = platform.node.halo_step_us
    row["host_step_hidden"] = platform.node.host_step_hidden
    pred = predict(platform, calibration, nodes, g, row["bytes"])
    row["flat_pred_s"], row["halo_pred_s"] = pred["flat"], pred["halo"]
    return row


# ------------------------------------------------------------------------------ closed loop


def closed_loop_calibration(out: Path, rate: float, measure: bool = True) -> Path:
    """OUT/closed-loop-calibration: calibration/local-cpu's GEMM and attention rows (the same CPU ranks), this
    network's collective rows, and the framework overhead measured right before the runs, as benchmarks/
    closed_loop.py does on loopback: the blocks and the 1- and 2-rank lockstep rows on this host, then the 4-rank
    lockstep rows by 2 x 2 ranks on the emulated network (bench_overhead --launched-ranks), the job shape of the
    closed loop. ``measure=False`` keeps the directory as an earlier run left it."""
    from piper_plan.catalog import calibration_dir

    cal_dir = out / "closed-loop-calibration"
    if not measure and (cal_dir / "overhead.csv").is_file():
        return cal_dir
    shutil.rmtree(cal_dir, ignore_errors=True)
    shutil.copytree(calibration_dir("local-cpu"), cal_dir)
    shutil.copy(out / f"calibration-{rate:g}" / "collectives.csv", cal_dir / "collectives.csv")
    if measure:
        subprocess.run(module("piper_plan.calibration.bench_overhead", "--out", str(cal_dir)), check=True, cwd=ROOT,
                       timeout=1800)
        run_on_network(NetworkSpec(rate, UPLINKS), 2, 2, module(
            "piper_plan.calibration.bench_overhead", "--launched-ranks", "--out", str(cal_dir)), 600)
    return cal_dir


def closed_loop(out: Path, shares: dict, checks: dict, copies: dict, tiny: dict, steps: int, fit: dict,
                run: bool = True) -> list[dict]:
    """dp4 ep4 (tiny-moe) with flat and with HALO on 2 nodes x 2 ranks of the slowest network; ``run=False``
    predicts again and compares with the steps measured before (OUT/closed-loop-*/metrics.jsonl)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from closed_loop import BATCH, MODEL, SEQ, runtime_options

    from piper_plan.calibration import load_calibration
    from piper_plan.catalog import load_model
    from piper_plan.cost.evaluate import estimate
    from piper_plan.planfile import write_plan_file
    from piper_plan.specs import ParallelPlan, TrainingSpec

    rate = min(RATES_GBps)
    cal_dir = closed_loop_calibration(out, rate, measure=run)
    calibration = load_calibration(cal_dir)
    platform = platform_for(rate, 2, 2, link_figures(cal_dir), shares["flat 2"], checks[rate], copies)
    platform = with_host_step(platform, calibration, 2, 2, tiny.get("2x2"))
    platform = with_hidden_step(platform, calibration, 2, 2, rate, fit.get("2x2"))
    model = load_model(MODEL)
    training = TrainingSpec(seq_len=SEQ, global_batch=BATCH, dtype="fp32", weight_bytes=4, grad_bytes=4, master_bytes=0)
    rows = []
    for a2a in ("flat", "halo"):
        plan = ParallelPlan(dp=4, ep=4, mbs=1, a2a=a2a, num_microbatches=BATCH // 4)
        prediction = estimate(model, platform, training, 2, plan, calibration=calibration, options=runtime_options())
        run_dir = out / f"closed-loop-{a2a}"
        if run:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_plan_file(run_dir / "plan.json", model, platform, training, 2, plan, "compact", prediction,
                            migration={"enabled": False})
            run_on_network(NetworkSpec(rate, UPLINKS), 2, 2, module(
                "piper_plan.runtime.train", "--plan", str(run_dir / "plan.json"), "--out", str(run_dir), "--steps",
                str(steps), "--aux-loss-coeff", "0"), 600)
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        rows.append({"plan": f"dp4 ep4 {a2a}", **loop_row(prediction.to_json(), records)})
        print(f"closed loop {rows[-1]}", flush=True)
    return rows


def loop_row(prediction: dict, records: list[dict]) -> dict:
    """Predicted against measured step, and its parts: the runtime's a2a and dp_sync timers (steady-state
    median) against the terms they cover, and the rest of the step."""
    from piper_plan.compare import compare

    result = compare(prediction, records)
    step, terms = result["step_time_s"], result["time_s"]
    breakdown = prediction["time"]["breakdown"]
    a2a, dp = (terms[k]["predicted"] or 0.0 for k in ("a2a", "dp_sync"))
    measured = {k: terms[k]["measured"] or 0.0 for k in ("a2a", "dp_sync")}
    inter = sum(v for k, v in breakdown.items() if k.startswith("moe/") and k.endswith("/inter_node"))
    return {"predicted_s": step["predicted"], "measured_s": step["measured"], "rel_error": step["rel_error"],
            "a2a_pred_s": a2a, "a2a_meas_s": measured["a2a"], "a2a_inter_node_pred_s": inter,
            "sync_wait_pred_s": breakdown.get("moe/sync_wait", 0.0), "dp_pred_s": dp, "dp_meas_s": measured["dp_sync"],
            "rest_pred_s": step["predicted"] - a2a - dp, "rest_meas_s": step["measured"] - measured["a2a"] - measured["dp_sync"]}


# ------------------------------------------------------------------------------ report


def rel(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def summary(rows: list[dict]) -> dict:
    big = [r for r in rows if r["bytes"] >= BIG]
    errors = {a: [abs(rel(r[f"{a}_pred_s"], r[f"{a}_s"])) for r in big] for a in ("flat", "halo")}
    sign_ok = [(r["flat_s"] > r["halo_s"]) == (r["flat_pred_s"] > r["halo_pred_s"]) for r in rows]
    wins = [r for r in rows if r["flat_s"] > r["halo_s"] and r["flat_pred_s"] > r["halo_pred_s"]]
    return {"within15": {a: sum(e <= 0.15 for e in v) for a, v in errors.items()}, "big_points": len(big),
            "mape": {a: 100 * statistics.mean(v) for a, v in errors.items()}, "sign_right": sum(sign_ok),
            "points": len(rows), "wins": wins}


def table(rows: list[dict]) -> list[str]:
    lines = ["| GB/s per uplink | nodes x ranks | bytes/rank | flat ms | flat pred | err | HALO ms | HALO pred | err | "
             "speedup meas | speedup pred | load |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rate_GBps']:g} | {r['nodes']} x {r['ranks_per_node']} | {r['bytes']:,} | "
                     f"{r['flat_s'] * 1e3:.2f} | {r['flat_pred_s'] * 1e3:.2f} | {100 * rel(r['flat_pred_s'], r['flat_s']):+.0f}% | "
                     f"{r['halo_s'] * 1e3:.2f} | {r['halo_pred_s'] * 1e3:.2f} | {100 * rel(r['halo_pred_s'], r['halo_s']):+.0f}% | "
                     f"{r['flat_s'] / r['halo_s']:.2f} | {r['flat_pred_s'] / r['halo_pred_s']:.2f} | "
                     f"{r.get('load_avg') or '-'} |")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(RATES_GBps), len(SHAPES), figsize=(4 * len(SHAPES), 3.4 * len(RATES_GBps)), squeeze=False)
    for i, rate in enumerate(RATES_GBps):
        for j, (nodes, g) in enumerate(SHAPES):
            ax, sel = axes[i][j], [r for r in rows if r["rate_GBps"] == rate and (r["nodes"], r["ranks_per_node"]) == (nodes, g)]
            x = [r["bytes"] / 1024 for r in sel]
            for algo, color in (("flat", "tab:blue"), ("halo", "tab:red")):
                ax.plot(x, [r[f"{algo}_s"] * 1e3 for r in sel], "o-", color=color, label=f"{algo} measured")
                ax.plot(x, [r[f"{algo}_pred_s"] * 1e3 for r in sel], "--", color=color, label=f"{algo} model")
            ax.set(xscale="log", yscale="log", title=f"{nodes} x {g} ranks, {UPLINKS} x {rate:g} GB/s uplinks",
                   xlabel="KiB per rank", ylabel="ms")
            ax2 = ax.twinx()
            ax2.plot(x, [r["flat_s"] / r["halo_s"] for r in sel], ":", color="k", label="speedup measured")
            ax2.set_ylabel("flat / HALO", fontsize=8)
            if i == j == 0:
                ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def repeatability(rows: list[dict], again: list[dict]) -> list[str]:
    """The same points measured in two sweeps: the second's time against the first's, per point (>= BIG), and the
    model's counts against each."""
    pairs = [(a, b) for a, b in zip(rows, again) if a["bytes"] >= BIG]
    assert all((a["rate_GBps"], a["nodes"], a["ranks_per_node"], a["bytes"]) ==
               (b["rate_GBps"], b["nodes"], b["ranks_per_node"], b["bytes"]) for a, b in pairs), "sweeps differ"
    spread = {algo: [rel(b[f"{algo}_s"], a[f"{algo}_s"]) for a, b in pairs] for algo in ("flat", "halo")}
    first, second = summary(rows), summary(again)
    lines = ["## Repeatability (the same points measured in a second sweep)", "",
             "| | flat | HALO |", "|---|---|---|"]
    lines.append("| second sweep within 15% of the first (>= 256 KiB) | "
                 + " | ".join(f"{sum(abs(x) <= 0.15 for x in v)}/{len(v)}" for v in spread.values()) + " |")
    lines.append("| second against first, range | "
                 + " | ".join(f"{100 * min(v):+.0f}% .. {100 * max(v):+.0f}%" for v in spread.values()) + " |")
    lines.append("| median abs difference | "
                 + " | ".join(f"{100 * statistics.median(abs(x) for x in v):.0f}%" for v in spread.values()) + " |")
    for name, s in (("first", first), ("second", second)):
        lines.append(f"| model within 15%, {name} sweep | {s['within15']['flat']}/{s['big_points']} | "
                     f"{s['within15']['halo']}/{s['big_points']} |")
    lines += ["", f"Sign of HALO's speedup right: first sweep {first['sign_right']}/{first['points']}, second "
              f"{second['sign_right']}/{second['points']}; wins predicted and measured: {len(first['wins'])} / "
              f"{len(second['wins'])}.", ""] + repeatability_bound(rows, again) + [
              "", "| GB/s | shape | bytes/rank | flat ms first / second | HALO ms first / second |", "|---|---|---|---|---|"]
    lines += [f"| {a['rate_GBps']:g} | {a['nodes']} x {a['ranks_per_node']} | {a['bytes']:,} | {a['flat_s'] * 1e3:.1f} / "
              f"{b['flat_s'] * 1e3:.1f} | {a['halo_s'] * 1e3:.1f} / {b['halo_s'] * 1e3:.1f} |" for a, b in pairs]
    return lines + [""]


def point_name(r: dict) -> str:
    return f"{r['rate_GBps']:g} GB/s {r['nodes']}x{r['ranks_per_node']} {r['bytes'] // 1024} KiB"


def repeatability_bound(rows: list[dict], again: list[dict]) -> list[str]:
    """What no model can reach in both sweeps: a point whose two times are more than 1.15 / 0.85 apart has no value
    within 15% of both (the intervals [0.85 t, 1.15 t] do not meet), and a point whose measured speedup changes
    sign between the sweeps is predicted right in one of them at most."""
    apart = RATIO_NO_COMMON_15
    far = {algo: [point_name(a) for a, b in zip(rows, again) if a["bytes"] >= BIG
                  and max(a[f"{algo}_s"], b[f"{algo}_s"]) > apart * min(a[f"{algo}_s"], b[f"{algo}_s"])]
           for algo in ("flat", "halo")}
    flips = [point_name(a) for a, b in zip(rows, again) if (a["flat_s"] > a["halo_s"]) != (b["flat_s"] > b["halo_s"])]
    big = sum(r["bytes"] >= BIG for r in rows)
    return [f"What no model can reach in both sweeps: at {len(far['flat'])} flat and {len(far['halo'])} HALO points "
            f"(>= 256 KiB) the two times are more than {apart:.3f}x apart, so no value is within 15% of both "
            f"(flat: {', '.join(far['flat']) or 'none'}; HALO: {', '.join(far['halo']) or 'none'}): at most "
            f"{big - len(far['flat'])}/{big} flat and {big - len(far['halo'])}/{big} HALO points within 15% of both. "
            f"The measured sign of HALO's speedup differs between the sweeps at {len(flips)} of {len(rows)} points "
            f"({', '.join(flips) or 'none'}): the sign is right in both at {len(rows) - len(flips)} at most."]


def uplink_use_table(uses: dict) -> list[str]:
    """The report's table of how busy flat and HALO keep each node's busiest uplink (measured_uplink_use)."""
    if not uses:
        return []
    lines = ["", f"## Uplink use (flat and HALO at {SHARE_RATE_GBps:g} GB/s, {USE_BYTES // 2**20} MiB per rank, "
             "a rate no predicted point uses)", "", "One rank per node sampled its uplinks' byte counters every 5 ms "
             f"through {REPEATS} calls of each (benchmarks/halo_phases.py --uplink-use). Utilization: the busiest "
             "uplink's bytes between the first and the last sample inside a call (the slowest rank's time) against "
             "what its rate allows in that span, mean over nodes, of the fastest call. The model takes both as 1 "
             "(flat: the switch bandwidth of the platform is the uplink rate / "
             "(ranks per node x busiest share); HALO's phase II per NIC, cost/comm.py), except flat on 3 or more "
             f"nodes, priced at its link use on {IN_EXCHANGE_SHAPE[0]} x {IN_EXCHANGE_SHAPE[1]} at the test rate "
             "(below): these figures at this rate are reported, not priced (benchmarks/halo_network_analysis.md says "
             "why).", "",
             "| shape | flat: fastest call ms | busiest uplink utilization | below half rate | HALO: fastest call ms | "
             "utilization | below half rate |", "|---|---|---|---|---|---|---|"]
    def cells(figures: dict | None) -> str:
        if figures is None:
            return "- | - | -"
        return f"{figures['seconds'] * 1e3:.1f} | {figures['utilization']:.2f} | {figures['below_half']:.0%}"
    lines += [f"| {shape.replace('x', ' x ')} | {cells(u['flat'])} | {cells(u['halo'])} |" for shape, u in uses.items()]
    return lines


def copies_inside_lines(checks: dict, copies: dict) -> list[str]:
    """The copy rate inside an exchange per test rate, which the model prices the copies at where measured."""
    inside = {rate: c["copies_in_exchange"] for rate, c in checks.items()
              if (c.get("copies_in_exchange") or {}).get("host_GBps")}
    if not inside:
        return []
    nodes, g = IN_EXCHANGE_SHAPE
    alone = copies["host_GBps"]
    parts = [f"{rate:g} GB/s: HALO {c['measured_s'] * 1e3:.1f} ms measured, its phases modelled "
             f"{c['phases_s'] * 1e3:.1f} ms, so {c['host_GBps']:.2f} GB/s"
             + (f", above the copies alone: priced at their {alone:.2f}" if c["host_GBps"] > alone else "")
             for rate, c in sorted(inside.items())]
    uses = [f"{rate:g} GB/s: flat {c['flat_measured_s'] * 1e3:.1f} ms measured, {c['flat_link_use']:.2f} of it modelled"
            + ("" if c.get("link_use_priced") else " (not priced: --no-link-use)")
            for rate, c in sorted(inside.items()) if c.get("flat_link_use")]
    wide = ", ".join(f"{n} x {r}" for n, r in SHAPES if n >= nodes)
    use_line = ([f"The same exchange gives flat's link use on {nodes} or more nodes ({'; '.join(uses)}): where an "
                 "uplink's flows go to several nodes they take turns on it, and flat's inter-node rate on such shapes "
                 f"({wide} here) is priced at that share of the switch figure. Between two nodes it is not."]
                if uses else [])
    return ["", f"Inside an exchange the copies run slower than alone: HALO at {COPY_BYTES // 2**20} MiB per rank on "
            f"{nodes} x {g} ranks (a shape no predicted point has; the median of its timings before the rate's "
            "points, between their first and second rounds and after them, of those the OUT holds), less the model's "
            "time for its phases without copies "
            f"(no host step: none is calibrated for that shape), is its copies' time ({'; '.join(parts)} over the "
            "host). A job of n ranks gets 1/n of the host's rate per rank.", *network_work_line(checks, copies),
            *use_line]


def network_work_line(checks: dict, copies: dict) -> list[str]:
    """How the copies' rate differs per shape (copies_beside_network_GBps), or that it does not."""
    if not copies.get("network_host_work", True):
        return ["The model prices the copies at that rate on every shape (--no-network-host-work)."]
    rates = [f"{rate:g} GB/s: " + ", ".join(f"{n} x {r} {copies_beside_network_GBps(copies, c, n, r):.2f}"
                                           for n, r in SHAPES)
             for rate, c in sorted(checks.items()) if (c.get("copies_in_exchange") or {}).get("host_GBps")]
    return [f"What the copies lose there is the emulated network's own work on this host (veth, bridge, tbf: every "
            f"byte crossing it costs the kernel time on the cores the copies run on): against the copies alone "
            f"({copies['host_GBps']:.2f} GB/s) it is priced per byte crossing the network, so a shape sending more of "
            "its bytes across it than it copies gets a slower copy rate (copies_beside_network_GBps; GB/s over the "
            f"host: {'; '.join(rates)})."]


def host_step_lines(rows: list[dict], other_rate: dict[str, dict], tiny: dict) -> list[str]:
    """The flat all-to-all and HALO's tiny exchange measured at SHARE_RATE_GBps, and the host steps each shape's
    prediction uses."""
    def steps(key: str) -> dict:
        return {(r["rate_GBps"], f"{r['nodes']}x{r['ranks_per_node']}"): r.get(key) or 0.0 for r in rows}

    flat_steps, halo_steps, hidden = steps("host_step_us"), steps("halo_step_us"), steps("host_step_hidden")
    rates = " / ".join(f"{r:g}" for r in RATES_GBps)
    kib = HOST_STEP_BYTES // 1024
    lines = ["", f"Flat all-to-all alone at {SHARE_RATE_GBps:g} GB/s per uplink (a rate no predicted point uses; "
             f"fastest of {REPEATS}, ms; '-': not measured in this OUT); the {kib} KiB flat and HALO exchanges at "
             f"that rate timed together as the test points are (the median of every round's fastest of {REPEATS}: "
             f"{TINY_ROUNDS} in a row at the start and before each test rate's points), and the host step per "
             f"dependent step they give each shape (node.host_step_us: the {kib} KiB flat exchange's time beyond the "
             "model's latency terms with each "
             f"test rate's calibration; node.halo_step_us: per HALO phase, the {kib} KiB HALO exchange's time beyond "
             f"the model's terms for it; node.host_step_hidden: the share of min(step, wire time) that runs under a "
             f"step's inter-node transfer, fitted so that the flat {HIDDEN_FIT_BYTES // 1024:,} KiB exchange at "
             f"{SHARE_RATE_GBps:g} GB/s is priced as measured, with each test rate's platform, clipped to 0..1):", "",
             "| shape | " + " | ".join(f"{b // 1024:,} KiB" for b in OTHER_RATE_SIZES)
             + f" | flat / HALO {kib} KiB together | host step us at {rates} GB/s | HALO step us at {rates} GB/s "
             f"| hidden share at {rates} GB/s |", "|---" * (len(OTHER_RATE_SIZES) + 5) + "|"]
    for shape in (f"{nodes}x{g}" for nodes, g in SHAPES):
        ms = {s["bytes_per_rank"]: s["seconds"]["flat"] * 1e3 for s in other_rate.get(shape, {}).get("sizes", [])}
        pair = tiny.get(shape, {})
        together = " / ".join(f"{1e3 * pair[a]:.2f}" if a in pair else "-" for a in ("flat", "halo"))
        lines.append(f"| {shape} | " + " | ".join(f"{ms[b]:.2f}" if b in ms else "-" for b in OTHER_RATE_SIZES)
                     + f" | {together} | " + " / ".join(f"{flat_steps.get((r, shape), 0.0):.0f}" for r in RATES_GBps)
                     + " | " + " / ".join(f"{halo_steps.get((r, shape), 0.0):.0f}" for r in RATES_GBps)
                     + " | " + " / ".join(f"{hidden.get((r, shape), 0.0):.2f}" for r in RATES_GBps) + " |")
    return lines


def point_rounds_text(rows: list[dict]) -> str:
    """How many rounds a test point's figure is the median of (an OUT measured before POINT_ROUNDS has one)."""
    counts = sorted({len(r.get("flat_rounds_s", [None])) for r in rows})
    if counts == [1]:
        return "a test point measured once; "
    return (f"a test point's figure is the median of {' or '.join(map(str, counts))} rounds' fastest calls (each "
            "round a bench run of its own, every shape's round taken before the next round of any shape); ")


def report(rows, checks, shares, loop_rows, copies, again=None, other_rate=None, tiny=None, uses=None) -> str:
    s = summary(rows)
    lines = ["# HALO vs flat all-to-all on an emulated multi-node network (measured)", "",
             "Generated by `benchmarks/halo_network.py` (run as root; scripts/netemu.sh builds the network); do not edit "
             f"by hand. {UPLINKS} uplinks per node (veth into one bridge per uplink index, tc tbf each way), ranks of a "
             f"node in one network namespace (loopback inside), gloo over the uplink addresses, CPU ranks on this "
             f"2-core machine shared with other work. An all-to-all figure is the fastest of {REPEATS} calls after one "
             "warm-up (noise on a shared host only adds time) of one call's time over all ranks, from the first "
             "rank's start to the last rank's end (one host, one clock), flat and HALO timed in alternation with a "
             "barrier before each call (calibration/bench_a2a.py); "
             + point_rounds_text(rows) + "calibration rows per rank the fastest call, the slowest rank's; the "
             "host's 1-minute load average after each size in the table (the highest of its rounds).",
             "", "## Shaping check", "", "| set GB/s per uplink | measured between nodes | within 10% | inside a node "
             "| both ways, one communicator | both ways, two communicators |", "|---|---|---|---|---|---|"]
    for rate, c in checks.items():
        ok = abs(c["inter_node_GBps"] / rate - 1) <= 0.10
        two_way = [f"{c[k]:.4f}" if c.get(k) else "not measured"
                   for k in ("two_way_one_connection_GBps", "two_way_two_connections_GBps")]
        both = c.get("checks")
        seen = f" (before {both['before']['inter_node_GBps']:.4f}, after {both['after']['inter_node_GBps']:.4f})" if both else ""
        lines.append(f"| {rate:g} | {c['inter_node_GBps']:.4f}{seen} | {'yes' if ok else 'NO'} | {c['intra_node_GBps']:.3f} "
                     f"(unshaped) | {two_way[0]} | {two_way[1]} |")
    statistic = next(iter(checks.values())).get("statistic", "median of 3")   # OUTs without it (before 8677749)
    statistic += "" if "warm-up" in statistic else " after a warm-up"
    lines += ["", f"One-way 16 MiB `send`/`recv`, one message at a time, the {statistic} "
              "(piper_plan/calibration/bench_shaping.py). GB/s = "
              "1e9 payload bytes/s; tbf counts frame bytes (MTU 9000: ~0.6% headers). Both ways: 16 MiB each way "
              "between the same two ranks at once, GB/s per direction; on one communicator both directions share one "
              "gloo connection, which carries one direction at a time, so HALO's phase II sends each direction on its "
              "own communicator (runtime/halo.py `_p2p_group`).", "",
              "## NIC use (tc byte counters, 2 nodes, 4 MiB per rank, uplinks at "
              f"{SHARE_RATE_GBps:g} GB/s)", "", "| algorithm | ranks per node | busiest uplink's share of a node's inter-node bytes |",
              "|---|---|---|"]
    lines += [f"| {k.split()[0]} | {k.split()[1]} | {v:.3f} (even: {1 / UPLINKS:.2f}) |" for k, v in shares.items()]
    lines += uplink_use_table(uses or {})
    lines += ["", "## Calibration used by the model (per rate; 2 nodes x 4 ranks, all-to-all across nodes dropped)", "",
              "| GB/s per uplink | node all_to_all busbw GB/s | node latency us | switch latency us | best inter-node p2p (sendrecv) GB/s | half duplex |",
              "|---|---|---|---|---|---|"]
    for rate, c in checks.items():
        f = c["figures"]
        lines.append(f"| {rate:g} | {f['node_GBps']:.3f} | {f['node_latency_us']:.0f} | {f['switch_latency_us']:.0f} | "
                     f"{f['p2p_switch_GBps']:.4f} | {'yes' if half_duplex(c) else 'no'} |")
    lines += ["", f"Half duplex: both ways on one communicator below {HALF_DUPLEX_BELOW:g} x the one-way rate (shaping "
              "check); then a one-way transfer of b bytes is priced as the p2p (sendrecv) row of b / 2 "
              "(network.half_duplex_connections). gloo's all_to_all_single posts every message before it waits "
              "(gloo/alltoallv.cc), so an exchange pays one latency, not one per peer (network.a2a_posts_all). "
              f"HALO's row copies (cost/comm.py relay_copy_bytes) timed alone on {copies['ranks']} ranks at once, "
              f"{copies['bytes_per_rank'] // 2**20} MiB per rank (benchmarks/halo_phases.py --copies): "
              f"{copies['seconds'] * 1e3:.1f} ms for {copies['copy_bytes_per_rank'] / 1e6:.1f} MB per rank, the host "
              f"copies {copies['host_GBps']:.2f} GB/s over all ranks; a job of n ranks gets 1/n of it per rank "
              "(node.relay_copy_GBps)."] + copies_inside_lines(checks, copies)
    lines += host_step_lines(rows, other_rate, tiny or {})
    lines += ["", "## Flat vs HALO: measured and predicted", ""] + table(rows) + [
        "", "![measured (solid) and modelled (dashed) all-to-all time; dotted: measured flat / HALO](halo-measured.png)", "",
        "## Against the targets", "",
        f"- model within 15% at >= 256 KiB: flat {s['within15']['flat']}/{s['big_points']} points "
        f"(mean error {s['mape']['flat']:.0f}%), HALO {s['within15']['halo']}/{s['big_points']} (mean error {s['mape']['halo']:.0f}%);",
        f"- sign of HALO's speedup predicted right at {s['sign_right']}/{s['points']} points;",
        f"- predicted and measured HALO wins: {len(s['wins'])} "
        + ("(" + "; ".join(f"{w['rate_GBps']:g} GB/s {w['nodes']}x{w['ranks_per_node']} {w['bytes'] // 1024} KiB: "
                           f"{w['flat_s'] / w['halo_s']:.2f}x measured, {w['flat_pred_s'] / w['halo_pred_s']:.2f}x predicted"
                           for w in s["wins"]) + ")" if s["wins"] else "") + ".", ""]
    lines += repeatability(rows, again) if again else []
    if loop_rows:
        lines += ["## Closed loop on the emulated network", "",
                  f"tiny-moe, seq 128, global batch 8, 2 nodes x 2 ranks, {UPLINKS} x {min(RATES_GBps):g} GB/s uplinks; "
                  "prediction with this network's platform and collective calibration, calibration/local-cpu's GEMM / "
                  "attention rows, and the framework overhead measured right before the runs (blocks and 1- / 2-rank "
                  "lockstep rows on this host, the 4-rank lockstep rows by 2 x 2 ranks on this network: "
                  "`bench_overhead --launched-ranks`); runtime under scripts/netemu.sh run. Measured: steady-state "
                  "median; a2a and dp sync are the runtime's timers (waits included), predicted a2a = dispatch + "
                  "combine + layout + moe/sync_wait.", "",
                  "| plan | predicted step s | measured step s | error | a2a pred / meas s | of it sync_wait pred s "
                  "| dp sync pred / meas s | rest pred / meas s |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['plan']} | {r['predicted_s']:.4f} | {r['measured_s']:.4f} | {100 * r['rel_error']:+.1f}% | "
                  f"{r['a2a_pred_s']:.4f} / {r['a2a_meas_s']:.4f} | {r['sync_wait_pred_s']:.4f} | "
                  f"{r['dp_pred_s']:.4f} / {r['dp_meas_s']:.4f} | {r['rest_pred_s']:.4f} / {r['rest_meas_s']:.4f} |"
                  for r in loop_rows]
        lines.append("")
    return "\n".join(lines) + "\n"


KEPT_FROM_FIRST = ("shares.json", "copies.json", "copies-probe.json", "shaping-{rate:g}.json",
                   "shaping-{rate:g}-after.json", "calibration-{rate:g}",
                   "flat-{share:g}-{nodes}x{g}.json", "uplink-use-{share:g}-{nodes}x{g}.json")


def reuse_calibration(first: Path, out: Path) -> None:
    """A repeat sweep into OUT measures flat and HALO again on the calibration, both shaping checks and NIC shares
    of the sweep in FIRST (copied; a FIRST with one check gives its one check as both), so the two sweeps differ
    only in the measurement being repeated."""
    for pattern in KEPT_FROM_FIRST:
        for rate in RATES_GBps:
            for nodes, g in SHAPES:
                name = pattern.format(rate=rate, share=SHARE_RATE_GBps, nodes=nodes, g=g)
                source, target = first / name, out / name
                if target.exists() or not source.exists():
                    continue
                (shutil.copytree if source.is_dir() else shutil.copy)(source, target)
    for rate in RATES_GBps:   # FIRST took one shaping check (before 12bd5ae): no second one in the repeat
        once, again = out / f"shaping-{rate:g}.json", out / f"shaping-{rate:g}-after.json"
        if once.exists() and not again.exists():
            shutil.copy(once, again)
    for source in first.glob("tiny-*.json"):   # every host-step round: the repeat is priced on the first's
        if not (out / source.name).exists():
            shutil.copy(source, out / source.name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/piper-halo-net")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "halo-measured.md"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--reuse", action="store_true", help="re-predict and re-render from OUT/results.json")
    ap.add_argument("--no-closed-loop", action="store_true")
    ap.add_argument("--rerun-closed-loop", action="store_true",
                    help="with --reuse: calibrate the overhead and run the closed loop again (the sweep is kept)")
    ap.add_argument("--from", dest="first", default=None,
                    help="a repeat sweep: take calibration, shaping and NIC shares from this earlier OUT")
    ap.add_argument("--repeat", default=None, help="an OUT measured again with --from OUT: report the spread per point")
    ap.add_argument("--no-link-use", action="store_true",
                    help="price flat on 3+ nodes without the link use measured on IN_EXCHANGE_SHAPE (the with / "
                         "without comparison of the analysis)")
    ap.add_argument("--no-network-host-work", action="store_true",
                    help="price HALO's copies at the in-exchange rate on every shape, without the emulated network's "
                         "host work per byte (copies_beside_network_GBps; the with / without comparison)")
    ap.add_argument("--no-shared-host", action="store_true",
                    help="price the intra-node phases at one node's time, as if each emulated node had its own host "
                         "(node.nodes_share_host off; the with / without comparison)")
    ap.add_argument("--no-hidden-step", action="store_true",
                    help="price without node.host_step_hidden (the with / without comparison of the analysis)")
    args = ap.parse_args()
    from piper_plan.fileio import atomic_write_json, atomic_write_text

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.first:
        reuse_calibration(Path(args.first), out)
    copies = {**relay_copies(out, reuse=args.reuse), "network_host_work": not args.no_network_host_work,
              "nodes_share_host": not args.no_shared_host}
    print(f"relay copies: {copies}", flush=True)
    if args.reuse:
        saved = json.loads((out / "results.json").read_text())
        rows, checks, shares = saved["rows"], {float(k): v for k, v in saved["checks"].items()}, saved["shares"]
        tiny = tiny_seconds(out)
        uses = measured_uplink_use(out, measure=False)   # --reuse re-renders: it measures nothing
        checks_from_files(out, checks)
        copies_inside_saved(out, checks, shares, not args.no_link_use)
        other_rate = at_other_rate(out, measure=False)
        fit = {} if args.no_hidden_step else other_rate   # what node.host_step_hidden is fitted on (with_hidden_step)
        rows = repredict(out, rows, checks, shares, copies, tiny, fit)
        again_loop = args.rerun_closed_loop
        loop_rows = (closed_loop(out, shares, checks, copies, tiny, args.steps, fit, run=again_loop)
                     if saved["closed_loop"] or again_loop else [])
    else:
        shares_path = out / "shares.json"
        shares = json.loads(shares_path.read_text()) if shares_path.is_file() else nic_shares(out)
        atomic_write_json(shares_path, shares)
        print(f"busiest-uplink shares: {shares}", flush=True)
        tiny = tiny_seconds(out, measure=True)
        print(f"tiny exchanges at {SHARE_RATE_GBps:g} GB/s: {tiny}", flush=True)
        other_rate = at_other_rate(out)   # flat alone at that rate: reported beside the host steps, fits the share
        fit = {} if args.no_hidden_step else other_rate
        uses = measured_uplink_use(out)
        print(f"uplink use at {SHARE_RATE_GBps:g} GB/s: {uses}", flush=True)
        rows, checks = sweep(out, shares, not args.no_link_use)
        tiny = tiny_seconds(out)                          # with the rounds the sweep took
        rows = repredict(out, rows, checks, shares, copies, tiny, fit)
        loop_rows = [] if args.no_closed_loop else closed_loop(out, shares, checks, copies, tiny, args.steps, fit)
    atomic_write_json(out / "results.json", {"rows": rows, "checks": checks, "shares": shares, "closed_loop": loop_rows,
                                             "copies": copies})
    doc = Path(args.doc)
    plot(rows, doc.with_suffix(".png"))
    again = None
    if args.repeat:
        other = Path(args.repeat)
        saved_again = json.loads((other / "results.json").read_text())
        again = repredict(other, saved_again["rows"], checks, shares, copies, tiny, fit)
    text = report(rows, checks, shares, loop_rows, copies, again, other_rate, tiny, uses)
    atomic_write_text(doc, text + analysis_text())
    print(text)
    return 0


def checks_from_files(out: Path, checks: dict) -> None:
    """With --reuse: each rate's shaping check merged again from OUT's two check files (fastest_check), where OUT
    has both; an OUT with one check keeps it as saved."""
    for rate, check in checks.items():
        before, after = out / f"shaping-{rate:g}.json", out / f"shaping-{rate:g}-after.json"
        if before.is_file() and after.is_file():
            merged = fastest_check(json.loads(before.read_text()), json.loads(after.read_text()))
            checks[rate] = {**merged, "figures": check["figures"]}


def copies_inside_saved(out: Path, checks: dict, shares: dict, price_link_use: bool = True) -> None:
    """With --reuse: the copy rate inside an exchange (re)computed from OUT's measurement of it where OUT has one
    (an OUT measured before it was taken keeps the copies-alone rate)."""
    from piper_plan.calibration import load_calibration

    nodes, g = IN_EXCHANGE_SHAPE
    for rate, check in checks.items():
        check.pop("copies_in_exchange", None)
        if (out / f"halo-copies-{rate:g}-{nodes}x{g}.json").is_file():
            check["copies_in_exchange"] = copies_in_exchange(out, NetworkSpec(rate, UPLINKS), check, shares,
                                                             load_calibration(out / f"calibration-{rate:g}"),
                                                             price_link_use)


def repredict(out: Path, rows: list[dict], checks: dict, shares: dict, copies: dict, tiny: dict,
              other: dict) -> list[dict]:
    """The saved measurements with the model's predictions computed again (after a model change)."""
    from piper_plan.calibration import load_calibration

    cals = {rate: load_calibration(out / f"calibration-{rate:g}") for rate in checks}
    return [predict_row(r, checks[r["rate_GBps"]], shares, copies, cals[r["rate_GBps"]], tiny, other) for r in rows]


def analysis_text() -> str:
    path = ROOT / "benchmarks" / "halo_network_analysis.md"
    return "\n" + path.read_text() if path.is_file() else ""


if __name__ == "__main__":
    sys.exit(main())
