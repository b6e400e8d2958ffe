"""The one pricing pipeline: ``evaluate_batch`` over a PlanBatch, each quantity computed once per distinct value of
the plan fields it depends on, then gathered back to the plans (no Python per plan). The search prices millions
of candidates with it and ``estimate`` prices a batch of one with it, so both give the same numbers by
construction; ``stage_detail`` then walks that one plan's every stage for the report.

What depends on what (the keys below; every one a few hundred to a few thousand distinct values in a search):

- time per micro-batch of every stage: (pp, tp, cp, ep, etp, mbs, recompute, a2a, virtual_stages, sp) KEY_TIME
- peak memory: (pp, tp, cp, ep, etp, mbs, recompute, virtual_stages, sp, dp, num_microbatches, schedule,
  zero, dp_replicate)                                                                               KEY_MEMORY
  of which memory without the micro-batches in flight: KEY_MEMORY less schedule, num_microbatches  KEY_STATE
- gradient sync and the optimizer step: (pp, tp, cp, dp, ep, etp, virtual_stages, zero, num_microbatches,
  dp_replicate)                                                                                     KEY_SYNC
- pipeline p2p: (pp, tp, cp, dp, mbs, virtual_stages)                                              KEY_P2P

Stages come from ``pipeline.stage_rows``: the distinct stage shapes of each layer split the plan may use
(even, FLOP-balanced; or the plan's explicit list), so per-stage arrays are [S, U] with S small. A plan whose
``layers_split`` is auto takes the split that fits, then the faster one (ties: even); even / balanced /
explicit plans take theirs.
"""

from __future__ import annotations

import numpy as np

from piper_plan.cost import stage as stg
from piper_plan.cost.memory import in_flight, loss_in_flight
from piper_plan.cost.overhead import optimizer_step_overhead
from piper_plan.cost.pipeline import (CHUNK_SLOT, bubble_microbatches, chunk_in_flight, chunk_stage_rows,
                                      explicit_stage_rows, rank_chunk_table, stage_layers, stage_rows,
                                      uneven_bubble_seconds, uneven_chunks)
from piper_plan.cost.params import moe_prefix, rank_stage_params
from piper_plan.cost.step import dp_sync_seconds, optimizer_seconds
from piper_plan.cost.terms import layer_terms, p2p_seconds, spans
from piper_plan.specs.vocab import LayerSplit

KEY_TIME = ("pp", "tp", "cp", "ep", "etp", "mbs", "recompute", "a2a", "virtual_stages", "sequence_parallel")
KEY_MEMORY = ("pp", "tp", "cp", "ep", "etp", "mbs", "recompute", "virtual_stages", "sequence_parallel", "dp",
              "num_microbatches", "schedule", "zero", "dp_replicate")
KEY_STATE = ("pp", "tp", "cp", "ep", "etp", "mbs", "recompute", "virtual_stages", "sequence_parallel", "dp", "zero",
             "dp_replicate")
KEY_SYNC = ("pp", "tp", "cp", "dp", "ep", "etp", "virtual_stages", "zero", "num_microbatches", "dp_replicate")
KEY_P2P = ("pp", "tp", "cp", "dp", "mbs", "virtual_stages")
SPLITS = (0, 1)
"""Split slots of the per-split arrays: 0 the even (or the explicit) split, 1 the FLOP-balanced one."""
_NONE = -np.inf


class Keys:
    """Small integer codes of each plan field (computed once), combined into composite keys."""

    def __init__(self, c):
        self.c = c
        self._codes: dict[str, tuple[np.ndarray, int]] = {}

    def codes(self, name: str) -> tuple[np.ndarray, int]:
        """(code per plan, number of distinct values) of one field, by a presence table (O(N))."""
        if name not in self._codes:
            col = getattr(self.c, name)
            present = np.zeros(int(col.max()) + 1, bool)
            present[col] = True
            distinct = np.flatnonzero(present)
            remap = np.zeros(present.size, np.int64)
            remap[distinct] = np.arange(distinct.size)
            self._codes[name] = (remap[col], distinct.size)
        return self._codes[name]

    def factorize(self, names) -> tuple[np.ndarray, np.ndarray]:
        """(first row of each distinct combination of ``names``, inverse [N] into those rows)."""
        key, radix = None, 1
        for name in names:
            code, size = self.codes(name)
            key = code.copy() if key is None else key * size + code
            radix *= size
        if radix > 1 << 24:
            _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
            return first, inverse
        first = np.full(radix, -1, np.int64)
        first[key[::-1]] = np.arange(key.size - 1, -1, -1)
        used = np.flatnonzero(first >= 0)
        dense = np.zeros(radix, np.int64)
        dense[used] = np.arange(used.size)
        return first[used], dense[key]


def stage_table(ctx, sub) -> tuple[np.ndarray, stg.StageShape, np.ndarray, np.ndarray]:
    """(split slot [S, U], StageShape [S, U], stage index [S, U], layers in flight of unequal interleaved chunks
    [S, U]: 0 elsewhere) of the distinct stages of each row of ``sub``; rows with fewer stages than S repeat
    their first (a duplicate never changes a maximum)."""
    chunks = _one_plan_chunks(ctx, sub)
    if chunks is not None:                          # a batch of one interleaved plan with unequal chunks
        tables, inverse = [chunk_stage_rows(ctx.model, chunks, int(sub.pp[0]))], np.zeros(len(sub), int)
    elif sub.explicit_layers is not None:           # a batch of one plan with its own layers_per_stage
        tables, inverse = [explicit_stage_rows(ctx.model, list(sub.explicit_layers[0]))], np.zeros(len(sub), int)
    else:
        n = sub.pp * sub.virtual_stages
        uneven = (sub.virtual_stages > 1) & (ctx.model.num_layers % n != 0)
        pairs = sub.pp * _V_KEY + np.where(uneven, sub.virtual_stages, np.where(sub.virtual_stages > 1, 0, 1))
        distinct, inverse = np.unique(pairs, return_inverse=True)
        cache = ctx.stage_rows
        for p in distinct:
            if int(p) not in cache:
                cache[int(p)] = stage_rows(ctx.model, ctx.training.seq_len, int(p // _V_KEY), int(p % _V_KEY))
        tables = [cache[int(p)] for p in distinct]
    size = max(len(t) for t in tables)
    stacked = np.stack([np.concatenate([t, np.repeat(t[:1], size - len(t), 0)]) for t in tables])   # [P, S, 7]
    rows = stacked[inverse].transpose(2, 1, 0)                                                        # [7, S, U]
    shape = stg.StageShape(rows[2], rows[3], rows[4].astype(bool), rows[5].astype(bool))
    return rows[0], shape, rows[1], rows[6]


_V_KEY = 1 << 16
"""Radix of the (pp, virtual stages) cache key of ``stage_table``; interleaving with equal chunks is key 0."""


def _one_plan_chunks(ctx, sub) -> list[int] | None:
    """The unequal model chunks of a batch of one interleaved plan (explicit or by rule), else None."""
    if len(sub) != 1 or int(sub.virtual_stages[0]) == 1:
        return None
    explicit = sub.explicit_chunks[0] if sub.explicit_chunks is not None else None
    return uneven_chunks(ctx.model.num_layers, int(sub.pp[0]), int(sub.virtual_stages[0]), explicit)


def per_split_max(values, split) -> np.ndarray:
    """[2, U]: the maximum over the stages of each split slot (-inf where a row has no such split)."""
    return np.stack([np.where(split == code, values, _NONE).max(0) for code in SPLITS])


def per_split_argmax(values, split) -> np.ndarray:
    """[2, U]: the stage row of each split's maximum."""
    return np.stack([np.where(split == code, values, _NONE).argmax(0) for code in SPLITS])


def stage_time_parts(model, per_layer: dict, head, st: stg.StageShape) -> dict[str, np.ndarray]:
    """Seconds per micro-batch of stages ``st`` by breakdown name (without p2p): per-layer terms times the
    stage's dense / MoE block counts (the MTP blocks included), the LM head on the last stage (once more per MTP
    module; eh_proj, 2 d^2 per token, is not priced)."""
    st = stg.with_mtp_blocks(model, st)
    parts = {k: st.dense_layers * d + st.moe_layers * m for k, (d, m) in per_layer.items()}
    parts["compute/lm_head"] = np.where(st.last, head * (1 + model.mtp_layers), 0.0)
    return parts


def time_by_key(ctx, alloc, sub):
    """Per KEY_TIME row and split: seconds per micro-batch of the slowest stage (without p2p) [2, U], the
    breakdown of that stage {name: [2, U]}, and the slowest unequal interleaved chunk [U] (-inf: none)."""
    per_layer, head = layer_terms(ctx, alloc, sub, stg.layer_activations(ctx, sub))
    split, st, _, _ = stage_table(ctx, sub)
    parts = stage_time_parts(ctx.model, per_layer, head, st)
    total = sum(parts.values())
    chunk = np.where(split == CHUNK_SLOT, total, _NONE).max(0)
    slow = per_split_argmax(total, split)
    cols = np.arange(total.shape[1])
    seconds = np.stack([np.where(split[slow[v], cols] == v, total[slow[v], cols], _NONE) for v in SPLITS])
    at_slow = lambda p: np.stack([np.broadcast_to(p, total.shape)[slow[v], cols] for v in SPLITS])   # noqa: E731
    return seconds, {k: at_slow(p) for k, p in parts.items()}, chunk


def memory_by_key(ctx, c, keys, rows_m, detail: bool):
    """Per KEY_MEMORY row and split: peak bytes over the stages [2, U], and (``detail``) the peak stage's
    components {name: [2, U]}.

    One formula, stage.stage_memory, which is affine in the micro-batches in flight and in those whose loss the
    last stage holds: it is evaluated at 0 and 1 in flight (no loss) once per KEY_STATE row (everything but the
    schedule and the micro-batch count), and each KEY_MEMORY row takes ``m0 + flight x (m1 - m0) + loss x
    per_loss`` for its own flights (memory.in_flight, memory.loss_in_flight; stage.loss_memory_per_micro_batch)."""
    rows_s, inv_s = keys.factorize(KEY_STATE)
    sub_s = c.take(rows_s)
    split, st, index, chunk_flight = stage_table(ctx, sub_s)
    acts = stg.layer_activations(ctx, sub_s)
    m0, m1 = (stg.stage_memory(ctx, sub_s, st, flight, acts, 0.0) for flight in (0.0, 1.0))
    per_loss = stg.loss_memory_per_micro_batch(ctx, sub_s, st)
    sub_m, a = c.take(rows_m), inv_s[rows_m]
    flight = in_flight(sub_m.schedule, index[:, a], sub_m.pp, sub_m.num_microbatches, sub_m.virtual_stages)
    flight = chunk_in_flight(flight, chunk_flight[:, a], st.layers[:, a], index[:, a], sub_m.pp,
                             sub_m.num_microbatches, sub_m.virtual_stages)
    loss = loss_in_flight(sub_m.schedule, sub_m.num_microbatches)
    shape = flight.shape
    at = lambda name: (np.broadcast_to(m0[name], split.shape)[:, a]                                  # noqa: E731
                       + flight * np.broadcast_to(m1[name] - m0[name], split.shape)[:, a]
                       + loss * np.broadcast_to(per_loss.get(name, 0.0), split.shape)[:, a])
    total = at("total")
    split_m = split[:, a]
    peak = per_split_max(total, split_m)
    if not detail:
        return peak, {"total": peak}
    big = per_split_argmax(total, split_m)
    cols = np.arange(shape[1])
    return peak, {k: np.stack([np.broadcast_to(at(k), shape)[big[v], cols] for v in SPLITS]) for k in m0}


def sync_by_key(ctx, sub, group_spans) -> dict[str, np.ndarray]:
    """Per KEY_SYNC row and split: dense / expert gradient sync and the optimizer step, seconds [2, U]."""
    split, st, _, _ = stage_table(ctx, sub)
    dense, expert = rank_stage_params(ctx.lp, st.layers, st.moe_layers, st.first, st.last, sub.tp, sub.ep, sub.etp)
    dense, expert = per_split_max(dense + 0.0 * split, split), per_split_max(expert + 0.0 * split, split)
    dense, expert = np.maximum(dense, 0.0), np.maximum(expert, 0.0)     # a missing split: any finite stand-in
    overhead = per_split_max(optimizer_step_overhead(ctx, st, sub.world) + 0.0 * split, split)
    o = ctx.opts
    out = {"dp/sync/dense": [], "dp/sync/expert": [], "optimizer/step": []}
    for v in SPLITS:
        sync_d, sync_e = dp_sync_seconds(ctx.net, ctx.training, dense[v], expert[v], sub, group_spans["dp"][0],
                                         group_spans["edp"][0], group_spans["dp_shard"][0],
                                         group_spans["dp_replicate"][0])
        out["dp/sync/dense"].append(sync_d * (1 - o.dp_overlap))
        out["dp/sync/expert"].append(sync_e * (1 - o.dp_overlap))
        out["optimizer/step"].append(optimizer_seconds(ctx.rates, ctx.training, dense[v], expert[v], sub)
                                     + np.maximum(overhead[v], 0.0))
    return {k: np.stack(v) for k, v in out.items()}


def choose_split(peak, seconds, device_bytes, layers_split) -> np.ndarray:
    """Split slot per plan from [2, N] peaks and stage times. ``auto``: the balanced split (1) when it exists and
    fits while the even one does not, or both fit (or neither) and it is faster (neither: smaller peak).
    ``balanced``: 1 where it exists (else it is the even split). ``even`` and ``explicit``: 0."""
    exists = np.isfinite(seconds[1])
    fit0, fit1 = peak[0] <= device_bytes, peak[1] <= device_bytes
    better = np.where(fit0 == fit1, np.where(fit0, seconds[1] < seconds[0], peak[1] < peak[0]), fit1)
    auto = layers_split == LayerSplit.AUTO.code
    wanted = np.where(auto, better, layers_split == LayerSplit.BALANCED.code)
    return (exists & wanted).astype(np.int64)


def evaluate_batch(ctx, alloc, c, memory_detail=False):
    """(breakdown {name: [N]}, step seconds [N], peak-stage memory {"total": [N], ...}, split slot [N])."""
    keys = Keys(c)
    rows_t, inv_t = keys.factorize(KEY_TIME)
    seconds_t, parts_t, chunk_t = time_by_key(ctx, alloc, c.take(rows_t))
    rows_m, inv_m = keys.factorize(KEY_MEMORY)
    peak_m, memory_m = memory_by_key(ctx, c, keys, rows_m, memory_detail)
    split = choose_split(peak_m[:, inv_m], seconds_t[:, inv_t], ctx.platform.device.memory_bytes, c.layers_split)
    rows_s, inv_s = keys.factorize(KEY_SYNC)
    sub_s = c.take(rows_s)
    sync = sync_by_key(ctx, sub_s, spans(alloc, sub_s))
    rows_p, inv_p = keys.factorize(KEY_P2P)
    sub_p = c.take(rows_p)
    p2p = p2p_seconds(ctx, sub_p, spans(alloc, sub_p))[inv_p]
    m = c.num_microbatches
    breakdown = _gather_split(parts_t, split, inv_t, m)
    breakdown["pipeline/p2p"] = p2p * m
    t_mb = seconds_t.ravel()[split * seconds_t.shape[1] + inv_t] + p2p
    breakdown["pipeline/bubble"] = t_mb * bubble_microbatches(c.schedule, c.pp, c.virtual_stages)
    chunk = chunk_t[inv_t]
    uneven = np.isfinite(chunk)                     # interleaved plans with unequal chunks
    if uneven.any():
        bubble = uneven_bubble_seconds(np.where(uneven, chunk, 0.0), p2p, c.pp, c.virtual_stages)
        breakdown["pipeline/bubble"] = np.where(uneven, bubble, breakdown["pipeline/bubble"])
    breakdown.update(_gather_split(sync, split, inv_s))
    step = t_mb * m + breakdown["pipeline/bubble"] + breakdown["dp/sync/dense"] + breakdown["dp/sync/expert"] \
        + breakdown["optimizer/step"]
    breakdown["migration"] = step * ctx.opts.migration_fraction
    step = step + breakdown["migration"]
    return breakdown, step, _gather_split(memory_m, split, inv_m), split


def _gather_split(values: dict, split, inverse, scale=None) -> dict[str, np.ndarray]:
    """{name: [2, U]} -> {name: [N]} at (split, inverse), through one take of the stacked [K, 2 U] matrix."""
    names = list(values)
    stacked = np.stack([values[k] for k in names]).reshape(len(names), -1)
    out = stacked.take(split * stacked.shape[1] // 2 + inverse, axis=1)
    if scale is not None:
        out *= scale
    return dict(zip(names, out))


def stage_detail(ctx, alloc, c, layers_per_stage: list[int]):
    """Every stage of a batch of one plan under its resolved split: (StageShape [pp, 1], memory by component
    {name: [pp, 1]}, seconds per micro-batch by breakdown name {name: [pp, 1]}, p2p included)."""
    pp = int(c.pp[0])
    stages = np.arange(pp)[:, None]
    flight = in_flight(c.schedule, stages, c.pp, c.num_microbatches, c.virtual_stages)
    chunks = _one_plan_chunks(ctx, c)
    if chunks is None:
        layers, moe = stage_layers(moe_prefix(ctx.model), ctx.model.num_layers, c.pp, stages, layers_per_stage)
    else:                                           # interleaved, unequal chunks: each rank over its chunks
        table = {k: v[:, None] for k, v in rank_chunk_table(ctx.model, chunks, pp).items()}
        layers, moe = table["layers"], table["moe_layers"]
        flight = chunk_in_flight(flight, table["flight_layers"], layers, stages, c.pp, c.num_microbatches,
                                 c.virtual_stages)
    st = stg.StageShape(layers, moe, stages == 0, stages == pp - 1)
    acts = stg.layer_activations(ctx, c)
    loss = loss_in_flight(c.schedule, c.num_microbatches)
    memory = {k: np.broadcast_to(v, stages.shape) for k, v in stg.stage_memory(ctx, c, st, flight, acts, loss).items()}
    per_layer, head = layer_terms(ctx, alloc, c, acts)
    times = stage_time_parts(ctx.model, per_layer, head, st)
    times["pipeline/p2p"] = np.broadcast_to(p2p_seconds(ctx, c, spans(alloc, c)), stages.shape)
    return st, memory, times
