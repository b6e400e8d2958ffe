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
    assert fp8.checkpoint == bf16.checkpoint                              # the 8-bit copies are rebuilt, not saved


def test_a_rank_saves_its_shard_of_the_checkpoint_under_fsdp():
    """zero 3 on one stage with ep = dp: every rank holds 1/dp of the saved state (fp32 shard + Adam moments),
    not the gathered bf16 weights; zero 1: its bf16 weights (the dense ones replicated) beside its master +
    optimizer shard."""
    platform, model = load_platform("dgx-h100"), load_model("mixtral-8x7b")
    training = TrainingSpec(seq_len=4096, global_batch=128)
    zero3 = estimate(model, platform, training, 1, PLAN.model_copy(update={"zero": 3})).checkpoint
    assert zero3.bytes_per_param == 4 + 8
    assert zero3.per_rank_bytes * PLAN.dp == pytest.approx(zero3.total_bytes)
    zero1 = estimate(model, platform, training, 1, PLAN.model_copy(update={"zero": 1})).checkpoint
    assert zero1.bytes_per_param == 2 + 4 + 8
    assert zero1.total_bytes < zero1.per_rank_bytes * PLAN.dp < 1.1 * zero1.total_bytes  # dense weights replicated


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


def test_a_calibration_without_rows_of_the_precision_prices_its_gemms_at_the_roofline_and_says_so():
    """gemm.csv measured bf16 only: fp8 GEMMs take fp8's roofline, not bf16's measured rates (which made an fp8
    estimate identical to bf16's), and the sources say which fallback was used."""
    from piper_plan.calibration.curves import load_calibration

    calibration = load_calibration("frontier")
    platform = _with_fp8_peak(load_platform("frontier"), 2.0)
    model, plan = load_model("tiny-moe"), ParallelPlan(dp=8, pp=1, ep=8, mbs=1, num_microbatches=2)
    runs = {dtype: estimate(model, platform, TrainingSpec(seq_len=256, global_batch=16, dtype=dtype), 1, plan,
                            calibration=calibration) for dtype in ("bf16", "fp8")}
    assert runs["bf16"].sources.compute.startswith("calibration: ") and "roofline" not in runs["bf16"].sources.compute
    assert "GEMMs in fp8: roofline fallback (efficiency.gemm=" in runs["fp8"].sources.compute
    assert "gemm.csv has no fp8 rows" in runs["fp8"].sources.compute
    roofline = estimate(model, platform, TrainingSpec(seq_len=256, global_batch=16, dtype="fp8"), 1, plan)
    fp8, bf16 = runs["fp8"].time.breakdown, runs["bf16"].time.breakdown
    assert fp8["compute/experts"] == pytest.approx(roofline.time.breakdown["compute/experts"])
    assert fp8["compute/experts"] != pytest.approx(bf16["compute/experts"])
    assert fp8["compute/lm_head"] == pytest.approx(bf16["compute/lm_head"])    # the output layer stays 16-bit


def test_the_output_says_whether_host_time_is_priced():
    """efficiency.host_s_per_gemm_call 0 is a fallback (host work hidden), named in estimate's and plan's sources."""
    from piper_plan.cost.evaluate import pricing_sources

    assert pricing_sources(load_platform("dgx-h100"), TrainingSpec())["host"].endswith("us per GEMM call "
                                                                              "(efficiency.host_s_per_gemm_call)")
    assert pricing_sources(load_platform("mi300x"), TrainingSpec())["host"] == (
        "not priced: mi300x has no efficiency.host_s_per_gemm_call (host work assumed hidden)")
    assert _estimate("bf16", load_platform("mi300x")).sources.host.startswith("not priced: mi300x")


def test_a_peak_borrowed_from_the_other_16_bit_format_is_named():
    """device.peak_flops without bf16 prices bf16 at fp16's peak (PlatformSpec.peak_flops), and now says so."""
    from piper_plan.cost.compute import Rates

    data = load_platform("dgx-h100").model_dump(mode="json")
    del data["device"]["peak_flops"]["bf16"]
    platform = type(load_platform("dgx-h100")).model_validate(data)
    assert "the bf16 peak is device.peak_flops' fp16 (no bf16 entry)" in Rates(platform, "bf16").source
    assert "peak is device.peak_flops'" not in Rates(load_platform("dgx-h100"), "bf16").source


def _recipe_estimate(recipe: str, platform_name: str):
    model = load_model("mixtral-8x7b")
    training = TrainingSpec(seq_len=4096, global_batch=128, dtype="fp8", fp8_recipe=recipe)
    return estimate(model, load_platform(platform_name), training, 1, PLAN)


def test_an_fp8_run_names_its_recipe_delayed_by_default_and_only_fp8_has_one():
    assert TrainingSpec(dtype="fp8").fp8_recipe == "delayed"          # Megatron-LM's and Transformer Engine's default
    assert TrainingSpec(dtype="bf16").fp8_recipe is None and TrainingSpec(dtype="mxfp8").fp8_recipe is None
    for dtype in ("bf16", "mxfp8"):
        with pytest.raises(ValueError, match="fp8_recipe=blockwise is for dtype fp8 only"):
            TrainingSpec(dtype=dtype, fp8_recipe="blockwise")
    saved = TrainingSpec(dtype="fp8", fp8_recipe="tensorwise").model_dump(mode="json")
    assert TrainingSpec.model_validate(saved).fp8_recipe == "tensorwise"


def test_each_recipe_scales_the_linear_gemms_by_its_measured_time_and_nothing_else():
    """dgx-h100's efficiency.fp8_recipe_time (Transformer Engine's H200 GEMM benchmark): the GEMM time of every
    linear layer Transformer Engine runs in 8 bits scales by the recipe's factor; the router and the output layer
    (16-bit in Megatron-Core), attention's core and elementwise work do not."""
    factors = load_platform("dgx-h100").efficiency.fp8_recipe_time
    runs = {r: _recipe_estimate(r, "dgx-h100") for r in ("delayed", "tensorwise", "blockwise")}
    assert runs["delayed"].step_time_s < runs["tensorwise"].step_time_s < runs["blockwise"].step_time_s
    base = runs["delayed"].time.breakdown
    for recipe, run in runs.items():
        ratio = factors[recipe] / factors["delayed"]
        assert run.time.breakdown["compute/experts"] == pytest.approx(base["compute/experts"] * ratio, rel=1e-9)
        for term in ("compute/router", "compute/lm_head", "compute/elementwise"):    # 16-bit GEMMs, memory-bound work
            assert run.time.breakdown[term] == pytest.approx(base[term]), (recipe, term)
        attention = run.time.breakdown["compute/attention"] / base["compute/attention"]   # projections + bf16 core
        assert attention == 1.0 if ratio == 1.0 else 1.0 < attention < ratio
        assert f"fp8 recipe {recipe}: linear GEMMs take {factors[recipe]:g} x" in run.sources.compute


def test_a_platform_without_a_measured_recipe_time_prices_the_kernel_rate_and_says_so():
    runs = [_recipe_estimate(r, "dgx-b200") for r in ("delayed", "tensorwise")]
    assert runs[0].step_time_s == runs[1].step_time_s
    assert "fp8 recipe tensorwise: no time measured for it on dgx-b200" in runs[1].sources.compute


@pytest.mark.parametrize("platform_name", ["dgx-b200", "gb200-nvl72"])
def test_blockwise_on_blackwell_runs_as_mxfp8_never_faster(platform_name):
    """Transformer Engine emulates the blockwise recipe through MXFP8 on Blackwell (efficiency.
    fp8_blockwise_runs_as_mxfp8): its GEMMs take mxfp8's rate, not the fp8 kernel's, so --dtype any cannot rank an
    fp8 blockwise plan above the same plan in mxfp8."""
    blockwise, tensorwise = (_recipe_estimate(r, platform_name) for r in ("blockwise", "tensorwise"))
    model = load_model("mixtral-8x7b")
    mxfp8 = estimate(model, load_platform(platform_name), TrainingSpec(seq_len=4096, global_batch=128,
                                                                      dtype="mxfp8"), 1, PLAN)
    for term in ("compute/experts", "compute/attention", "compute/router", "compute/lm_head"):
        assert blockwise.time.breakdown[term] == pytest.approx(mxfp8.time.breakdown[term], rel=1e-12), term
    assert blockwise.time.breakdown["compute/experts"] > tensorwise.time.breakdown["compute/experts"]
    assert f"{platform_name} runs it as MXFP8" in blockwise.sources.compute
    assert "for mxfp8" in blockwise.sources.compute and "for fp8," not in blockwise.sources.compute


def test_a_measured_blockwise_time_on_blackwell_is_applied_and_named():
    """Where a Blackwell platform measures the emulation's own time, it scales mxfp8's rate and the source says so
    (before, the factor was applied while the source line said the conversion was not measured)."""
    data = load_platform("dgx-b200").model_dump(mode="json")
    data["efficiency"]["fp8_recipe_time"] = {"blockwise": 1.5}
    platform = type(load_platform("dgx-b200")).model_validate(data)
    model, plain = load_model("mixtral-8x7b"), _recipe_estimate("blockwise", "dgx-b200")
    timed = estimate(model, platform, TrainingSpec(seq_len=4096, global_batch=128, dtype="fp8", fp8_recipe="blockwise"),
                     1, PLAN)
    assert timed.time.breakdown["compute/experts"] == pytest.approx(1.5 * plain.time.breakdown["compute/experts"])
    assert "linear GEMMs at mxfp8's rate x 1.5 (efficiency.fp8_recipe_time)" in timed.sources.compute


def test_blockwise_as_mxfp8_needs_an_mxfp8_peak():
    from pydantic import ValidationError

    data = load_platform("dgx-h100").model_dump(mode="json")
    data["efficiency"]["fp8_blockwise_runs_as_mxfp8"] = True              # Hopper has no mxfp8 rate
    with pytest.raises(ValidationError, match="fp8_blockwise_runs_as_mxfp8=true .* needs an mxfp8 entry"):
        type(load_platform("dgx-h100")).model_validate(data)


def test_a_recipe_time_below_one_is_refused():
    from pydantic import ValidationError

    data = load_platform("dgx-h100").model_dump(mode="json")
    data["efficiency"]["fp8_recipe_time"]["delayed"] = 0.9            # faster than the kernel it runs: impossible
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        type(load_platform("dgx-h100")).model_validate(data)


def test_an_8_bit_gemm_rate_borrowed_from_the_16_bit_one_is_said():
    """mi355x has no fp8 GEMM measurement (efficiency.gemm_by_dtype): its 16-bit efficiency prices fp8, and the
    sources say so; dgx-h100 has one (MAMF fp8) and says nothing of the kind."""
    from piper_plan.cost.compute import Rates

    said = "no fp8 GEMM efficiency measured (efficiency.gemm_by_dtype): the 16-bit efficiency.gemm is taken for fp8"
    assert said in Rates(load_platform("mi355x"), "fp8").source
    assert said not in Rates(load_platform("dgx-h100"), "fp8").source
