"""Whole-step quantities: data-parallel sync, optimizer step, training totals, checkpoints."""

from __future__ import annotations

import numpy as np

from piper_plan.cost.memory import saved_bytes_per_param


def dp_sync_seconds(net, training, dense, expert, c, dp_span, edp_span, shard_span,
                    replica_span) -> tuple[np.ndarray, np.ndarray]:
    """(dense, expert) gradient sync seconds of one rank per step, as piper's runtime syncs (docs/design-notes.md,
    "zero 0-3 in the runtime"). zero 0: all-reduce of the gradients; 1: their reduce-scatter and an all-gather of
    the updated weights (Rajbhandari et al. 2020); 2 and 3 (FSDP2): fp32 reduce-scatters and compute-dtype
    all-gathers: at pp > 1 one reduce-scatter per step (PipelineStage defers it to the last backward) and one
    all-gather (2) or M + 1 (3: before every op that follows a forward); at pp = 1 one reduce-scatter per
    micro-batch and M (2) or 2 M (3) all-gathers. HSDP (``c.dp_replicate`` > 1): the dense all-gathers and
    reduce-scatters run in the shard group (``shard_span``), and each reduce-scatter is followed by an fp32
    all-reduce of the gradient shard over the replicas (``replica_span``), as FSDP2 does on a 2-D mesh.
    Nothing overlapped (CostOptions.dp_overlap)."""
    from piper_plan.cost.memory import FSDP_GRAD_BYTES

    m = c.num_microbatches
    piped = c.pp > 1
    gathers = np.where(piped, np.where(c.zero == 3, m + 1, 1), np.where(c.zero == 3, 2 * m, m))
    scatters = np.where(piped, 1, m)
    hsdp = c.dp_replicate > 1          # else the shard group is the whole dp x cp group: c.dense_shard == c.dp_cp
    out = []
    for params, n, span, fsdp_n, fsdp_span in ((dense, c.dp_cp, dp_span, c.dense_shard, shard_span),
                                               (expert, c.edp, edp_span, c.edp, edp_span)):
        grads = params * training.grad_bytes
        weights = net.seconds("all_gather", n, params * training.weight_bytes, span)
        plain = net.seconds("all_reduce", n, grads, span)
        sharded = net.seconds("reduce_scatter", n, grads, span) + weights
        fsdp_weights = net.seconds("all_gather", fsdp_n, params * training.weight_bytes, fsdp_span)
        fsdp = scatters * net.seconds("reduce_scatter", fsdp_n, params * FSDP_GRAD_BYTES, fsdp_span) \
            + gathers * fsdp_weights
        synced = np.where(c.zero >= 2, fsdp, np.where(c.zero == 1, sharded, plain))
        out.append(np.where(params > 0, synced, 0.0))      # no parameters of the kind (a dense model's experts)
    if hsdp.any():
        across = net.seconds("all_reduce", c.dp_replicate, dense / c.dense_shard * FSDP_GRAD_BYTES, replica_span)
        out[0] = out[0] + np.where(hsdp & (c.zero >= 2), scatters * across, 0.0)
    return out[0], out[1]


def optimizer_seconds(rates, training, dense, expert, c, piper_runtime: bool = False) -> np.ndarray:
    """Adam step, memory-bound: read + write master and optimizer state, read gradients, write weights,
    for the parameters this rank updates (its ZeRO-1 shard), at the calibration's measured ``optimizer`` rate.
    Before it the gradients are read again: Megatron-Core's clipping and loss-scale unscaling, 2 x their bytes;
    piper's runtime (``piper_runtime``) reads its fp32 gradients for the global norm and rewrites them for the clip
    (runtime/optim.py: 3 x, at the ``clip`` rate) and divides them by the micro-batch count after the last
    backward (runtime/pipeline.py scale_grads, as torch's pipelining schedules do: 2 x, at the ``accumulate``
    rate), all of the rank's gradients but FSDP2's shards; Megatron-Core folds that mean into the loss."""
    from piper_plan.cost.memory import FSDP_GRAD_BYTES

    local = dense / np.where(c.zero >= 1, c.dense_shard, 1) + expert / np.where(c.zero >= 1, c.edp, 1)
    per_param = 2 * (training.master_bytes + training.optimizer_bytes) + training.grad_bytes + training.weight_bytes
    step = rates.memory_seconds(local * per_param, "optimizer")
    if not piper_runtime:
        return step + rates.memory_seconds(local * 2 * training.grad_bytes, "clip")
    # the runtime's gradients are fp32 (its parameters' dtype) and whole on each rank but under FSDP2 (zero 2 / 3,
    # dp > 1), whose gradients are shards: zero 1 shards the optimizer's state, not the norm, clip and mean
    fsdp = (c.zero >= 2) & (c.dp > 1)
    grads = np.where(fsdp, local, dense + expert) * FSDP_GRAD_BYTES
    return step + rates.memory_seconds(3 * grads, "clip") + rates.memory_seconds(2 * grads, "accumulate")


def runtime_copy_seconds(rates, training, dense, expert, c, launch_device: str, opts) -> np.ndarray:
    """Weight and gradient copies of piper's runtime in 16 bits on a GPU, memory-bound, per step, for every
    parameter of the rank's stage (unsharded: the gradients are full size before any reduce-scatter); m
    micro-batches, p the 16-bit bytes.

    - zero 0 / 1, and zero 2 / 3 at dp = 1 (autocast; runtime/train.py precision_path): the fp32 weights are cast
      once per step (runtime/casts.py casts_once_per_step: 4 + p bytes), each micro-batch's 16-bit weight gradient
      is cast to fp32 (p + 4) and from the second micro-batch on added to the held fp32 gradient (AccumulateGrad:
      4 + 4 + 4; the first is taken as it is): (4 + p)(1 + m) + 12 (m - 1).
    - FSDP2 (zero 2 / 3, dp > 1), reduce dtype fp32 (torch 2.13, torch/distributed/fsdp/_fully_shard:
      _fsdp_param_group.py post_backward, _fsdp_param.py to_accumulated_grad_if_needed /
      accumulate_unsharded_grad_if_needed, _fsdp_collectives.py foreach_reduce's copy into a reduce-dtype buffer):
      at pp = 1 each micro-batch's 16-bit gradient is copied into the fp32 reduce-scatter input, (p + 4) m; at
      pp > 1 the reduce-scatter waits for the last micro-batch: the first gradient is cast to fp32 (p + 4), each
      later one added to it (4 + p + 4) and the sum copied into the reduce-scatter input (4 + 4). The all-gathers'
      casts of the 1/dp shard are left out.

    An untied embedding table is looked up, not cast, and is priced as the rest (a bound by its share of the
    parameters). Casts at the calibration's measured ``cast`` rate, additions at ``accumulate``'s, the FSDP2 copy
    at ``copy``'s (memory.csv; the memory bandwidth without it). On an H200 the zero 0 copies and adds took 38.7 of
    a 121 ms step (benchmarks/gpu_check.py --profile, docs/gpu-check.md); the FSDP2 terms are not measured.
    Megatron-Core keeps 16-bit weights and fp32 main gradients instead: 0 outside piper's runtime."""
    from piper_plan.cost.memory import FSDP_GRAD_BYTES

    if not opts.unfused_kernels or launch_device != "cuda" or training.dtype not in ("bf16", "fp16"):
        return np.zeros(np.broadcast_shapes(np.shape(dense), np.shape(c.zero)))
    m, fp32, low = c.num_microbatches, FSDP_GRAD_BYTES, 2        # low: the 16-bit compute copy the runtime makes
    fsdp, piped = (c.zero >= 2) & (c.dp > 1), c.pp > 1
    casts = np.where(fsdp, np.where(piped, 1, m), 1 + m) * (fp32 + low)
    adds = np.where(fsdp, np.where(piped, (2 * fp32 + low) * (m - 1), 0), 3 * fp32 * (m - 1))
    copies = np.where(fsdp & piped, 2 * fp32, 0)                  # FSDP2's sum into the reduce-scatter input
    params = dense + expert
    return rates.memory_seconds(params * casts, "cast") + rates.memory_seconds(params * adds, "accumulate") \
        + rates.memory_seconds(params * copies, "copy")


def training_totals(training, step_s, nodes: int) -> dict[str, np.ndarray]:
    """Time and node-hours to train the spec's tokens at this step time."""
    steps = training.tokens_to_train / training.tokens_per_step
    seconds = steps * step_s
    return {"steps": steps, "time_to_train_s": seconds, "node_hours": seconds / 3600 * nodes}


def checkpoint_bytes(model, training, zero: int, fp32_replicas: bool = False) -> dict[str, float]:
    """Checkpoint size: the saved weights + master + optimizer state of every parameter (memory.
    saved_bytes_per_param; gradients and rebuilt copies are not saved), the MTP module's trained weights included."""
    per_param = float(sum(saved_bytes_per_param(training, zero, fp32_replicas)))
    return {"total_bytes": float(model.params.total_with_mtp * per_param), "bytes_per_param": per_param}


TABLE_IV_GPUS = 8
"""GPUs the Piper paper's Table IV reassigns a layer's experts over (expert_migration's default)."""


def expert_migration(num_experts: int, hidden: int, d_ffn: int, bytes_per_param: int = 16, matrices: int = 3,
                     gpus: int = TABLE_IV_GPUS, bandwidth_Bps: float = 50e9) -> tuple[float, float]:
    """(bytes sent per GPU, seconds) when one MoE layer's experts are fully reassigned over ``gpus`` GPUs:
    ``bytes_per_param x matrices x E d d_ffn / gpus`` (Piper paper, Table IV: 48 E d d_ffn / 8 at 50 GB/s).
    At a step boundary the gradients need not move (bytes_per_param 14 of 16); a 2-matrix expert has 2/3."""
    nbytes = bytes_per_param * matrices * num_experts * hidden * d_ffn / gpus
    return nbytes, nbytes / bandwidth_Bps
