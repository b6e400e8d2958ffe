"""What a search found, as plain data: ranked rows, the JSON document of ``piper plan``, the winner against
its runner-up, what to do when nothing fits, and the chosen plan with its prediction. Pure (no rich, no click);
the CLI renders it.
"""

from __future__ import annotations

import numpy as np

from piper_plan.errors import PiperError
from piper_plan.specs.estimate import FLOPS_CONVENTIONS

COMPARED_FIELDS = ("dp", "cp", "tp", "pp", "ep", "etp", "mbs", "num_microbatches", "schedule", "recompute", "zero", "a2a")
"""Plan fields the winner / runner-up comparison names when they differ."""


def plan_rows(result, model, training, top: int) -> list[dict]:
    """The best ``top`` plans as dicts (degrees, figures, node-hours to train, and whether piper's runtime runs
    them: ``runtime_missing`` lists what it lacks, capability.py)."""
    rows = []
    for rank_index, i in enumerate(result.order[:top] if top > 0 else result.order, start=1):
        row = {"rank": rank_index, **result.row(int(i))}
        row["node_hours_to_train"] = training.tokens_to_train / row["tokens_per_s"] / 3600.0 * result.nodes
        rows.append(with_runtime_marks(row, model, training, result.options))
    return rows


RUNTIME_MEMORY = ("memory: does not fit as the runtime runs it (its unfused kernels: peak_memory_bytes_piper_runtime; "
                  "`piper plan --runnable` ranks by that)")
"""What a ranked plan that fits only under fused kernels lacks for piper's runtime."""


def with_runtime_marks(row: dict, model, training, options=None) -> dict:
    """A ranked plan's row with ``runtime_missing`` (what piper's runtime lacks for it: capability.py, the cost
    options that change the training, and a fit as the runtime runs it, SearchResult.runtime_peak_bytes) and
    ``runnable_by_piper``."""
    from piper_plan.capability import options_problems, runtime_missing
    from piper_plan.search.space import CANDIDATE_FIELDS
    from piper_plan.specs import ParallelPlan

    plan = ParallelPlan(**{k: row[k] for k in CANDIDATE_FIELDS})
    missing = runtime_missing(plan, model, training) + ([] if options is None else options_problems(options, plan, model, training))
    if not row.get("fits_piper_runtime", True):
        missing.append(RUNTIME_MEMORY)
    return {**row, "runtime_missing": missing, "runnable_by_piper": not missing}


def result_json(result, model, platform, training, top: int) -> dict:
    return {
        "model": model.name, "platform": platform.name, "nodes": result.nodes, "world": result.world,
        "seq_len": training.seq_len, "global_batch": training.global_batch,
        "dtype": training.dtype, "fp8_recipe": training.fp8_recipe,
        "candidates_enumerated": result.candidates_total,
        "cost_model_evaluations": result.evaluated,
        "feasible": result.feasible,
        "infeasible_reasons": result.reasons,
        "unsupported_features": result.unsupported,
        "search_seconds": result.search_seconds,
        "memory_limit_bytes": result.memory_limit_bytes,
        "sources": result.sources,
        "flops_conventions": FLOPS_CONVENTIONS,
        "plans": plan_rows(result, model, training, top),
        "pareto": [result.row(int(i)) for i in result.pareto],
    }


def precision_rows(searches, model, top: int) -> list[dict]:
    """Several searches of one setting at different precisions, ``[(training, result)]``, as one ranking: every
    row carries its ``dtype`` and ``fp8_recipe``, ranked by tokens/s (each search's own order kept among equals)."""
    rows = [{**row, "dtype": training.dtype, "fp8_recipe": training.fp8_recipe} for training, result in searches
            if result.feasible for row in plan_rows(result, model, training, top)]
    rows.sort(key=lambda row: -row["tokens_per_s"])
    rows = rows[:top] if top > 0 else rows
    for rank_index, row in enumerate(rows, start=1):
        row["rank"] = rank_index
    return rows


def best_search(searches):
    """The (training, result) whose best plan is the fastest (searches with a feasible plan only)."""
    feasible = [(t, r) for t, r in searches if r.feasible]
    return max(feasible, key=lambda tr: float(tr[1].evaluation.tokens_per_s[tr[1].best])) if feasible else None


def precisions_json(searches, model, platform, top: int) -> dict:
    """``piper plan --dtype LIST|any``: the winning precision's document, its plans replaced by the ranking over
    every precision, the counts summed, and one summary per precision."""
    training, result = best_search(searches)
    obj = result_json(result, model, platform, training, top)
    reasons: dict[str, int] = {}
    for _, r in searches:
        for name, count in r.reasons.items():
            reasons[name] = reasons.get(name, 0) + count
    obj.update(dtype=training.dtype, fp8_recipe=training.fp8_recipe, plans=precision_rows(searches, model, top),
               infeasible_reasons=reasons,
               candidates_enumerated=sum(r.candidates_total for _, r in searches),
               cost_model_evaluations=sum(r.evaluated for _, r in searches),
               feasible=sum(r.feasible for _, r in searches),
               search_seconds=sum(r.search_seconds for _, r in searches),
               precisions=[{"dtype": t.dtype, "fp8_recipe": t.fp8_recipe, "candidates_enumerated": r.candidates_total,
                            "cost_model_evaluations": r.evaluated, "feasible": r.feasible, "sources": r.sources,
                            "best_tokens_per_s": float(r.evaluation.tokens_per_s[r.best]) if r.feasible else None}
                           for t, r in searches])
    return obj


def candidate_status(result) -> np.ndarray:
    """Per evaluated candidate (``result.fields``): "feasible", or the reason the ranking left it out
    (out_of_memory, not_runnable). Candidates refused before the cost model (structural reasons) are not in it."""
    from piper_plan.search import rank

    ev = result.evaluation
    fits = np.asarray(ev.fits, dtype=bool) & (np.asarray(ev.peak_memory_bytes) <= result.memory_limit_bytes)
    status = np.where(fits, rank.NOT_RUNNABLE, rank.OUT_OF_MEMORY).astype(object)
    status[result.order] = "feasible"
    return status


def runner_up(result) -> int | None:
    """The best plan with other degrees (dp, cp, tp, pp, ep, etp) than the winner; else simply the second plan.

    Plans that differ only in a setting the model predicts no effect for (selective recompute with flash
    attention, say) tie with the winner and say nothing about what separates it from the alternatives."""
    if result.feasible < 2:
        return None
    f, order = result.fields, result.order
    w = order[0]
    differs = np.zeros(len(order) - 1, dtype=bool)
    for k in ("dp", "cp", "tp", "pp", "ep", "etp"):
        differs |= f[k][order[1:]] != f[k][w]
    hits = np.flatnonzero(differs)
    return int(order[1 + hits[0]]) if len(hits) else int(order[1])


def explain_json(result) -> dict:
    """The winner's breakdown (seconds per step by component) beside the runner-up's, and what differs."""
    winner = int(result.order[0])
    runner = runner_up(result)
    breakdown = result.evaluation.breakdown
    out = {"winner": result.row(winner), "runner_up": result.row(runner) if runner is not None else None,
           "breakdown": {}}
    for name in sorted(breakdown):
        values = np.asarray(breakdown[name])
        w = float(values[winner])
        r = float(values[runner]) if runner is not None else None
        out["breakdown"][name] = {"winner_s": w, "runner_up_s": r, "delta_s": None if r is None else r - w}
    if runner is not None:
        a, b = out["winner"], out["runner_up"]
        out["differences"] = {k: [a[k], b[k]] for k in COMPARED_FIELDS if a[k] != b[k]}
    return out


def nothing_fits_json(model, platform, training, result, options, kwargs) -> dict:
    """The closest candidates, their overflow, and the node count that would fit (if any)."""
    from piper_plan.search import engine, rank

    closest = [result.row(int(i)) for i in rank.closest_to_fitting(result.evaluation, result.memory_limit_bytes, 5)]
    for row in closest:
        row["overflow_bytes"] = max(0, row["peak_memory_bytes"] - int(result.memory_limit_bytes))
    start = result.nodes + 1
    needed = None
    # no allocation helps when the fixed framework bytes alone exceed the limit (every plan pays them)
    hopeless = platform.memory.framework_bytes >= result.memory_limit_bytes
    if start <= platform.node_limit and not hopeless:
        try:
            needed, _ = engine.min_nodes(model, platform, training, options, start=start, **kwargs)
        except PiperError:      # every larger count is refused (batch, cp, nodes): none found
            needed = None
    return {"model": model.name, "platform": platform.name, "nodes": result.nodes, "feasible": 0,
            "candidates_enumerated": result.candidates_total, "infeasible_reasons": result.reasons,
            "search_seconds": result.search_seconds, "memory_limit_bytes": result.memory_limit_bytes,
            "plans": [], "closest": closest, "nodes_needed": needed,
            "all_closest_use_full_recompute": all(r["recompute"] == "full" for r in closest),
            "fit_but_not_runnable": result.reasons.get(rank.NOT_RUNNABLE, 0), "runtime_missing": result.unsupported}


def best_plan(model, platform, training, result, placement, calibration, cost_options=None):
    """The best plan with the layer split the search priced it with (cost/pipeline.py's rule: even or
    FLOP-balanced), and ``estimate``'s prediction of it, which equals its row in the ranking."""
    return ranked_plan(model, platform, training, result, result.best, placement, calibration, cost_options)


def ranked_plan(model, platform, training, result, i: int, placement, calibration, cost_options=None):
    """Candidate ``i`` of a search as (ParallelPlan with the split it was priced with, estimate's prediction)."""
    from piper_plan.cost.evaluate import estimate

    plan = result.plan(model, training, i)
    extra = {} if cost_options is None else {"options": cost_options}
    prediction = estimate(model, platform, training, result.nodes, plan, calibration=calibration, placement=placement,
                          **extra)
    return plan, prediction


