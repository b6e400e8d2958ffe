"""Ranking, Pareto front, headroom, runnable filter: hand-built cases and properties."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from piper_plan.capability import unsupported_features
from piper_plan.cost.evaluate import evaluate
from piper_plan.catalog import load_model, load_platform
from piper_plan.search import rank
from piper_plan.search.space import CANDIDATE_FIELDS, SearchOptions, describe, enumerate_space
from piper_plan.specs import TrainingSpec

FRONTIER = load_platform("frontier")


def _fields(n: int, **over) -> dict[str, np.ndarray]:
    f = {k: np.ones(n, dtype=np.int64) for k in CANDIDATE_FIELDS}
    f.update({k: np.asarray(v, dtype=np.int64) for k, v in over.items()})
    return f


def _ev(tps, mem, fits=None):
    tps, mem = np.asarray(tps, float), np.asarray(mem, float)
    return SimpleNamespace(tokens_per_s=tps, peak_memory_bytes=mem,
                           fits=np.ones(len(tps), bool) if fits is None else np.asarray(fits))


def test_rank_by_tokens_then_memory_then_fewer_stages():
    f = _fields(4, pp=[4, 2, 1, 1], tp=[1, 1, 2, 1])
    ev = _ev([100, 100, 100, 200], [5, 5, 5, 9])
    order = rank.rank_order(f, ev, np.ones(4, bool))
    # 3 is fastest; 0, 1, 2 tie on tokens and memory: pp=1 before pp=2 before pp=4; within pp=1, tp=2 (idx 2) only.
    assert order.tolist() == [3, 2, 1, 0]


def test_rank_excludes_masked_and_prefers_larger_mbs_on_ties():
    f = _fields(3, mbs=[1, 4, 2])
    ev = _ev([10, 10, 10], [1, 1, 1])
    assert rank.rank_order(f, ev, np.array([True, True, False])).tolist() == [1, 0]


def test_pareto_front_by_hand():
    # ranked by tokens/s: (300, 50) (250, 60) (200, 40) (150, 40) (100, 10): front = 300/50, 200/40, 100/10.
    tps = np.array([150, 300, 100, 250, 200.0])
    mem = np.array([40, 50, 10, 60, 40.0])
    order = np.argsort(-tps)
    assert rank.pareto_front(tps, mem, order).tolist() == [1, 4, 2]


def test_headroom_tightens_fit():
    cap = FRONTIER.device.memory_bytes
    ev = _ev([1, 1, 1], [0.5 * cap, 0.85 * cap, 0.95 * cap])
    assert rank.fits_mask(ev, FRONTIER, 0.0).tolist() == [True, True, True]
    assert rank.fits_mask(ev, FRONTIER, 0.1).tolist() == [True, True, False]
    assert rank.fits_mask(ev, FRONTIER, 0.2).tolist() == [True, False, False]


@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_ranking_is_independent_of_candidate_order(seed):
    model, training = load_model("mixtral-8x7b"), TrainingSpec()
    space = enumerate_space(model, FRONTIER, training, 4)
    ev = evaluate(model, FRONTIER, training, 4, space.batch())
    order = rank.rank_order(space.fields, ev, rank.fits_mask(ev, FRONTIER))
    perm = np.random.default_rng(seed).permutation(len(space))
    f2 = {k: v[perm] for k, v in space.fields.items()}
    ev2 = SimpleNamespace(tokens_per_s=ev.tokens_per_s[perm], peak_memory_bytes=ev.peak_memory_bytes[perm],
                          fits=ev.fits[perm])
    order2 = rank.rank_order(f2, ev2, rank.fits_mask(ev2, FRONTIER))
    assert perm[order2].tolist() == order.tolist()


@settings(max_examples=20, deadline=None)
@given(st.floats(min_value=16.0, max_value=256.0), st.floats(min_value=1.0, max_value=4.0))
def test_more_memory_never_makes_a_feasible_plan_infeasible(mem_GiB, factor):
    model, training = load_model("mixtral-8x7b"), TrainingSpec()
    space = enumerate_space(model, FRONTIER, training, 4)
    small = FRONTIER.model_copy(update={"device": FRONTIER.device.model_copy(update={"memory_bytes": int(mem_GiB * 2**30)})})
    big = FRONTIER.model_copy(update={"device": FRONTIER.device.model_copy(update={"memory_bytes": int(mem_GiB * factor * 2**30)})})
    fit_small = rank.fits_mask(evaluate(model, small, training, 4, space.batch()), small)
    fit_big = rank.fits_mask(evaluate(model, big, training, 4, space.batch()), big)
    assert not np.any(fit_small & ~fit_big)


def test_runnable_mask_matches_capability_per_candidate():
    """With expert tensor parallelism searched (the runtime runs etp = 1 only) some candidates are refused."""
    model = load_model("mixtral-8x7b")
    space = enumerate_space(model, FRONTIER, TrainingSpec(), 2, SearchOptions(expert_tp=True))
    ok, features = rank.runnable_mask(space.fields, model)
    from piper_plan.specs import ParallelPlan

    sample = range(0, len(space), max(1, len(space) // 300))
    for i in sample:
        d = describe(space.fields, i)
        expect = not unsupported_features(ParallelPlan(**{k: d[k] for k in CANDIDATE_FIELDS}), model)
        assert bool(ok[i]) == expect
    assert 0 < ok.sum() < len(space)
    assert not np.any(space.fields["etp"][ok] > 1)
    assert np.any((space.fields["tp"][ok] > 1) & (space.fields["zero"][ok] == 1))  # tp runs with zero 1
    assert sum(features.values()) >= np.count_nonzero(~ok)


def test_merge_reasons_adds_and_sorts():
    assert rank.merge_reasons({"a": 1, "b": 5}, {"a": 7}) == {"a": 8, "b": 5}
