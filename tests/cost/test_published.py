"""Tier 1: published numbers, each with its citation and tolerance.

Korthikanti et al. 2022 (arXiv 2205.05198), Table 3 / Fig. 1 / Table 2, as transcribed in
../shared/reference/validation-public.md: dense GPT on DGX A100 (Selene), sequence 2048, fp16, dp 1.
Piper paper (Dash & Wang, arXiv 2605.05049), memory equations, Table IV and the weak-scaling family, as in
../shared/reference/piper-paper.md.
"""

from __future__ import annotations

import numpy as np
import pytest

from piper_plan.catalog import load_model, load_platform
from piper_plan.cost.evaluate import estimate
from piper_plan.cost.options import CostOptions
from piper_plan.cost.step import expert_migration
from piper_plan.specs import ParallelPlan, TrainingSpec

GiB = 2**30

# model, GPUs, tp, pp, interleave, global batch, micro-batch, step full (s), step sel (s),
# weights+optimizer GiB, activations tp-only GiB, activations sp+selective GiB
KORTHIKANTI = [
    ("gpt-22b", 8, 8, 1, 1, 4, 4, 1.42, 1.10, 45.56, 59.25, 9.56),
    ("gpt-175b", 64, 8, 8, 3, 64, 1, 18.13, 13.75, 45.56, 66.84, 12.35),
    ("gpt-530b", 280, 8, 35, 3, 280, 1, 49.05, 37.83, 31.64, 114.02, 23.08),
    ("gpt-1t", 512, 8, 64, 1, 512, 1, 94.42, 71.49, 32.96, 131.25, 26.56),
]
MEGATRON_TRAINING = dict(seq_len=2048, dtype="fp16", weight_bytes=2, grad_bytes=4, master_bytes=4,
                         optimizer_bytes=8, flash_attention=False)     # 18 B/param (Korthikanti sec. 5)


def _korthikanti(row, recompute: str, sequence_parallel: bool):
    name, gpus, tp, pp, v, gbs, mbs = row[:7]
    training = TrainingSpec(global_batch=gbs, **MEGATRON_TRAINING)
    plan = ParallelPlan(dp=1, tp=tp, pp=pp, mbs=mbs, num_microbatches=gbs // mbs, recompute=recompute,
                        schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v,
                        sequence_parallel=sequence_parallel)
    opts = CostOptions(dropout=True)
    return estimate(load_model(name), load_platform("dgx-a100"), training, gpus // 8, plan, options=opts)


@pytest.mark.parametrize("row", KORTHIKANTI, ids=[r[0] for r in KORTHIKANTI])
def test_korthikanti_step_time_within_10pct(row):
    """Step time, full recompute (tensor parallel only) and selective recompute (with sequence parallel),
    on the dgx-a100 roofline fallback: |error| <= 10% per row (Calculon's bar: 3.65% mean, 8.87% max)."""
    full = _korthikanti(row, "full", sequence_parallel=False).step_time_s
    sel = _korthikanti(row, "selective", sequence_parallel=True).step_time_s
    assert abs(full - row[7]) / row[7] <= 0.10, (row[0], "full", full, row[7])
    assert abs(sel - row[8]) / row[8] <= 0.10, (row[0], "selective", sel, row[8])


def test_korthikanti_mean_error_within_5pct():
    """Over all 8 step times, the mean |error| stays within 5% (at writing: 4.1% mean, 7.5% max; Calculon
    reports 3.65% / 8.87% on the same rows)."""
    errors = []
    for row in KORTHIKANTI:
        errors.append(_korthikanti(row, "full", False).step_time_s / row[7] - 1)
        errors.append(_korthikanti(row, "selective", True).step_time_s / row[8] - 1)
    assert np.mean(np.abs(errors)) <= 0.05, errors


def _layer_activations(stage: dict) -> float:
    """Activations the transformer layers keep (Korthikanti's figure leaves out embedding and logits, and counts
    what is saved for backward, not the one layer a recompute rebuilds at a time: recompute_working)."""
    comp = stage.components
    return sum(v for k, v in comp.items() if k.startswith("activations/") and k not in
               ("activations/embedding", "activations/logits", "activations/recompute_working"))


@pytest.mark.parametrize("row", KORTHIKANTI, ids=[r[0] for r in KORTHIKANTI])
def test_korthikanti_memory_within_5pct(row):
    """Weights + gradients + optimizer (18 B/param) of a stage without the embedding (pp = 1: the whole
    model), and first-stage activations: tensor parallel only / sequence parallel + selective: within 5%."""
    tp_only = _korthikanti(row, "none", sequence_parallel=False)
    stage = tp_only.memory.per_stage[1 if row[3] > 2 else 0].components
    state = stage["weights"] + stage["gradients"] + stage["optimizer"]
    assert state / GiB == pytest.approx(row[9], rel=0.05)
    assert _layer_activations(tp_only.memory.per_stage[0]) / GiB == pytest.approx(row[10], rel=0.05)
    sel = _korthikanti(row, "selective", sequence_parallel=True)
    assert _layer_activations(sel.memory.per_stage[0]) / GiB == pytest.approx(row[11], rel=0.05)


# ---- Piper paper -------------------------------------------------------------------------------------
TABLE_IV = [  # model, E, d, d_ffn, send per GPU (printed), time ms (printed), unit the row matches
    ("Switch-Base", 128, 768, 2048, 1.21, 24.2, 1e9),
    ("Mixtral 8x7B", 8, 4096, 14336, 2.63, 52.6, GiB),
    ("Mixtral 8x22B", 8, 6144, 16384, 4.50, 90.0, GiB),
    ("Grok-1", 8, 6144, 32768, 9.00, 180.0, GiB),
    ("GLaM", 64, 8192, 32768, 102.88, 2057.6, 1e9),   # the paper's inconsistency: 103.08 GB by its formula
    ("DeepSeek-V2", 160, 5120, 1536, 7.04, 140.8, GiB),
    ("DeepSeek-V3", 256, 7168, 2048, 21.00, 420.0, GiB),
]


@pytest.mark.parametrize("row", TABLE_IV, ids=[r[0] for r in TABLE_IV])
def test_piper_table_iv_migration(row):
    """Worst case: one layer fully reassigned, 48 E d d_ffn / 8 bytes per GPU at 50 (G or GiB)/s: within 1%
    in the unit each row matches. GLaM's printed 102.88 GB is 0.19% below the formula's 103.08 GB (and far
    from its 96 GiB): the paper's inconsistency, still inside 1% in decimal GB."""
    name, experts, d, d_ffn, size, ms, unit = row
    nbytes, seconds = expert_migration(experts, d, d_ffn, bytes_per_param=16, matrices=3, gpus=8,
                                       bandwidth_Bps=50 * unit)
    assert nbytes / unit == pytest.approx(size, rel=0.01)
    assert seconds * 1e3 == pytest.approx(ms, rel=0.01)


def _paper_static(layers, d, experts, d_ffn, ep, per_expert_matrix_bytes):
    """Piper's static term per stage: (L/PP)(64 d^2 + (48 or 32) E/EP d d_ffn)."""
    return layers * (64 * d * d + per_expert_matrix_bytes * experts / ep * d * d_ffn)


@pytest.mark.parametrize("name,nodes,ep,pp", [("piper-weak-110b", 8, 8, 8), ("piper-weak-862b", 64, 32, 16),
                                              ("piper-weak-1.7t", 128, 32, 32)])
def test_weak_scaling_static_memory(name, nodes, ep, pp):
    """Static memory per GPU of the weak-scaling family = the paper's formula with 2-matrix experts
    (32 E d d_ffn where the paper writes 48 for 3-matrix experts), 16 B/param, no ZeRO. The family's norms
    (2 d per layer) and router (E d per layer) are what the paper leaves out: < 0.02% here, and added
    explicitly so the comparison is exact."""
    model = load_model(name)
    training = TrainingSpec(seq_len=4096, global_batch=ep * 8)
    plan = ParallelPlan(dp=ep, pp=pp, ep=ep, num_microbatches=8)
    stage = estimate(model, load_platform("frontier"), training, nodes, plan).memory.per_stage[0]
    comp = stage.components
    ours = comp["weights"] + comp["gradients"] + comp["optimizer"]
    layers = stage.layers
    d, moe = model.hidden_size, model.moe
    paper = _paper_static(layers, d, moe.num_experts, moe.expert.intermediate_size, ep, 32)
    omitted = 16 * layers * (2 * d + moe.num_experts * d)
    assert ours == pytest.approx(paper + omitted, rel=1e-12)
    assert ours == pytest.approx(paper, rel=1e-3)


def _paper_model(gated: bool):
    """The paper's special case: MHA, no embeddings, no norms, every layer MoE (router aside)."""
    from piper_plan.specs import ModelSpec

    return ModelSpec.model_validate({
        "name": "paper-case", "source": "Piper paper memory equations", "vocab_size": None,
        "hidden_size": 256, "num_layers": 8, "attention": {"kind": "mha", "num_heads": 4},
        "norm": {"per_layer": 0, "final": False},
        "moe": {"num_experts": 8, "top_k": 2, "expert": {"intermediate_size": 512, "gated": gated}}})


@pytest.mark.parametrize("gated,per_matrix", [(True, 48), (False, 32)])
@pytest.mark.parametrize("pp,ep,m", [(2, 4, 8), (4, 2, 2), (1, 8, 4)])
def test_paper_memory_equations_special_case(gated, per_matrix, pp, ep, m):
    """M(i) = (L/PP)[64 d^2 + (48 E/EP) d d_ffn + (PP - i)(12 b s d + 4 b H s^2 + (2 b s k / EP)(3 d_ffn + d))]
    with b = one micro-batch: the paper's terms come out exactly, stage by stage (1F1B, 16 B/param, non-flash,
    no dropout, tp 1). Two caveats, asserted explicitly: (1) the paper divides expert activations by EP while
    charging attention for the full b, i.e. its expert b is the EP group's batch (b x EP); (2) what it leaves
    out (router weights, the MoE norm/input, router scores, dispatch/combine buffers) is reported separately."""
    model = _paper_model(gated)
    s, d, mbs, k, f, heads, experts = 64, 256, 2, 2, 512, 4, 8
    training = TrainingSpec(seq_len=s, global_batch=mbs * ep * m, flash_attention=False)
    plan = ParallelPlan(dp=ep, pp=pp, ep=ep, mbs=mbs, num_microbatches=m)
    stages = estimate(model, load_platform("frontier"), training, ep * pp // 8 or 1, plan).memory.per_stage
    matrices = 3 if gated else 2
    for i, stage in enumerate(stages):
        comp, layers = stage.components, stage.layers
        static = comp["weights"] + comp["gradients"] + comp["optimizer"]
        router = 16 * layers * experts * d
        assert static - router == _paper_static(layers, d, experts, f, ep, per_matrix)
        flight = min(pp - i, m)
        attention = layers * flight * (12 * mbs * s * d + 4 * mbs * heads * s * s)
        experts_b = mbs * ep                                  # the paper's expert b (caveat 1)
        expert_act = layers * flight * 2 * experts_b * s * k / ep * (matrices * f + d)
        assert comp["activations/attention"] == attention
        assert comp["activations/moe/experts"] == expert_act
