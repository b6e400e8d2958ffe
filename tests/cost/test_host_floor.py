"""The host floor of a GPU layer (cost/overhead.py, host_floor_terms): a layer takes at least the host time of its
GEMM calls; the term is zero where the platform prices no host time, and CUDA-graphed parts cost no host time."""

from __future__ import annotations

import pytest

from piper_plan.catalog import load_model, load_platform
from piper_plan.cost.evaluate import estimate
from piper_plan.cost.options import CostOptions
from piper_plan.cost.overhead import GEMMS_PER_LINEAR, linears_per_layer
from piper_plan.errors import PiperError
from piper_plan.specs import ParallelPlan, TrainingSpec

MODEL = load_model("mixtral-8x7b")          # 32 MoE layers, 8 experts, GQA: no dense layer
TRAINING = TrainingSpec(seq_len=4096, global_batch=64)


def _platform(host_s: float):
    platform = load_platform("dgx-h100")
    data = platform.model_dump(mode="json")
    data["efficiency"]["host_s_per_gemm_call"] = host_s
    return type(platform).model_validate(data)


def _estimate(host_s: float, ep: int = 8, options: CostOptions = CostOptions()):
    plan = ParallelPlan(dp=8, pp=1, ep=ep, mbs=1, num_microbatches=8)
    return estimate(MODEL, _platform(host_s), TRAINING, 1, plan, options=options)


def test_no_host_time_priced_leaves_every_term_as_it_was():
    base = _estimate(0.0)
    assert "host/launch" not in base.time.breakdown


def test_a_host_bound_layer_takes_its_host_time():
    per_call = 5e-3                                          # far above any device time of one layer
    est = _estimate(per_call)
    _, moe_linears = linears_per_layer(MODEL, MODEL.moe.num_experts / 8, ())
    host_per_layer = per_call * GEMMS_PER_LINEAR * float(moe_linears)
    head = est.time.breakdown["compute/lm_head"] / 8         # the LM head runs once per micro-batch, outside layers
    stage = est.memory.per_stage[0].time_per_microbatch_s
    assert stage == pytest.approx(MODEL.num_layers * host_per_layer + head, rel=1e-6)
    assert est.time.breakdown["host/launch"] > 0


def test_a_device_bound_layer_pays_nothing_for_its_host_work():
    base, tiny = _estimate(0.0), _estimate(1e-9)
    assert tiny.time.breakdown["host/launch"] == 0.0
    assert tiny.step_time_s == pytest.approx(base.step_time_s)


def test_more_local_experts_cost_more_host_time_and_graphed_parts_none():
    per_call = 5e-3
    ep8, ep4 = _estimate(per_call, ep=8), _estimate(per_call, ep=4)         # 1 vs 2 local experts
    assert ep4.time.breakdown["host/launch"] > ep8.time.breakdown["host/launch"]
    graphed = _estimate(per_call, options=CostOptions(cuda_graph_scope=("attn", "moe_router")))
    assert graphed.step_time_s < ep8.step_time_s
    assert linears_per_layer(MODEL, 1, ("attn", "moe_router"))[1] == 2       # only the routed experts' pair left


def test_an_unknown_graph_scope_is_one_clear_error():
    with pytest.raises(PiperError, match="cuda_graph_scope"):
        CostOptions(cuda_graph_scope=("everything",))


def test_a_parallel_dense_mlp_is_two_more_linears_unless_graphed():
    """Arctic's MoE layers run a dense residual MLP beside the experts: its two linears (2 x 3 host GEMM calls)."""
    arctic = load_model("arctic")
    assert arctic.moe.parallel_dense_ffn is not None
    routed = 2 * 1
    assert linears_per_layer(arctic, 1, ())[1] == 2 + 1 + 2 + routed      # attention, router, parallel MLP, experts
    assert linears_per_layer(arctic, 1, ("attn", "moe_router", "mlp"))[1] == routed


def test_the_runtimes_measured_host_replaces_megatrons_per_call_constant():
    """h200 has both: dgx-h100's per-GEMM-call constant (Megatron-Core's host work) and piper's runtime's own host
    overhead measured on an H200 (calibration/h200/overhead.csv). Priced as the runtime runs a plan, the measured
    overhead alone prices its host (here under its device time); as Megatron-Core runs it, the constant does."""
    from piper_plan.cli.common import platform_calibration

    model, platform = load_model("deepseek-v3"), load_platform("h200")
    plan = ParallelPlan(dp=4, tp=4, pp=16, ep=8, zero=1, num_microbatches=256)
    training = TrainingSpec(seq_len=1024, global_batch=1024)
    calibration = platform_calibration("h200")
    as_run = estimate(model, platform, training, 32, plan, calibration=calibration,
                      options=CostOptions(unfused_kernels=True))
    as_megatron = estimate(model, platform, training, 32, plan, calibration=calibration)
    runtime, megatron = as_run.time.breakdown, as_megatron.time.breakdown
    assert "host/framework" in runtime and runtime.get("host/launch", 0) == 0     # before: 58.5 s of host/launch
    assert megatron["host/launch"] > 0 and megatron.get("host/framework", 0) == 0
    assert "overhead.csv" in as_run.sources.host and "per GEMM call" not in as_run.sources.host    # what it says
    assert as_megatron.sources.host.endswith("us per GEMM call (efficiency.host_s_per_gemm_call)")
