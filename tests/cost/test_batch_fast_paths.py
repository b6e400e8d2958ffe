"""cost/batch.py's fast paths equal the plain computations they replace: composite keys without a sort, peak
memory per stage table, gradient-sync terms once per KEY_PARAMS row."""

import numpy as np
import pytest

from piper_plan.catalog import load_model, load_platform
from piper_plan.cost import batch
from piper_plan.cost import stage as stg
from piper_plan.cost.memory import in_flight, loss_in_flight
from piper_plan.cost.options import DEFAULT_OPTIONS
from piper_plan.cost.pipeline import chunk_in_flight
from piper_plan.cost.step import dp_sync_seconds
from piper_plan.cost.terms import spans
from piper_plan.placement.layout import allocation
from piper_plan.search.space import enumerate_space
from piper_plan.specs import ParallelPlan, TrainingSpec


class Columns:
    def __init__(self, **arrays):
        self.__dict__.update(arrays)
        self._n = len(next(iter(arrays.values())))

    def __len__(self):
        return self._n


def plain_factorize(c, names):
    """np.unique over the stacked fields: the combinations in lexicographic order."""
    _, first, inverse = np.unique(np.stack([getattr(c, n) for n in names], axis=1), axis=0, return_index=True,
                                  return_inverse=True)
    return first, inverse.ravel()


@pytest.mark.parametrize("n,high", [(1000, 5), (20_000, 300), (300_000, 5000)])
def test_factorize_equals_a_sort(n, high):
    """Small ranges (one table), ranges that need renumbering on the way, and one that needs the sort; a field
    with one value among them."""
    rng = np.random.default_rng(n)
    names = tuple(f"f{i}" for i in range(6))
    c = Columns(**{name: rng.integers(0, high, n) * (i + 1) for i, name in enumerate(names)}, f6=np.full(n, 3))
    names = names[:2] + ("f6",) + names[2:]
    want_first, want_inverse = plain_factorize(c, names)
    got_first, got_inverse = batch.Keys(c).factorize(names)
    assert np.array_equal(got_first, want_first) and np.array_equal(got_inverse, want_inverse)


def test_factorize_from_leading_fields_equals_a_fresh_key():
    rng = np.random.default_rng(1)
    c = Columns(**{name: rng.integers(0, 40, 50_000) for name in "abcde"})
    keys = batch.Keys(c)
    keys.factorize(("a", "b", "c"))
    extended = keys.factorize(("a", "b", "c", "d", "e"))
    fresh = plain_factorize(c, ("a", "b", "c", "d", "e"))
    assert all(np.array_equal(x, y) for x, y in zip(extended, fresh))


def setting(name="mixtral-8x7b", nodes=8, platform="frontier"):
    model, platform, training = load_model(name), load_platform(platform), TrainingSpec()
    c = enumerate_space(model, platform, training, nodes).batch()
    return stg.make_context(model, platform, training, DEFAULT_OPTIONS), allocation(platform, nodes, "compact"), c


def plain_memory(ctx, c, rows_m, detail):
    """The padded form: every KEY_MEMORY row over the S stage rows of the widest table, masked per split."""
    keys = batch.Keys(c)
    rows_s, inv_s = keys.factorize(batch.KEY_STATE)
    sub_s = c.take(rows_s)
    split, st, index, chunk_flight = batch.stage_table(ctx, sub_s)
    acts = stg.layer_activations(ctx, sub_s)
    m0, m1 = (stg.stage_memory(ctx, sub_s, st, f, acts, 0.0) for f in (0.0, 1.0))
    per_loss = stg.loss_memory_per_micro_batch(ctx, sub_s, st)
    sub_m, a = c.take(rows_m), inv_s[rows_m]
    flight = in_flight(sub_m.schedule, index[:, a], sub_m.pp, sub_m.num_microbatches, sub_m.virtual_stages)
    flight = chunk_in_flight(flight, chunk_flight[:, a], st.layers[:, a], index[:, a], sub_m.pp,
                             sub_m.num_microbatches, sub_m.virtual_stages)
    loss = loss_in_flight(sub_m.schedule, sub_m.num_microbatches)
    full = lambda x: np.broadcast_to(x, split.shape)[:, a]   # noqa: E731
    at = lambda k: full(m0[k]) + flight * full(m1[k] - m0[k]) + loss * full(per_loss.get(k, 0.0))   # noqa: E731
    total, split_m = at("total"), split[:, a]
    peak = batch.per_split_max(total, split_m)
    if not detail:
        return peak, {"total": peak}
    big, cols = batch.per_split_argmax(total, split_m), np.arange(len(a))
    return peak, {k: np.stack([np.broadcast_to(at(k), total.shape)[big[v], cols] for v in batch.SPLITS])
                  for k in m0}


@pytest.mark.parametrize("detail", [False, True])
@pytest.mark.parametrize("name,nodes,platform", [("mixtral-8x7b", 8, "frontier"), ("deepseek-v3", 128, "frontier"),
                                                 ("qwen3-235b-a22b", 32, "dgx-h100")])
def test_memory_per_stage_table_equals_the_padded_form(name, nodes, platform, detail):
    """Mixtral: several tables, interleaved ones among them; DeepSeek-V3: FLOP-balanced splits (slot 1); Qwen3-235B
    (94 layers): interleaved plans with unequal chunks (their tables hold chunk rows besides the ranks)."""
    ctx, _, c = setting(name, nodes, platform)
    split, _, _, _ = batch.stage_table(ctx, c)
    assert len(np.unique(c.pp)) > 2 and ((c.virtual_stages > 1).any() or (split == 1).any())
    if name.startswith("qwen3"):
        assert (split == batch.CHUNK_SLOT).any()
    keys = batch.Keys(c)
    keys.factorize(batch.KEY_STATE)
    rows_m, _ = keys.factorize(batch.KEY_MEMORY)
    peak, parts = batch.memory_by_key(ctx, c, keys, rows_m, detail)
    want_peak, want_parts = plain_memory(ctx, c, rows_m, detail)
    assert np.array_equal(peak, want_peak)
    assert parts.keys() == want_parts.keys()
    for k in parts:
        assert np.array_equal(parts[k], want_parts[k]), k


def test_sync_once_per_params_row_equals_per_sync_row():
    """The stage parameters and spans gathered from KEY_PARAMS rows give what each KEY_SYNC row computes itself."""
    ctx, alloc, c = setting("deepseek-v3", 128)
    keys = batch.Keys(c)
    rows_y, _ = keys.factorize(batch.KEY_SYNC)
    got = batch.sync_by_key(ctx, alloc, c, keys, rows_y)
    sub = c.take(rows_y)
    split, st, _, _ = batch.stage_table(ctx, sub)
    dense, expert = batch.rank_stage_params(ctx.lp, st.layers, st.moe_layers, st.first, st.last, sub.tp, sub.ep,
                                            sub.etp)
    dense = np.maximum(batch.per_split_max(dense + 0.0 * split, split), 0.0)
    expert = np.maximum(batch.per_split_max(expert + 0.0 * split, split), 0.0)
    group_spans = spans(alloc, sub)
    for v in batch.SPLITS:
        want = dp_sync_seconds(ctx.net, ctx.training, dense[v], expert[v], sub,
                               *(group_spans[k][0] for k in batch.SYNC_GROUPS))
        assert np.array_equal(got["dp/sync/dense"][v], want[0] * (1 - ctx.opts.dp_overlap))
        assert np.array_equal(got["dp/sync/expert"][v], want[1] * (1 - ctx.opts.dp_overlap))


def test_no_plans_is_an_empty_evaluation():
    """evaluate() of an empty batch (before: numpy's zero-size reduction error; the search guarded it itself)."""
    from piper_plan.cost.evaluate import evaluate
    from piper_plan.plans import PlanBatch

    none = PlanBatch.of(ParallelPlan(dp=8)).take(np.array([], dtype=int))
    training = TrainingSpec(seq_len=32, global_batch=8)
    assert len(evaluate(load_model("tiny-moe"), load_platform("dgx-h100"), training, 1, none).step_time_s) == 0
