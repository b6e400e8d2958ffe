"""Tensor parallelism with sequence parallelism over the mesh's tp dimension (Shoeybi et al. 2019; Korthikanti
et al. 2022), on torch's ``torch.distributed.tensor.parallel``.

A StageModel is built on the meta device (model.py), split here by ``parallelize_module``, then materialised:
the seeded initialisation computes each parameter's whole value and keeps this rank's part (model.py
``materialize``), so a tp run starts from the reference's weights.
Sequence parallelism is always on with tp > 1: the residual stream between blocks is a local tensor holding this
rank's sequence shard [B, S / tp, D] (pipeline stages send and receive it as such), norms run on it
(``SequenceParallel``), and each block all-gathers its input and reduce-scatters its output.

What is split (one function per block kind):
- embedding: vocabulary-parallel (``RowwiseParallel``, output sequence-sharded); learned positions replicated
  (added to the all-reduced embedding, then the sum is sequence-sharded at the first block).
- attention (MHA / GQA): q, k, v column-parallel (local heads), o row-parallel; sinks sharded with the heads;
  per-head qk-norm weights replicated (their gradients summed over tp). qk_norm "full" is refused (capability.py).
- MLA: q (full-rank) or q_b column-parallel, kv_b column-parallel, o row-parallel; q_a, q_a_norm, kv_a and
  kv_a_norm replicated (run on the gathered sequence); the rope key shared by all heads is replicated and its
  gradient summed over tp (model.py ``local_tensor(..., partial_grad=True)``).
- dense MLP, shared experts, Arctic's residual MLP: up and gate column-parallel, down row-parallel.
- MoE (etp = 1): routed on this rank's sequence shard; router and shared-expert gate replicated, seeing only this
  rank's tokens: their gradients are summed over tp (train.py ``sync_grads``). Routed experts are reduced over edp as
  without tp (an expert group is ep consecutive ranks of the stage's dp x tp block: mesh.py).
- final norm sequence-parallel; LM head column-parallel with DTensor logits sharded on the vocabulary, whose
  cross entropy runs under ``loss_parallel`` (no full-vocabulary gather); a tied head uses the embedding's
  vocabulary shard the same way.
- MTP modules (last stage): the embedding's copy (pp > 1) vocabulary-parallel as on the first stage; hnorm, enorm
  and the final norm sequence-parallel; eh_proj column-parallel, its output redistributed to the sequence shard
  (Megatron-Core: ColumnParallelLinear, gather, scatter to the sequence-parallel region); the block as a layer's.
"""

from __future__ import annotations

import contextlib

import torch

DENSE_TP_SUMMED = ("router", "shared_gate", "q_norm", "k_norm")
"""Replicated (non-DTensor) parameters that see only this rank's tokens or heads: gradients summed over tp."""


def local_tensor(t, partial_grad: bool = False):
    """A DTensor's local shard (a replicated DTensor's value), else ``t`` itself. ``partial_grad``: the local
    gradient is one rank's share (a replicated tensor used by this rank's heads only), summed over tp in backward."""
    from torch.distributed.tensor import DTensor, Partial

    if not isinstance(t, DTensor):
        return t
    return t.to_local(grad_placements=[Partial()] if partial_grad else None)


def is_tp_sharded(param) -> bool:
    """Whether the parameter is split over tp (each rank holds a different part)."""
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor) and any(p.is_shard() for p in param.placements)


# ---- the plan, one function per block kind -------------------------------------------------------
def _seq():
    from torch.distributed.tensor import Shard

    return Shard(1)


def ffn_plan(prefix: str, ffn, seq_layout) -> dict:
    """A dense MLP whose input (and output) is sequence-sharded as ``seq_layout``: up/gate colwise, down rowwise."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    plan = {prefix: PrepareModuleInput(input_layouts=(seq_layout,), desired_input_layouts=(Replicate(),)),
            f"{prefix}.up": ColwiseParallel(), f"{prefix}.down": RowwiseParallel(output_layouts=seq_layout)}
    if ffn.gate is not None:
        plan[f"{prefix}.gate"] = ColwiseParallel()
    return plan


def attention_plan(prefix: str, attn) -> dict:
    """MHA / GQA / MLA: the block's input gathered (a replicated DTensor), head projections colwise, o rowwise."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    plan = {prefix: PrepareModuleInput(input_layouts=(_seq(),), desired_input_layouts=(Replicate(),)),
            f"{prefix}.o": RowwiseParallel(output_layouts=_seq())}
    heads = ["q", "k", "v"] if not hasattr(attn, "kv_b") else (["q"] if hasattr(attn, "q") else ["q_b"]) + ["kv_b"]
    plan.update({f"{prefix}.{name}": ColwiseParallel() for name in heads})
    return plan


def moe_plan(prefix: str, moe) -> dict:
    """MoE on this rank's sequence shard (rows of x_TD): shared experts gather the rows and split their width."""
    from torch.distributed.tensor import Shard

    plan = {}
    for i, ffn in enumerate(moe.shared):
        plan.update(ffn_plan(f"{prefix}.shared.{i}", ffn, Shard(0)))
    if moe.parallel_dense is not None:
        plan.update(ffn_plan(f"{prefix}.parallel_dense", moe.parallel_dense, Shard(0)))
    return plan


def block_plan(prefix: str, block) -> dict:
    from torch.distributed.tensor.parallel import SequenceParallel

    plan = {f"{prefix}.norm{i}": SequenceParallel(use_local_output=True)
            for i in (1, 2, 3, 4) if getattr(block, f"norm{i}") is not None}
    plan.update(attention_plan(f"{prefix}.attn", block.attn))
    if block.is_moe:
        plan.update(moe_plan(f"{prefix}.mlp", block.mlp))
    else:
        plan.update(ffn_plan(f"{prefix}.mlp", block.mlp, _seq()))
    if block.residual_mlp is not None:
        plan.update(ffn_plan(f"{prefix}.residual_mlp", block.residual_mlp, _seq()))
    return plan


def ends_plan(stage) -> dict:
    """Embedding (first stage), final norm and LM head (last stage)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    plan = {}
    if stage.embed is not None and not stage.is_first:   # the MTP modules' copy on the last stage
        plan["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=_seq())
    if stage.is_first and stage.pos is None:
        plan["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=_seq())
    elif stage.is_first:  # positions are added to the whole sequence, then it is split at the first block
        plan["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        first = next(iter(stage.layers))
        plan[f"layers.{first}"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(_seq(),),
                                                     use_local_output=True)
    if stage.final_norm is not None:
        plan["final_norm"] = SequenceParallel(use_local_output=stage.lm_head is not None)
    if stage.lm_head is not None:
        plan["lm_head"] = ColwiseParallel(input_layouts=_seq(), use_local_output=False)
    return plan


def mtp_plan(prefix: str, module) -> dict:
    """One MTP module (model.MTPModule) on the sequence-sharded residual stream."""
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

    plan = {f"{prefix}.{name}": SequenceParallel(use_local_output=True) for name in ("hnorm", "enorm", "final_norm")}
    plan[f"{prefix}.eh_proj"] = ColwiseParallel(input_layouts=_seq(), output_layouts=_seq())
    plan.update(block_plan(f"{prefix}.block", module.block))
    return plan


def tied_head_style(stage):
    """A tied LM head multiplies by the embedding's vocabulary shard: the final norm's output is gathered into a
    replicated DTensor for it (None where the stage has no tied head)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleOutput

    if stage.lm_head is not None or not stage.is_last:
        return None
    return PrepareModuleOutput(output_layouts=(_seq(),), desired_output_layouts=(Replicate(),),
                               use_local_output=False)


def _replicate_mla_latents(stage, tp_mesh) -> None:
    """MLA's down-projections and their norms: replicated DTensors (they read the gathered sequence)."""
    from torch.distributed.tensor import distribute_module

    for block in stage.blocks().values():
        for name in ("q_a", "q_a_norm", "kv_a", "kv_a_norm"):
            if hasattr(block.attn, name):
                distribute_module(getattr(block.attn, name), tp_mesh)


def _shard_sinks(stage, tp_mesh) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    for block in stage.blocks().values():
        if getattr(block.attn, "sinks", None) is not None:
            block.attn.sinks = torch.nn.Parameter(distribute_tensor(block.attn.sinks.data, tp_mesh, [Shard(0)]))


def parallelize_stage(stage, tp_mesh) -> None:
    """Split one initialised StageModel over the 1-D tp DeviceMesh (in place)."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = ends_plan(stage)
    for idx, block in stage.layers.items():
        plan.update(block_plan(f"layers.{idx}", block))
    for idx, module in stage.mtp.items():
        plan.update(mtp_plan(f"mtp.{idx}", module))
    _replicate_mla_latents(stage, tp_mesh)
    _shard_sinks(stage, tp_mesh)
    parallelize_module(stage, tp_mesh, plan)
    tied = tied_head_style(stage)
    if tied is not None:  # a second style on the final norm, after its SequenceParallel
        parallelize_module(stage.final_norm, tp_mesh, tied)


def parallelize(module, tp_mesh) -> None:
    """Split this rank's module (StageModel or VirtualStages) over tp (in place)."""
    stages = list(module.chunks) if hasattr(module, "chunks") else [module]
    for stage in stages:
        parallelize_stage(stage, tp_mesh)


def tp_summed_params(module) -> list:
    """The replicated parameters whose gradients must be summed over tp (DENSE_TP_SUMMED), found by name (FSDP2
    replaces the parameter objects it shards, never their names)."""
    return [q for n, q in module.named_parameters()
            if ".experts." not in n and any(f".{part}." in f".{n}" for part in DENSE_TP_SUMMED)]


# ---- gradients -------------------------------------------------------------------------------------
def finish_dtensor_grads(module) -> None:
    """Replicated DTensor parameters whose gradient arrives as a partial sum (norm weights, MLA latents,
    row-parallel biases): all-reduced over tp to their replicated value. (The replicated plain parameters that saw
    only this rank's tokens, ``parallelize``'s list, are summed over tp by the trainer.)"""
    from torch.distributed.tensor import DTensor

    for q in module.parameters():
        g = q.grad
        if isinstance(g, DTensor) and tuple(g.placements) != tuple(q.placements):
            q.grad = g.redistribute(q.device_mesh, q.placements)


def loss_context(tp: int):
    """``loss_parallel`` (vocabulary-sharded cross entropy, forward and backward) where tp > 1."""
    if tp == 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
