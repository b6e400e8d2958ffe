"""The PP x DP x TP mesh of DESIGN.md and its expert regrouping, on torch's DeviceMesh.

Rank order: rank = (pp_index x dp + dp_index) x tp + tp_index (tp fastest, then dp, then pp). The dense mesh is
``init_device_mesh(device, (pp, dp, tp), ("pp", "dp", "tp"))``. Experts regroup each stage's dp x tp block
(``ep x edp = dp x tp``, etp = 1): the block is flattened in rank order and unflattened as (edp, ep), so an expert
group is ep consecutive ranks of the block and the edp ranks at the same position of their expert groups hold the
same experts. Every group comes from the mesh (no hand-made ``new_group``); where two dimensions hold the same
ranks (tp = 1 and ep = dp: the expert group is the dp group) the expert dimension reuses the dense one's
communicator. ``coords`` is pure; ``Mesh.create`` is collective (every rank calls it with the same arguments).
"""

from __future__ import annotations

from dataclasses import dataclass


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
    tp_index: int = 0


def coords(rank: int, pp: int, dp: int, ep: int, tp: int = 1) -> Coords:
    pp_index, block_index = divmod(rank, dp * tp)
    assert pp_index < pp, f"rank {rank} outside pp x dp x tp = {pp} x {dp} x {tp}"
    dp_index, tp_index = divmod(block_index, tp)
    group_index, ep_rank = divmod(block_index, ep)
    return Coords(rank, pp_index, dp_index, ep_rank, group_index, tp_index)


def expert_groups(pp: int, dp: int, ep: int, tp: int = 1) -> list[list[int]]:
    """All EP groups of the world, stage by stage: ep consecutive ranks of each stage's dp x tp block."""
    block = dp * tp
    return [[p * block + g * ep + j for j in range(ep)] for p in range(pp) for g in range(block // ep)]


@dataclass
class Mesh:
    """This rank's coordinates, its DeviceMeshes and process groups (a group is None where it is this rank alone)."""

    pp: int
    dp: int
    ep: int
    me: Coords
    device_mesh: object
    """DeviceMesh ("pp", "dp", "tp") of the whole world."""
    expert_mesh: object
    """DeviceMesh ("edp", "ep") of this rank's stage."""
    pp_group: object
    dp_group: object
    ep_group: object
    edp_group: object
    ep_group_ranks: list[list[int]]
    tp: int = 1
    tp_group: object = None

    @classmethod
    def create(cls, rank: int, pp: int, dp: int, ep: int, tp: int = 1, device_type: str = "cpu") -> "Mesh":
        from torch.distributed.device_mesh import init_device_mesh

        world = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        experts = _expert_mesh(world, dp * tp // ep, ep)
        groups = {name: _group(world, name) for name in ("pp", "dp", "tp")}
        ep_group = _same_or(groups, world["dp"] if tp == 1 else None, experts["ep"])
        edp_group = _group(experts, "edp")
        return cls(pp, dp, ep, coords(rank, pp, dp, ep, tp), world, experts, groups["pp"], groups["dp"], ep_group,
                   edp_group, expert_groups(pp, dp, ep, tp), tp, groups["tp"])

    @property
    def is_last_stage(self) -> bool:
        return self.me.pp_index == self.pp - 1

    def first_last_group(self):
        """The process group of this rank's (dp, tp) position on the first and the last stage (pp > 1; the MTP
        modules' embedding copy, train.py): the pp group where pp = 2, else one ``new_group`` per position, every
        rank creating all of them in the same order (DeviceMesh has no view of two non-adjacent pp indices).
        None on the stages between."""
        import torch.distributed as dist

        if self.pp == 2:
            return self.pp_group
        block = self.dp * self.tp
        mine = None
        for position in range(block):
            group = dist.new_group([position, (self.pp - 1) * block + position])
            if self.me.rank % block == position and self.me.pp_index in (0, self.pp - 1):
                mine = group
        return mine

    def submesh(self, name: str):
        """The 1-D DeviceMesh of one dimension: "pp", "dp", "tp" (dense) or "ep", "edp" (experts)."""
        return self.expert_mesh[name] if name in ("ep", "edp") else self.device_mesh[name]


def end_process_group() -> None:
    """Destroy the default process group (and with it the mesh's groups) safely: a gloo rank whose group is
    destroyed while unreachable objects still hold its work (DTensor, FSDP2, functional collectives) can abort at
    interpreter exit ("terminate called without an active exception", exit -6: 7 of 24 runs of a minimal script,
    shared/reference/environment.md); collecting them first avoids it (0 of 18)."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


def _expert_mesh(world, edp: int, ep: int):
    """This stage's dp x tp block regrouped as (edp, ep): ep consecutive ranks per expert group."""
    block = world["dp", "tp"]._flatten("dp_tp")
    return block._unflatten(0, (edp, ep), ("edp", "ep"))


def _group(mesh, name: str):
    """The process group of one mesh dimension; None where the dimension has size 1."""
    return mesh.get_group(name) if mesh.size(mesh.mesh_dim_names.index(name)) > 1 else None


def _same_or(groups: dict, dense_dim, expert_dim):
    """The expert dimension's group, reusing the dense dp group when both hold the same ranks."""
    if expert_dim.size() == 1:
        return None
    if dense_dim is not None and dense_dim.mesh.tolist() == expert_dim.mesh.tolist():
        return groups["dp"]
    return expert_dim.get_group()
