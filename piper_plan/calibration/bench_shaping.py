"""Check an emulated network's shaping: one-way point-to-point bandwidth between two nodes and inside one.

    scripts/netemu.sh run --nodes 2 --ranks-per-node 2 ... -- python -m piper_plan.calibration.bench_shaping OUT.json

Rank 0 sends ``size`` bytes to rank ``g`` (the first rank of node 1: across one uplink) and, when a node has two
ranks, to rank 1 (inside node 0: loopback, unshaped); one message at a time, so the rate is the link's, not a
contended share. Each send waits for a one-float ack from the receiver, so its time ends when the last byte has
arrived, not when the sender's socket buffers took it. Seconds = the fastest of ``repeats`` after one warm-up
(calibration.timing): what the link carries, since a busy host only adds time (the all-to-all sweeps take their
fastest call for the same reason; a median let one slow spell of this shared host pass for a slower link).
Then the same transfer both ways at once between rank 0 and rank ``g``: on one communicator (one gloo
connection) and with each direction on its own communicator (HALO's phase II, runtime/halo.py ``_p2p_group``).
Rank 0 writes
``{"inter_node_GBps", "intra_node_GBps", "two_way_one_connection_GBps", "two_way_two_connections_GBps",
"bytes", "statistic"}`` (GB/s = 1e9 payload bytes per second in each direction).
"""

from __future__ import annotations

import sys

from piper_plan.launchenv import read_launch_env
from piper_plan.runtime.mesh import end_process_group

FASTEST = "min"
REPEATS = 5


def one_way_GBps(peer: int, nbytes: int, repeats: int, device) -> float | None:
    """Rank 0 -> ``peer``: payload GB/s (every rank calls this; ranks other than 0 and peer only synchronise)."""
    import torch
    import torch.distributed as dist

    from piper_plan.calibration.timing import call_seconds

    rank = dist.get_rank()
    buffer, ack = torch.ones(nbytes // 4), torch.zeros(1)

    def send_then_ack():  # a send returns once the socket buffers hold the tail (up to the tbf queue): wait for
        dist.send(buffer, peer)  # the receiver's one-float ack, so the time covers the arrival of the last byte
        dist.recv(ack, peer)

    def recv_then_ack():
        dist.recv(buffer, 0)
        dist.send(ack, 0)

    seconds = None
    if rank == 0:
        seconds = call_seconds(send_then_ack, device, 1, repeats, 0.0, FASTEST)
    elif rank == peer:
        call_seconds(recv_then_ack, device, 1, repeats, 0.0, FASTEST)
    dist.barrier()
    return nbytes / seconds / 1e9 if rank == 0 else None


def two_way_GBps(peer: int, nbytes: int, repeats: int, device, reverse_group) -> float | None:
    """Rank 0 <-> ``peer`` at once, ``nbytes`` each way: payload GB/s per direction. ``reverse_group``: the
    communicator of peer -> 0 (the default group: both directions on one connection)."""
    import torch
    import torch.distributed as dist

    from piper_plan.calibration.timing import call_seconds

    rank = dist.get_rank()
    out, back = torch.ones(nbytes // 4), torch.empty(nbytes // 4)

    def exchange(to: int, forward_send: bool):
        sent = dist.isend(out, to) if forward_send else dist.isend(out, to, group=reverse_group)
        got = dist.irecv(back, to, group=reverse_group) if forward_send else dist.irecv(back, to)
        sent.wait()
        got.wait()

    seconds = None
    if rank == 0:
        seconds = call_seconds(lambda: exchange(peer, True), device, 1, repeats, 0.0, FASTEST)
    elif rank == peer:
        call_seconds(lambda: exchange(0, False), device, 1, repeats, 0.0, FASTEST)
    dist.barrier()
    return nbytes / seconds / 1e9 if rank == 0 else None


def main(argv: list[str]) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from piper_plan.fileio import atomic_write_json

    out, nbytes, repeats = argv[0], int(argv[1]) if len(argv) > 1 else 16 * 2**20, REPEATS
    env = read_launch_env()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        device = torch.device("cpu")
        inter = one_way_GBps(env.ranks_per_node, nbytes, repeats, device)
        intra = one_way_GBps(1, nbytes, repeats, device) if env.ranks_per_node > 1 else None
        one = two_way_GBps(env.ranks_per_node, nbytes, repeats, device, dist.group.WORLD)
        two = two_way_GBps(env.ranks_per_node, nbytes, repeats, device, dist.new_group(list(range(env.world_size))))
        if env.rank == 0:
            atomic_write_json(out, {"inter_node_GBps": inter, "intra_node_GBps": intra, "bytes": nbytes,
                                    "two_way_one_connection_GBps": one, "two_way_two_connections_GBps": two,
                                    "statistic": f"fastest of {repeats}"})
    finally:
        end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
