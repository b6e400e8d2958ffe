"""A small stand-in for ``piper_plan.cost.evaluate.evaluate``, built from real numpy arithmetic.

It lets the search be tested independently of the cost model (and before it exists). Memory follows the
Piper paper's per-stage equation generalised to tp/etp/ZeRO (piper-paper.md, "Memory model"): 16 B per
parameter of training state, stage 0 holding min(pp, M) micro-batches under 1F1B (M under GPipe), with an
activation term of 34 s b d bytes per layer (Korthikanti et al. 2022, no flash, tp-split). Time: 6 x active
FLOPs per token (x 4/3 with full recompute) at 50% of peak scaled by a micro-batch efficiency, a pipeline
bubble (M + pp - 1) / M, and 4 all-to-alls per MoE layer at the platform's per-scope bandwidth.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

REC_ACT = np.array([1.0, 0.5, 2.0 / 34.0])     # none, selective, full: activation bytes kept
REC_FLOPS = np.array([1.0, 1.05, 4.0 / 3.0])    # hardware FLOPs relative to model FLOPs


def standin_evaluate(model, platform, training, nodes, cand, calibration=None, placement="compact"):
    c = {k: np.asarray(getattr(cand, k), dtype=np.int64) for k in
         ("dp", "tp", "pp", "ep", "etp", "mbs", "num_microbatches", "schedule", "virtual_stages", "recompute",
          "zero", "a2a")}
    peak = _memory_bytes(model, platform, training, c)
    step, a2a_s = _step_seconds(model, platform, training, c)
    world = c["pp"] * c["dp"] * c["tp"]
    tokens = training.seq_len * training.global_batch
    tps = tokens / step
    model_flops = 6.0 * model.active_params * tokens
    tflops = model_flops / step / world / 1e12
    peak_flops = platform.peak_flops(training.dtype)
    return SimpleNamespace(
        step_time_s=step, tokens_per_s=tps, tflops_per_device=tflops, mfu=tflops * 1e12 / peak_flops,
        hfu=tflops * 1e12 * REC_FLOPS[c["recompute"]] / peak_flops, peak_memory_bytes=peak,
        a2a_share=a2a_s / step, fits=peak <= platform.device.memory_bytes,
        breakdown={"compute": step - a2a_s, "moe/dispatch": a2a_s / 2, "moe/combine": a2a_s / 2})


def _memory_bytes(model, platform, training, c):
    p = model.params
    expert = p.routed_experts
    dense = p.total - expert
    edp = c["dp"] * c["tp"] // (c["ep"] * c["etp"])
    shard_dense = np.where(c["zero"] == 1, c["dp"], 1)
    shard_expert = np.where(c["zero"] == 1, edp, 1)
    per_param = lambda shard: 4.0 + 12.0 / shard  # weights + grads, then master + Adam sharded by ZeRO-1
    state = (dense / (c["pp"] * c["tp"]) * per_param(shard_dense)
             + expert / (c["pp"] * c["ep"] * c["etp"]) * per_param(shard_expert))
    layers = np.ceil(model.num_layers / c["pp"])
    act_layer = 34.0 * training.seq_len * c["mbs"] * model.hidden_size / c["tp"] * REC_ACT[c["recompute"]]
    in_flight = np.where(c["schedule"] == 0, c["num_microbatches"], np.minimum(c["pp"], c["num_microbatches"]))
    tensors = state + layers * act_layer * in_flight
    return tensors * (1.0 + platform.memory.fragmentation) + platform.memory.framework_bytes


def _step_seconds(model, platform, training, c):
    world = c["pp"] * c["dp"] * c["tp"]
    tokens = training.seq_len * training.global_batch
    peak = platform.peak_flops(training.dtype)
    eff = 0.5 * c["mbs"] / (c["mbs"] + 0.5)
    compute = 6.0 * model.active_params * tokens * REC_FLOPS[c["recompute"]] / (world * peak * eff)
    bubble = np.where(c["schedule"] == 2, (c["pp"] - 1) / c["virtual_stages"], c["pp"] - 1)
    compute = compute * (c["num_microbatches"] + bubble) / c["num_microbatches"]
    k = model.moe.top_k if model.moe is not None else 0
    dpn = platform.devices_per_node
    bw = np.where(c["ep"] <= dpn, platform.network.scopes["node"].bandwidth_GBps,
                  platform.network.scopes["switch"].bandwidth_GBps) * 1e9
    bw = bw * np.where((c["a2a"] == 1) & (c["ep"] > dpn), 1.5, 1.0)
    tokens_per_rank = tokens / (c["dp"] * c["tp"])   # every stage sees all tokens, split over its dp x tp ranks
    bytes_per_a2a = tokens_per_rank * k * model.hidden_size * 2.0 * (c["ep"] - 1) / c["ep"]
    a2a = np.where(c["ep"] > 1, 4.0 * model.num_moe_layers / c["pp"] * bytes_per_a2a / bw, 0.0)
    return compute + a2a, a2a
