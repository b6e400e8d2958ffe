"""Hugging Face config.json import: counts equal transformers' own count of the same config.

The integers below were measured with scripts/check_hf_counts.py (transformers 5.24.0, models built on
the meta device: sum of numel; active = total - routed experts + routed experts x top_k / E); arctic and
deepseek (v1) are not in transformers: arctic is models.md's hand-derived integer, deepseek-moe-16b is
checked against its published 16.4B / 2.8B (DeepSeekMoE arXiv:2401.06066). test_hf_counts_transformers.py
re-measures them whenever transformers is installed.
"""

import json
import math
from pathlib import Path

import pytest

from piper_plan.catalog import load_model, parse_spec, spec_to_yaml
from piper_plan.errors import PiperError
from piper_plan.hf_import import SUPPORTED_MODEL_TYPES, import_hf_file, spec_from_hf_config
from piper_plan.specs import ModelSpec

FIXTURES = Path(__file__).parent / "fixtures"

TRANSFORMERS_COUNTS = {
    "dbrx-base.json": (131_596_523_520, 36_469_708_800),          # DBRX blog: 132B / 36B
    "deepseek-v2.json": (235_741_434_880, 21_375_800_320),
    "deepseek-v3.json": (671_026_404_352, 37_552_282_624),
    "gpt-oss-20b.json": (20_914_757_184, 4_187_440_704),          # OpenAI model card: 20.9B (3.6B active w/o embedding)
    "kimi-k2.json": (1_026_408_209_408, 32_861_477_888),          # built as deepseek_v3
    "llama-3.1-8b.json": (8_030_261_248, 8_030_261_248),
    "llama4-maverick.json": (400_711_848_960, 17_184_691_200),
    "llama4-scout-multimodal.json": (107_769_861_120, 17_172_894_720),
    "llama4-scout.json": (107_769_861_120, 17_172_894_720),
    "mistral-7b-v0.1.json": (7_241_732_096, 7_241_732_096),
    "mixtral-8x22b.json": (140_620_634_112, 39_152_031_744),
    "mixtral-8x7b.json": (46_702_792_704, 12_879_925_248),
    "olmoe-1b-7b-0924.json": (6_919_161_856, 1_282_017_280),     # OLMoE paper: 6.9B / 1.3B
    "qwen1.5-moe-a2.7b.json": (14_315_784_192, 2_689_173_504),   # Qwen blog: 14.3B / 2.7B
    "qwen2-7b.json": (7_615_616_512, 7_615_616_512),
    "qwen3-30b-a3b.json": (30_532_122_624, 3_353_032_704),       # Qwen3 report: 30.5B / 3.3B
    "qwen3-8b.json": (8_190_735_360, 8_190_735_360),
    # small variants that exercise the flags (biases, head_dim, tied embeddings, layer rules)
    "variants/dbrx-tiny.json": (181_440, 126_144),
    "variants/deepseek-v2-lite-bias.json": (250_720, 176_992),
    "variants/deepseek-v3-no-dense.json": (286_432, 138_976),
    "variants/gpt-oss-tiny.json": (159_840, 109_664),
    "variants/llama-biases-tied.json": (166_464, 166_464),
    "variants/llama4-text-explicit.json": (206_912, 170_048),
    "variants/mistral-head-dim.json": (188_992, 188_992),
    "variants/mixtral-tied-head-dim.json": (239_168, 165_440),
    "variants/olmoe-gqa.json": (281_536, 134_080),
    "variants/qwen2-moe-sparse-step.json": (184_832, 160_256),
    "variants/qwen2-tied.json": (140_352, 140_352),
    "variants/qwen3-bias.json": (132_224, 132_224),
    "variants/qwen3-moe-head-dim.json": (244_544, 195_392),
}


@pytest.mark.parametrize("fixture", sorted(TRANSFORMERS_COUNTS))
def test_import_equals_transformers_count(fixture):
    spec = import_hf_file(FIXTURES / fixture)
    assert (spec.total_params, spec.active_params) == TRANSFORMERS_COUNTS[fixture]


@pytest.mark.parametrize("fixture, catalog", [
    ("mixtral-8x7b.json", "mixtral-8x7b"), ("mixtral-8x22b.json", "mixtral-8x22b"),
    ("deepseek-v2.json", "deepseek-v2"), ("deepseek-v3.json", "deepseek-v3"), ("kimi-k2.json", "kimi-k2"),
    ("llama4-scout.json", "llama4-scout"), ("llama4-scout-multimodal.json", "llama4-scout"),
    ("llama4-maverick.json", "llama4-maverick"), ("arctic.json", "arctic"),
])
def test_published_configs_import_to_the_catalog_counts(fixture, catalog):
    imported, listed = import_hf_file(FIXTURES / fixture), load_model(catalog)
    assert imported.params == listed.params
    assert imported.moe_layers == listed.moe_layers


def test_deepseek_v1_matches_published_headline():
    # DeepSeekMoE 16B (arXiv:2401.06066): 16.4B total, 2.8B active; tolerance 1% (printed to 3 digits).
    spec = import_hf_file(FIXTURES / "deepseek-moe-16b.json")
    assert math.isclose(spec.total_params, 16.4e9, rel_tol=0.01)
    assert math.isclose(spec.active_params, 2.8e9, rel_tol=0.02)
    assert spec.moe_layers == tuple(range(1, 28))


def test_every_supported_type_has_a_fixture():
    types = set()
    for path in FIXTURES.rglob("*.json"):
        cfg = json.loads(path.read_text())
        types.add(cfg["model_type"])
    assert set(SUPPORTED_MODEL_TYPES) <= types


def test_layer_rules_follow_the_reference_code():
    qwen = import_hf_file(FIXTURES / "variants/qwen2-moe-sparse-step.json")
    assert qwen.moe_layers == (1,)          # (i + 1) % 2 == 0 -> 1, 3; layer 3 is in mlp_only_layers
    llama4 = import_hf_file(FIXTURES / "variants/llama4-text-explicit.json")
    assert llama4.moe_layers == (1, 2)      # explicit moe_layers


def test_unsupported_model_type_names_the_supported_ones():
    with pytest.raises(PiperError) as err:
        import_hf_file(FIXTURES / "grok-1.json")
    text = str(err.value)
    assert "grok-1.json" in text and "model_type" in text
    assert all(t in text for t in SUPPORTED_MODEL_TYPES)


def test_missing_and_bad_fields_name_the_field():
    cfg = json.loads((FIXTURES / "mixtral-8x7b.json").read_text())
    del cfg["num_local_experts"]
    with pytest.raises(PiperError, match=r"cfg.json: num_local_experts: missing field"):
        spec_from_hf_config(cfg, "cfg.json")
    cfg = json.loads((FIXTURES / "dbrx-base.json").read_text())
    cfg["ffn_config"]["moe_top_k"] = 0
    with pytest.raises(PiperError, match=r"ffn_config.moe_top_k: must be an integer >= 1, got 0"):
        spec_from_hf_config(cfg, "cfg.json")


def test_name_comes_from_name_or_path_or_file():
    cfg = json.loads((FIXTURES / "mixtral-8x7b.json").read_text())
    assert spec_from_hf_config(cfg, "x/config.json").name == "x"
    named = {**cfg, "_name_or_path": "mistralai/Mixtral-8x7B-v0.1"}
    assert spec_from_hf_config(named, "c.json").name == "mixtral-8x7b-v0.1"
    assert spec_from_hf_config(cfg, "c.json", name="mine").name == "mine"


@pytest.mark.parametrize("fixture", sorted(TRANSFORMERS_COUNTS)[:6])
def test_imported_spec_round_trips_through_yaml(fixture):
    import yaml

    spec = import_hf_file(FIXTURES / fixture)
    assert parse_spec(ModelSpec, yaml.safe_load(spec_to_yaml(spec)), "roundtrip") == spec


@pytest.mark.parametrize("fixture, extra, expected", [
    ("mistral-7b-v0.1.json", {"sliding_window": 4096}, (4096, 1)),          # Mistral 7B v0.1's: every layer
    ("mixtral-8x7b.json", {"sliding_window": 4096}, (4096, 1)),
    ("mixtral-8x7b.json", {"sliding_window": None}, (None, 1)),             # Mixtral 8x7B's own: none
    ("qwen2-7b.json", {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 0}, (4096, 1)),
    ("qwen2-7b.json", {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 28}, (None, 1)),
    ("qwen2-7b.json", {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 0}, (None, 1)),
    ("qwen3-30b-a3b.json", {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 0}, (4096, 1)),
])
def test_a_configs_sliding_window_is_imported_not_dropped(fixture, extra, expected):
    """Mistral / Mixtral slide in every layer when sliding_window is set; Qwen2 / Qwen3 from max_window_layers on
    with use_sliding_window (before: every one imported as full attention)."""
    path = Path(__file__).parent / "fixtures" / fixture
    spec = spec_from_hf_config({**json.loads(path.read_text()), **extra}, str(path))
    assert (spec.attention.sliding_window, spec.attention.sliding_window_every) == expected


def test_a_qwen_window_from_a_middle_layer_is_one_error():
    path = Path(__file__).parent / "fixtures" / "qwen2-7b.json"
    config = {**json.loads(path.read_text()), "use_sliding_window": True, "sliding_window": 4096,
              "max_window_layers": 14}
    with pytest.raises(PiperError, match="piper states every layer or every n-th from layer 0") as info:
        spec_from_hf_config(config, str(path))
    assert info.value.field == "max_window_layers"


def test_sliding_window_layers_from_layer_types():
    """gpt-oss's layer_types (sliding, full, sliding, ...) -> a 128-key window on every other layer; a pattern the
    spec cannot state is one clear error."""
    path = Path(__file__).parent / "fixtures" / "gpt-oss-20b.json"     # its config, with gpt-oss-120b's layer_types
    config = {**json.loads(path.read_text()),
              "layer_types": ["sliding_attention", "full_attention"] * 12}
    spec = spec_from_hf_config(config, str(path))
    assert (spec.attention.sliding_window, spec.attention.sliding_window_every) == (128, 2)
    odd = {**config, "layer_types": ["full_attention"] + ["sliding_attention"] * 23}
    with pytest.raises(PiperError, match="layer_types"):
        spec_from_hf_config(odd, str(path))


def test_group_limited_routing_only_where_the_config_routes_by_groups():
    """DeepSeek-V2's group_limited_greedy and V3's noaux_tc limit routing to topk_group of n_group groups; "greedy"
    (V2-Lite) ignores the groups (the reference modeling code's topk_method switch), and transformers' null
    n_group / topk_group mean no groups."""
    base = json.loads((FIXTURES / "deepseek-v2.json").read_text())
    limited = spec_from_hf_config(base, "v2.json").moe
    assert (limited.routing_groups, limited.routing_group_top_k, limited.routing_group_score_top) == (8, 3, 1)
    for change in ({"topk_method": "greedy"}, {"n_group": None, "topk_group": None}):
        assert spec_from_hf_config({**base, **change}, "v2.json").moe.routing_groups is None, change


GPT_OSS = json.loads((FIXTURES / "gpt-oss-20b.json").read_text())      # 24 layers, sliding_window 128


@pytest.mark.parametrize("layer_types, needle", [
    (["sliding_attention"], "got a list of 1"),                                   # was: a window on every layer
    (["sliding_attention", "full_attention", "full_attention"], "got a list of 3"),  # was: every 3rd layer
    (["sliding_attention", "full_attention"] * 50, "got a list of 100"),
    (["sliding_attention", "bogus"] * 12, "entry 1 is 'bogus'"),
    ([1, 2] * 12, "entry 0 is 1"),                                                 # was: silently no window
    ("sliding_attention", "got 'sliding_attention'"),
    ([], "got a list of 0")])
def test_layer_types_one_known_type_per_layer(layer_types, needle):
    """layer_types is refused in one line naming the file, the field and the allowed types unless it holds one of
    sliding_attention / full_attention for each of num_hidden_layers layers."""
    with pytest.raises(PiperError) as err:
        spec_from_hf_config({**GPT_OSS, "layer_types": layer_types}, "cfg.json")
    text = str(err.value)
    assert text.startswith("cfg.json: layer_types: ") and needle in text, text
    assert "sliding_attention, full_attention" in text and "\n" not in text


def test_layer_types_checked_without_a_window():
    """A null sliding_window builds no window, but a broken layer_types is still bad input."""
    with pytest.raises(PiperError, match="layer_types: entry 0 is 'bogus'"):
        spec_from_hf_config({**GPT_OSS, "sliding_window": None, "layer_types": ["bogus"] * 24}, "cfg.json")
    every = spec_from_hf_config({**GPT_OSS, "sliding_window": None, "layer_types": ["sliding_attention"] * 24}, "c")
    assert every.attention.sliding_window is None


DEEPSEEK_V3 = json.loads((FIXTURES / "deepseek-v3.json").read_text())


@pytest.mark.parametrize("field, value, allowed", [
    ("scoring_func", "sigmoidd", "softmax, sigmoid"), ("scoring_func", 1, "softmax, sigmoid"),
    ("scoring_func", None, "softmax, sigmoid"),
    ("topk_method", "noaux-tc", "greedy, group_limited_greedy, noaux_tc"),
    ("topk_method", ["noaux_tc"], "greedy, group_limited_greedy, noaux_tc")])
def test_unknown_routing_names_are_refused(field, value, allowed):
    """An unknown scoring_func / topk_method was read as softmax / as no group routing; now one line naming the
    file, the field, the value and the allowed names."""
    with pytest.raises(PiperError) as err:
        spec_from_hf_config({**DEEPSEEK_V3, field: value}, "cfg.json")
    assert str(err.value) == f"cfg.json: {field}: must be one of {allowed}, got {value!r}"


@pytest.mark.parametrize("change, scoring, groups", [
    ({}, "sigmoid", 8), ({"scoring_func": "softmax", "topk_method": "group_limited_greedy"}, "softmax", 8),
    ({"topk_method": "greedy"}, "sigmoid", None)])
def test_known_routing_names_still_import(change, scoring, groups):
    moe = spec_from_hf_config({**DEEPSEEK_V3, **change}, "cfg.json").moe
    assert (moe.scoring, moe.routing_groups) == (scoring, groups)


def test_cli_bad_layer_types_is_one_error_line(tmp_path):
    from click.testing import CliRunner

    from piper_plan.cli.main import cli

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**GPT_OSS, "layer_types": ["sliding_attention"]}))
    result = CliRunner().invoke(cli, ["model", "import", str(path)])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: {path}: layer_types: must be a list of one layer type per layer"), lines[0]


def test_a_gpt_oss_config_without_layer_types_alternates_as_transformers_does():
    """GptOssConfig sets layer_types to sliding / full alternating from layer 0 when the file has none (transformers
    configuration_gpt_oss.py); the import did the same only when the list was written out."""
    written = spec_from_hf_config(GPT_OSS, "cfg.json").attention
    absent = spec_from_hf_config({k: v for k, v in GPT_OSS.items() if k != "layer_types"}, "cfg.json").attention
    assert (absent.sliding_window, absent.sliding_window_every) == (written.sliding_window, 2) == (128, 2)


def test_gpt_oss_experts_take_the_clamped_quick_gelu_gate():
    """GptOssExperts: quick_gelu(min(gate, L)) x (clamp(up, -L, L) + 1), L = swiglu_limit (7 by default); before,
    the spec had no field for it and the runtime and export trained SwiGLU."""
    expert = spec_from_hf_config(GPT_OSS, "cfg.json").moe.expert
    assert (expert.activation, expert.glu_linear_offset, expert.activation_clamp) == ("quick_gelu", 1.0, 7.0)
    assert expert == load_model("gpt-oss-120b").moe.expert
    assert spec_from_hf_config({**GPT_OSS, "swiglu_limit": 5.5}, "cfg.json").moe.expert.activation_clamp == 5.5
    with pytest.raises(PiperError, match=r"must be 1.702 \(quick_gelu's gain"):
        spec_from_hf_config({**GPT_OSS, "swiglu_alpha": 2.0}, "cfg.json")
    with pytest.raises(PiperError, match="must be a number > 0"):
        spec_from_hf_config({**GPT_OSS, "swiglu_limit": "7"}, "cfg.json")


@pytest.mark.parametrize("hidden_act, activation", [("silu", "silu"), ("swish", "silu"), ("gelu", "gelu"),
                                                    ("gelu_pytorch_tanh", "gelu_tanh"), ("gelu_new", "gelu_tanh"),
                                                    ("quick_gelu", "quick_gelu")])
def test_hidden_act_reaches_every_ffn(hidden_act, activation):
    """A config's hidden_act is its FFNs' non-linearity (before: ignored, every import was SwiGLU)."""
    config = json.loads((FIXTURES / "deepseek-v3.json").read_text())
    spec = spec_from_hf_config({**config, "hidden_act": hidden_act}, "cfg.json")
    ffns = (spec.dense_ffn, spec.moe.expert, spec.moe.shared_expert)
    assert {f.activation_name for f in ffns if f is not None} == {activation}


def test_an_unknown_hidden_act_is_refused_and_gpt_oss_keeps_its_gate():
    config = json.loads((FIXTURES / "mixtral-8x7b.json").read_text())
    with pytest.raises(PiperError, match=r"hidden_act: must be one of silu, swish, gelu.*got 'relu'"):
        spec_from_hf_config({**config, "hidden_act": "relu"}, "cfg.json")
    assert spec_from_hf_config({**GPT_OSS, "hidden_act": "gelu"}, "cfg.json").moe.expert.activation == "quick_gelu"


def test_every_ffn_role_takes_the_activation_and_dbrx_reads_its_own_field():
    """Qwen2-MoE's shared expert takes hidden_act like its experts; DBRX names its experts' activation in
    ffn_config.ffn_act_fn (transformers DbrxFFNConfig), where hidden_act means nothing."""
    qwen = json.loads((FIXTURES / "qwen1.5-moe-a2.7b.json").read_text())
    spec = spec_from_hf_config({**qwen, "hidden_act": "gelu_new"}, "cfg.json")
    assert (spec.moe.expert.activation, spec.moe.shared_expert.activation) == ("gelu_tanh", "gelu_tanh")
    dbrx = json.loads((FIXTURES / "dbrx-base.json").read_text())
    gelu = {**dbrx, "ffn_config": {**dbrx["ffn_config"], "ffn_act_fn": {"name": "gelu"}}}
    assert spec_from_hf_config(gelu, "cfg.json").moe.expert.activation == "gelu"
    assert spec_from_hf_config({**dbrx, "hidden_act": "gelu"}, "cfg.json").moe.expert.activation_name == "silu"
    with pytest.raises(PiperError, match=r"ffn_config\.ffn_act_fn\.name: must be one of"):
        spec_from_hf_config({**dbrx, "ffn_config": {**dbrx["ffn_config"], "ffn_act_fn": {"name": "relu"}}}, "cfg.json")
