"""One validity check: the search's valid set and reason counts are ``plans.problems`` over the enumerated space;
every command that takes a plan refuses exactly the plans ``problems`` rejects."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from piper_plan.catalog import load_model, load_platform
from piper_plan.cli.main import cli
from piper_plan.errors import PiperError
from piper_plan.planfile import parse_plan_dict, plan_file_dict
from piper_plan.plans import INVALID_REASONS, RULES, PlanBatch, plan_problems, problem_masks, problems
from piper_plan.search.space import (DUPLICATE_REASONS, STRATEGY_REASONS, SearchOptions, enumerate_space, expand,
                                     search_masks, structural_grid)
from piper_plan.specs import ParallelPlan, TrainingSpec

FRONTIER, LOCAL = load_platform("frontier"), load_platform("local-cpu")


def _whole_space(model, platform, training, nodes, options) -> PlanBatch:
    """Every candidate the search enumerates, none filtered: the structural grid times the other axes."""
    grid = structural_grid(model, platform, training, nodes * platform.devices_per_node, options)
    return expand(grid, training, options)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["tiny-moe", "tiny-dense", "mixtral-8x7b", "deepseek-v3"]),
       nodes=st.sampled_from([1, 2, 3, 4, 6, 8]), batch=st.sampled_from([8, 12, 16, 48, 64]),
       strategy=st.sampled_from(["general", "piper"]), vs=st.sampled_from([(2,), (3,), (2, 3, 4), None]))
def test_search_valid_set_and_counts_are_problems_over_the_space(name, nodes, batch, strategy, vs):
    model = load_model(name)
    training = TrainingSpec(seq_len=min(1024, model.max_seq_len or 1024), global_batch=batch)
    options = SearchOptions(strategy=strategy, virtual_stages=vs)
    try:
        space = enumerate_space(model, FRONTIER, training, nodes, options)
    except PiperError:
        return                                   # no dp divides the batch: a user error, not a space
    every = _whole_space(model, FRONTIER, training, nodes, options)
    assert space.total == len(every)
    reasons = problems(model, FRONTIER, training, nodes, every)
    tally = {r: reasons.count(r) for r in INVALID_REASONS if reasons.count(r)}
    assert {k: v for k, v in space.reasons.items() if k in INVALID_REASONS} == tally
    valid = np.array([r is None for r in reasons])
    dropped = search_masks(model, FRONTIER, training, every, options).any(axis=0)
    names = list(every.arrays())
    expected = {tuple(every.arrays()[k][i] for k in names) for i in np.flatnonzero(valid & ~dropped)}
    got = {tuple(space.fields[k][i] for k in names) for i in range(len(space))}
    assert got == expected
    others = sum(v for k, v in space.reasons.items() if k in STRATEGY_REASONS + DUPLICATE_REASONS)
    assert others == int(np.count_nonzero(valid & dropped))


def test_every_rule_can_fire_and_names_its_values():
    """Each rule has a plan that breaks it alone (or first), and its message names the values involved."""
    model, training = load_model("tiny-moe"), TrainingSpec(seq_len=512, global_batch=8)
    fired = set()
    cases = [ParallelPlan(dp=8, num_microbatches=1, tp=3), ParallelPlan(dp=1, tp=2, etp=4, pp=4),
             ParallelPlan(dp=4, pp=2, num_microbatches=2, schedule="interleaved", virtual_stages=4),
             ParallelPlan(dp=8, ep=3, num_microbatches=1), ParallelPlan(dp=8, num_microbatches=5),
             ParallelPlan(dp=8, pp=1, num_microbatches=1, virtual_stages=2),
             ParallelPlan(dp=8, num_microbatches=1, schedule="interleaved"),
             ParallelPlan(dp=2, pp=4, num_microbatches=4, layers_per_stage=[1, 1, 1, 2]),
             ParallelPlan(dp=1, pp=8, num_microbatches=8), ParallelPlan(dp=4, tp=2, ep=8, num_microbatches=2),
             ParallelPlan(dp=8, mbs=3), ParallelPlan(dp=2, pp=2, tp=2, etp=2, num_microbatches=4),
             ParallelPlan(dp=4, cp=3, num_microbatches=2),
             ParallelPlan(dp=8, num_microbatches=1, zero=3, dp_replicate=3),
             ParallelPlan(dp=8, num_microbatches=1, zero=1, dp_replicate=2),
             ParallelPlan(tp=16, num_microbatches=8),
             ParallelPlan(dp=4, pp=2, num_microbatches=3, schedule="interleaved", virtual_stages=2),
             ParallelPlan(dp=4, pp=2, num_microbatches=2, schedule="interleaved", virtual_stages=2,
                          virtual_stage_layers=[1, 1, 1, 0]),
             ParallelPlan(dp=4, tp=2, ep=2, num_microbatches=2, sequence_parallel=False)]
    for plan in cases:
        for line in plan_problems(model, FRONTIER, training, 1, plan):
            fired.add(line.split(":")[0])
            assert "=" in line
    fired |= {line.split(":")[0] for line in plan_problems(model, FRONTIER, TrainingSpec(seq_len=4096), 99999,
                                                           ParallelPlan())}
    dense = load_model("tiny-dense")
    fired |= {line.split(":")[0] for line in plan_problems(dense, FRONTIER, training, 1,
                                                           ParallelPlan(dp=8, ep=2, num_microbatches=1))}
    big = FRONTIER.model_copy(update={"node": FRONTIER.node.model_copy(update={"devices_per_node": 1024,
                                                                             "device_nic": None})})
    fired |= {line.split(":")[0] for line in plan_problems(model, big, training, 2048, ParallelPlan())}
    deep = model.model_copy(update={"num_layers": 1100})
    fired |= {line.split(":")[0] for line in plan_problems(deep, FRONTIER, training, 1, ParallelPlan(
        dp=4, pp=2, num_microbatches=1, layers_split="balanced"))}
    assert fired >= set(INVALID_REASONS) - {"etp_not_divisor_ffn"}


def test_interleaved_deepseek_v3_is_invalid_everywhere():
    """61 layers: no pp x v > 1 divides them (the #9 plan `plan` used to rank and `estimate` refused)."""
    model, training = load_model("deepseek-v3"), TrainingSpec()
    plan = ParallelPlan(dp=64, pp=8, ep=64, num_microbatches=16, schedule="interleaved", virtual_stages=2)
    assert problems(model, FRONTIER, training, 64, PlanBatch.of(plan)) == ["interleaved_layers_not_divisible"]
    space = enumerate_space(model, FRONTIER, training, 256)
    assert not np.any(space.fields["schedule"] == 2)


def _plan_json(tmp_path, plan: ParallelPlan, nodes: int, training) -> str:
    """plan.json of ``plan`` written without the writer's own check (as a user or another tool might)."""
    data = plan_file_dict(load_model("tiny-moe"), LOCAL, training, nodes, plan, "compact", None)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return str(path)


runtime_plans = st.builds(
    lambda dp, pp, ep, mbs, m, sched, v, rec, zero, a2a: ParallelPlan(
        dp=dp, pp=pp, ep=ep, mbs=mbs, num_microbatches=m, schedule=sched, virtual_stages=v, recompute=rec,
        zero=zero, a2a=a2a),
    dp=st.sampled_from([1, 2, 3, 4]), pp=st.sampled_from([1, 2, 3, 4, 5]), ep=st.sampled_from([1, 2, 3, 4]),
    mbs=st.sampled_from([1, 2]), m=st.sampled_from([1, 2, 3, 4]),
    sched=st.sampled_from(["gpipe", "1f1b", "interleaved"]), v=st.sampled_from([1, 2]),
    rec=st.sampled_from(["none", "full"]), zero=st.sampled_from([0, 1]), a2a=st.sampled_from(["flat", "halo"]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=runtime_plans, nodes=st.sampled_from([1, 2]))
def test_launch_refuses_exactly_the_invalid_plans(tmp_path, plan, nodes):
    """Within the runtime's capability list, `launch --plan` exits 2 iff ``problems`` rejects the plan."""
    training = TrainingSpec.for_device("cpu", seq_len=64, global_batch=8)
    found = plan_problems(load_model("tiny-moe"), LOCAL, training, nodes, plan)
    path = _plan_json(tmp_path, plan, nodes, training)
    result = CliRunner().invoke(cli, ["launch", "--plan", path, "--out", str(tmp_path / "job"), "--dry-run"])
    assert result.exit_code == (2 if found else 0), result.output
    if found:
        assert found[0].split(":")[0] in result.output
        with pytest.raises(PiperError):
            parse_plan_dict(json.loads(open(path).read()), path)


def test_rules_are_the_only_validity_source():
    """The structural / schedule split the search uses covers every rule exactly once."""
    from piper_plan.search.space import SCHEDULE_RULES, STRUCTURAL_RULES

    assert tuple(r.name for r in STRUCTURAL_RULES + SCHEDULE_RULES) == INVALID_REASONS
    assert len(RULES) == len(INVALID_REASONS) == len(set(INVALID_REASONS))
    one = PlanBatch.of(ParallelPlan())
    assert problem_masks(load_model("tiny-moe"), FRONTIER, TrainingSpec(seq_len=512), 1, one).shape == \
        (len(RULES), 1)
