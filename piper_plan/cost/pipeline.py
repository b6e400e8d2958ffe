"""Pipeline stages of a plan and the schedule's step time.

Step time (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", sec. 2.2):
GPipe and 1F1B take ``(M + pp - 1) x t`` with t the forward + backward time of one micro-batch on the
bottleneck stage; interleaved 1F1B with v model chunks per rank shrinks the bubble to ``(pp - 1) / v``.
"""

from __future__ import annotations

import numpy as np

from piper_plan.cost.params import even_stage_bounds, explicit_stage_bounds

GPIPE, ONE_F_ONE_B, INTERLEAVED = 0, 1, 2


def representative_stages(model, pp) -> np.ndarray:
    """Stage indices [S, N] that hold every stage's maximum of memory and time under an even split.

    Per-stage memory falls with the stage index (fewer micro-batches in flight) and rises with the layers
    held; time rises with the layers. With identical layers everywhere the maxima sit on the first stage,
    the first stage with an extra layer, or the last (LM head). Dense first layers (DeepSeek) add the stage
    holding the first MoE layer, the next one, and the first all-MoE stage with an extra layer; interleaved
    MoE layers (Llama 4) add the neighbours whose MoE count differs by parity. test_evaluate_matches_estimate
    checks the choice against every stage."""
    pp = np.asarray(pp, np.int64)
    extra = model.num_layers % pp
    first_big = pp - np.where(extra, extra, 1)
    rows = [np.zeros_like(pp), first_big, pp - 1]
    if 0 < model.num_moe_layers < model.num_layers:
        first_moe = _stage_of_layer(model.num_layers, pp, model.moe_layers[0])
        rows += [first_moe, first_moe + 1, np.maximum(first_big, first_moe + 1)]
        if not _moe_after_dense_prefix(model):                 # interleaved MoE layers: parity matters
            rows += [np.ones_like(pp), 2 * np.ones_like(pp), first_big + 1, pp - 2]
    return np.clip(np.stack(rows), 0, pp - 1)


def _moe_after_dense_prefix(model) -> bool:
    """Every layer from the first MoE layer on is MoE (DeepSeek's first_k_dense_replace)."""
    first = model.moe_layers[0]
    return len(model.moe_layers) == model.num_layers - first


def _stage_of_layer(num_layers: int, pp, layer: int):
    """Stage holding ``layer`` under the even split (extra layers on the later stages)."""
    base, extra = num_layers // pp, num_layers % pp
    small = (pp - extra) * base                      # layers held by the stages without an extra layer
    return np.where(layer < small, layer // np.maximum(base, 1), (pp - extra) + (layer - small) // (base + 1))


def stage_layers(prefix: np.ndarray, num_layers: int, pp, stage, layers_per_stage=None):
    """(layers, MoE layers) of each stage, from the MoE prefix count (arrays broadcast)."""
    if layers_per_stage is None:
        start, end = even_stage_bounds(num_layers, pp, stage)
    else:
        start, end = explicit_stage_bounds(layers_per_stage, stage)
    return end - start, prefix[end] - prefix[start]


def bubble_microbatches(schedule, pp, virtual_stages):
    """Idle micro-batch slots of the schedule: pp - 1, or (pp - 1) / v interleaved."""
    return np.where(schedule == INTERLEAVED, (pp - 1) / virtual_stages, pp - 1.0)
