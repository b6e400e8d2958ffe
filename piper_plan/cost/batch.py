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
  of which the stages' parameters and the groups' spans: KEY_SYNC less num_microbatches             KEY_PARAMS
- pipeline p2p: (pp, tp, cp, dp, mbs, virtual_stages), priced per KEY_STATE row (which holds them)

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
from piper_plan.cost.step import dp_sync_seconds, optimizer_seconds, runtime_copy_seconds
from piper_plan.cost.terms import HOST_ISSUE, HOST_ISSUE_STEP, layer_terms, p2p_seconds, spans
from piper_plan.specs.vocab import LayerSplit

KEY_TIME = ("pp", "tp", "cp", "ep", "etp", "mbs", "recompute", "a2a", "virtual_stages", "sequence_parallel")
KEY_STATE = ("pp", "tp", "cp", "ep", "etp", "mbs", "recompute", "virtual_stages", "sequence_parallel", "dp", "zero",
             "dp_replicate")
KEY_MEMORY = KEY_STATE + ("num_microbatches", "schedule")
KEY_PARAMS = ("pp", "tp", "cp", "dp", "ep", "etp", "virtual_stages", "zero", "dp_replicate")
KEY_SYNC = KEY_PARAMS + ("num_microbatches",)
SYNC_GROUPS = ("dp", "edp", "dp_shard", "dp_replicate")
"""The groups (terms.spans) whose scopes price the gradient sync, in dp_sync_seconds' order."""
SPLITS = (0, 1)
"""Split slots of the per-split arrays: 0 the even (or the explicit) split, 1 the FLOP-balanced one."""
_NONE = -np.inf
_DENSE_RADIX = 1 << 24
"""Largest composite-key range Keys.factorize indexes directly (a presence table of that many entries)."""


class Keys:
    """Small integer codes of each plan field (computed once), combined into composite keys."""

    def __init__(self, c):
        self.c = c
        self._codes: dict[str, tuple[np.ndarray, int]] = {}
        self._keys: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def codes(self, name: str) -> tuple[np.ndarray | None, int]:
        """(code per plan, number of distinct values) of one field, by a presence table (O(N)); (None, 1) for a
        field with one value (it adds nothing to a key)."""
        if name not in self._codes:
            col = getattr(self.c, name)
            self._codes[name] = (None, 1) if col.min() == col.max() else dense_codes(col)
        return self._codes[name]

    def factorize(self, names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(first row of each distinct combination of ``names``, inverse [N] into those rows), the combinations
        in lexicographic order of the fields' codes. The mixed-radix key is renumbered densely (order kept)
        whenever it would outgrow a presence table of a few entries per plan: O(N) per field, no sort. A key
        whose leading fields were factorized already starts from that inverse (the same order)."""
        if names not in self._keys:
            self._keys[names] = self._factorize(names)
        return self._keys[names]

    def _factorize(self, names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        done = max((k for k in self._keys if names[:len(k)] == k), key=len, default=())
        key, radix = None, 1
        if done:
            first, inverse = self._keys[done]
            key, radix = inverse.copy(), len(first)
        limit = min(max(4 * len(self.c), 1 << 16), _DENSE_RADIX)
        for name in names[len(done):]:
            code, size = self.codes(name)
            if code is None:
                continue
            if key is None:
                key, radix = code.copy(), size
                continue
            if radix * size > limit:
                key, radix = dense_codes(key, radix)
            if radix * size >= 1 << 31:
                key = key.astype(np.int64)
            key *= size
            key += code
            radix *= size
            if radix > _DENSE_RADIX:             # more distinct combinations than a table holds: sort
                _, key = np.unique(key, return_inverse=True)
                radix = int(key.max()) + 1
        if key is None:                          # every field has one value
            key = np.zeros(len(self.c), np.int32)
        first = np.full(radix, -1, np.int64)
        first[key[::-1]] = np.arange(key.size - 1, -1, -1)
        used = np.flatnonzero(first >= 0)
        dense = np.zeros(radix, np.int32)
        dense[used] = np.arange(used.size)
        return first[used], dense[key]


def dense_codes(values: np.ndarray, top: int | None = None) -> tuple[np.ndarray, int]:
    """(rank of each value among the distinct ones as int32, number of distinct values) of small non-negative
    integers (all below ``top``), by a presence table: order-preserving, O(N + top)."""
    present = np.zeros(int(values.max()) + 1 if top is None else top, bool)
    present[values] = True
    rank = np.cumsum(present, dtype=np.int32) - 1
    return rank[values], int(rank[-1]) + 1


_V_KEY = 1 << 16
"""Radix of the (pp, virtual stages) cache key of ``stage_groups``; interleaving with equal chunks is key 0."""


def stage_groups(ctx, sub) -> tuple[list[np.ndarray], np.ndarray]:
    """(the distinct stage tables among the rows of ``sub``: pipeline.stage_rows [R, 7] of each (pp, virtual
    stages), or the explicit split or unequal chunks of a batch of one; which table each row uses [U])."""
    chunks = _one_plan_chunks(ctx, sub)
    if chunks is not None:                          # a batch of one interleaved plan with unequal chunks
        return [chunk_stage_rows(ctx.model, chunks, int(sub.pp[0]))], np.zeros(len(sub), int)
    if sub.explicit_layers is not None:             # a batch of one plan with its own layers_per_stage
        return [explicit_stage_rows(ctx.model, list(sub.explicit_layers[0]))], np.zeros(len(sub), int)
    # unequal chunks: specs.parallel.interleaved_chunk_split's first case (the even split) fails, over the batch
    uneven = (sub.virtual_stages > 1) & (ctx.model.num_layers % (sub.pp * sub.virtual_stages) != 0)
    pairs = sub.pp * _V_KEY + np.where(uneven, sub.virtual_stages, np.where(sub.virtual_stages > 1, 0, 1))
    distinct, inverse = np.unique(pairs, return_inverse=True)
    cache = ctx.stage_rows
    for p in distinct:
        if int(p) not in cache:
            cache[int(p)] = stage_rows(ctx.model, ctx.training.seq_len, int(p // _V_KEY), int(p % _V_KEY))
    return [cache[int(p)] for p in distinct], inverse


def slot_rows(table: np.ndarray, slot: int) -> slice | None:
    """The rows of a stage table in split slot ``slot`` (stage_rows lists them slot by slot), None if none."""
    at = np.flatnonzero(table[:, 0] == slot)
    return slice(int(at[0]), int(at[-1]) + 1) if at.size else None


def stage_table(ctx, sub, groups=None) -> tuple[np.ndarray, stg.StageShape, np.ndarray, np.ndarray]:
    """(split slot [S, U], StageShape [S, U], stage index [S, U], layers in flight of unequal interleaved chunks
    [S, U]: 0 elsewhere) of the distinct stages of each row of ``sub``; rows with fewer stages than S repeat
    their first (a duplicate never changes a maximum). ``groups``: ``stage_groups(ctx, sub)`` where the caller
    has it already."""
    tables, inverse = stage_groups(ctx, sub) if groups is None else groups
    size = max(len(t) for t in tables)
    stacked = np.stack([np.concatenate([t, np.repeat(t[:1], size - len(t), 0)]) for t in tables])   # [P, S, 7]
    rows = stacked[inverse].transpose(2, 1, 0)                                                        # [7, S, U]
    shape = stg.StageShape(rows[2], rows[3], rows[4].astype(bool), rows[5].astype(bool))
    return rows[0], shape, rows[1], rows[6]



def _one_plan_chunks(ctx, sub) -> list[int] | None:
    """The unequal model chunks of a batch of one interleaved plan (explicit or by rule), else None."""
    if len(sub) != 1 or int(sub.virtual_stages[0]) == 1:
        return None
    return uneven_chunks(ctx.model.num_layers, int(sub.pp[0]), int(sub.virtual_stages[0]), sub.chunks_of(0))


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
    breakdown of that stage {name: [2, U]} (with the host's issue seconds per micro-batch, HOST_ISSUE, where
    layer_terms prices them), and the slowest unequal interleaved chunk [U] (-inf: none)."""
    per_layer, head, host = layer_terms(ctx, alloc, sub, stg.layer_activations(ctx, sub))
    split, st, _, _ = stage_table(ctx, sub)
    parts = stage_time_parts(ctx.model, per_layer, head, st)
    total = sum(parts.values())
    chunk = np.where(split == CHUNK_SLOT, total, _NONE).max(0)
    slow = per_split_argmax(total, split)
    cols = np.arange(total.shape[1])
    seconds = np.stack([np.where(split[slow[v], cols] == v, total[slow[v], cols], _NONE) for v in SPLITS])
    at_slow = lambda p: np.stack([np.broadcast_to(p, total.shape)[slow[v], cols] for v in SPLITS])   # noqa: E731
    parts = {k: at_slow(p) for k, p in parts.items()}
    if host is not None:               # the stage whose host is slowest, which need not be the device's slowest
        host_s = sum(stage_time_parts(ctx.model, *host, st).values())
        parts[HOST_ISSUE] = per_split_max(np.broadcast_to(host_s, total.shape), split)
    return seconds, parts, chunk


def host_floor(breakdown: dict, c, step) -> np.ndarray:
    """A GPU step's wait on its host: the host's issue seconds of the step beyond the device's ``step``, 0 where
    none is priced. ``breakdown`` holds (popped here) HOST_ISSUE, the slowest host's seconds per micro-batch, and
    HOST_ISSUE_STEP, its optimizer's. A host-paced schedule idles as the device-paced one does: M micro-batches
    plus the schedule's bubble (pipeline.bubble_microbatches). piper's runtime reads nothing back from the device
    inside a layer at ep 1 (runtime/moe.py keeps counts and offsets on the device), so its host runs ahead and the
    step takes the longer of the two: on an H200 the host issued the Mixtral-shaped step of benchmarks/gpu_check.py
    in 0.077 of its 0.123 s (docs/gpu-check.md). At ep > 1 the dispatch reads its counts in every MoE layer
    (runtime/dispatch.py), the host cannot run ahead across layers, and this is a lower bound (not measured)."""
    per_mb, optimizer = breakdown.pop(HOST_ISSUE, None), breakdown.pop(HOST_ISSUE_STEP, 0.0)
    if per_mb is None:
        return np.zeros_like(step)
    host = per_mb * (c.num_microbatches + bubble_microbatches(c.schedule, c.pp, c.virtual_stages)) + optimizer
    return np.maximum(host - step, 0.0)


def memory_by_key(ctx, c, keys, rows_m, detail: bool):
    """Per KEY_MEMORY row and split: peak bytes over the stages [2, U], and (``detail``) the peak stage's
    components {name: [2, U]}.

    One formula, stage.stage_memory, which is affine in the micro-batches in flight and in those whose loss the
    last stage holds: it is evaluated at 0 and 1 in flight (no loss) once per KEY_STATE row (everything but the
    schedule and the micro-batch count), and each KEY_MEMORY row takes ``m0 + flight x (m1 - m0) + loss x
    per_loss`` for its own flights (memory.in_flight, memory.loss_in_flight; stage.loss_memory_per_micro_batch),
    over the stages of its own stage table (the rows of one table share their stages: each split's peak is the
    maximum over a block of rows)."""
    rows_s, inv_s = keys.factorize(KEY_STATE)
    sub_s = c.take(rows_s)
    tables, table_of = groups = stage_groups(ctx, sub_s)
    split, st, _, _ = stage_table(ctx, sub_s, groups)
    acts = stg.layer_activations(ctx, sub_s)
    m0, m1 = (stg.stage_memory(ctx, sub_s, st, flight, acts, 0.0) for flight in (0.0, 1.0))
    per_loss = stg.loss_memory_per_micro_batch(ctx, sub_s, st)
    full = lambda x: None if x is None else np.broadcast_to(x, split.shape)   # noqa: E731
    terms = {k: (full(m0[k]), full(m1[k] - m0[k]), full(per_loss.get(k))) for k in (m0 if detail else ("total",))}
    a = inv_s[rows_m]
    schedule, pp, count, virtual = (getattr(c, name)[rows_m] for name in ("schedule", "pp", "num_microbatches",
                                                                        "virtual_stages"))
    peak = np.full((2, len(a)), _NONE)
    parts = {k: np.empty((2, len(a))) for k in terms} if detail else {"total": peak}
    group = table_of[a]
    for g, table in enumerate(tables):
        cols = np.flatnonzero(group == g)
        if not cols.size:
            continue
        ag, last = a[cols], np.flatnonzero(table[:, 5])
        index = table[:, 1:2]
        flight = in_flight(schedule[cols], index, pp[cols], count[cols], virtual[cols])
        flight = chunk_in_flight(flight, table[:, 6:7], table[:, 2:3], index, pp[cols], count[cols], virtual[cols])
        loss = loss_in_flight(schedule[cols], count[cols])
        at = lambda k: memory_at(terms[k], ag, flight, loss, last)   # noqa: E731
        total = at("total")
        for v in SPLITS:
            rows = slot_rows(table, v)
            if rows is not None:
                peak[v, cols] = total[rows].max(0)
            if detail:     # the peak stage's components (a missing split: the first stage's, as a stand-in)
                big = np.zeros(len(cols), int) if rows is None else rows.start + total[rows].argmax(0)
                for k in terms:
                    parts[k][v, cols] = np.broadcast_to(at(k), total.shape)[big, np.arange(len(cols))]
    return peak, parts


def memory_at(term, cols, flight, loss, last_rows) -> np.ndarray:
    """One memory component (m0, slope, per_loss: [S, U] each; per_loss None where no logits count) at the stage
    rows of one table ([R, n], ``flight`` [R, n]) and KEY_STATE columns ``cols``: m0 + flight x slope, and on the
    last stages (the only ones holding logits, per_loss 0 elsewhere) + loss x per_loss."""
    base, slope, per = term
    rows = len(flight)
    out = base[:rows, cols] + flight * slope[:rows, cols]
    if per is not None:
        out[last_rows] += loss * per[last_rows][:, cols]
    return out


def sync_by_key(ctx, alloc, c, keys, rows_y) -> dict[str, np.ndarray]:
    """Per KEY_SYNC row and split: dense / expert gradient sync, the optimizer step and the runtime's weight and
    gradient copies (step.runtime_copy_seconds), seconds [2, U]. What does not depend on the micro-batch count (the
    stages' parameters, the optimizer's overhead, the groups' spans) is computed once per KEY_PARAMS row."""
    rows_q, inv_q = keys.factorize(KEY_PARAMS)
    sub_q = c.take(rows_q)
    split, st, _, _ = stage_table(ctx, sub_q)
    dense, expert = rank_stage_params(ctx.lp, st.layers, st.moe_layers, st.first, st.last, sub_q.tp, sub_q.ep,
                                      sub_q.etp)
    dense, expert = per_split_max(dense + 0.0 * split, split), per_split_max(expert + 0.0 * split, split)
    dense, expert = np.maximum(dense, 0.0), np.maximum(expert, 0.0)     # a missing split: any finite stand-in
    overhead = per_split_max(optimizer_step_overhead(ctx, st, sub_q.world) + 0.0 * split, split)
    q = inv_q[rows_y]
    dense, expert, overhead = dense[:, q], expert[:, q], overhead[:, q]
    group_spans = {k: spans_q[0][q] for k, spans_q in spans(alloc, sub_q).items() if k in SYNC_GROUPS}
    sub = c.take(rows_y)
    o, on_cpu = ctx.opts, ctx.platform.launch.device == "cpu"
    out = {"dp/sync/dense": [], "dp/sync/expert": [], "optimizer/step": [], "precision/copies": []}
    out.update({} if on_cpu else {HOST_ISSUE_STEP: []})
    for v in SPLITS:
        sync_d, sync_e = dp_sync_seconds(ctx.net, ctx.training, dense[v], expert[v], sub,
                                         *(group_spans[k] for k in SYNC_GROUPS))
        out["dp/sync/dense"].append(sync_d * (1 - o.dp_overlap))
        out["dp/sync/expert"].append(sync_e * (1 - o.dp_overlap))
        out["optimizer/step"].append(optimizer_seconds(ctx.rates, ctx.training, dense[v], expert[v], sub,
                                                       o.unfused_kernels)
                                     + (np.maximum(overhead[v], 0.0) if on_cpu else 0.0))
        if not on_cpu:                  # a GPU's host issues the optimizer as it issues the layers (host_floor)
            out[HOST_ISSUE_STEP].append(np.maximum(overhead[v], 0.0))
        out["precision/copies"].append(runtime_copy_seconds(ctx.rates, ctx.training, dense[v], expert[v], sub,
                                                            ctx.platform.launch.device, o))
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


def quiet_overflow(fn):
    """Run ``fn`` with numpy's overflow / invalid / divide warnings off: a candidate whose figures overflow prices
    as inf or nan, which the search drops and an estimate refuses in one line (evaluate._validated_estimate);
    a warning per array would only bury that line."""
    import functools

    @functools.wraps(fn)
    def quiet(*args, **kwargs):
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return fn(*args, **kwargs)
    return quiet


def evaluate_batch(ctx, alloc, c, memory_detail=False):
    """(breakdown {name: [N]}, step seconds [N], peak-stage memory {"total": [N], ...}, split slot [N])."""
    keys = Keys(c)
    rows_t, inv_t = keys.factorize(KEY_TIME)
    seconds_t, parts_t, chunk_t = time_by_key(ctx, alloc, c.take(rows_t))
    keys.factorize(KEY_STATE)               # the leading fields of KEY_MEMORY (and memory_by_key's own key)
    rows_m, inv_m = keys.factorize(KEY_MEMORY)
    peak_m, memory_m = memory_by_key(ctx, c, keys, rows_m, memory_detail)
    split = choose_split(peak_m[:, inv_m], seconds_t[:, inv_t], ctx.platform.device.memory_bytes, c.layers_split)
    keys.factorize(KEY_PARAMS)              # the leading fields of KEY_SYNC (and sync_by_key's own key)
    rows_s, inv_s = keys.factorize(KEY_SYNC)
    sync = sync_by_key(ctx, alloc, c, keys, rows_s)
    rows_p, inv_p = keys.factorize(KEY_STATE)                 # it holds every field p2p depends on
    sub_p = c.take(rows_p)
    p2p = p2p_seconds(ctx, sub_p, spans(alloc, sub_p))[inv_p]
    m = c.num_microbatches
    host_mb = parts_t.pop(HOST_ISSUE, None)
    breakdown = _gather_split(parts_t, split, inv_t, m)
    if host_mb is not None:
        breakdown.update(_gather_split({HOST_ISSUE: host_mb}, split, inv_t))
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
        + breakdown["optimizer/step"] + breakdown["precision/copies"]
    breakdown["host/framework"] = host_floor(breakdown, c, step)
    step = step + breakdown["host/framework"]
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
    per_layer, head, _host = layer_terms(ctx, alloc, c, acts)
    times = stage_time_parts(ctx.model, per_layer, head, st)
    times["pipeline/p2p"] = np.broadcast_to(p2p_seconds(ctx, c, spans(alloc, c)), stages.shape)
    return st, memory, times
