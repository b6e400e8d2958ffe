"""Uneven pipeline stage splits: layers per stage balanced by forward FLOPs per token.

An even split by layer count is wrong when layers differ: DeepSeek-V3's first 3 layers are dense, Llama 4
Maverick alternates dense and MoE layers, and the LM head (2 V d FLOPs per token) sits on the last stage.
``balanced_stage_layers`` cuts the layer sequence into ``pp`` contiguous, non-empty stages minimising the
heaviest stage (the pipeline's bottleneck), by dynamic programming over prefix sums (exact, O(pp x L^2) in numpy).
"""

from __future__ import annotations

import numpy as np

from piper_plan.specs import even_split
from piper_plan.specs.params import attention_params, ffn_params, router_params, shared_expert_params


def layer_flops_per_token(model, seq_len: int) -> np.ndarray:
    """Forward FLOPs per token of each layer: 2 x its active weights + attention scores (4 s H head_dim, non-causal)."""
    d = model.hidden_size
    attn = 2.0 * attention_params(model.attention, d, model.head_dim)
    attn += 4.0 * seq_len * model.attention.num_heads * model.head_dim
    out = np.full(model.num_layers, attn)
    moe = model.moe
    for i in range(model.num_layers):
        if model.is_moe_layer(i):
            active = router_params(moe, d) + moe.top_k * ffn_params(moe.expert, d) + shared_expert_params(moe, d)
            if moe.parallel_dense_ffn is not None:
                active += ffn_params(moe.parallel_dense_ffn, d)
        else:
            active = ffn_params(model.dense_ffn, d)
        out[i] += 2.0 * active
    return out


def lm_head_flops_per_token(model) -> float:
    """The LM head's forward FLOPs per token (2 V d); 0 without a vocabulary."""
    return 2.0 * (model.vocab_size or 0) * model.hidden_size


def balanced_stage_layers(model, seq_len: int, pp: int) -> list[int]:
    """Layers per stage (contiguous, each >= 1) minimising the largest stage FLOPs, LM head on the last stage.

    Ties keep the even split when it is optimal, so a uniform model gets ``even_split``.
    """
    if pp == 1:
        return [model.num_layers]
    w = layer_flops_per_token(model, seq_len)
    even = even_split(model.num_layers, pp)
    best = _min_max_split(w, pp, lm_head_flops_per_token(model))
    return even if _heaviest(w, even, model) <= _heaviest(w, best, model) * (1 + 1e-12) else best


def _heaviest(w: np.ndarray, split: list[int], model) -> float:
    ends = np.cumsum(split)
    starts = ends - np.asarray(split)
    loads = [w[s:e].sum() for s, e in zip(starts, ends)]
    loads[-1] += lm_head_flops_per_token(model)
    return max(loads)


def _min_max_split(w: np.ndarray, pp: int, tail: float) -> list[int]:
    """Exact linear partition: cost[k][j] = best max-load of layers [0, j) in k stages; the last stage carries ``tail``."""
    n = len(w)
    prefix = np.concatenate(([0.0], np.cumsum(w)))
    cost = np.full((pp + 1, n + 1), np.inf)
    cut = np.zeros((pp + 1, n + 1), dtype=np.int64)
    cost[1, 1:] = prefix[1:]
    for k in range(2, pp + 1):
        for j in range(k, n + 1):
            i = np.arange(k - 1, j)
            last = prefix[j] - prefix[i] + (tail if (k == pp and j == n) else 0.0)
            cand = np.maximum(cost[k - 1, i], last)
            pick = int(np.argmin(cand))
            cost[k, j], cut[k, j] = cand[pick], i[pick]
    split, j = [], n
    for k in range(pp, 0, -1):
        i = cut[k, j] if k > 1 else 0
        split.append(int(j - i))
        j = i
    return split[::-1]
