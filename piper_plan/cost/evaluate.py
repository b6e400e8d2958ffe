"""The resource model's entry points, both on the one pricing pipeline (cost/batch.py):

- ``evaluate``: a PlanBatch in, an ``Evaluation`` of arrays out (the search's hot path);
- ``estimate``: one plan as a batch of one through the same pipeline, plus the detailed per-stage breakdown:
  the typed ``Estimate`` that ``piper estimate --json`` prints and plan.json's ``prediction`` holds.

Pure numpy: the only Python loops run over distinct pipeline depths and over breakdown components.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from piper_plan.cost import stage as stg
from piper_plan.cost.batch import evaluate_batch, quiet_overflow, stage_detail
from piper_plan.cost.memory import moe_saved_rows
from piper_plan.cost.flops import CONVENTIONS, model_flops_per_token, recompute_flops_per_token
from piper_plan.cost.options import DEFAULT_OPTIONS, CostOptions
from piper_plan.cost.pipeline import layers_per_stage_of
from piper_plan.cost.step import checkpoint_bytes, training_totals
from piper_plan.cost.terms import spans
from piper_plan.errors import PiperError
from piper_plan.placement.layout import allocation
from piper_plan.plans import PlanBatch
from piper_plan.specs.estimate import FLOPS_CONVENTIONS, Estimate
from piper_plan.specs.parallel import ParallelPlan
from piper_plan.specs.platform import SCOPES
from piper_plan.specs.vocab import A2A_TIME_PREFIX


@dataclass(frozen=True)
class Evaluation:
    """Arrays of length N."""

    step_time_s: np.ndarray
    tokens_per_s: np.ndarray
    tflops_per_device: np.ndarray
    mfu: np.ndarray
    """PaLM convention (cost/flops.py)."""
    hfu: np.ndarray
    peak_memory_bytes: np.ndarray
    a2a_share: np.ndarray
    fits: np.ndarray
    breakdown: dict[str, np.ndarray]
    layers_split: np.ndarray
    """Split slot each plan was priced with: 0 even (or its explicit list), 1 FLOP-balanced."""
    memory: dict[str, np.ndarray] = field(default_factory=dict)
    """Bytes of the peak-memory stage: "total", and by component with memory_detail."""
    mfu_megatron: np.ndarray | None = None
    """MFU in the megatron convention (causal attention, MTP counted: NVIDIA's published TFLOPS)."""
    hfu_megatron: np.ndarray | None = None

    @classmethod
    def empty(cls) -> Evaluation:
        """The evaluation of no plans (a search whose space holds no valid candidate)."""
        none = np.zeros(0)
        return cls(step_time_s=none, tokens_per_s=none, tflops_per_device=none, mfu=none, hfu=none,
                   peak_memory_bytes=none, a2a_share=none, fits=np.zeros(0, bool), breakdown={},
                   layers_split=np.zeros(0, np.int64), mfu_megatron=none, hfu_megatron=none)


@quiet_overflow
def evaluate(model, platform, training, nodes: int, plans: PlanBatch, calibration=None, placement="compact",
             options: CostOptions = DEFAULT_OPTIONS, memory_detail: bool = False) -> Evaluation:
    """Predict step time, throughput and peak memory of every plan (arrays of length N), each with the layer
    split its ``layers_split`` asks for (auto: the one that fits, then the faster).

    Plans are assumed valid (``plans.problems``; the search filters first); no plans, an empty evaluation."""
    ctx = stg.make_context(model, platform, training, options, calibration)
    if not len(plans):
        return Evaluation.empty()
    breakdown, step, memory, split = evaluate_batch(ctx, allocation(platform, nodes, placement), plans,
                                                    memory_detail=memory_detail)
    return _summary(ctx, plans, breakdown, step, memory, split)


def plan_of(model, training, plans: PlanBatch, evaluation: Evaluation, i: int) -> ParallelPlan:
    """Plan i as the ParallelPlan it was priced as: its layer split resolved into an explicit list."""
    return plans.plan(i, layers_per_stage=resolved_layers(model, training, plans, evaluation.layers_split, i))


def resolved_layers(model, training, plans: PlanBatch, split, i: int) -> list[int]:
    """The layers per stage plan i was priced with."""
    if plans.explicit_layers is not None:
        return list(plans.explicit_layers[i])
    return layers_per_stage_of(model, training.seq_len, int(plans.pp[i]), int(split[i]),
                               int(plans.virtual_stages[i]))


def _summary(ctx, c: PlanBatch, breakdown, step, peak_mem, split) -> Evaluation:
    t = ctx.training
    world = c.world
    peak = ctx.platform.peak_flops(t.dtype)
    tokens_per_step = c.num_microbatches * c.mbs * c.dp * t.seq_len    # the work the step does (= gbs x s)
    rate = 1.0 / (step * world * peak)
    util = {}
    for convention in CONVENTIONS:
        model_flops = model_flops_per_token(ctx.model, t.seq_len, convention) * tokens_per_step
        redone = recompute_flops_per_token(ctx.model, t.seq_len, ctx.lf, c.recompute, t.flash_attention,
                                           convention, ctx.opts.recompute_modules) * tokens_per_step
        util[convention] = (model_flops * rate, (model_flops + redone) * rate)
    a2a = sum((v for k, v in breakdown.items() if k.startswith(A2A_TIME_PREFIX)), np.zeros(len(c)))
    return Evaluation(
        step_time_s=step,
        tokens_per_s=tokens_per_step / step,
        tflops_per_device=util["palm"][0] * peak / 1e12,
        mfu=util["palm"][0],
        hfu=util["palm"][1],
        mfu_megatron=util["megatron"][0],
        hfu_megatron=util["megatron"][1],
        peak_memory_bytes=peak_mem["total"],
        a2a_share=a2a / step,
        fits=peak_mem["total"] <= ctx.platform.device.memory_bytes,
        breakdown=breakdown,
        layers_split=split,
        memory=peak_mem,
    )


@quiet_overflow
def estimate(model, platform, training, nodes, plan: ParallelPlan, calibration=None, placement="compact",
             options: CostOptions = DEFAULT_OPTIONS) -> Estimate:
    """One plan in full detail: ``evaluate`` of it as a batch of one (the same numbers ``piper plan`` ranks it
    by), then every stage's memory and time, time and node-hours to train, checkpoint size, data sources."""
    ctx = stg.make_context(model, platform, training, options, calibration)
    c = PlanBatch.of(plan)
    alloc = allocation(platform, nodes, placement)
    breakdown, step, memory, split = evaluate_batch(ctx, alloc, c, memory_detail=True)
    ev = _summary(ctx, c, breakdown, step, memory, split)
    layers = resolved_layers(model, training, c, split, 0)
    st, stage_memory, stage_times = stage_detail(ctx, alloc, c, layers)
    per_stage = [{"stage": i, "layers": int(st.layers[i, 0]), "moe_layers": int(st.moe_layers[i, 0]),
                  "total_bytes": float(stage_memory["total"][i, 0]),
                  "components": {k: float(v[i, 0]) for k, v in stage_memory.items() if k != "total"},
                  "time_per_microbatch_s": float(sum(v[i, 0] for v in stage_times.values()))}
                 for i in range(plan.pp)]
    saved_per_rank = float(np.max(stg.stage_saved_state(ctx, c, st)))
    return _estimate(ctx, plan, c, nodes, placement, alloc, ev, per_stage, layers, saved_per_rank)


def pricing_sources(platform, training, calibration=None, opts=None) -> dict[str, str]:
    """Where a search's or an estimate's compute rates and host time come from (Estimate.sources' two lines)."""
    from piper_plan.cost.compute import Rates

    rates = Rates(platform, training.dtype, calibration, training.fp8_recipe)
    return {"compute": rates.source, "host": host_source(platform, calibration, opts)}


def host_source(platform, calibration=None, opts=None) -> str:
    """How the host's work is priced: piper's runtime's overhead measured into the calibration (overhead.csv, where
    cost/overhead.py priced_overhead takes it: on a GPU a floor under the step, cost/batch.py host_floor; on a CPU
    added to the compute), else per GEMM call (cost/overhead.py host_floor_terms), or that it is not."""
    from piper_plan.calibration.curves import shown_path
    from piper_plan.cost.options import CostOptions
    from piper_plan.cost.overhead import priced_overhead

    if priced_overhead(calibration, platform, opts or CostOptions()) is not None:    # it alone (cost/terms.py)
        how = "added to the compute" if platform.launch.device == "cpu" else "the step waits for the longer of host " \
            "and device"
        return f"the runtime's overhead measured in {shown_path(calibration.directory / 'overhead.csv')} ({how})"
    per_call_s = platform.efficiency.host_s_per_gemm_call
    if per_call_s > 0:
        return f"{per_call_s * 1e6:.1f} us per GEMM call (efficiency.host_s_per_gemm_call)"
    return f"not priced: {platform.name} has no efficiency.host_s_per_gemm_call (host work assumed hidden)"


HOST_DOMINATES = 0.5
"""Share of a step above which host time, not the devices, sets it (host_warning)."""


def host_warning(platform, host_s: float, step_s: float, subject: str = "this step",
                 framework_s: float = 0.0) -> str | None:
    """A line when host time is most of a step: priced per GEMM call (``host_s``, cost/overhead.py
    host_floor_terms), the figure rests on one per-call constant (host_source), which a plan with many more GEMM
    calls per step (local experts, layers, micro-batches) than the run it came from extrapolates; measured
    (``framework_s``, the runtime's overhead.csv on a GPU: cost/batch.py host_floor), it rests on the host that
    measured it, which moved by 40% between two leases of one H200 (docs/gpu-check.md). None otherwise."""
    if step_s <= 0:
        return None
    if host_s / step_s >= HOST_DOMINATES:
        return (f"warning: host time is {host_s / step_s:.0%} of {subject}, priced at {host_source(platform)}, "
                f"whose origin {platform.name}'s efficiency.source gives: the step rests on that one constant; fewer "
                "GEMM calls per step (fewer local experts, more tokens per micro-batch) or CUDA graphs shrink it")
    if framework_s / step_s >= HOST_DOMINATES:
        return (f"warning: {subject} waits on its host for {framework_s / step_s:.0%} of it (host/framework: the "
                "runtime's host overhead measured in the calibration's overhead.csv): the figure is that host's, "
                "which moves with the machine and its load; measure it where the job runs (`piper calibrate "
                "overhead`), or give each micro-batch more tokens")
    return None


def _estimate(ctx, plan, c: PlanBatch, nodes, placement, alloc, ev: Evaluation, per_stage, layers,
              saved_per_rank: float) -> Estimate:
    device_bytes = ctx.platform.device.memory_bytes
    peak = float(ev.peak_memory_bytes[0])
    group_spans = spans(alloc, c)
    totals = training_totals(ctx.training, float(ev.step_time_s[0]), nodes)
    return _validated_estimate({
        "step_time_s": float(ev.step_time_s[0]),
        "tokens_per_s": float(ev.tokens_per_s[0]),
        "tflops_per_device": float(ev.tflops_per_device[0]),
        "mfu": float(ev.mfu[0]),
        "hfu": float(ev.hfu[0]),
        "mfu_megatron": float(ev.mfu_megatron[0]),
        "hfu_megatron": float(ev.hfu_megatron[0]),
        "flops_conventions": FLOPS_CONVENTIONS,
        "a2a_share": float(ev.a2a_share[0]),
        "fits": bool(ev.fits[0]),
        "memory": {"peak_bytes": peak, "device_bytes": device_bytes, "overflow_bytes": max(peak - device_bytes, 0.0),
                   "per_stage": per_stage},
        "time": {"breakdown": {k: float(v[0]) for k, v in ev.breakdown.items()}},
        "training": {k: float(v) for k, v in totals.items()},
        "checkpoint": {**checkpoint_bytes(ctx.model, ctx.training, plan.zero, ctx.opts.unfused_kernels),
                       "per_rank_bytes": saved_per_rank},
        "model_flops_per_token": model_flops_per_token(ctx.model, ctx.training.seq_len),
        "scopes": {k: SCOPES[int(v[0][0])] for k, v in group_spans.items()},
        "placement": placement,
        "nodes": nodes,
        "layers_per_stage": layers,
        "sources": {"compute": ctx.rates.source, "host": host_source(ctx.platform, ctx.rates.calibration, ctx.opts),
                    "extrapolated": bool(ctx.rates.extrapolated or ctx.net.extrapolated),
                    "collectives_calibrated": sorted(ctx.net.calibrated_ops),
                    "collectives_fallback": "alpha-beta from platform network.scopes",
                    "a2a_algorithm": plan.a2a.value,
                    "a2a": ctx.net.a2a_source(plan.a2a, plan.ep, int(group_spans["ep"][1][0]),
                                              int(group_spans["ep"][0][0]))},
        "options": {**{f.name: getattr(ctx.opts, f.name) for f in fields(ctx.opts)},
                    "moe_saved_rows": moe_saved_rows(ctx.opts)},   # the count in force (None resolved)
    })


def _validated_estimate(values: dict) -> Estimate:
    """``values`` as an Estimate; a figure outside what an estimate can hold (inputs valid one by one whose
    combination is no trainable job: a routing skew of 1e100, a peak of 1 MFLOP/s) is one PiperError line."""
    from pydantic import ValidationError

    try:
        return Estimate.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise PiperError(f"the prediction's {where} is {first.get('input')!r}, outside what piper reports "
                         f"({first['msg'].lower()}): the model, platform, training and plan are each valid, but "
                         "together they make no trainable job; check their sizes and rates") from None
