"""Multi-token prediction (MTP) modules and context parallelism (cp) in the planner: exact counts, FLOPs,
memory and time of the last stage; cp's world formula, rules, per-rank split, KV ring and search axis."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from piper_plan.capability import unsupported_features
from piper_plan.catalog import load_model, load_platform
from piper_plan.cli.main import cli
from piper_plan.cost import stage as stg
from piper_plan.cost.evaluate import estimate, evaluate
from piper_plan.cost.flops import model_flops_per_token, mtp_forward_flops
from piper_plan.cost.memory import rank_param_counts
from piper_plan.cost.options import DEFAULT_OPTIONS
from piper_plan.errors import PiperError
from piper_plan.hf_import import spec_from_hf_config
from piper_plan.plans import PlanBatch, check_plan, plan_problems
from piper_plan.search.space import CP_MIN_SEQ_LEN, SearchOptions, enumerate_space
from piper_plan.specs import ModelSpec, ParallelPlan, TrainingSpec
from piper_plan.specs.vocab import Recompute

H100 = load_platform("dgx-h100")
DSV3 = load_model("deepseek-v3")


def with_mtp(model: ModelSpec, n: int) -> ModelSpec:
    return ModelSpec.model_validate({**model.model_dump(), "mtp_layers": n})


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


# ---- MTP: counts --------------------------------------------------------------------------------------------
def test_deepseek_v3_mtp_module_by_hand():
    """One DeepSeek-V3 MTP module (its own weights; embedding and head shared): MLA attention 187,107,328
    (= 11,413,547,008 / 61 layers) + 2 norms 2 x 7168 + MoE block (router 256 x 7168 + 256 experts x 3 x 7168 x
    2048 + 1 shared expert 3 x 7168 x 2048) + eh_proj 2 x 7168 x 7168 + enorm, hnorm, final norm 3 x 7168."""
    d = 7168
    expert = 3 * d * 2048
    block = 187_107_328 + 2 * d + 256 * d + 256 * expert + expert
    module = block + 2 * d * d + 3 * d
    p = DSV3.params
    assert DSV3.mtp_layers == 1 and p.mtp == module == 11_610_067_968
    assert p.mtp_active == module - 248 * expert == 688_100_352          # top-8 of the 256 routed experts
    assert p.total == 671_026_404_352                                      # the main model: transformers' count
    # the Hugging Face checkpoint stores the module with its own copies of the embedding and the head (layer 61's
    # embed_tokens and shared_head.head): 684,489,830,400, the hub's "685B" (README_WEIGHTS.md: 671B + 14B) to
    # 0.08% (the checkpoint's fp8 block scales, about 1 / 128^2 of the weights, add about 0.04B more)
    hub = p.total_with_mtp + 2 * 129_280 * d
    assert hub == 684_489_830_400 and abs(hub - 685e9) / 685e9 < 1e-3


def test_hf_import_reads_num_nextn_predict_layers():
    config = json.loads(open("tests/specs/fixtures/deepseek-v3.json").read())
    assert spec_from_hf_config(config, "deepseek-v3.json").mtp_layers == 1
    assert spec_from_hf_config({**config, "num_nextn_predict_layers": 0}, "x.json").mtp_layers == 0
    with pytest.raises(PiperError, match="num_nextn_predict_layers.*integer >= 0, got -1"):
        spec_from_hf_config({**config, "num_nextn_predict_layers": -1}, "x.json")


def test_bad_mtp_counts_in_specs():
    with pytest.raises(ValueError, match="mtp_layers"):
        with_mtp(DSV3, -1)
    abstract = load_model("tiny-moe").model_dump()
    with pytest.raises(ValueError, match="needs a vocabulary"):
        ModelSpec.model_validate({**abstract, "vocab_size": None, "mtp_layers": 1})


@pytest.mark.parametrize("model, value, needle", [("deepseek-v3", -1, "allowed 0 to 1"),
                                                  ("deepseek-v3", 2, "defines 1"),
                                                  ("tiny-moe", 1, "has no multi-token-prediction module")])
def test_cli_mtp_layers_out_of_range_is_one_line(model, value, needle):
    result = run("estimate", "--model", model, "--platform", "local-cpu", "--nodes", "1", "--mtp-layers", value)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --mtp-layers") and needle in lines[0], result.stderr


# ---- MTP: FLOPs, memory, time ---------------------------------------------------------------------------------
def test_mtp_flops_counted_in_megatron_convention_only():
    """Megatron-LM counts each MTP module as one more MoE layer + 3 d + 2 d^2 + the logits once more; PaLM does
    not count it. Forward per token: 2 x 688,100,352 + 2 V d + 2 H (qk + v) s / 2 causal."""
    no_mtp = with_mtp(DSV3, 0)
    s = 4096
    fwd = 2 * 688_100_352 + 2 * 129_280 * 7168 + 2 * 128 * (192 + 128) * s / 2
    assert mtp_forward_flops(DSV3, s) == pytest.approx(fwd)
    assert model_flops_per_token(DSV3, s, "palm") == model_flops_per_token(no_mtp, s, "palm")
    assert model_flops_per_token(DSV3, s, "megatron") - model_flops_per_token(no_mtp, s, "megatron") \
        == pytest.approx(3 * fwd)


def test_mtp_params_sit_on_the_last_stage():
    """pp = 4, tp = 2, ep = 8: the last stage holds the module (dense part over tp except its norms, router and
    MLA's q_a / kv_a compressions 7168 x 1536 + 1536 + 7168 x 576 + 512, experts over ep) and a vocab-parallel
    copy of the embedding for it; the other stages hold what they held."""
    plan = ParallelPlan(dp=8, tp=2, pp=4, ep=8, num_microbatches=4)
    with_, without = rank_param_counts(DSV3, plan), rank_param_counts(with_mtp(DSV3, 0), plan)
    assert with_[:3] == without[:3]
    d, expert = 7168, 3 * 7168 * 2048
    whole = 2 * d + 3 * d + 256 * d + d * 1536 + 1536 + d * 576 + 512
    dense = (DSV3.params.mtp - 256 * expert - whole) / 2 + whole + 129_280 * d / 2
    assert with_[3]["expert"] - without[3]["expert"] == 256 * expert // 8
    assert with_[3]["dense"] - without[3]["dense"] == pytest.approx(dense, abs=1)


def test_mtp_adds_work_and_memory_to_the_last_stage_only():
    training = TrainingSpec(seq_len=4096, global_batch=1024, grad_bytes=4)
    plan = ParallelPlan(dp=64, tp=2, pp=8, ep=64, zero=1, num_microbatches=16, layers_per_stage=[8] * 7 + [5])
    a = estimate(DSV3, H100, training, 128, plan)
    b = estimate(with_mtp(DSV3, 0), H100, training, 128, plan)
    sa, sb = a.memory.per_stage, b.memory.per_stage
    assert [s.total_bytes for s in sa[:7]] == [s.total_bytes for s in sb[:7]]
    assert sa[7].total_bytes > sb[7].total_bytes
    assert sa[7].time_per_microbatch_s > sb[7].time_per_microbatch_s
    assert [s.time_per_microbatch_s for s in sa[:7]] == pytest.approx([s.time_per_microbatch_s for s in sb[:7]])


@pytest.mark.parametrize("mtp", [1, 2])
def test_hfu_at_least_mfu_with_mtp(mtp):
    """The HFU >= MFU property holds with MTP modules, in both conventions, over random plans and every
    recompute mode (equal without recompute, larger with full)."""
    model = with_mtp(load_model("tiny-mla"), mtp)
    training = TrainingSpec(seq_len=64, global_batch=64)
    rng = np.random.default_rng(mtp)
    n = 48
    pp = rng.choice([1, 2], n)
    cand = PlanBatch(dp=8 // pp, tp=1, pp=pp, ep=rng.choice([1, 2], n), etp=1, mbs=rng.choice([1, 2], n),
                     num_microbatches=1, schedule=1, virtual_stages=1, recompute=rng.integers(0, 3, n),
                     zero=rng.integers(0, 2, n), a2a=0, sequence_parallel=1, layers_split=0)
    cand = PlanBatch.from_arrays({**cand.arrays(), "num_microbatches": 64 // (cand.dp * cand.mbs)})
    ev = evaluate(model, H100, training, 1, cand)
    none, full = cand.recompute == Recompute.NONE.code, cand.recompute == Recompute.FULL.code
    for mfu, hfu in ((ev.mfu, ev.hfu), (ev.mfu_megatron, ev.hfu_megatron)):
        assert np.all(hfu >= mfu)
        assert np.allclose(hfu[none], mfu[none]) and np.all(hfu[full] > mfu[full])


def test_mtp_is_runnable():
    """The runtime builds the MTP module (runtime/model.py MTPModule; tests/runtime/test_mtp.py)."""
    for n in (0, 1):
        assert not any("mtp" in p for p in unsupported_features(ParallelPlan(), with_mtp(DSV3, n)))


# ---- context parallelism ----------------------------------------------------------------------------------------
def test_cp_world_and_expert_regrouping():
    """world = pp x dp x cp x tp; edp = dp x cp x tp / (ep x etp) (Megatron-Core's expert regrouping)."""
    plan = ParallelPlan(dp=4, cp=2, tp=2, pp=2, ep=8)
    assert plan.world == 32 and plan.edp == 2
    batch = PlanBatch.of(plan)
    assert int(batch.world[0]) == 32 and int(batch.edp[0]) == 2 and int(batch.dp_cp[0]) == 8


def test_cp_rules_name_their_values():
    model, training = load_model("mixtral-8x7b"), TrainingSpec(seq_len=4100, global_batch=64)
    found = plan_problems(model, H100, training, 1, ParallelPlan(dp=2, cp=4, ep=8, num_microbatches=32))
    assert any(p.startswith("cp_not_divisor_seq") and "seq_len=4100" in p and "2 x cp = 8" in p for p in found)
    check_plan(model, H100, TrainingSpec(seq_len=4096, global_batch=64), 1,
               ParallelPlan(dp=2, cp=4, ep=8, num_microbatches=32))                       # 4096 % 8 == 0: valid
    with pytest.raises(PiperError, match="pp x dp x cp x tp = 1 x 2 x 2 x 1 = 4"):
        check_plan(model, H100, training, 1, ParallelPlan(dp=2, cp=2, num_microbatches=32))


def test_cli_cp_not_dividing_the_sequence_is_one_line():
    result = run("estimate", "--model", "mixtral-8x7b", "--platform", "dgx-h100", "--nodes", "1", "--dp", "4",
                 "--cp", "2", "--ep", "8", "--seq", "4094", "--global-batch", "64")
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cp_not_divisor_seq" in lines[0] and "seq_len=4094" in lines[0], result.stderr
    bad = run("plan", "--model", "mixtral-8x7b", "--platform", "dgx-h100", "--nodes", "1", "--cp", "1,zero")
    assert bad.exit_code == 2 and bad.stderr.strip().startswith("error: --cp")


def _acts(model, training, plan):
    ctx = stg.make_context(model, H100, training, DEFAULT_OPTIONS)
    return ctx, PlanBatch.of(plan)


def test_cp_splits_activations_and_compute_per_rank():
    """cp = 2 over the same 8 ranks: each rank holds half the tokens of a micro-batch, so every per-layer
    activation and every GEMM / attention time halves (flash attention: the rank's queries against all keys)."""
    model, training = load_model("mixtral-8x7b"), TrainingSpec(seq_len=32768, global_batch=64)
    ctx, one = _acts(model, training, ParallelPlan(dp=8, ep=8, num_microbatches=8))
    _, two = _acts(model, training, ParallelPlan(dp=4, cp=2, ep=8, num_microbatches=16))
    a1, a2 = stg.layer_activations(ctx, one), stg.layer_activations(ctx, two)
    for name in ("attention", "moe/moe_input", "moe/buffers", "moe/experts", "input"):
        assert float(a2[name][0]) == pytest.approx(float(a1[name][0]) / 2)
    t1, t2 = stg.layer_compute_seconds(ctx, one), stg.layer_compute_seconds(ctx, two)
    for name in ("attention_core", "experts"):
        assert float(t2[name][0][0]) == pytest.approx(float(t1[name][0][0]) / 2, rel=0.05)


def test_kv_ring_hidden_by_long_attention_exposed_by_short():
    """Ring p2p: cp - 1 steps of the local K and V, each overlapped with 1/cp of the attention core. At 32k tokens
    inside a node the compute covers it; at 4k over 8 nodes (cp = 8 at stride tp = 8) it does not."""
    model = load_model("mixtral-8x7b")
    long = estimate(model, H100, TrainingSpec(seq_len=32768, global_batch=64), 4,
                    ParallelPlan(dp=16, cp=2, ep=8, num_microbatches=4))
    assert long.time.breakdown["comm/cp"] == 0.0
    short = estimate(model, H100, TrainingSpec(seq_len=4096, global_batch=64), 8,
                     ParallelPlan(dp=1, cp=8, tp=8, ep=8, num_microbatches=64))
    assert short.time.breakdown["comm/cp"] > 0.0 and short.scopes["cp"] != "node"


def test_kv_exchange_by_hand():
    """Exposed ring time: (cp - 1) x max(step - core_fwd / cp, 0) per forward pass + (cp - 1) x max(2 step -
    core_bwd / cp, 0) backward; step = 1.0, cp = 4, core 2.0 / 3.0: forward 3 x 0.5, backward 3 x 1.25."""
    c = PlanBatch.of(ParallelPlan(dp=1, cp=4))
    assert float(stg.cp_exchange_seconds(c, 1.0, 2.0, 3.0, 1)[0]) == pytest.approx(3 * 0.5 + 3 * 1.25)
    assert float(stg.cp_exchange_seconds(c, 1.0, 2.0, 3.0, 2)[0]) == pytest.approx(2 * 3 * 0.5 + 3 * 1.25)
    assert float(stg.cp_exchange_seconds(c, 0.1, 2.0, 3.0, 1)[0]) == 0.0


def test_dense_gradients_reduced_over_dp_times_cp():
    """dp = 4, cp = 2 and dp = 8, cp = 1 on 8 ranks sync the same dense gradients over the same 8 ranks."""
    model, training = load_model("mixtral-8x7b"), TrainingSpec(seq_len=8192, global_batch=64)
    a = estimate(model, H100, training, 1, ParallelPlan(dp=4, cp=2, ep=8, zero=1, num_microbatches=16))
    b = estimate(model, H100, training, 1, ParallelPlan(dp=8, ep=8, zero=1, num_microbatches=8))
    for key in ("dp/sync/dense", "dp/sync/expert", "optimizer/step"):
        assert a.time.breakdown[key] == pytest.approx(b.time.breakdown[key])
    assert a.memory.per_stage[0].components["optimizer"] == pytest.approx(b.memory.per_stage[0].components["optimizer"])


def test_cp_search_axis_default_and_explicit():
    model = load_model("mixtral-8x7b")
    short = enumerate_space(model, H100, TrainingSpec(seq_len=4096, global_batch=64), 2)
    assert set(short.fields["cp"].tolist()) == {1}
    long = enumerate_space(model, H100, TrainingSpec(seq_len=CP_MIN_SEQ_LEN, global_batch=64), 2)
    assert set(long.fields["cp"].tolist()) == {1, 2, 4, 8}
    asked = enumerate_space(model, H100, TrainingSpec(seq_len=4096, global_batch=64), 2, SearchOptions(cp=(1, 2)))
    assert set(asked.fields["cp"].tolist()) == {1, 2}
    assert np.all(asked.fields["dp"] * asked.fields["cp"] * asked.fields["tp"] * asked.fields["pp"] == 16)


def test_cp_is_not_runnable():
    problems = unsupported_features(ParallelPlan(dp=2, cp=2), load_model("tiny-moe"))
    assert "parallel.cp=2 (the runtime has no context parallelism)" in problems
