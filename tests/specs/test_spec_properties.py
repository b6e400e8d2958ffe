"""Tier 3 properties of parameter counting, and YAML <-> spec round trips of the whole catalog."""

import copy

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from piper_plan.catalog import catalog_names, load_model, models_dir, parse_spec, spec_to_yaml
from piper_plan.specs import ModelSpec


@st.composite
def moe_specs(draw):
    """Small random MoE / dense specs (dicts), every knob that changes a count."""
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kv = draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0]))
    experts = draw(st.integers(1, 16))
    data = {
        "name": "prop", "source": "hypothesis",
        "vocab_size": draw(st.none() | st.integers(1, 1000)),
        "hidden_size": heads * 2 * draw(st.integers(1, 8)),       # an even head width (rotary embeddings)
        "num_layers": draw(st.integers(1, 6)),
        "attention": {"kind": "gqa", "num_heads": heads, "num_kv_heads": kv, "qkv_bias": draw(st.booleans())},
        "dense_ffn": {"intermediate_size": draw(st.integers(1, 64)), "gated": draw(st.booleans())},
        "tie_embeddings": draw(st.booleans()),
    }
    if draw(st.booleans()):
        data["moe"] = {"num_experts": experts, "top_k": draw(st.integers(1, experts)),
                       "expert": {"intermediate_size": draw(st.integers(1, 64)), "gated": draw(st.booleans())},
                       "num_shared_experts": draw(st.integers(0, 2)),
                       "layers": {"first_k_dense": draw(st.integers(0, 2)), "every": draw(st.integers(1, 2))}}
        rule = data["moe"]["layers"]
        if not any(i % rule["every"] == 0 for i in range(rule["first_k_dense"], data["num_layers"])):
            rule["first_k_dense"] = 0      # a moe block selects at least one layer (layer 0 here)
    return data


def build(data: dict) -> ModelSpec:
    return ModelSpec.model_validate(data)


def bumped(data: dict, path: tuple[str, ...], delta: int) -> dict:
    """A deep copy of ``data`` with data[path] += delta."""
    out = copy.deepcopy(data)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] += delta
    return out


@settings(max_examples=150, deadline=None)
@given(moe_specs())
def test_active_never_exceeds_total(data):
    spec = build(data)
    assert 0 < spec.active_params <= spec.total_params
    assert spec.params.active_excluding_embedding <= spec.active_params


@settings(max_examples=100, deadline=None)
@given(moe_specs(), st.integers(1, 32))
def test_counts_grow_with_expert_width_and_count(data, delta):
    spec = build(data)
    if not spec.is_moe:
        return
    wider = build(bumped(data, ("moe", "expert", "intermediate_size"), delta))
    assert wider.total_params > spec.total_params and wider.active_params > spec.active_params
    more = build(bumped(data, ("moe", "num_experts"), delta))
    assert more.total_params > spec.total_params
    assert more.active_params >= spec.active_params      # only the router grows per token


@settings(max_examples=100, deadline=None)
@given(moe_specs(), st.integers(1, 8))
def test_counts_grow_with_dense_width_and_hidden_size(data, steps):
    spec = build(data)
    wider = build(bumped(data, ("dense_ffn", "intermediate_size"), steps))
    assert wider.total_params >= spec.total_params
    assert (wider.total_params > spec.total_params) == (spec.num_dense_layers > 0)
    # hidden size grows by whole heads (head_dim = hidden / heads grows too): every matrix grows
    bigger = build(bumped(data, ("hidden_size",), 2 * steps * data["attention"]["num_heads"]))
    assert bigger.total_params > spec.total_params and bigger.active_params > spec.active_params


@settings(max_examples=100, deadline=None)
@given(moe_specs())
def test_top_k_moves_active_only(data):
    spec = build(data)
    if not spec.is_moe or spec.moe.top_k == spec.moe.num_experts:
        return
    more_k = build(bumped(data, ("moe", "top_k"), 1))
    assert more_k.total_params == spec.total_params and more_k.active_params > spec.active_params


def test_every_catalog_model_round_trips_through_yaml():
    for name in catalog_names(models_dir()):
        spec = load_model(name)
        again = parse_spec(ModelSpec, yaml.safe_load(spec_to_yaml(spec)), f"{name} round trip")
        assert again == spec and again.total_params == spec.total_params


@settings(max_examples=50, deadline=None)
@given(moe_specs())
def test_random_specs_round_trip(data):
    spec = build(data)
    assert parse_spec(ModelSpec, yaml.safe_load(spec_to_yaml(spec)), "rt") == spec


def test_moe_fields_that_cannot_hold_together_are_one_line(tmp_path):
    """Before: a capacity factor above num_experts / top_k priced padding no engine computes (Mixtral at 1000: 6,716 s
    a step), and a shared-expert gate or shape with no shared expert was counted (256 gate parameters) or ignored."""
    import pytest

    from piper_plan.errors import PiperError

    base = yaml.safe_load((models_dir() / "tiny-moe.yaml").read_text())
    experts, top_k = base["moe"]["num_experts"], base["moe"]["top_k"]
    assert parse_spec(ModelSpec, {**base, "moe": {**base["moe"], "capacity_factor": experts / top_k}}, "m.yaml")
    for change, needle in (({"capacity_factor": experts / top_k + 0.5}, "is above num_experts / top_k"),
                           ({"num_shared_experts": 0, "shared_expert_gate": True}, "shared_expert_gate: true with "
                            "num_shared_experts=0"),
                           ({"num_shared_experts": 0, "shared_expert": {"intermediate_size": 8}},
                            "shared_expert with num_shared_experts=0")):
        with pytest.raises(PiperError, match=needle) as exc:
            parse_spec(ModelSpec, {**base, "moe": {**base["moe"], **change}}, "m.yaml")
        assert "\n" not in str(exc.value) and "m.yaml" in str(exc.value)
