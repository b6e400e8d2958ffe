"""The training-precision axis: fp8 / mxfp8 speed up GEMMs only, keep 8-bit weight copies, and are refused where the
platform has no rate for them."""

from __future__ import annotations

import pytest

from piper_plan.catalog import load_model, load_platform
from piper_plan.cost.evaluate import estimate
from piper_plan.errors import PiperError
from piper_plan.specs import ParallelPlan, TrainingSpec

PLAN = ParallelPlan(dp=8, pp=1, ep=8, mbs=1, num_microbatches=16)


def _with_fp8_peak(platform, factor: float):
    """A copy of the platform whose fp8 rate is ``factor`` x its bf16 rate (a test fixture, not a hardware fact)."""
    data = platform.model_dump(mode="json")
    data["device"]["peak_flops"]["fp8"] = factor * platform.peak_flops("bf16")
    return type(platform).model_validate(data)


def _estimate(dtype: str, platform):
    model = load_model("mixtral-8x7b")
    training = TrainingSpec(seq_len=4096, global_batch=128, dtype=dtype)
    return estimate(model, platform, training, 1, PLAN)


def test_fp8_speeds_up_gemms_not_attention_and_keeps_weight_copies():
    platform = _with_fp8_peak(load_platform("dgx-h100"), 2.0)
    bf16, fp8 = _estimate("bf16", platform), _estimate("fp8", platform)
    b, f = bf16.time.breakdown, fp8.time.breakdown
    assert f["compute/experts"] < 0.75 * b["compute/experts"]           # compute-bound GEMMs: up to 2x faster
    assert f["compute/elementwise"] == pytest.approx(b["compute/elementwise"])          # memory-bound: unchanged
    core = _core_seconds("bf16", platform)
    assert core == pytest.approx(_core_seconds("fp8", platform)) and core > 0          # attention scores stay bf16
    assert fp8.step_time_s < bf16.step_time_s
    weights = [e.memory.per_stage[0].components["weights"] for e in (bf16, fp8)]
    assert weights[1] == pytest.approx(weights[0] * (2 + 2) / 2)        # + rowwise and columnwise 8-bit copies


def _core_seconds(dtype: str, platform) -> float:
    from piper_plan.cost import stage
    from piper_plan.cost.options import DEFAULT_OPTIONS
    from piper_plan.plans import PlanBatch

    training = TrainingSpec(seq_len=4096, global_batch=128, dtype=dtype)
    ctx = stage.make_context(load_model("mixtral-8x7b"), platform, training, DEFAULT_OPTIONS)
    fwd, bwd = stage.layer_compute_seconds(ctx, PlanBatch.of(PLAN))["attention_core"]
    return float(fwd[0] + bwd[0])


def test_a_precision_the_platform_has_no_rate_for_is_one_clear_error():
    with pytest.raises(PiperError, match="no peak for dtype=fp8"):
        _estimate("fp8", load_platform("frontier"))          # MI250X: no fp8 (platforms/frontier.yaml)


@pytest.mark.parametrize("dtype,gemm_byte", [("bf16", 2.0), ("fp8", 1.0), ("mxfp8", 1 + 1 / 32)])
def test_8_bit_recipes_save_gemm_inputs_as_their_8_bit_casts(dtype, gemm_byte):
    """Mixtral 8x7B expert block, tp 1, ep 8, mbs 1, s 4096, top-2 (routing skew 1): 8,192 rows reach a rank.
    Saved: the experts' fc1 input [8192 x 4096] and the SwiGLU product [8192 x 14336] (fc2's input) at the GEMM
    input's bytes (Transformer Engine saves the 8-bit cast), gate and up [8192 x 2 x 14336] in bf16."""
    from piper_plan.cost.memory import moe_activation_bytes
    from piper_plan.cost.options import CostOptions

    model = load_model("mixtral-8x7b")
    training = TrainingSpec(seq_len=4096, global_batch=128, dtype=dtype)
    rows, d, ffn = 8192, 4096, 14336
    expected = rows * d * gemm_byte + rows * 2 * ffn * 2 + rows * ffn * gemm_byte
    got = moe_activation_bytes(model, training, CostOptions(), 1, 1, 8, 1, 1)["experts"]
    assert got == pytest.approx(expected)
    runtime = moe_activation_bytes(model, training, CostOptions(unfused_kernels=True), 1, 1, 8, 1, 1)["experts"]
    assert runtime == pytest.approx(rows * d * 2 + rows * 4 * ffn * 2)       # piper's runtime: no 8-bit GEMMs
