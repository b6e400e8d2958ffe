"""Collective sweep driver: one process per rank (srun, torchrun, or ``piper calibrate``'s local spawn).

    python -m piper_plan.calibration.bench_collectives --platform frontier --out calibration/frontier [--quick] [--resume]

Environment: RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE (torchrun) or SLURM_PROCID / SLURM_NTASKS /
SLURM_LOCALID / SLURM_NTASKS_PER_NODE (srun), MASTER_ADDR / MASTER_PORT; PIPER_EMULATE_TOPOLOGY="2x2" makes
consecutive ranks emulated nodes. Backend and device come from the platform's launch block (nccl = rccl on
ROCm; gloo on CPU). Groups span each scope the allocation has (compact order assumed: Slurm's node order,
``nodes_per_switch`` nodes to a switch). Rows follow nccl-tests: ``bytes_per_rank`` is its ``size`` for the op;
``seconds`` the median over repeats of the slowest rank (``--statistic min``: the fastest call, the uncontended
time on a shared host); algbw = size / time, busbw = algbw x factor.
Rank 0 merges the rows of each (op, group) block into collectives.csv atomically as soon as it is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

from piper_plan.calibration.timing import STATISTICS
from piper_plan.launchenv import LaunchEnv, device_index, read_launch_env
from piper_plan.runtime.mesh import end_process_group

PROGRESS_PREFIX = "PIPER_PROGRESS "


def dist_env(environ=os.environ) -> LaunchEnv | None:
    """The distributed environment from torchrun or srun variables (piper_plan.launchenv); None outside one."""
    env = read_launch_env(environ)
    return env if env.launched else None


@dataclass(frozen=True)
class GroupSpec:
    """A group of global ranks, the scope it spans, and its shape."""

    scope: str
    num_nodes: int
    ranks_per_node: int
    ranks: tuple[int, ...]


def scope_of_nodes(num_nodes: int, network) -> str:
    """Widest scope crossed by ``num_nodes`` consecutive nodes starting at node 0 (compact)."""
    if num_nodes == 1:
        return "node"
    if num_nodes <= network.nodes_per_switch:
        return "switch"
    return "group" if num_nodes <= network.nodes_per_group else "system"


def plan_groups(env: LaunchEnv, network, quick: bool) -> list[GroupSpec]:
    """Groups for the collectives: inside node 0 (2, 4, ... ranks), then 2, 4, ... whole nodes."""
    g = env.ranks_per_node
    sizes = [g] if quick else sorted({s for s in (2**i for i in range(1, 12)) if s < g} | {g})
    groups = [GroupSpec("node", 1, s, tuple(range(s))) for s in sizes if s >= 2]
    counts = sorted({n for n in (2**i for i in range(1, 20)) if n < env.num_nodes} | {env.num_nodes})
    if quick:
        by_scope = {}
        for n in counts:
            by_scope[scope_of_nodes(n, network)] = n
        counts = sorted(by_scope.values())
    groups += [GroupSpec(scope_of_nodes(n, network), n, g, tuple(range(n * g))) for n in counts if n >= 2]
    return groups


def p2p_groups(env: LaunchEnv, network) -> list[GroupSpec]:
    """Pairs for p2p: two ranks of node 0, then rank 0 with local rank 0 of the farthest node of each scope."""
    g = env.ranks_per_node
    pairs = [GroupSpec("node", 1, 2, (0, 1))] if g >= 2 else []
    seen = set()
    for n in range(env.num_nodes, 1, -1):
        scope = scope_of_nodes(n, network)
        if scope not in seen:
            seen.add(scope)
            pairs.append(GroupSpec(scope, 2, 1, (0, (n - 1) * g)))
    return sorted(pairs, key=lambda p: ("node", "switch", "group", "system").index(p.scope))


def message_sizes(quick: bool, device_type: str) -> list[int]:
    """Powers of two (bytes per rank): 1 KiB .. 1 MiB quick; up to 256 MiB on GPUs, 16 MiB on CPU."""
    top = 20 if quick else (28 if device_type == "cuda" else 24)
    step = 2 if quick else 1
    return [2**e for e in range(10, top + 1, step)]


def _ops_buffers(op: str, size: int, n: int, device):
    """Input/output tensors (float32) whose nccl-tests ``size`` is ``size`` bytes for a group of n ranks."""
    import torch

    elems = max(size // 4 // n, 1) * n  # divisible by the group size
    if op in ("all_to_all", "all_reduce", "p2p"):
        return torch.randn(elems, device=device), torch.empty(elems, device=device)
    if op == "all_gather":  # size = gathered output
        return torch.randn(elems // n, device=device), torch.empty(elems, device=device)
    return torch.randn(elems, device=device), torch.empty(elems // n, device=device)  # reduce_scatter: size = input


def _op_call(op: str, x, y, group, ranks: tuple[int, ...], rank: int):
    import torch.distributed as dist

    if op == "all_to_all":
        return lambda: dist.all_to_all_single(y, x, group=group)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(y, x, group=group)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(y, x, group=group)
    i = ranks.index(rank)  # p2p: ring sendrecv as nccl-tests' sendrecv_perf
    peer_to, peer_from = ranks[(i + 1) % len(ranks)], ranks[(i - 1) % len(ranks)]

    def sendrecv():
        ops = [dist.P2POp(dist.isend, x, peer_to, group), dist.P2POp(dist.irecv, y, peer_from, group)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    return sendrecv




OPS_MEASURED = ("all_to_all", "all_reduce", "all_gather", "reduce_scatter", "p2p")


@dataclass(frozen=True)
class Block:
    """One op on one group over a list of sizes: its rows are written together."""

    op: str
    group: GroupSpec
    sizes: tuple[int, ...]


def plan_blocks(env: LaunchEnv, network, quick: bool, device_type: str, ops: tuple[str, ...]) -> list[Block]:
    sizes = tuple(message_sizes(quick, device_type))
    blocks = []
    for op in ops:
        groups = p2p_groups(env, network) if op == "p2p" else plan_groups(env, network, quick)
        blocks += [Block(op, g, sizes) for g in groups]
    return blocks


def _row_key(op: str, g: GroupSpec, size: int) -> tuple:
    return (op, g.scope, g.num_nodes, g.ranks_per_node, size)


def _row(op: str, g: GroupSpec, size: int, seconds: float, source: str) -> dict:
    from piper_plan.calibration.schema import collective_bandwidths_GBps

    algbw, busbw = collective_bandwidths_GBps(op, len(g.ranks), size, seconds)
    return {"op": op, "scope": g.scope, "num_nodes": g.num_nodes, "ranks_per_node": g.ranks_per_node,
            "bytes_per_rank": size, "seconds": seconds, "algbw_GBps": algbw, "busbw_GBps": busbw, "source": source}


def _progress(done: int, total: int, label: str) -> None:
    if os.environ.get("PIPER_PROGRESS_PIPE"):
        print(PROGRESS_PREFIX + json.dumps({"done": done, "total": total, "label": label}), flush=True)
    else:
        print(f"[{done}/{total}] {label}", file=sys.stderr, flush=True)


def run(env: LaunchEnv, platform, out_dir: str, quick: bool, resume: bool, ops: tuple[str, ...], source: str,
        timing: tuple[str, int | None] = ("median", None)) -> dict:
    """Every rank calls this; rank 0 writes the rows. Returns metadata (hosts, backend, timings) on rank 0."""
    import socket

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = _device(platform, env)
    dist.init_process_group(platform.launch.backend, rank=env.rank, world_size=env.world_size)
    try:
        blocks = plan_blocks(env, platform.network, quick, device.type, ops)
        handles = {b.group.ranks: None for b in blocks}
        for ranks in handles:  # every rank creates every group, in the same order
            handles[ranks] = dist.new_group(list(ranks))
        skip = _broadcast_skip(env, out_dir, resume)
        hosts = [None] * env.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        skipped = _run_blocks(env, blocks, handles, skip, device, quick, out_dir, source, timing)
        dist.barrier()
        if env.rank == 0 and os.environ.get("PIPER_PROGRESS_PIPE"):
            print(PROGRESS_PREFIX + json.dumps({"skipped": skipped}), flush=True)
        return {"hosts": sorted(set(hosts)), "backend": platform.launch.backend, "world_size": env.world_size,
                "ranks_per_node": env.ranks_per_node, "torch": torch.__version__, "skipped": skipped}
    finally:
        end_process_group()


def _device(platform, env: LaunchEnv):
    import torch

    if platform.launch.device == "cuda" and torch.cuda.is_available():
        index = device_index(env.local_rank, torch.cuda.device_count())
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _broadcast_skip(env: LaunchEnv, out_dir: str, resume: bool) -> set:
    import torch.distributed as dist

    from piper_plan.calibration.io import measured_keys
    from piper_plan.calibration.schema import COLLECTIVES

    box = [measured_keys(out_dir, COLLECTIVES) if (resume and env.rank == 0) else set()]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _run_blocks(env, blocks, handles, skip, device, quick, out_dir, source, timing) -> int:
    """Every block's rows; ``timing`` = (statistic, repeats or None for the default of --quick or not). Returns the
    points skipped as already measured (--resume)."""
    from piper_plan.calibration.io import merge_rows
    from piper_plan.calibration.schema import COLLECTIVES
    from piper_plan.calibration.timing import call_seconds, slowest_rank_seconds

    warmup, repeats = (2, 5) if quick else (5, 10)
    statistic, repeats = timing[0], timing[1] or repeats
    total = sum(len(b.sizes) for b in blocks)
    done = skipped = 0
    for block in blocks:
        rows, g = [], block.group
        member = env.rank in g.ranks
        for size in block.sizes:
            done += 1
            if _row_key(block.op, g, size) in skip:
                skipped += 1
                continue
            seconds = 0.0
            if member:
                x, y = _ops_buffers(block.op, size, len(g.ranks), device)
                fn = _op_call(block.op, x, y, handles[g.ranks], g.ranks, env.rank)
                seconds = call_seconds(fn, device, warmup, repeats, 0.0, statistic)
            slowest = slowest_rank_seconds(seconds, device)
            if env.rank == 0:
                rows.append(_row(block.op, g, size, slowest, source))
                _progress(done, total, f"{block.op} {g.scope} {len(g.ranks)} ranks {size} B")
        if env.rank == 0 and rows:
            merge_rows(out_dir, COLLECTIVES, rows)
    return skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="piper collective sweep (one process per rank)")
    parser.add_argument("--platform", required=True)
    parser.add_argument("--out", required=True, help="calibration directory (calibration/<platform>)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--ops", default=",".join(OPS_MEASURED))
    parser.add_argument("--source", default=None, help="text of the source column")
    parser.add_argument("--statistic", choices=sorted(STATISTICS), default="median",
                        help="per rank, the median of the timed calls or the fastest (shared host)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per point (default 5 quick, else 10)")
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1")
    env = dist_env()
    if env is None:
        print("bench_collectives: no distributed environment (RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS); "
              "launch with srun or torchrun, or run `piper calibrate` to spawn a local gloo group", file=sys.stderr)
        return 2
    from piper_plan.catalog import load_platform

    platform = load_platform(args.platform)
    source = args.source or f"measured: {' '.join(['bench_collectives'] + (argv or sys.argv[1:]))} on {os.uname().nodename}"
    t0 = time.perf_counter()
    meta = run(env, platform, args.out, args.quick, args.resume, tuple(args.ops.split(",")), source,
               (args.statistic, args.repeats))
    if env.rank == 0:
        from piper_plan.calibration.io import write_metadata

        meta["seconds"] = round(time.perf_counter() - t0, 2)
        write_metadata(args.out, {"collectives": meta})
    return 0


if __name__ == "__main__":
    sys.exit(main())
