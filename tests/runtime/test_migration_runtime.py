"""Live expert migration on gloo ranks (issue 8, runtime): the function is preserved exactly, a run that
migrates every step matches one that never does (so weights, gradients and Adam state moved with their
experts), and a skewed router's imbalance falls after migration with expert replicas kept identical.
One spawn of 4 ranks runs every job (each torch import costs seconds on 2 cores)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from migration_worker import spawn
from piper_plan.catalog import load_model
from piper_plan.planfile import MigrationBlock
from piper_plan.runtime.migration import apply_swaps, rank_transfers, slot_moves
from piper_plan.placement.migration import Swap
from plans import plan_dict

STEPS = 4
SKEW_STEPS, SKEW_INTERVAL = 6, 3
# Biased gate: experts 0-3 (EP rank 0 at the start) get +2 ... +0.5 on their logits.
ROUTER_BIAS = [2.0, 1.5, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0]


def _biased_model() -> dict:
    spec = load_model("tiny-moe").model_dump(mode="json")
    spec["moe"]["router_bias"] = True
    return spec


PLANS = {"pp2_dp2_ep2": plan_dict(pp=2, dp=2, ep=2, schedule="1f1b", num_microbatches=2, model_dict=_biased_model()),
         "pp1_dp4_ep2_zero1": plan_dict(pp=1, dp=4, ep=2, num_microbatches=2, zero=1, model_dict=_biased_model())}
MIGRATING_PLAN = {**plan_dict(pp=2, dp=2, ep=2, schedule="gpipe", num_microbatches=2, checkpoint_interval=100),
                  "migration": {"enabled": True, "threshold": 1.0, "interval": 2, "max_iters": 4}}
HALO_PLAN = plan_dict(pp=1, dp=4, ep=4, num_microbatches=1, model_dict=_biased_model())
HALO_PLAN["parallel"]["a2a"] = "halo"  # on PIPER_EMULATE_TOPOLOGY=2x2 (set by the worker): 2 nodes x 2 ranks
INTERLEAVED_PLAN = plan_dict(pp=2, dp=2, ep=2, schedule="interleaved", num_microbatches=2, model_dict=_biased_model())
INTERLEAVED_PLAN["parallel"]["virtual_stages"] = 2  # each rank: two 1-layer chunks, migrated together
TP_ZERO1_PLAN = plan_dict(pp=1, dp=2, ep=2, tp=2, num_microbatches=2, zero=1, model_dict=_biased_model())
PAIRS = {"every_step_pp2_dp2_ep2": ("pp2_True", "pp2_False"), "skewed_pp1_dp4_ep2_zero1": ("skew", "skew_static"),
         "every_step_halo_pp1_dp4_ep4": ("halo_True", "halo_False"),
         "every_step_interleaved_pp2_v2": ("interleaved_True", "interleaved_False"),
         "every_step_tp2_dp2_ep2_zero1": ("tp_zero1_True", "tp_zero1_False")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("migration")
    (tmp / "plan.json").write_text(json.dumps(MIGRATING_PLAN))
    skew = MigrationBlock(threshold=1.1, interval=SKEW_INTERVAL, max_iters=16)
    jobs = [("function", "function", {"plan": PLANS["pp2_dp2_ep2"]})]
    for migrate in (True, False):
        jobs.append((f"pp2_{migrate}", "train", {"plan": PLANS["pp2_dp2_ep2"], "steps": STEPS, "migrate": migrate,
                                                 "router_bias": ROUTER_BIAS}))
    for migrate in (True, False):
        jobs.append((f"interleaved_{migrate}", "train", {"plan": INTERLEAVED_PLAN, "steps": 3, "migrate": migrate,
                                                         "router_bias": ROUTER_BIAS}))
    for migrate in (True, False):
        jobs.append((f"halo_{migrate}", "train", {"plan": HALO_PLAN, "steps": 3, "migrate": migrate,
                                                  "router_bias": ROUTER_BIAS}))
    for migrate in (True, False):  # zero 1 over tp-split dense weights: experts (etp = 1) and their Adam state move
        jobs.append((f"tp_zero1_{migrate}", "train", {"plan": TP_ZERO1_PLAN, "steps": 3, "migrate": migrate,
                                                      "router_bias": ROUTER_BIAS}))
    for name, migrate in (("skew", True), ("skew_static", False)):
        jobs.append((name, "train", {"plan": PLANS["pp1_dp4_ep2_zero1"], "steps": SKEW_STEPS, "migrate": migrate,
                                     "router_bias": ROUTER_BIAS, "settings": skew}))
    jobs.append(("resume", "resume", {"plan": MIGRATING_PLAN, "run_dir": str(tmp / "resume")}))
    jobs.append(("cli", "cli", {"plan_path": str(tmp / "plan.json"), "run_dir": str(tmp / "run"), "steps": 4}))
    results = spawn(4, jobs, tmp)
    for r in results:
        r["run_dir"] = tmp / "run"
    return results


# ---- pure parts --------------------------------------------------------------------------------------
def test_slot_moves_chain_and_transfers():
    # E = 4, G = 2, El = 2: swap 0<->3 then 0<->1 -> expert 0: slot 0 -> 1 (local on rank 0),
    # expert 3: slot 3 -> 0 (rank 1 -> 0), expert 1: slot 1 -> 3 (rank 0 -> 1).
    before = np.arange(4)[None, :]
    after = apply_swaps(before, [Swap(0, 0, 0, 3, 1), Swap(0, 0, 1, 1, 0)])
    assert after.tolist() == [[1, 3, 2, 0]]
    moves = slot_moves(before, after)
    assert [(m.src_slot, m.dst_slot) for m in moves] == [(3, 0), (0, 1), (1, 3)]
    sends, recvs, local = rank_transfers(moves, 2, 0)
    assert [(m.src_slot, m.dst_slot) for m in sends[1]] == [(1, 3)]
    assert [(m.src_slot, m.dst_slot) for m in recvs[1]] == [(3, 0)]
    assert [(m.src_slot, m.dst_slot) for m in local] == [(0, 1)]
    assert sorted(after[0].tolist()) == [0, 1, 2, 3]  # still a permutation


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.sampled_from([(4, 2), (8, 2), (8, 4), (6, 3)]), st.data())
def test_transfers_realise_any_swap_sequence(num_layers, shape, data):
    """Property: for any swap sequence, simulating every rank's sends, receives and local copies on slot
    contents turns the old layout into the new one, and each rank's sends to p are p's receives from it."""
    num_experts, ep = shape
    n = num_experts // ep
    pair = st.tuples(st.integers(0, num_layers - 1), st.integers(0, num_experts - 1), st.integers(0, num_experts - 1))
    swaps = [Swap(layer, a, 0, b, 0) for layer, a, b in data.draw(st.lists(pair, max_size=12)) if a != b]
    before = np.tile(np.arange(num_experts), (num_layers, 1))
    before = np.stack([np.random.default_rng(i).permutation(row) for i, row in enumerate(before)])
    after = apply_swaps(before, swaps)
    assert all(sorted(row) == list(range(num_experts)) for row in after)
    content = np.empty_like(before)  # content[row, slot] = logical expert living there
    np.put_along_axis(content, before, np.arange(num_experts)[None, :].repeat(num_layers, 0), axis=1)
    moved = content.copy()
    moves = slot_moves(before, after)
    for me in range(ep):
        sends, recvs, local = rank_transfers(moves, n, me)
        for peer, ms in recvs.items():
            assert ms == rank_transfers(moves, n, peer)[0][me]
        for m in [*local, *(m for ms in recvs.values() for m in ms)]:
            assert m.dst_slot // n == me
            moved[m.row, m.dst_slot] = content[m.row, m.src_slot]
    want = np.empty_like(after)
    np.put_along_axis(want, after, np.arange(num_experts)[None, :].repeat(num_layers, 0), axis=1)
    assert np.array_equal(moved, want)


# ---- multi-process -------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_function_preserved_exactly(results):
    per_rank = [r["function"] for r in results]
    for r in per_rank:
        assert torch.equal(r["before"], r["after"])  # same inputs -> bit-identical outputs
        assert not np.array_equal(r["slots_before"], r["slots_after"])
    for stage in (0, 1):
        ranks = [r for r in per_rank if r["stage"] == stage]
        before = {k: v for r in ranks for k, v in r["experts_before"].items()}
        after = {k: v for r in ranks for k, v in r["experts_after"].items()}
        assert set(before) == set(after) and len(before) == 2 * 8  # 2 MoE layers x 8 experts per stage
        for key, tensors in before.items():
            assert tensors.keys() == after[key].keys() and any(".exp_avg" in n for n in tensors)
            for name, value in tensors.items():
                assert torch.equal(value, after[key][name]), (key, name)
        # the expert moved: the rank holding it changed for some logical experts
        holders_before = {k: i for i, r in enumerate(ranks) for k in r["experts_before"]}
        holders_after = {k: i for i, r in enumerate(ranks) for k in r["experts_after"]}
        assert sum(holders_before[k] != holders_after[k] for k in before) == 2 * 2
    _check_bytes(per_rank)


def _check_bytes(per_rank) -> None:
    """Each rank sends one expert per layer, 2 MoE layers per stage: params, grads, exp_avg, exp_avg_sq of
    w_in, w_gate [64, 128] and w_out [128, 64] fp32 = 4 x 3 x 8192 x 4 B = 393,216 B per expert, plus the
    three Adam step counters (3 x 8 B) per layer packet."""
    per_expert = 4 * 3 * 64 * 128 * 4
    for r in per_rank:
        assert r["bytes_sent"] == 2 * (per_expert + 3 * 8)


@pytest.mark.distributed
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_migrating_run_matches_static_run(results, pair):
    moving, static = ([r[name] for r in results] for name in PAIRS[pair])
    swaps = sum(e["num_swaps"] for r in moving for e in r["events"] if e)
    assert swaps >= len(moving)  # migration really happened
    want = "HaloDispatcher" if "halo" in pair else "FlatDispatcher"
    assert {r["dispatcher"] for r in moving + static} == {want}
    for m, s in zip(moving, static):
        if m["losses"][0] is not None:
            # exact, not within a tolerance: every expert sees the same rows in the same order wherever it lives
            assert m["losses"] == s["losses"]
        assert m["expert_tokens"] == s["expert_tokens"]  # metrics' counts are by logical expert id
    merged_m, merged_s = _by_group(moving), _by_group(static)
    groups = len({r["ep_group"] for r in moving})  # EP groups per stage
    assert merged_m.keys() == merged_s.keys() and len(merged_m) == groups * 4 * 8  # x 4 MoE layers x 8 experts
    assert any(".exp_avg" in n for tensors in merged_m.values() for n in tensors)  # Adam state compared too
    for k, tensors in merged_m.items():
        assert tensors.keys() == merged_s[k].keys()
        for name, value in tensors.items():
            assert torch.equal(value, merged_s[k][name]), (k, name)


def _by_group(per_rank) -> dict:
    """{(EP group index, layer, logical expert): tensors}, whichever rank of the group holds the expert now."""
    out = {}
    for r in per_rank:
        for (layer, e), tensors in r["experts"].items():
            out[(r["ep_group"], layer, e)] = tensors
    return out


@pytest.mark.distributed
def test_skewed_router_imbalance_falls(results):
    per_rank = [r["skew"] for r in results]
    groups: dict[int, list[dict]] = {}
    for r in per_rank:
        groups.setdefault(r["ep_group"], []).append(r)
    for members in groups.values():
        members.sort(key=lambda r: r["ep_rank"])
        rows = np.array([r["rows"] for r in members], dtype=float)  # [G, steps]: rows each rank computed
        ratio = rows.max(0) / rows.mean(0)
        before, after = ratio[:SKEW_INTERVAL].mean(), ratio[SKEW_INTERVAL:].mean()
        print(f"max/mean rows per EP rank: before {before:.3f}, after {after:.3f}")
        assert before > 1.5 and after < 1.15
        event = members[0]["events"][SKEW_INTERVAL - 1]
        assert event["num_swaps"] >= 1 and event["max_over_mean_after"] < event["max_over_mean_before"]
    # replicas: the two EP groups applied the same swaps; expert replicas (same ep_rank) stay identical
    a, b = (sorted(g, key=lambda r: r["ep_rank"]) for g in groups.values())
    for ra, rb in zip(a, b):
        assert all(np.array_equal(x, y) for x, y in zip(ra["slots"], rb["slots"]))
        for name, w in ra["local_weights"].items():
            assert torch.equal(w, rb["local_weights"][name]), name


@pytest.mark.distributed
def test_runtime_migration_resumes_exactly(results):
    for r in (r["resume"] for r in results):
        assert r["events"][0] is None and r["events"][2] is None  # interval 2: boundaries after steps 2 and 4
        assert r["events"][1]["num_swaps"] + r["events"][3]["num_swaps"] >= 1
        assert r["resumed"] == r["full"]  # exact: placement, weights and Adam state restored
        assert np.array_equal(r["slots_full"], r["slots_resumed"])


@pytest.mark.distributed
def test_runtime_logs_migrations(results):
    """train.run (what torchrun / srun start) with plan.json's migration block: metrics.jsonl carries the
    events and their time; summary.json the totals."""
    assert all(r["cli"] == 0 for r in results)
    run_dir = results[0]["run_dir"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert all(sum(c) == 64 * 2 for c in r["expert_tokens"].values())  # by logical id, all tokens counted
        if r["step"] % 2:
            assert r["migrations"] == [] and r["time_s"]["migration"] == 0.0
            continue
        assert sorted(e["stage"] for e in r["migrations"]) == [0, 1] and r["time_s"]["migration"] > 0
        for e in r["migrations"]:
            assert e["seconds"] > 0 and e["layers"] == ([0, 1] if e["stage"] == 0 else [2, 3])
            assert (e["bytes_moved"] > 0) == (e["num_swaps"] > 0) and len(e["swaps"]) == e["num_swaps"]
            assert all(s["layer"] in e["layers"] for s in e["swaps"])
            # each expert that changes rank is sent once: 393,216 B (see _check_bytes) + 24 B of Adam step
            # counters per (sender, layer) packet: 2 senders x 2 layers at most
            assert 0 <= e["bytes_moved"] - e["experts_moved"] * 4 * 3 * 64 * 128 * 4 <= 2 * 2 * 24
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["migration"]["events"] == 4 and 0 < summary["migration"]["share"] < 1


@pytest.mark.parametrize("world,ep", [(4, 4), (4, 2), (2, 2)])
def test_the_migration_benchmarks_plan_is_one_the_runtime_reads(world, ep):
    """benchmarks/migration_runtime.py builds its plan.json by hand; every rank parses it first. Before: the
    plan said checkpoint_interval 0 and Frontier's 8 devices per node for 4 ranks, and every rank died on it, so
    docs/migration-runtime.md could not be made again."""
    import importlib.util

    from piper_plan.catalog import project_root
    from piper_plan.planfile import parse_plan_dict

    spec = importlib.util.spec_from_file_location("migration_runtime",
                                                  project_root() / "benchmarks" / "migration_runtime.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.parse_args(["--world", str(world), "--ep", str(ep)])
    cfg = parse_plan_dict(bench.plan_dict(args), "migration benchmark plan")
    assert cfg.parallel.dp == world and cfg.parallel.ep == ep and cfg.migration.enabled
