"""FLOPs per token, per layer and component: forward, backward, recompute; and the MFU convention.

A matrix multiply ``[m x k] @ [k x n]`` costs 2 m n k FLOPs; per token, a Linear(k, n) costs 2 k n = 2 x its
weights. Backward = 2 x forward for every GEMM (input and weight gradients). Attention scores: ``Q K^T`` and
``P V`` cost 2 s x (qk width) and 2 s x (v width) per token and head; causal kernels (flash attention) skip
the masked half, so hardware FLOPs count half (unfused attention computes the whole block); flash attention's backward recomputes the scores, 5 GEMMs
against the forward's 2, i.e. 2.5 x forward (Dao et al. 2022).

Model FLOPs (MFU) and hardware FLOPs (HFU) come in two named conventions; :func:`model_flops_per_token` and
:func:`recompute_flops_per_token` are their one owner:

- ``palm`` (Chowdhery et al. 2022, appendix B; DESIGN.md): ``6 N + 12 L H Q T`` per token, N the active
  non-embedding parameters and the LM head (tied to the embedding or not), attention counted non-causal.
- ``megatron`` (what NVIDIA's published TFLOPS count: Megatron-LM's ``num_floating_point_operations``, per
  reference/validation-moe-public.md): the same GEMMs, causal attention (half the score work), and an MTP layer
  where the model has one.

HFU adds, in the same convention, the forward work that activation recomputation repeats, so HFU >= MFU by
construction (tests/cost/test_properties.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from piper_plan.cost.params import layer_params
from piper_plan.specs.model import ModelSpec

CONVENTIONS = ("palm", "megatron")
"""The FLOP-counting conventions of MFU / HFU (module docstring)."""
FLASH_BACKWARD_FACTOR = 2.5      # flash attention backward: 5 score-sized GEMMs vs 2 forward (Dao et al. 2022)


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs per token of each component of one layer (unsplit), hardware count (causal halved)."""

    attention_proj: float      # q/k/v/o projections (MLA compressions included)
    attention_core: float      # Q K^T and P V, causal
    dense_mlp: float           # MLP of a dense layer
    router: float
    experts: float             # the top_k routed experts one token visits
    shared: float              # shared experts + parallel dense MLP
    lm_head: float             # per token of the last stage


def score_widths(model: ModelSpec) -> tuple[int, int, int]:
    """(heads, qk width, v width) of the attention scores."""
    a = model.attention
    if a.kind == "mla":
        return a.num_heads, a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim
    return a.num_heads, model.head_dim, model.head_dim


def layer_flops(model: ModelSpec, seq_len: int, flash: bool = True) -> LayerFlops:
    """Forward FLOPs per token of one layer's components. Flash attention skips the masked half of the
    causal score matrix; unfused attention (``flash=False``, Megatron's baddbmm + masked softmax) computes
    all of it and masks afterwards."""
    lp = layer_params(model)
    heads, qk, v = score_widths(model)
    moe = model.moe
    return LayerFlops(
        attention_proj=2.0 * lp.attention,
        attention_core=2.0 * heads * (qk + v) * _core_keys(model, seq_len, flash),
        dense_mlp=2.0 * lp.dense_mlp,
        router=2.0 * lp.router,
        experts=2.0 * lp.expert * (moe.top_k if moe else 0),
        shared=2.0 * (lp.shared + lp.parallel_dense),
        lm_head=2.0 * (model.vocab_size or 0) * model.hidden_size,
    )


def keys_per_query(model: ModelSpec, seq_len: int, convention: str) -> float:
    """Keys each query scores, averaged over the layers: s in full layers (PaLM, non-causal) or s / 2 (megatron,
    causal); sliding-window layers score at most w: w (PaLM) or the causal window's mean w - w (w - 1) / (2 s)
    (megatron)."""
    s, a, layers = float(seq_len), model.attention, model.num_layers
    full = s if convention == "palm" else s / 2
    sliding = a.sliding_layers(layers)
    if not sliding:
        return full
    w = min(float(a.sliding_window), s)
    windowed = w if convention == "palm" else w - w * (w - 1) / (2 * s)
    return (full * (layers - sliding) + windowed * sliding) / layers


def attention_score_flops_per_token(model: ModelSpec, seq_len: int, convention: str = "palm") -> float:
    """Forward FLOPs per token of every layer's Q K^T and P V: 2 x keys per query x H (Q_qk + Q_v) per layer:
    s keys non-causal (PaLM), s / 2 causal (megatron); sliding-window layers by their window."""
    heads, qk, v = score_widths(model)
    return 2.0 * model.num_layers * heads * (qk + v) * keys_per_query(model, seq_len, convention)


def _core_keys(model: ModelSpec, seq_len: int, flash: bool) -> float:
    """Keys per query the hardware scores, averaged over layers: causal kernels skip the masked part (s / 2, or a
    window's causal mean), unfused attention computes every s x s score and masks afterwards."""
    if not flash:
        return float(seq_len)
    return keys_per_query(model, seq_len, "megatron")


def model_flops_per_token(model: ModelSpec, seq_len: int, convention: str = "palm") -> float:
    """Model FLOPs per token of training (forward + backward = 3 x forward), no recompute: ``6 N`` plus 3 x the
    attention scores (PaLM's 12 L H Q T with separate q/k and v widths for MLA). N = active non-embedding
    parameters and the LM head's V d, tied to the embedding or not (``lm_head_params``). The megatron convention
    adds the MTP modules: 3 x mtp_forward_flops."""
    n = model.params.active_excluding_embedding + lm_head_params(model)
    main = 6.0 * n + 3.0 * attention_score_flops_per_token(model, seq_len, convention)
    return main + (3.0 * mtp_forward_flops(model, seq_len) if convention == "megatron" else 0.0)


def lm_head_params(model: ModelSpec) -> int:
    """The LM head's weights the FLOP count adds to the non-embedding parameters: V d of a head tied to the input
    embedding, whose matrix active_excluding_embedding leaves out with the embedding though the head's GEMM runs
    (an untied head is among those parameters already). PaLM counts it so (its embedding is shared; its reported
    46.2% MFU, 540B at 238.3K tokens/s on 6,144 TPU v4, needs the shared matrix in N: Chowdhery et al. 2022,
    appendix B), and Megatron-LM's num_floating_point_operations adds the logits' 6 V d for every model. Before,
    a tied model's MFU left it out (gpt-22b -1.3%, switch-base -13%). The count is cost/params.py's tied_head."""
    return layer_params(model).tied_head


def mtp_forward_flops(model: ModelSpec, seq_len: int) -> float:
    """Forward FLOPs per token of the MTP modules, as Megatron-LM's ``num_floating_point_operations`` counts them
    (megatron/training/training.py: each module one more MoE layer, its norms and eh_proj ``3 d + 2 d^2``, the
    logits once more): 2 x the module's active parameters + 2 V d for its pass through the shared head + its
    block's attention scores, causal (s / 2 keys per query, full attention)."""
    if not model.mtp_layers:
        return 0.0
    heads, qk, v = score_widths(model)
    per_module = 2.0 * (model.vocab_size or 0) * model.hidden_size + 2.0 * heads * (qk + v) * seq_len / 2
    return 2.0 * model.params.mtp_active + model.mtp_layers * per_module


def recompute_flops_per_token(model: ModelSpec, seq_len: int, lf: LayerFlops, recompute, flash: bool,
                              convention: str = "palm", modules: tuple[str, ...] = ("core_attn",)):
    """Forward FLOPs per token that recomputation repeats (arrays broadcast over ``recompute`` codes): full = every
    layer's forward (GEMMs and scores; megatron: the MTP blocks' too, their shared-head logits excluded),
    selective = the GEMMs of the ``modules`` it re-runs (selective_gemm_flops_per_token; megatron: ``moe`` re-runs
    the MTP blocks' MoE too) and, with core_attn, the attention scores (none under flash attention, whose backward
    recomputes them anyway and is counted as the model's backward)."""
    import numpy as np

    from piper_plan.specs.vocab import Recompute

    moe_l, dense_l, layers = model.num_moe_layers, model.num_dense_layers, model.num_layers
    gemm_fwd = layers * lf.attention_proj + dense_l * lf.dense_mlp + moe_l * (lf.router + lf.experts + lf.shared)
    scores = attention_score_flops_per_token(model, seq_len, convention)
    if convention == "megatron":
        gemm_fwd = gemm_fwd + mtp_forward_flops(model, seq_len) \
            - model.mtp_layers * 2.0 * (model.vocab_size or 0) * model.hidden_size
    selective = selective_gemm_flops_per_token(model, lf, modules) \
        + (0.0 if flash or "core_attn" not in modules else scores)
    if convention == "megatron" and "moe" in modules and model.moe is not None and model.mtp_is_moe:
        selective = selective + model.mtp_layers * (lf.router + lf.experts + lf.shared)   # the MTP blocks' MoE
    return np.where(recompute == Recompute.FULL.code, gemm_fwd + scores,
                    np.where(recompute == Recompute.SELECTIVE.code, selective, 0.0))


def selective_gemm_flops_per_token(model: ModelSpec, lf: LayerFlops, modules) -> float:
    """Forward GEMM FLOPs per token that selective recompute of ``modules`` re-runs, as its time is priced
    (cost/stage.py selective_recompute_seconds): mla_up_proj = MLA's q and kv up-projections in every layer, mlp =
    the dense layers' MLP, shared_experts = the MoE layers' shared experts, moe = the MoE layers' router, routed
    and shared experts; the other modules (norms, the experts' activation, the attention core) hold no GEMM."""
    flops = 0.0
    a = model.attention
    if "mla_up_proj" in modules and a.kind == "mla":
        q_up = a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim) * (a.q_lora_rank or model.hidden_size)
        kv_up = a.num_heads * (a.qk_nope_head_dim + a.v_head_dim) * a.kv_lora_rank
        flops += model.num_layers * 2.0 * (q_up + kv_up)
    if "mlp" in modules:
        flops += model.num_dense_layers * lf.dense_mlp
    if "moe" in modules and model.moe is not None:               # the whole block, its shared experts included
        flops += model.num_moe_layers * (lf.router + lf.experts + lf.shared)
    elif "shared_experts" in modules and model.moe is not None:
        flops += model.num_moe_layers * 2.0 * layer_params(model).shared
    return flops
