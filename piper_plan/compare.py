"""Measured (the runtime's metrics.jsonl) vs predicted (plan.json's ``prediction``): pure, no I/O.
``check_same_job`` and ``check_stage_count`` refuse metrics of another job than the plan's before any comparison;
``layout_records`` keeps the steps that ran under the plan's parallel layout (a run resumed under another one keeps
the earlier layout's steps in its metrics.jsonl).

Every quantity is ``{"predicted", "measured", "rel_error"}`` with ``rel_error = (predicted - measured) / measured``
(DESIGN.md, compare format); a quantity missing on either side has ``rel_error = None``.
Measured values are steady-state: the first step of each invocation (warm-up: allocation, gloo/NCCL connection
set-up; metricsfile.steady_steps) is left out when other steps remain; times are medians over steps (robust to a
stray slow step; a migration, paid on some steps only, is the mean), memory is the maximum over steps (a peak).
"""

from __future__ import annotations

import math
from statistics import median

from piper_plan.errors import PiperError
from piper_plan.metricsfile import PROCESS_RSS_KEY, steady_steps
from piper_plan.specs.vocab import A2A_TIME_PREFIX

A2A_KEY_PARTS = (A2A_TIME_PREFIX, "dispatch", "combine", "a2a", "all_to_all")
"""Prediction breakdown entries counted as expert all-to-all time (the runtime's a2a timer: exchanges, count
exchange, the waits at them; specs.vocab.A2A_TIME_PREFIX), and the names of other predictions' exchanges."""


def quantity(predicted: float | None, measured: float | None) -> dict:
    rel = None
    if predicted is not None and measured not in (None, 0):
        rel = (predicted - measured) / measured
        rel = rel if math.isfinite(rel) else None      # a ratio beyond float range says nothing
    return {"predicted": predicted, "measured": measured, "rel_error": rel}


def _median_of(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return median(values) if values else None


def measured_a2a_share(records: list[dict]) -> float | None:
    """Median over steps of (all-to-all seconds / step seconds)."""
    shares = [r["time_s"]["a2a"] / r["step_time_s"] for r in records
              if isinstance((r.get("time_s") or {}).get("a2a"), (int, float)) and r.get("step_time_s")]
    return median(shares) if shares else None


def predicted_a2a_share(prediction: dict) -> float | None:
    if isinstance(prediction.get("a2a_share"), (int, float)):
        return prediction["a2a_share"]
    a2a, step = predicted_term_s(prediction, A2A_KEY_PARTS), prediction.get("step_time_s")
    return a2a / step if a2a is not None and step else None


TIME_TERMS: dict[str, tuple[str, ...]] = {"a2a": A2A_KEY_PARTS, "p2p": ("p2p",), "dp_sync": ("dp/sync",),
                                          "migration": ("migration",)}
"""Measured time terms (metrics.jsonl ``time_s``) -> name parts of the prediction breakdown entries that price them."""


def predicted_term_s(prediction: dict, parts: tuple[str, ...]) -> float | None:
    """Seconds per step of the prediction breakdown entries named by one of ``parts``: a part ending in "/" is a
    name prefix (``specs.vocab.A2A_TIME_PREFIX``, as the estimate counts it), any other part a substring."""
    breakdown = (prediction.get("time") or {}).get("breakdown") or {}
    named = lambda name, p: name.startswith(p) if p.endswith("/") else p in name   # noqa: E731
    matched = [s for name, s in breakdown.items() if any(named(name, p) for p in parts)]
    return sum(matched) if matched else None


AMORTISED_TERMS = ("migration",)
"""Time terms paid on some steps only (a migration every ``interval`` steps): their per-step cost is the mean over
the steady steps, which the median (0 unless most steps migrate) would hide."""


def sharded_by_fsdp(records: list[dict]) -> bool:
    """Steps run under zero 2 / 3 (FSDP2): their gradient reduce-scatter runs inside backward, outside the runtime's
    dp_sync timer (measured as not timed), and the tensor accounting holds the parameters' local shards, not the
    gathered weights the prediction prices."""
    return any(((r.get("parallel") or {}).get("zero") or 0) >= 2 for r in records)


def time_terms(prediction: dict, records: list[dict]) -> dict[str, dict]:
    """Per measured time term: predicted seconds per step vs the median over the steady steps (the mean for
    AMORTISED_TERMS)."""
    steady = steady_steps(records)
    out = {}
    for term, parts in TIME_TERMS.items():
        if term == "dp_sync" and sharded_by_fsdp(steady):     # not what the runtime's dp_sync timer sees there
            out[term] = quantity(predicted_term_s(prediction, parts), None)
            continue
        measured = [r["time_s"][term] for r in steady if isinstance((r.get("time_s") or {}).get(term), (int, float))]
        per_step = (sum(measured) / len(measured) if term in AMORTISED_TERMS else median(measured)) if measured \
            else None
        out[term] = quantity(predicted_term_s(prediction, parts), per_step)
    return out


def term_notes(time_s: dict, records: list[dict]) -> list[str]:
    """Why a time term's row reads as it does where the numbers alone mislead: a migration the plan priced none of
    (its error would read -100%), and dp_sync under FSDP2 (measured '-')."""
    notes = []
    migration = time_s.get("migration") or {}
    if (migration.get("measured") or 0) > 0 and not migration.get("predicted"):
        notes.append("migration: the plan priced none: the cost model prices live migration as a share of the step "
                     "(`--cost-option migration_fraction=F`, 0 by default; the Piper paper bounds it below 5%)")
    if "dp_sync" in time_s and sharded_by_fsdp(steady_steps(records)):
        notes.append("dp_sync: not measured under zero 2 / 3: FSDP2 reduce-scatters the gradients inside the "
                     "backward pass, outside the runtime's dp_sync timer")
    return notes


def _stage_bytes(entry) -> float | None:
    if isinstance(entry, (int, float)):
        return entry
    if isinstance(entry, dict):
        total = entry.get("total_bytes")
        return total if total is not None else entry.get("peak_bytes")
    return None


def measured_memory_per_stage(records: list[dict]) -> list[float | None]:
    """Per stage, the maximum over all steps (warm-up included: a peak is a peak)."""
    return _stage_maxima(records, _stage_bytes)


def _stage_maxima(records: list[dict], value_of) -> list[float | None]:
    """Per stage, the largest ``value_of(stage entry)`` over all steps (None where no step has one)."""
    stages = max((len(r.get("memory_bytes") or []) for r in records), default=0)
    out = []
    for i in range(stages):
        values = [value_of(r["memory_bytes"][i]) for r in records if len(r.get("memory_bytes") or []) > i]
        values = [x for x in values if x is not None]
        out.append(max(values) if values else None)
    return out


NOT_TENSORS = ("framework", "fragmentation")
"""Prediction components a CPU run's tensor accounting cannot see (runtime context, allocator slack)."""


def measured_by_tensor_accounting(records: list[dict]) -> bool:
    """True when the runtime measured memory by its own tensor accounting (CPU), not an allocator peak (GPU)."""
    return any(isinstance(m, dict) and str(m.get("source", "")).startswith("tensor accounting")
               for r in records for m in r.get("memory_bytes") or [])


def predicted_memory_per_stage(prediction: dict, tensors_only: bool = False) -> list[float | None]:
    """Predicted bytes per stage; ``tensors_only`` leaves out what tensor accounting cannot measure."""
    out = []
    for stage in (prediction.get("memory") or {}).get("per_stage") or []:
        total = _stage_bytes(stage)
        if tensors_only and total is not None and isinstance(stage, dict):
            total -= sum((stage.get("components") or {}).get(k, 0) for k in NOT_TENSORS)
        out.append(total)
    return out


def measured_rss_per_stage(records: list[dict]) -> list[float | None]:
    """Per stage, the largest process peak RSS of its ranks over all steps (CPU runs); [] where none was measured."""
    rss = lambda m: m.get(PROCESS_RSS_KEY) if isinstance(m, dict) else None  # noqa: E731
    out = _stage_maxima(records, rss)
    return out if any(v is not None for v in out) else []


def compare(prediction: dict, records: list[dict]) -> dict:
    """The comparison of one run: step time, tokens/s, all-to-all share, memory per stage (and, on CPU ranks, the
    processes' peak RSS against the whole per-device prediction, framework and fragmentation included)."""
    steady = steady_steps(records)
    tensors_only = measured_by_tensor_accounting(records)
    pred_mem = predicted_memory_per_stage(prediction, tensors_only)
    meas_mem = measured_memory_per_stage(records)
    meas_rss = measured_rss_per_stage(records)
    stages = max(len(pred_mem), len(meas_mem))
    pad = lambda xs: xs + [None] * (stages - len(xs))  # noqa: E731
    rss = [quantity(p, m) for p, m in zip(pad(predicted_memory_per_stage(prediction)), pad(meas_rss))] \
        if meas_rss else []
    times = time_terms(prediction, records)
    return {
        "steps_measured": len(steady),
        "warmup_only": all(r.get("warmup") for r in steady),      # no steady step yet: the figures are warm-up's
        "step_time_s": quantity(prediction.get("step_time_s"), _median_of(steady, "step_time_s")),
        "tokens_per_s": quantity(prediction.get("tokens_per_s"), _median_of(steady, "tokens_per_s")),
        "a2a_share": quantity(predicted_a2a_share(prediction), measured_a2a_share(steady)),
        "time_s": times,
        "time_notes": term_notes(times, records),
        "memory_bytes_per_stage": [quantity(p, m) for p, m in zip(pad(pred_mem), pad(meas_mem))],
        "memory_basis": ("tensor accounting (prediction without framework and fragmentation)" if tensors_only
                         else "allocator peak") + ("; under zero 2 / 3 the accounting holds the parameters' local "
                                                   "shards, not FSDP2's gathered weights, which the prediction "
                                                   "holds" if tensors_only and sharded_by_fsdp(records) else ""),
        "process_rss_bytes_per_stage": rss,
    }


def check_same_job(plan_file, records: list[dict], metrics_path: str, plan_path: str) -> None:
    """Refuse metrics of another job than the plan's: every record's ``tokens`` (the run's global batch x sequence
    length a step, runtime/metrics.py) must be the plan's, and its expert counts of the plan's model
    (``check_same_model``); one line naming both files."""
    training = plan_file.training
    check_same_model(plan_file.model, records, metrics_path, plan_path)
    planned = training.tokens_per_step
    for record in records:
        tokens = record.get("tokens")
        if tokens is not None and tokens != planned:
            raise PiperError(f"step {record['step']}: tokens={tokens:,} a step, but {plan_path} trains global_batch "
                             f"{training.global_batch:,} x seq_len {training.seq_len:,} = {planned:,}: the metrics "
                             "are of another job; compare a run directory with the plan.json it ran",
                             path=metrics_path)


def check_same_model(model, records: list[dict], metrics_path: str, plan_path: str) -> None:
    """Refuse metrics of another model than the plan's: a record's ``expert_tokens`` (runtime/metrics.py: per MoE
    layer, by its global index, one count per expert) must name the model's MoE layers (ModelSpec.expert_layer_ids)
    with ``num_experts`` counts each. A malformed entry is placement.loads' to name; one line naming both files."""
    layers = set(model.expert_layer_ids)
    experts = model.moe.num_experts if model.moe is not None else 0
    for record in records:
        tokens = record.get("expert_tokens")
        if not tokens:
            continue
        entries = tokens.items() if isinstance(tokens, dict) else enumerate(tokens) if isinstance(tokens, list) else ()
        for key, counts in entries:
            plain = isinstance(key, int) or (isinstance(key, str) and key.isascii() and key.isdecimal())
            layer = int(key) if plain else None
            named = layer is not None and (layer in layers if isinstance(tokens, dict) else layer < len(layers))
            if not layers or not named or not isinstance(counts, list) or len(counts) != experts:
                raise PiperError(f"step {record['step']}: expert_tokens has layer {key} with "
                                 f"{len(counts) if isinstance(counts, list) else '?'} experts, but {plan_path}'s model "
                                 f"{model.name} routes {experts} experts in layers {sorted(layers) or 'none'}: the "
                                 "metrics are of another model; compare a run directory with the plan.json it ran",
                                 path=metrics_path)


def layout_records(plan_file, records: list[dict], metrics_path: str, plan_path: str) -> list[dict]:
    """The records of the layout plan.json now holds (a run resumed under another layout replaces plan.json and keeps
    the earlier steps' records: metricsfile.records_of_layout); none is an error naming both files."""
    from piper_plan.metricsfile import records_of_layout

    kept = records_of_layout(records, plan_file.parallel.model_dump(mode="json"))
    if not kept:
        raise PiperError(f"no step ran under the parallel layout of {plan_path} (every record's 'parallel' is "
                         "another); compare a run directory with the plan.json it ran", path=metrics_path)
    return kept


def check_stage_count(pp: int, records: list[dict], metrics_path: str, plan_path: str) -> None:
    """Refuse ``memory_bytes`` with more entries than the plan's ``pp`` pipeline stages (the runtime writes one
    entry per stage, runtime/train.py merge_reports); one line naming both files."""
    for record in records:
        entries = len(record.get("memory_bytes") or [])
        if entries > pp:
            raise PiperError(f"step {record['step']}: memory_bytes has {entries} entries, but {plan_path} has pp={pp} "
                             f"pipeline stage(s); allowed at most {pp} (one per stage)", path=metrics_path)
