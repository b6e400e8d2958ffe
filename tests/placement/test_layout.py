"""Rank layout on compact and spread allocations (DESIGN.md rank order; Frontier: 8 GCDs per node, 4 nodes
per switch, 128 nodes per dragonfly group, two GCDs per NIC)."""

from __future__ import annotations

import numpy as np
import pytest

from piper_plan.catalog import load_platform
from piper_plan.placement.layout import allocation, group_ranks, group_span, span_arrays, stage_pair_scope

FRONTIER = load_platform("frontier")


def test_rank_to_node_nic_switch_group_compact():
    alloc = allocation(FRONTIER, 256)
    ranks = np.array([0, 7, 8, 31, 32, 1023, 1024])
    assert alloc.node_of_rank(ranks).tolist() == [0, 0, 1, 3, 4, 127, 128]
    assert alloc.nic_of_rank(ranks).tolist() == [0, 3, 4, 15, 16, 511, 512]     # 4 NICs a node, 2 GCDs each
    nodes = alloc.node_of_rank(ranks)
    assert alloc.switch_of_node(nodes).tolist() == [0, 0, 0, 0, 1, 31, 32]
    assert alloc.group_of_node(nodes).tolist() == [0, 0, 0, 0, 0, 0, 1]


def test_group_ranks_tile_the_world():
    """dp groups of a (pp=2, dp=4, tp=2) world of 16: stride tp = 2, count dp = 4."""
    groups = group_ranks(16, 2, 4)
    assert groups.tolist()[:3] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14]]
    assert sorted(groups.ravel().tolist()) == list(range(16))


@pytest.mark.parametrize("nodes,stride,count,scope,spanned", [
    (4, 1, 8, "node", 1),        # tp / ep of 8 inside a node
    (4, 1, 16, "switch", 2),     # 2 nodes on one switch
    (8, 1, 64, "group", 8),      # 8 nodes = 2 switches of one group
    (256, 1, 2048, "system", 256),
    (8, 8, 8, "group", 8),       # dp of 8 with tp 8: one rank per node over 8 nodes
])
def test_group_span_compact(nodes, stride, count, scope, spanned):
    span = group_span(allocation(FRONTIER, nodes), stride, count)
    assert (span.scope, span.nodes) == (scope, spanned)
    assert span.ranks_per_node == count // spanned


def test_spread_puts_every_node_pair_in_different_groups():
    spread = group_span(allocation(FRONTIER, 4, "spread"), 1, 16)
    compact = group_span(allocation(FRONTIER, 4, "compact"), 1, 16)
    assert (compact.scope, spread.scope) == ("switch", "system")
    assert group_span(allocation(FRONTIER, 4, "spread"), 1, 8).scope == "node"


def test_span_arrays_match_group_span_per_candidate():
    alloc = allocation(FRONTIER, 16)
    strides = np.array([1, 1, 8, 2, 1])
    counts = np.array([8, 32, 16, 4, 1])
    scope, nodes, per_node = span_arrays(alloc, strides, counts)
    for i in range(len(strides)):
        span = group_span(alloc, int(strides[i]), int(counts[i]))
        assert (scope[i], nodes[i], per_node[i]) == (span.scope_index, span.nodes, span.ranks_per_node)


def test_pipeline_pairs_cross_the_widest_boundary():
    """pp stages of 8 ranks (a node each) on 8 compact nodes: stage 3 -> 4 crosses a switch (4 nodes/switch);
    stages of 4 ranks on 2 nodes: stage 1 -> 2 crosses nodes on one switch; on 1 node: no boundary."""
    alloc = allocation(FRONTIER, 8)
    assert stage_pair_scope(alloc, np.array([8, 4, 32])).tolist() == [2, 2, 2]
    assert stage_pair_scope(allocation(FRONTIER, 2), np.array([4, 8])).tolist() == [1, 1]
    assert stage_pair_scope(allocation(FRONTIER, 1), np.array([4])).tolist() == [0]


def test_gb200_segments_keep_expert_groups_inside_one_rack():
    """GB200 NVL72: 18 trays of 4 GPUs per rack, jobs placed in 16-tray segments (network.segment_nodes).
    A 64-tray job (256 GPUs) at dp = ep = 64, pp = 4: every stage's 64 ranks = 16 trays = one rack (NVLink);
    filling racks completely (no segments) puts stage 1 on trays 16-31, straddling racks 0 and 1."""
    gb200 = load_platform("gb200-nvl72")
    alloc = allocation(gb200, 64)
    assert alloc.segment_nodes == 16
    assert alloc.switch_of_node(np.array([0, 15, 16, 31, 32, 63])).tolist() == [0, 0, 1, 1, 2, 3]
    assert group_span(alloc, 1, 64).scope == "switch"
    assert stage_pair_scope(alloc, np.array([64]))[0] == 2       # stage 0 -> 1: rack 0 -> rack 1 of one SU (group)
    racks_filled = allocation(gb200.model_copy(update={"network": gb200.network.model_copy(
        update={"segment_nodes": None})}), 64)
    assert group_span(racks_filled, 1, 64).scope == "group"
    assert gb200.network.max_nodes == 128 * 16                   # 128 racks, 16 trays of each a job can use


def test_segment_larger_than_a_switch_is_refused():
    from pydantic import ValidationError

    net = load_platform("gb200-nvl72").network.model_dump()
    with pytest.raises(ValidationError, match="segment_nodes"):
        type(load_platform("gb200-nvl72").network).model_validate({**net, "segment_nodes": 19})


@pytest.mark.parametrize("platform, nodes", [("local-cpu", 4), ("frontier", 64), ("frontier", 2048),
                                             ("dgx-h100", 128)])
def test_spread_uses_only_the_switches_the_machine_has(platform, nodes):
    """Spread put every node on a switch of its own, also on a one-switch machine (local-cpu: 4 nodes priced as
    crossing a dragonfly group it does not have). Now: a node's switch lies in its group, there are no more
    switches than the machine has, and nodes share one only once every switch holds a node."""
    alloc = allocation(load_platform(platform), nodes, "spread")
    node = np.arange(nodes)
    switch, group = alloc.switch_of_node(node), alloc.group_of_node(node)
    switches = alloc.num_groups * alloc.switches_per_group
    assert switch.max() < switches and np.all(switch // alloc.switches_per_group == group)
    assert len(set(switch.tolist())) == min(nodes, switches)
    if alloc.num_groups == 1 and alloc.switches_per_group == 1:
        compact = allocation(load_platform(platform), nodes, "compact")
        ranks = np.arange(alloc.world)
        assert np.array_equal(alloc.scope_of_pair(ranks[:, None], ranks), compact.scope_of_pair(ranks[:, None], ranks))
