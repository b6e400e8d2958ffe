"""The PP x EP x DP mesh of DESIGN.md: rank = (pp_index x dp + dp_index) x tp + tp_index (tp = 1 here).

Expert groups are ep consecutive ranks of a stage's dp block; the edp ranks with the same position in
their expert group hold the same experts and reduce expert gradients together. ``coords`` is pure;
``Mesh.create`` builds the process groups (collective: every rank calls it, groups in the same order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Coords:
    """Where one rank sits in the mesh."""

    rank: int
    pp_index: int
    dp_index: int
    ep_rank: int
    """Position inside its expert group (which experts it holds)."""
    ep_group_index: int
    """Which of the stage's edp expert groups it belongs to."""


def coords(rank: int, pp: int, dp: int, ep: int) -> Coords:
    pp_index, dp_index = divmod(rank, dp)
    assert pp_index < pp, f"rank {rank} outside pp x dp = {pp} x {dp}"
    group_index, ep_rank = divmod(dp_index, ep)
    return Coords(rank, pp_index, dp_index, ep_rank, group_index)


def stage_ranks(pp_index: int, dp: int) -> list[int]:
    return [pp_index * dp + d for d in range(dp)]


def pipeline_ranks(dp_index: int, pp: int, dp: int) -> list[int]:
    return [p * dp + dp_index for p in range(pp)]


def expert_groups(pp: int, dp: int, ep: int) -> list[list[int]]:
    """All EP groups of the world, stage by stage: ep consecutive ranks of each stage's dp block."""
    return [[p * dp + g * ep + j for j in range(ep)] for p in range(pp) for g in range(dp // ep)]


def expert_dp_groups(pp: int, dp: int, ep: int) -> list[list[int]]:
    """All EDP groups: the ranks of a stage at the same position of their expert groups."""
    return [[p * dp + g * ep + j for g in range(dp // ep)] for p in range(pp) for j in range(ep)]


@dataclass
class Mesh:
    """This rank's coordinates and its process groups (None where the group is this rank alone)."""

    pp: int
    dp: int
    ep: int
    me: Coords
    pp_group: object
    dp_group: object
    ep_group: object
    edp_group: object
    ep_group_ranks: list[list[int]]

    @classmethod
    def create(cls, rank: int, pp: int, dp: int, ep: int) -> "Mesh":
        me = coords(rank, pp, dp, ep)
        pp_group = _mine([pipeline_ranks(d, pp, dp) for d in range(dp)], rank)
        dp_group = _mine([stage_ranks(p, dp) for p in range(pp)], rank)
        eps = expert_groups(pp, dp, ep)
        ep_group = _mine(eps, rank)
        edp_group = _mine(expert_dp_groups(pp, dp, ep), rank)
        return cls(pp, dp, ep, me, pp_group, dp_group, ep_group, edp_group, eps)

    @property
    def is_last_stage(self) -> bool:
        return self.me.pp_index == self.pp - 1


def _mine(groups: list[list[int]], rank: int):
    """Create every group (collective) and return the one holding ``rank``."""
    mine = None
    for ranks in groups:
        g = dist.new_group(ranks)
        if rank in ranks:
            mine = g
    return mine
