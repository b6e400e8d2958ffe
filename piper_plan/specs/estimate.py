"""Estimate: the cost model's prediction of one plan, typed (``piper estimate --json`` and plan.json's
``prediction``). Written by ``cost.evaluate.estimate``; validated whenever plan.json is read, so a tampered
prediction is one line naming the field, never a traceback in ``launch`` or ``compare``.

Every number is finite (``allow_inf_nan=False``); byte and second counts are non-negative.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from piper_plan.specs.base import Spec

MAX_FIGURE = 1e30
"""Largest figure a prediction may hold (bytes, seconds, FLOP): beyond it a ratio overflows a float."""
NonNegative = Annotated[float, Field(ge=0, le=MAX_FIGURE, allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0, le=MAX_FIGURE, allow_inf_nan=False)]


class StageMemory(Spec):
    """One pipeline stage of one rank."""

    stage: int = Field(ge=0)
    layers: int = Field(ge=0)
    moe_layers: int = Field(ge=0)
    total_bytes: NonNegative
    """Peak bytes of the stage's rank, fragmentation and framework overhead included."""
    components: dict[str, NonNegative]
    """Bytes by component (weights, gradients, optimizer, activations/..., fragmentation, framework)."""
    time_per_microbatch_s: NonNegative
    """Forward + backward seconds of one micro-batch on this stage (its p2p included)."""


class MemoryEstimate(Spec):
    peak_bytes: NonNegative
    device_bytes: Positive
    overflow_bytes: NonNegative
    per_stage: list[StageMemory]


class TimeEstimate(Spec):
    breakdown: dict[str, NonNegative]
    """Seconds per step by component (bottleneck stage); they sum to the step time."""


class TrainingTotals(Spec):
    steps: NonNegative
    time_to_train_s: NonNegative
    node_hours: NonNegative


class CheckpointSize(Spec):
    total_bytes: NonNegative
    bytes_per_param: NonNegative
    per_rank_bytes: NonNegative


class Sources(Spec):
    """Where the figures came from."""

    compute: str
    host: str = "not recorded (a plan file written before piper named it)"
    """How the host's work per GEMM call is priced, or that it is not (cost/evaluate.py host_source)."""
    extrapolated: bool
    collectives_calibrated: list[str]
    collectives_fallback: str
    a2a_algorithm: str
    a2a: str


class OtherPlacement(Spec):
    """The same plan on the other allocation shape, when its step time differs."""

    placement: str
    step_time_s: Positive
    tokens_per_s: Positive
    scopes: dict[str, str]


FLOPS_CONVENTIONS = {
    "mfu, hfu, tflops_per_device": "PaLM (Chowdhery et al. 2022, appendix B): 6 N (the LM head in N, tied or not) + "
                                   "12 L H Q T per token, attention non-causal, no MTP layer",
    "mfu_megatron, hfu_megatron": "Megatron (Megatron-LM num_floating_point_operations, as NVIDIA's published TFLOPS): "
                                  "the same GEMMs, attention causal, MTP layers counted",
}
"""The FLOP conventions of the utilisation figures, named in every estimate and plan JSON (cost/flops.py)."""

MAX_STEP_S = 1e9
"""The longest step a prediction may report: no training step runs for 30 years."""


class Estimate(Spec):
    """One plan's prediction."""

    step_time_s: Annotated[float, Field(gt=0, le=MAX_STEP_S, allow_inf_nan=False)]
    """Seconds per optimizer step (at most MAX_STEP_S)."""
    tokens_per_s: Positive
    tflops_per_device: NonNegative
    mfu: NonNegative
    """Model FLOPs utilisation, PaLM convention (attention non-causal; cost/flops.py)."""
    hfu: NonNegative
    """Hardware FLOPs utilisation, PaLM convention: MFU's FLOPs plus what recomputation repeats (>= mfu)."""
    mfu_megatron: NonNegative | None = None
    """MFU in the convention of NVIDIA's published TFLOPS (causal attention, MTP counted; None in older plan files)."""
    hfu_megatron: NonNegative | None = None
    """HFU in the megatron convention (>= mfu_megatron)."""
    flops_conventions: dict[str, str] = {}
    """Which FLOP-counting convention each utilisation figure uses (FLOPS_CONVENTIONS)."""
    a2a_share: NonNegative
    fits: bool
    memory: MemoryEstimate
    time: TimeEstimate
    training: TrainingTotals
    checkpoint: CheckpointSize
    model_flops_per_token: NonNegative
    scopes: dict[str, str]
    """Network scope each parallel group spans (tp, ep, etp, dp, edp, pp)."""
    placement: str
    nodes: int = Field(ge=1)
    layers_per_stage: list[int] = []
    """The layer split the plan was priced with (empty in plan.json files of schema 1)."""
    sources: Sources
    options: dict[str, bool | int | float | None | list[str] | str]
    """The CostOptions in force (None: an option left to its default rule, e.g. loss_chunk_rows)."""
    other_placement: OtherPlacement | None = None

    def to_json(self) -> dict:
        return self.model_dump(mode="json", exclude_none=True)
