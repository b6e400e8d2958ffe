"""Benchmark and verify the flat all-to-all against HALO (``piper bench a2a``): a calibration driver.

On one machine this spawns ``nodes x ranks_per_node`` gloo processes with an emulated topology (over loopback,
or with ``network`` over the emulated multi-node network of scripts/netemu.sh, one namespace per node); under
torchrun or srun it uses the job's own ranks and the detected topology (piper_plan.launchenv). Per message size it times
``torch.distributed.all_to_all_single`` (flat) and ``HaloDispatcher`` (halo) on the same data and, with
``verify``, checks that HALO's output and gradients equal ``all_to_all_single``'s exactly.

Sizes follow nccl-tests (``alltoall_perf``): ``bytes_per_rank`` is its ``size`` column, the bytes one rank
sends in total (its share to itself included), split evenly over the ranks; ``algbw = size / time`` and
``busbw = algbw x (n - 1) / n`` (nccl-tests doc/PERFORMANCE.md; calibration.schema.busbw_factor). A size is
rounded to whole rows of at most ``ROW_FLOATS`` float32 per peer, and the actual byte count is reported.
Time = the median over ``repeats`` calls after ``warmup`` untimed calls, or the fastest call (``statistic="min"``:
the uncontended time on a shared host), of one call's time over all ranks: from the first rank's start to the last
rank's end where the ranks share a host's clock (CPU ranks on one machine, the emulated network), else the slowest
rank's own time (calibration.timing.exchange_spans). The algorithms are timed in alternation, a call of each per
round (``interleaved_call_times``), so the host's slow spells fall on both and their ratio, HALO's speedup, holds
on a shared machine; a barrier (untimed) before every call makes each one exchange from quiet links, as an expert
all-to-all between two layers' compute is.

HALO itself is the runtime's (runtime/halo.py); this module imports it inside the functions that run on a rank
(the one seam between calibration/ and runtime/, docs/design-notes.md).
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from piper_plan.calibration.schema import collective_bandwidths_GBps
from piper_plan.errors import PiperError
from piper_plan.launchenv import MAX_LOCAL_RANKS, device_index, read_launch_env
from piper_plan.runtime.mesh import end_process_group

ALGOS = ("flat", "halo")
ROW_FLOATS = 64
"""Widest row (float32 elements) used to carry a message; narrower when a peer's share is smaller."""
SIZE_SUFFIX = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
"""Size suffixes as nccl-tests' parsesize reads them (powers of 1024)."""
OP_OF_ALGO = {"flat": "all_to_all", "halo": "halo_all_to_all"}
"""collectives.csv ``op`` of each algorithm."""


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"4K,64K,1M"`` -> (4096, 65536, 1048576) bytes."""
    sizes = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", item.upper())
        if not match or int(match.group(1)) == 0:
            raise PiperError(f"--sizes: {item.strip()!r} is not a positive size; use e.g. 4K,64K,1M (K = 1024 bytes)")
        size = int(match.group(1)) * SIZE_SUFFIX[match.group(2)]
        if size in sizes:
            raise PiperError(f"--sizes: {item.strip()!r} is {size} bytes again; give each size once")
        sizes.append(size)
    return tuple(sizes)


BUFFERS_PER_RANK = 6
"""Message-sized buffers a rank holds at once (input, flat and HALO outputs, phase buffers, gradients)."""


def check_local_spawn(nodes: int, ranks_per_node: int, sizes_bytes: tuple[int, ...]) -> None:
    """Refuse a local spawn that would start too many processes or allocate more than the machine's memory."""
    ranks = nodes * ranks_per_node
    if ranks < 2:
        raise PiperError(f"--nodes x --ranks-per-node = {nodes} x {ranks_per_node}: an all-to-all needs 2 ranks or "
                         "more")
    if ranks > MAX_LOCAL_RANKS:
        raise PiperError(f"--nodes x --ranks-per-node = {nodes} x {ranks_per_node} = {ranks} local processes; at most "
                         f"{MAX_LOCAL_RANKS} on one machine (launch under srun / torchrun for real nodes)")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need = ranks * BUFFERS_PER_RANK * max(sizes_bytes)
    if need > memory // 2:
        raise PiperError(f"--sizes up to {max(sizes_bytes)} bytes on {ranks} ranks needs ~{need / 1e9:.1f} GB; "
                         f"this machine has {memory / 1e9:.1f} GB (allowed: half of it)")


def parse_algos(text: str) -> tuple[str, ...]:
    """``"flat,halo"`` -> ("flat", "halo")."""
    algos = tuple(a.strip() for a in text.split(",") if a.strip())
    bad = [a for a in algos if a not in ALGOS]
    if bad or not algos:
        raise PiperError(f"--algo: {','.join(bad) or text!r} unknown; allowed: {', '.join(ALGOS)}")
    return algos


@dataclass(frozen=True)
class BenchConfig:
    """What one benchmark run does (picklable: handed to spawned ranks)."""

    algos: tuple[str, ...]
    sizes_bytes: tuple[int, ...]
    nodes: int
    ranks_per_node: int
    repeats: int = 5
    warmup: int = 1
    verify: bool = False
    devices_per_node: int | None = None
    """Platform devices per node (None = ranks_per_node)."""
    device_nic: tuple[int, ...] | None = None
    """Platform NIC of each local device (None = one NIC per device)."""
    emulate: str | None = None
    """``"NxG"`` topology override; set for local spawns."""
    seed: int = 0
    network: str | None = None
    """The emulated network the ranks ran on (``uplink_GBps=...,uplinks=...``; None = loopback or the job's)."""
    statistic: str = "median"
    """The median or the minimum of the ``repeats`` calls' times over all ranks (calibration.timing.STATISTICS)."""


@dataclass(frozen=True)
class SizeResult:
    """One message size: the bytes actually moved per rank, seconds per algorithm, and the checks."""

    bytes_per_rank: int
    seconds: dict[str, float]
    checks: int = 0
    errors: tuple[str, ...] = field(default_factory=tuple)
    load_avg: float | None = None
    """The host's 1-minute load average (/proc/loadavg) on rank 0 after this size was timed; None = not read."""


@dataclass(frozen=True)
class BenchResult:
    """A whole run, as the CLI renders and records it."""

    num_nodes: int
    ranks_per_node: int
    backend: str
    emulated: bool
    sizes: tuple[SizeResult, ...]
    network: str | None = None

    @property
    def num_ranks(self) -> int:
        return self.num_nodes * self.ranks_per_node

    @property
    def passed(self) -> bool:
        return all(not s.errors for s in self.sizes)


def message_shape(bytes_per_rank: int, num_ranks: int) -> tuple[int, int]:
    """(rows per peer, float32 per row) carrying about ``bytes_per_rank`` split evenly over ``num_ranks``."""
    per_peer_floats = max(bytes_per_rank // (4 * num_ranks), 1)
    row_floats = min(ROW_FLOATS, per_peer_floats)
    return max(per_peer_floats // row_floats, 1), row_floats


def carried_bytes(bytes_per_rank: int, num_ranks: int) -> int:
    """The bytes per rank ``message_shape`` really sends for a requested size (whole float32 rows per peer)."""
    rows, width = message_shape(bytes_per_rank, num_ranks)
    return rows * width * 4 * num_ranks


def check_sizes_differ(sizes_bytes: tuple[int, ...], num_ranks: int) -> None:
    """Refuse, before any rank starts, two requested sizes that carry the same message on ``num_ranks`` ranks
    (they would time one point twice and write one calibration row twice)."""
    seen: dict[int, int] = {}
    for size in sizes_bytes:
        carried = carried_bytes(size, num_ranks)
        if carried in seen:
            raise PiperError(f"{seen[carried]} and {size} bytes both carry {carried} bytes per rank on "
                             f"{num_ranks} ranks (whole float32 rows of at most {ROW_FLOATS} per peer); give sizes "
                             "that differ after that rounding", field="--sizes")
        seen[carried] = size


def random_counts(num_ranks: int, rng: np.random.Generator, max_rows: int = 5) -> np.ndarray:
    """A skewed [P, P] count matrix with zeros, one rank that sends nothing and one that receives nothing."""
    counts = rng.integers(0, max_rows + 1, size=(num_ranks, num_ranks))
    counts[rng.random(counts.shape) < 0.3] = 0
    counts[rng.integers(num_ranks), :] = 0
    counts[:, rng.integers(num_ranks)] = 0
    return counts.astype(np.int64)


# ----------------------------------------------------------------------------------------------------
# Per-rank work (torch.distributed initialised).
# ----------------------------------------------------------------------------------------------------

def verify_exchange(halo, counts_PP: np.ndarray, dim: int, seed: int) -> list[str]:
    """HALO dispatch/combine == all_to_all_single, outputs and gradients, bit for bit (collective on halo.group).

    Every rank of the EP group calls this with the same ``counts_PP`` (rows group rank s -> d).
    """
    import torch

    from piper_plan.runtime.halo import comm_device

    me = halo.me
    gen = torch.Generator().manual_seed(seed * 10007 + me)
    send, recv = [int(c) for c in counts_PP[me]], [int(c) for c in counts_PP[:, me]]
    layout = halo.layout(torch.tensor(send))
    errors = [] if (list(layout.send_counts), list(layout.recv_counts)) == (send, recv) else [
        f"rank {me}: layout {layout.send_counts}/{layout.recv_counts} != {send}/{recv}"]
    device = comm_device(halo.group)  # nccl needs GPU tensors; gloo CPU ones
    x_RD = torch.randn(sum(send), dim, generator=gen, dtype=torch.float64).to(device)
    w_SD = torch.randn(sum(recv), dim, generator=gen, dtype=torch.float64).to(device)
    for name, (got, want) in _dispatch_pairs(halo, layout, x_RD, w_SD, send, recv).items():
        if not torch.equal(got, want):
            errors.append(f"rank {me}: {name} differs from all_to_all_single (counts {counts_PP.tolist()})")
    return errors


def _dispatch_pairs(halo, layout, x_RD, w_SD, send, recv) -> dict:
    """(HALO, reference) pairs: dispatch output and input gradient, combine output and input gradient.

    The reference is ``all_to_all_single`` itself; the gradient of ``sum(a2a(x) * w)`` with respect to x is
    the reverse exchange of w (the all-to-all is a permutation of rows; its adjoint is the inverse one).
    """
    import torch
    import torch.distributed as dist

    def flat(inp, out_splits, in_splits):
        out = inp.new_empty((sum(out_splits), inp.shape[1]))
        dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=halo.group)
        return out

    def halo_run(fn, inp, weight):
        leaf = inp.clone().requires_grad_(True)
        out = fn(leaf)
        (out * weight).sum().backward()
        return out.detach(), leaf.grad if leaf.grad is not None else torch.zeros_like(inp)

    h_out, h_grad = halo_run(lambda t: halo.dispatch(t, layout), x_RD, w_SD)
    hc_out, hc_grad = halo_run(lambda t: halo.combine(t, layout), w_SD, x_RD)
    return {"dispatch": (h_out, flat(x_RD, recv, send)), "dispatch grad": (h_grad, flat(w_SD, send, recv)),
            "combine": (hc_out, flat(w_SD, send, recv)), "combine grad": (hc_grad, flat(x_RD, recv, send))}


def bench_one_size(halo, config: BenchConfig, bytes_per_rank: int, device, size_index: int) -> SizeResult:
    """Time every algorithm at one size; with ``verify``, check HALO against all_to_all_single."""
    import torch
    import torch.distributed as dist

    from piper_plan.calibration.timing import STATISTICS, exchange_spans, interleaved_call_times

    num_ranks = dist.get_world_size()
    rows, width = message_shape(bytes_per_rank, num_ranks)
    splits = [rows] * num_ranks
    x_RD = torch.randn(rows * num_ranks, width, device=device)
    flat_out = torch.empty_like(x_RD)
    layout = halo.layout(torch.tensor(splits))
    ops = {"flat": lambda: dist.all_to_all_single(flat_out, x_RD, splits, splits, group=halo.group),
           "halo": lambda: halo.exchange(x_RD, layout.dispatch_plan)}
    own = interleaved_call_times({a: ops[a] for a in config.algos}, device, config.warmup, config.repeats,
                                 before=lambda: dist.barrier(group=halo.group))
    everyone: list = [None] * num_ranks
    dist.all_gather_object(everyone, (socket.gethostname(), own))
    shared_clock = device.type == "cpu" and len({host for host, _ in everyone}) == 1
    seconds = {a: STATISTICS[config.statistic](exchange_spans([times[a] for _, times in everyone], shared_clock))
               for a in config.algos}
    errors: list[str] = []
    checks = 0
    if config.verify:
        ops["flat"]()
        checks += 1
        if not torch.equal(halo.exchange(x_RD, layout.dispatch_plan), flat_out):
            errors.append(f"rank {dist.get_rank()}: HALO != all_to_all_single at {bytes_per_rank} bytes")
        rng = np.random.default_rng(config.seed * 1000 + size_index)
        errors += verify_exchange(halo, random_counts(num_ranks, rng), dim=3, seed=config.seed + size_index)
        checks += 4
    return SizeResult(carried_bytes(bytes_per_rank, num_ranks), seconds, checks, tuple(errors), host_load_average())


def host_load_average() -> float | None:
    """The 1-minute load average of this host (/proc/loadavg), None where there is none."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def run_bench(config: BenchConfig) -> BenchResult:
    """Every rank: build HALO over the whole world, run all sizes, gather the errors (collective)."""
    import torch.distributed as dist

    from piper_plan.runtime.halo import build_halo_dispatchers, comm_device
    from piper_plan.runtime.topology import EMULATE_ENV, topology_from_env

    world = dist.get_world_size()
    topology = topology_from_env(world, config.devices_per_node or config.ranks_per_node,
                                 list(config.device_nic) if config.device_nic else None, config.emulate)
    halo = build_halo_dispatchers([list(range(world))], topology)
    device = comm_device(halo.group)
    sizes = [bench_one_size(halo, config, b, device, i) for i, b in enumerate(config.sizes_bytes)]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, [s.errors for s in sizes])
    sizes = [SizeResult(s.bytes_per_rank, s.seconds, s.checks * world, tuple(e for g in gathered for e in g[i]),
                        s.load_avg) for i, s in enumerate(sizes)]
    emulated = bool(config.emulate or os.environ.get(EMULATE_ENV))
    return BenchResult(topology.num_nodes, world // topology.num_nodes, dist.get_backend(), emulated, tuple(sizes),
                       config.network)


# ----------------------------------------------------------------------------------------------------
# Starting ranks: spawn on one machine, or join a launcher's job.
# ----------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_gloo(entry, num_ranks: int, *args, timeout_s: float = 300.0) -> None:
    """Run ``entry(rank, num_ranks, init_method, timeout_s, *args)`` in ``num_ranks`` spawned processes.

    A Ctrl-C (the terminal's SIGINT to the whole process group) ends the ranks from here: they start with SIGINT
    ignored (inherited), and this process kills them on its KeyboardInterrupt. Before, each rank printed its own
    KeyboardInterrupt traceback (from wherever it was: importing torch, in the rendezvous), 240 lines in all."""
    import signal

    import torch.multiprocessing as mp

    init_method = f"tcp://127.0.0.1:{free_port()}"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ranks = mp.start_processes(entry, args=(num_ranks, init_method, timeout_s) + args, nprocs=num_ranks,
                                   join=False, start_method="spawn")
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        while not ranks.join():         # blocks until a rank ends (torch's idiom, as in mp.spawn): no busy loop
            pass
    except KeyboardInterrupt:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
        for process in ranks.processes:
            process.join()
        raise


def init_gloo(rank: int, num_ranks: int, init_method: str, timeout_s: float) -> None:
    """Join a spawned gloo group (one thread per rank: the machine's cores are shared)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=num_ranks,
                            timeout=timedelta(seconds=timeout_s))


def _spawned_bench(rank: int, num_ranks: int, init_method: str, timeout_s: float,
                   config: BenchConfig, result_path: str) -> None:
    init_gloo(rank, num_ranks, init_method, timeout_s)
    try:
        result = run_bench(config)
        if rank == 0:
            Path(result_path).write_text(json.dumps(asdict(result)), encoding="utf-8")
    finally:
        end_process_group()


def spawn_bench(config: BenchConfig) -> BenchResult:
    """Run the benchmark in ``nodes x ranks_per_node`` local gloo processes (emulated topology)."""
    config = BenchConfig(**{**asdict(config), "emulate": f"{config.nodes}x{config.ranks_per_node}"})
    with tempfile.TemporaryDirectory(prefix="piper-bench-") as tmp:
        path = Path(tmp) / "result.json"
        spawn_gloo(_spawned_bench, config.nodes * config.ranks_per_node, config, str(path))
        return result_from_dict(json.loads(path.read_text(encoding="utf-8")))


def result_from_dict(data: dict) -> BenchResult:
    sizes = tuple(SizeResult(s["bytes_per_rank"], s["seconds"], s["checks"], tuple(s["errors"]), s.get("load_avg"))
                  for s in data["sizes"])
    return BenchResult(data["num_nodes"], data["ranks_per_node"], data["backend"], data["emulated"], sizes,
                       data.get("network"))


def run_launched(config: BenchConfig, backend: str, timeout_s: float = 600.0) -> tuple[int, BenchResult]:
    """Join the launcher's job (MASTER_ADDR / MASTER_PORT from the job script) and run; returns (rank, result)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    env = read_launch_env()
    if backend == "nccl":
        torch.cuda.set_device(device_index(env.local_rank, torch.cuda.device_count()))
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        return env.rank, run_bench(config)
    finally:
        end_process_group()


def network_bench(config: BenchConfig, network, timeout_s: float = 300.0) -> BenchResult:
    """Run the benchmark on the emulated network ``network`` (calibration.netemu.NetworkSpec): one namespace per
    node, ``nodes x ranks_per_node`` ranks started inside them by scripts/netemu.sh, gloo over the uplinks."""
    import sys

    from piper_plan.calibration.netemu import run_on_network

    config = BenchConfig(**{**asdict(config), "network": network.text})
    with tempfile.TemporaryDirectory(prefix="piper-bench-") as tmp:
        path = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "piper_plan.calibration.bench_a2a", json.dumps(asdict(config)), str(path)]
        run_on_network(network, config.nodes, config.ranks_per_node, command, timeout_s)
        return result_from_dict(json.loads(path.read_text(encoding="utf-8")))


def config_from_dict(data: dict) -> BenchConfig:
    tuples = {k: tuple(v) for k, v in data.items() if isinstance(v, list)}
    return BenchConfig(**{**data, **tuples})


def main(argv: list[str]) -> int:
    """One rank under a launcher: ``python -m piper_plan.calibration.bench_a2a CONFIG_JSON RESULT_PATH``."""
    from piper_plan.fileio import atomic_write_text

    config_json, result_path = argv
    rank, result = run_launched(config_from_dict(json.loads(config_json)), "gloo")
    if rank == 0:
        atomic_write_text(result_path, json.dumps(asdict(result)))
    return 0 if result.passed else 1


# ----------------------------------------------------------------------------------------------------
# Calibration rows.
# ----------------------------------------------------------------------------------------------------

def collective_rows(result: BenchResult, scope: str, source: str) -> list[dict]:
    """collectives.csv rows (DESIGN.md columns) for every algorithm and size of ``result``."""
    rows = []
    for size in result.sizes:
        for algo, seconds in size.seconds.items():
            algbw, busbw = collective_bandwidths_GBps("all_to_all", result.num_ranks, size.bytes_per_rank, seconds)
            rows.append({"op": OP_OF_ALGO[algo], "scope": scope, "num_nodes": result.num_nodes,
                         "ranks_per_node": result.ranks_per_node, "bytes_per_rank": size.bytes_per_rank,
                         "seconds": seconds, "algbw_GBps": algbw, "busbw_GBps": busbw, "source": source})
    return rows


def write_collective_rows(directory: str | Path, rows: list[dict]) -> Path:
    """Merge the rows into ``directory/collectives.csv`` (calibration.io's atomic merge; same key replaced)."""
    from piper_plan.calibration.io import merge_rows
    from piper_plan.calibration.schema import COLLECTIVES

    return merge_rows(directory, COLLECTIVES, rows)


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
