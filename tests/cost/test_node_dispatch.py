"""Per-node expert dispatch (CostOptions.ep_dispatch "per_node", DeepEP / HybridEP): the network carries one copy of
a token per destination node, and group-limited routing (DeepSeek-V3: 4 of 8 groups) caps the nodes it reaches."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from piper_plan.catalog import load_model, load_platform
from piper_plan.cost.evaluate import estimate
from piper_plan.cost.options import CostOptions
from piper_plan.cost.terms import node_copy_fraction
from piper_plan.errors import PiperError
from piper_plan.hf_import import import_hf_file
from piper_plan.specs import ParallelPlan, TrainingSpec
from piper_plan.specs.model import MoESpec

FIXTURES = Path(__file__).parents[1] / "specs" / "fixtures"


def test_deepseek_v3_on_eight_nodes_reaches_its_four_groups_nodes():
    """EP64 over 8 nodes: one routing group per node, a token's 8 experts on its 4 chosen groups' nodes: 4 / 8."""
    moe = load_model("deepseek-v3").moe
    assert (moe.routing_groups, moe.routing_group_top_k) == (8, 4)
    assert float(node_copy_fraction(moe, 8)) == pytest.approx(0.5)


def test_without_groups_the_fraction_is_the_expected_distinct_nodes_of_k_draws():
    moe = load_model("qwen3-235b-a22b").moe                        # 128 experts, top 8, no group limit
    miss = math.comb(128 - 32, 8) / math.comb(128, 8)               # one of 4 nodes holds none of the 8
    assert float(node_copy_fraction(moe, 4)) == pytest.approx(4 * (1 - miss) / 8)
    assert float(node_copy_fraction(moe, 1)) == 1.0


def test_per_node_dispatch_shrinks_only_the_inter_node_exchange():
    model, platform = load_model("deepseek-v3"), load_platform("dgx-h100")
    plan = ParallelPlan(dp=64, ep=64, pp=1, zero=1, num_microbatches=4)
    training = TrainingSpec(seq_len=4096, global_batch=256)
    per_expert, per_node = (estimate(model, platform, training, 8, plan, options=CostOptions(ep_dispatch=d))
                            .time.breakdown for d in ("per_expert", "per_node"))
    for part in ("dispatch", "combine"):
        key = f"moe/{part}/inter_node"
        assert per_node[key] == pytest.approx(0.5 * per_expert[key], rel=1e-9)
        assert per_node.get(f"moe/{part}/intra_node", 0) == pytest.approx(per_expert.get(f"moe/{part}/intra_node", 0))


def test_hf_import_reads_group_limited_routing():
    moe = import_hf_file(FIXTURES / "deepseek-v3.json").moe
    assert (moe.routing_groups, moe.routing_group_top_k, moe.routing_group_score_top) == (8, 4, 2)   # noaux_tc
    v2 = import_hf_file(FIXTURES / "deepseek-v2.json").moe
    assert (v2.routing_groups, v2.routing_group_top_k, v2.routing_group_score_top) == (8, 3, 1)   # the max
    assert import_hf_file(FIXTURES / "kimi-k2.json").moe.routing_groups is None         # n_group 1: no limit


@pytest.mark.parametrize("fields", [{"routing_groups": 8}, {"routing_groups": 7, "routing_group_top_k": 4},
                                    {"routing_groups": 8, "routing_group_top_k": 9}])
def test_inconsistent_routing_groups_are_refused(fields):
    base = load_model("deepseek-v3").moe.model_dump()
    base.update({"routing_groups": None, "routing_group_top_k": None, **fields})
    with pytest.raises(ValueError, match="routing_group"):
        MoESpec.model_validate(base)


def test_an_unknown_dispatch_is_one_clear_error():
    with pytest.raises(PiperError, match="ep_dispatch"):
        CostOptions(ep_dispatch="per_rack")


def test_fraction_is_vectorised_over_candidates():
    out = node_copy_fraction(load_model("deepseek-v3").moe, np.array([1, 2, 8]))
    assert out.shape == (3,) and out[0] == 1.0 and 0 < out[1] < out[2] <= 1
