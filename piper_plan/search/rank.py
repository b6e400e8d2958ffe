"""Ranking: which candidates fit, their order by throughput, the Pareto set, and the reason counts.

Pure numpy over the arrays of ``piper_plan.cost.evaluate.Evaluation`` (any object with the same array
attributes works). No Python call per candidate.
"""

from __future__ import annotations

import numpy as np

from piper_plan.search.space import CANDIDATE_FIELDS

OUT_OF_MEMORY = "out_of_memory"
NOT_RUNNABLE = "not_runnable"

# Tie-break after tokens/s (descending) and peak memory (ascending): fewer pipeline stages, less tensor
# parallelism, larger micro-batches, then the remaining fields in a fixed order. Deterministic by construction.
TIE_BREAK: tuple[tuple[str, int], ...] = (("pp", 1), ("tp", 1), ("mbs", -1), ("ep", 1), ("etp", 1),
                                          ("recompute", 1), ("zero", 1), ("schedule", 1), ("a2a", 1))


def memory_limit_bytes(platform, headroom: float) -> float:
    """Usable device memory: (1 - headroom) x device.memory_bytes."""
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"memory headroom must be in [0, 1), got {headroom}")
    return (1.0 - headroom) * platform.device.memory_bytes


def fits_mask(evaluation, platform, headroom: float = 0.0) -> np.ndarray:
    """The cost model's fit, tightened by the headroom (peak_memory_bytes already includes overheads)."""
    limit = memory_limit_bytes(platform, headroom)
    return np.asarray(evaluation.fits, dtype=bool) & (np.asarray(evaluation.peak_memory_bytes) <= limit)


def rank_order(fields: dict[str, np.ndarray], evaluation, mask: np.ndarray) -> np.ndarray:
    """Indices of the candidates in ``mask``, best first: tokens/s desc, peak memory asc, then TIE_BREAK."""
    idx = np.flatnonzero(mask)
    keys = [sign * fields[name][idx] for name, sign in reversed(TIE_BREAK)]
    keys.append(np.asarray(evaluation.peak_memory_bytes)[idx])
    keys.append(-np.asarray(evaluation.tokens_per_s)[idx])
    return idx[np.lexsort(keys)]


def pareto_front(tokens_per_s: np.ndarray, peak_bytes: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Candidates of ``order`` (ranked best first) not dominated in (more tokens/s, less peak memory).

    Walking the ranking from the fastest down, a candidate is on the front when it needs strictly less
    memory than every faster one. Returned fastest first.
    """
    if len(order) == 0:
        return order
    mem = np.asarray(peak_bytes)[order]
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], mem[:-1])))
    return order[mem < best_before]


def closest_to_fitting(evaluation, limit_bytes: float, count: int) -> np.ndarray:
    """The ``count`` candidates with the smallest peak memory, faster first among equals (for "nothing fits").
    ``limit_bytes`` is not used: the limit is one number, so the smallest peak is also the smallest over it."""
    peak = np.asarray(evaluation.peak_memory_bytes)
    order = np.lexsort((-np.asarray(evaluation.tokens_per_s), peak))
    return order[:count]


def merge_reasons(*counts: dict[str, int]) -> dict[str, int]:
    """Add reason -> count mappings; sorted by count, largest first."""
    total: dict[str, int] = {}
    for c in counts:
        for name, n in c.items():
            total[name] = total.get(name, 0) + int(n)
    return dict(sorted(total.items(), key=lambda kv: (-kv[1], kv[0])))


def runnable_mask(fields: dict[str, np.ndarray], model, training=None) -> tuple[np.ndarray, dict[str, int]]:
    """Which candidates the runtime can execute, asking ``capability.unsupported_features(plan, model, training)``
    once per distinct plan shape.

    Candidates differing only in mbs / num_microbatches share one answer (the capability list is about
    degrees, schedules and algorithms), except 1F1B's one micro-batch per stage, checked per candidate
    (``too_few_microbatches``). Returns (mask, feature -> rejected count).
    """
    from piper_plan.capability import FEWER_MICROBATCHES_THAN_STAGES, too_few_microbatches, unsupported_features
    from piper_plan.plans import described
    from piper_plan.specs import ParallelPlan

    shape_fields = [k for k in CANDIDATE_FIELDS if k not in ("mbs", "num_microbatches")]
    keys = np.stack([fields[k] for k in shape_fields], axis=1)
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    ok = np.ones(len(uniq), dtype=bool)
    features: dict[str, int] = {}
    inverse = inverse.ravel()
    sizes = np.bincount(inverse, minlength=len(uniq))
    first_of = np.zeros(len(uniq), dtype=np.int64)
    first_of[inverse[::-1]] = np.arange(len(inverse))[::-1]
    columns = {k: np.broadcast_to(np.atleast_1d(fields[k]), inverse.shape)[first_of].tolist()
               for k in CANDIDATE_FIELDS}             # each shape's first candidate, as Python ints
    for u in range(len(uniq)):
        d = described({k: int(columns[k][u]) for k in CANDIDATE_FIELDS})
        plan = ParallelPlan(**{k: d[k] for k in CANDIDATE_FIELDS})
        missing = unsupported_features(plan, model, training)
        if missing:
            ok[u] = False
            for feat in missing:
                features[feat] = features.get(feat, 0) + int(sizes[u])
    mask = ok[inverse]
    few = mask & too_few_microbatches(fields)       # per candidate: the shapes above ignore the batch split
    if few.any():
        features[FEWER_MICROBATCHES_THAN_STAGES] = int(few.sum())
    return mask & ~few, features
