"""Parameters per layer kind and per pipeline stage, for one rank after tp / ep / etp / pp splitting.

Counts come from ``piper_plan.specs.params`` (exact, transformers-equal); this module only splits them.
Splitting rules (Megatron-LM / Megatron-Core conventions, Shoeybi et al. 2019 and the MoE guide):
attention and dense / shared MLP matrices are split over tp, norms and the router are replicated over tp,
the word embedding and the LM head are vocabulary-parallel over tp; routed experts are split over ep
(``num_experts / ep`` whole experts per rank) and each expert's matrices over etp. The embedding sits on
the first stage, the final norm and the LM head on the last (DESIGN.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from piper_plan.specs.model import ModelSpec
from piper_plan.specs.params import (attention_params, ffn_params, linear_params, mtp_extra_params, norm_params,
                                     router_params, shared_expert_params)


@dataclass(frozen=True)
class LayerParams:
    """Parameter counts (numel) of one layer's modules and of the model's ends."""

    attention: int
    norms: int               # the per-layer norms (replicated over tp)
    dense_mlp: int           # MLP of a dense layer
    router: int
    shared: int              # shared experts (+ gate) of a MoE layer
    parallel_dense: int      # dense MLP beside the experts (Arctic)
    expert: int              # ONE routed expert
    num_experts: int
    embedding: int           # word (+ learned position) embedding
    lm_head: int             # 0 when tied or absent
    tied_head: int           # tied LM head: the copy of the word embedding the last stage keeps when pp > 1
    final_norm: int
    attention_whole: int = 0     # the parts of the modules above that tensor parallelism keeps whole on every
    dense_mlp_whole: int = 0     # rank (tp_whole_params); the rest is split over tp
    shared_whole: int = 0
    parallel_dense_whole: int = 0
    embedding_whole: int = 0
    mtp_layers: int = 0          # multi-token-prediction modules, all on the last stage (Megatron-Core puts them
    mtp_moe: bool = False        # there, after the decoder); each is a block shaped like the last layer (MoE or
    mtp_proj: int = 0            # dense) + eh_proj (split over tp like a column-parallel Linear)
    mtp_norms: int = 0           # + enorm, hnorm, final norm (whole)
    mtp_embedding: int = 0       # the word embedding the last stage keeps for its MTP modules when pp > 1


def layer_params(model: ModelSpec) -> LayerParams:
    """The per-module counts of ``model`` (one layer of each kind)."""
    d, moe = model.hidden_size, model.moe
    embedding = (model.vocab_size or 0) * d + (model.max_seq_len * d if model.learned_position_embeddings else 0)
    lm_head = 0 if (model.tie_embeddings or model.vocab_size is None) else model.vocab_size * d
    return LayerParams(
        attention=attention_params(model.attention, d, model.head_dim),
        norms=model.norm.per_layer * norm_params(model.norm, d),
        dense_mlp=ffn_params(model.dense_ffn, d) if model.dense_ffn is not None else 0,
        router=router_params(moe, d) if moe else 0,
        shared=shared_expert_params(moe, d) if moe else 0,
        parallel_dense=ffn_params(moe.parallel_dense_ffn, d) if moe and moe.parallel_dense_ffn else 0,
        expert=ffn_params(moe.expert, d) if moe else 0,
        num_experts=moe.num_experts if moe else 0,
        embedding=embedding,
        lm_head=lm_head,
        tied_head=(model.vocab_size or 0) * d if model.tie_embeddings else 0,
        final_norm=norm_params(model.norm, d) if model.norm.final else 0,
        **tp_whole_params(model),
        **mtp_params(model),
    )


def mtp_params(model: ModelSpec) -> dict:
    """The MTP fields of LayerParams (all 0 without MTP modules)."""
    if not model.mtp_layers:
        return {}
    d = model.hidden_size
    return {"mtp_layers": model.mtp_layers, "mtp_moe": model.mtp_is_moe, "mtp_proj": linear_params(2 * d, d, False),
            "mtp_norms": mtp_extra_params(model) - linear_params(2 * d, d, False),
            "mtp_embedding": 0 if model.tie_embeddings else model.vocab_size * d}


def tp_whole_params(model: ModelSpec) -> dict[str, int]:
    """Parameters tensor parallelism keeps whole on every tp rank, as piper's runtime splits them
    (runtime/tensor_parallel.py) and Megatron-LM does: a row-parallel projection's bias (attention's o, every MLP's
    down), per-head qk-norm weights, the shared-expert gate, MLA's compressions (q_a, kv_a and their norms), learned
    position embeddings."""
    a, d, moe = model.attention, model.hidden_size, model.moe
    attention = d if a.o_bias else 0
    if a.qk_norm == "per_head":
        attention += 2 * model.head_dim
    if a.kind == "mla":
        qb = int(a.qkv_bias)
        if a.q_lora_rank is not None:
            attention += (d + qb) * a.q_lora_rank + a.q_lora_rank
        attention += (d + qb) * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
    down_bias = lambda ffn: d if ffn is not None and ffn.bias else 0  # noqa: E731
    shared = 0
    if moe is not None:
        shared = moe.num_shared_experts * down_bias(moe.shared) + (d if moe.shared_expert_gate else 0)
    return {"attention_whole": attention, "dense_mlp_whole": down_bias(model.dense_ffn), "shared_whole": shared,
            "parallel_dense_whole": down_bias(moe.parallel_dense_ffn) if moe is not None else 0,
            "embedding_whole": model.max_seq_len * d if model.learned_position_embeddings else 0}


def moe_prefix(model: ModelSpec) -> np.ndarray:
    """Cumulative count of MoE layers: ``prefix[j]`` = MoE layers among layers 0..j-1 (length L + 1)."""
    is_moe = np.zeros(model.num_layers, np.int64)
    is_moe[list(model.moe_layers)] = 1
    return np.concatenate([[0], np.cumsum(is_moe)])


def even_stage_bounds(num_layers: int, pp, stage) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) layer range of ``stage`` under specs.even_split (extra layers on the later stages)."""
    pp, stage = np.asarray(pp, np.int64), np.asarray(stage, np.int64)
    base, extra = num_layers // pp, num_layers % pp
    first_big = pp - extra
    start = stage * base + np.maximum(stage - first_big, 0)
    size = base + (stage >= first_big)
    return start, start + size


def explicit_stage_bounds(layers_per_stage: list[int], stage) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) of ``stage`` for an explicit layers-per-stage list."""
    edges = np.concatenate([[0], np.cumsum(layers_per_stage)])
    stage = np.asarray(stage, np.int64)
    return edges[stage], edges[stage + 1]


def rank_stage_params(lp: LayerParams, layers, moe_layers, first, last, tp, ep, etp) -> tuple[np.ndarray, np.ndarray]:
    """(dense, expert) parameter counts held by one rank of a stage (arrays broadcast).

    ``layers`` / ``moe_layers``: layers of the stage and how many of them are MoE; ``first`` / ``last``:
    whether the stage is the first / last one (embedding / final norm + LM head; with a tied LM head and
    pp > 1 the last stage keeps its own copy of the word embedding, as Megatron-LM does; the last stage also holds
    the MTP modules, and at pp > 1 a copy of the word embedding for them, as Megatron-Core builds it)."""
    split = lambda total, whole: (total - whole) / tp + whole  # noqa: E731   (tp_whole_params stays whole)
    per_layer = split(lp.attention, lp.attention_whole) + lp.norms + split(lp.dense_mlp, lp.dense_mlp_whole)
    per_moe = (split(lp.shared, lp.shared_whole) + split(lp.parallel_dense, lp.parallel_dense_whole)
               - split(lp.dense_mlp, lp.dense_mlp_whole) + lp.router)
    first, last = np.asarray(first), np.asarray(last)
    dense = layers * per_layer + moe_layers * per_moe + first * split(lp.embedding, lp.embedding_whole)
    dense = dense + last * ((lp.lm_head + lp.tied_head * ~first) / tp + lp.final_norm)
    expert_layer = lp.num_experts * lp.expert / (ep * etp)
    expert = moe_layers * expert_layer
    if lp.mtp_layers:
        module = per_layer + lp.mtp_moe * per_moe + lp.mtp_proj / tp + lp.mtp_norms
        dense = dense + last * (lp.mtp_layers * module + lp.mtp_embedding * ~first / tp)
        expert = expert + last * (lp.mtp_layers * lp.mtp_moe * expert_layer)
    return dense, expert
