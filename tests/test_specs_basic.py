"""Specs: cross-field validation names every value; derived numbers are properties."""

import pytest
from pydantic import ValidationError

from piper_plan.catalog import load_model, load_platform
from piper_plan.errors import PiperError
from piper_plan.plans import check_plan
from piper_plan.specs import ParallelPlan, TrainingSpec, even_split

LOCAL = load_platform("local-cpu")


def test_plan_ep_must_divide_dp_tp():
    with pytest.raises(PiperError, match=r"ep x etp = 3 x 1 must divide a stage's dp x cp x tp = 4 x 1 x 1"):
        check_plan(load_model("mixtral-8x7b"), LOCAL, TrainingSpec(global_batch=4), 1, ParallelPlan(dp=4, ep=3,
                                                                                                    num_microbatches=1))


def test_explicit_split_is_a_list_and_only_then():
    assert ParallelPlan(pp=2, layers_per_stage=[1, 3]).layers_split == "explicit"
    with pytest.raises(ValidationError, match="explicit split"):
        ParallelPlan(pp=2, layers_split="explicit")
    with pytest.raises(ValidationError, match="explicit split"):
        ParallelPlan(pp=2, layers_split="even", layers_per_stage=[1, 3])


def test_edp_is_derived():
    assert ParallelPlan(dp=4, pp=2, ep=2).edp == 2
    assert ParallelPlan(dp=4, pp=2, ep=2).world == 8


def test_check_plan_names_every_value():
    model = load_model("mixtral-8x7b")
    plan = ParallelPlan(dp=6, ep=3, num_microbatches=1)
    with pytest.raises(PiperError) as err:
        check_plan(model, load_platform("frontier"), TrainingSpec(global_batch=12), 1, plan)
    text = str(err.value)
    assert "ep=3 must divide num_experts=8" in text
    assert "= 6 must equal the world size 1 nodes x 8 = 8" in text
    assert "num_microbatches=1 must equal global_batch / (dp x mbs) = 12 / (6 x 1)" in text


def test_even_split_puts_extra_layers_late():
    # 10 layers over 4 stages: 2, 2, 3, 3 (stage 0 carries the embedding and the most in-flight micro-batches)
    assert even_split(10, 4) == [2, 2, 3, 3]
    assert sum(even_split(61, 16)) == 61


def test_state_bytes_default_is_papers_16():
    assert TrainingSpec().state_bytes_per_param == 16


def test_expert_parallelism_on_a_dense_model_is_an_error():
    with pytest.raises(PiperError, match=r"ep=2, etp=1: tiny-dense is dense"):
        check_plan(load_model("tiny-dense"), LOCAL, TrainingSpec(global_batch=8), 1,
                   ParallelPlan(dp=2, ep=2, num_microbatches=4))


@pytest.mark.parametrize("layers", [{"every": 2, "phase": 5}, {"first_k_dense": 32}, {"explicit": []}])
def test_a_moe_block_that_selects_no_layer_is_refused(layers):
    """Before: a MoE model with 0 routed experts in its counts, priced with ep 8 and no all-to-all."""
    data = load_model("mixtral-8x7b").model_dump(mode="json")
    data["moe"]["layers"] = layers
    with pytest.raises(ValidationError, match="selects none of the 32 layers"):
        type(load_model("mixtral-8x7b")).model_validate(data)


@pytest.mark.parametrize("field, value", [("weight_bytes", 3), ("grad_bytes", 1), ("grad_bytes", 10**18),
                                          ("master_bytes", 8), ("optimizer_bytes", 64)])
def test_byte_widths_are_real_formats(field, value):
    """Before: a plan file's weight_bytes 3 or grad_bytes 1e18 was read and priced."""
    with pytest.raises(ValidationError, match=field):
        TrainingSpec(**{field: value})


@pytest.mark.parametrize("name, update, needle", [
    ("deepseek-v3", {"head_dim": 64}, "kind=mla takes its widths"),
    ("deepseek-v3", {"num_kv_heads": 8}, "drop head_dim=None and num_kv_heads=8"),
    ("mixtral-8x7b", {"kv_lora_rank": 512}, "kv_lora_rank describe MLA, but kind=gqa"),
])
def test_attention_fields_of_another_kind_are_refused(name, update, needle):
    """Before: silently ignored (an MLA model's head_dim, a GQA model's kv_lora_rank)."""
    from piper_plan.specs.model import AttentionSpec

    data = {**load_model(name).attention.model_dump(mode="json"), **update}
    with pytest.raises(ValidationError, match=needle):
        AttentionSpec.model_validate(data)


@pytest.mark.parametrize("model, attention, needle", [
    ("qwen3-30b-a3b", {"head_dim": 3}, "head_dim=3 is odd"),
    ("deepseek-v3", {"qk_rope_head_dim": 63}, "attention.qk_rope_head_dim=63 is odd"),
])
def test_an_odd_rotary_width_is_refused(model, attention, needle):
    """The runtime's rotary embedding turns pairs of features (found accepted by a fuzzing pass: head_dim 3 in a
    Hugging Face import, qk_rope_head_dim 3 in a model YAML)."""
    spec = load_model(model)
    data = spec.model_dump()
    data["attention"].update(attention)
    with pytest.raises(ValidationError, match=needle):
        type(spec).model_validate(data)
