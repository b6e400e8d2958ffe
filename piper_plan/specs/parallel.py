"""ParallelPlan: how one training run is split over ranks (vocabulary in DESIGN.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import PositiveInt, model_validator

from piper_plan.errors import PiperError
from piper_plan.specs.base import Spec

Schedule = Literal["gpipe", "1f1b", "interleaved"]
Recompute = Literal["none", "selective", "full"]
A2A = Literal["flat", "halo"]


class ParallelPlan(Spec):
    """Degrees and schedule. world = pp x dp x tp; experts regroup a stage's dp x tp ranks as ep x etp x edp."""

    dp: PositiveInt = 1
    """Data-parallel degree of the dense weights."""
    tp: PositiveInt = 1
    """Tensor-parallel degree (inside a node)."""
    pp: PositiveInt = 1
    """Pipeline stages."""
    ep: PositiveInt = 1
    """Expert-parallel degree: ranks that split one MoE layer's experts."""
    etp: PositiveInt = 1
    """Tensor-parallel degree inside an expert."""
    mbs: PositiveInt = 1
    """Micro-batch size, sequences."""
    num_microbatches: PositiveInt = 1
    """Micro-batches per step per pipeline = global_batch / (dp x mbs)."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule."""
    virtual_stages: PositiveInt = 1
    """Model chunks per rank for the interleaved schedule (1 otherwise)."""
    recompute: Recompute = "none"
    """Activation recomputation."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: norms and dropout split over tp (needs tp > 1 to matter)."""
    zero: Literal[0, 1] = 0
    """ZeRO stage: 1 shards optimizer state over dp (dense) and edp (experts)."""
    a2a: A2A = "flat"
    """Expert all-to-all algorithm."""
    layers_per_stage: list[PositiveInt] | None = None
    """Layers of each pipeline stage (None = as even as possible)."""

    @model_validator(mode="after")
    def _check(self) -> "ParallelPlan":
        if (self.dp * self.tp) % (self.ep * self.etp):
            raise ValueError(f"ep x etp = {self.ep} x {self.etp} must divide dp x tp = {self.dp} x {self.tp}")
        if self.layers_per_stage is not None and len(self.layers_per_stage) != self.pp:
            raise ValueError(f"layers_per_stage has {len(self.layers_per_stage)} entries, pp={self.pp}")
        if self.schedule != "interleaved" and self.virtual_stages != 1:
            raise ValueError(f"virtual_stages={self.virtual_stages} needs schedule=interleaved, got {self.schedule}")
        return self

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (expert gradients are reduced over them)."""
        return self.dp * self.tp // (self.ep * self.etp)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers per stage: the explicit list, else an even split with the remainder on the last stages."""
        if self.layers_per_stage is not None:
            return list(self.layers_per_stage)
        return even_split(num_layers, self.pp)

    def degrees(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "ep": self.ep, "etp": self.etp, "edp": self.edp}


def even_split(num_layers: int, pp: int) -> list[int]:
    """Split ``num_layers`` over ``pp`` stages as evenly as possible; extra layers go to the later stages
    (stage 0 holds the embedding and the most micro-batches in flight under 1F1B)."""
    base, extra = divmod(num_layers, pp)
    return [base + (1 if i >= pp - extra else 0) for i in range(pp)]


def check_plan(plan: ParallelPlan, model, training, world: int) -> None:
    """Check a plan against a model, a training spec and an allocation; raise PiperError naming every value."""
    errors = []
    if plan.world != world:
        errors.append(f"pp x dp x tp = {plan.pp} x {plan.dp} x {plan.tp} = {plan.world} must equal "
                      f"the world size {world}")
    if plan.pp > model.num_layers:
        errors.append(f"pp={plan.pp} must be <= num_layers={model.num_layers}")
    heads, kv = model.attention.num_heads, model.attention.kv_heads
    if heads % plan.tp or kv % plan.tp:
        errors.append(f"tp={plan.tp} must divide num_heads={heads} and num_kv_heads={kv}")
    if model.moe is not None and model.moe.num_experts % plan.ep:
        errors.append(f"ep={plan.ep} must divide num_experts={model.moe.num_experts}")
    if model.moe is None and plan.ep * plan.etp > 1:
        errors.append(f"ep={plan.ep}, etp={plan.etp}: {model.name} is dense (no experts); use ep=1, etp=1")
    if training.global_batch % (plan.dp * plan.mbs):
        errors.append(f"global_batch={training.global_batch} must be divisible by dp x mbs = {plan.dp} x {plan.mbs}")
    elif plan.num_microbatches != training.global_batch // (plan.dp * plan.mbs):
        errors.append(f"num_microbatches={plan.num_microbatches} must equal global_batch / (dp x mbs) = "
                      f"{training.global_batch} / ({plan.dp} x {plan.mbs})")
    if plan.layers_per_stage is not None and sum(plan.layers_per_stage) != model.num_layers:
        errors.append(f"layers_per_stage {plan.layers_per_stage} sums to {sum(plan.layers_per_stage)}, "
                      f"num_layers={model.num_layers}")
    if plan.schedule == "interleaved" and plan.num_microbatches % plan.pp:
        errors.append(f"schedule=interleaved needs num_microbatches={plan.num_microbatches} divisible by pp={plan.pp}")
    if errors:
        raise PiperError("; ".join(errors), field="parallel")
