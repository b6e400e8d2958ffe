"""Exact parameter counts of a ModelSpec, by component.

Each function counts the weights of one module the way its reference implementation builds it
(Hugging Face ``transformers``: LlamaAttention, DeepseekV3Attention, MixtralSparseMoeBlock, ...), so that
``total`` equals transformers' count of the model on the meta device. Buffers (rotary tables, DeepSeek-V3's
``e_score_correction_bias``) are not parameters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:       # annotations only: ModelSpec.params calls count_params, so no import back at run time
    from piper_plan.specs.model import AttentionSpec, FFNSpec, ModelSpec, MoESpec, NormSpec


@dataclass(frozen=True)
class ParamBreakdown:
    """Parameter counts of a whole model by component; ``*_active`` is what one token touches."""

    embedding: int
    attention: int
    dense_mlp: int
    router: int
    routed_experts: int
    routed_experts_active: int
    shared_experts: int
    norms: int
    lm_head: int
    mtp: int = 0
    """Multi-token-prediction modules, all their own weights (not in ``total``: see mtp_module_params)."""
    mtp_active: int = 0
    """What one token touches of them (top_k routed experts)."""

    @property
    def total(self) -> int:
        return (self.embedding + self.attention + self.dense_mlp + self.router + self.routed_experts
                + self.shared_experts + self.norms + self.lm_head)

    @property
    def active(self) -> int:
        """Active parameters including the input embedding."""
        return self.total - self.routed_experts + self.routed_experts_active

    @property
    def active_excluding_embedding(self) -> int:
        """Active parameters without the input embedding (gpt-oss's convention)."""
        return self.active - self.embedding

    @property
    def non_embedding(self) -> int:
        """Total minus the input embedding (and the LM head when tied to it)."""
        return self.total - self.embedding

    @property
    def total_with_mtp(self) -> int:
        """The main model and its MTP modules (DeepSeek-V3: the 685B of its Hugging Face checkpoint less the
        copies of the embedding and head that checkpoint stores again for the module)."""
        return self.total + self.mtp

    def as_dict(self) -> dict[str, int]:
        out = asdict(self)
        out.update(total=self.total, active=self.active,
                   active_excluding_embedding=self.active_excluding_embedding, total_with_mtp=self.total_with_mtp)
        return out


def linear_params(fan_in: int, fan_out: int, bias: bool) -> int:
    """nn.Linear(fan_in, fan_out, bias)."""
    return fan_in * fan_out + (fan_out if bias else 0)


def attention_params(attn: AttentionSpec, hidden: int, head_dim: int) -> int:
    """One attention block: q, k, v, o projections (+ MLA's compressions and norms, qk-norm, sinks)."""
    if attn.kind == "mla":
        return _mla_params(attn, hidden)
    h, kv = attn.num_heads, attn.kv_heads
    n = linear_params(hidden, h * head_dim, attn.qkv_bias)
    n += 2 * linear_params(hidden, kv * head_dim, attn.qkv_bias)
    n += linear_params(h * head_dim, hidden, attn.o_bias)
    if attn.qk_norm == "per_head":
        n += 2 * head_dim
    elif attn.qk_norm == "full":
        n += (h + kv) * head_dim
    if attn.sinks:
        n += h
    return n


def _mla_params(attn: AttentionSpec, hidden: int) -> int:
    """DeepseekV2/V3Attention: q_a (+ norm) -> q_b, kv_a_with_mqa (+ norm) -> kv_b, o.

    With ``attention_bias`` (our qkv_bias / o_bias) transformers puts a bias on q_a, kv_a and o only
    (q_b, kv_b and a full-rank q_proj never carry one).
    """
    h, qb = attn.num_heads, attn.qkv_bias
    qk_head = attn.qk_nope_head_dim + attn.qk_rope_head_dim
    if attn.q_lora_rank is None:
        n = hidden * h * qk_head
    else:
        n = linear_params(hidden, attn.q_lora_rank, qb) + attn.q_lora_rank + attn.q_lora_rank * h * qk_head
    n += linear_params(hidden, attn.kv_lora_rank + attn.qk_rope_head_dim, qb) + attn.kv_lora_rank
    n += attn.kv_lora_rank * h * (attn.qk_nope_head_dim + attn.v_head_dim)
    n += linear_params(h * attn.v_head_dim, hidden, attn.o_bias)
    return n


def ffn_params(ffn: FFNSpec, hidden: int) -> int:
    """One MLP / expert: gated = gate, up, down (3 matrices); plain = up, down (2)."""
    w = ffn.intermediate_size
    if ffn.gated:
        return 2 * linear_params(hidden, w, ffn.bias) + linear_params(w, hidden, ffn.bias)
    return linear_params(hidden, w, ffn.bias) + linear_params(w, hidden, ffn.bias)


def router_params(moe: MoESpec, hidden: int) -> int:
    """Router Linear(d, E) (+ a shared-expert gate Linear(d, 1) for Qwen2-MoE)."""
    n = linear_params(hidden, moe.num_experts, moe.router_bias)
    return n


def shared_expert_params(moe: MoESpec, hidden: int) -> int:
    n = moe.num_shared_experts * ffn_params(moe.shared, hidden)
    if moe.shared_expert_gate:
        n += hidden
    return n


def norm_params(norm: NormSpec, width: int) -> int:
    """One norm over ``width`` features."""
    return width * (2 if norm.kind == "layernorm" and norm.bias else 1)


def moe_block_params(moe: MoESpec, hidden: int, active: bool = False) -> int:
    """The MoE block of one layer: router, routed experts (all, or the top_k one token visits), shared experts,
    parallel dense MLP."""
    n = router_params(moe, hidden) + (moe.top_k if active else moe.num_experts) * ffn_params(moe.expert, hidden)
    n += shared_expert_params(moe, hidden)
    if moe.parallel_dense_ffn is not None:
        n += ffn_params(moe.parallel_dense_ffn, hidden)
    return n


def mtp_extra_params(model: ModelSpec) -> int:
    """What one MTP module adds around its block: enorm, hnorm and the final norm before the shared head
    (3 norms over d) and eh_proj, Linear(2d, d) without bias (DeepSeek-V3 report sec. 2.2; Megatron-Core
    multi_token_prediction.py; its FLOP count takes the same 3 d + 2 d^2)."""
    d = model.hidden_size
    return 3 * norm_params(model.norm, d) + linear_params(2 * d, d, False)


def mtp_module_params(model: ModelSpec, active: bool = False) -> int:
    """One MTP module's own parameters: its transformer block (attention, per-layer norms, the FFN of the model's
    last layer) plus mtp_extra_params; the embedding and the LM head are the main model's (shared)."""
    d = model.hidden_size
    block = attention_params(model.attention, d, model.head_dim) + model.norm.per_layer * norm_params(model.norm, d)
    block += moe_block_params(model.moe, d, active) if model.mtp_is_moe else ffn_params(model.dense_ffn, d)
    return block + mtp_extra_params(model)


def count_params(model: ModelSpec) -> ParamBreakdown:
    """All parameters of ``model`` by component."""
    d, moe = model.hidden_size, model.moe
    n_moe, n_dense = model.num_moe_layers, model.num_dense_layers
    embedding = (model.vocab_size or 0) * d
    if model.learned_position_embeddings:
        embedding += model.max_seq_len * d
    lm_head = 0 if (model.tie_embeddings or model.vocab_size is None) else model.vocab_size * d
    dense_mlp = n_dense * ffn_params(model.dense_ffn, d) if n_dense else 0
    router = routed = routed_active = shared = 0
    if moe is not None and n_moe:
        router = n_moe * router_params(moe, d)
        per_expert = ffn_params(moe.expert, d)
        routed = n_moe * moe.num_experts * per_expert
        routed_active = n_moe * moe.top_k * per_expert
        shared = n_moe * shared_expert_params(moe, d)
        if moe.parallel_dense_ffn is not None:
            dense_mlp += n_moe * ffn_params(moe.parallel_dense_ffn, d)
    norms = model.num_layers * model.norm.per_layer * norm_params(model.norm, d)
    norms += norm_params(model.norm, d) if model.norm.final else 0
    return ParamBreakdown(
        embedding=embedding,
        attention=model.num_layers * attention_params(model.attention, d, model.head_dim),
        dense_mlp=dense_mlp,
        router=router,
        routed_experts=routed,
        routed_experts_active=routed_active,
        shared_experts=shared,
        norms=norms,
        lm_head=lm_head,
        mtp=model.mtp_layers * mtp_module_params(model) if model.mtp_layers else 0,
        mtp_active=model.mtp_layers * mtp_module_params(model, active=True) if model.mtp_layers else 0,
    )
