"""One pipeline stage, for one rank: memory by component and time per micro-batch by component.

Every function takes candidate arrays (shape [N]) and stage arrays (shape [S, N]) and broadcasts; the
only Python loops are over components. Names of the returned dicts are the hierarchical breakdown names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from piper_plan.cost import memory as mem
from piper_plan.cost.comm import Network
from piper_plan.cost.compute import Rates
from piper_plan.cost.flops import FLASH_BACKWARD_FACTOR, LayerFlops, layer_flops
from piper_plan.cost.options import CostOptions, check_modules_exist
from piper_plan.cost.params import LayerParams, layer_params, rank_stage_params
from piper_plan.specs.model import ModelSpec
from piper_plan.specs.platform import PlatformSpec
from piper_plan.specs.training import TrainingSpec
from piper_plan.specs.vocab import Recompute

FULL, SELECTIVE = Recompute.FULL.code, Recompute.SELECTIVE.code
LOSS_SOFTMAX_BYTES = 4   # the fp32 softmax Megatron's native cross entropy saves per logit (end_bytes)


@dataclass
class Context:
    """Everything about (model, platform, training) that does not depend on the candidate."""

    model: ModelSpec
    platform: PlatformSpec
    training: TrainingSpec
    opts: CostOptions
    lp: LayerParams
    lf: LayerFlops
    rates: Rates
    net: Network
    stage_rows: dict = field(default_factory=dict)
    """pipeline.stage_rows per (pp, virtual stages), filled by cost/batch.py as the search meets them."""


def make_context(model, platform, training, opts, calibration=None) -> Context:
    check_modules_exist(model, opts.recompute_modules)
    return Context(model, platform, training, opts, layer_params(model), layer_flops(model, training.seq_len, training.flash_attention),
                   Rates(platform, training.dtype, calibration, training.fp8_recipe), Network(platform, calibration))


@dataclass
class StageShape:
    """Which layers a stage holds: arrays [S, N]."""

    layers: np.ndarray
    moe_layers: np.ndarray
    first: np.ndarray
    last: np.ndarray

    @property
    def dense_layers(self):
        return self.layers - self.moe_layers


def with_mtp_blocks(model: ModelSpec, st: StageShape) -> StageShape:
    """The transformer blocks a stage runs: its layers, and on the last stage the MTP modules' blocks (each shaped
    like the model's last layer), whose activations and time count like a layer's."""
    if not model.mtp_layers:
        return st
    extra = st.last * model.mtp_layers
    return StageShape(st.layers + extra, st.moe_layers + extra * model.mtp_is_moe, st.first, st.last)


# ---- memory ----------------------------------------------------------------------------------------
# Every per-rank token count below is c.seq_share x seq_len = mbs x s / cp: context parallelism splits each
# sequence, so activations, GEMMs, the attention scores a rank computes (its queries against all keys, s / 2 on
# average under the load-balanced causal split) and the collectives all scale by 1 / cp.
def sequence_split(c):
    """How many ways activations outside the tp region are split: tp with sequence parallelism, else 1."""
    return np.where(c.sequence_parallel == 1, c.tp, 1)


def layer_activations(ctx: Context, c, streamed: bool = False) -> dict:
    """Per-layer, per-micro-batch activation bytes by component (arrays [N]): as saved for backward, or
    (``streamed``) as the elementwise kernels read and write them, in the activation dtype (the 8-bit casts of
    GEMM inputs that fp8 recipes save are extra outputs of those kernels, not smaller tensors)."""
    m, t, o = ctx.model, ctx.training, ctx.opts
    if streamed:
        t = t.model_copy(update={"dtype": t.attention_dtype, "fp8_recipe": None})
    sp = sequence_split(c)
    kept, core = mem.attention_activation_bytes(m, t, o, c.tp, c.seq_share, sp)
    out = {"attention": kept, "attention_core": core + 0.0 * kept,
           "mlp": mem.dense_mlp_activation_bytes(m, t, o, c.tp, c.seq_share, sp) if m.dense_ffn is not None else 0.0 * kept,
           "input": mem.layer_input_bytes(m, t, o, c.tp, c.seq_share, sp)}
    if m.moe is not None:
        for name, value in mem.moe_activation_bytes(m, t, o, c.tp, c.seq_share, c.ep, c.etp, sp).items():
            out[f"moe/{name}"] = value + 0.0 * kept
    if not streamed:
        out["selective"] = mem.selective_dropped_bytes(m, t, o, c.tp, c.seq_share, c.ep, c.etp, sp)
    return out


def stage_memory(ctx: Context, c, st: StageShape, flight, acts, loss_flight) -> dict[str, np.ndarray]:
    """Bytes per rank of a stage by component (arrays shaped like ``st``); ``total`` includes overheads.
    ``flight``: micro-batches in flight (memory.in_flight); ``loss_flight``: those whose logits the last stage
    holds (memory.loss_in_flight); ``acts``: layer_activations(ctx, c)."""
    dense, expert = rank_stage_params(ctx.lp, st.layers, st.moe_layers, st.first, st.last, c.tp, c.ep, c.etp)
    out = mem.state_bytes(ctx.training, dense, expert, c.dense_shard, c.edp, c.zero, c.pp, *_largest_layer(ctx, c, st),
                          fp32_replicas=ctx.opts.unfused_kernels)
    st = with_mtp_blocks(ctx.model, st)                   # activations: the MTP blocks count like layers
    selective = c.recompute == SELECTIVE
    drops_core = (c.recompute == FULL) | (selective & ("core_attn" in ctx.opts.recompute_modules))
    core = np.where(drops_core, 0.0, acts["attention_core"])
    keep_all = c.recompute != FULL
    kept = lambda name: acts[name] - np.where(selective, acts["selective"].get(name, 0.0), 0.0)  # noqa: E731
    layer_sum = lambda value, count: np.where(keep_all, value * count * flight, 0.0)  # noqa: E731
    out["activations/attention"] = layer_sum(kept("attention") + core, st.layers)
    out["activations/mlp"] = layer_sum(kept("mlp"), st.dense_layers)
    for k in _moe_names(acts):
        out[f"activations/{k}"] = layer_sum(kept(k), st.moe_layers)
    out["activations/recompute_inputs"] = np.where(keep_all, 0.0, acts["input"] * st.layers * flight)
    rebuilt_core = np.where(drops_core, acts["attention_core"], 0.0)
    out["activations/recompute_working"] = np.where(
        keep_all, np.where(selective, _selective_working(st, acts, rebuilt_core), 0.0), _working(st, acts))
    out.update(_end_activations(ctx, c, st, flight, loss_flight))
    tensors = sum(out.values())
    out["fragmentation"] = tensors * ctx.platform.memory.fragmentation
    out["framework"] = np.zeros_like(tensors) + ctx.platform.memory.framework_bytes
    out["total"] = tensors + out["fragmentation"] + out["framework"]
    return out


def stage_saved_state(ctx: Context, c, st: StageShape) -> np.ndarray:
    """Bytes per rank of a stage's state that a checkpoint saves (memory.saved_state_bytes)."""
    dense, expert = rank_stage_params(ctx.lp, st.layers, st.moe_layers, st.first, st.last, c.tp, c.ep, c.etp)
    return mem.saved_state_bytes(ctx.training, dense, expert, c.dense_shard, c.edp, c.zero,
                                 fp32_replicas=ctx.opts.unfused_kernels)


def _largest_layer(ctx: Context, c, st: StageShape):
    """(params of the stage's largest layer, of its root: embedding / final norm / LM head) on one rank."""
    layer_d, layer_e = rank_stage_params(ctx.lp, np.minimum(st.layers, 1), np.minimum(st.moe_layers, 1), False,
                                         False, c.tp, c.ep, c.etp)
    root_d, root_e = rank_stage_params(ctx.lp, 0, 0, st.first, st.last, c.tp, c.ep, c.etp)
    return layer_d + layer_e, root_d + root_e


def _moe_names(acts) -> list[str]:
    return [k for k in acts if k.startswith("moe/")]


def _layer_totals(acts):
    """(dense layer, MoE layer) activation bytes with everything kept (no recompute)."""
    attn = acts["attention"] + acts["attention_core"]
    moe_sum = acts["moe_total"] if "moe_total" in acts else sum((acts[k] for k in _moe_names(acts)), 0.0)
    return attn + acts["mlp"], attn + moe_sum


def _working(st: StageShape, acts):
    """Full recompute rebuilds one layer's activations at a time: the largest layer of the stage."""
    per_dense, per_moe = _layer_totals(acts)
    return np.maximum(np.where(st.dense_layers > 0, per_dense, 0), np.where(st.moe_layers > 0, per_moe, 0))


def _selective_working(st: StageShape, acts, core):
    """Selective recompute rebuilds what it dropped one layer at a time, in that layer's backward: the largest
    layer's dropped bytes (memory.selective_dropped_bytes; the whole MoE block under ``moe``) and ``core``, the
    attention core's saved tensors where ``core_attn`` dropped them (nothing under flash attention)."""
    dropped = acts["selective"]
    attn = dropped.get("attention", 0.0) + core
    per_dense = attn + dropped.get("mlp", 0.0)
    per_moe = attn + sum((v for k, v in dropped.items() if k.startswith("moe/")), 0.0)
    return np.maximum(np.where(st.dense_layers > 0, per_dense, 0), np.where(st.moe_layers > 0, per_moe, 0))


def end_bytes(ctx: Context, c):
    """(first stage, last stage) activation bytes per micro-batch in flight outside the layers: what the embedding
    saves, its int64 token ids and, with dropout, the 1-byte mask of the dropout on its output (as the layers'
    dropouts keep theirs: memory.py); its output is layer 0's norm input, which that layer's activations hold
    (before, it was counted here once more: 6.25 GiB on gpt-1t's first stage at tp 8, pp 64); the loss's fp32
    softmax of the logits (Megatron-Core's vocab-parallel cross entropy upcasts the logits and saves
    exp(logits - max) in fp32, in place; the head's own bf16 output is saved by nobody:
    megatron/core/fusions/fused_cross_entropy.py ``_VocabParallelCrossEntropy.forward``, and the unfused
    tensor_parallel/cross_entropy.py on ``logits.float()``), or under ``cross_entropy_fusion_impl="te"`` the
    logits themselves, which Transformer Engine's loss overwrites with their gradient (CostOptions), once more
    per MTP module with its embedding output, hidden state and eh_proj input (4 d per token) around its block.
    ``unfused_kernels`` (piper's runtime): the embedding keeps its int64 token ids (its output is layer 0's norm
    input); the loss keeps the fp32 log-softmax and the int64 targets, the head its input, the final norm its
    input, normalised input and fp32 rstd; under its chunked loss (``loss_chunk_rows``, a micro-batch of more
    tokens) no fp32 log-softmax (measured with the runtime's tensor accounting on tiny-moe, mbs 2, seq 64: 262,148 B
    fewer saved = 128 tokens x 512 x 4 B + one scalar; the chunk being recomputed in backward is not counted)."""
    m, t = ctx.model, ctx.training
    tokens = c.seq_share * t.seq_len
    sp = sequence_split(c)
    d_bytes = tokens * m.hidden_size * t.activation_bytes / sp
    if ctx.opts.unfused_kernels:
        chunk = ctx.opts.loss_chunk_rows
        whole = np.ones_like(tokens) if chunk is None else (c.mbs * t.seq_len <= chunk)
        logits = np.where(whole, tokens * (m.vocab_size or 0) / c.tp * 4, 0.0) + 3 * d_bytes + tokens * (4 + mem.INDEX_BYTES) \
            + mem.gathered_input_bytes(tokens, m.hidden_size, t.activation_bytes, sp, ctx.opts)   # the head's input
        logits = logits * (1 + m.mtp_layers) + m.mtp_layers * 4 * d_bytes
        return tokens * mem.INDEX_BYTES + 0.0 * d_bytes, logits
    per_logit = LOSS_SOFTMAX_BYTES if ctx.opts.cross_entropy_fusion_impl == "native" else t.activation_bytes
    logits = tokens * (m.vocab_size or 0) / c.tp * per_logit
    embedding = tokens * mem.INDEX_BYTES + (tokens * m.hidden_size / sp if ctx.opts.dropout else 0.0 * tokens)
    return embedding, logits * (1 + m.mtp_layers) + m.mtp_layers * 4 * d_bytes


def loss_memory_per_micro_batch(ctx: Context, c, st: StageShape) -> dict:
    """What one more micro-batch of logits in flight adds to stage_memory's components: the logits, their share
    of fragmentation, and the total."""
    _, logits = end_bytes(ctx, c)
    held = np.where(st.last, logits, 0.0)
    frag = ctx.platform.memory.fragmentation
    return {"activations/logits": held, "fragmentation": held * frag, "total": held * (1 + frag)}


def _end_activations(ctx: Context, c, st: StageShape, flight, loss_flight) -> dict:
    """end_bytes on the first / last stage, times the micro-batches in flight there: the stage's for the embedding,
    ``loss_flight`` for the logits (a micro-batch's loss graph lives until its backward: all M under GPipe, one
    under 1F1B)."""
    emb, logits = end_bytes(ctx, c)
    return {"activations/embedding": np.where(st.first, emb * flight, 0.0),
            "activations/logits": np.where(st.last, logits * loss_flight, 0.0)}


# ---- time per micro-batch ------------------------------------------------------------------------
def _gemm(ctx: Context, m, n, k, groups=1):
    """(forward, backward) seconds of one linear layer's GEMM shape (in the training precision, with its recipe)."""
    r = ctx.rates
    return r.linear_seconds(m, n, k, groups), r.linear_seconds(m, n, k, groups, backward=True)


def gemm_16bit(ctx: Context, m, n, k, groups=1):
    """(forward, backward) seconds of a GEMM an 8-bit recipe leaves in 16 bits (``Rates.high_precision``): the
    router, the output layer, unfused attention."""
    r = ctx.rates.high_precision
    return r.gemm_seconds(m, n, k, groups), r.gemm_seconds(m, n, k, groups, backward=True)


def _ffn_gemms(ctx: Context, ffn, rows, tp, groups=1, count=1):
    """(fwd, bwd) seconds of ``count`` MLPs of shape ``ffn`` over ``rows`` rows (per group), split over tp."""
    d = ctx.model.hidden_size
    up_n = ffn.intermediate_size * (2 if ffn.gated else 1) * count / tp
    f1, b1 = _gemm(ctx, rows, up_n, d, groups)
    f2, b2 = _gemm(ctx, rows, d, ffn.intermediate_size * count / tp, groups)
    return f1 + f2, b1 + b2


def layer_compute_seconds(ctx: Context, c) -> dict[str, tuple]:
    """(fwd, bwd) seconds per layer per micro-batch, by component (arrays [N])."""
    m, t = ctx.model, ctx.training
    tokens = c.seq_share * t.seq_len
    d = m.hidden_size
    out = {"attention": _gemm(ctx, tokens, ctx.lp.attention / d / c.tp, d)}
    out["attention_core"] = _attention_core(ctx, c)
    if m.dense_ffn is not None:
        out["mlp"] = _ffn_gemms(ctx, m.dense_ffn, tokens, c.tp)
    if m.moe is not None:
        moe = m.moe
        out["router"] = gemm_16bit(ctx, tokens / c.tp, moe.num_experts, d)
        _, received = mem.routed_rows(m, t, c.tp, c.seq_share, c.ep)
        local = moe.num_experts / c.ep
        out["experts"] = _ffn_gemms(ctx, moe.expert, received * c.etp / local, c.etp, groups=local)
        shared = (0.0 * tokens, 0.0 * tokens)
        if moe.num_shared_experts:
            shared = _ffn_gemms(ctx, moe.shared, tokens, c.tp, count=moe.num_shared_experts)
        if moe.parallel_dense_ffn is not None:
            pf, pb = _ffn_gemms(ctx, moe.parallel_dense_ffn, tokens, c.tp)
            shared = (shared[0] + pf, shared[1] + pb)
        out["shared_experts"] = shared
    return out


def selective_recompute_seconds(ctx: Context, c, comp, acts) -> tuple:
    """(dense layer, MoE layer) forward seconds that ``recompute: selective`` re-runs in backward per micro-batch,
    beyond the attention core, for the modules of CostOptions.recompute_modules (memory.selective_dropped_bytes):
    MLA's up-projection GEMMs (q from its latent, k_nope and v from the kv latent), the dense MLP's and the shared
    experts' forward, and memory-bound kernels (the norms, the experts' activation) at HBM bandwidth: read their
    input, write their output once more; ``moe``, the MoE block's GEMMs and memory-bound kernels (its all-to-alls:
    terms.py). ``comp``: layer_compute_seconds; ``acts``: layer_activations."""
    m, t, modules = ctx.model, ctx.training, set(ctx.opts.recompute_modules)
    tokens, d, ab = c.seq_share * t.seq_len, m.hidden_size, t.activation_bytes
    zero = 0.0 * tokens
    attn, dense, moe = zero, zero, zero
    a = m.attention
    if "mla_up_proj" in modules and a.kind == "mla":
        heads = a.num_heads / c.tp
        q_up = _gemm(ctx, tokens, heads * (a.qk_nope_head_dim + a.qk_rope_head_dim), a.q_lora_rank or d)[0]
        kv_up = _gemm(ctx, tokens, heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank)[0]
        attn = attn + q_up + kv_up
    if "layernorm" in modules:
        norm = ctx.rates.memory_seconds(2 * tokens * d * ab / sequence_split(c))
        attn, dense, moe = attn + norm, dense + norm, moe + norm
    if "mlp" in modules and "mlp" in comp:
        dense = dense + comp["mlp"][0]
    whole_block = "moe" in modules and m.moe is not None          # covers moe_act and shared_experts
    if whole_block:
        moe = moe + comp["router"][0] + comp["experts"][0] + comp["shared_experts"][0] \
            + ctx.rates.memory_seconds(moe_block_streamed_bytes(ctx, c, acts, with_input=False))
    if "moe_act" in modules and m.moe is not None and not whole_block:
        _, received = mem.routed_rows(m, t, c.tp, c.seq_share, c.ep)
        moe = moe + ctx.rates.memory_seconds(received * 3 * m.moe.expert.intermediate_size * ab)
    if "shared_experts" in modules and m.moe is not None and m.moe.num_shared_experts and not whole_block:
        moe = moe + _ffn_gemms(ctx, m.moe.shared, tokens, c.tp, count=m.moe.num_shared_experts)[0]
    return attn + dense, attn + moe


def _attention_core(ctx: Context, c):
    """(fwd, bwd) seconds of Q K^T and P V. Flash attention: the attention rate, backward 2.5 x forward.
    Unfused attention: two batched GEMMs per head ([s x qk] @ [qk x s], [s x s] @ [s x v]), priced by GEMM
    shape (low intensity for small head widths), backward 2 x forward; softmax and masks are elementwise."""
    m, t = ctx.model, ctx.training
    tokens, s = c.seq_share * t.seq_len, t.seq_len
    core_flops = tokens * ctx.lf.attention_core / c.tp
    heads = m.attention.num_heads / c.tp
    if t.flash_attention:
        rate = ctx.rates.attention_flops_per_s
        return (core_flops / rate(s, heads, m.head_dim, "fwd"),
                FLASH_BACKWARD_FACTOR * core_flops / rate(s, heads, m.head_dim, "bwd"))
    from piper_plan.cost.flops import score_widths

    _, qk, v = score_widths(m)
    batch = c.seq_share * heads
    scores, values = gemm_16bit(ctx, s, s, qk, batch), gemm_16bit(ctx, s, v, s, batch)
    return scores[0] + values[0], scores[1] + values[1]


def layer_comm_seconds(ctx: Context, c, spans) -> dict[str, np.ndarray]:
    """Seconds of one forward pass's collectives per layer per micro-batch (arrays [N]); the backward
    repeats them once, full recompute once more. spans: dict name -> (scope, nodes) from placement."""
    m, t = ctx.model, ctx.training
    tokens, ab, d = c.seq_share * t.seq_len, t.activation_bytes, m.hidden_size
    out = {"tp": 2 * ctx.net.seconds("all_reduce", c.tp, tokens * d * ab, spans["tp"][0]),
           "cp_step": cp_step_seconds(ctx, c, spans["cp"][0])}
    if m.moe is not None:
        sent, received = mem.routed_rows(m, t, c.tp, c.seq_share, c.ep)
        load = received / sent                                  # the busiest receiver sets the pace
        nbytes = sent * d * ab * load
        intra, inter = ctx.net.a2a_seconds(c.a2a, c.ep, spans["ep"][1], nbytes, spans["ep"][0])
        out["a2a_intra"], out["a2a_inter"] = 2 * intra, 2 * inter   # dispatch + combine
        # expert tensor parallelism: all-gather the etp group's rows before, reduce-scatter after the experts
        out["etp"] = ctx.net.seconds("all_reduce", c.etp, nbytes * c.etp, spans["etp"][0])
    return out


def kv_bytes(ctx: Context, c):
    """Bytes of K and V of one rank's sequence chunks per layer and micro-batch, for its tp share of the heads:
    what one step of the context-parallel ring sends (MLA: per-head K (nope + rope) and V, as Megatron-Core
    passes them to Transformer Engine's ring attention)."""
    from piper_plan.cost.flops import score_widths

    m, t = ctx.model, ctx.training
    heads, qk, v = score_widths(m)
    kv_heads = heads if m.attention.kind == "mla" else m.attention.kv_heads
    return c.seq_share * t.seq_len * kv_heads * (qk + v) / c.tp * t.activation_bytes


def cp_step_seconds(ctx: Context, c, cp_scope):
    """Seconds of one step of the context-parallel ring (kv_bytes as one p2p at the cp group's scope); 0 at cp = 1."""
    ring = c.cp > 1
    if not ring.any():
        return np.zeros(len(c))
    return np.where(ring, ctx.net.seconds("p2p", 2, kv_bytes(ctx, c), cp_scope), 0.0)


def cp_exchange_seconds(c, step_s, core_fwd_s, core_bwd_s, passes_fwd):
    """Exposed seconds of the context-parallel KV ring per layer and micro-batch (Megatron-Core's cp_comm_type
    p2p, Transformer Engine's ring attention): cp - 1 steps each send K and V of the local chunk (``step_s``), and
    each overlaps the attention compute of one step, 1 / cp of the core; backward passes K, V and their gradients
    (twice the bytes) against the backward core. What the compute does not cover is exposed; ``passes_fwd``:
    forward passes (2 with full recompute)."""
    steps = c.cp - 1
    fwd = steps * np.maximum(step_s - core_fwd_s / c.cp, 0.0)
    bwd = steps * np.maximum(2 * step_s - core_bwd_s / c.cp, 0.0)
    return fwd * passes_fwd + bwd


def elementwise_bytes_per_layer(ctx: Context, c, acts) -> tuple:
    """(dense layer, MoE layer) bytes streamed by memory-bound kernels in one forward pass: every saved
    activation is written once and read once, in the activation dtype [modelling assumption]; and the token rows
    of the dispatch permutation and the combine, [rows sent x hidden] each, written and read whether the MoE block
    saves them (memory.moe_saved_rows) or, like Megatron-Core's memory-efficient permutation, only their indices."""
    if mem.gemm_input_bytes(ctx.training, ctx.opts) != ctx.training.activation_bytes:
        acts = layer_activations(ctx, c, streamed=True)
    core = acts["attention_core"]
    dense = 2 * (acts["attention"] + core + acts["mlp"])
    return dense, 2 * (acts["attention"] + core) + moe_block_streamed_bytes(ctx, c, acts, streamed=True)


def moe_block_streamed_bytes(ctx: Context, c, acts, streamed: bool = False, with_input: bool = True):
    """The MoE block's share of elementwise_bytes_per_layer: its saved activations written and read, and the
    dispatch and combine token rows it does not save (0 without MoE). ``acts``: layer_activations, ``streamed``
    when already in the activation dtype; ``with_input`` False leaves out the pre-MoE norm's input and output
    (moe/moe_input), which the ``moe`` recompute module does not re-run."""
    if ctx.model.moe is None:
        return 0.0 * acts["attention"]
    if not streamed and mem.gemm_input_bytes(ctx.training, ctx.opts) != ctx.training.activation_bytes:
        acts = layer_activations(ctx, c, streamed=True)
    out = 2 * sum((v for k, v in acts.items() if k.startswith("moe/") and (with_input or k != "moe/moe_input")), 0.0)
    unsaved = 2 - mem.moe_saved_rows(ctx.opts)
    if unsaved > 0:
        sent, _ = mem.routed_rows(ctx.model, ctx.training, c.tp, c.seq_share, c.ep)
        out = out + 2 * unsaved * sent * ctx.model.hidden_size * ctx.training.activation_bytes
    return out
