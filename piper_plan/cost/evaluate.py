"""The resource model's entry points: ``evaluate`` (vectorised over candidate plans; the hot path is
cost/batch.py) and ``estimate`` (one plan, every stage walked, full detail: the object ``piper estimate --json``
prints and plan.json's ``prediction``). Both price the same formulas; tests hold them equal.

Pure numpy: a ``Candidates`` struct of arrays goes in, an ``Evaluation`` of arrays comes out; the only
Python loops run over distinct pipeline depths and over breakdown components.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import get_args

import numpy as np

from piper_plan.cost import stage as stg
from piper_plan.cost.flops import model_flops_per_token
from piper_plan.cost.options import DEFAULT_OPTIONS, CostOptions
from piper_plan.cost.params import moe_prefix, rank_stage_params
from piper_plan.cost.memory import in_flight
from piper_plan.cost.batch import evaluate_batch
from piper_plan.cost.pipeline import bubble_microbatches, stage_layers
from piper_plan.cost.step import (checkpoint_bytes, dp_sync_seconds, hardware_flops_per_token, optimizer_seconds,
                                  training_totals)
from piper_plan.placement.layout import allocation, span_arrays, stage_pair_scope
from piper_plan.specs.parallel import A2A as A2AKind
from piper_plan.specs.parallel import ParallelPlan, Recompute, Schedule

SCHEDULES: tuple[str, ...] = get_args(Schedule)   # the ParallelPlan field types, in their order: codes index them
RECOMPUTE: tuple[str, ...] = get_args(Recompute)
A2A: tuple[str, ...] = get_args(A2AKind)
_CODES = {"schedule": SCHEDULES, "recompute": RECOMPUTE, "a2a": A2A}


@dataclass(frozen=True)
class Candidates:
    """Struct of arrays: every field an int64 array of the same length N; codes index the tuples above."""

    dp: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    ep: np.ndarray
    etp: np.ndarray
    mbs: np.ndarray
    num_microbatches: np.ndarray
    schedule: np.ndarray
    virtual_stages: np.ndarray
    recompute: np.ndarray
    zero: np.ndarray
    a2a: np.ndarray

    def __post_init__(self):
        arrays = np.broadcast_arrays(*(np.atleast_1d(np.asarray(getattr(self, f.name), np.int64))
                                       for f in fields(self)))
        for f, a in zip(fields(self), arrays):
            object.__setattr__(self, f.name, np.ascontiguousarray(a))
        object.__setattr__(self, "_edp", self.dp * self.tp // (self.ep * self.etp))

    def __len__(self) -> int:
        return len(self.dp)

    @property
    def edp(self) -> np.ndarray:
        """Ranks holding the same experts: dp x tp / (ep x etp)."""
        return self._edp

    @property
    def world(self) -> np.ndarray:
        return self.pp * self.dp * self.tp

    @classmethod
    def from_plan(cls, plan: ParallelPlan) -> "Candidates":
        """N = 1."""
        values = {f.name: getattr(plan, f.name) for f in fields(cls)}
        for name, codes in _CODES.items():
            values[name] = codes.index(values[name])
        return cls(**values)

    def plan(self, i: int, layers_per_stage=None) -> ParallelPlan:
        """Candidate i as a ParallelPlan."""
        values = {f.name: int(getattr(self, f.name)[i]) for f in fields(self)}
        for name, codes in _CODES.items():
            values[name] = codes[values[name]]
        return ParallelPlan(**values, layers_per_stage=layers_per_stage)

    def take(self, index) -> "Candidates":
        """A subset (boolean mask or indices)."""
        return Candidates(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


@dataclass(frozen=True)
class Evaluation:
    """Arrays of length N."""

    step_time_s: np.ndarray
    tokens_per_s: np.ndarray
    tflops_per_device: np.ndarray
    mfu: np.ndarray
    hfu: np.ndarray
    peak_memory_bytes: np.ndarray
    a2a_share: np.ndarray
    fits: np.ndarray
    breakdown: dict[str, np.ndarray]
    memory: dict[str, np.ndarray] = field(default_factory=dict)
    """Bytes of the peak-memory stage: "total", and by component (estimate's names) with memory_detail."""
    layers_split: np.ndarray | None = None
    """Layer split each candidate was priced with: 0 even, 1 FLOP-balanced (pipeline.layers_per_stage_of)."""


def _spans(alloc, c: Candidates) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(scope index, nodes spanned) of each parallel group kind, per candidate."""
    out = {}
    for name, stride, count in (("tp", 1, c.tp), ("ep", c.etp, c.ep), ("etp", 1, c.etp), ("dp", c.tp, c.dp),
                                ("edp", c.ep * c.etp, c.edp)):
        scope, nodes, _ = span_arrays(alloc, stride, count)
        out[name] = (scope, nodes)
    out["pp"] = (stage_pair_scope(alloc, c.dp * c.tp), None)
    return out


def _time_terms(ctx, c: Candidates, spans, acts) -> tuple[dict, dict]:
    """Seconds per micro-batch by breakdown name: per-layer coefficients {name: (per dense layer, per MoE
    layer)} and per-stage terms {name: (value, applies-to)} with applies-to "last" or "all" (arrays [N])."""
    o = ctx.opts
    comp = stg.layer_compute_seconds(ctx, c)
    comm = stg.layer_comm_seconds(ctx, c, spans)
    zero = np.zeros(len(c))
    fb = lambda name: comp[name][0] + comp[name][1] if name in comp else zero   # noqa: E731
    fwd = lambda name: comp[name][0] if name in comp else zero                  # noqa: E731
    dense_b, moe_b = stg.elementwise_bytes_per_layer(ctx, c, acts)
    elem_d, elem_m = ctx.rates.memory_seconds(dense_b), ctx.rates.memory_seconds(moe_b)
    attn = fb("attention") + fb("attention_core")
    full = c.recompute == stg.FULL
    # selective recompute re-runs the attention core: its GEMMs and its softmax / mask / dropout kernels, which
    # write and read the s^2 tensors once more (the same elementwise rule as elementwise_bytes_per_layer)
    core_elem = ctx.rates.memory_seconds(2 * acts["attention_core"])
    sel = zero if ctx.training.flash_attention else \
        np.where(c.recompute == stg.SELECTIVE, fwd("attention_core") + core_elem, 0.0)
    attn_fwd = fwd("attention") + fwd("attention_core")
    rec_d = np.where(full, attn_fwd + fwd("mlp") + elem_d, sel)
    rec_m = np.where(full, attn_fwd + fwd("router") + fwd("experts") + fwd("shared_experts") + elem_m, sel)
    passes = 2 + full                                         # forward, backward, + recompute forward
    tp = comm["tp"] * passes * (1 - o.tp_overlap)
    per_layer = {
        "compute/attention": (attn, attn), "compute/mlp": (fb("mlp"), zero),
        "compute/router": (zero, fb("router")), "compute/experts": (zero, fb("experts")),
        "compute/shared_experts": (zero, fb("shared_experts")),
        "compute/elementwise": (3 * elem_d, 3 * elem_m), "compute/recompute": (rec_d, rec_m),
        "comm/tp": (tp, tp),
    }
    if "a2a_intra" in comm:
        per_layer["comm/etp"] = (zero, comm["etp"] * passes * (1 - o.tp_overlap))
        for part in ("dispatch", "combine"):
            for where, key in (("intra_node", "a2a_intra"), ("inter_node", "a2a_inter")):
                per_layer[f"moe/{part}/{where}"] = (zero, comm[key] / 2 * passes * (1 - o.a2a_overlap))
    head_f, head_b = stg._gemm(ctx, c.mbs * ctx.training.seq_len, (ctx.model.vocab_size or 0) / c.tp,
                               ctx.model.hidden_size)
    per_layer["compute/lm_head"] = (head_f + head_b, zero)       # per stage, not per layer: see _key_terms
    overhead = getattr(ctx.rates.calibration, "overhead", None)
    if overhead is not None:                                     # measured framework overhead (cost/overhead.py)
        from piper_plan.cost.overhead import overhead_terms

        extra, head_s, scale = overhead_terms(ctx, c, spans, overhead)
        per_layer = {k: ((d * scale, m * scale) if k.startswith("compute/") else (d, m))
                     for k, (d, m) in per_layer.items()}
        per_layer.update(extra)
        per_layer["compute/lm_head"] = (per_layer["compute/lm_head"][0] + head_s, zero)
    return per_layer


def _layer_terms(ctx, alloc, c: Candidates):
    """Activations and time coefficients per layer (estimate's path: one plan, every stage).

    Returns (acts, terms); terms = (per_layer {name: (per dense layer, per MoE layer)},
    per_stage {name: (value, "last" | "all")}, (sum per dense layer, sum per MoE layer))."""
    acts = stg.layer_activations(ctx, c)
    acts["moe_total"] = sum((v for k, v in acts.items() if k.startswith("moe/")), 0.0 * acts["input"])
    per_layer, head = _key_terms(ctx, alloc, c, acts)
    sums = (sum(d for d, _ in per_layer.values()), sum(m for _, m in per_layer.values()))
    return acts, (per_layer, {"compute/lm_head": (head, "last")}, sums)


def _stage_times(terms, st: stg.StageShape, scale=1) -> dict[str, np.ndarray]:
    """Seconds per micro-batch of a stage by breakdown name (arrays shaped like ``st``), times ``scale``."""
    per_layer, per_stage, _ = terms
    dense_n, moe_n = st.dense_layers * scale, st.moe_layers * scale
    zero = 0.0 * dense_n
    out = {}
    for k, (d, m) in per_layer.items():
        value = zero if d is None else dense_n * d
        out[k] = value if m is None else value + moe_n * m
    for k, (value, applies) in per_stage.items():
        out[k] = np.where(st.last, value * scale, 0.0) if applies == "last" else value * scale + zero
    return out


def _stage_time_total(terms, st: stg.StageShape):
    """sum(_stage_times(...).values()) with few array operations."""
    _, per_stage, (dense, moe) = terms
    head, p2p = per_stage["compute/lm_head"][0], per_stage["pipeline/p2p"][0]
    return st.dense_layers * dense + st.moe_layers * moe + np.where(st.last, head, 0.0) + p2p


def _p2p_seconds(ctx, c: Candidates, spans) -> np.ndarray:
    """Activations forward and gradients backward across one stage boundary per micro-batch (x v chunks).

    Each tp rank sends 1/tp of the activation (Megatron's scatter/gather optimisation, Narayanan et al.
    2021 sec. 4.1; with sequence parallelism the activation is split anyway); the intra-node all-gather that
    follows is small and not counted."""
    nbytes = c.mbs * ctx.training.seq_len * ctx.model.hidden_size * ctx.training.activation_bytes / c.tp
    t = 2 * ctx.net.seconds("p2p", 2, nbytes, spans["pp"][0]) * c.virtual_stages
    return np.where(c.pp > 1, t * (1 - ctx.opts.p2p_overlap), 0.0)


def _stage_shape(ctx, c: Candidates, stages, layers_per_stage=None) -> stg.StageShape:
    layers, moe = stage_layers(moe_prefix(ctx.model), ctx.model.num_layers, c.pp, stages, layers_per_stage)
    return stg.StageShape(layers, moe, stages == 0, stages == c.pp - 1)


def _select(st: stg.StageShape, index) -> stg.StageShape:
    """The stage at index[N] of each candidate: arrays [N]."""
    cols = np.arange(index.shape[0])
    pick = lambda a: np.broadcast_to(a, st.layers.shape)[index, cols]   # noqa: E731
    return stg.StageShape(pick(st.layers), pick(st.moe_layers), pick(st.first), pick(st.last))


def _evaluate(ctx, c: Candidates, alloc, stages, layers_per_stage=None, memory_detail=False):
    """Per-candidate results from the stages [S, N]: totals per stage with few array operations, then the
    full breakdown of the bottleneck (time) and peak (memory) stage only."""
    st = _stage_shape(ctx, c, stages, layers_per_stage)
    spans = _spans(alloc, c)
    acts, terms = _layer_terms(ctx, alloc, c)
    terms[1]["pipeline/p2p"] = (_p2p_seconds(ctx, c, spans), "all")
    flight = in_flight(c.schedule, stages, c.pp, c.num_microbatches, c.virtual_stages)
    stage_seconds = _stage_time_total(terms, st)
    slow = np.argmax(stage_seconds, axis=0)
    dense, expert = rank_stage_params(ctx.lp, st.layers, st.moe_layers, st.first, st.last, c.tp, c.ep, c.etp)
    totals = stg.stage_memory_total(ctx, c, st, flight, acts, (dense, expert))
    big = np.argmax(totals, axis=0)
    cols = np.arange(len(c))
    st_slow, st_big = _select(st, slow), _select(st, big)
    t_mb = np.broadcast_to(stage_seconds, stages.shape)[slow, cols]
    breakdown = _stage_times(terms, st_slow, scale=c.num_microbatches)
    breakdown["pipeline/bubble"] = t_mb * bubble_microbatches(c.schedule, c.pp, c.virtual_stages)
    dense, expert = np.broadcast_to(dense, stages.shape).max(0), np.broadcast_to(expert, stages.shape).max(0)
    sync_d, sync_e = dp_sync_seconds(ctx.net, ctx.training, dense, expert, c, spans["dp"][0], spans["edp"][0])
    breakdown["dp/sync/dense"] = sync_d * (1 - ctx.opts.dp_overlap)
    breakdown["dp/sync/expert"] = sync_e * (1 - ctx.opts.dp_overlap)
    breakdown["optimizer/step"] = optimizer_seconds(ctx.rates, ctx.training, dense, expert, c)
    step = t_mb * c.num_microbatches + breakdown["pipeline/bubble"] + breakdown["dp/sync/dense"] \
        + breakdown["dp/sync/expert"] + breakdown["optimizer/step"]
    breakdown["migration"] = step * ctx.opts.migration_fraction
    step = step + breakdown["migration"]
    peak_mem = {"total": np.broadcast_to(totals, stages.shape)[big, cols]}
    if memory_detail:
        peak_mem = stg.stage_memory(ctx, c, st_big, np.broadcast_to(flight, stages.shape)[big, cols], acts)
    return st, (flight, acts, terms), breakdown, step, peak_mem


def evaluate(model, platform, training, nodes: int, cand: Candidates, calibration=None, placement="compact",
             options: CostOptions = DEFAULT_OPTIONS, memory_detail: bool = False) -> Evaluation:
    """Predict step time, throughput and peak memory of every candidate (arrays of length N).

    Each candidate is priced with the layer split its plan will use (``Evaluation.layers_split``; see
    cost/batch.py and pipeline.split_variants): ``estimate`` of ``plan_of(...)`` gives the same numbers.
    ``memory_detail``: also fill ``Evaluation.memory`` with the peak stage's components (else only "total").

    Candidates are assumed valid (degrees multiply to the world size; the search filters first)."""
    ctx = stg.make_context(model, platform, training, options, calibration)
    alloc = allocation(platform, nodes, placement)
    breakdown, step, peak_mem, split = evaluate_batch(ctx, alloc, cand, _spans, _key_terms, _p2p_seconds,
                                                      memory_detail=memory_detail)
    return replace(_summary(ctx, cand, breakdown, step, peak_mem), layers_split=split)


def plan_of(model, training, cand: Candidates, evaluation: Evaluation, i: int) -> ParallelPlan:
    """Candidate i as the ParallelPlan it was priced as (its layer split included)."""
    from piper_plan.cost.pipeline import layers_per_stage_of

    code = 0 if evaluation.layers_split is None else int(evaluation.layers_split[i])
    pp = int(cand.pp[i])
    return cand.plan(i, layers_per_stage=layers_per_stage_of(model, training.seq_len, pp, code))


def _key_terms(ctx, alloc, sub: Candidates, acts):
    """Per-layer time coefficients {name: (per dense layer, per MoE layer)} and the LM head's seconds, for
    candidates ``sub`` (one row per distinct batch.KEY_TIME)."""
    terms = _time_terms(ctx, sub, _spans(alloc, sub), acts)
    return terms, terms.pop("compute/lm_head")[0]


def _summary(ctx, c: Candidates, breakdown, step, peak_mem) -> Evaluation:
    t = ctx.training
    world = c.world
    peak = ctx.platform.peak_flops(t.dtype)
    tokens_per_step = c.num_microbatches * c.mbs * c.dp * t.seq_len    # the work the step does (= gbs x s)
    model_flops = model_flops_per_token(ctx.model, t.seq_len) * tokens_per_step
    hw_flops = hardware_flops_per_token(ctx.model, ctx.lf, c.recompute, t.flash_attention) * tokens_per_step
    a2a = sum((v for k, v in breakdown.items() if k.startswith("moe/")), np.zeros(len(c)))
    return Evaluation(
        step_time_s=step,
        tokens_per_s=tokens_per_step / step,
        tflops_per_device=model_flops / (step * world) / 1e12,
        mfu=model_flops / (step * world * peak),
        hfu=hw_flops / (step * world * peak),
        peak_memory_bytes=peak_mem["total"],
        a2a_share=a2a / step,
        fits=peak_mem["total"] <= ctx.platform.device.memory_bytes,
        breakdown=breakdown,
        memory=peak_mem,
    )


def estimate(model, platform, training, nodes, plan: ParallelPlan, calibration=None, placement="compact",
             options: CostOptions = DEFAULT_OPTIONS) -> dict:
    """One plan in full detail: every stage's memory, the step's time breakdown, throughput, MFU/HFU,
    time and node-hours to train, checkpoint size, and the data sources used. JSON-ready."""
    if "sequence_parallel" in getattr(plan, "model_fields_set", ()):        # the plan says so explicitly
        options = replace(options, sequence_parallel=bool(plan.sequence_parallel))
    ctx = stg.make_context(model, platform, training, options, calibration)
    cand = Candidates.from_plan(plan)
    alloc = allocation(platform, nodes, placement)
    stages = np.arange(plan.pp)[:, None]
    st, (flight, acts, terms), breakdown, step, peak_mem = _evaluate(ctx, cand, alloc, stages, plan.layers_per_stage,
                                                                     memory_detail=True)
    ev = _summary(ctx, cand, breakdown, step, peak_mem)
    memory = stg.stage_memory(ctx, cand, st, flight, acts)
    memory = {k: np.broadcast_to(v, stages.shape) for k, v in memory.items()}
    times = _stage_times(terms, st)
    return _estimate_dict(ctx, plan, nodes, placement, alloc, st, memory, times, ev)


def _estimate_dict(ctx, plan, nodes, placement, alloc, st, memory, times, ev) -> dict:
    device_bytes = ctx.platform.device.memory_bytes
    per_stage = []
    for i in range(plan.pp):
        comp = {k: float(v[i, 0]) for k, v in memory.items() if k != "total"}
        per_stage.append({"stage": i, "layers": int(st.layers[i, 0]), "moe_layers": int(st.moe_layers[i, 0]),
                          "total_bytes": float(memory["total"][i, 0]), "components": comp,
                          "time_per_microbatch_s": float(sum(v[i, 0] for v in times.values()))})
    peak = float(ev.peak_memory_bytes[0])
    spans = {k: v for k, v in _spans(alloc, Candidates.from_plan(plan)).items()}
    from piper_plan.specs.platform import SCOPES
    totals = training_totals(ctx.training, float(ev.step_time_s[0]), nodes)
    sources = ctx.rates.source if ctx.rates.calibration is None else \
        "calibration: " + "; ".join(getattr(ctx.rates.calibration, "sources", []) or ["(no sources listed)"])
    return {
        "step_time_s": float(ev.step_time_s[0]),
        "tokens_per_s": float(ev.tokens_per_s[0]),
        "tflops_per_device": float(ev.tflops_per_device[0]),
        "mfu": float(ev.mfu[0]),
        "hfu": float(ev.hfu[0]),
        "a2a_share": float(ev.a2a_share[0]),
        "fits": bool(ev.fits[0]),
        "memory": {"peak_bytes": peak, "device_bytes": device_bytes, "overflow_bytes": max(peak - device_bytes, 0.0),
                   "per_stage": per_stage},
        "time": {"breakdown": {k: float(v[0]) for k, v in ev.breakdown.items()}},
        "training": {k: float(v) for k, v in totals.items()},
        "checkpoint": {**checkpoint_bytes(ctx.model, ctx.training),
                       "per_rank_bytes": max(s["components"]["weights"] + s["components"]["optimizer"]
                                             for s in per_stage)},   # its weights + its (ZeRO) optimizer shard
        "model_flops_per_token": model_flops_per_token(ctx.model, ctx.training.seq_len),
        "scopes": {k: SCOPES[int(v[0][0])] for k, v in spans.items()},
        "placement": placement,
        "nodes": nodes,
        "sources": {"compute": sources, "extrapolated": bool(ctx.rates.extrapolated or ctx.net.extrapolated),
                    "collectives_calibrated": sorted(ctx.net.calibrated_ops),
                    "collectives_fallback": "alpha-beta from platform network.scopes",
                    "a2a_algorithm": plan.a2a,
                    "a2a": ctx.net.a2a_source(plan.a2a, plan.ep, int(spans["ep"][1][0]), int(spans["ep"][0][0]))},
        "options": {f.name: getattr(ctx.opts, f.name) for f in fields(ctx.opts)},
    }
