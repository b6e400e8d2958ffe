"""Memory per pipeline stage, for one rank: training state and activations. Pure numpy; arrays broadcast.

Training state: working weights + gradients + fp32 master + optimizer state, bytes per parameter from the
TrainingSpec (the Piper paper's 16 B = 2 + 2 + 4 + 8; Megatron's 18 B with fp32 gradients). ZeRO-1 shards
master + optimizer state over dp (dense parameters) and edp (expert parameters) (Rajbhandari et al. 2020).

Activations saved for backward, per layer per micro-batch, follow Korthikanti et al. 2022 (arXiv 2205.05198,
section 4, Table 2) term by term, generalised to GQA / MLA, gated MLPs, flash attention and MoE:
``s b h (34 + 5 a s / h)`` for a dense GPT layer without parallelism, ``s b h (10 + 24/t + 5 a s/(h t))``
with tensor parallelism, everything divided by t with sequence parallelism; selective recompute drops the
s^2 terms, full recompute keeps only the layer input. The Piper paper's per-layer terms (12 b s d + 4 b H s^2
attention, 2 b s k (3 d_ffn + d) experts) are the dropout-free, non-flash special case (tests show both).
"""

from __future__ import annotations

import numpy as np

from piper_plan.cost.options import CostOptions
from piper_plan.cost.params import even_stage_bounds, explicit_stage_bounds, layer_params, moe_prefix, rank_stage_params
from piper_plan.cost.pipeline import warmup_chunks
from piper_plan.specs.vocab import Schedule
from piper_plan.specs.model import ModelSpec
from piper_plan.specs.parallel import ParallelPlan
from piper_plan.specs.training import LOW_PRECISION_GEMM_DTYPES, TrainingSpec

LSE_BYTES = 4          # flash attention keeps one fp32 log-sum-exp per query row and head (Dao 2022)
RSTD_BYTES = 4         # an RMSNorm keeps one fp32 reciprocal RMS per normalised row for backward
ROUTER_BYTES = 4       # router logits and probabilities in fp32 (Megatron-Core router, fp32 for stability)
INDEX_BYTES = 8        # int64 indices (token ids, top-k expert ids) that PyTorch's gather / embedding backward keep


def gemm_input_bytes(training: TrainingSpec, opts: CostOptions) -> float:
    """Bytes per element of a GEMM input saved for backward. Under an 8-bit recipe Transformer Engine saves the
    input's fp8 cast for the weight-gradient GEMM, not the bf16 tensor (transformer_engine/pytorch/module/
    linear.py ``_Linear.forward``: ``saved_inputmat = inputmat`` or its fp8 transpose ``inputmat_t`` when fp8, the
    unquantised ``inputmat_no_fp8`` otherwise; grouped and layernorm-fused linears alike): 1 byte, plus one 1-byte
    scale per 32 values under mxfp8 (LOW_PRECISION_GEMM_DTYPES: the weight copy's bytes, halved). Everything else
    (norm inputs, the SwiGLU input, attention's q / k / v) stays in the activation dtype. Piper's runtime has no
    8-bit GEMMs: ``unfused_kernels`` keeps the activation dtype."""
    low = LOW_PRECISION_GEMM_DTYPES.get(training.dtype)
    if low is None or opts.unfused_kernels:
        return float(training.activation_bytes)
    return low / 2


def unfused_norm_bytes(tokens, d, ab, sp, opts):
    """What an unfused RMSNorm keeps beyond its input: the normalised input and one fp32 rstd per token
    (PyTorch's composite rms_norm backward); 0 with fused kernels."""
    return (tokens * d * ab + tokens * RSTD_BYTES) / sp if opts.unfused_kernels else 0.0


def gathered_input_bytes(tokens, d, ab, sp, opts):
    """What a column-parallel block of piper's runtime keeps beyond its input's sequence shard: torch's tensor
    parallelism saves the all-gathered input [tokens, D] for backward (runtime/tensor_parallel.py), where
    Megatron keeps the 1/tp shard and gathers again (Korthikanti et al. 2022); 0 with fused kernels or sp = 1.
    Measured: tests/runtime/test_analytic_vs_real.py."""
    return tokens * d * ab * (1 - 1 / sp) if opts.unfused_kernels else 0.0 * sp


# ---- training state ------------------------------------------------------------------------------
FSDP_GRAD_BYTES = 4
"""Bytes per parameter of FSDP2's gradients and sharded parameters: piper's runtime keeps fp32 masters and reduces
in fp32 (MixedPrecisionPolicy(reduce_dtype=float32), runtime/sharding.py)."""


def state_bytes(training: TrainingSpec, dense, expert, dp, edp, zero, pp=1, one_layer=None,
                root=0.0, fp32_replicas: bool = False) -> dict[str, np.ndarray]:
    """Weights, gradients and master + optimizer bytes of one rank holding ``dense`` and ``expert`` params at the
    step's peak (``one_layer``: the params of the stage's largest layer, ``root`` its embedding / final norm / head:
    for FSDP2 at pp = 1), as piper's runtime holds them (docs/design-notes.md, "zero 0-3 in the
    runtime", measured by benchmarks/zero_memory.py). zero 0: all unsharded; 1: master + optimizer sharded over
    dp / edp (Rajbhandari et al. 2020); 2 and 3 (FSDP2): fp32 parameters and optimizer state sharded at rest, plus
    the gathered compute-dtype weights: the stage's at pp > 1 (torch's PipelineStage keeps them to the last
    backward) and under zero 2, the root's and one layer's under zero 3 at pp = 1; gradients: the stage's unsharded
    fp32 accumulation at pp > 1 (the reduce-scatter waits for the last micro-batch), else the sharded fp32
    gradient plus one layer's unsharded one. ``fp32_replicas`` (piper's runtime, zero 0 / 1): fp32 weights and
    gradients, the optimizer's fp32 state without a separate master, and under bf16 autocast's bf16 copy of every
    weight (runtime/train.py; docs/design-notes.md, "zero 0-3 in the runtime")."""
    keep = training.master_bytes + training.optimizer_bytes
    shard_dense = np.where(zero >= 1, dp, 1)
    shard_expert = np.where(zero >= 1, edp, 1)
    local = dense / shard_dense + expert / shard_expert
    full = dense + expert
    one_layer = full if one_layer is None else one_layer
    fsdp, piped = zero >= 2, pp > 1
    gathered = np.where(piped | (zero == 2), full, one_layer + root) * training.weight_bytes
    weights = np.where(fsdp, local * FSDP_GRAD_BYTES + gathered, full * training.weight_bytes)
    grads = np.where(fsdp, np.where(piped, full, local + one_layer) * FSDP_GRAD_BYTES, full * training.grad_bytes)
    if fp32_replicas:
        autocast = 0 if training.dtype == "fp32" else training.weight_bytes
        weights = np.where(fsdp, weights, full * (FSDP_GRAD_BYTES + autocast))
        grads = np.where(fsdp, grads, full * FSDP_GRAD_BYTES)
        keep = training.optimizer_bytes
    return {
        "weights": weights + full * training.low_precision_copy_bytes,
        "gradients": grads,
        "optimizer": local * np.where(fsdp, training.optimizer_bytes, keep),
    }


def saved_bytes_per_param(training: TrainingSpec, zero, fp32_replicas: bool = False):
    """(weight bytes, master + optimizer bytes) per parameter that a checkpoint saves of the state ``state_bytes``
    holds at rest: zero 0 / 1 the weights in their stored dtype (fp32 under ``fp32_replicas``, whose optimizer
    keeps no separate master), zero 2 / 3 (FSDP2) the fp32 shard and its optimizer state. Not saved: gradients, an
    fp8 recipe's 8-bit weight copies, FSDP's gathered compute-dtype weights, autocast's copies (all rebuilt)."""
    fsdp = np.asarray(zero) >= 2
    weight = FSDP_GRAD_BYTES if fp32_replicas else training.weight_bytes
    keep = training.optimizer_bytes if fp32_replicas else training.master_bytes + training.optimizer_bytes
    return np.where(fsdp, FSDP_GRAD_BYTES, weight), np.where(fsdp, training.optimizer_bytes, keep)


def saved_state_bytes(training: TrainingSpec, dense, expert, dp, edp, zero,
                      fp32_replicas: bool = False) -> np.ndarray:
    """Bytes of one rank's state that a checkpoint saves (``saved_bytes_per_param``): under zero 0 / 1 every
    weight of the rank and its master + optimizer shard, under zero 2 / 3 its shard of both."""
    local = dense / np.where(zero >= 1, dp, 1) + expert / np.where(zero >= 1, edp, 1)
    weight, keep = saved_bytes_per_param(training, zero, fp32_replicas)
    return np.where(zero >= 2, local, dense + expert) * weight + local * keep


# ---- activations of one layer for one micro-batch ------------------------------------------------
def attention_activation_bytes(model: ModelSpec, training: TrainingSpec, opts: CostOptions, tp, mbs, sp):
    """(kept, core): bytes of one attention block that stay through any recompute but full, and the
    attention-core part that selective recompute drops (the s^2 score matrices without flash)."""
    a, s, d, ab = model.attention, training.seq_len, model.hidden_size, training.activation_bytes
    gb = gemm_input_bytes(training, opts)
    tokens = mbs * s
    heads_local = a.num_heads / tp
    kept = tokens * d * (ab + gb) / sp + unfused_norm_bytes(tokens, d, ab, sp, opts)   # norm input + QKV input
    kept = kept + gathered_input_bytes(tokens, d, ab, sp, opts)
    if a.kind == "mla":
        latent = (a.q_lora_rank or 0) + a.kv_lora_rank + a.qk_rope_head_dim
        kept = kept + tokens * latent * (ab + gb)            # compressed q / kv before and after their norms
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        kept = kept + tokens * heads_local * (2 * qk + a.v_head_dim) * ab
        v_dim = a.v_head_dim
    else:
        kv_heads = a.kv_heads / tp
        kept = kept + tokens * (heads_local + 2 * kv_heads) * model.head_dim * ab
        kept = kept + qk_norm_bytes(a.qk_norm, tokens, heads_local, kv_heads, model.head_dim, ab, opts)
        v_dim = model.head_dim
        if opts.unfused_kernels:
            kept = kept + 4 * s * model.head_dim * ab        # RoPE cos + sin [s, hd], once for q, once for k
    kept = kept + tokens * heads_local * v_dim * gb          # output-projection input (= attention output)
    if opts.dropout:
        kept = kept + tokens * d / sp                        # 1-byte dropout mask after the projection
    if training.flash_attention:
        if not opts.unfused_kernels:
            return kept + tokens * heads_local * LSE_BYTES, 0.0 * kept
        # piper's runtime: its core (checkpointed under selective recompute) keeps SDPA's log-sum-exp, or on the
        # sink path the softmax output instead (runtime_masked_core_bytes)
        lse = 0.0 if a.sinks else tokens * heads_local * LSE_BYTES
        return kept, lse + runtime_masked_core_bytes(model, training, opts, tp, mbs) + 0.0 * kept
    per_score = 5 if opts.dropout else 4                     # softmax out 2 + mask 1 + dropout out 2 | scores 2 + probs 2
    core = mbs * heads_local * s * s * per_score
    return kept, core


def qk_norm_bytes(qk_norm: str, tokens, heads_local, kv_local, head_dim: int, ab: int, opts: CostOptions):
    """Bytes the q and k norms of one attention block keep (AttentionSpec.qk_norm: Qwen3's per_head, OLMoE's full,
    Llama 4's weightless): their q- and k-sized inputs and one fp32 rstd per normalised row (a head's values per
    token; under "full" a token's whole q or k). Transformer Engine's RMSNorm, Megatron-Core's q_layernorm /
    k_layernorm, saves its input and rstd (transformer_engine/pytorch/ops/basic/rmsnorm.py ``op_forward``:
    ``ctx.save_for_backward(x, rstdevs)``). Piper's runtime (``unfused_kernels``) keeps the normalised output too
    where the norm has a weight (PyTorch's composite rms_norm), and where it normalises the [B, H, S, hd] head layout
    (per_head, weightless) the attention output reaches the output projection through a copy, one q more (measured
    with the runtime's saved-tensor accounting: tests/runtime/test_analytic_vs_real.py). Before, none of it was
    counted (Qwen3-30B-A3B at sequence 4096: 38 MB per layer)."""
    if qk_norm == "none":
        return 0.0
    qk = tokens * (heads_local + kv_local) * head_dim * ab
    rows = tokens * 2 if qk_norm == "full" else tokens * (heads_local + kv_local)
    kept = qk + rows * RSTD_BYTES
    if opts.unfused_kernels:
        kept = kept + (qk if qk_norm != "weightless" else 0.0) \
            + (tokens * heads_local * head_dim * ab if qk_norm != "full" else 0.0)
    return kept


def runtime_masked_core_bytes(model: ModelSpec, training: TrainingSpec, opts: CostOptions, tp, mbs):
    """Bytes per layer (averaged over the layers) that piper's runtime saves inside its attention core beyond
    SDPA's log-sum-exp, where it masks explicitly (runtime/model.py ``attention_core``; ``unfused_kernels`` only;
    0 otherwise). K and V repeated to every query head; with sinks, in every layer, the softmax output over the keys
    and the sink [s, s + 1] per head and the boolean causal / window mask [s, s]; without sinks, in the windowed
    layers whose window is shorter than the sequence, SDPA's additive mask [s, s] in the activation dtype. All of
    it inside the core, which selective recompute re-runs (dropped with it); MLA has neither sinks nor a window."""
    a, s, ab = model.attention, training.seq_len, training.activation_bytes
    if not opts.unfused_kernels or a.kind == "mla":
        return 0.0
    windowed = a.sliding_layers(model.num_layers) / model.num_layers if (a.sliding_window or s) < s else 0.0
    share = 1.0 if a.sinks else windowed                 # layers on a masked path
    heads_local, kv_local = a.num_heads / tp, a.kv_heads / tp
    expanded = mbs * s * 2 * (heads_local - kv_local) * model.head_dim * ab
    scores = mbs * heads_local * s * (s + 1) * ab + s * s if a.sinks else s * s * ab
    return share * (expanded + scores)


def ffn_activation_bytes(ffn, rows, ab, tp, unfused: bool = False, gb=None):
    """Intermediates of one MLP over ``rows`` token rows, split over tp: gated 3 x d_ffn (gate, up, product;
    fused SwiGLU), plain 2 x d_ffn (activation input and output); unfused, what the runtime saves
    (unfused_ffn_saved). The last one (product / activation output) is the second GEMM's input, kept at ``gb``
    bytes (gemm_input_bytes; default ``ab``)."""
    gb = ab if gb is None else gb
    kept_in_ab = (unfused_ffn_saved(ffn) if unfused else 2 if ffn.gated else 1) * ffn.intermediate_size
    return rows * (kept_in_ab * ab + ffn.intermediate_size * gb) / tp


def unfused_ffn_saved(ffn) -> int:
    """d_ffn-wide tensors piper's runtime saves for backward besides the second GEMM's input (runtime/moe.py
    ``activate``, eager PyTorch): the activation's input, and where gated its output and up; quick_gelu keeps its
    sigmoid too; a clamp keeps both unclamped inputs (SwiGLU 3, gpt-oss's clamped quick_gelu 6; measured by
    tests/runtime/test_analytic_vs_real.py)."""
    kept = (3 if ffn.gated else 1) + (ffn.activation_name == "quick_gelu")
    return kept + (2 if ffn.activation_clamp is not None else 0)


def dense_mlp_activation_bytes(model: ModelSpec, training: TrainingSpec, opts: CostOptions, tp, mbs, sp):
    """One dense MLP block: norm input, MLP input, intermediates, dropout mask."""
    tokens, d, ab = mbs * training.seq_len, model.hidden_size, training.activation_bytes
    gb = gemm_input_bytes(training, opts)
    out = tokens * d * (ab + gb) / sp + unfused_norm_bytes(tokens, d, ab, sp, opts) \
        + ffn_activation_bytes(model.dense_ffn, tokens, ab, tp, opts.unfused_kernels, gb) \
        + gathered_input_bytes(tokens, d, ab, sp, opts)
    return out + (tokens * d / sp if opts.dropout else 0)


def routed_rows(model: ModelSpec, training: TrainingSpec, tp, mbs, ep):
    """Rows (token copies) the busiest rank of an ep group receives per MoE layer and micro-batch.

    Tokens per rank are mbs x s / tp (Megatron-Core requires sequence parallelism for MoE with tp > 1);
    each is sent to top_k experts. Dropless: the mean times routing_skew (expected max / mean per rank);
    a capacity factor pads every expert to capacity_factor x the mean (Fedus et al. 2021). With etp > 1
    the etp ranks of an expert-tensor group gather each other's rows (etp x received rows per rank, each
    1/etp of the expert's width), as Megatron-Core's expert tensor parallelism does."""
    moe = model.moe
    sent = mbs * training.seq_len / tp * moe.top_k
    load = moe.capacity_factor if moe.capacity_factor is not None else np.minimum(training.routing_skew,
                                                                                 max_routing_skew(moe, ep))
    return sent, sent * load


def max_routing_skew(moe, ep):
    """The largest max / mean rows per rank an ep group can see: every token of the group sends its top_k copies
    to one rank, at most one per expert it holds (num_experts / ep of them)."""
    ep = np.asarray(ep, float)
    return ep * np.minimum(moe.top_k, moe.num_experts / ep) / moe.top_k


def routing_skew_from_histogram(tokens_per_expert, ep: int) -> float:
    """Expected max / mean tokens per expert-parallel rank from a measured histogram (tokens per expert,
    one MoE layer or summed), experts placed contiguously, num_experts / ep per rank (DESIGN.md)."""
    counts = np.asarray(tokens_per_expert, float)
    if counts.size % ep:
        from piper_plan.errors import PiperError

        raise PiperError(f"histogram has {counts.size} experts, not divisible by ep={ep}", field="routing_skew")
    per_rank = counts.reshape(ep, -1).sum(axis=1)
    mean = per_rank.mean()
    return float(per_rank.max() / mean) if mean > 0 else 1.0


def moe_saved_rows(opts: CostOptions) -> int:
    """Token-row buffers a MoE layer saves (CostOptions.moe_saved_rows; None: 1 unfused, 2 fused)."""
    if opts.moe_saved_rows is not None:
        return opts.moe_saved_rows
    return 1 if opts.unfused_kernels else 2


def moe_activation_bytes(model: ModelSpec, training: TrainingSpec, opts: CostOptions, tp, mbs, ep, etp, sp):
    """One MoE block, by component: norm/input, router, saved token-row buffers, routed experts, shared."""
    moe, d, ab = model.moe, model.hidden_size, training.activation_bytes
    gb = gemm_input_bytes(training, opts)
    tokens = mbs * training.seq_len
    sent, received = routed_rows(model, training, tp, mbs, ep)
    unfused = opts.unfused_kernels
    out = {
        "moe_input": 2 * tokens * d * ab / sp + unfused_norm_bytes(tokens, d, ab, sp, opts),  # norm + router input
        "router": tokens / tp * (2 * moe.num_experts * ROUTER_BYTES + moe.top_k * ROUTER_BYTES),
        "buffers": moe_saved_rows(opts) * sent * d * ab,
        "experts": received * etp * d * gb + ffn_activation_bytes(moe.expert, received * etp, ab, etp, unfused, gb),
        "shared": shared_expert_bytes(model, training, opts, tp, mbs, sp),
    }
    if unfused:
        out["router"] = out["router"] + tokens / tp * moe.top_k * INDEX_BYTES   # top-k expert ids (int64)
        if getattr(moe, "normalize_top_k", False):    # top / top.sum(): the division keeps both (runtime/moe.py)
            out["router"] = out["router"] + tokens / tp * (moe.top_k + 1) * ROUTER_BYTES
    if moe.parallel_dense_ffn is not None:
        out["shared"] = out["shared"] + ffn_activation_bytes(moe.parallel_dense_ffn, tokens, ab, tp, unfused, gb) \
            + gathered_input_bytes(tokens, d, ab, sp, opts) + _own_cast(tokens, d, ab, gb, sp)
    if opts.dropout:
        out["moe_input"] = out["moe_input"] + tokens * d / sp
    return out


def selective_dropped_bytes(model: ModelSpec, training: TrainingSpec, opts: CostOptions, tp, mbs, ep, etp, sp) -> dict:
    """Bytes per layer and micro-batch that ``recompute: selective`` drops beyond the attention core, by the
    component they come out of, for the modules CostOptions.recompute_modules names (Megatron-Core's selective
    recompute keeps a module's input and discards what it saves inside): ``mla_up_proj`` the per-head q, k and v
    (from "attention"); ``layernorm`` the two norm outputs (attention's QKV input, the MLP's or router's input);
    ``mlp`` the dense MLP's intermediates; ``moe_act`` the experts' activation output (their second GEMM's input);
    ``shared_experts`` all the shared experts save (their input is the router's, saved anyway); ``moe`` all the MoE
    block saves but its input (router, token buffers, experts, shared experts: moe_activation_bytes), which covers
    ``moe_act`` and ``shared_experts``."""
    modules, d, ab = set(opts.recompute_modules), model.hidden_size, training.activation_bytes
    gb = gemm_input_bytes(training, opts)
    tokens = mbs * training.seq_len
    zero = 0.0 * (tp * mbs * sp)
    out = {"attention": zero, "mlp": zero, "moe/moe_input": zero, "moe/experts": zero, "moe/shared": zero}
    a = model.attention
    if "mla_up_proj" in modules and a.kind == "mla":
        out["attention"] = out["attention"] + tokens * a.num_heads / tp * (2 * (a.qk_nope_head_dim + a.qk_rope_head_dim)
                                                                           + a.v_head_dim) * ab
    if "layernorm" in modules:
        out["attention"] = out["attention"] + tokens * d * gb / sp
        out["mlp"] = out["mlp"] + tokens * d * gb / sp
        out["moe/moe_input"] = out["moe/moe_input"] + tokens * d * ab / sp
    if "mlp" in modules and model.dense_ffn is not None:
        out["mlp"] = out["mlp"] + ffn_activation_bytes(model.dense_ffn, tokens, ab, tp, opts.unfused_kernels, gb)
    if "moe_act" in modules and model.moe is not None:
        _, received = routed_rows(model, training, tp, mbs, ep)
        out["moe/experts"] = out["moe/experts"] + received * model.moe.expert.intermediate_size * gb
    if "shared_experts" in modules and model.moe is not None:
        out["moe/shared"] = out["moe/shared"] + shared_expert_bytes(model, training, opts, tp, mbs, sp)
    if "moe" in modules and model.moe is not None:
        block = moe_activation_bytes(model, training, opts, tp, mbs, ep, etp, sp)
        out.update({f"moe/{name}": block[name] + zero for name in ("router", "buffers", "experts", "shared")})
    return out


def shared_expert_bytes(model: ModelSpec, training: TrainingSpec, opts: CostOptions, tp, mbs, sp):
    """What a MoE layer's shared experts save per micro-batch: each its intermediates, its gathered input (tp
    with sequence parallelism) and its own 8-bit cast of the block input (0 without shared experts)."""
    moe, d, ab = model.moe, model.hidden_size, training.activation_bytes
    if not moe.num_shared_experts:
        return 0.0 * (tp * mbs * sp)
    gb, tokens = gemm_input_bytes(training, opts), mbs * training.seq_len
    return moe.num_shared_experts * (ffn_activation_bytes(moe.shared, tokens, ab, tp, opts.unfused_kernels, gb)
                                     + gathered_input_bytes(tokens, d, ab, sp, opts) + _own_cast(tokens, d, ab, gb, sp))


def _own_cast(tokens, d, ab, gb, sp):
    """A shared expert's own 8-bit cast of the block input it reads beside the router (0 when inputs stay in the
    activation dtype: the router's saved input is the same tensor)."""
    return tokens * d * gb / sp if gb != ab else 0.0


def layer_input_bytes(model: ModelSpec, training: TrainingSpec, opts: CostOptions, tp, mbs, sp):
    """What full recompute keeps per layer: its input (Korthikanti: 2 s b h, / t with sequence parallelism)."""
    return mbs * training.seq_len * model.hidden_size * training.activation_bytes / sp


# ---- micro-batches in flight ---------------------------------------------------------------------
def in_flight(schedule, stage, pp, num_microbatches, virtual_stages):
    """Micro-batches whose activations stage ``stage`` holds at its peak, in units of the stage's layers.

    GPipe: all M. 1F1B: min(pp - i, M) (Narayanan et al. 2021). Interleaved 1F1B (Megatron-LM): the warm-up's
    chunks in flight (cost/pipeline.py warmup_chunks), each 1/v of the stage's layers, capped at M x v;
    on stage 0 that is Korthikanti's L (1 + (p - 1)/(p v)) layers' worth."""
    m = num_microbatches
    out = np.minimum(pp - stage, m).astype(float)
    gpipe, interleaved = schedule == Schedule.GPIPE.code, schedule == Schedule.INTERLEAVED.code
    if np.any(gpipe):
        out = np.where(gpipe, m, out)
    if np.any(interleaved):
        chunks = np.minimum(warmup_chunks(pp, virtual_stages, stage), m * virtual_stages)
        out = np.where(interleaved, chunks / virtual_stages, out)
    return out


def loss_in_flight(schedule, num_microbatches):
    """Micro-batches whose loss graph (logits, softmax) the last stage holds at its peak: all M under GPipe; one
    under 1F1B and interleaved 1F1B, where the last stage runs each micro-batch's last chunk forward and then at
    once its backward (Narayanan et al. 2021; Megatron-Core's interleaved schedule: the last rank's warm-up covers
    the other v - 1 chunks, so the loss chunk alternates one forward, one backward)."""
    return np.where(schedule == Schedule.GPIPE.code, num_microbatches, np.minimum(num_microbatches, 1)).astype(float)


# ---- public helper -------------------------------------------------------------------------------
def rank_param_counts(model: ModelSpec, plan: ParallelPlan) -> list[dict]:
    """Per pipeline stage, for ONE rank of that stage: {"dense", "expert", "total"} parameter counts."""
    lp, prefix = layer_params(model), moe_prefix(model)
    out = []
    for i in range(plan.pp):
        if plan.layers_per_stage is not None:
            start, end = explicit_stage_bounds(plan.layers_per_stage, i)
        else:
            start, end = even_stage_bounds(model.num_layers, plan.pp, i)
        layers, moe = int(end - start), int(prefix[end] - prefix[start])
        dense, expert = rank_stage_params(lp, layers, moe, np.bool_(i == 0), np.bool_(i == plan.pp - 1),
                                          plan.tp, plan.ep, plan.etp)
        dense, expert = int(round(float(dense))), int(round(float(expert)))
        out.append({"dense": dense, "expert": expert, "total": dense + expert})
    return out
