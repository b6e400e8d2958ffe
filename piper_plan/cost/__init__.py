"""The resource model (pure numpy; no torch, rich or click): memory, compute and communication per
pipeline stage, the schedule's step time, and ``evaluate`` / ``estimate`` over candidate plans.

Modules: params (splitting parameters), memory (state + activations), flops (FLOPs, the MFU convention),
compute (achieved rates: calibration or roofline), comm (collectives, flat / HALO all-to-all), stage
(per-stage memory and time), pipeline (stages and schedules), step (sync, optimizer, totals), evaluate.
"""

from piper_plan.cost.evaluate import A2A, RECOMPUTE, SCHEDULES, Candidates, Evaluation, estimate, evaluate
from piper_plan.cost.flops import model_flops_per_token
from piper_plan.cost.memory import rank_param_counts
from piper_plan.cost.options import CostOptions

__all__ = ["A2A", "RECOMPUTE", "SCHEDULES", "Candidates", "CostOptions", "Evaluation", "estimate", "evaluate",
           "model_flops_per_token", "rank_param_counts"]
