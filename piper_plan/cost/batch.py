"""The search's hot path: ``evaluate`` over many candidates, each quantity computed once per distinct value of
the plan fields it depends on, then gathered back to the candidates (no Python per candidate).

What depends on what (the keys below; every one a few hundred to a few thousand distinct values in a search):

- time per micro-batch of every stage: (pp, tp, ep, etp, mbs, recompute, a2a, virtual_stages)   KEY_TIME
- parameters and activations per micro-batch of every stage: the above without a2a               KEY_STAGE
- peak memory: KEY_STAGE plus dp, num_microbatches, schedule, zero                                  KEY_MEMORY
- gradient sync and the optimizer step: (pp, tp, dp, ep, etp, virtual_stages, zero)               KEY_SYNC
- pipeline p2p: (pp, tp, dp, mbs, virtual_stages)                                                  KEY_P2P

Stages come from ``pipeline.stage_rows``: the distinct stage shapes of each layer split the plan may use
(even, FLOP-balanced), so per-stage arrays are [S, U] with S small. Each candidate takes the split that fits,
then the faster one (ties: even); ``estimate`` with that split's ``layers_per_stage`` gives the same numbers.
"""

from __future__ import annotations

import numpy as np

from piper_plan.cost import stage as stg
from piper_plan.cost.memory import in_flight
from piper_plan.cost.params import rank_stage_params
from piper_plan.cost.pipeline import bubble_microbatches, stage_rows
from piper_plan.cost.step import dp_sync_seconds, optimizer_seconds

KEY_TIME = ("pp", "tp", "ep", "etp", "mbs", "recompute", "a2a", "virtual_stages")
KEY_MEMORY = ("pp", "tp", "ep", "etp", "mbs", "recompute", "virtual_stages", "dp", "num_microbatches", "schedule",
              "zero")
KEY_STAGE = ("pp", "tp", "ep", "etp", "mbs", "recompute", "virtual_stages")
KEY_SYNC = ("pp", "tp", "dp", "ep", "etp", "virtual_stages", "zero")
KEY_P2P = ("pp", "tp", "dp", "mbs", "virtual_stages")
_NONE = -np.inf


class Keys:
    """Small integer codes of each candidate field (computed once), combined into composite keys."""

    def __init__(self, c):
        self.c = c
        self._codes: dict[str, tuple[np.ndarray, int]] = {}

    def codes(self, name: str) -> tuple[np.ndarray, int]:
        """(code per candidate, number of distinct values) of one field, by a presence table (O(N))."""
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


def stage_table(ctx, sub) -> tuple[np.ndarray, stg.StageShape, np.ndarray]:
    """(split code [S, U], StageShape [S, U], stage index [S, U]) of the distinct stages of each row of ``sub``;
    rows with fewer stages than S repeat their first (a duplicate never changes a maximum)."""
    pairs = sub.pp * 4 + np.minimum(sub.virtual_stages, 2)
    distinct, inverse = np.unique(pairs, return_inverse=True)
    cache = ctx.stage_rows
    for p in distinct:
        if int(p) not in cache:
            cache[int(p)] = stage_rows(ctx.model, ctx.training.seq_len, int(p // 4), min(int(p % 4), 2))
    tables = [cache[int(p)] for p in distinct]
    size = max(len(t) for t in tables)
    stacked = np.stack([np.concatenate([t, np.repeat(t[:1], size - len(t), 0)]) for t in tables])   # [P, S, 6]
    rows = stacked[inverse].transpose(2, 1, 0)                                                        # [6, S, U]
    shape = stg.StageShape(rows[2], rows[3], rows[4].astype(bool), rows[5].astype(bool))
    return rows[0], shape, rows[1]


def per_split_max(values, split) -> np.ndarray:
    """[2, U]: the maximum over the stages of each split code (-inf where a row has no such split)."""
    return np.stack([np.where(split == code, values, _NONE).max(0) for code in (0, 1)])


def per_split_argmax(values, split) -> np.ndarray:
    """[2, U]: the stage row of each split's maximum."""
    return np.stack([np.where(split == code, values, _NONE).argmax(0) for code in (0, 1)])


def time_by_key(ctx, alloc, sub, terms_fn):
    """Per KEY_TIME row and split: seconds per micro-batch of the slowest stage (without p2p) [2, U] and the
    breakdown of that stage {name: [2, U]}."""
    acts = stg.layer_activations(ctx, sub)
    per_layer, head = terms_fn(ctx, alloc, sub, acts)
    split, st, _ = stage_table(ctx, sub)
    dense_n, moe_n = st.dense_layers, st.moe_layers
    parts = {k: dense_n * d + moe_n * m for k, (d, m) in per_layer.items()}
    parts["compute/lm_head"] = np.where(st.last, head, 0.0)
    total = sum(parts.values())
    slow = per_split_argmax(total, split)
    cols = np.arange(total.shape[1])
    seconds = np.stack([np.where(split[slow[v], cols] == v, total[slow[v], cols], _NONE) for v in (0, 1)])
    at_slow = lambda p: np.stack([np.broadcast_to(p, total.shape)[slow[v], cols] for v in (0, 1)])   # noqa: E731
    breakdown = {k: at_slow(p) for k, p in parts.items()}
    return seconds, breakdown


def memory_by_key(ctx, c, keys, rows_m):
    """Per KEY_MEMORY row (``rows_m``) and split: peak bytes over the stages [2, U] and the stage row holding
    it [2, U]. Parameters and activations per micro-batch come once per KEY_STAGE row; only the micro-batches
    in flight and the ZeRO sharding vary with the rest of the key."""
    rows_a, inv_a = keys.factorize(KEY_STAGE)
    sub_a = c.take(rows_a)
    split, st, index = stage_table(ctx, sub_a)
    acts = stg.layer_activations(ctx, sub_a)
    acts["moe_total"] = sum((v for k, v in acts.items() if k.startswith("moe/")), 0.0 * acts["input"])
    params = rank_stage_params(ctx.lp, st.layers, st.moe_layers, st.first, st.last, sub_a.tp, sub_a.ep, sub_a.etp)
    per_flight, fixed = stg.activation_parts(ctx, sub_a, st, acts)
    sub_m, a = c.take(rows_m), inv_a[rows_m]
    flight = in_flight(sub_m.schedule, index[:, a], sub_m.pp, sub_m.num_microbatches, sub_m.virtual_stages)
    total = stg.memory_total(ctx, sub_m, (params[0][:, a], params[1][:, a]), flight * per_flight[:, a] + fixed[:, a])
    return per_split_max(total, split[:, a]), per_split_argmax(total, split[:, a]), (st, index, acts, inv_a)


def sync_by_key(ctx, sub, spans) -> dict[str, np.ndarray]:
    """Per KEY_SYNC row and split: dense / expert gradient sync and the optimizer step, seconds [2, U]."""
    split, st, _ = stage_table(ctx, sub)
    dense, expert = rank_stage_params(ctx.lp, st.layers, st.moe_layers, st.first, st.last, sub.tp, sub.ep, sub.etp)
    dense, expert = per_split_max(dense + 0.0 * split, split), per_split_max(expert + 0.0 * split, split)
    dense, expert = np.maximum(dense, 0.0), np.maximum(expert, 0.0)     # a missing split: any finite stand-in
    o = ctx.opts
    out = {"dp/sync/dense": [], "dp/sync/expert": [], "optimizer/step": []}
    for v in (0, 1):
        sync_d, sync_e = dp_sync_seconds(ctx.net, ctx.training, dense[v], expert[v], sub, spans["dp"][0],
                                         spans["edp"][0])
        out["dp/sync/dense"].append(sync_d * (1 - o.dp_overlap))
        out["dp/sync/expert"].append(sync_e * (1 - o.dp_overlap))
        out["optimizer/step"].append(optimizer_seconds(ctx.rates, ctx.training, dense[v], expert[v], sub))
    return {k: np.stack(v) for k, v in out.items()}


def choose_split(peak, seconds, device_bytes) -> np.ndarray:
    """Split code per candidate from [2, N] peaks and stage times: the balanced split (1) when it exists and
    fits while the even one does not, or both fit (or neither) and it is faster (neither: smaller peak)."""
    exists = np.isfinite(seconds[1])
    fit0, fit1 = peak[0] <= device_bytes, peak[1] <= device_bytes
    better = np.where(fit0 == fit1, np.where(fit0, seconds[1] < seconds[0], peak[1] < peak[0]), fit1)
    return (exists & better).astype(np.int64)


def evaluate_batch(ctx, alloc, c, spans_fn, terms_fn, p2p_fn, memory_detail=False):
    """(breakdown {name: [N]}, step seconds [N], peak memory {"total": [N], ...}, split code [N])."""
    keys = Keys(c)
    rows_t, inv_t = keys.factorize(KEY_TIME)
    seconds_t, parts_t = time_by_key(ctx, alloc, c.take(rows_t), terms_fn)
    rows_m, inv_m = keys.factorize(KEY_MEMORY)
    peak_m, big_m, detail_m = memory_by_key(ctx, c, keys, rows_m)
    peak2, seconds2 = peak_m[:, inv_m], seconds_t[:, inv_t]
    split = choose_split(peak2, seconds2, ctx.platform.device.memory_bytes)
    rows_s, inv_s = keys.factorize(KEY_SYNC)
    sub_s = c.take(rows_s)
    sync = sync_by_key(ctx, sub_s, spans_fn(alloc, sub_s))
    rows_p, inv_p = keys.factorize(KEY_P2P)
    sub_p = c.take(rows_p)
    p2p = p2p_fn(ctx, sub_p, spans_fn(alloc, sub_p))[inv_p]
    m = c.num_microbatches
    breakdown = _gather_split(parts_t, split, inv_t, m)
    breakdown["pipeline/p2p"] = p2p * m
    t_mb = seconds_t.ravel()[split * seconds_t.shape[1] + inv_t] + p2p
    breakdown["pipeline/bubble"] = t_mb * bubble_microbatches(c.schedule, c.pp, c.virtual_stages)
    breakdown.update(_gather_split(sync, split, inv_s))
    step = t_mb * m + breakdown["pipeline/bubble"] + breakdown["dp/sync/dense"] + breakdown["dp/sync/expert"] \
        + breakdown["optimizer/step"]
    breakdown["migration"] = step * ctx.opts.migration_fraction
    step = step + breakdown["migration"]
    peak_mem = {"total": np.where(split == 1, peak2[1], peak2[0])}
    if memory_detail:
        peak_mem = _memory_detail(ctx, c, big_m[split, inv_m], detail_m)
    return breakdown, step, peak_mem, split


def _gather_split(values: dict, split, inverse, scale=None) -> dict[str, np.ndarray]:
    """{name: [2, U]} -> {name: [N]} at (split, inverse), through one take of the stacked [K, 2 U] matrix."""
    names = list(values)
    stacked = np.stack([values[k] for k in names]).reshape(len(names), -1)
    out = stacked.take(split * stacked.shape[1] // 2 + inverse, axis=1)
    if scale is not None:
        out *= scale
    return dict(zip(names, out))


def _memory_detail(ctx, c, big_row, detail) -> dict[str, np.ndarray]:
    """The peak stage's memory components per candidate (stage.stage_memory at that stage)."""
    st, index, acts, inv_a = detail
    pick = lambda a: a[big_row, inv_a]        # noqa: E731
    shape = stg.StageShape(pick(st.layers), pick(st.moe_layers), pick(st.first), pick(st.last))
    acts_n = {k: np.broadcast_to(v, st.layers.shape[1:])[inv_a] for k, v in acts.items() if k != "moe_total"}
    flight = in_flight(c.schedule, pick(index), c.pp, c.num_microbatches, c.virtual_stages)
    return stg.stage_memory(ctx, c, shape, flight, acts_n)
