"""Candidate generation: hand-derived counts, brute force = vectorised, the paper's PP x EP restriction."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from piper_plan.catalog import load_model, load_platform
from piper_plan.errors import PiperError
from piper_plan.plans import PlanBatch, check_plan
from piper_plan.search.space import CANDIDATE_FIELDS, SearchOptions, describe, divisors, enumerate_space
from piper_plan.specs import ParallelPlan, TrainingSpec
from piper_plan.specs.vocab import A2A, Recompute, Schedule

SCHEDULES, RECOMPUTE, A2A_NAMES = Schedule.values(), Recompute.values(), A2A.values()

FRONTIER = load_platform("frontier")
BRUTE_ZERO = (0, 3)   # zero 1 and 2 obey exactly zero 3's rules (the zero-dependent one: zero >= 1); out for time
ONE_COMBO = SearchOptions(schedules=("1f1b",), recompute=("none",), zero=(0,), a2a="flat", mbs=(1,), expert_tp=True)


def test_divisors():
    assert divisors(1) == [1]
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(16384) == [2**i for i in range(15)]


def test_tiny_moe_one_node_counts_by_hand():
    # tiny-moe: L=4, 4 heads / 2 KV heads, E=8, expert d_ffn=128; 1 Frontier node = 8 devices, batch 8, mbs 1.
    # (pp, tp) with pp x tp | 8: (1,1) (1,2) (1,4) (1,8) (2,1) (2,2) (2,4) (4,1) (4,2) (8,1) = 10 pairs;
    # ep in {1,2,4,8}, etp in {1,2,4,8} -> 160 rows.
    # pp=8 > 4 layers: 16 rows. tp in {4,8} does not divide 2 KV heads: (1,4) (1,8) (2,4) -> 48 rows.
    # etp must divide tp: tp=1 keeps etp=1 (12 of 16 rejected), tp=2 keeps etp in {1,2} (8 rejected):
    # 3 x 12 + 3 x 8 = 60 rows. Then ep x etp | dp x tp: (1,1) P=8: 4 ok; (1,2) P=8: 4 + 3 ok, 1 not;
    # (2,1) P=4: 3 ok, 1 not; (2,2) P=4: 3 + 2 ok, 3 not; (4,1) P=2: 2 ok, 2 not; (4,2) P=2: 2 + 1 ok, 5 not.
    # Valid 4+7+3+5+2+3 = 24; ep_etp_not_divisor_ranks 0+1+1+3+2+5 = 12; 16 + 48 + 60 + 12 + 24 = 160.
    space = enumerate_space(load_model("tiny-moe"), FRONTIER, TrainingSpec(global_batch=8, seq_len=512), 1, ONE_COMBO)
    assert space.total == 160
    assert len(space) == 24
    assert space.reasons == {"pp_exceeds_layers": 16, "tp_not_divisor_heads": 48, "etp_not_divisor_tp": 60,
                             "ep_etp_not_divisor_ranks": 12}


@pytest.mark.parametrize("name,nodes", [("tiny-moe", 2), ("mixtral-8x7b", 16), ("deepseek-v3", 128),
                                        ("tiny-dense", 4), ("piper-weak-862b", 64)])
def test_every_candidate_is_counted_once(name, nodes):
    space = enumerate_space(load_model(name), FRONTIER, TrainingSpec(seq_len=1024), nodes)
    assert space.total == len(space) + sum(space.reasons.values())
    keys = np.stack([space.fields[k] for k in CANDIDATE_FIELDS], axis=1)
    assert len(np.unique(keys, axis=0)) == len(space)     # no duplicates among the valid ones


def _brute_force_valid(model, training, nodes: int, dpn: int) -> set[tuple]:
    """The same space by a Python loop per candidate, validated by plans.check_plan one plan at a time."""
    out = set()
    world = nodes * dpn
    divs, mbs_values = divisors(world), (1, 2, 4, 8)
    ep_values = sorted(set(divs) | set(divisors(model.moe.num_experts)))
    for pp, tp, ep, etp, mbs in itertools.product(divs, divs, ep_values, divisors(dpn), mbs_values):
        if world % (pp * tp) or (world // (pp * tp) * tp) % (ep * etp) or \
                training.global_batch % (world // (pp * tp) * mbs):
            continue                                  # a ParallelPlan of these cannot even be built
        dp = world // (pp * tp)
        for sched, rec, zero, a2a in itertools.product(SCHEDULES, RECOMPUTE, BRUTE_ZERO, A2A_NAMES):
            vs = 2 if sched == "interleaved" else 1
            m = training.global_batch // (dp * mbs)
            plan = ParallelPlan(dp=dp, tp=tp, pp=pp, ep=ep, etp=etp, mbs=mbs, num_microbatches=m, schedule=sched,
                                virtual_stages=vs, recompute=rec, zero=zero, a2a=a2a)
            try:
                check_plan(model, FRONTIER, training, nodes, plan)
            except PiperError:
                continue
            if (pp == 1 and sched == "gpipe") or (ep == 1 and a2a == "halo") or (dp == 1 and plan.edp == 1 and zero) \
                    or (m == 1 and sched == "gpipe"):
                continue   # duplicates of a kept candidate
            if (ep > 1 and dpn % (ep * etp) == 0 and a2a == "halo") or (rec == "selective" and training.flash_attention):
                continue   # HALO inside one node is flat; selective recompute under flash attention is none
            out.add(tuple(PlanBatch.of(plan).describe(0)[k] for k in ("dp", "tp", "pp", "ep", "etp", "mbs",
                                                                          "num_microbatches", "schedule",
                                                                          "virtual_stages", "recompute", "zero",
                                                                          "a2a")))
    return out


def test_vectorised_equals_brute_force_with_check_plan():
    model, training = load_model("tiny-moe"), TrainingSpec(global_batch=16, seq_len=512)
    space = enumerate_space(model, FRONTIER, training, 1, SearchOptions(expert_tp=True, zero=BRUTE_ZERO))
    keys = ("dp", "tp", "pp", "ep", "etp", "mbs", "num_microbatches", "schedule", "virtual_stages", "recompute",
            "zero", "a2a")
    got = {tuple(describe(space.fields, i)[k] for k in keys) for i in range(len(space))}
    assert got == _brute_force_valid(model, training, 1, 8)
    assert len(got) > 100


def test_default_space_keeps_experts_whole():
    """etp > 1 only on request (--expert-tp): the runtime never tensor-splits experts (benchmarks/etp_value.py)."""
    model, training = load_model("mixtral-8x7b"), TrainingSpec()
    assert set(enumerate_space(model, FRONTIER, training, 8).fields["etp"]) == {1}
    assert set(enumerate_space(model, FRONTIER, training, 8, SearchOptions(expert_tp=True)).fields["etp"]) > {1}


def test_candidates_describe_as_valid_plans():
    model, training = load_model("mixtral-8x7b"), TrainingSpec()
    space = enumerate_space(model, FRONTIER, training, 8)
    for i in range(0, len(space), max(1, len(space) // 200)):
        d = describe(space.fields, i)
        check_plan(model, FRONTIER, training, 8, ParallelPlan(**{k: d[k] for k in CANDIDATE_FIELDS}))


def test_piper_strategy_weak_scaling_1024_gcds_structurally_admits_only_pp32_ep32():
    # Paper: PP x EP = 1024, EP | 256 experts, PP <= 32 layers, EP <= g N_h = 8 x 4 = 32 -> only PP = EP = 32.
    space = enumerate_space(load_model("piper-weak-1.7t"), FRONTIER, TrainingSpec(), 128, SearchOptions(strategy="piper"))
    assert len(space) > 0
    assert set(space.fields["pp"].tolist()) == {32}
    assert set(space.fields["ep"].tolist()) == {32}
    assert np.all(space.fields["tp"] == 1) and np.all(space.fields["dp"] == space.fields["ep"])


def test_piper_strategy_rules_at_64_gcds():
    space = enumerate_space(load_model("piper-weak-110b"), FRONTIER, TrainingSpec(), 8, SearchOptions(strategy="piper"))
    f = space.fields
    assert np.all(f["pp"] * f["ep"] == 64) and np.all(f["ep"] <= 32) and np.all(16 % f["ep"] == 0)
    assert set(f["pp"].tolist()) == {4, 8, 16, 32}   # ep in {16, 8, 4, 2} (16 experts), pp <= 32 layers


def test_a2a_option_restricts_the_algorithm():
    model, training = load_model("mixtral-8x7b"), TrainingSpec()
    halo = enumerate_space(model, FRONTIER, training, 4, SearchOptions(a2a="halo"))
    assert set(halo.fields["a2a"].tolist()) == {A2A.HALO.code}
    flat = enumerate_space(model, FRONTIER, training, 4, SearchOptions(a2a="flat"))
    assert set(flat.fields["a2a"].tolist()) == {A2A.FLAT.code}


def test_batch_that_no_dp_divides_is_a_user_error():
    # tiny-moe on 8 nodes (64 devices): pp <= 4 layers and tp <= 2 KV heads, so dp >= 8; a batch of 4 fails all.
    with pytest.raises(PiperError, match="global_batch=4"):
        enumerate_space(load_model("tiny-moe"), FRONTIER, TrainingSpec(global_batch=4, seq_len=256), 8)


def test_dropped_twins_predict_the_same_as_the_kept_ones():
    """The duplicate rules drop only candidates the cost model prices exactly like their kept twin."""
    from piper_plan.cost.evaluate import evaluate

    model, training = load_model("mixtral-8x7b"), TrainingSpec()
    full = enumerate_space(model, FRONTIER, training, 2, SearchOptions(recompute=("selective",), a2a="halo"))
    kept = {k: v.copy() for k, v in full.fields.items()}
    kept["recompute"][:] = Recompute.NONE.code
    kept["a2a"][:] = np.where(FRONTIER.devices_per_node % (kept["ep"] * kept["etp"]) == 0, A2A.FLAT.code,
                              kept["a2a"])
    a = evaluate(model, FRONTIER, training, 2, full.batch())
    b = evaluate(model, FRONTIER, training, 2, PlanBatch.from_arrays(kept))
    np.testing.assert_allclose(a.step_time_s, b.step_time_s, rtol=1e-12)
    np.testing.assert_allclose(a.peak_memory_bytes, b.peak_memory_bytes, rtol=1e-12)


def test_one_microbatch_gpipe_is_priced_as_1f1b():
    """With one micro-batch the two schedules are the same run: the duplicate rule keeps 1F1B only."""
    from piper_plan.cost.evaluate import evaluate

    model, training = load_model("mixtral-8x7b"), TrainingSpec(global_batch=16)
    base = ParallelPlan(dp=16, tp=1, pp=2, ep=8, mbs=1, num_microbatches=1, zero=1)
    gpipe = evaluate(model, FRONTIER, training, 4, PlanBatch.of(base.model_copy(update={"schedule": "gpipe"})))
    ofob = evaluate(model, FRONTIER, training, 4, PlanBatch.of(base))
    np.testing.assert_allclose(gpipe.step_time_s, ofob.step_time_s, rtol=1e-12)
    np.testing.assert_allclose(gpipe.peak_memory_bytes, ofob.peak_memory_bytes, rtol=1e-12)


def test_selective_recompute_of_more_than_core_attn_is_searched():
    """Under flash attention selective recompute of core_attn alone re-runs nothing (dropped as none's twin); of
    other modules it drops their activations and adds time, so it is a plan of its own (before: always dropped)."""
    from piper_plan.specs.vocab import Recompute

    model, training = load_model("tiny-moe"), TrainingSpec(global_batch=8, seq_len=512)
    default = enumerate_space(model, FRONTIER, training, 1)
    modules = enumerate_space(model, FRONTIER, training, 1, recompute_modules=("core_attn", "moe_act"))
    selective = Recompute.SELECTIVE.code
    assert not (default.fields["recompute"] == selective).any() and default.reasons["duplicate_selective_flash"] > 0
    assert (modules.fields["recompute"] == selective).sum() == default.reasons["duplicate_selective_flash"]
    assert "duplicate_selective_flash" not in modules.reasons
    no_op = enumerate_space(model, FRONTIER, training, 1, recompute_modules=("core_attn", "mlp", "shared_experts"))
    assert no_op.reasons == default.reasons       # tiny-moe has no dense layer and no shared expert: still twins
