"""Formulas checked by hand against their published derivations (a review of the cost model, 2026-12-05): each
test fails on the formula as it was before that review."""

from __future__ import annotations

import pytest

from piper_plan.catalog import load_model, load_platform
from piper_plan.cost.evaluate import estimate
from piper_plan.cost.flops import model_flops_per_token
from piper_plan.cost.options import CostOptions
from piper_plan.cost.terms import moe_block_tp_pairs
from piper_plan.specs import ModelSpec, ParallelPlan, TrainingSpec

H100 = load_platform("dgx-h100")


def _with(name: str, **moe) -> ModelSpec:
    data = load_model(name).model_dump()
    data["moe"].update(moe)
    return ModelSpec.model_validate(data)


def test_only_an_moe_block_with_a_dense_ffn_gathers_over_tp():
    """Routed experts run on the rank's sequence shard: an MoE layer of Mixtral (no shared expert) has attention's
    tp pair only, the same layer with one shared expert (split over tp) one pair more, so twice the tp time."""
    assert [moe_block_tp_pairs(load_model(n)) for n in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "arctic")] \
        == [0, 0, 1, 1]
    training = TrainingSpec(seq_len=4096, global_batch=256)
    plan = ParallelPlan(dp=4, tp=4, pp=4, ep=8, mbs=1, num_microbatches=64, zero=1)
    tp_s = [estimate(m, H100, training, 8, plan).time.breakdown["comm/tp"]
            for m in (load_model("mixtral-8x7b"), _with("mixtral-8x7b", num_shared_experts=1))]
    assert tp_s[1] == pytest.approx(2 * tp_s[0], rel=1e-9)


@pytest.mark.parametrize("dropout", [False, True])
def test_the_embedding_keeps_its_ids_and_its_dropout_mask_not_its_output(dropout):
    """The embedding's output is layer 0's norm input, held by the layer: the first stage keeps only the int64 ids
    and, with dropout, the 1-byte mask (gpt-22b at tp 8 without sequence parallelism: s b h bytes)."""
    model = load_model("gpt-22b")
    training = TrainingSpec(seq_len=2048, global_batch=4, dtype="fp16")
    plan = ParallelPlan(tp=8, mbs=4, num_microbatches=1, sequence_parallel=False)
    stage = estimate(model, load_platform("dgx-a100"), training, 1, plan,
                     options=CostOptions(dropout=dropout)).memory.per_stage[0]
    tokens = 4 * 2048
    assert stage.components["activations/embedding"] == tokens * 8 + (tokens * model.hidden_size if dropout else 0)


def test_a_tied_lm_head_is_in_the_model_flops():
    """Narayanan et al. 2021's FLOP count for GPT without activation recompute: 72 l h^2 (1 + s / 6h + V / 12 l h) per
    token, whose
    head is tied to its embedding; piper's count differs by the biases and norms only."""
    model = load_model("gpt-22b")
    assert model.tie_embeddings
    l, h, s, v = model.num_layers, model.hidden_size, 2048, model.vocab_size
    assert model_flops_per_token(model, s) == pytest.approx(72 * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)),
                                                            rel=5e-4)
