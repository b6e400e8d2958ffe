"""Framework overhead: the time a step spends outside FLOPs, bytes and collectives, as MEASURED quantities.

A small model's layer is not priced by its FLOPs: every operator costs a fixed dispatch time (Python, the
autograd graph, the kernel launch), whatever its size. On a GPU this is the launch-bound regime of small models
(e.g. Megatron-LM's and torch.compile's motivation for fused kernels / CUDA graphs); on this CPU machine it is
most of a tiny-moe step (docs/closed-loop.md). ``piper calibrate --only overhead`` measures it with the runtime's
own modules at a width where FLOPs are negligible (calibration/<platform>/overhead.csv, bench_overhead.py):

- ``attention_layer``: norm + attention + residual, forward + backward, per layer and micro-batch;
- ``dense_mlp``: norm + MLP + residual (dense layers);
- ``moe_block`` at several local-expert counts: norm + router + permutation + the per-expert loop + combine
  weights; priced as ``a + b x local experts`` (least squares over the measured counts);
- ``head_loss``: embedding + final norm + LM head + cross entropy, per micro-batch;
- ``optimizer_tensor`` at several tensor counts: the optimizer step's per-tensor cost, ``a + b x tensors``;
- ``concurrency``: per-rank seconds of a reference workload with ``size`` ranks running at once on one host,
  relative to one rank; > 1 when ranks share cores (emulated nodes on one machine). Absent: 1.

Pure numpy; the rows are handed in as a :class:`FrameworkOverhead` (``calibration.overhead`` when loaded).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from piper_plan.specs.vocab import A2A, Recompute


@dataclass(frozen=True)
class FrameworkOverhead:
    """Measured fixed costs (seconds) of one rank; linear models ``intercept + slope x count``."""

    attention_layer_s: float = 0.0
    dense_mlp_s: float = 0.0
    moe_block_s: float = 0.0
    """Intercept of the MoE block's time over local experts."""
    moe_per_local_expert_s: float = 0.0
    head_loss_s: float = 0.0
    optimizer_s: float = 0.0
    """Intercept of the optimizer step over parameter tensors."""
    optimizer_per_tensor_s: float = 0.0
    concurrency_ranks: tuple[int, ...] = (1,)
    concurrency_factor: tuple[float, ...] = (1.0,)
    """Slowdown of one rank when ``concurrency_ranks`` ranks share the host (1 = alone)."""
    source: str = ""
    sync_wait_s: tuple[float, ...] = (0.0,)
    """Seconds a rank waits at each blocking collective for a peer (one preempted while computing), per entry of
    ``concurrency_ranks``; 0 when not measured."""
    forward_share: float = 0.0
    """The forward's share of a layer's forward + backward overhead (the *_forward rows): full recompute runs the
    forward again; 0 when not measured (recompute then adds no overhead)."""

    def wait_seconds(self, ranks_per_host):
        """Wait per blocking collective with ``ranks_per_host`` ranks, linear between the measured points."""
        xs, ys = np.asarray(self.concurrency_ranks, float), np.asarray(self.sync_wait_s, float)
        if ys.size != xs.size:
            return 0.0 * np.asarray(ranks_per_host, float)
        return np.interp(np.asarray(ranks_per_host, float), xs, ys)

    def slowdown(self, ranks_per_host):
        """Per-rank slowdown with ``ranks_per_host`` ranks at once: linear in the measured points, and
        proportional beyond the largest (the cores are saturated: twice the ranks, twice the time); 1 where no
        point beyond one rank was measured (``calibrate overhead --no-concurrency``: nothing says ranks share)."""
        ranks = np.asarray(ranks_per_host, float)
        xs, ys = np.asarray(self.concurrency_ranks, float), np.asarray(self.concurrency_factor, float)
        if xs[-1] <= 1:
            return np.ones_like(ranks)
        inside = np.interp(ranks, xs, ys)
        return np.where(ranks > xs[-1], ys[-1] * ranks / xs[-1], np.maximum(inside, 1.0))


NO_OVERHEAD = FrameworkOverhead()


def priced_overhead(calibration, platform, opts) -> FrameworkOverhead | None:
    """The calibration's measured framework overhead where it prices this step: on a CPU platform always (the only
    runtime there is piper's), on a GPU for piper's runtime only (CostOptions.unfused_kernels): the rows time its
    modules, not Megatron-Core's (whose host work efficiency.host_s_per_gemm_call prices)."""
    ov = getattr(calibration, "overhead", None)
    return ov if platform.launch.device == "cpu" or opts.unfused_kernels else None


def linear_fit(counts, seconds) -> tuple[float, float]:
    """(intercept, slope) of seconds over counts by least squares; one point -> (0, seconds / count)."""
    x, y = np.asarray(counts, float), np.asarray(seconds, float)
    if x.size < 2 or np.ptp(x) == 0:
        return 0.0, float(np.mean(y / x))
    slope, intercept = np.polyfit(x, y, 1)
    return float(max(intercept, 0.0)), float(max(slope, 0.0))


def local_experts(model, ep):
    """Routed experts per rank [N] (num_experts / ep); 0 for a dense model."""
    return (model.moe.num_experts / ep) if model.moe is not None else 0.0 * ep


def layer_overhead_seconds(ov: FrameworkOverhead, local_experts, has_moe: bool, has_dense: bool):
    """(per dense layer, per MoE layer) overhead seconds of one micro-batch's forward + backward."""
    dense = ov.attention_layer_s + (ov.dense_mlp_s if has_dense else 0.0) + 0.0 * np.asarray(local_experts, float)
    moe = ov.attention_layer_s + ov.moe_block_s + ov.moe_per_local_expert_s * np.asarray(local_experts, float)
    return dense, moe if has_moe else 0.0 * dense


def optimizer_overhead_seconds(ov: FrameworkOverhead, param_tensors):
    """The optimizer step's fixed cost for ``param_tensors`` tensors of one optimizer call (one call per gradient
    group: runtime/train.py's Optimizers)."""
    return np.where(np.asarray(param_tensors) > 0, ov.optimizer_s + ov.optimizer_per_tensor_s * param_tensors, 0.0)


def optimizer_step_overhead(ctx, st, world):
    """Framework seconds of one optimizer step on stages ``st`` ([S, N]): the dense and the expert gradient
    group each one optimizer call over its tensors (embedding on the first stage; final norm and LM head on
    the last), times the slowdown of the ranks sharing a host. 0 without measured overhead."""
    ov = priced_overhead(ctx.rates.calibration, ctx.platform, ctx.opts)
    if ov is None:
        return 0.0 * st.layers
    model = ctx.model
    dense_t, moe_t = param_tensors_per_layer(model)
    expert_t = expert_tensors_per_layer(model)
    ends = np.where(st.first, 1, 0) + np.where(st.last, 1 + (0 if model.tie_embeddings else 1), 0)
    dense = st.dense_layers * dense_t + st.moe_layers * (moe_t - expert_t) + ends
    expert = st.moe_layers * expert_t
    share = ov.slowdown(ranks_per_host(ctx.platform, world))
    return (optimizer_overhead_seconds(ov, dense) + optimizer_overhead_seconds(ov, expert)) * share


def expert_tensors_per_layer(model) -> int:
    """The stacked routed-expert weights of one MoE layer (w_in [, w_gate], w_out [+ biases]): the expert group."""
    if model.moe is None:
        return 0
    ffn = model.moe.expert
    return (3 if ffn.gated else 2) * (2 if ffn.bias else 1)


def param_tensors_per_layer(model) -> tuple[int, int]:
    """(dense layer, MoE layer) parameter tensors as the runtime builds them (runtime/model.py, moe.py):
    norms (weight [+ bias]), q, k, v, o (+ biases), the MLP's linears, the router, stacked expert weights
    (w_in [, w_gate], w_out [+ biases]: independent of the expert count), shared experts, gates."""
    a, norm = model.attention, model.norm
    norms = norm.per_layer * (2 if norm.kind == "layernorm" and norm.bias else 1)
    attn = 4 + (3 if a.qkv_bias else 0) + (1 if a.o_bias else 0)

    def ffn(spec):
        return (3 if spec.gated else 2) * (2 if spec.bias else 1)

    dense = norms + attn + (ffn(model.dense_ffn) if model.dense_ffn is not None else 0)
    moe = model.moe
    if moe is None:
        return dense, 0
    experts = ffn(moe.expert)
    router = 1 + (1 if moe.router_bias else 0)
    shared = moe.num_shared_experts * ffn(moe.shared) + (1 if moe.shared_expert_gate else 0)
    shared += ffn(moe.parallel_dense_ffn) if moe.parallel_dense_ffn is not None else 0
    return dense, norms + attn + router + experts + shared


INDEX_BYTES = 8     # the runtime exchanges int64 counts


def ranks_per_host(platform, world):
    """Ranks that share one host's cores: on a CPU platform every rank (piper's CPU emulation runs all emulated
    nodes on one machine: PIPER_EMULATE_TOPOLOGY), else the devices of one node."""
    world = np.asarray(world)
    if platform.launch.device == "cpu":
        return world
    return np.minimum(world, platform.node.devices_per_node)


def layout_exchanges(a2a, ep, nodes):
    """Small count exchanges per MoE layer and micro-batch before the dispatch (runtime/moe.py ``_layout``):
    flat, one all_to_all of the per-(rank, local expert) counts; HALO (runtime/halo.py), its own layout exchange
    plus that one (2) once the group spans nodes (on one node HALO is flat)."""
    return np.where(ep > 1, np.where((a2a == A2A.HALO.code) & (np.asarray(nodes) > 1), 2.0, 1.0), 0.0)


def overhead_terms(ctx, c, spans, ov: FrameworkOverhead):
    """(per-layer terms {name: (per dense layer, per MoE layer)}, head seconds per micro-batch on the last stage,
    compute scale [N]) of the framework overhead, for candidates ``c``.

    Overhead is the measured fixed cost times the slowdown of ``ranks_per_host`` ranks at once; the FLOP-priced
    compute is scaled by the slowdown relative to one rank (the calibration's GEMM rows already hold one rank's
    share of the host's load). The count exchange is priced by the calibrated all_to_all curve."""
    model = ctx.model
    share = ov.slowdown(ranks_per_host(ctx.platform, c.world))
    compute_scale = share / ov.slowdown(1)
    local = local_experts(model, c.ep)
    dense, moe = layer_overhead_seconds(ov, local, model.moe is not None, model.dense_ffn is not None)
    layer = share * (1 + ov.forward_share * (c.recompute == Recompute.FULL.code))   # full recompute: forward again
    terms = {"framework/layer": (dense * layer, moe * layer)}
    if model.moe is not None:
        count_bytes = c.ep * local * INDEX_BYTES
        one = ctx.net.seconds("all_to_all", c.ep, count_bytes, spans["ep"][0])
        exchanges = layout_exchanges(c.a2a, c.ep, spans["ep"][1])
        terms["moe/layout"] = (0.0 * one, one * exchanges)
        # every blocking exchange of a MoE layer (layout, dispatch + combine forward, their two backward) waits
        calls = np.where(c.ep > 1, exchanges + 4, 0.0)
        terms["moe/sync_wait"] = (0.0 * one, calls * ov.wait_seconds(ranks_per_host(ctx.platform, c.world)))
    chunks = loss_chunks(ctx, c)
    recomputed = np.where(chunks > 1, 1 + ov.forward_share, 1.0)     # ChunkedLoss checkpoints each chunk
    return terms, ov.head_loss_s * share * chunks * recomputed, compute_scale


def loss_chunks(ctx, c):
    """LM head + loss calls per micro-batch: 1, or under piper's chunked loss (CostOptions.loss_chunk_rows, a
    micro-batch of more rows) one per chunk of ``chunk_rows // mbs`` positions, as runtime/pipeline.py ChunkedLoss
    splits it (its sequence shards under tp / cp not counted). Each chunk's head and loss is priced at the
    head_loss row's overhead (which holds the embedding and final norm once: a bound), and its forward again at the
    forward's measured share (overhead_terms: each chunk is checkpointed and recomputed in backward)."""
    chunk = ctx.opts.loss_chunk_rows
    if not ctx.opts.unfused_kernels or chunk is None:
        return np.ones_like(c.mbs, dtype=float)
    seq = ctx.training.seq_len
    return np.where(c.mbs * seq <= chunk, 1.0, np.ceil(seq / np.maximum(chunk // c.mbs, 1)))


# ---- the host floor of a GPU layer ----------------------------------------------------------------------------
GEMMS_PER_LINEAR = 3
"""A linear's forward, input-gradient and weight-gradient GEMMs, each its own host call."""


def attention_linears(model) -> int:
    """Linear modules of one attention block as Megatron-Core builds them: GQA / MHA a fused qkv and the output
    projection; MLA the q down / up (one q projection without q_lora_rank), kv down / up and the output."""
    a = model.attention
    if a.kind == "mla":
        return (2 if a.q_lora_rank else 1) + 2 + 1
    return 2


def linears_per_layer(model, local_experts, graphed: tuple[str, ...]):
    """(dense layer, MoE layer) linear modules whose host work runs every micro-batch, outside CUDA graphs.
    A gated FFN is two linears (fused gate / up, down); the routed experts are one pair per local expert
    (grouped GEMM as multi-stream cuBLAS calls, one per expert: the GB200 guide, baseline item 3) and never
    graphed: their token counts change every step in dropless routing."""
    attn = 0 if "attn" in graphed else attention_linears(model)
    mlp = 0 if ("mlp" in graphed or model.dense_ffn is None) else 2
    dense = attn + mlp + 0.0 * np.asarray(local_experts, float)
    moe = model.moe
    if moe is None:
        return dense, 0.0 * dense
    router = 0 if "moe_router" in graphed else 1 + (2 if moe.num_shared_experts else 0)
    parallel = 2 if moe.parallel_dense_ffn is not None and "mlp" not in graphed else 0   # Arctic's residual MLP
    return dense, attn + router + parallel + 2.0 * np.asarray(local_experts, float)


def moe_block_rerun(ctx, c) -> np.ndarray:
    """1 where selective recompute re-runs the whole MoE block (recompute module ``moe``: its GEMM calls and its
    all-to-alls too), else 0 (arrays [N])."""
    rerun = "moe" in ctx.opts.recompute_modules and ctx.model.moe is not None
    return ((c.recompute == Recompute.SELECTIVE.code) & rerun).astype(int)


def host_floor_terms(ctx, c, per_layer: dict) -> dict:
    """{"host/launch": (per dense layer, per MoE layer)}: the host time of a layer's GEMM calls beyond what the
    device spends on that layer (its compute and communication terms in ``per_layer``), per micro-batch.

    A layer takes at least its host work: each GEMM call of a training step costs the host a fixed time (Python,
    framework and kernel launch, with its casts: ``efficiency.host_s_per_gemm_call``), whatever its size. In a
    dropless MoE the host cannot bank that time ahead: every MoE layer synchronises it on the tokens-per-expert
    counts (the GB200 guide's future work: "eliminate the device-host sync in the MoE model (its purpose is to get
    the tokens per expert information)"), so the floor holds layer by layer:
    ``max(device, host) = device + max(host - device, 0)``. Full recompute adds its forward calls, and so does
    the ``moe`` module for the MoE block's linears; the other selective modules' few re-run linears are not
    counted. Empty when the platform prices no host time; not applied where piper's runtime's measured overhead
    prices the step (priced_overhead: the runtime's host work, its GEMM calls' included, is what it measured)."""
    per_call = ctx.platform.efficiency.host_s_per_gemm_call
    if per_call <= 0:
        return {}
    model = ctx.model
    local = local_experts(model, c.ep)
    dense_n, moe_n = linears_per_layer(model, local, ctx.opts.cuda_graph_scope)
    gemms = GEMMS_PER_LINEAR + np.where(c.recompute == Recompute.FULL.code, 1, 0)     # + the recomputed forward
    device_d = sum(d for d, _ in per_layer.values())
    device_m = sum(m for _, m in per_layer.values())
    block_n = moe_n - (0 if "attn" in ctx.opts.cuda_graph_scope else attention_linears(model))
    host_d, host_m = per_call * gemms * dense_n, per_call * (gemms * moe_n + moe_block_rerun(ctx, c) * block_n)
    return {"host/launch": (np.maximum(host_d - device_d, 0.0), np.maximum(host_m - device_m, 0.0))}
