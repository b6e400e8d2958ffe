"""The rank order of DESIGN.md: rank = (pp_index x dp + dp_index) x tp + tp_index; expert groups are ep consecutive
ranks of a stage's dp x tp block (pure, no process group)."""

from piper_plan.runtime.mesh import coords, expert_groups


def test_rank_order_tp_fastest_then_dp_then_pp():
    pp, dp, tp, ep = 2, 2, 2, 2
    seen = {}
    for rank in range(pp * dp * tp):
        c = coords(rank, pp, dp, ep, tp)
        assert rank == (c.pp_index * dp + c.dp_index) * tp + c.tp_index
        seen[(c.pp_index, c.ep_group_index, c.ep_rank)] = rank
    assert len(seen) == 8  # every (stage, expert group, position) once


def test_expert_groups_regroup_each_stage_block():
    assert expert_groups(2, 2, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert expert_groups(1, 4, 4) == [[0, 1, 2, 3]]
    for group in expert_groups(2, 4, 2, 2):
        stage = {r // 8 for r in group}
        assert len(stage) == 1  # an expert group never crosses a stage
    c = coords(5, 1, 4, 4, 2)  # block index 5: expert group 1, position 1; dp 2, tp 1
    assert (c.ep_group_index, c.ep_rank, c.dp_index, c.tp_index) == (1, 1, 2, 1)
