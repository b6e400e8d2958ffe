"""Where each rank runs: its node, its index inside the node, and the NIC its device is attached to.

HALO (piper-paper.md, "HALO") needs this map to keep node-local traffic inside the node and to send the
inter-node traffic between NIC-affine peers. On Frontier the two GCDs of one MI250X share a NIC
(platforms/frontier.yaml ``device_nic: [0, 0, 1, 1, 2, 2, 3, 3]``; OLCF Frontier User Guide).

The map comes from the launch environment (``SLURM_NODEID``, else the host name, gathered from every
rank with ``all_gather_object``) or is emulated for tests: ``emulate="2x4"`` (or the environment variable
``PIPER_EMULATE_TOPOLOGY``) = 2 nodes x 4 ranks, consecutive ranks on one node. The pure part
(``topology_from_node_keys``, ``emulated_topology``) needs no torch; only the gathering imports it.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Hashable, Sequence

from piper_plan.errors import PiperError

EMULATE_ENV = "PIPER_EMULATE_TOPOLOGY"
"""Environment variable that overrides the detected topology, e.g. ``2x4``."""


@dataclass(frozen=True)
class RankTopology:
    """Per global rank: node index (0-based, in order of first appearance), index inside the node, NIC."""

    node_of_rank: tuple[int, ...]
    local_rank_of_rank: tuple[int, ...]
    nic_of_rank: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.node_of_rank)
        assert len(self.local_rank_of_rank) == n and len(self.nic_of_rank) == n, "ragged topology"

    @property
    def world_size(self) -> int:
        return len(self.node_of_rank)

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_of_rank))

    def ranks_on_node(self, node: int) -> list[int]:
        """Global ranks on ``node``, ascending."""
        return [r for r, n in enumerate(self.node_of_rank) if n == node]


def parse_emulate(spec: str) -> tuple[int, int]:
    """``"2x4"`` -> (2 nodes, 4 ranks per node)."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", spec)
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise PiperError(f"emulated topology {spec!r}: expected NODESxRANKS_PER_NODE with positive integers, e.g. 2x4",
                         field=EMULATE_ENV)
    return int(match.group(1)), int(match.group(2))


def nic_of_local_rank(local_rank: int, devices_per_node: int, device_nic: Sequence[int] | None) -> int:
    """NIC of the device a local rank drives: ``device_nic[local_rank]`` (platform spec); None = one NIC per device.

    More ranks than devices on a node (CPU ranks) wrap around: local rank ``devices_per_node`` uses device 0's NIC.
    """
    device = local_rank % max(devices_per_node, 1)
    if device_nic is None:
        return device
    return int(device_nic[device % len(device_nic)])


def topology_from_node_keys(node_keys: Sequence[Hashable], devices_per_node: int,
                            device_nic: Sequence[int] | None) -> RankTopology:
    """Topology from one node key (SLURM node id or host name) per global rank.

    Nodes are numbered in order of first appearance; local ranks in ascending global-rank order per node.
    Example: keys (a, a, b, b) -> nodes (0, 0, 1, 1), local ranks (0, 1, 0, 1).
    """
    node_index: dict[Hashable, int] = {}
    seen_per_node: dict[int, int] = {}
    nodes, locals_, nics = [], [], []
    for key in node_keys:
        node = node_index.setdefault(key, len(node_index))
        local = seen_per_node.get(node, 0)
        seen_per_node[node] = local + 1
        nodes.append(node)
        locals_.append(local)
        nics.append(nic_of_local_rank(local, devices_per_node, device_nic))
    return RankTopology(tuple(nodes), tuple(locals_), tuple(nics))


def emulated_topology(num_nodes: int, ranks_per_node: int, devices_per_node: int | None = None,
                      device_nic: Sequence[int] | None = None) -> RankTopology:
    """``num_nodes`` x ``ranks_per_node`` with consecutive ranks on one node (rank r on node r // ranks_per_node)."""
    keys = [r // ranks_per_node for r in range(num_nodes * ranks_per_node)]
    return topology_from_node_keys(keys, devices_per_node or ranks_per_node, device_nic)


def local_node_key() -> str:
    """This process's node: ``SLURM_NODEID`` under Slurm, else the host name."""
    node_id = os.environ.get("SLURM_NODEID")
    return f"slurm-node-{node_id}" if node_id is not None else socket.gethostname()


def topology_from_env(world_size: int, devices_per_node: int, device_nic: list[int] | None,
                      emulate: str | None = None) -> RankTopology:
    """The topology of the running job.

    ``emulate`` (or env ``PIPER_EMULATE_TOPOLOGY``) = ``"NxG"`` overrides detection; otherwise every rank's
    node key is gathered with ``all_gather_object`` (collective: every rank must call this), or, without an
    initialised process group, all ``world_size`` ranks are taken to share this node.
    """
    spec = emulate or os.environ.get(EMULATE_ENV)
    if spec:
        num_nodes, ranks_per_node = parse_emulate(spec)
        if num_nodes * ranks_per_node != world_size:
            raise PiperError(f"emulated topology {spec!r} has {num_nodes * ranks_per_node} ranks, the job has "
                             f"{world_size}; use NODESxRANKS_PER_NODE with that product", field=EMULATE_ENV)
        return emulated_topology(num_nodes, ranks_per_node, devices_per_node, device_nic)
    return topology_from_node_keys(_gather_node_keys(world_size), devices_per_node, device_nic)


def _gather_node_keys(world_size: int) -> list[str]:
    import torch.distributed as dist  # runtime only: the planner never imports torch

    if not (dist.is_available() and dist.is_initialized()):
        return [local_node_key()] * world_size
    keys: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, local_node_key())
    assert len(keys) == world_size, f"world_size={world_size} but the process group has {len(keys)} ranks"
    return [str(k) for k in keys]
