"""Per-layer and per-stage time terms of candidate plans (arrays [N]): which scope each parallel group spans,
seconds per layer per micro-batch by breakdown name, and the pipeline p2p. Used by cost/batch.py, the one
pricing pipeline.
"""

from __future__ import annotations

import numpy as np

from piper_plan.cost import stage as stg
from piper_plan.cost.overhead import host_floor_terms, moe_block_rerun, priced_overhead
from piper_plan.placement.layout import span_arrays, stage_pair_scope
from piper_plan.plans import PlanBatch
from piper_plan.specs.vocab import A2A, Recompute


def spans(alloc, c: PlanBatch) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(scope index, nodes spanned) of each parallel group kind, per candidate, in the rank order tp, cp, dp, pp
    (fastest first): "dp" is the dp x cp group the dense gradients are reduced over."""
    out = {}
    for name, stride, count in (("tp", 1, c.tp), ("cp", c.tp, c.cp), ("ep", c.etp, c.ep), ("etp", 1, c.etp),
                                ("dp", c.tp, c.dp_cp), ("edp", c.ep * c.etp, c.edp),
                                ("dp_shard", c.tp, c.dense_shard), ("dp_replicate", c.tp * c.dense_shard,
                                                                    c.dp_replicate)):
        scope, nodes, _ = span_arrays(alloc, stride, count)
        out[name] = (scope, nodes)
    out["pp"] = (stage_pair_scope(alloc, c.dp_cp * c.tp), None)
    return out


def _hide_dispatch_behind_shared_experts(per_layer: dict, shared_fb, c: PlanBatch, reruns) -> None:
    """The runtime's shared-expert overlap (planfile.RuntimeBlock.shared_expert_overlap; flat all-to-all only):
    in each pass the dispatch exchange is exposed only where it outlasts the shared experts of that pass
    (forward, its re-runs under full recompute or the ``moe`` module, backward). Scales the moe/dispatch terms in
    place.
    ``shared_fb``: stage.py's "shared_experts" (fwd, bwd), which includes a parallel dense FFN where a model has
    both (none in the catalog; the runtime runs that FFN outside the overlap)."""
    names = [n for n in per_layer if n.startswith("moe/dispatch/")]
    dispatch = sum(per_layer[n][1] for n in names)                   # all passes
    passes = 2 + reruns
    per_pass = dispatch / passes
    shared_f, shared_b = shared_fb
    exposed = (np.maximum(per_pass - shared_f, 0) * (passes - 1) + np.maximum(per_pass - shared_b, 0))
    keep = np.where((c.a2a == A2A.FLAT.code) & (dispatch > 0), exposed / np.maximum(dispatch, 1e-300), 1.0)
    for n in names:
        per_layer[n] = (per_layer[n][0], per_layer[n][1] * keep)


def _no_hit_probability(pool, held, picks: int):
    """Probability that ``picks`` distinct draws from ``pool`` items miss all ``held`` of them (hypergeometric)."""
    p = np.ones_like(np.asarray(held, float))
    for i in range(picks):
        p = p * np.maximum(pool - held - i, 0.0) / (pool - i)
    return p


def node_copy_fraction(moe, nodes) -> np.ndarray:
    """Inter-node copies of a per-node dispatch (CostOptions.ep_dispatch) over those of a per-expert one, for an
    expert group spanning ``nodes`` nodes (experts placed contiguously, E / nodes per node): the expected distinct
    nodes a token's k experts live on over k (both counts' remote share (nodes - 1) / nodes cancels), for uniform
    routing (the forced load balance of benchmark runs). With group-limited routing whose groups sit whole on
    nodes (routing_groups a multiple of nodes), a token reaches at most its routing_group_top_k groups' nodes,
    each chosen group assumed to receive one of its experts (groups are ranked by their best experts); otherwise
    the plain draw of k of E. 1 on one node."""
    nodes = np.maximum(np.asarray(nodes, float), 1.0)
    experts, k = float(moe.num_experts), moe.top_k
    distinct = nodes * (1 - _no_hit_probability(experts, experts / nodes, k))
    groups = moe.routing_groups
    if groups is not None:
        whole = np.mod(groups, nodes) == 0
        grouped = nodes * (1 - _no_hit_probability(float(groups), groups / nodes, moe.routing_group_top_k))
        distinct = np.where(whole, np.minimum(grouped, distinct), distinct)
    return np.where(nodes > 1, np.minimum(distinct / k, 1.0), 1.0)


def moe_block_tp_pairs(model) -> int:
    """Tensor-parallel all-gather / reduce-scatter pairs of an MoE layer's block (beside attention's one): one where
    the block holds a dense FFN split over tp (shared experts, Arctic's residual MLP), which gathers the sequence
    shard's rows and scatters its output; none for the routed experts alone, which run on the rank's own sequence
    shard (expert tensor parallelism's gather is the `etp` term): Megatron-Core's token dispatchers gather over the
    expert tensor-parallel group only (megatron/core/transformer/moe/token_dispatcher.py: ``tp_group`` is the
    expert tp group), and piper's runtime routes the shard (runtime/tensor_parallel.py). Before, every MoE layer
    was priced with the block's pair (Mixtral on dgx-h100 at tp 4: comm/tp 0.303 s a step against 0.152)."""
    moe = model.moe
    return int(moe is not None and (moe.num_shared_experts > 0 or moe.parallel_dense_ffn is not None))


def _time_terms(ctx, c: PlanBatch, group_spans, acts) -> dict:
    """Seconds per micro-batch by breakdown name: {name: (per dense layer, per MoE layer)} (arrays [N]); the
    LM head's (seconds, 0) under "compute/lm_head" (it runs once, on the last stage)."""
    o = ctx.opts
    comp = stg.layer_compute_seconds(ctx, c)
    comm = stg.layer_comm_seconds(ctx, c, group_spans)
    zero = np.zeros(len(c))
    fb = lambda name: comp[name][0] + comp[name][1] if name in comp else zero   # noqa: E731
    fwd = lambda name: comp[name][0] if name in comp else zero                  # noqa: E731
    dense_b, moe_b = stg.elementwise_bytes_per_layer(ctx, c, acts)
    elem_d, elem_m = ctx.rates.memory_seconds(dense_b), ctx.rates.memory_seconds(moe_b)
    attn = fb("attention") + fb("attention_core")
    full = c.recompute == Recompute.FULL.code
    # selective recompute re-runs the attention core: its GEMMs and its softmax / mask / dropout kernels, which
    # write and read the s^2 tensors once more (the same elementwise rule as elementwise_bytes_per_layer)
    core_elem = ctx.rates.memory_seconds(2 * acts["attention_core"])
    selective = c.recompute == Recompute.SELECTIVE.code
    no_core_rerun = ctx.training.flash_attention or "core_attn" not in ctx.opts.recompute_modules
    sel = zero if no_core_rerun else np.where(selective, fwd("attention_core") + core_elem, 0.0)
    sel_d, sel_m = stg.selective_recompute_seconds(ctx, c, comp, acts)
    attn_fwd = fwd("attention") + fwd("attention_core")
    rec_d = np.where(full, attn_fwd + fwd("mlp") + elem_d, sel + np.where(selective, sel_d, 0.0))
    rec_m = np.where(full, attn_fwd + fwd("router") + fwd("experts") + fwd("shared_experts") + elem_m,
                     sel + np.where(selective, sel_m, 0.0))
    passes = 2 + full                                         # forward, backward, + recompute forward
    reruns = full + moe_block_rerun(ctx, c)                   # forwards of the MoE block beyond the first
    tp = comm["tp"] * passes * (1 - o.tp_overlap)
    tp_moe = comm["tp"] / 2 * (passes + moe_block_tp_pairs(ctx.model) * (passes + reruns - full)) \
        * (1 - o.tp_overlap)
    cp = stg.cp_exchange_seconds(c, comm["cp_step"], fwd("attention_core"), comp["attention_core"][1], 1 + full)
    per_layer = {
        "compute/attention": (attn, attn), "compute/mlp": (fb("mlp"), zero),
        "compute/router": (zero, fb("router")), "compute/experts": (zero, fb("experts")),
        "compute/shared_experts": (zero, fb("shared_experts")),
        "compute/elementwise": (3 * elem_d, 3 * elem_m), "compute/recompute": (rec_d, rec_m),
        "comm/tp": (tp, tp_moe), "comm/cp": (cp, cp),
    }
    if "a2a_intra" in comm:
        if o.ep_dispatch == "per_node":
            comm["a2a_inter"] = comm["a2a_inter"] * node_copy_fraction(ctx.model.moe, group_spans["ep"][1])
        per_layer["comm/etp"] = (zero, comm["etp"] * (2 + reruns) * (1 - o.tp_overlap))
        for part in ("dispatch", "combine"):
            for where, key in (("intra_node", "a2a_intra"), ("inter_node", "a2a_inter")):
                per_layer[f"moe/{part}/{where}"] = (zero, comm[key] / 2 * (2 + reruns) * (1 - o.a2a_overlap))
        if o.shared_expert_overlap and ctx.model.moe.num_shared_experts:
            _hide_dispatch_behind_shared_experts(per_layer, comp["shared_experts"], c, reruns)
    head_f, head_b = stg.gemm_16bit(ctx, c.seq_share * ctx.training.seq_len, (ctx.model.vocab_size or 0) / c.tp,
                                    ctx.model.hidden_size)
    per_layer["compute/lm_head"] = (head_f + head_b, zero)       # per stage, not per layer: see layer_terms
    overhead = priced_overhead(ctx.rates.calibration, ctx.platform, o)
    if overhead is not None:     # piper's runtime's own host work, measured (cost/overhead.py): it alone prices it
        return _with_overhead(ctx, c, group_spans, overhead, per_layer)
    # else Megatron-Core's host work per GEMM call, last, against every device term of the layer as priced (the
    # LM head is per stage, not per layer); before, a platform with both would have priced a runtime's host twice
    per_layer.update(host_floor_terms(ctx, c, {k: v for k, v in per_layer.items()
                                              if k not in ("compute/lm_head", HOST_ISSUE, HOST_ISSUE_HEAD)}))
    return per_layer


HOST_ISSUE = "host/issue"
"""Not a time term: on a GPU, the host's seconds to issue a layer (and, ``HOST_ISSUE_HEAD``, the LM head and loss)
per micro-batch, which layer_terms hands out apart (cost/batch.py prices the step's host floor from them)."""
HOST_ISSUE_HEAD = "host/issue_head"
HOST_ISSUE_STEP = "host/issue_step"
"""Not a time term either: on a GPU, the host's seconds to issue the optimizer step (cost/batch.py sync_by_key)."""


def _with_overhead(ctx, c, group_spans, overhead, per_layer: dict) -> dict:
    """The per-layer terms with the measured framework overhead (cost/overhead.py overhead_terms). On a CPU the host
    runs the layer's work itself: its fixed costs add to the FLOP-priced compute (scaled by the ranks sharing its
    cores). On a GPU the host issues work while the device runs what it issued before: its seconds go out apart
    (``HOST_ISSUE``), and the step takes the longer of the two (cost/batch.py ``host_floor``)."""
    from piper_plan.cost.overhead import overhead_terms

    extra, head_s, scale = overhead_terms(ctx, c, group_spans, overhead)
    zero = 0.0 * c.ep
    if ctx.platform.launch.device == "cpu":
        per_layer = {k: ((d * scale, m * scale) if k.startswith("compute/") else (d, m))
                     for k, (d, m) in per_layer.items()}
        per_layer.update(extra)
        per_layer["compute/lm_head"] = (per_layer["compute/lm_head"][0] + head_s, zero)
        return per_layer
    per_layer[HOST_ISSUE] = extra.pop("framework/layer")
    per_layer[HOST_ISSUE_HEAD] = (head_s + zero, zero)
    per_layer.update(extra)
    return per_layer


def p2p_seconds(ctx, c: PlanBatch, group_spans) -> np.ndarray:
    """Activations forward and gradients backward across one stage boundary per micro-batch (x v chunks).

    Each tp rank sends 1/tp of the activation (Megatron's scatter/gather optimisation, Narayanan et al.
    2021 sec. 4.1; with sequence parallelism the activation is split anyway); the intra-node all-gather that
    follows is small and not counted."""
    nbytes = c.seq_share * ctx.training.seq_len * ctx.model.hidden_size * ctx.training.activation_bytes / c.tp
    t = 2 * ctx.net.seconds("p2p", 2, nbytes, group_spans["pp"][0]) * c.virtual_stages
    return np.where(c.pp > 1, t * (1 - ctx.opts.p2p_overlap), 0.0)


def layer_terms(ctx, alloc, sub: PlanBatch, acts):
    """Per-layer time coefficients {name: (per dense layer, per MoE layer)}, the LM head's seconds, and on a GPU with
    measured framework overhead the host's issue seconds ({HOST_ISSUE: (per dense, per MoE layer)}, the head's),
    else None, for candidates ``sub`` (one row per distinct cost/batch.py's KEY_TIME)."""
    terms = _time_terms(ctx, sub, spans(alloc, sub), acts)
    host = terms.pop(HOST_ISSUE, None)
    head_host = terms.pop(HOST_ISSUE_HEAD, (0.0, 0.0))[0]
    return terms, terms.pop("compute/lm_head")[0], (None if host is None else ({HOST_ISSUE: host}, head_host))
