"""The runtime's capability list: what it refuses, what it now runs, and that the planner-side module imports
no torch."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

from piper_plan.capability import RUNTIME_CAPABILITY, unsupported_features
from piper_plan.catalog import load_model
from piper_plan.specs import ParallelPlan


def test_runnable_plan_has_no_problems():
    assert unsupported_features(ParallelPlan(pp=2, dp=4, ep=2, schedule="gpipe"), load_model("tiny-moe")) == []


def test_interleaved_recompute_and_mla_now_run():
    plan = ParallelPlan(pp=2, dp=4, ep=2, schedule="interleaved", virtual_stages=2, recompute="full")
    assert unsupported_features(plan, load_model("tiny-mla")) == []
    assert unsupported_features(plan.model_copy(update={"recompute": "selective"}), load_model("tiny-moe")) == []


def test_every_catalog_feature_model_is_runnable_at_pp1():
    """Every catalog model's features run, DeepSeek-V3 with its MTP module (runtime/model.py MTPModule) too, at
    pp 1 and with the module on the last of 8 stages under tp 2; gpt-oss with its sinks and sliding windows."""
    plan = ParallelPlan(pp=1, dp=8, ep=8)
    for name in ("arctic", "grok-1", "llama4-scout", "gpt-175b", "glam", "switch-base", "deepseek-v3",
                 "gpt-oss-120b"):
        assert unsupported_features(plan, load_model(name)) == [], name
    assert load_model("deepseek-v3").mtp_layers == 1
    assert unsupported_features(ParallelPlan(pp=8, dp=4, tp=2, ep=8), load_model("deepseek-v3")) == []


def test_mtp_with_a_tied_head_is_refused_under_tp_only():
    tied = load_model("tiny-moe").model_copy(update={"tie_embeddings": True, "mtp_layers": 1})
    assert unsupported_features(ParallelPlan(pp=1, dp=2, ep=2), tied) == []
    found = unsupported_features(ParallelPlan(pp=1, dp=1, tp=2, ep=2), tied)
    assert len(found) == 1 and found[0].startswith("mtp_layers=1 with tie_embeddings")


def test_tp_interleaved_recompute_mla_is_runnable_with_every_zero():
    plan = ParallelPlan(pp=2, dp=4, tp=2, ep=2, schedule="interleaved", virtual_stages=2, recompute="full",
                        num_microbatches=2, zero=1)
    for zero in (0, 1, 2, 3):
        assert unsupported_features(plan.model_copy(update={"zero": zero}), load_model("tiny-mla")) == [], zero


def test_runnable_is_valid_and_inside_the_capability_list():
    """An invalid plan is refused by the validity check first (4 layers cannot make 2 x 3 chunks), with the
    rule's name; a valid one by the capability list."""
    from piper_plan.capability import runnable_problems
    from piper_plan.catalog import load_platform
    from piper_plan.specs import TrainingSpec

    frontier, training = load_platform("frontier"), TrainingSpec(seq_len=64, global_batch=8)
    bad = ParallelPlan(pp=2, dp=4, ep=2, schedule="interleaved", virtual_stages=3, num_microbatches=2)
    found = runnable_problems(load_model("tiny-mla"), frontier, training, 1, bad)
    assert found and found[0].startswith("interleaved_layers_not_divisible") and "2 x 3" in found[0]
    ok = ParallelPlan(pp=2, dp=4, ep=2, num_microbatches=2)
    assert runnable_problems(load_model("tiny-mla"), frontier, training, 1, ok) == []
    assert set(RUNTIME_CAPABILITY["schedule"]) == {"gpipe", "1f1b", "interleaved"}


def test_model_features_still_refused():
    base = load_model("tiny-moe")
    plan = ParallelPlan(pp=2, dp=2, ep=2)
    tied = base.model_copy(update={"tie_embeddings": True})
    assert len(unsupported_features(plan, tied)) == 1
    assert unsupported_features(ParallelPlan(dp=2, ep=2), tied) == []
    capped = base.model_copy(update={"moe": base.moe.model_copy(update={"capacity_factor": 1.25})})
    assert "moe.capacity_factor=1.25" in unsupported_features(plan, capped)[0]
    for per, n in ((1, 1), (3, 1), (4, 0)):  # 3 without Arctic's residual MLP is refused, 4 (Grok-1) runs
        spec = base.model_copy(update={"norm": base.norm.model_copy(update={"per_layer": per})})
        assert len(unsupported_features(plan, spec)) == n, per
    assert len(unsupported_features(plan, load_model("xmoe-small"))) == 1  # no vocabulary


def test_capability_imports_no_torch():
    code = "import sys, piper_plan.capability; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_16_bit_plan_that_trains_in_fp32_on_the_cpu_is_named():
    # the plan and its prediction said bf16 while zero 0 / 1 CPU runs trained in fp32 (autocast is GPU-only), and
    # nothing said so; `piper run` now prints a note where precision_path says so
    import torch

    from piper_plan.catalog import load_model, load_platform
    from piper_plan.runtime.train import precision_path
    from piper_plan.specs import TrainingSpec

    cfg = SimpleNamespace(model=load_model("tiny-moe"), platform=load_platform("local-cpu"))
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    for dtype, zero, device, fp32 in (("bf16", 0, cpu, True), ("bf16", 1, cpu, True), ("bf16", 3, cpu, False),
                                      ("fp32", 0, cpu, False), ("bf16", 0, gpu, False)):
        cfg.training = TrainingSpec(seq_len=64, global_batch=8, dtype=dtype)
        cfg.parallel = ParallelPlan(dp=2, ep=2, zero=zero, num_microbatches=4)
        assert (precision_path(cfg, device) == "fp32 instead") is fp32, (dtype, zero, device)
