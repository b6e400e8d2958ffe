"""One search: enumerate the space, evaluate it with the cost model in one vectorised call, rank it.

Also the node-count questions built on it: a sweep over node counts and the smallest allocation that fits.
Pure computation (no rich, no click, no torch); the CLI renders what this returns.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from piper_plan.cost.options import DEFAULT_OPTIONS
from piper_plan.errors import CountRefused, PiperError
from piper_plan.fileio import ascii_int
from piper_plan.plans import PlanBatch
from piper_plan.search import rank
from piper_plan.search.space import SearchOptions, describe, enumerate_space, world_size
from piper_plan.specs.vocab import LayerSplit


@dataclass(frozen=True)
class SearchResult:
    """Everything one search found for one node count."""

    nodes: int
    world: int
    fields: dict[str, np.ndarray]
    """The structurally valid candidates (what the cost model evaluated)."""
    evaluation: Any
    """The cost model's Evaluation of ``fields``."""
    candidates_total: int
    """Every candidate enumerated: feasible + sum(reasons)."""
    reasons: dict[str, int]
    """Reason -> rejected candidates (structural, duplicates, out_of_memory, not_runnable)."""
    order: np.ndarray
    """Feasible candidates, best first (indices into ``fields``)."""
    pareto: np.ndarray
    """Feasible candidates on the tokens/s vs peak-memory front, fastest first."""
    memory_limit_bytes: float
    search_seconds: float
    unsupported: dict[str, int] = field(default_factory=dict)
    """runnable=True: runtime feature the rejected candidates need -> count."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where the compute rates and the host time came from (cost/evaluate.py pricing_sources)."""
    options: Any = None
    """The CostOptions the candidates were priced with (None: the defaults)."""
    runtime_peak_bytes: np.ndarray | None = None
    """Where the options are not piper's runtime's kernels: each fitting candidate's peak memory per device as the
    runtime runs it (cost/options.as_the_runtime_runs; NaN elsewhere), which `launch` checks; None otherwise."""
    device_bytes: float = 0.0
    """The device's memory (platform device.memory_bytes), which the runtime peak must fit."""

    @property
    def batch(self) -> PlanBatch:
        return PlanBatch.from_arrays(self.fields)

    @property
    def feasible(self) -> int:
        return len(self.order)

    @property
    def best(self) -> int | None:
        return int(self.order[0]) if len(self.order) else None

    def row(self, i: int) -> dict:
        """Candidate ``i``: degrees, names and predicted figures as plain Python values."""
        ev = self.evaluation
        out = describe(self.fields, i)
        for name in ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "hfu", "mfu_megatron",
                     "hfu_megatron", "peak_memory_bytes", "a2a_share"):
            out[name] = float(np.asarray(getattr(ev, name))[i])
        out["peak_memory_bytes"] = int(round(out["peak_memory_bytes"]))
        out["fits"] = bool(np.asarray(ev.fits)[i]) and out["peak_memory_bytes"] <= self.memory_limit_bytes
        out["layers_split"] = "balanced" if int(ev.layers_split[i]) == 1 else "even"   # the split it was priced with
        if self.runtime_peak_bytes is not None and not np.isnan(self.runtime_peak_bytes[i]):
            out["peak_memory_bytes_piper_runtime"] = int(round(float(self.runtime_peak_bytes[i])))
            out["fits_piper_runtime"] = float(self.runtime_peak_bytes[i]) <= self.device_bytes
        return out

    @property
    def evaluated(self) -> int:
        """Candidates the cost model priced (the enumerated ones less those the rules refused)."""
        return len(self.fields["dp"])

    def plan(self, model, training, i: int):
        """Candidate ``i`` as the ParallelPlan the cost model priced (its layer split resolved into an explicit
        list): ``estimate`` of it reproduces the candidate's row."""
        from piper_plan.cost.evaluate import plan_of

        return plan_of(model, training, self.batch, self.evaluation, i)


def search(model, platform, training, nodes: int, options: SearchOptions = SearchOptions(), *,
           calibration=None, placement: str = "compact", runnable: bool = False, cost_options=None) -> SearchResult:
    """Search every candidate of ``nodes`` nodes; ``runnable`` keeps those piper's runtime executes
    (capability.py)."""
    from piper_plan.cost.evaluate import evaluate, pricing_sources

    start = time.perf_counter()
    modules = (DEFAULT_OPTIONS if cost_options is None else cost_options).recompute_modules
    space = enumerate_space(model, platform, training, nodes, options, modules)
    extra = {} if cost_options is None else {"options": cost_options}
    ev = evaluate(model, platform, training, nodes, space.batch(), calibration=calibration, placement=placement,
                  **extra)
    limit = rank.memory_limit_bytes(platform, options.memory_headroom)
    fits = rank.fits_mask(ev, platform, options.memory_headroom)
    _check_figures(ev, fits)
    reasons = [space.reasons, {rank.OUT_OF_MEMORY: int(np.count_nonzero(~fits))}]
    features: dict[str, int] = {}
    if runnable and fits.any():
        ok, features = rank.runnable_mask(rank_subset(space.fields, fits), model, training)
        reasons.append({rank.NOT_RUNNABLE: int(np.count_nonzero(~ok))})
        fits = _narrow(fits, ok)
    order = rank.rank_order(space.fields, ev, fits)
    pareto = rank.pareto_front(ev.tokens_per_s, ev.peak_memory_bytes, order)
    merged = {k: v for k, v in rank.merge_reasons(*reasons).items() if v}
    priced = DEFAULT_OPTIONS if cost_options is None else cost_options
    runtime_peak = None if runnable or priced.unfused_kernels or not fits.any() else \
        _runtime_peaks(model, platform, training, nodes, space.fields, ev.layers_split, fits, calibration,
                       placement, priced)
    return SearchResult(nodes=nodes, world=world_size(platform, nodes), fields=space.fields, evaluation=ev,
                        candidates_total=space.total, reasons=merged, order=order, pareto=pareto,
                        memory_limit_bytes=limit, search_seconds=time.perf_counter() - start, unsupported=features,
                        sources=pricing_sources(platform, training, calibration, priced), options=cost_options,
                        runtime_peak_bytes=runtime_peak, device_bytes=float(platform.device.memory_bytes))


def _runtime_peaks(model, platform, training, nodes, fields, split_slots, fits, calibration, placement,
                   priced) -> np.ndarray:
    """Peak memory per device of the fitting candidates as piper's runtime runs them (NaN for the others), each
    with the layer split it was ranked with (``split_slots``: Evaluation.layers_split), the one ``-o`` saves and
    ``launch`` checks: left to ``auto``, the runtime's figures could take the other split."""
    from piper_plan.cost.evaluate import evaluate
    from piper_plan.cost.options import as_the_runtime_runs

    out = np.full(len(fits), np.nan)
    subset = rank_subset(fields, fits)
    subset["layers_split"] = np.where(split_slots[fits] == 1, LayerSplit.BALANCED.code, LayerSplit.EVEN.code)
    ev = evaluate(model, platform, training, nodes, PlanBatch.from_arrays(subset),
                  calibration=calibration, placement=placement, options=as_the_runtime_runs(priced))
    out[fits] = np.asarray(ev.peak_memory_bytes, float)
    return out


def _check_figures(ev, fits: np.ndarray) -> None:
    """One PiperError line when a plan that fits is priced outside what an estimate can hold (NaN, infinity, a step
    beyond MAX_STEP_S): inputs valid one by one (a calibration row, an efficiency) whose rates together make no
    trainable job; ``piper estimate`` refuses the same plan likewise (cost.evaluate)."""
    from piper_plan.specs.estimate import MAX_STEP_S

    with np.errstate(invalid="ignore"):
        bad = fits & ~(np.isfinite(ev.step_time_s) & (ev.step_time_s > 0) & (ev.step_time_s <= MAX_STEP_S)
                       & np.isfinite(ev.tokens_per_s))
    if bad.any():
        value = float(ev.step_time_s[np.flatnonzero(bad)[0]])
        raise PiperError(f"the prediction's step_time_s is {value!r} for {int(bad.sum()):,} plans, outside what piper "
                         f"reports (a finite number of seconds <= {MAX_STEP_S:g}): the model, platform, calibration and "
                         "training are each valid, but together they make no trainable job; check their rates")


def rank_subset(fields: dict[str, np.ndarray], mask: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v[mask] for k, v in fields.items()}


def _narrow(mask: np.ndarray, ok_of_selected: np.ndarray) -> np.ndarray:
    """Within the True entries of ``mask``, keep those where ``ok_of_selected`` (aligned to them) is True."""
    out = mask.copy()
    out[np.flatnonzero(mask)[~ok_of_selected]] = False
    return out


# ---- node counts ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RefusedCount:
    """A node count of a sweep whose whole space was refused (errors.CountRefused): no plan, and why."""

    nodes: int
    world: int
    reason: str
    feasible: bool = False
    search_seconds: float = 0.0
    candidates_total: int = 0


def sweep(model, platform, training, node_counts: list[int], options: SearchOptions = SearchOptions(),
          **kwargs) -> list[SearchResult | RefusedCount]:
    """One search per node count (ascending); a count whose whole space is refused (no dp divides the global
    batch there) is a RefusedCount, unless every count is: then the first refusal is the input's error."""
    results, refusals = [], []
    for n in sorted(set(node_counts)):
        r, refused = _search_or_refusal(model, platform, training, n, options, **kwargs)
        results.append(r if refused is None else RefusedCount(n, n * platform.devices_per_node, refused.message))
        refusals += [refused] if refused is not None else []
    if refusals and len(refusals) == len(results):
        raise refusals[0]
    return results


def scaling_rows(results: list[SearchResult]) -> list[dict]:
    """Per node count: the best plan's throughput and the efficiency against the smallest count that fits.

    efficiency = (tokens/s per device at n) / (tokens/s per device at the base), i.e. strong scaling of
    the same model and batch; 1.0 is perfect.
    """
    base = next((r for r in results if r.feasible), None)
    rows = []
    for r in results:
        row = {"nodes": r.nodes, "world": r.world, "feasible": r.feasible, "best": None, "speedup": None,
               "efficiency": None, "refused": r.reason if isinstance(r, RefusedCount) else None}
        if r.feasible:
            best = r.row(r.best)
            per_device = best["tokens_per_s"] / r.world
            base_tps = base.row(base.best)["tokens_per_s"]
            row.update(best=best, speedup=best["tokens_per_s"] / base_tps,
                       efficiency=per_device / (base_tps / base.world))
        rows.append(row)
    return rows


def parse_node_range(text: str) -> list[int]:
    """'64' -> [64]; '8..64' -> 8, 16, 32, 64 (doubling from A, B always included)."""
    try:
        if ".." not in text:
            return [ascii_int(text)]
        a_text, b_text = text.split("..", 1)
        a, b = ascii_int(a_text), ascii_int(b_text)
    except ValueError:
        raise PiperError(f"{text!r} is not a node count or a range A..B of node counts", field="--nodes") from None
    if a < 1 or b < a:
        raise PiperError(f"range {text!r} needs 1 <= A <= B", field="--nodes")
    counts, n = [], a
    while n < b:
        counts.append(n)
        n *= 2
    return counts + [b]


def min_nodes(model, platform, training, options: SearchOptions = SearchOptions(), *, start: int = 1,
              **kwargs) -> tuple[int | None, SearchResult | None]:
    """The smallest node count >= ``start`` whose search has a feasible plan: the counts of ``probe_counts``
    (``start``'s doublings and the powers of two above it) until one is feasible, then bisection below it.

    Bisection assumes that fitting is monotone in the node count between the last failure and the first
    success (true of memory; a batch-divisibility gap can break it, in which case the count found stands).
    A count whose whole space is refused (errors.CountRefused: no dp divides the global batch, no cp divides its
    world) has no plan and the search moves on; the counts start at the first whose world a searched cp divides (a
    cp of 3 holds no power-of-two world). When every count is refused, the first refusal is the answer, as it is
    then the input's, not one count's.
    """
    aligned = _cp_aligned_start(start, options, platform.devices_per_node)
    counts = probe_counts(aligned, platform.node_limit) or probe_counts(start, platform.node_limit)
    found, lo, first_refusal, all_refused = None, counts[0] - 1 if counts else start - 1, None, True
    for n in counts:
        r, refused = _search_or_refusal(model, platform, training, n, options, **kwargs)
        first_refusal, all_refused = first_refusal or refused, all_refused and refused is not None
        if r is not None and r.feasible:
            found = r
            break
        lo = n
    if found is None:
        if first_refusal is not None and all_refused:
            raise first_refusal
        return None, None
    hi = found.nodes
    while hi - lo > 1:
        mid = (lo + hi) // 2
        r, _ = _search_or_refusal(model, platform, training, mid, options, **kwargs)
        if r is not None and r.feasible:
            hi, found = mid, r
        else:
            lo = mid
    return hi, found


def probe_counts(start: int, limit: int) -> list[int]:
    """The node counts min_nodes tries before bisecting, ascending: ``start`` x 2^k (multiples of whatever
    ``start`` holds: from 3, 6 and 12 hold a cp of 3 on 8-device nodes), the powers of two above ``start`` (what a
    power-of-two global batch divides: from 33, 66 and its doublings may admit no plan while 64 does), and
    ``limit``."""
    if start > limit:
        return []
    doublings = {start << k for k in range(limit.bit_length() + 1) if start << k <= limit}
    powers = {1 << k for k in range(limit.bit_length() + 1) if start < 1 << k <= limit}
    return sorted(doublings | powers | {limit})


def _cp_aligned_start(start: int, options: SearchOptions, devices_per_node: int) -> int:
    """The first count >= ``start`` whose world some searched cp divides (nodes a multiple of cp / gcd(cp, devices
    per node)): no count between holds a plan."""
    step = min(c // math.gcd(c, devices_per_node) for c in options.cp or (1,))
    return -(-start // step) * step


def _search_or_refusal(model, platform, training, nodes, options, **kwargs):
    """(the search at ``nodes``, None), or (None, the CountRefused that refused that count's whole space)."""
    try:
        return search(model, platform, training, nodes, options, **kwargs), None
    except CountRefused as exc:
        return None, exc
