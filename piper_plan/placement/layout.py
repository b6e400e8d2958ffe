"""Rank layout on an allocation: rank -> node, switch, dragonfly group, NIC; and the scope a group spans.

Rank order (DESIGN.md): ``rank = (pp_index x dp + dp_index) x tp + tp_index``; ranks fill nodes in order
(``node = rank // devices_per_node``, one srun task per device). Node placement on the network:

- ``compact``: node j sits on switch ``j // nodes_per_switch`` of group ``j // nodes_per_group`` (fewest
  switches and groups: what a topology-aware scheduler hands out). Where the platform allocates in segments
  (``network.segment_nodes``, Slurm topology/block ``--segment``: GB200 NVL72 racks), each switch gets
  ``segment_nodes`` consecutive job nodes and the next segment starts on the next switch: job node j sits at
  slot ``(j // segment) x nodes_per_switch + j % segment``, so no segment straddles two NVLink domains.
- ``spread``: every node on its own switch, and consecutive nodes in different dragonfly groups
  (node j in group ``j % num_groups``): the worst case a busy machine hands out.

Every parallel group of the plan is a strided set of ranks: ``count`` ranks ``stride`` apart, groups tiling
blocks of ``stride x count`` consecutive ranks (tp: stride 1; dp: stride tp; ep: stride etp; edp: stride
ep x etp; a pipeline pair: stride dp x tp, count 2). Pure: no I/O, numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from piper_plan.specs.platform import SCOPES, PlatformSpec
from piper_plan.specs.vocab import Placement

PLACEMENTS = Placement.values()


@dataclass(frozen=True)
class Allocation:
    """``nodes`` nodes of a platform, placed compactly or spread over the network."""

    nodes: int
    devices_per_node: int
    nodes_per_switch: int
    nodes_per_group: int
    num_groups: int
    device_nic: tuple[int, ...]
    placement: str = "compact"
    segment_nodes: int | None = None
    """Job nodes per switch under compact placement (network.segment_nodes); None = every slot of a switch."""

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of_rank(self, rank):
        return np.asarray(rank) // self.devices_per_node

    def local_rank(self, rank):
        return np.asarray(rank) % self.devices_per_node

    def nic_of_rank(self, rank):
        """Global NIC id: node x NICs-per-node + the local device's NIC (Frontier: 2 GCDs share one)."""
        nics = max(self.device_nic) + 1
        return self.node_of_rank(rank) * nics + np.asarray(self.device_nic)[self.local_rank(rank)]

    def slot_of_node(self, node):
        """Position of job node ``node`` among the machine's node slots under compact placement."""
        node = np.asarray(node)
        if self.segment_nodes is None:
            return node
        return node // self.segment_nodes * self.nodes_per_switch + node % self.segment_nodes

    @property
    def switches_per_group(self) -> int:
        return max(self.nodes_per_group // self.nodes_per_switch, 1)

    def switch_of_node(self, node):
        """The switch a job node sits on. Spread: round-robin over the groups (group_of_node), then over the
        switches of its group: one node per switch while the machine has switches to spare, never a switch it
        does not have (a one-switch machine keeps every node on its switch)."""
        node = np.asarray(node)
        if self.placement == "spread":
            within = (node // self.num_groups) % self.switches_per_group
            return self.group_of_node(node) * self.switches_per_group + within
        return self.slot_of_node(node) // self.nodes_per_switch

    def group_of_node(self, node):
        node = np.asarray(node)
        if self.placement == "spread":
            return node % self.num_groups
        return self.slot_of_node(node) // self.nodes_per_group

    def scope_of_pair(self, a, b):
        """Scope index (0 node .. 3 system) of the link between ranks a and b (arrays broadcast)."""
        na, nb = self.node_of_rank(a), self.node_of_rank(b)
        same_node = na == nb
        same_switch = self.switch_of_node(na) == self.switch_of_node(nb)
        same_group = self.group_of_node(na) == self.group_of_node(nb)
        return np.where(same_node, 0, np.where(same_switch, 1, np.where(same_group, 2, 3)))


def allocation(platform: PlatformSpec, nodes: int, placement: str = "compact") -> Allocation:
    """The Allocation of ``nodes`` nodes of ``platform``."""
    if placement not in PLACEMENTS:
        from piper_plan.errors import PiperError

        raise PiperError(f"placement={placement!r} is not one of {', '.join(PLACEMENTS)}", field="placement")
    net = platform.network
    return Allocation(nodes=nodes, devices_per_node=platform.devices_per_node,
                      nodes_per_switch=net.nodes_per_switch, nodes_per_group=net.nodes_per_group,
                      num_groups=net.num_groups, device_nic=tuple(platform.node.nic_of_device),
                      placement=placement, segment_nodes=net.segment_nodes)


@dataclass(frozen=True)
class GroupSpan:
    """What the widest group of a kind spans: its scope, nodes, and group ranks per node."""

    scope: str
    nodes: int
    ranks_per_node: int

    @property
    def scope_index(self) -> int:
        return SCOPES.index(self.scope)


def group_ranks(world: int, stride: int, count: int) -> np.ndarray:
    """All groups of ``count`` ranks ``stride`` apart, tiling blocks of stride x count ranks: [groups, count]."""
    block = stride * count
    assert world % block == 0, (world, stride, count)
    base = (np.arange(world // block)[:, None] * block + np.arange(stride)[None, :]).reshape(-1)
    return base[:, None] + np.arange(count)[None, :] * stride


@lru_cache(maxsize=4096)
def group_span(alloc: Allocation, stride: int, count: int) -> GroupSpan:
    """The widest scope any group of this kind crosses (the slowest group sets the pace of a collective)."""
    if count <= 1:
        return GroupSpan("node", 1, 1)
    ranks = group_ranks(alloc.world, stride, count)
    scope = int(alloc.scope_of_pair(ranks[:, :1], ranks).max())
    node_ids = np.sort(alloc.node_of_rank(ranks), axis=1)
    nodes_per_group = 1 + np.count_nonzero(np.diff(node_ids, axis=1), axis=1)     # distinct nodes per group
    nodes = int(nodes_per_group.max())
    return GroupSpan(SCOPES[scope], nodes, max(count // nodes, 1))


def lookup_unique(keys: np.ndarray, fn, width: int) -> np.ndarray:
    """``fn(key) -> tuple of width ints`` for every distinct key, gathered back: int64 [..., width].

    Keys are small non-negative integers in a search, so the distinct ones are found with a presence
    table (O(N), no sort); key ranges much wider than the keys are many (one plan's) or huge fall back to np.unique."""
    flat = keys.ravel()
    top = int(flat.max()) + 1 if flat.size else 1
    if top <= min(1 << 22, 64 * flat.size + 1024):
        present = np.zeros(top, bool)
        present[flat] = True
        distinct = np.flatnonzero(present)
        table = np.zeros((top, width), np.int64)
        table[distinct] = np.array([fn(int(k)) for k in distinct], np.int64).reshape(-1, width)
        return table[flat].reshape(keys.shape + (width,))
    distinct, inverse = np.unique(flat, return_inverse=True)
    table = np.array([fn(int(k)) for k in distinct], np.int64).reshape(-1, width)
    return table[inverse].reshape(keys.shape + (width,))


def span_arrays(alloc: Allocation, stride, count) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vectorised group_span over candidate arrays: (scope index, nodes, ranks per node), each int64 [N].

    Only the distinct (stride, count) pairs are laid out (a handful per search), the rest is a lookup."""
    stride, count = np.broadcast_arrays(np.asarray(stride, np.int64), np.asarray(count, np.int64))
    base = alloc.world + 1
    rows = lookup_unique(stride * base + count, lambda key: _span_row(alloc, key // base, key % base), 3)
    return rows[..., 0], rows[..., 1], rows[..., 2]


def _span_row(alloc: Allocation, stride: int, count: int) -> tuple[int, int, int]:
    if alloc.world % (stride * count):
        return (len(SCOPES) - 1, alloc.nodes, 1)        # invalid candidate: priced as worst case
    span = group_span(alloc, stride, count)
    return (span.scope_index, span.nodes, span.ranks_per_node)


def stage_pair_scope(alloc: Allocation, stage_ranks) -> np.ndarray:
    """Scope index of pipeline p2p: the widest link between rank r and r + dp x tp (next stage), per candidate."""
    stage_ranks = np.asarray(stage_ranks, np.int64)
    return lookup_unique(stage_ranks, lambda block: (_pair_scope(alloc, block),), 1)[..., 0]


@lru_cache(maxsize=4096)
def _pair_scope(alloc: Allocation, block: int) -> int:
    if block >= alloc.world or block <= 0:
        return 0
    r = np.arange(alloc.world - block)
    return int(alloc.scope_of_pair(r, r + block).max())
