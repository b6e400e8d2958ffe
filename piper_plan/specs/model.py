"""ModelSpec: the architecture of a (MoE) transformer, enough to count its parameters and FLOPs exactly.

Layer i (0-based) is a MoE layer when ``moe`` is set and ``moe.layers`` selects it; every other layer
runs ``dense_ffn``. Parameter counting lives in ``piper_plan.specs.params`` and follows the reference
implementations (Hugging Face ``transformers`` modules) so that counts match them to the integer.
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Literal

from pydantic import Field, model_validator

from piper_plan.specs.base import Name, Spec

MAX_LAYERS = 10_000
"""Most transformer layers a model may have (the largest published MoE models have about 100); checked before
anything is sized by the layer count."""
MAX_WIDTH = 2**20
"""Largest width (hidden size, FFN inner size, head dim, MLA ranks): 1,048,576 (published models stay below 2^17)."""
MAX_VOCAB = 2**24
"""Largest vocabulary: 16,777,216 tokens (published models stay below 2^18)."""
MAX_HEADS = 2**14
"""Most attention heads: 16,384."""
MAX_EXPERTS = 2**16
"""Most routed (or shared) experts per layer: 65,536."""
MAX_SEQ_LEN = 2**31
"""Longest max_seq_len (TrainingSpec.seq_len has the same bound)."""

Width = Annotated[int, Field(ge=1, le=MAX_WIDTH)]
Heads = Annotated[int, Field(ge=1, le=MAX_HEADS)]


class AttentionSpec(Spec):
    """Self-attention of one layer: MHA, GQA or MLA (DeepSeek's multi-head latent attention)."""

    kind: Literal["mha", "gqa", "mla"] = "gqa"
    """mha: num_kv_heads = num_heads; gqa: grouped KV heads; mla: low-rank compressed Q and KV."""
    num_heads: Heads
    """Query heads."""
    num_kv_heads: Heads | None = None
    """Key/value heads (GQA); defaults to num_heads. MLA: unset (or num_heads)."""
    head_dim: Width | None = None
    """Per-head width of q/k/v; defaults to hidden_size / num_heads (Llama 4, Qwen3-MoE, gpt-oss set it)."""
    qkv_bias: bool = False
    """q, k and v projections carry a bias (Qwen2, gpt-oss)."""
    o_bias: bool = False
    """Output projection carries a bias (gpt-oss)."""
    qk_norm: Literal["none", "per_head", "full", "weightless"] = "none"
    """Norm on q and k: per_head (a head_dim-wide RMSNorm, Qwen3), full (over all heads, OLMoE), weightless (L2, Llama 4)."""
    sinks: bool = False
    """One learned attention-sink logit per head (gpt-oss)."""
    sliding_window: Width | None = None
    """Sliding-window attention: each query attends to at most this many keys (itself and the ones before it),
    in the layers ``sliding_window_every`` picks; None = full causal attention everywhere."""
    sliding_window_every: Width = 1
    """Every n-th layer, from layer 0, uses the window (gpt-oss alternates: 2, layers 0, 2, 4, ...)."""
    q_lora_rank: Width | None = None
    """MLA: rank of the query compression; None = full-rank query projection (DeepSeek-V2-Lite)."""
    kv_lora_rank: Width | None = None
    """MLA: rank of the joint key/value compression."""
    qk_nope_head_dim: Width | None = None
    """MLA: per-head query/key width without rotary embedding."""
    qk_rope_head_dim: Width | None = None
    """MLA: per-head query/key width with rotary embedding (the key part is shared by all heads)."""
    v_head_dim: Width | None = None
    """MLA: per-head value width."""

    @model_validator(mode="after")
    def _check(self) -> "AttentionSpec":
        if self.sliding_window is None and self.sliding_window_every != 1:
            raise ValueError(f"sliding_window_every={self.sliding_window_every} picks the layers of a sliding window, "
                             "but sliding_window is not set: set both, or drop sliding_window_every")
        mla_only = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.kind == "mla":
            missing = [f for f in mla_only[1:] if getattr(self, f) is None]
            if missing:
                raise ValueError(f"kind=mla needs {', '.join(missing)}")
            if self.head_dim is not None or self.num_kv_heads not in (None, self.num_heads):
                raise ValueError(f"kind=mla takes its widths from qk_nope_head_dim, qk_rope_head_dim and v_head_dim "
                                 f"and has a key and value per head: drop head_dim={self.head_dim} and "
                                 f"num_kv_heads={self.num_kv_heads}")
            return self
        stray = [f for f in mla_only if getattr(self, f) is not None]
        if stray:
            raise ValueError(f"{', '.join(stray)} describe MLA, but kind={self.kind}: drop them, or set kind: mla")
        kv = self.kv_heads
        if self.kind == "mha" and kv != self.num_heads:
            raise ValueError(f"kind=mha needs num_kv_heads == num_heads, got num_kv_heads={kv}, num_heads={self.num_heads}")
        if self.num_heads % kv:
            raise ValueError(f"num_kv_heads={kv} must divide num_heads={self.num_heads}")
        return self

    def sliding_layers(self, num_layers: int) -> int:
        """How many of ``num_layers`` layers attend through the window."""
        if self.sliding_window is None:
            return 0
        return -(-num_layers // self.sliding_window_every)

    def window_of(self, layer: int) -> int | None:
        """The key window of global layer ``layer`` (0-based): sliding_window in every ``sliding_window_every``-th
        layer from layer 0, None (full causal attention) elsewhere."""
        if self.sliding_window is None or layer % self.sliding_window_every:
            return None
        return self.sliding_window

    @property
    def kv_heads(self) -> int:
        """Key/value heads (num_heads for MHA and MLA)."""
        if self.kind == "mla":
            return self.num_heads
        return self.num_kv_heads or self.num_heads


class FFNSpec(Spec):
    """A dense feed-forward block (also the shape of one expert)."""

    intermediate_size: Width
    """Inner width d_ffn."""
    gated: bool = True
    """Gated (a GLU: 3 matrices, act(gate) x up; SwiGLU by default) or plain (2 matrices, act(up))."""
    bias: bool = False
    """Linear layers carry biases."""
    activation: Literal["silu", "gelu", "gelu_tanh", "quick_gelu"] | None = None
    """The non-linearity; None = silu when gated (SwiGLU), gelu when plain. gelu is the exact (erf) form, gelu_tanh
    its tanh approximation (jax.nn.gelu's default, which Grok-1's experts use: xai-org/grok-1 model.py at 1a0ba38,
    DenseBlock); quick_gelu = x sigmoid(1.702 x) (gpt-oss's experts: huggingface/transformers
    models/gpt_oss/modeling_gpt_oss.py at 00d4b3d, GptOssExperts alpha 1.702; Megatron's --quick-geglu)."""
    glu_linear_offset: float = Field(default=0.0, ge=-1e6, le=1e6)
    """A gated FFN computes act(gate) x (up + offset) (gpt-oss: 1; Megatron's --glu-linear-offset)."""
    activation_clamp: float | None = Field(default=None, gt=0, le=1e6)
    """A gated FFN clamps gate to at most c and up to [-c, c] before the product (gpt-oss: 7, GptOssExperts'
    limit; Megatron's --activation-func-clamp-value); None = no clamp."""

    @property
    def activation_name(self) -> str:
        """The non-linearity, its default resolved."""
        return self.activation or ("silu" if self.gated else "gelu")

    @model_validator(mode="after")
    def _check(self) -> "FFNSpec":
        if not self.gated and (self.glu_linear_offset or self.activation_clamp is not None):
            raise ValueError("glu_linear_offset and activation_clamp shape a gated FFN's product; this FFN is "
                             "plain (gated: false)")
        return self


def ffn_dicts(data: dict) -> list[dict]:
    """The FFN mappings of a model's data (a ModelSpec dump or a spec being built): dense_ffn and the MoE block's
    expert, shared_expert and parallel_dense_ffn, where present."""
    moe = data.get("moe") or {}
    found = (data.get("dense_ffn"), moe.get("expert"), moe.get("shared_expert"), moe.get("parallel_dense_ffn"))
    return [ffn for ffn in found if ffn is not None]


class MoELayersSpec(Spec):
    """Which layers are MoE: layer i is MoE iff i >= first_k_dense and i % every == phase, or i in explicit."""

    first_k_dense: int = Field(default=0, ge=0, le=MAX_LAYERS)
    """The first k layers are dense (DeepSeek's first_k_dense_replace)."""
    every: int = Field(default=1, ge=1, le=MAX_LAYERS)
    """A MoE layer every n-th layer (DeepSeek's moe_layer_freq; Llama 4's interleave_moe_layer_step)."""
    phase: int = Field(default=0, ge=0, le=MAX_LAYERS)
    """Offset inside the period: Llama 4 uses (i + 1) % step == 0, i.e. phase = step - 1."""
    explicit: list[Annotated[int, Field(ge=0, le=MAX_LAYERS)]] | None = Field(default=None, max_length=MAX_LAYERS)
    """An explicit list of MoE layer indices (overrides the rule above)."""

    def is_moe(self, layer: int) -> bool:
        if self.explicit is not None:
            return layer in self.explicit
        return layer >= self.first_k_dense and layer % self.every == self.phase


class MoESpec(Spec):
    """The Mixture-of-Experts block of a MoE layer."""

    num_experts: int = Field(ge=1, le=MAX_EXPERTS)
    """Routed experts per MoE layer (E)."""
    top_k: int = Field(ge=1, le=MAX_EXPERTS)
    """Routed experts per token (k)."""
    expert: FFNSpec
    """Shape of one routed expert (gated = 3 matrices, plain = 2)."""
    num_shared_experts: int = Field(default=0, ge=0, le=MAX_EXPERTS)
    """Always-active shared experts (DeepSeek, Qwen2-MoE, Llama 4)."""
    shared_expert: FFNSpec | None = None
    """Shape of one shared expert; defaults to the routed expert's shape."""
    shared_expert_gate: bool = False
    """A sigmoid gate Linear(d, 1) on the shared expert output (Qwen2-MoE)."""
    router_bias: bool = False
    """The router Linear carries a bias (gpt-oss). DeepSeek-V3's correction bias is a buffer, not a parameter."""
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    """Router scoring function."""
    normalize_top_k: bool = True
    """The k chosen scores are renormalised to sum 1 (Mixtral; HF norm_topk_prob=true); False: each expert output
    is weighted by its raw score (Switch, Qwen2-MoE, DeepSeek-V2, Llama 4's sigmoid)."""
    layers: MoELayersSpec = MoELayersSpec()
    """Which layers are MoE."""
    parallel_dense_ffn: FFNSpec | None = None
    """A dense MLP beside the experts in every MoE layer (Arctic's residual MLP)."""
    capacity_factor: float | None = Field(default=None, ge=0.01, le=1000)
    """Tokens per expert are capped at capacity_factor x (tokens x k / E), 0.01..1000; None = dropless."""
    routing_groups: int | None = Field(default=None, ge=2, le=MAX_EXPERTS)
    """Group-limited routing (DeepSeek-V2 / V3 config n_group): the experts form this many equal groups and a
    token's top_k experts come from its ``routing_group_top_k`` best groups; None = no limit."""
    routing_group_top_k: int | None = Field(default=None, ge=1, le=MAX_EXPERTS)
    """Groups a token's experts may come from (config topk_group)."""
    routing_group_score_top: int = Field(default=1, ge=1, le=MAX_EXPERTS)
    """A group is ranked by the sum of its this-many best expert scores: 1 = its best (DeepSeek-V2's
    ``group_limited_greedy``), 2 = DeepSeek-V3's ``noaux_tc`` (transformers models/deepseek_v2 and deepseek_v3,
    the routers' ``topk_method`` branches)."""

    @model_validator(mode="after")
    def _check(self) -> "MoESpec":
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be <= num_experts={self.num_experts}")
        groups, chosen = self.routing_groups, self.routing_group_top_k
        if (groups is None) != (chosen is None):
            raise ValueError("routing_groups and routing_group_top_k go together")
        if groups is not None and (self.num_experts % groups or chosen > groups
                                   or self.top_k > chosen * self.num_experts // groups):
            raise ValueError(f"routing_groups={groups} must divide num_experts={self.num_experts} and "
                             f"routing_group_top_k={chosen} groups must hold top_k={self.top_k} experts")
        if self.capacity_factor is not None and self.capacity_factor > self.num_experts / self.top_k:
            raise ValueError(f"capacity_factor={self.capacity_factor:g} is above num_experts / top_k = "
                             f"{self.num_experts / self.top_k:g}: there every expert already takes every token (its "
                             "capacity would exceed the tokens routed; Megatron-Core drops none), so no larger "
                             "factor exists; allowed: 0.01 to num_experts / top_k, or none (dropless)")
        if self.num_shared_experts == 0 and (self.shared_expert_gate or self.shared_expert is not None):
            given = "shared_expert_gate: true" if self.shared_expert_gate else "shared_expert"
            raise ValueError(f"{given} with num_shared_experts=0: there is no shared expert to shape or gate; "
                             "allowed: num_shared_experts >= 1 with it, or leave it out")
        if groups is not None and self.routing_group_score_top > self.num_experts // groups:
            raise ValueError(f"routing_group_score_top={self.routing_group_score_top} exceeds the "
                             f"{self.num_experts // groups} experts of a routing group")
        return self

    @property
    def shared(self) -> FFNSpec:
        """Shape of one shared expert."""
        return self.shared_expert or self.expert


class NormSpec(Spec):
    """Normalisation layers."""

    kind: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """RMSNorm (weight only) or LayerNorm."""
    bias: bool = False
    """LayerNorm with a bias (doubles its parameters)."""
    per_layer: int = Field(default=2, ge=0, le=16)
    """Norms per transformer layer (2 = pre-attention + pre-MLP; Arctic 3, Grok-1 4)."""
    final: bool = True
    """A final norm before the LM head."""


class ModelSpec(Spec):
    """A decoder-only transformer, dense or MoE."""

    name: Name
    """Catalog name, lowercase and hyphenated (mixtral-8x7b)."""
    source: str = Field(min_length=1)
    """Where the configuration comes from (paper, model card, config.json)."""
    notes: str = ""
    """Assumptions and approximations, said plainly."""
    vocab_size: Annotated[int, Field(ge=1, le=MAX_VOCAB)] | None
    """Vocabulary; None = no embedding and no LM head (the papers' abstract models)."""
    hidden_size: Width
    """Model width d."""
    num_layers: int = Field(ge=1, le=MAX_LAYERS)
    """Transformer layers L (at most MAX_LAYERS)."""
    max_seq_len: Annotated[int, Field(ge=1, le=MAX_SEQ_LEN)] | None = None
    """Longest sequence the model supports (max_position_embeddings); None = unknown / unbounded."""
    attention: AttentionSpec
    """Self-attention."""
    dense_ffn: FFNSpec | None = None
    """The MLP of non-MoE layers (required when some layer is dense)."""
    moe: MoESpec | None = None
    """Mixture-of-Experts block of MoE layers; None = dense model."""
    parallel_attn_mlp: bool = False
    """Attention and MLP read the same input (parallel residual, Arctic); no parameter change."""
    tie_embeddings: bool = False
    """LM head shares the input embedding matrix."""
    learned_position_embeddings: bool = False
    """A learned position table of max_seq_len x d (GPT-2/Megatron GPT)."""
    norm: NormSpec = NormSpec()
    """Normalisation layers."""
    mtp_layers: int = Field(default=0, ge=0, le=MAX_LAYERS)
    """Multi-token-prediction modules (DeepSeek-V3: 1; HF ``num_nextn_predict_layers``). Module k predicts token
    t + k + 1: it norms the previous depth's hidden state and the embedding of token t + k (enorm, hnorm),
    projects their concatenation 2d -> d (eh_proj), runs one transformer block shaped like the model's last layer
    and the shared LM head after its own final norm (DeepSeek-V3 report, sec. 2.2; Megatron-Core's
    MultiTokenPredictionBlock). The embedding and the head are shared with the main model; the counts in
    ``params`` exclude the modules (``params.mtp``), as the published 671B of DeepSeek-V3 does."""

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if self.attention.kind != "mla" and self.attention.head_dim is None and self.hidden_size % self.attention.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.attention.num_heads}; set attention.head_dim")
        a = self.attention
        rotary, name = (a.qk_rope_head_dim, "attention.qk_rope_head_dim") if a.kind == "mla" else (self.head_dim, "head_dim")
        if rotary % 2:
            raise ValueError(f"{name}={rotary} is odd: rotary position embeddings turn pairs of a head's features "
                             "(the runtime's half-split layout, runtime/model.py rotary), so the rotary width is even")
        if self.moe is not None and self.moe.layers.explicit is not None:
            bad = [i for i in self.moe.layers.explicit if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"moe.layers.explicit has indices {bad[:5]} outside 0..{self.num_layers - 1} "
                                 f"(num_layers={self.num_layers})")
        if self.moe is not None and not self.moe_layers:
            rule = self.moe.layers
            picks = (f"explicit={rule.explicit}" if rule.explicit is not None else
                     f"first_k_dense={rule.first_k_dense}, every={rule.every}, phase={rule.phase}")
            raise ValueError(f"moe.layers ({picks}) selects none of the {self.num_layers} layers: a moe block needs "
                             "at least one MoE layer (phase < every, first_k_dense < num_layers); drop moe for a "
                             "dense model")
        if self.num_dense_layers and self.dense_ffn is None:
            raise ValueError(f"{self.num_dense_layers} of {self.num_layers} layers are dense "
                             f"({self._dense_reason()}) but dense_ffn is not set")
        if self.learned_position_embeddings and self.max_seq_len is None:
            raise ValueError("learned_position_embeddings needs max_seq_len")
        if self.mtp_layers and self.vocab_size is None:
            raise ValueError(f"mtp_layers={self.mtp_layers} needs a vocabulary (an MTP module embeds tokens and "
                             "predicts them through the shared LM head); vocab_size is null")
        return self

    def _dense_reason(self) -> str:
        if self.moe is None:
            return "no moe block"
        return "moe.layers selects only some layers"

    # ---- derived structure -------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """Per-head q/k width (MLA: nope + rope)."""
        a = self.attention
        if a.kind == "mla":
            return a.qk_nope_head_dim + a.qk_rope_head_dim
        return a.head_dim or self.hidden_size // a.num_heads

    @cached_property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of MoE layers."""
        if self.moe is None:
            return ()
        return tuple(i for i in range(self.num_layers) if self.moe.layers.is_moe(i))

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def mtp_is_moe(self) -> bool:
        """An MTP module's block is shaped like the model's last layer (DeepSeek-V3: MoE)."""
        return self.mtp_layers > 0 and self.is_moe_layer(self.num_layers - 1)

    @property
    def is_moe(self) -> bool:
        return self.num_moe_layers > 0

    @property
    def ffns(self) -> dict[str, FFNSpec]:
        """The FFNs the model builds, by role: dense FFNs (in a dense layer or a dense MTP block), experts, shared
        experts, residual MLPs beside the experts (Arctic)."""
        moe, dense_built = self.moe, self.num_dense_layers > 0 or (self.mtp_layers > 0 and not self.mtp_is_moe)
        built = {"dense FFNs": self.dense_ffn if dense_built else None}
        if moe is not None and self.is_moe:
            built.update({"experts": moe.expert, "shared experts": moe.shared if moe.num_shared_experts else None,
                          "residual MLPs": moe.parallel_dense_ffn})
        return {role: ffn for role, ffn in built.items() if ffn is not None}

    @property
    def expert_layer_ids(self) -> tuple[int, ...]:
        """The layers whose router counts tokens (metrics.jsonl's expert_tokens keys): the MoE layers, then the MTP
        modules' MoE blocks as num_layers + k (runtime/model.py)."""
        mtp = tuple(self.num_layers + k for k in range(self.mtp_layers)) if self.mtp_is_moe else ()
        return self.moe_layers + mtp

    # ---- parameters --------------------------------------------------------------------
    @cached_property
    def params(self):
        """Parameter counts by component (exact integers)."""
        from piper_plan.specs.params import count_params

        return count_params(self)

    @property
    def total_params(self) -> int:
        return self.params.total

    @property
    def active_params(self) -> int:
        """Active per token, including the input embedding (see models.md's convention)."""
        return self.params.active



