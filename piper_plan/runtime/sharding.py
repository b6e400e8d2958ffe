"""ZeRO 2 and 3 with FSDP2 (``torch.distributed.fsdp.fully_shard``); docs/design-notes.md "zero 0-3 in the runtime".

Per pipeline stage (each model chunk of an interleaved rank is its own root):

- the routed experts of every MoE layer (``MoE.experts``, a LocalExperts) over the stage's ``edp`` mesh first,
  sharded on dim 1 (hidden or expert width), so every edp rank holds the same slice of each of its local experts
  and expert migration exchanges local slices slot by slot (runtime/migration.py); their gradients are summed over
  edp and divided by dp (each expert rank already holds its EP group's tokens): ``set_gradient_divide_factor(dp)``
  with ``set_force_sum_reduction_for_comms`` (gloo has no PREMUL_SUM);
- then each Block over ``dp`` (its dense weights: attention, norms, router, shared experts, dense MLP), or HSDP's
  2-D (dp_replicate, dp_shard) mesh when ``plan.dp_replicate`` > 1 (``dense_mesh``); an MTP module (its norms,
  eh_proj and block) as one unit, like a Block;
- then the stage root (embedding, final norm, LM head) over ``dp``, ``reshard_after_forward=False`` (its weights
  are the first ones backward needs).

zero 2 = ``reshard_after_forward=False`` (blocks stay gathered from forward to backward), zero 3 = ``True``.
dp = 1 leaves the stage unwrapped (nothing to shard: zero 2/3 then run as zero 0). edp = 1 (every expert on one
rank of the stage) still wraps the experts, over a 1-rank mesh: nothing is sharded or communicated, but FSDP2
casts them to the compute dtype once per gather (not once per micro-batch as a plain fp32 weight under bf16
compute would be) and divides their gradients by dp, so every parameter of a zero 2/3 stage is FSDP2's.
Mixed precision: training.dtype bf16 -> ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` over
fp32 sharded master weights (FSDP2 casts on CPU too); fp32 -> no cast.
"""

from __future__ import annotations

import torch
from torch import nn

from piper_plan.capability import uses_fsdp

EXPERT_SHARD_DIM = 1
"""The dim of the stacked ``[El, ...]`` expert tensors sharded over edp (dim 0 would split experts between ranks)."""


def mixed_precision(dtype: str):
    """FSDP2's policy for training.dtype: bf16 params for compute, fp32 gradient reduction; fp32 = no cast."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def stage_roots(module: nn.Module) -> list[nn.Module]:
    """The pipeline stages of this rank's module: its chunks (model.VirtualStages) or the StageModel itself."""
    return list(module.chunks) if hasattr(module, "chunks") else [module]


def shard_stage_module(module: nn.Module, mesh, plan, dtype: str) -> nn.Module:
    """Wrap this rank's module in FSDP2 per the plan's zero level (in place; returns it). No-op unless uses_fsdp."""
    if not uses_fsdp(plan):
        return module
    from torch.distributed.fsdp import fully_shard

    _quiet_view_output_warning()
    policy = mixed_precision(dtype)
    per_block = plan.zero == 3
    dp_mesh = dense_mesh(mesh, plan)
    for stage in stage_roots(module):
        for block in stage.blocks().values():
            if block.is_moe:
                _shard_experts(block.mlp.experts, mesh, plan, policy, per_block)
        for unit in (*stage.layers.values(), *stage.mtp.values()):
            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=per_block, mp_policy=policy)
        fully_shard(stage, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)
    return module


VIEW_OUTPUT_WARNING = r"FSDP2-wrapped module \(\w+\) returned a view tensor"
"""torch's warning (fsdp/_fully_shard/_fsdp_state.py) when a wrapped module's output is a view: an in-place op on
it would skip the pre-backward all-gather. A stage's or MTP module's final hidden states are one (a sequence-
parallel norm's local view); every consumer here (the pipeline's send, the chunked loss's row slices, the MTP
module) reads them out of place, so the warning is silenced for these modules, not the check: losses under zero 3
equal zero 0's (tests/runtime/test_fsdp_runtime.py)."""


def _quiet_view_output_warning() -> None:
    import warnings

    warnings.filterwarnings("ignore", message=VIEW_OUTPUT_WARNING, category=UserWarning)


def dense_mesh(mesh, plan):
    """The mesh FSDP2 shards the dense weights over: dp, or HSDP's 2-D ("dp_replicate", "dp_shard") view of it
    (plan.dp_replicate replicas of a shard group of consecutive dp ranks; FSDP2 replicates over dim 0)."""
    dp_mesh = mesh.submesh("dp")
    if plan.dp_replicate == 1:
        return dp_mesh
    return dp_mesh._unflatten(0, (plan.dp_replicate, plan.dp // plan.dp_replicate), ("dp_replicate", "dp_shard"))


def _shard_experts(experts: nn.Module, mesh, plan, policy, per_block: bool) -> None:
    """FSDP2 over edp for one layer's LocalExperts (edp = 1: a 1-rank mesh, see the module docstring)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    fully_shard(experts, mesh=mesh.submesh("edp"), reshard_after_forward=per_block, mp_policy=policy,
                shard_placement_fn=lambda p: Shard(EXPERT_SHARD_DIM))
    experts.set_gradient_divide_factor(float(plan.dp))
    if plan.edp > 1:
        # sum, then divide: gloo has no PREMUL_SUM. Not on a 1-rank mesh, where FSDP2 (torch 2.13) would divide
        # twice (once in its no-collective copy, once after); there it divides once and communicates nothing.
        experts.set_force_sum_reduction_for_comms(True)


def local(t):
    """The local shard of a DTensor (FSDP2's sharded parameters, gradients, optimizer state); any tensor else."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


FSDP_MESH_DIMS = ("dp", "edp", "dp_replicate")
"""The mesh dimensions FSDP2 shards over here (tensor parallelism's DTensors live on the "tp" dimension)."""


def is_sharded(t) -> bool:
    """Whether ``t`` is FSDP2-managed: a DTensor on the dp or edp mesh."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) and (t.device_mesh.mesh_dim_names or ("",))[0] in FSDP_MESH_DIMS


def replicated(params: list) -> list:
    """The parameters FSDP2 does not manage (their gradients are synchronised by train.py's all-reduce)."""
    return [q for q in params if not is_sharded(q)]
