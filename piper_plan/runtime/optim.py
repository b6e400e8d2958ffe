"""The optimizer side of a step: learning-rate schedule, weight-decay groups, global gradient clipping, and one
optimizer per gradient group (dense over dp, experts over edp; ZeRO-1 shards each over its group).

ZeRO-1 with tensor parallelism: torch's ZeroRedundancyOptimizer partitions, steps and broadcasts plain tensors
only, so it is given, for each DTensor parameter (tp-split or tp-replicated), a leaf ``nn.Parameter`` over the
parameter's local tensor (:func:`shard_leaf`, the same storage: its update is the DTensor's), whose ``.grad`` is
set to the local gradient before each step. Every tp index has its own dp / edp group (mesh.py), and every tp rank
holds local shards of the same shapes, so each group's ZeRO partitions its tp index's shards the same way and
shard i of a parameter has its optimizer state on the same dp index for every tp index. Gradient clipping and the
global norm read the DTensor gradients as without ZeRO. Checkpoints: ``dtensor_of`` lets runtime/checkpoint.py
save that state under the parameter's name and tp layout.

Settings: plan.json's ``runtime`` block (planfile.RuntimeBlock: lr, lr_schedule, warmup_steps, min_lr_ratio,
weight_decay, grad_clip_norm). Fused AdamW on GPUs.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def lr_at(step: int, total_steps: int, rt) -> float:
    """Learning rate of optimizer step ``step`` (0-based) of ``total_steps``: linear warmup over
    ``warmup_steps``, then cosine decay to ``min_lr_ratio x lr`` at the last step (or constant)."""
    if step < rt.warmup_steps:
        return rt.lr * (step + 1) / (rt.warmup_steps + 1)
    if rt.lr_schedule == "constant":
        return rt.lr
    span = max(total_steps - 1 - rt.warmup_steps, 1)
    progress = min((step - rt.warmup_steps) / span, 1.0)
    floor = rt.min_lr_ratio * rt.lr
    return floor + (rt.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def adamw_options(device) -> dict:
    """The runtime's AdamW settings on ``device`` beyond lr and weight decay: fused on GPUs (the calibration's
    optimizer rows time the same, calibration/bench_memory.py and bench_overhead.py)."""
    return {"fused": True} if device.type == "cuda" else {}


def decays(name: str, param: torch.Tensor) -> bool:
    """Weight decay on matrices only: not on norms, biases (``bias``, the experts' ``b_*``) or 1-D parameters."""
    leaf = name.rsplit(".", 1)[-1]
    return param.dim() >= 2 and leaf != "bias" and not leaf.startswith("b_")


def param_groups(named: list[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict]:
    """Two torch parameter groups (decayed, not decayed); empty groups left out."""
    on = [p for n, p in named if decays(n, p)]
    off = [p for n, p in named if not decays(n, p)]
    return [g for g in ({"params": on, "weight_decay": weight_decay}, {"params": off, "weight_decay": 0.0})
            if g["params"]]


def shard_leaf(param: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's local tensor as a leaf ``nn.Parameter`` over the same storage (what
    ZeroRedundancyOptimizer can step and broadcast); any other parameter itself."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param
    return torch.nn.Parameter(param.detach().to_local(), requires_grad=param.requires_grad)


class Optimizers:
    """One optimizer per gradient group; ZeRO-1 (ZeroRedundancyOptimizer) shards each over its group.
    ``dtensor_of[i]``: {leaf: DTensor parameter} of optimizer i's local-shard leaves (empty without ZeRO or tp)."""

    def __init__(self, groups: list[tuple[list, object, int]], training, rt, device, zero: int) -> None:
        """groups: (named parameters, process group, group size) per gradient group; zero: the plan's stage."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if training.optimizer == "adam":
            cls, kw = torch.optim.AdamW, adamw_options(device)
        else:
            cls, kw = torch.optim.SGD, {}
        self.optims, self.dtensor_of = [], []
        for named, group, size in groups:
            pgroups = param_groups(named, rt.weight_decay_for(training.optimizer))
            if not pgroups:
                continue
            leaves = {}
            if zero == 1 and size > 1:                # zero 2/3: FSDP2 shards the state (runtime/sharding.py)
                for g in pgroups:
                    params, g["params"] = g["params"], [shard_leaf(q) for q in g["params"]]
                    leaves.update({leaf: q for leaf, q in zip(g["params"], params) if leaf is not q})
                self.optims.append(ZeroRedundancyOptimizer(pgroups[0]["params"], optimizer_class=cls,
                                                           process_group=group, lr=rt.lr,
                                                           weight_decay=pgroups[0]["weight_decay"], **kw))
                for g in pgroups[1:]:
                    self.optims[-1].add_param_group(g)
            else:
                self.optims.append(cls(pgroups, lr=rt.lr, **kw))
            self.dtensor_of.append(leaves)

    def _inner(self):
        return [getattr(o, "optim", o) for o in self.optims]

    def set_lr(self, lr: float) -> None:
        for o in self.optims:
            for g in o.param_groups:
                g["lr"] = lr

    def step(self) -> None:
        """Each optimizer's step; a local-shard leaf first gets its DTensor parameter's local gradient."""
        from piper_plan.runtime.sharding import local

        for o, leaves in zip(self.optims, self.dtensor_of):
            for leaf, q in leaves.items():
                leaf.grad = None if q.grad is None else local(q.grad)
            o.step()

    def state_dict(self) -> list:
        return [o.state_dict() for o in self._inner()]

    def load_state_dict(self, states: list) -> None:
        for o, s in zip(self._inner(), states):
            o.load_state_dict(s)

    def state_bytes(self) -> int:
        from piper_plan.runtime.accounting import optimizer_state_bytes

        return sum(optimizer_state_bytes(o) for o in self._inner())


def global_grad_norm(dense: list, expert: list, dp: int, edp: int, device, tp: int = 1) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, the same on every rank (one all-reduce of a scalar).

    Each rank adds the square of its local gradient values divided by how many ranks hold the same values
    (``_copies``), so the sum over the world counts every parameter once: dense gradients live on the stage's
    dp x tp ranks, expert gradients on the edp ranks of an expert; a DTensor (tensor parallelism's on the tp mesh,
    FSDP2's on the dp / edp mesh, or both) holds distinct values along its sharded mesh dimensions only."""
    from piper_plan.runtime.tensor_parallel import local_tensor

    def part(params, group: int):
        by_copies: dict[int, list] = {}
        for q in params:
            if q.grad is not None:
                by_copies.setdefault(_copies(q.grad, group), []).append(local_tensor(q.grad))
        total = torch.zeros((), device=device, dtype=torch.float32)
        for copies, grads in sorted(by_copies.items()):
            total = total + torch.nn.utils.get_total_norm(grads).float().square() / copies
        return total

    sq = part(dense, dp * tp) + part(expert, edp)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sq)
    return sq.sqrt()


def _copies(grad, group: int) -> int:
    """Ranks of a gradient's group (``group`` ranks hold the parameter) that hold this rank's local values: the
    group over the DTensor mesh's ranks, times the mesh's replicated dimensions (any other placement shards,
    FSDP2's _StridedShard over a tp split included); a plain tensor: the group."""
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor):
        return group
    mesh = grad.device_mesh
    replicated = math.prod(mesh.size(i) for i, p in enumerate(grad.placements) if p.is_replicate() or p.is_partial())
    return group // mesh.size() * replicated


def clip_grads(params: list, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / (total_norm + 1e-6)) (torch's clip_grads_with_norm_ formula, on
    the device: no host read); a sharded gradient (DTensor) through its local shard."""
    from piper_plan.runtime.sharding import local

    grads = [local(q.grad) for q in params if q.grad is not None]
    if grads:
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].device))
