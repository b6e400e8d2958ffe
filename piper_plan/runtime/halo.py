"""HALO: the hierarchical, NIC-affine all-to-all of the Piper paper (piper-paper.md, "HALO").

A drop-in for the flat expert dispatcher (runtime/dispatch.py, ``FlatDispatcher``): the same
layout -> dispatch -> combine API, and a result equal to ``all_to_all_single``'s row for row (grouped by
source rank, in EP-group rank order). One exchange runs in three phases:

- **I**   rows bound to ranks of my own node: one ``all_to_all_single`` on the node's intra-node group;
- **II**  rows bound to each other node B: packed per node and sent with ``batch_isend_irecv`` to my
          NIC-affine *relay* on B (the rank of B on the same NIC index: local rank j of node A talks to
          local rank j of node B), so every NIC of a node carries its share of the node's traffic;
- **III** each relay redistributes what it received inside its node (``all_to_all_single`` on a second
          intra-node group).

Schedule ``I || (II -> III)``: phase I is issued asynchronously on its own group and waited for last.
The row bookkeeping is pure (``plan_exchange``, numpy only) and the torch part only moves rows.
Split sizes may be anything, including zero; a transfer of zero rows is skipped on both sides (both know
the full count matrix), so a rank that sends or receives nothing never hangs.

Shapes: R = rows this rank sends (grouped by destination), S = rows it receives (grouped by source),
D = feature width, P = EP group size. ``counts_PP[s, d]`` = rows group rank s sends to group rank d.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

import numpy as np

from piper_plan.runtime.topology import RankTopology


# ----------------------------------------------------------------------------------------------------
# Pure planning: which rows go where in each phase (no torch).
# ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExchangePlan:
    """One rank's part of one all-to-all, as row indices and split sizes (all counts in rows)."""

    intra_send_index: np.ndarray
    """Phase I input = x[intra_send_index], grouped by destination in ``node_members`` order."""
    intra_send_splits: list[int]
    intra_recv_splits: list[int]
    """Phase I output, grouped by source in ``node_members`` order."""
    inter_send_index: np.ndarray
    """Phase II packed input = x[inter_send_index], one block per entry of ``inter_sends``."""
    inter_sends: list[tuple[int, int]]
    """(relay group rank, rows) per remote node with rows to send, in node order."""
    inter_recvs: list[tuple[int, int]]
    """(source group rank, rows) this rank relays, in group-rank order; blocks of the phase II buffer."""
    relay_send_index: np.ndarray
    """Phase III input = phase-II buffer[relay_send_index], grouped by destination in ``node_members`` order."""
    relay_send_splits: list[int]
    relay_recv_splits: list[int]
    """Phase III output, grouped by relay in ``node_members`` order."""
    output_index: np.ndarray
    """Result = cat(phase I output, phase III output)[output_index], grouped by source group rank."""


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(start, start + length) for each pair, as int64 (vectorised)."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    block_start_in_out = np.cumsum(lengths) - lengths
    return np.repeat(starts - block_start_in_out, lengths) + np.arange(total, dtype=np.int64)


def _exclusive_cumsum(values: np.ndarray) -> np.ndarray:
    values = np.asarray(values, dtype=np.int64)
    return np.cumsum(values) - values


def node_members(node_of: Sequence[int]) -> dict[int, list[int]]:
    """Group ranks on each node, ascending; nodes in order of first appearance."""
    members: dict[int, list[int]] = {}
    for g, node in enumerate(node_of):
        members.setdefault(node, []).append(g)
    return members


def relay_of(source: int, dest_node: int, node_of: Sequence[int], nic_of: Sequence[int]) -> int:
    """The rank of ``dest_node`` that receives ``source``'s rows bound there (phase II peer).

    NIC affinity: among the destination node's ranks on the same NIC index as ``source``, the k-th, where
    ``source`` is the k-th rank of its own node on that NIC (wrapping). With equal layouts on both nodes
    this is "local rank j talks to local rank j". If no rank there uses that NIC index, the rank at
    ``source``'s local position (wrapping) is used.
    """
    members = node_members(node_of)
    own = members[node_of[source]]
    there = members[dest_node]
    same_nic_there = [d for d in there if nic_of[d] == nic_of[source]]
    if same_nic_there:
        same_nic_here = [s for s in own if nic_of[s] == nic_of[source]]
        return same_nic_there[same_nic_here.index(source) % len(same_nic_there)]
    return there[own.index(source) % len(there)]


@lru_cache(maxsize=64)
def _relay_table(node_of: tuple[int, ...], nic_of: tuple[int, ...]) -> dict[tuple[int, int], int]:
    """relay_of for every (source, other node) of a group: it depends on the topology only, not the counts."""
    return {(s, node): relay_of(s, node, node_of, nic_of)
            for s in range(len(node_of)) for node in set(node_of) if node != node_of[s]}


def plan_exchange(counts_PP: np.ndarray, me: int, node_of: Sequence[int], nic_of: Sequence[int]) -> ExchangePlan:
    """Rank ``me``'s plan for the all-to-all where group rank s sends ``counts_PP[s, d]`` rows to d.

    Every rank computes the plans from the same full matrix, so senders and receivers agree on every size.
    """
    counts = np.asarray(counts_PP, dtype=np.int64)
    node_of, nic_of = tuple(node_of), tuple(nic_of)
    members = node_members(node_of)
    mine = members[node_of[me]]
    relay_table = _relay_table(node_of, nic_of)
    relays = {s: relay_table[s, node_of[me]] for s in range(len(node_of)) if node_of[s] != node_of[me]}
    send_offset = _exclusive_cumsum(counts[me])
    intra_send_index = _ranges(send_offset[mine], counts[me, mine])
    remote_nodes = [n for n in members if n != node_of[me]]
    inter_sends, inter_blocks = [], []
    for node in remote_nodes:
        dests = members[node]
        rows = int(counts[me, dests].sum())
        inter_blocks.append(_ranges(send_offset[dests], counts[me, dests]))
        if rows:
            inter_sends.append((relay_table[me, node], rows))
    relayed = [s for s in sorted(relays) if relays[s] == me]
    relay_send_index, relay_send_splits = _relay_send(counts, relayed, mine)
    return ExchangePlan(
        intra_send_index=intra_send_index,
        intra_send_splits=[int(c) for c in counts[me, mine]],
        intra_recv_splits=[int(c) for c in counts[mine, me]],
        inter_send_index=np.concatenate(inter_blocks) if inter_blocks else np.zeros(0, dtype=np.int64),
        inter_sends=inter_sends,
        inter_recvs=[(s, int(counts[s, mine].sum())) for s in relayed if counts[s, mine].sum()],
        relay_send_index=relay_send_index,
        relay_send_splits=relay_send_splits,
        relay_recv_splits=[int(sum(counts[s, me] for s in relays if relays[s] == q)) for q in mine],
        output_index=_output_index(counts, me, mine, relays),
    )


def _relay_send(counts: np.ndarray, relayed: list[int], mine: list[int]) -> tuple[np.ndarray, list[int]]:
    """Phase III: reorder the phase-II buffer (blocks [source][dest]) into blocks [dest][source]."""
    if not relayed:
        return np.zeros(0, dtype=np.int64), [0] * len(mine)
    block_SD = counts[np.ix_(relayed, mine)]  # rows source s -> local dest d, as laid out in the buffer
    start_SD = _exclusive_cumsum(block_SD.reshape(-1)).reshape(block_SD.shape)
    index = _ranges(start_SD.T.reshape(-1), block_SD.T.reshape(-1))
    return index, [int(c) for c in block_SD.sum(axis=0)]


def _output_index(counts: np.ndarray, me: int, mine: list[int], relays: dict[int, int]) -> np.ndarray:
    """Where each source's block sits in cat(phase I out, phase III out); result grouped by source."""
    num_sources = counts.shape[0]
    start = np.zeros(num_sources, dtype=np.int64)
    intra_offsets = _exclusive_cumsum(counts[mine, me])
    for pos, s in enumerate(mine):
        start[s] = intra_offsets[pos]
    offset = int(counts[mine, me].sum())
    for q in mine:  # phase III output: grouped by relay q, then by source in group-rank order
        for s in sorted(r for r in relays if relays[r] == q):
            start[s] = offset
            offset += int(counts[s, me])
    return _ranges(start, counts[:, me])


# ----------------------------------------------------------------------------------------------------
# Layout and the torch dispatcher.
# ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HaloLayout:
    """The handle of one exchange: dispatch.DispatchLayout's fields and meaning, plus both directions' plans."""

    send_counts: tuple[int, ...]
    """Rows this rank sends to each member of the EP group (group-rank order)."""
    recv_counts: tuple[int, ...]
    """Rows this rank receives from each member."""
    recv_expert_counts: tuple[tuple[int, ...], ...] | None = None
    """Per source member, rows for each of this rank's local experts (only when counts were per expert)."""
    dispatch_plan: ExchangePlan | None = field(default=None, repr=False, compare=False)
    """Phases of dispatch (counts matrix C)."""
    combine_plan: ExchangePlan | None = field(default=None, repr=False, compare=False)
    """Phases of combine, the reverse exchange (C transposed); also dispatch's backward."""
    recv_expert_counts_tensor: object = field(default=None, repr=False, compare=False)
    """``recv_expert_counts`` as an int64 [P x n_local] tensor where the gather left it (dispatch.DispatchLayout)."""


def layout_from_counts(counts_PX: np.ndarray, me: int, node_of: Sequence[int], nic_of: Sequence[int]) -> HaloLayout:
    """The layout rank ``me`` derives from the gathered counts (pure).

    counts_PX: [P, P] rows source -> destination, or [P, P * n_local] rows source -> (destination, local expert).
    """
    counts = np.asarray(counts_PX, dtype=np.int64)
    size = len(node_of)
    per_expert = counts.reshape(size, size, -1)
    rows_PP = per_expert.sum(axis=2)
    return HaloLayout(
        send_counts=tuple(int(c) for c in rows_PP[me]),
        recv_counts=tuple(int(c) for c in rows_PP[:, me]),
        recv_expert_counts=(tuple(tuple(int(c) for c in row) for row in per_expert[:, me, :])
                            if counts.shape[1] != size else None),
        dispatch_plan=plan_exchange(rows_PP, me, node_of, nic_of),
        combine_plan=plan_exchange(rows_PP.T, me, node_of, nic_of),
    )


class HaloDispatcher:
    """HALO expert dispatch for one EP group; API and results as FlatDispatcher's.

    Built by ``build_halo_dispatchers`` (collective), not directly.
    """

    def __init__(self, ep_ranks: Sequence[int], topology: RankTopology, me: int, ep_group, intra_groups,
                 descending_group=None):
        self.ep_ranks = tuple(ep_ranks)
        """Global ranks of the EP group, in group-rank order."""
        self.me = me
        """This rank's index in the group."""
        self.node_of = tuple(topology.node_of_rank[r] for r in self.ep_ranks)
        self.nic_of = tuple(topology.nic_of_rank[r] for r in self.ep_ranks)
        self.group = ep_group
        self.descending_group = ep_group if descending_group is None else descending_group
        """Phase II transfers from a higher to a lower group rank (``_p2p_group``); ``ep_group`` on nccl."""
        self.intra_groups = intra_groups
        """(phase I group, phase III group) of this rank's node; None where the node holds one member."""
        from piper_plan.runtime.dispatch import CommTimer

        self.timer = CommTimer()
        """Seconds spent in exchanges (layout gather included), as FlatDispatcher.timer."""

    @property
    def num_nodes(self) -> int:
        """Nodes the EP group spans (1 = HALO is phase I only)."""
        return len(set(self.node_of))

    def layout(self, send_counts) -> HaloLayout:
        """Gather every member's send counts (one all_gather on the EP group) and plan both directions.

        send_counts: int64 [P] rows this rank sends to each group member, or [P, n_local] rows per
        (member, local expert); the layout then carries ``recv_expert_counts`` as FlatDispatcher's does.
        """
        return self.start_layout(send_counts).wait()

    def start_layout(self, send_counts):
        """``layout`` with its gather started, not waited for (as FlatDispatcher.start_layout)."""
        import torch
        import torch.distributed as dist

        from piper_plan.runtime.dispatch import PendingLayout

        counts = torch.as_tensor(send_counts, dtype=torch.int64)
        if counts.shape[0] != len(self.ep_ranks) or counts.dim() > 2:
            raise ValueError(f"send_counts must be [{len(self.ep_ranks)}] or [{len(self.ep_ranks)}, n_local] "
                             f"non-negative ints, got shape {tuple(counts.shape)}")
        flat = counts.reshape(-1).to(comm_device(self.group))
        gathered = [torch.zeros_like(flat) for _ in self.ep_ranks]
        work = self.timer.run(lambda: dist.all_gather(gathered, flat, group=self.group, async_op=True),
                              device=flat.device)
        return PendingLayout(lambda: self._layout(counts, gathered, work))

    def _layout(self, counts, gathered, work) -> HaloLayout:
        import torch

        self.timer.run(work.wait, device=gathered[0].device)
        matrix = torch.stack(gathered)
        matrix_PX = np.asarray(matrix.tolist(), dtype=np.int64)  # the layer's one host read
        if (matrix_PX < 0).any():
            raise ValueError(f"send_counts must be non-negative, got {matrix_PX.tolist()}")
        layout = layout_from_counts(matrix_PX, self.me, self.node_of, self.nic_of)
        if counts.dim() == 1:
            return layout
        n_local = counts.shape[1]
        mine = matrix[:, self.me * n_local:(self.me + 1) * n_local].reshape(-1)
        return dataclasses.replace(layout, recv_expert_counts_tensor=mine)

    def dispatch(self, x_RD, layout: HaloLayout):
        """x_RD rows grouped by destination -> received rows [S, D] grouped by source; differentiable."""
        assert layout.dispatch_plan is not None, "a HaloDispatcher needs its own layout (HaloDispatcher.layout)"
        assert x_RD.shape[0] == sum(layout.send_counts), f"x has {x_RD.shape[0]} rows; sends {layout.send_counts}"
        return _exchange_function().apply(x_RD, self, layout.dispatch_plan, layout.combine_plan)

    def dispatch_async(self, x_RD, layout: HaloLayout):
        """``dispatch``, run to completion now (its three phases are not split around other work)."""
        from piper_plan.runtime.dispatch import ReadyExchange

        return ReadyExchange(self.dispatch(x_RD, layout))

    def combine(self, y_SD, layout: HaloLayout):
        """The reverse exchange: rows grouped by source go back, arriving grouped by destination; differentiable."""
        assert layout.combine_plan is not None, "a HaloDispatcher needs its own layout (HaloDispatcher.layout)"
        assert y_SD.shape[0] == sum(layout.recv_counts), f"y has {y_SD.shape[0]} rows, layout gets {layout.recv_counts}"
        return _exchange_function().apply(y_SD, self, layout.combine_plan, layout.dispatch_plan)

    def exchange(self, x_RD, plan: ExchangePlan):
        """Run one planned all-to-all (no autograd), timed into ``self.timer``."""
        return self.timer.run(self._exchange, x_RD, plan, device=x_RD.device)

    def _exchange(self, x_RD, plan: ExchangePlan):
        """I || (II -> III), then reorder the received rows by source."""
        import torch

        x_RD = x_RD.contiguous()
        intra_out, intra_work = self._phase_local(x_RD, plan)
        relay_in = self._phase_inter(x_RD, plan)
        relay_out, relay_work = self._phase_redistribute(relay_in, plan)
        for work in (intra_work, relay_work):
            if work is not None:
                work.wait()
        return torch.cat([intra_out, relay_out])[_index(plan.output_index, x_RD.device)]

    def _phase_local(self, x_RD, plan: ExchangePlan):
        """Phase I, asynchronous: rows for my own node."""
        send = x_RD[_index(plan.intra_send_index, x_RD.device)]
        return _all_to_all_async(send, plan.intra_send_splits, plan.intra_recv_splits, self.intra_groups[0])

    def _phase_inter(self, x_RD, plan: ExchangePlan):
        """Phase II: packed rows per remote node to the NIC-affine relay there; returns what I relay."""
        import torch
        import torch.distributed as dist

        send = x_RD[_index(plan.inter_send_index, x_RD.device)]
        recv = x_RD.new_empty((sum(n for _, n in plan.inter_recvs),) + tuple(x_RD.shape[1:]))
        ops = [dist.P2POp(dist.isend, block, self.ep_ranks[peer], self._p2p_group(self.me, peer))
               for (peer, _), block in zip(plan.inter_sends, torch.split(send, [n for _, n in plan.inter_sends]))]
        ops += [dist.P2POp(dist.irecv, block, self.ep_ranks[src], self._p2p_group(src, self.me))
                for (src, _), block in zip(plan.inter_recvs, torch.split(recv, [n for _, n in plan.inter_recvs]))]
        by_group: dict[int, list] = {}
        for op in ops:                       # batch_isend_irecv takes one communicator per batch
            by_group.setdefault(id(op.group), []).append(op)
        works = [w for batch in by_group.values() for w in dist.batch_isend_irecv(batch)]
        for work in works:
            work.wait()
        return recv

    def _p2p_group(self, source: int, dest: int):
        """The communicator of a phase II transfer from group rank ``source`` to ``dest``: the two directions
        between a pair travel on two communicators, because one gloo connection carries one direction at a time
        (docs/halo-measured.md, shaping check: both ways on one communicator get half the one-way rate)."""
        return self.group if source < dest else self.descending_group

    def _phase_redistribute(self, relay_in, plan: ExchangePlan):
        """Phase III: what I relayed goes to its destinations on my node."""
        if self.num_nodes == 1:
            return relay_in[:0], None
        send = relay_in[_index(plan.relay_send_index, relay_in.device)]
        return _all_to_all_async(send, plan.relay_send_splits, plan.relay_recv_splits, self.intra_groups[1])


def _index(index: np.ndarray, device):
    import torch

    return torch.from_numpy(index).to(device)


def _all_to_all_async(send, send_splits: list[int], recv_splits: list[int], group):
    """all_to_all_single issued asynchronously; a one-member group is a copy. Returns (output, work or None)."""
    import torch.distributed as dist

    if group is None:
        return send, None
    out = send.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
    work = dist.all_to_all_single(out, send, recv_splits, send_splits, group=group, async_op=True)
    return out, work


def comm_device(group):
    """Where collectives on ``group`` need their tensors: the current GPU for nccl, else CPU."""
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@lru_cache(maxsize=1)
def _exchange_function():
    """The autograd Function of one planned exchange (built on first use: torch is imported lazily)."""
    import torch

    class HaloExchange(torch.autograd.Function):
        """One planned HALO exchange; backward is the reverse exchange (a permutation's adjoint)."""

        @staticmethod
        def forward(ctx, x, dispatcher, forward_plan, backward_plan):
            ctx.dispatcher, ctx.backward_plan = dispatcher, backward_plan
            return dispatcher.exchange(x, forward_plan)

        @staticmethod
        def backward(ctx, grad):
            return ctx.dispatcher.exchange(grad.contiguous(), ctx.backward_plan), None, None, None

    return HaloExchange


# ----------------------------------------------------------------------------------------------------
# Collective construction.
# ----------------------------------------------------------------------------------------------------

def check_ep_groups(ep_groups: list[list[int]], world_size: int) -> None:
    """Every rank in at most one group, inside the world."""
    seen: set[int] = set()
    for ranks in ep_groups:
        bad = [r for r in ranks if not 0 <= r < world_size or r in seen]
        if bad or not ranks:
            raise ValueError(f"EP group {ranks}: ranks {bad} out of range 0..{world_size - 1} or in two groups")
        seen.update(ranks)


def build_halo_dispatchers(ep_groups: list[list[int]], topology: RankTopology, my_ep_group=None) -> HaloDispatcher | None:
    """Create every EP group's node-local process groups (collective: every rank calls this with the same
    arguments).

    ``my_ep_group``: this rank's EP group from the mesh (runtime/mesh.py: layout exchange + phase II p2p); None
    makes the EP groups here too (standalone use: benchmarks, tests). Then, per EP group and for each node it spans
    that holds two or more of its members, a phase I group and (if the group spans nodes) a phase III group: two
    communicators on the same node-local ranks, so that phase I runs concurrently with phase III (collectives on
    one communicator are serialised). Node-local groups are made here, not by the mesh, because an EP group's
    split over nodes need not be regular (ep = 6 on 4-device nodes).
    On gloo, an EP group that spans nodes gets one more communicator on its ranks for phase II's descending
    transfers (``HaloDispatcher._p2p_group``): a gloo connection is not full duplex; nccl's is.
    Group-rank order is ascending global rank (torch's ``new_group`` order, as for FlatDispatcher).
    Returns this rank's dispatcher, or None if the rank is in no group.
    """
    import torch.distributed as dist

    check_ep_groups(ep_groups, topology.world_size)
    rank = dist.get_rank()
    half_duplex = dist.get_backend() == "gloo"
    mine = None
    for ranks in (sorted(g) for g in ep_groups):  # new_group orders members by global rank: so do we
        ep_group = my_ep_group if my_ep_group is not None and rank in ranks else None
        if my_ep_group is None:
            ep_group = dist.new_group(list(ranks))
        by_node = node_members([topology.node_of_rank[r] for r in ranks])
        descending = dist.new_group(list(ranks)) if half_duplex and len(by_node) > 1 else None
        groups_per_node = 1 if len(by_node) == 1 else 2
        intra: dict[int, tuple] = {}
        for node, positions in by_node.items():
            members = [ranks[p] for p in positions]
            made = [dist.new_group(members) if len(members) > 1 else None for _ in range(groups_per_node)]
            intra[node] = (made[0], made[-1])
        if rank in ranks:
            mine = HaloDispatcher(ranks, topology, list(ranks).index(rank), ep_group,
                                  intra[topology.node_of_rank[rank]], descending)
    return mine
