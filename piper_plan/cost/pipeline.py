"""Pipeline stages of a plan (the layer split rule) and the schedule's step time.

Layer split (one rule, used by ``evaluate``, ``estimate`` callers and ``plan --save``): every plan with one
model chunk per rank is priced with both the even split (specs.even_split) and the FLOP-balanced split
(``balanced_stage_layers``: dense and MoE layers weighed by forward FLOPs, the LM head on the last stage);
``evaluate`` keeps the one that fits, then the faster (see cost/batch.py). Interleaved schedules split into
pp x v model chunks: equal where num_layers divides, else Megatron-Core's split (specs.parallel.
interleaved_chunk_split: the first and / or last chunk one layer shorter) or an explicit ``virtual_stage_layers``
list; a rank then holds unequal chunks (``chunk_stage_rows``).

Step time (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", sec. 2.2):
GPipe and 1F1B take ``(M + pp - 1) x t`` with t the forward + backward time of one micro-batch on the
bottleneck stage; interleaved 1F1B with v model chunks per rank shrinks the bubble to ``(pp - 1) / v``, i.e.
pp - 1 chunk slots. With unequal chunks every one of those pp - 1 slots of the fill and drain is priced at the
slowest chunk (``uneven_bubble_seconds``): an upper bound, exact for equal chunks (tests/cost/
test_uneven_interleaved.py simulates Megatron-Core's interleaved order: the priced step is 1.7% to 8.6% above the
simulated one in its unequal cases, lighter end chunks overlapping the fill and drain).
"""

from __future__ import annotations

import numpy as np

from piper_plan.cost.flops import mtp_forward_flops
from piper_plan.cost.params import even_stage_bounds, explicit_stage_bounds, moe_prefix
from piper_plan.specs import even_split
from piper_plan.specs.parallel import MAX_BALANCED_LAYERS, model_chunks, rank_layers
from piper_plan.specs.params import attention_params, ffn_params, router_params, shared_expert_params
from piper_plan.specs.vocab import Schedule

def stage_layers(prefix: np.ndarray, num_layers: int, pp, stage, layers_per_stage=None):
    """(layers, MoE layers) of each stage, from the MoE prefix count (arrays broadcast)."""
    if layers_per_stage is None:
        start, end = even_stage_bounds(num_layers, pp, stage)
    else:
        start, end = explicit_stage_bounds(layers_per_stage, stage)
    return end - start, prefix[end] - prefix[start]


def bubble_microbatches(schedule, pp, virtual_stages):
    """Idle micro-batch slots of the schedule: pp - 1, or (pp - 1) / v interleaved."""
    return np.where(schedule == Schedule.INTERLEAVED.code, (pp - 1) / virtual_stages, pp - 1.0)


def uneven_bubble_seconds(chunk_seconds, p2p_seconds, pp, virtual_stages):
    """Bubble of interleaved 1F1B with unequal chunks: pp - 1 chunk slots of fill and drain, each the slowest
    chunk's forward + backward plus one chunk's p2p (p2p_seconds covers a rank's v chunks per micro-batch).
    Equal chunks of t / v give (pp - 1) x t / v, the interleaved bubble (Narayanan et al. 2021, sec. 2.2.2)."""
    return (chunk_seconds + p2p_seconds / virtual_stages) * (pp - 1)


# ---- interleaved model chunks ----------------------------------------------------------------------------
CHUNK_SLOT = 2
"""Split slot of the chunk rows of ``chunk_stage_rows`` (read for the bubble only; never a stage)."""


def uneven_chunks(num_layers: int, pp: int, virtual_stages: int, explicit=None) -> list[int] | None:
    """The model chunks of an interleaved plan when they are unequal (explicit list, else Megatron-Core's rule),
    else None (equal chunks are priced by the even rule)."""
    chunks = model_chunks(num_layers, pp, virtual_stages, explicit)
    return chunks if chunks is not None and len(set(chunks)) > 1 else None


def warmup_chunks(pp: int, virtual_stages: int, stage):
    """Forward chunks rank ``stage`` runs before its first backward in Megatron-Core's interleaved 1F1B
    (megatron/core/pipeline_parallel/schedules.py, forward_backward_pipelining_with_interleaving:
    (pp - i - 1) x 2 + (v - 1) x pp warm-up forwards, plus the first steady-state forward)."""
    return (pp - stage - 1) * 2 + (virtual_stages - 1) * pp + 1


def rank_chunk_table(model, chunks: list[int], pp: int) -> dict[str, np.ndarray]:
    """Per rank of an interleaved split (arrays [pp]): layers, MoE layers and the layers whose activations it
    holds at its warm-up peak. Chunk k holds the next chunks[k] layers in layer order (Megatron-Core's
    flatten_layout: virtual stage by virtual stage, rank by rank) and runs on rank k % pp; the warm-up forwards
    run chunk (j // pp) % v for the j-th forward (schedules.py get_model_chunk_id)."""
    v = len(chunks) // pp
    prefix = moe_prefix(model)
    edges = np.concatenate([[0], np.cumsum(chunks)])
    layers, moe, flight = np.zeros(pp, np.int64), np.zeros(pp, np.int64), np.zeros(pp, np.int64)
    for r in range(pp):
        own = [chunks[vs * pp + r] for vs in range(v)]
        layers[r] = sum(own)
        moe[r] = sum(prefix[edges[k + 1]] - prefix[edges[k]] for k in range(r, len(chunks), pp))
        flight[r] = sum(own[(j // pp) % v] for j in range(warmup_chunks(pp, v, r)))
    return {"layers": layers, "moe_layers": moe, "flight_layers": flight}


def chunk_stage_rows(model, chunks: list[int], pp: int) -> np.ndarray:
    """``stage_rows`` of an interleaved split with unequal chunks: int64 [R, 7] rows (slot, index, layers, MoE
    layers, first, last, layers in flight at the warm-up peak). Slot 0: the ranks (each distinct (shape, own
    chunks) once at its lowest index, which holds the most in flight); slot CHUNK_SLOT: the distinct chunks
    (first: chunk 0 with the embedding; last: the final chunk with the LM head and MTP modules)."""
    v, n = len(chunks) // pp, len(chunks)
    table = rank_chunk_table(model, chunks, pp)
    rows, seen = [], set()
    for r in range(pp):
        shape = (int(table["layers"][r]), int(table["moe_layers"][r]), int(r == 0), int(r == pp - 1))
        key = (shape, tuple(chunks[r::pp]))
        if key not in seen:
            seen.add(key)
            rows.append((0, r, *shape, int(table["flight_layers"][r])))
    assert v * pp == n
    chunk_rows = _rows(model, [chunks])            # the chunks as a contiguous split of n stages
    chunk_rows[:, 0], chunk_rows[:, 1] = CHUNK_SLOT, chunk_rows[:, 1] % pp
    return np.concatenate([np.array(rows, np.int64), chunk_rows])


def chunk_in_flight(flight, flight_layers, layers, stage, pp, num_microbatches, virtual_stages):
    """Micro-batches in flight, in units of the stage's layers, where a row has unequal chunks (flight_layers >
    0): its warm-up peak's layers / its layers, or all M micro-batches where the schedule has fewer forwards than
    the warm-up (M x v < warm-up; memory.in_flight's cap). Elsewhere ``flight`` unchanged."""
    capped = num_microbatches * virtual_stages < warmup_chunks(pp, virtual_stages, stage)
    uneven = np.where(capped, num_microbatches, flight_layers / np.maximum(layers, 1))
    return np.where(flight_layers > 0, uneven, flight)


# ---- layer split rule ----------------------------------------------------------------------------------
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


def lm_head_flops_per_token(model, seq_len: int = 0) -> float:
    """Forward FLOPs per token of what the last stage runs after its layers: the LM head (2 V d; 0 without a
    vocabulary) and the MTP modules (cost/flops.py mtp_forward_flops)."""
    return 2.0 * (model.vocab_size or 0) * model.hidden_size + mtp_forward_flops(model, seq_len)


def balanced_stage_layers(model, seq_len: int, pp: int) -> list[int]:
    """Layers per stage (contiguous, each >= 1) minimising the largest stage FLOPs, LM head on the last stage.

    Exact linear partition by dynamic programming over prefix sums, O(pp x L^2). Ties keep the even split
    when it is optimal, so a uniform model gets ``even_split``."""
    if pp == 1:
        return [model.num_layers]
    w = layer_flops_per_token(model, seq_len)
    even = even_split(model.num_layers, pp)
    best = _min_max_split(w, pp, lm_head_flops_per_token(model, seq_len))
    return even if _heaviest(w, even, model, seq_len) <= _heaviest(w, best, model, seq_len) * (1 + 1e-12) else best


def _heaviest(w: np.ndarray, split: list[int], model, seq: int) -> float:
    ends = np.cumsum(split)
    starts = ends - np.asarray(split)
    loads = [w[s:e].sum() for s, e in zip(starts, ends)]
    loads[-1] += lm_head_flops_per_token(model, seq)
    return max(loads)


_SPLITS: dict[tuple, list[int]] = {}
"""_min_max_split's answers by (layer loads, pp, tail): a search prices the same split for every node count."""


def _min_max_split(w: np.ndarray, pp: int, tail: float) -> list[int]:
    """Exact linear partition (``_partition``), remembered: the search asks the same question once per node count."""
    key = (w.tobytes(), pp, tail)
    if key not in _SPLITS:
        if len(_SPLITS) >= 256:
            _SPLITS.clear()
        _SPLITS[key] = _partition(w, pp, tail)
    return list(_SPLITS[key])


def _partition(w: np.ndarray, pp: int, tail: float) -> list[int]:
    """Exact linear partition: cost[k][j] = best max-load of layers [0, j) in k stages; the last stage carries
    ``tail``. Each k is one [L+1, L+1] array step (i = start of the k-th stage, j = its end)."""
    n = len(w)
    prefix = np.concatenate(([0.0], np.cumsum(w)))
    cost = np.full((pp + 1, n + 1), np.inf)
    cut = np.zeros((pp + 1, n + 1), dtype=np.int64)
    cost[1, 1:] = prefix[1:]
    i, j = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    load = prefix[j] - prefix[i]                                   # layers [i, j) as one stage
    for k in range(2, pp + 1):
        last = load.copy()
        if k == pp:
            last[:, n] += tail
        cand = np.where((i < j) & (i >= k - 1), np.maximum(cost[k - 1][:, None], last), np.inf)
        cut[k] = np.argmin(cand, axis=0)
        cost[k] = cand[cut[k], np.arange(n + 1)]
    split, j = [], n
    for k in range(pp, 0, -1):
        start = cut[k, j] if k > 1 else 0
        split.append(int(j - start))
        j = start
    return split[::-1]


def split_variants(model, seq_len: int, pp: int, virtual_stages: int = 1) -> list[list[int]]:
    """The layer splits a plan may use, indexed by split code: [even] or [even, FLOP-balanced] (the even one only
    beyond MAX_BALANCED_LAYERS layers); interleaved: [each rank's layers over its chunks]."""
    even = even_split(model.num_layers, pp)
    if model.num_layers > MAX_BALANCED_LAYERS and virtual_stages == 1:
        return [even]
    if pp == 1 or virtual_stages != 1:
        chunks = uneven_chunks(model.num_layers, pp, virtual_stages) if virtual_stages > 1 else None
        return [even] if chunks is None else [rank_layers(chunks, pp)]
    balanced = balanced_stage_layers(model, seq_len, pp)
    return [even] if balanced == even else [even, balanced]


def layers_per_stage_of(model, seq_len: int, pp: int, split_slot: int, virtual_stages: int = 1) -> list[int]:
    """The layers per stage of split slot 0 (even) or 1 (FLOP-balanced) of ``split_variants``."""
    variants = split_variants(model, seq_len, pp, virtual_stages)
    return variants[min(split_slot, len(variants) - 1)]


def stage_rows(model, seq_len: int, pp: int, virtual_stages: int = 1) -> np.ndarray:
    """Distinct stages of every split variant: int64 [R, 7] rows (split slot, stage index, layers, MoE layers,
    first, last, 0), each (slot, shape) once at its lowest stage index; interleaved with unequal chunks,
    ``chunk_stage_rows``; ``virtual_stages`` 0 stands for any v whose chunks are equal (the even split).

    Memory and time of a stage depend only on its shape, except the micro-batches in flight, which never
    grow with the stage index (memory.in_flight); so the lowest index of each shape holds its maximum."""
    chunks = uneven_chunks(model.num_layers, pp, virtual_stages) if virtual_stages > 1 else None
    if chunks is not None:
        return chunk_stage_rows(model, chunks, pp)
    return _rows(model, split_variants(model, seq_len, pp, virtual_stages))


def explicit_stage_rows(model, layers_per_stage: list[int]) -> np.ndarray:
    """``stage_rows`` of one explicit split, in slot 0."""
    return _rows(model, [layers_per_stage])


def _rows(model, splits: list[list[int]]) -> np.ndarray:
    """[R, 7] rows of contiguous splits (the flight column 0: memory.in_flight prices them)."""
    prefix = moe_prefix(model)
    rows = []
    for slot, split in enumerate(splits):
        pp = len(split)
        edges = np.concatenate([[0], np.cumsum(split)])
        seen = set()
        for i in range(pp):
            shape = (int(split[i]), int(prefix[edges[i + 1]] - prefix[edges[i]]), int(i == 0), int(i == pp - 1))
            if shape not in seen:
                seen.add(shape)
                rows.append((slot, i, *shape, 0))
    return np.array(rows, np.int64)
