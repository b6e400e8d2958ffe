"""The runtime's capability list: what it refuses, and that the planner-side module imports no torch."""

from __future__ import annotations

import subprocess
import sys

from piper_plan.capability import RUNTIME_CAPABILITY, unsupported_features
from piper_plan.catalog import load_model
from piper_plan.specs import ParallelPlan


def test_runnable_plan_has_no_problems():
    assert unsupported_features(ParallelPlan(pp=2, dp=4, ep=2, schedule="gpipe"), load_model("tiny-moe")) == []


def test_each_unsupported_feature_is_named():
    plan = ParallelPlan(pp=2, dp=4, tp=2, ep=2, schedule="interleaved", virtual_stages=2, recompute="full")
    problems = unsupported_features(plan, load_model("tiny-mla"))
    joined = " ".join(problems)
    for needle in ("parallel.tp=2", "parallel.schedule='interleaved'", "parallel.virtual_stages=2",
                   "parallel.recompute='full'", "attention.kind='mla'"):
        assert needle in joined
    assert len(problems) == 5
    assert set(RUNTIME_CAPABILITY["schedule"]) == {"gpipe", "1f1b"}


def test_capability_imports_no_torch():
    code = "import sys, piper_plan.capability; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
