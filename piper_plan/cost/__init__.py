"""The resource model (pure numpy; no torch, rich or click): memory, compute and communication per
pipeline stage, the schedule's step time, and ``evaluate`` / ``estimate`` over plans (piper_plan.plans.PlanBatch).

Modules: params (splitting parameters), memory (state + activations), flops (FLOPs, the MFU convention),
compute (achieved rates: calibration or roofline), comm (collectives, flat / HALO all-to-all), stage
(per-stage memory and time), terms (per-layer time terms), pipeline (stages and schedules), step (sync,
optimizer, totals), batch (the one pricing pipeline), evaluate (its entry points: ``evaluate``, ``estimate``).
Import the module you need; this package file imports nothing, so the modules form an acyclic graph.
"""
