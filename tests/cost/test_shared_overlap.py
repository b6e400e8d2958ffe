"""The runtime's shared-expert overlap priced (CostOptions.shared_expert_overlap, cost/terms.py): the dispatch
exchange is exposed only where it outlasts the shared experts of each pass; combine, HALO and models without
shared experts are priced as before."""

from __future__ import annotations

import pytest

from piper_plan.catalog import load_model, load_platform
from piper_plan.cost.evaluate import estimate
from piper_plan.cost.options import PIPER_RUNTIME_OPTIONS, CostOptions
from piper_plan.planfile import RuntimeBlock
from piper_plan.specs import ParallelPlan, TrainingSpec

def _without_host_floor(platform):
    """The platform with no host time priced: these tests compare device terms only (cost/overhead.py's host
    floor would absorb what the overlap saves on a host-bound layer)."""
    data = platform.model_dump(mode="json")
    data["efficiency"]["host_s_per_gemm_call"] = 0.0
    return type(platform).model_validate(data)


H100 = _without_host_floor(load_platform("dgx-h100"))
TRAINING = TrainingSpec(seq_len=4096, global_batch=512)


def _breakdowns(model, plan):
    nodes = plan.world // 8
    return [estimate(load_model(model), H100, TRAINING, nodes, plan, options=CostOptions(shared_expert_overlap=on))
            .time.breakdown for on in (False, True)]


def _dispatch(b):
    return sum(v for k, v in b.items() if k.startswith("moe/dispatch/"))


@pytest.mark.parametrize("plan", [ParallelPlan(dp=64, ep=64, zero=1, num_microbatches=8),    # inter-node
                                  ParallelPlan(dp=8, ep=8, zero=1, num_microbatches=64)])    # inside a node
def test_dispatch_longer_than_the_shared_experts_hides_all_of_them(plan):
    off, on = _breakdowns("deepseek-v3", plan)
    assert _dispatch(on) == pytest.approx(_dispatch(off) - off["compute/shared_experts"], rel=1e-9)
    assert {k: v for k, v in on.items() if not k.startswith("moe/dispatch/")} == \
        {k: v for k, v in off.items() if not k.startswith("moe/dispatch/")}


def test_shared_experts_longer_than_the_dispatch_hide_it_whole():
    # Llama 4 Scout inside one node (ep 2): one 8192-wide shared expert per token against a 2-way exchange
    plan = ParallelPlan(dp=8, ep=2, zero=1, num_microbatches=64)
    off, on = _breakdowns("llama4-scout", plan)
    assert 0 < _dispatch(off) < off["compute/shared_experts"], off
    assert _dispatch(on) == 0.0


@pytest.mark.parametrize("model, plan", [("deepseek-v3", ParallelPlan(dp=64, ep=64, zero=1, num_microbatches=8,
                                                                         a2a="halo")),
                                         ("mixtral-8x7b", ParallelPlan(dp=8, ep=8, zero=1, num_microbatches=64))])
def test_halo_and_models_without_shared_experts_unchanged(model, plan):
    off, on = _breakdowns(model, plan)
    assert on == off


def test_the_runtime_default_is_the_planners_runtime_option():
    assert RuntimeBlock().shared_expert_overlap is PIPER_RUNTIME_OPTIONS.shared_expert_overlap is True
    assert CostOptions().shared_expert_overlap is False  # Megatron-Core's default (moe_shared_expert_overlap)
