"""Hugging Face ``config.json`` -> ModelSpec, for the MoE and dense families piper knows.

Each family's converter reads the fields the reference implementation reads (transformers'
``modeling_<type>.py``; DeepSeekMoE v1 and Arctic from their published remote code) and builds the
spec dict, so that the spec's parameter count equals the count of the model transformers builds
(``scripts/check_hf_counts.py`` checks it on the meta device). Pure: no I/O except ``import_hf_file``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from piper_plan.catalog import parse_spec, read_structured
from piper_plan.errors import PiperError
from piper_plan.specs import ModelSpec
from piper_plan.specs.model import ffn_dicts

_MISSING = object()


class _Config:
    """A config mapping that turns a missing or bad field into one PiperError line naming it."""

    def __init__(self, data: dict, path: str, prefix: str = ""):
        self.data, self.path, self.prefix = data, path, prefix

    def get(self, key: str, default: Any = _MISSING) -> Any:
        value = self.data.get(key, default)
        if value is _MISSING:
            raise PiperError("missing field in the Hugging Face config", path=self.path, field=self.prefix + key)
        return value

    def int_(self, key: str, default: Any = _MISSING, minimum: int = 1, maximum: int | None = None) -> int | None:
        """A whole number >= minimum (and <= maximum where given; None passes through when it is the default)."""
        value = self.get(key, default)
        if value is None and default is None:
            return None
        if (isinstance(value, bool) or not isinstance(value, int) or value < minimum
                or (maximum is not None and value > maximum)):
            allowed = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum:,}"
            raise PiperError(f"must be an integer {allowed}, got {value!r}", path=self.path, field=self.prefix + key)
        return value

    def num_layers(self, key: str = "num_hidden_layers") -> int:
        """The layer count, bounded as a spec's (specs.model.MAX_LAYERS) before any per-layer list is built."""
        from piper_plan.specs.model import MAX_LAYERS

        return self.int_(key, maximum=MAX_LAYERS)

    def layer_list(self, key: str, num_layers: int) -> list[int] | None:
        """A list of layer indices 0..num_layers-1 (absent or null: None)."""
        value = self.get(key, None)
        if value is None:
            return None
        if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers
                                              for i in value):
            raise PiperError(f"must be a list of layer indices 0..{num_layers - 1}, got {value!r}", path=self.path,
                             field=self.prefix + key)
        return value

    def flag(self, key: str, default: bool) -> bool:
        """A JSON boolean (the string "false" is not one: bool("false") would be True)."""
        value = self.get(key, default)
        if value is None:                                 # null: transformers falls back to the default too
            return default
        if not isinstance(value, bool):
            raise PiperError(f"must be true or false, got {value!r}", path=self.path, field=self.prefix + key)
        return value

    def positive_number(self, key: str, default: float) -> float:
        """A finite number > 0 (absent or null: ``default``)."""
        value = self.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise PiperError(f"must be a number > 0, got {value!r}", path=self.path, field=self.prefix + key)
        return float(value)

    def choice(self, key: str, allowed: tuple[str, ...], default: str) -> str:
        """One of the ``allowed`` names (absent: ``default``); anything else is refused, never mapped to a default."""
        value = self.get(key, default)
        if not isinstance(value, str) or value not in allowed:
            raise PiperError(f"must be one of {', '.join(allowed)}, got {value!r}", path=self.path,
                             field=self.prefix + key)
        return value

    def sub(self, key: str) -> "_Config":
        value = self.get(key)
        if not isinstance(value, dict):
            raise PiperError(f"expected a mapping, got {type(value).__name__}", path=self.path, field=self.prefix + key)
        return _Config(value, self.path, f"{self.prefix}{key}.")


# ---- shared pieces --------------------------------------------------------------------------------

def _base(c: _Config, hidden: str = "hidden_size", layers: str = "num_hidden_layers",
          max_pos: str = "max_position_embeddings") -> dict:
    return {"vocab_size": c.int_("vocab_size"), "hidden_size": c.int_(hidden), "num_layers": c.num_layers(layers),
            "max_seq_len": c.int_(max_pos, None), "tie_embeddings": c.flag("tie_word_embeddings", False)}


def _gqa(c: _Config, *, heads: str = "num_attention_heads", kv: str = "num_key_value_heads",
         head_dim: int | None = None, qkv_bias: bool = False, o_bias: bool = False,
         qk_norm: str = "none", sinks: bool = False) -> dict:
    num_heads = c.int_(heads)
    num_kv = c.int_(kv, None) or num_heads
    attn = {"kind": "mha" if num_kv == num_heads else "gqa", "num_heads": num_heads, "num_kv_heads": num_kv,
            "head_dim": head_dim, "qkv_bias": qkv_bias, "o_bias": o_bias, "qk_norm": qk_norm, "sinks": sinks}
    return {k: v for k, v in attn.items() if v is not None}


def _mla(c: _Config) -> dict:
    bias = c.flag("attention_bias", False)
    return {"kind": "mla", "num_heads": c.int_("num_attention_heads"), "q_lora_rank": c.int_("q_lora_rank", None),
            "kv_lora_rank": c.int_("kv_lora_rank"), "qk_nope_head_dim": c.int_("qk_nope_head_dim"),
            "qk_rope_head_dim": c.int_("qk_rope_head_dim"), "v_head_dim": c.int_("v_head_dim"),
            "qkv_bias": bias, "o_bias": bias}


def _ffn(width: int, gated: bool = True, bias: bool = False) -> dict:
    return {"intermediate_size": width, "gated": gated, "bias": bias}


HF_ACTIVATIONS = {"silu": None, "swish": None, "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
                  "gelu_pytorch_tanh": "gelu_tanh", "quick_gelu": "quick_gelu"}
"""hidden_act -> FFNSpec.activation (None: the gated default, SiLU). transformers' ACT2FN (src/transformers/
activations.py at 00e12e7): gelu is the erf form, gelu_new and gelu_fast its tanh approximation, quick_gelu
x sigmoid(1.702 x), silu and swish one function; gelu_pytorch_tanh (a later entry of the same table) is torch's
gelu(approximate="tanh"). Any other name is refused: piper's runtime and cost model have no other non-linearity."""


def _activation(c: _Config, key: str = "hidden_act") -> dict:
    """The FFN fields of the activation named by ``key`` (absent: silu, the gated default: no field)."""
    activation = HF_ACTIVATIONS[c.choice(key, tuple(HF_ACTIVATIONS), "silu")]
    return {} if activation is None else {"activation": activation}


def _with_activation(data: dict, c: _Config) -> dict:
    """Every FFN the family converter left without an activation gets the config's hidden_act (absent: silu)."""
    activation = _activation(c).get("activation")
    if activation is None:
        return data
    for ffn in ffn_dicts(data):
        ffn.setdefault("activation", activation)
    return data


def _sparse_step_layers(c: _Config, num_layers: int) -> dict:
    """Qwen2/3-MoE: layer i is MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    step = c.int_("decoder_sparse_step", 1)
    dense_only = c.layer_list("mlp_only_layers", num_layers) or []
    if not dense_only:
        return {"every": step, "phase": step - 1}
    return {"explicit": [i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0]}


# ---- families -------------------------------------------------------------------------------------

def _mixtral(c: _Config) -> dict:
    return {**_base(c), "attention": {**_gqa(c, head_dim=c.int_("head_dim", None)), **_every_layer_window(c)},
            "moe": {"num_experts": c.int_("num_local_experts"), "top_k": c.int_("num_experts_per_tok"),
                    "expert": _ffn(c.int_("intermediate_size"))}}


def _qwen_moe(c: _Config, qwen3: bool) -> dict:
    spec = _base(c)
    if qwen3:
        bias = c.flag("attention_bias", False)
        attn = _gqa(c, head_dim=c.int_("head_dim", None), qkv_bias=bias, o_bias=bias, qk_norm="per_head")
    else:
        attn = _gqa(c, qkv_bias=c.flag("qkv_bias", True))
    moe = {"num_experts": c.int_("num_experts"), "top_k": c.int_("num_experts_per_tok"),
           "expert": _ffn(c.int_("moe_intermediate_size")), "layers": _sparse_step_layers(c, spec["num_layers"]),
           "normalize_top_k": c.flag("norm_topk_prob", False)}
    if not qwen3:
        moe.update(num_shared_experts=1, shared_expert=_ffn(c.int_("shared_expert_intermediate_size")),
                   shared_expert_gate=True)
    return {**spec, "attention": {**attn, **_qwen_window(c)}, "dense_ffn": _ffn(c.int_("intermediate_size")),
            "moe": moe}


def _deepseek(c: _Config, mla: bool) -> dict:
    """DeepSeekMoE v1 (MHA), V2 / V3 / Kimi K2 (MLA): first_k_dense_replace dense layers, then MoE
    every moe_layer_freq layers (the reference code's rule; transformers' V2/V3 assume freq 1);
    num_nextn_predict_layers MTP modules (V3: 1, Kimi K2: 0; transformers builds none of them)."""
    mlp_bias = c.flag("mlp_bias", False)
    bias = c.flag("attention_bias", False)
    attn = _mla(c) if mla else _gqa(c, qkv_bias=bias, o_bias=bias)
    shared = c.int_("n_shared_experts", None, minimum=0) or 0
    moe = {"num_experts": c.int_("n_routed_experts"), "top_k": c.int_("num_experts_per_tok"),
           "expert": _ffn(c.int_("moe_intermediate_size")), "num_shared_experts": shared,
           "scoring": c.choice("scoring_func", ("softmax", "sigmoid"), "softmax"),
           "normalize_top_k": c.flag("norm_topk_prob", False),
           "layers": {"first_k_dense": c.int_("first_k_dense_replace", 0, minimum=0),
                      "every": c.int_("moe_layer_freq", 1)}}
    # group-limited routing: V2's group_limited_greedy and V3's noaux_tc; "greedy" (V2-Lite, the reference code's
    # default) ignores the groups, and transformers writes n_group / topk_group as null when they are unset
    method = c.choice("topk_method", ("greedy", "group_limited_greedy", "noaux_tc"), "greedy")
    groups = c.int_("n_group", 1, minimum=1) if c.get("n_group", None) is not None else 1
    if groups > 1 and method in ("group_limited_greedy", "noaux_tc"):
        top = c.int_("topk_group", groups, minimum=1) if c.get("topk_group", None) is not None else groups
        moe.update(routing_groups=groups, routing_group_top_k=top, routing_group_score_top=2 if method == "noaux_tc" else 1)
    if shared and mlp_bias:
        # The reference code builds the shared experts as ONE MLP of width n_shared x moe_intermediate_size;
        # that is the same weights as n_shared experts, but one set of biases.
        moe.update(num_shared_experts=1, shared_expert=_ffn(shared * c.int_("moe_intermediate_size"), bias=True))
    return {**_base(c), "attention": attn, "dense_ffn": _ffn(c.int_("intermediate_size"), bias=mlp_bias), "moe": moe,
            "mtp_layers": c.int_("num_nextn_predict_layers", 0, minimum=0)}


def _dbrx(c: _Config) -> dict:
    attn_c, ffn_c = c.sub("attn_config"), c.sub("ffn_config")
    heads = c.int_("n_heads")
    kv = attn_c.int_("kv_n_heads", 1)
    return {**_base(c, "d_model", "n_layers", "max_seq_len"),
            "attention": {"kind": "mha" if kv == heads else "gqa", "num_heads": heads, "num_kv_heads": kv},
            "moe": {"num_experts": ffn_c.int_("moe_num_experts", 4), "top_k": ffn_c.int_("moe_top_k", 1),
                    "expert": {**_ffn(ffn_c.int_("ffn_hidden_size", 3584)), **_dbrx_activation(ffn_c)}},
            "norm": {"kind": "layernorm", "bias": False}}


def _dbrx_activation(ffn_c: _Config) -> dict:
    """DBRX names its experts' activation in ffn_config.ffn_act_fn.name, not hidden_act (transformers
    configuration_dbrx.py: DbrxFFNConfig, ffn_act_fn default {"name": "silu"})."""
    if ffn_c.get("ffn_act_fn", None) is None:
        return {"activation": "silu"}
    return {"activation": _activation(ffn_c.sub("ffn_act_fn"), "name").get("activation", "silu")}


def _olmoe(c: _Config) -> dict:
    bias = c.flag("attention_bias", False)
    return {**_base(c), "attention": _gqa(c, qkv_bias=bias, o_bias=bias, qk_norm="full"),
            "moe": {"num_experts": c.int_("num_experts"), "top_k": c.int_("num_experts_per_tok"),
                    "expert": _ffn(c.int_("intermediate_size")), "normalize_top_k": c.flag("norm_topk_prob", False)}}


def _gpt_oss(c: _Config) -> dict:
    bias = c.flag("attention_bias", True)
    top_k = c.int_("num_experts_per_tok", None) or c.int_("experts_per_token")
    attention = {**_gqa(c, head_dim=c.int_("head_dim", 64), qkv_bias=bias, o_bias=bias, sinks=True),
                 **_sliding_window(c, ["sliding_attention" if i % 2 == 0 else "full_attention"
                                       for i in range(c.num_layers())])}
    expert = {**_ffn(c.int_("intermediate_size"), bias=True), **_gpt_oss_activation(c)}
    return {**_base(c), "attention": attention,
            "moe": {"num_experts": c.int_("num_local_experts"), "top_k": top_k, "expert": expert,
                    "router_bias": True}}


def _gpt_oss_activation(c: _Config) -> dict:
    """The experts' clamped SwiGLU: quick_gelu(clamp(gate, max=L)) x (clamp(up, -L, L) + 1), L = swiglu_limit
    (GptOssConfig: swiglu_alpha 1.702 and swiglu_limit 7.0 by default, huggingface/transformers src/transformers/
    models/gpt_oss/configuration_gpt_oss.py at 02b8f42; GptOssExperts.forward in modeling_gpt_oss.py at 00d4b3d).
    Another alpha than quick_gelu's 1.702 is refused: no spec field states it."""
    alpha = c.positive_number("swiglu_alpha", 1.702)
    if alpha != 1.702:
        raise PiperError(f"must be 1.702 (quick_gelu's gain: piper states no other), got {alpha!r}", path=c.path,
                         field=c.prefix + "swiglu_alpha")
    return {"activation": "quick_gelu", "glu_linear_offset": 1.0,
            "activation_clamp": c.positive_number("swiglu_limit", 7.0)}


def _every_layer_window(c: _Config) -> dict:
    """Mistral and Mixtral: ``sliding_window`` (null: none) in every layer's attention (transformers
    src/transformers/models/mistral/modeling_mistral.py at 93e0020, MistralAttention.forward passes
    config.sliding_window; MixtralAttention is MistralAttention)."""
    return _sliding_window(c, ["sliding_attention"] * c.num_layers())


def _qwen_window(c: _Config) -> dict:
    """Qwen2 / Qwen3 (dense and MoE): with use_sliding_window, layers from max_window_layers on slide (their config
    classes' layer_types rule: i >= max_window_layers); off (the default), none does."""
    if not c.flag("use_sliding_window", False):
        return {}
    if c.get("layer_types", None) is not None:
        return _sliding_window(c, [])
    start = c.int_("max_window_layers", minimum=0)
    return _sliding_window(c, ["sliding_attention" if i >= start else "full_attention" for i in range(c.num_layers())],
                           from_field="max_window_layers")


def _sliding_window(c: _Config, default_types: list[str], from_field: str = "layer_types") -> dict:
    """``sliding_window`` + ``layer_types`` -> the window and which layers use it: every layer, or every n-th from
    layer 0 (the patterns the spec can state); another pattern is refused in one line, naming ``from_field``, the
    field the pattern came from. ``default_types``: the pattern the family's transformers config class sets where
    ``layer_types`` is absent (GptOssConfig: every 2nd layer from layer 0 slides, huggingface/transformers
    src/transformers/models/gpt_oss/configuration_gpt_oss.py at 02b8f42)."""
    types = _layer_types(c, c.num_layers())
    if types is None:
        types = default_types
    window = c.int_("sliding_window", None)
    if window is None or types is None:
        return {}
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    for every in range(1, len(types) + 1):
        if sliding == list(range(0, len(types), every)):
            return {"sliding_window": window, "sliding_window_every": every}
    if not sliding:
        return {}
    raise PiperError(f"sliding-window attention on layers {sliding[:6]}...; piper states every layer or every "
                     "n-th from layer 0", path=c.path, field=c.prefix + from_field)


_LAYER_TYPES = ("sliding_attention", "full_attention")


def _layer_types(c: _Config, num_layers: int) -> list[str] | None:
    """``layer_types``: one of _LAYER_TYPES per layer (absent or null: None)."""
    types, field = c.get("layer_types", None), c.prefix + "layer_types"
    allowed = f"allowed: {', '.join(_LAYER_TYPES)}"
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != num_layers:
        got = f"a list of {len(types)}" if isinstance(types, list) else repr(types)
        raise PiperError(f"must be a list of one layer type per layer (num_hidden_layers={num_layers}), got {got}; "
                         f"{allowed}", path=c.path, field=field)
    bad = next((i for i, t in enumerate(types) if not isinstance(t, str) or t not in _LAYER_TYPES), None)
    if bad is not None:
        raise PiperError(f"entry {bad} is {types[bad]!r}; {allowed}", path=c.path, field=field)
    return types


def _llama4(c: _Config) -> dict:
    """Llama 4 text model: MoE layers = moe_layers, else those with (i + 1) % interleave_moe_layer_step == 0."""
    bias = c.flag("attention_bias", False)
    qk_norm = "weightless" if c.flag("use_qk_norm", True) else "none"
    explicit = c.layer_list("moe_layers", c.num_layers())
    step = c.int_("interleave_moe_layer_step", 1)
    layers = {"explicit": explicit} if explicit is not None else {"every": step, "phase": step - 1}
    attn = _gqa(c, head_dim=c.int_("head_dim", 128), qkv_bias=bias, o_bias=bias, qk_norm=qk_norm)
    return {**_base(c), "attention": attn,
            "dense_ffn": _ffn(c.int_("intermediate_size_mlp")),
            "moe": {"num_experts": c.int_("num_local_experts"), "top_k": c.int_("num_experts_per_tok"),
                    "expert": _ffn(c.int_("intermediate_size")), "num_shared_experts": 1, "scoring": "sigmoid",
                    "normalize_top_k": False, "layers": layers}}


def _arctic(c: _Config) -> dict:
    """Snowflake Arctic (modeling_arctic.py): MoE iff (i + 1) % moe_layer_frequency == 0; a MoE layer with
    use_residual adds a gated MLP of width hidden_size and a third norm beside the experts."""
    freq = c.int_("moe_layer_frequency", 2)
    residual = c.flag("use_residual", False)
    if residual and freq != 1:
        raise PiperError(f"use_residual with moe_layer_frequency={freq} is not supported (allowed: 1), "
                         "because the residual norm exists only in MoE layers",
                         path=c.path, field="moe_layer_frequency")
    d = c.int_("hidden_size")
    moe = {"num_experts": c.int_("num_local_experts"), "top_k": c.int_("num_experts_per_tok"),
           "expert": _ffn(c.int_("intermediate_size")), "layers": {"every": freq, "phase": freq - 1}}
    if residual:
        moe["parallel_dense_ffn"] = _ffn(d)
    return {**_base(c), "attention": _gqa(c), "dense_ffn": _ffn(c.int_("intermediate_size")), "moe": moe,
            "parallel_attn_mlp": c.flag("parallel_attn_mlp_res", False),
            "norm": {"per_layer": 3 if residual else 2}}


def _llama(c: _Config) -> dict:
    bias = c.flag("attention_bias", False)
    return {**_base(c), "attention": _gqa(c, head_dim=c.int_("head_dim", None), qkv_bias=bias, o_bias=bias),
            "dense_ffn": _ffn(c.int_("intermediate_size"), bias=c.flag("mlp_bias", False))}


def _mistral(c: _Config) -> dict:
    return {**_base(c), "attention": {**_gqa(c, head_dim=c.int_("head_dim", None)), **_every_layer_window(c)},
            "dense_ffn": _ffn(c.int_("intermediate_size"))}


def _qwen2(c: _Config) -> dict:
    return {**_base(c), "attention": {**_gqa(c, qkv_bias=True), **_qwen_window(c)},
            "dense_ffn": _ffn(c.int_("intermediate_size"))}


def _qwen3(c: _Config) -> dict:
    bias = c.flag("attention_bias", False)
    attention = _gqa(c, head_dim=c.int_("head_dim", None), qkv_bias=bias, o_bias=bias, qk_norm="per_head")
    return {**_base(c), "attention": {**attention, **_qwen_window(c)}, "dense_ffn": _ffn(c.int_("intermediate_size"))}


CONVERTERS: dict[str, Callable[[_Config], dict]] = {
    "mixtral": _mixtral,
    "qwen2_moe": lambda c: _qwen_moe(c, qwen3=False),
    "qwen3_moe": lambda c: _qwen_moe(c, qwen3=True),
    "deepseek": lambda c: _deepseek(c, mla=False),
    "deepseek_v2": lambda c: _deepseek(c, mla=True),
    "deepseek_v3": lambda c: _deepseek(c, mla=True),
    "kimi_k2": lambda c: _deepseek(c, mla=True),
    "dbrx": _dbrx,
    "olmoe": _olmoe,
    "gpt_oss": _gpt_oss,
    "llama4": _llama4,
    "llama4_text": _llama4,
    "arctic": _arctic,
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(CONVERTERS))


def default_name(config: dict, path: str) -> str:
    """Catalog-style name: the repo name of ``_name_or_path``, else the file name (its folder for config.json),
    lowercased and hyphenated."""
    stem = Path(path).stem
    if not isinstance(config.get("_name_or_path", ""), str):
        raise PiperError(f"must be a string, got {config['_name_or_path']!r}", path=path, field="_name_or_path")

    def clean(raw: str) -> str:
        return re.sub(r"[^a-z0-9.]+", "-", raw.rstrip("/").split("/")[-1].lower()).strip("-.")

    own = clean(config.get("_name_or_path") or "")      # "./" or ".." name no model: the file's own name then
    return own or clean(stem if stem != "config" else Path(path).resolve().parent.name) or "model"


def spec_from_hf_config(config: dict, path: str, name: str | None = None) -> ModelSpec:
    """The ModelSpec of a parsed HF config; errors name ``path`` and the offending field."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONVERTERS:
        raise PiperError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}",
                         path=path, field="model_type")
    cfg = _Config(config, path)
    if model_type == "llama4":
        cfg = cfg.sub("text_config")
    data = {"name": default_name(config, path) if name is None else name,
            "source": f"Hugging Face config.json ({path}, model_type {model_type}), imported by piper model import",
            **_with_activation(CONVERTERS[model_type](cfg), cfg)}
    if model_type == "llama4":
        data["notes"] = "Text model only (vision encoder and projector not counted)."
    return parse_spec(ModelSpec, data, path)


def import_hf_file(path: str | Path, name: str | None = None) -> ModelSpec:
    """Read a config.json and convert it."""
    return spec_from_hf_config(read_structured(Path(path)), str(path), name)
