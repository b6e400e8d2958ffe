"""What one dependent communication step costs when every rank of a job takes part: chains of tiny exchanges.

    scripts/netemu.sh run --nodes N --ranks-per-node G ... -- python -m piper_plan.calibration.bench_steps OUT.json

A step is one tiny exchange every rank waits for before the next starts, as HALO's phases and a flat all-to-all
each are one. Timed as a chain of ``STEPS`` steps, per step, the fastest of ``REPEATS`` chains, slowest rank:

- ``pair_step_s``: ranks 0 and G (local rank 0 of nodes 0 and 1) send 4 bytes to each other, the other ranks
  wait at a barrier: the network's one-message latency with the host's cores free;
- ``ring_step_s``: every rank sends 4 bytes to the rank G places on (same local rank, next node: across the
  uplinks) and receives from the rank G places back: the same step with every rank of the job at once.

On ranks that outnumber the host's cores the second is slower: each rank has to be scheduled again when its
message arrives. A probe, not a calibration: its difference (0.07-0.50 ms per step) came out far below what an
exchange costs the host, so benchmarks/halo_network.py calibrates node.host_step_us / halo_step_us from tiny
flat and HALO exchanges instead (benchmarks/halo_network_analysis.md). Needs at least 2 emulated nodes.
Rank 0 writes ``{"pair_step_s", "ring_step_s", "ranks", "steps"}``.
"""

from __future__ import annotations

import sys

from piper_plan.runtime.mesh import end_process_group

STEPS = 20
REPEATS = 10


def chain_seconds(peer_to: int | None, peer_from: int | None, group=None) -> float | None:
    """Per step, the fastest of REPEATS chains of STEPS tiny sendrecv steps with the given peers (None: this
    rank only waits); every rank calls this."""
    import torch
    import torch.distributed as dist

    from piper_plan.calibration.timing import call_seconds

    out, back = torch.ones(1), torch.empty(1)

    def chain():
        for _ in range(STEPS):
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer_to, group),
                                            dist.P2POp(dist.irecv, back, peer_from, group)])
            for work in works:
                work.wait()

    seconds = None
    if peer_to is not None:
        seconds = call_seconds(chain, torch.device("cpu"), 1, REPEATS, 0.0, "min") / STEPS
    dist.barrier()
    return seconds


def read_launch_env_checked():
    """The launcher's environment when it has >= 2 nodes of ranks (the pair step needs rank g), else None with
    one line on stderr."""
    from piper_plan.launchenv import read_launch_env

    env = read_launch_env()
    if env.world_size < 2 * env.ranks_per_node:
        print(f"bench_steps: {env.world_size} ranks with {env.ranks_per_node} per node: needs at least 2 nodes",
              file=sys.stderr)
        return None
    return env


def main(argv: list[str]) -> int:
    from datetime import timedelta

    if len(argv) != 1:
        print("usage: python -m piper_plan.calibration.bench_steps OUT.json (under scripts/netemu.sh run)", file=sys.stderr)
        return 2
    env = read_launch_env_checked()
    if env is None:
        return 2
    import torch
    import torch.distributed as dist

    from piper_plan.calibration.timing import slowest_rank_seconds
    from piper_plan.fileio import atomic_write_json

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        rank, world, g = env.rank, env.world_size, env.ranks_per_node
        pair_peer = {0: g, g: 0}.get(rank)
        pair = chain_seconds(pair_peer, pair_peer)
        ring = chain_seconds((rank + g) % world, (rank - g) % world)
        device = torch.device("cpu")
        result = {"pair_step_s": slowest_rank_seconds(pair or 0.0, device),
                  "ring_step_s": slowest_rank_seconds(ring, device), "ranks": world, "steps": STEPS}
        if rank == 0:
            atomic_write_json(argv[0], result)
    finally:
        end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
