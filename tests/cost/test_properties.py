"""Tiers 2-3: hand-derived small cases and properties of the resource model."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from piper_plan.catalog import load_model, load_platform
from piper_plan.cost.comm import Network
from piper_plan.cost.evaluate import estimate, evaluate, plan_of
from piper_plan.plans import PlanBatch
from piper_plan.specs.vocab import LayerSplit, Recompute
from piper_plan.cost.memory import rank_param_counts
from piper_plan.specs import ParallelPlan, PlatformSpec, TrainingSpec

FRONTIER = load_platform("frontier")
NET = Network(FRONTIER)
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


# ---- hand-derived ----------------------------------------------------------------------------------
def test_rank_param_counts_tiny_moe_by_hand():
    """tiny-moe: d 64, 4 layers, 4 heads / 2 KV heads of 16, 8 gated experts of 128, vocab 512, untied.
    attention 64*64 + 2*64*32 + 64*64 = 12288; norms 2*64 = 128; router 64*8 = 512; expert 3*64*128 = 24576;
    embedding = LM head = 512*64 = 32768; final norm 64. pp 2, ep 2: each stage holds 2 layers x 8/2 experts.
    stage 0: dense 2*(12288+128+512) + 32768 = 58624; stage 1: 25856 + 32768 + 64 = 58688; expert 2*4*24576."""
    plan = ParallelPlan(dp=2, pp=2, ep=2, num_microbatches=2)
    counts = rank_param_counts(load_model("tiny-moe"), plan)
    assert counts == [{"dense": 58624, "expert": 196608, "total": 255232},
                      {"dense": 58688, "expert": 196608, "total": 255296}]


def test_rank_param_counts_sum_to_model_total():
    """Summing one rank per (stage, tp slice, expert shard) recovers the model's exact parameter count
    (replicated norms/router counted once per stage)."""
    model = load_model("mixtral-8x7b")
    plan = ParallelPlan(dp=8, pp=4, ep=8, num_microbatches=1)
    counts = rank_param_counts(model, plan)
    assert sum(c["dense"] + c["expert"] * plan.ep for c in counts) == model.total_params


def test_all_reduce_alpha_beta_by_hand():
    """4 ranks in one Frontier node (50 GB/s, 2 us): 2 x 3/4 x 1 MB / 50 GB/s + 2 x 3 x 2 us = 42 us."""
    assert NET.seconds("all_reduce", 4, 1e6, 0) == pytest.approx(42e-6)


def test_state_bytes_zero1_by_hand():
    """tiny-moe, dp 2 = ep 2 (edp 1), ZeRO-1: stage 0 dense 58624 x (2 + 2 + 12/2), expert 196608 x 16."""
    plan = ParallelPlan(dp=2, pp=2, ep=2, num_microbatches=2, zero=1)
    est = estimate(load_model("tiny-moe"), FRONTIER, TrainingSpec(seq_len=64, global_batch=4), 1, plan)
    comp = est.memory.per_stage[0].components
    assert comp["weights"] + comp["gradients"] + comp["optimizer"] == 58624 * 10 + 196608 * 16


# ---- properties ------------------------------------------------------------------------------------
@given(nbytes=st.floats(1.0, 1e10), scope=st.integers(0, 3))
def test_one_rank_communicates_nothing(nbytes, scope):
    for op in OPS:
        assert NET.seconds(op, 1, nbytes, scope) == 0.0
    for algo in (0, 1):
        intra, inter = NET.a2a_seconds(algo, 1, 1, nbytes, scope)
        assert intra == 0.0 and inter == 0.0


@given(sizes=st.lists(st.floats(1.0, 1e10), min_size=2, max_size=8), n=st.integers(2, 1024),
       scope=st.integers(0, 3), nodes=st.integers(1, 64), algo=st.integers(0, 1))
def test_time_monotone_in_bytes(sizes, n, scope, nodes, algo):
    sizes = np.sort(np.array(sizes))
    for op in OPS + ("p2p",):
        assert np.all(np.diff(NET.seconds(op, n, sizes, scope)) >= 0)
    nodes = min(nodes, n)
    intra, inter = NET.a2a_seconds(algo, n, nodes, sizes, scope)
    assert np.all(np.diff(intra + inter) >= -1e-18)


@given(nodes=st.integers(2, 512), per_node=st.sampled_from([1, 2, 4, 8]), nbytes=st.floats(1e3, 1e10),
       scope=st.integers(1, 3))
def test_halo_phase_two_no_slower_than_flat_remote(nodes, per_node, nbytes, scope):
    """HALO's inter-node phase (one NIC-affine message per remote node) is never slower than flat's inter-node
    part; the whole exchange adds the relay copy after it: max(I, II + III), the runtime's schedule."""
    n = nodes * per_node
    local, flat_remote, halo_remote, redistribute = NET.a2a_phases(n, nodes, nbytes, scope)
    assert halo_remote <= flat_remote * (1 + 1e-12)
    assert sum(NET.a2a_seconds(1, n, nodes, nbytes, scope)) == pytest.approx(max(local, halo_remote + redistribute))


@given(per_node=st.sampled_from([2, 4, 8]), nbytes=st.floats(1.0, 1e10))
def test_halo_equals_flat_on_one_node(per_node, nbytes):
    flat = NET.a2a_seconds(0, per_node, 1, nbytes, 0)
    halo = NET.a2a_seconds(1, per_node, 1, nbytes, 0)
    assert flat == halo


def test_halo_faster_with_many_nodes_of_small_messages():
    """At 64 nodes with 1 MB per rank the per-peer flat messages are latency-bound: HALO wins (the paper:
    1.2-9x at 16+ nodes)."""
    flat = sum(NET.a2a_seconds(0, 512, 64, 1e6, 3))
    halo = sum(NET.a2a_seconds(1, 512, 64, 1e6, 3))
    assert flat / halo > 1.2


def _random_candidates(rng, count, world, experts, layers, global_batch=256, max_pp=8):
    """Valid-degree candidates for ``world`` ranks (powers of two), M = global_batch / (dp x mbs)."""
    rows = []
    while len(rows) < count:
        tp = int(rng.choice([1, 2, 4, 8]))
        pp = int(rng.choice([d for d in (1, 2, 4, 8, 16, 32, 64) if d <= min(layers, max_pp)]))
        if world % (tp * pp):
            continue
        dp = world // (tp * pp)
        ep = int(rng.choice([e for e in (1, 2, 4, 8) if experts % e == 0 and (dp * tp) % e == 0]))
        mbs = int(rng.choice([1, 2]))
        if global_batch % (dp * mbs):
            continue
        rows.append((dp, tp, pp, ep, 1, mbs, global_batch // (dp * mbs), int(rng.integers(0, 2)), 1, int(rng.integers(0, 3)),
                     int(rng.integers(0, 2)), int(rng.integers(0, 2))))
    cols = np.array(rows).T
    names = ["dp", "tp", "pp", "ep", "etp", "mbs", "num_microbatches", "schedule", "virtual_stages",
             "recompute", "zero", "a2a"]
    return PlanBatch(**dict(zip(names, cols)), sequence_parallel=1, layers_split=LayerSplit.AUTO.code)


def _with_memory(platform: PlatformSpec, memory_bytes: int) -> PlatformSpec:
    data = platform.model_dump()
    data["device"]["memory_bytes"] = memory_bytes
    return PlatformSpec.model_validate(data)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31), extra_GiB=st.integers(1, 64))
def test_more_memory_never_turns_a_fit_into_a_non_fit(seed, extra_GiB):
    model = load_model("mixtral-8x7b")
    training = TrainingSpec(seq_len=4096, global_batch=256)
    cand = _random_candidates(np.random.default_rng(seed), 32, 64, 8, model.num_layers)
    small = evaluate(model, FRONTIER, training, 8, cand)
    big_platform = _with_memory(FRONTIER, FRONTIER.device.memory_bytes + extra_GiB * 2**30)
    big = evaluate(model, big_platform, training, 8, cand)
    assert np.all(big.fits >= small.fits)
    assert np.array_equal(big.peak_memory_bytes, small.peak_memory_bytes)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-v3", "llama4-maverick", "tiny-mla"])
def test_evaluate_matches_estimate(name):
    """The vectorised path (distinct stage shapes per key, the split chosen per candidate) equals the one-plan
    path (every stage) given the split it chose."""
    model = load_model(name)
    training = TrainingSpec(seq_len=4096, global_batch=512)
    experts = model.moe.num_experts
    cand = _random_candidates(np.random.default_rng(1), 16, 512, experts, model.num_layers, 512, max_pp=64)
    ev = evaluate(model, FRONTIER, training, 64, cand)
    for i in range(len(cand)):
        plan = plan_of(model, training, cand, ev, i)
        one = estimate(model, FRONTIER, training, 64, plan)
        again = evaluate(model, FRONTIER, training, 64, PlanBatch.of(plan))
        assert one.memory.peak_bytes == pytest.approx(float(again.peak_memory_bytes[0]), rel=1e-12)
        assert one.step_time_s == pytest.approx(float(again.step_time_s[0]), rel=1e-12)
        assert ev.step_time_s[i] == pytest.approx(one.step_time_s, rel=1e-12)      # batch == one by one
        assert ev.peak_memory_bytes[i] == pytest.approx(one.memory.peak_bytes, rel=1e-12)
    assert np.all(np.isfinite(ev.step_time_s)) and np.all(ev.step_time_s > 0)


def test_tall_skinny_expert_gemms_are_slow():
    """Few tokens per expert: the roofline makes the expert GEMM memory-bound (Piper paper's observation)."""
    from piper_plan.cost.compute import Rates

    rates = Rates(FRONTIER, "bf16")
    few = rates.gemm_flops_per_s(16, 2048, 7168)
    many = rates.gemm_flops_per_s(8192, 2048, 7168)
    assert few < 0.2 * many


def test_routing_skew_stretches_experts_and_a2a():
    model = load_model("mixtral-8x7b")
    plan = ParallelPlan(dp=8, pp=8, ep=8, num_microbatches=8)
    base = estimate(model, FRONTIER, TrainingSpec(seq_len=4096, global_batch=64), 8, plan)
    skew = estimate(model, FRONTIER, TrainingSpec(seq_len=4096, global_batch=64, routing_skew=1.5), 8, plan)
    for key in ("compute/experts", "moe/dispatch/intra_node"):
        assert skew.time.breakdown[key] > 1.3 * base.time.breakdown[key]


def test_routing_skew_is_capped_where_one_rank_takes_every_copy_it_can():
    """Mixtral (8 experts, top 2) on ep 8: one expert per rank, so a rank receives at most one copy of every token
    of its group: 8 x the mean / 2 = skew 4. Before: skew 1000 priced 100x skew 8 on some terms, not others."""
    from piper_plan.cost.memory import max_routing_skew

    model = load_model("mixtral-8x7b")
    assert max_routing_skew(model.moe, 8) == 4 and max_routing_skew(model.moe, 1) == 1
    plan = ParallelPlan(dp=8, pp=8, ep=8, num_microbatches=8)
    at, past = (estimate(model, FRONTIER, TrainingSpec(seq_len=4096, global_batch=64, routing_skew=s), 8, plan)
                for s in (4.0, 1000.0))
    below = estimate(model, FRONTIER, TrainingSpec(seq_len=4096, global_batch=64, routing_skew=3.0), 8, plan)
    assert past.step_time_s == at.step_time_s and past.memory.peak_bytes == at.memory.peak_bytes
    assert below.step_time_s < at.step_time_s


def test_planner_imports_no_torch_rich_click():
    """A fresh interpreter imports the cost model, the layout and planfile without torch, rich or click."""
    code = ("import sys, piper_plan.cost, piper_plan.cost.evaluate, piper_plan.placement.layout, "
            "piper_plan.planfile; bad = [m for m in ('torch', 'rich', 'click') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_routing_skew_from_histogram_by_hand():
    """8 experts on ep 4 (2 per rank): ranks get 10+30, 20+20, 5+15, 0+60 = 40, 40, 20, 60; mean 40 -> 1.5."""
    from piper_plan.cost.memory import routing_skew_from_histogram

    assert routing_skew_from_histogram([10, 30, 20, 20, 5, 15, 0, 60], 4) == 1.5
    assert routing_skew_from_histogram([7] * 8, 2) == 1.0


@pytest.mark.parametrize("etp", [1, 2, 4, 8])
def test_hfu_never_exceeds_the_fastest_kernel_rate(etp):
    """Roofline fallback: no kernel runs faster than efficiency.gemm x peak, so HFU <= that, for every
    split of the experts (an etp that dropped rows once showed MFU 1.2)."""
    model = load_model("mixtral-8x7b")
    training = TrainingSpec(seq_len=4096, global_batch=256)
    cand = _random_candidates(np.random.default_rng(etp), 24, 64, 8, model.num_layers)
    ok = (cand.dp * cand.tp) % (cand.ep * etp) == 0
    cand = cand.take(ok)
    cand = PlanBatch.from_arrays({**cand.arrays(), "etp": np.full(len(cand), etp)})
    ev = evaluate(model, FRONTIER, training, 8, cand)
    cap = max(FRONTIER.efficiency.gemm, FRONTIER.efficiency.attention)
    assert len(cand) > 0 and np.all(ev.hfu <= cap) and np.all(ev.mfu <= cap)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-v3", "tiny-mla", "llama4-scout"])
def test_hfu_at_least_mfu_in_both_conventions(name):
    """HFU = MFU's FLOPs + what recomputation repeats, in the same convention, so HFU >= MFU for every plan
    (equal without recompute); the megatron convention halves the causal scores, so it never exceeds PaLM's."""
    model = load_model(name)
    training = TrainingSpec(seq_len=4096 if name != "tiny-mla" else 64, global_batch=256)
    cand = _random_candidates(np.random.default_rng(7), 24, 64, 8, model.num_layers)
    cand = cand.take((cand.dp * cand.tp) % cand.ep == 0)
    ev = evaluate(model, FRONTIER, training, 8, cand)
    assert len(cand) > 0
    for mfu, hfu in ((ev.mfu, ev.hfu), (ev.mfu_megatron, ev.hfu_megatron)):
        assert np.all(hfu >= mfu)
        none, full = cand.recompute == Recompute.NONE.code, cand.recompute == Recompute.FULL.code
        assert np.allclose(hfu[none], mfu[none]) and np.all(hfu[full] > mfu[full])
    assert np.all(ev.mfu_megatron < ev.mfu)


@pytest.mark.parametrize("modules, rises", [(("mla_up_proj",), True), (("mla_up_proj", "mlp", "moe_act"), True),
                                             (("layernorm", "moe_act"), False), (("core_attn",), False),
                                             (("shared_experts",), True), (("moe",), True)])
def test_selective_recompute_of_gemm_modules_raises_hfu(modules, rises):
    """DeepSeek-V3 (MLA, 3 dense layers): re-running the up-projections, the dense MLPs or the MoE block is GEMM
    work HFU counts; norms, the experts' activation and (under flash attention) the core hold none. Before: HFU ==
    MFU for all."""
    from piper_plan.cost.options import CostOptions

    model = load_model("deepseek-v3")
    plan = ParallelPlan(dp=8, pp=8, ep=8, num_microbatches=32, recompute="selective")
    ev = estimate(model, FRONTIER, TrainingSpec(seq_len=4096, global_batch=256), 8, plan,
                  options=CostOptions(recompute_modules=modules))
    for mfu, hfu in ((ev.mfu, ev.hfu), (ev.mfu_megatron, ev.hfu_megatron)):
        assert (hfu > mfu * (1 + 1e-6)) if rises else hfu == pytest.approx(mfu)


def test_in_flight_by_schedule_by_hand():
    """GPipe: all M; 1F1B: min(pp - i, M); interleaved stage 0 (pp 8, v 3, M 64): (8-1)x2 + (3-1)x8 + 1 = 31
    chunks of 1/3 stage = 10.33 stages' worth = pp (1 + (p - 1)/(p v)) (Korthikanti et al. 2022, sec. 4.2.3)."""
    from piper_plan.cost.memory import in_flight

    stage = np.array([0, 3, 7])
    assert in_flight(np.zeros(3, int), stage, 8, 64, 1).tolist() == [64, 64, 64]
    assert in_flight(np.ones(3, int), stage, 8, 64, 1).tolist() == [8, 5, 1]
    assert in_flight(np.ones(3, int), stage, 8, 4, 1).tolist() == [4, 4, 1]
    inter = in_flight(np.full(3, 2), stage, 8, 64, 3)
    assert inter[0] == pytest.approx(8 * (1 + 7 / 24))
    assert inter.tolist() == pytest.approx([31 / 3, 25 / 3, 17 / 3])


def test_loss_in_flight_by_schedule():
    """The last stage holds the logits of all M micro-batches under GPipe, of one under 1F1B and interleaved 1F1B
    (its loss chunk runs a forward, then at once its backward), though interleaving keeps (v - 1) pp + 1 chunks of
    its layers in flight (pp 2, v 24, M 32: 47 / 24 stages' worth)."""
    from piper_plan.cost.memory import in_flight, loss_in_flight

    schedules = np.array([0, 1, 2])
    assert loss_in_flight(schedules, 32).tolist() == [32, 1, 1]
    assert in_flight(np.array([2]), np.array([1]), 2, 32, 24)[0] == pytest.approx(47 / 24)


def test_interleaved_last_stage_keeps_one_micro_batch_of_logits():
    """Qwen3-30B-A3B on 16 H100s, pp 2, dp 8, mbs 2, interleaved v 24: the last stage's logits are one
    micro-batch's fp32 softmax, 2 x 4096 tokens x 151,936 vocabulary x 4 B (Megatron's vocab-parallel cross
    entropy), in both pricing paths (the search's affine memory and estimate's per-stage detail)."""
    from piper_plan.cost.evaluate import estimate, evaluate
    from piper_plan.plans import PlanBatch
    from piper_plan.specs import ParallelPlan

    model, h100 = load_model("qwen3-30b-a3b"), load_platform("dgx-h100")
    training = TrainingSpec(seq_len=4096, global_batch=512, grad_bytes=4)
    plan = ParallelPlan(dp=8, pp=2, ep=8, mbs=2, num_microbatches=32, schedule="interleaved", virtual_stages=24)
    est = estimate(model, h100, training, 2, plan)
    assert est.memory.per_stage[1].components["activations/logits"] == pytest.approx(2 * 4096 * 151936 * 4)
    ev = evaluate(model, h100, training, 2, PlanBatch.of(plan))
    assert ev.peak_memory_bytes[0] == pytest.approx(est.memory.peak_bytes)


def test_mla_attention_activations_by_hand():
    """tiny-mla, tp 1, one sequence of 32, bf16, flash: per token norm input + q/kv input (2 x 64), latent
    (32 + 16 + 8) before and after its norms (2 x 56), q and k (2 x 4 x 24), v (4 x 16), output (4 x 16):
    128 + 112 + 192 + 64 + 64 = 560 elements x 2 B + fp32 log-sum-exp 4 heads x 4 B = 1136 B per token."""
    from piper_plan.cost.memory import attention_activation_bytes
    from piper_plan.cost.options import CostOptions

    kept, core = attention_activation_bytes(load_model("tiny-mla"), TrainingSpec(seq_len=32), CostOptions(), 1, 1, 1)
    assert kept == 32 * 1136 and core == 0


def test_mla_flops_per_token_by_hand():
    """PaLM for tiny-mla at s = 32: 6 N (N = active minus embedding) + 6 L H (qk + v) s = 6 N + 6 x 4 x 4 x 40 x 32."""
    from piper_plan.cost.flops import model_flops_per_token

    model = load_model("tiny-mla")
    n = model.params.active_excluding_embedding
    assert model_flops_per_token(model, 32) == 6 * n + 6 * 4 * 4 * (24 + 16) * 32


@pytest.mark.parametrize("name", ["deepseek-v3", "llama4-maverick", "tiny-mla"])
def test_distinct_stages_cover_every_pp(name):
    """For pipeline depths 1..8, every fifth beyond and L - 1, L (uneven and balanced splits included),
    evaluate's distinct stage shapes find the same peak memory and bottleneck time as estimate's walk over all
    stages of the chosen split."""
    model = load_model(name)
    training = TrainingSpec(seq_len=1024, global_batch=64)
    L = model.num_layers
    for pp in sorted({*range(1, min(L, 8) + 1), *range(9, L + 1, 5), L - 1, L}):
        plan = ParallelPlan(dp=8, pp=pp, ep=8, num_microbatches=8)
        cand = PlanBatch.of(plan)
        ev = evaluate(model, FRONTIER, training, pp, cand)
        one = estimate(model, FRONTIER, training, pp, plan_of(model, training, cand, ev, 0))
        assert ev.peak_memory_bytes[0] == pytest.approx(one.memory.peak_bytes, rel=1e-12), pp
        assert ev.step_time_s[0] == pytest.approx(one.step_time_s, rel=1e-12), pp


def test_split_choice_fits_first_then_faster():
    """choose_split by hand: [even, balanced] peaks and stage times per candidate."""
    from piper_plan.cost.batch import choose_split

    peak = np.array([[10.0, 10.0, 30.0, 10.0, 30.0], [10.0, 30.0, 10.0, 10.0, 20.0]])
    secs = np.array([[2.0, 2.0, 2.0, 1.0, 2.0], [1.0, 1.0, 3.0, -np.inf, 1.0]])
    # both fit, balanced faster -> 1; balanced overflows -> 0; only balanced fits -> 1; no balanced -> 0;
    # neither fits -> the smaller peak (balanced)
    auto = np.full(5, LayerSplit.AUTO.code)
    assert choose_split(peak, secs, 16.0, auto).tolist() == [1, 0, 1, 0, 1]
    # a plan that names its split keeps it (balanced where it exists)
    assert choose_split(peak, secs, 16.0, auto * 0 + LayerSplit.EVEN.code).tolist() == [0] * 5
    assert choose_split(peak, secs, 16.0, auto * 0 + LayerSplit.BALANCED.code).tolist() == [1, 1, 1, 0, 1]


def test_balanced_split_lowers_deepseek_bottleneck():
    """DeepSeek-V3 (3 dense layers, LM head on the last stage), pp=8, 1F1B: the search prices the FLOP-
    balanced split, which is faster than the even one, and estimate agrees with each."""
    from piper_plan.cost.pipeline import balanced_stage_layers

    model = load_model("deepseek-v3")
    training = TrainingSpec(seq_len=4096, global_batch=512)
    plan = ParallelPlan(dp=32, pp=8, ep=32, num_microbatches=16)
    cand = PlanBatch.of(plan)
    ev = evaluate(model, FRONTIER, training, 32, cand)
    even = estimate(model, FRONTIER, training, 32, plan.model_copy(update={"layers_split": "even"}))
    bal = estimate(model, FRONTIER, training, 32, ParallelPlan(**{**plan.model_dump(), "layers_split": "explicit",
                                                                  "layers_per_stage": balanced_stage_layers(model, 4096, 8)}))
    auto = estimate(model, FRONTIER, training, 32, plan)
    assert bal.step_time_s < even.step_time_s
    chosen = bal if int(ev.layers_split[0]) == 1 else even
    assert float(ev.step_time_s[0]) == pytest.approx(chosen.step_time_s, rel=1e-12)
    assert auto.step_time_s == chosen.step_time_s and auto.layers_per_stage == chosen.layers_per_stage
    assert float(ev.step_time_s[0]) <= even.step_time_s


def test_halo_phases_use_node_calibration_and_say_so(tmp_path):
    """A collectives.csv with all_to_all rows at the node scope prices HALO's intra-node phases I and III
    from that curve (here 10x slower than the platform's figures, so the intra-node part grows), and the
    estimate names its source; without rows it falls back to the platform's network figures."""
    pytest.importorskip("pandas")
    from piper_plan.calibration import load_calibration

    import shutil

    from piper_plan.catalog import calibration_dir

    model = load_model("mixtral-8x7b")
    training = TrainingSpec(seq_len=4096, global_batch=64)
    plan = ParallelPlan(dp=16, pp=1, ep=16, num_microbatches=4, a2a="halo")     # 16 ranks over 2 nodes
    dirs = {}
    for name in ("plain", "node"):
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
        for f in ("gemm.csv", "attention.csv"):
            shutil.copy(calibration_dir("frontier") / f, dirs[name] / f)
    bw = FRONTIER.network.scopes["node"].bandwidth_GBps * 1e9 / 10       # 10x slower than the spec
    rows = ["op,scope,num_nodes,ranks_per_node,bytes_per_rank,seconds,algbw_GBps,busbw_GBps,source"]
    for size in (2**20, 2**26, 2**32):
        secs = size * 7 / 8 / bw
        rows.append(f"all_to_all,node,1,8,{size},{secs},{size / secs / 1e9},{size * 7 / 8 / secs / 1e9},test")
    (dirs["node"] / "collectives.csv").write_text("\n".join(rows) + "\n")
    base = estimate(model, FRONTIER, training, 2, plan, calibration=load_calibration(dirs["plain"]))
    assert base.sources.a2a == "HALO phases I/III: platform network figures (alpha-beta); " \
                                     "phase II: platform network figures (alpha-beta)"
    slow = estimate(model, FRONTIER, training, 2, plan, calibration=load_calibration(dirs["node"]))
    assert slow.sources.a2a.startswith("HALO phases I/III: calibration all_to_all@node")
    intra = lambda r: sum(v for k, v in r.time.breakdown.items() if k.endswith("intra_node"))  # noqa: E731
    assert intra(slow) > 2 * intra(base)


def test_optimizer_framework_overhead_is_priced():
    """With a measured overhead.csv the optimizer step pays one call per gradient group, a + b x tensors each,
    times the host slowdown. tiny-moe on one stage: 4 layers; dense group = embedding + final norm + LM head +
    per layer (2 norms + q k v o + router) ... counted by param_tensors_per_layer; expert group = the stacked
    expert weights of every MoE layer."""
    from dataclasses import replace as dc_replace

    from piper_plan.calibration import load_calibration
    from piper_plan.calibration.overhead import load_overhead
    from piper_plan.catalog import calibration_dir
    from piper_plan.cost.overhead import expert_tensors_per_layer, param_tensors_per_layer, ranks_per_host

    model, local = load_model("tiny-moe"), load_platform("local-cpu")
    training = TrainingSpec.for_device("cpu", seq_len=64, global_batch=4)
    import copy

    ov = load_overhead(calibration_dir("local-cpu"))
    cal, silent = load_calibration("local-cpu"), None
    cal.overhead = ov
    silent = copy.copy(cal)
    silent.overhead = dc_replace(ov, optimizer_s=0.0, optimizer_per_tensor_s=0.0)
    plan = ParallelPlan(dp=2, ep=2, num_microbatches=2)
    priced = estimate(model, local, training, 1, plan, calibration=cal).time.breakdown["optimizer/step"]
    none = estimate(model, local, training, 1, plan, calibration=silent)
    dense_t, moe_t = param_tensors_per_layer(model)
    expert_t = expert_tensors_per_layer(model)
    layers, moe_layers = model.num_layers, model.num_moe_layers
    dense = (layers - moe_layers) * dense_t + moe_layers * (moe_t - expert_t) + 3
    expert = moe_layers * expert_t
    by_hand = (2 * ov.optimizer_s + ov.optimizer_per_tensor_s * (dense + expert)) * ov.slowdown(
        ranks_per_host(local, 2))
    assert priced - none.time.breakdown["optimizer/step"] == pytest.approx(float(by_hand), rel=1e-9)
    assert by_hand > 0


def test_hsdp_shards_dense_state_over_the_shard_group_and_all_reduces_across_replicas():
    """dp_replicate r: the dense optimizer state per rank grows r-fold (sharded over dp / r), expert state does
    not change, and the dense sync adds an all-reduce over the r replicas (plans.PlanBatch.dense_shard)."""
    from piper_plan.cost.evaluate import estimate

    model, training = load_model("mixtral-8x7b"), TrainingSpec()
    base = ParallelPlan(dp=32, pp=2, ep=8, num_microbatches=32, zero=3)
    one, two = (estimate(model, FRONTIER, training, 8, base.model_copy(update={"dp_replicate": r})) for r in (1, 2))
    stage = lambda e: e.memory.per_stage[0].components  # noqa: E731
    grow = stage(two)["optimizer"] - stage(one)["optimizer"]
    assert grow > 0 and two.time.breakdown["dp/sync/dense"] != one.time.breakdown["dp/sync/dense"]
    four = estimate(model, FRONTIER, training, 8, base.model_copy(update={"dp_replicate": 4}))
    assert stage(four)["optimizer"] - stage(one)["optimizer"] == pytest.approx(3 * grow, rel=1e-9)


def test_a_dense_model_syncs_no_expert_gradients():
    """Before: 2.8e-05 s of dp/sync/expert (an empty all-reduce's latency) on a model with no experts."""
    est = estimate(load_model("tiny-dense"), load_platform("dgx-h100"), TrainingSpec(global_batch=64), 1,
                   ParallelPlan(dp=8, num_microbatches=8))
    assert est.time.breakdown["dp/sync/expert"] == 0.0 and est.time.breakdown["dp/sync/dense"] > 0.0


def test_the_runtimes_autocast_copies_are_priced_by_hand_and_only_where_it_makes_them():
    """piper's runtime under bf16 autocast (zero 0 / 1 on a GPU) casts its fp32 weights once per step, each
    micro-batch's 16-bit weight gradient to fp32, and adds it to the held gradient from the second micro-batch on:
    (4 + 2) (1 + m) + 3 x 4 (m - 1) bytes per parameter of the rank at the device's bandwidth (on an H200, 38.7 of
    121 ms a step, docs/gpu-check.md). Megatron's kernels, FSDP2 (zero 2 / 3) and CPU runs (fp32 there) have none."""
    from piper_plan.cost.options import PIPER_RUNTIME_OPTIONS, CostOptions

    model, h200 = load_model("tiny-moe"), load_platform("h200")
    plan = ParallelPlan(dp=8, ep=8, num_microbatches=4)
    training = TrainingSpec(seq_len=64, global_batch=32)

    def copies(platform=h200, training=training, plan=plan, options=PIPER_RUNTIME_OPTIONS):
        return estimate(model, platform, training, 1, plan, options=options).time.breakdown["precision/copies"]

    (rank,) = rank_param_counts(model, plan)
    by_hand = (rank["dense"] + rank["expert"]) * ((4 + 2) * (1 + 4) + 3 * 4 * 3) / (4800e9)
    assert copies() == pytest.approx(by_hand, rel=1e-12) and by_hand > 0
    whole = estimate(model, h200, training, 1, plan, options=PIPER_RUNTIME_OPTIONS)
    assert whole.step_time_s == pytest.approx(sum(whole.time.breakdown.values()), rel=1e-9)
    assert copies(options=CostOptions()) == 0.0                                # Megatron-Core's kernels
    fsdp = plan.model_copy(update={"zero": 2})                                # FSDP2, pp 1: a copy per micro-batch
    (shard,) = rank_param_counts(model, fsdp)
    assert copies(plan=fsdp) == pytest.approx((shard["dense"] + shard["expert"]) * (2 + 4) * 4 / 4800e9, rel=1e-12)
    piped = ParallelPlan(dp=4, pp=2, ep=4, zero=3, num_microbatches=4)      # pp > 1: accumulated, then one copy
    stage = max(rank_param_counts(model, piped), key=lambda r: r["dense"] + r["expert"])
    per_param = (2 + 4) + (4 + 2 + 4) * 3 + (4 + 4)
    assert copies(plan=piped) == pytest.approx((stage["dense"] + stage["expert"]) * per_param / 4800e9, rel=1e-12)
    alone = plan.model_copy(update={"zero": 2, "dp": 1, "ep": 1})            # dp 1: no FSDP2, autocast as zero 0
    (whole,) = rank_param_counts(model, alone)
    assert copies(plan=alone) == pytest.approx((whole["dense"] + whole["expert"]) * 66 / 4800e9, rel=1e-12)
    assert copies(training=training.model_copy(update={"dtype": "fp16"})) == pytest.approx(by_hand, rel=1e-12)
    cpu = TrainingSpec.for_device("cpu", seq_len=64, global_batch=32)
    assert copies(platform=load_platform("local-cpu"), training=cpu, plan=plan.model_copy(update={"dp": 1,
                                                                                                   "ep": 1})) == 0.0
