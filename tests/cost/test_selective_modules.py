"""Selective recompute by module (CostOptions.recompute_modules, Megatron-Core's recompute_modules): what each
module drops from the saved activations and what it re-runs, by hand on tiny-mla (4 layers: 1 dense, 3 MoE)."""

from __future__ import annotations

import pytest

from piper_plan.catalog import load_model, load_platform
from piper_plan.cost.evaluate import estimate
from piper_plan.cost.options import CostOptions
from piper_plan.errors import PiperError
from piper_plan.specs import ParallelPlan, TrainingSpec

MODEL = load_model("tiny-mla")
H100 = load_platform("dgx-h100")
TRAINING = TrainingSpec(seq_len=32, global_batch=1)
PLAN = ParallelPlan(mbs=1, num_microbatches=1, recompute="selective")


def _stage(modules, plan=PLAN):
    est = estimate(MODEL, H100, TRAINING, 1, plan, options=CostOptions(recompute_modules=modules))
    return est.memory.per_stage[0].components, est.time.breakdown


def test_mla_up_proj_drops_every_heads_q_k_v():
    """32 tokens x 4 heads x (q 24 + k 24 + v 16) x 2 B = 16,384 B per layer, 4 layers, one micro-batch."""
    default, t_default = _stage(("core_attn",))
    up, t_up = _stage(("core_attn", "mla_up_proj"))
    assert default["activations/attention"] - up["activations/attention"] == pytest.approx(4 * 32 * 4 * 64 * 2)
    assert t_up["compute/recompute"] > t_default["compute/recompute"]       # the up-projections run again


def test_mlp_moe_act_and_layernorm_drop_their_outputs():
    """mlp: the dense layer's SwiGLU intermediates 32 x 3 x 192 x 2 B; moe_act: 3 MoE layers x the experts'
    activation output, 32 tokens x top-2 x 32 x 2 B; layernorm: the QKV input on 4 layers, the MLP input on 1 and
    the router input on 3, 32 x 64 x 2 B each."""
    default, _ = _stage(("core_attn",))
    mlp, _ = _stage(("core_attn", "mlp"))
    assert default["activations/mlp"] - mlp["activations/mlp"] == pytest.approx(32 * 3 * 192 * 2)
    act, _ = _stage(("core_attn", "moe_act"))
    assert default["activations/moe/experts"] - act["activations/moe/experts"] == pytest.approx(3 * 32 * 2 * 32 * 2)
    norm, _ = _stage(("core_attn", "layernorm"))
    dropped = sum(default[k] - norm[k] for k in ("activations/attention", "activations/mlp", "activations/moe/moe_input"))
    assert dropped == pytest.approx((4 + 1 + 3) * 32 * 64 * 2)


def test_modules_only_act_under_selective_recompute():
    none = ParallelPlan(mbs=1, num_microbatches=1)
    assert _stage(("mla_up_proj", "layernorm"), none)[0] == _stage(("core_attn",), none)[0]


def test_an_unknown_module_is_one_clear_error():
    with pytest.raises(PiperError, match="recompute_modules names 'attn'; allowed: core_attn, mla_up_proj"):
        CostOptions(recompute_modules=("attn",))


@pytest.mark.parametrize("model,module,why", [("mixtral-8x7b", "mla_up_proj", "its attention is gqa, not mla"),
                                              ("gpt-22b", "moe_act", "it has no MoE layer")])
def test_a_module_the_model_lacks_is_one_line(model, module, why):
    """Before: priced as nothing, silently (Megatron-Core refuses both: TransformerConfig.__post_init__)."""
    plan = ParallelPlan(dp=8, mbs=1, recompute="selective")
    with pytest.raises(PiperError, match=rf"names {module} \({why}\), which {model} does not have; modules that act on it"):
        estimate(load_model(model), H100, TrainingSpec(seq_len=2048, global_batch=64), 1, plan,
                 options=CostOptions(recompute_modules=("core_attn", module)))


def test_mlp_on_a_model_without_dense_layers_is_megatrons_no_op():
    """Megatron-Core sets recompute_mlp only on layers that are not MoE: accepted and priced as nothing."""
    model, plan = load_model("qwen3-30b-a3b"), ParallelPlan(dp=8, ep=8, mbs=1, recompute="selective")
    training = TrainingSpec(seq_len=2048, global_batch=64)
    with_mlp, without = (estimate(model, H100, training, 1, plan, options=CostOptions(recompute_modules=m))
                         for m in (("core_attn", "mlp"), ("core_attn",)))
    assert with_mlp.time.breakdown == without.time.breakdown and with_mlp.memory == without.memory



def test_shared_experts_drop_all_they_save_and_run_again():
    """Megatron-Core's shared_experts module: tiny-mla's one shared expert per MoE layer keeps nothing (its input
    is the router's) and its forward runs again in backward; a no-op on a model without shared experts."""
    default, t_default = _stage(("core_attn",))
    shared, t_shared = _stage(("core_attn", "shared_experts"))
    assert default["activations/moe/shared"] > 0 and shared["activations/moe/shared"] == 0
    assert t_shared["compute/recompute"] > t_default["compute/recompute"]
    plain = load_model("tiny-moe")              # no shared experts
    plan = ParallelPlan(mbs=1, num_microbatches=1, recompute="selective")
    with_it, without = (estimate(plain, H100, TRAINING, 1, plan, options=CostOptions(recompute_modules=m))
                        for m in (("core_attn", "shared_experts"), ("core_attn",)))
    assert with_it.memory == without.memory and with_it.time == without.time


MOE_BLOCK = ("activations/moe/router", "activations/moe/buffers", "activations/moe/experts", "activations/moe/shared")


def test_moe_keeps_only_the_blocks_input_and_rebuilds_one_layer_at_a_time():
    """Megatron-Core's ``moe`` module checkpoints the whole MoELayer forward (moe_layer.py at 0011998): nothing of
    router, token buffers, routed or shared experts stays saved, the block's input does; in backward one layer's
    block is rebuilt at a time (recompute_working: 1 of the 3 MoE layers, one micro-batch in flight)."""
    default, _ = _stage(("core_attn",))
    block, _ = _stage(("core_attn", "moe"))
    assert sum(default[k] for k in MOE_BLOCK) > 0 and all(block[k] == 0 for k in MOE_BLOCK)
    assert block["activations/moe/moe_input"] == default["activations/moe/moe_input"] > 0
    assert default["activations/recompute_working"] == 0
    assert block["activations/recompute_working"] == pytest.approx(sum(default[k] for k in MOE_BLOCK) / 3)


def test_moe_runs_the_blocks_gemms_and_both_exchanges_again():
    """On 2 ranks (ep 2) the dispatch and combine all-to-alls run in the forward, the backward and once more in
    the recompute: 3/2 of their time without it; the recompute adds router, routed and shared experts' forward.
    moe_act and shared_experts beside it add nothing more (the block's re-run covers them)."""
    training, plan = TrainingSpec(seq_len=32, global_batch=2), ParallelPlan(dp=2, ep=2, mbs=1, recompute="selective")
    t_default, t_block, t_all = (
        estimate(MODEL, H100, training, 1, plan, options=CostOptions(recompute_modules=m)).time.breakdown
        for m in (("core_attn",), ("core_attn", "moe"), ("core_attn", "moe", "moe_act", "shared_experts")))
    for name in ("moe/dispatch/intra_node", "moe/combine/intra_node"):
        assert t_default[name] > 0 and t_block[name] == pytest.approx(1.5 * t_default[name])
    forward = sum(t_default[f"compute/{k}"] for k in ("router", "experts", "shared_experts")) / 3   # fwd = 1/3 of f + b
    assert t_block["compute/recompute"] - t_default["compute/recompute"] > 0.9 * forward
    assert t_all == t_block


def test_moe_on_a_dense_model_is_megatrons_no_op():
    """Only a MoELayer reads ``moe``: a dense model prices it as nothing, and the search treats it so."""
    model, plan = load_model("gpt-22b"), ParallelPlan(dp=8, mbs=1, recompute="selective")
    training = TrainingSpec(seq_len=2048, global_batch=64)
    with_it, without = (estimate(model, H100, training, 1, plan, options=CostOptions(recompute_modules=m))
                        for m in (("core_attn", "moe"), ("core_attn",)))
    assert with_it.time.breakdown == without.time.breakdown and with_it.memory == without.memory
