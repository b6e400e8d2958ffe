"""Group-limited routing (DeepSeek-V2 / V3: MoESpec.routing_groups, routing_group_top_k, routing_group_score_top;
runtime/moe.py group_limited_scores): a token's experts come from its best groups only, a group ranked by the sum
of its best scores (1: V2's max, 2: V3's top-2 sum), the weights are the picked experts' own scores; a model with
groups trains and its dp 2 ep 2 run equals the single-process reference."""

from __future__ import annotations

import pytest
import torch

from piper_plan.catalog import load_model
from piper_plan.runtime.model import shrink_spec
from piper_plan.runtime.moe import group_limited_scores
from piper_plan.specs import ModelSpec
from plans import plan_dict


def grouped(name: str = "tiny-moe", groups: int = 4, chosen: int = 2, score_top: int = 2) -> ModelSpec:
    data = load_model(name).model_dump()
    data["moe"].update(routing_groups=groups, routing_group_top_k=chosen, routing_group_score_top=score_top)
    return ModelSpec.model_validate(data)


def brute_force_experts(probs: torch.Tensor, moe) -> list[set[int]]:
    """Per token: the top_k experts of the best routing_group_top_k groups, by plain Python loops."""
    size = moe.num_experts // moe.routing_groups
    out = []
    for row in probs.tolist():
        groups = [row[g * size:(g + 1) * size] for g in range(moe.routing_groups)]
        score = [sum(sorted(g, reverse=True)[:moe.routing_group_score_top]) for g in groups]
        best = sorted(range(moe.routing_groups), key=lambda g: -score[g])[:moe.routing_group_top_k]
        allowed = [e for g in best for e in range(g * size, (g + 1) * size)]
        out.append(set(sorted(allowed, key=lambda e: -row[e])[:moe.top_k]))
    return out


@pytest.mark.parametrize("score_top", [1, 2])
def test_group_limited_picks_equal_brute_force(score_top):
    moe = grouped(score_top=score_top).moe
    torch.manual_seed(0)
    probs = torch.rand(64, moe.num_experts)
    picked = group_limited_scores(probs, moe).topk(moe.top_k, dim=-1).indices
    assert [set(r) for r in picked.tolist()] == brute_force_experts(probs, moe)


def test_the_two_group_scores_differ_where_the_max_and_the_top_two_disagree():
    # group 0 = experts {0, 1}: one high score (0.9, 0.0); group 1 = {2, 3}: two good ones (0.6, 0.6)
    probs = torch.tensor([[0.9, 0.0, 0.6, 0.6, 0.1, 0.1, 0.1, 0.1]])
    v2, v3 = grouped(chosen=1, score_top=1).moe, grouped(chosen=1, score_top=2).moe
    assert set(group_limited_scores(probs, v2).topk(2).indices[0].tolist()) == {0, 1}    # max: group 0 (0.9)
    assert set(group_limited_scores(probs, v3).topk(2).indices[0].tolist()) == {2, 3}    # top-2 sum: 1.2 > 0.9


def test_the_router_keeps_each_token_in_its_groups_and_weights_by_its_own_scores():
    from piper_plan.runtime.moe import MoE

    spec = grouped()
    torch.manual_seed(1)
    block = MoE(spec.hidden_size, spec.moe)
    x = torch.randn(32, spec.hidden_size)
    weights, idx, probs = block._route(x)
    size = spec.moe.num_experts // spec.moe.routing_groups
    assert all(len({e // size for e in row}) <= spec.moe.routing_group_top_k for row in idx.tolist())
    expected = probs.gather(-1, idx)
    if spec.moe.normalize_top_k:
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, expected.to(weights.dtype))
    ungrouped = probs.topk(spec.moe.top_k, dim=-1).indices
    assert any(set(a) != set(b) for a, b in zip(idx.tolist(), ungrouped.tolist()))   # the limit changes picks


def test_deepseek_v3_keeps_its_groups_where_the_shrunk_experts_allow_them():
    full = load_model("deepseek-v3").moe
    assert (full.routing_groups, full.routing_group_top_k, full.routing_group_score_top) == (8, 4, 2)
    assert shrink_spec(load_model("deepseek-v3")).moe.routing_groups is None          # 8 experts, top 8: no room
    kept = shrink_spec(load_model("deepseek-v3"), num_experts=32).moe
    assert (kept.routing_groups, kept.routing_group_top_k, kept.routing_group_score_top) == (8, 4, 2)


@pytest.mark.distributed
def test_group_routed_run_equals_the_reference(tmp_path):
    from test_mtp import _compare
    from workers import spawn

    plan = plan_dict(pp=1, dp=2, ep=2, num_microbatches=2, model_dict=grouped().model_dump(mode="json"))
    _compare(plan, [r["run"] for r in spawn(2, [("run", "train", {"plan": plan, "steps": 2, "aux": 0.01})],
                                            tmp_path)])


def test_a_group_score_over_more_experts_than_a_group_holds_is_refused():
    data = grouped().model_dump()
    data["moe"].update(routing_group_score_top=3)      # 4 groups of 2 experts: at most 2 scores per group
    with pytest.raises(ValueError, match="routing_group_score_top=3 exceeds the 2 experts"):
        ModelSpec.model_validate(data)
