"""Candidate generation: every (dp, tp, pp, ep, etp, mbs, schedule, recompute, zero, a2a) of one allocation.

Pure numpy (no torch, no I/O). Vocabulary from DESIGN.md: ``world = nodes x devices_per_node = pp x dp x tp``;
experts regroup a stage's ``dp x tp`` ranks as ``ep x etp x edp``; ``num_microbatches = global_batch / (dp x mbs)``.

The space is a cartesian product: divisor lists per axis, broadcast with ``np.meshgrid`` (no Python loop per
candidate). It is built in two steps so that the big product never materialises for structurally invalid rows:

1. the *structural* grid (pp, tp, ep, etp, mbs) with ``pp x tp`` dividing the world (dp is derived), checked
   against the model and the batch; each invalid row is counted under its first reason, times the number of
   (schedule, recompute, zero, a2a) combinations it stands for;
2. the valid rows times (schedule, recompute, zero, a2a), where schedule-level rules and duplicates
   (e.g. GPipe vs 1F1B with one stage) are counted as reasons too.

Reasons (a candidate is counted under the first that applies, so the counts add up to the rejected total):
see ``STRUCTURAL_REASONS`` and ``EXPANDED_REASONS``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

from piper_plan.errors import PiperError
from piper_plan.specs import parallel as plan_types

# Code tables: a candidate's code indexes these names, in ParallelPlan's Literal order; piper_plan.cost.evaluate
# uses the same tuples (tests/search/test_space.py checks that they agree).
SCHEDULES: tuple[str, ...] = get_args(plan_types.Schedule)
RECOMPUTE: tuple[str, ...] = get_args(plan_types.Recompute)
A2A: tuple[str, ...] = get_args(plan_types.A2A)

CANDIDATE_FIELDS: tuple[str, ...] = ("dp", "tp", "pp", "ep", "etp", "mbs", "num_microbatches", "schedule",
                                     "virtual_stages", "recompute", "zero", "a2a")

STRUCTURAL_REASONS: tuple[str, ...] = (
    "pp_exceeds_layers",          # pp > num_layers
    "tp_exceeds_node",            # tp > devices_per_node (tp stays inside a node)
    "tp_not_divisor_heads",       # tp must divide num_heads and num_kv_heads
    "etp_not_divisor_tp",         # expert tensor parallelism runs inside the tp group: etp | tp
    "etp_not_divisor_ffn",        # etp must divide the expert intermediate size
    "ep_not_divisor",             # ep must divide num_experts
    "ep_etp_not_divisor_ranks",   # ep x etp must divide a stage's dp x tp ranks
    "ep_exceeds_switch_group",    # --strategy piper: ep <= devices_per_node x nodes_per_switch
    "batch_not_divisible",        # global_batch % (dp x mbs) != 0
)
EXPANDED_REASONS: tuple[str, ...] = (
    "interleaved_needs_pp",                     # interleaving needs at least 2 stages
    "interleaved_exceeds_layers",               # pp x virtual_stages > num_layers
    "interleaved_microbatches_not_divisible",   # Megatron: num_microbatches % pp == 0
    "duplicate_pp1_schedule",                   # pp = 1: GPipe and 1F1B are the same run (1F1B kept)
    "duplicate_one_microbatch_schedule",        # one micro-batch: GPipe and 1F1B are the same run (1F1B kept)
    "duplicate_no_all_to_all",                  # ep = 1: no expert all-to-all, halo = flat (flat kept)
    "duplicate_zero_no_replicas",               # dp = edp = 1: ZeRO-1 shards nothing (zero=0 kept)
    "duplicate_halo_one_node",                  # every expert group inside one node: HALO is its phase I = flat
    "duplicate_selective_flash",                # flash attention keeps no scores: selective = none (none kept)
)


@dataclass(frozen=True)
class SearchOptions:
    """What the search may choose. Defaults: the full (general) space."""

    strategy: Literal["general", "piper"] = "general"
    """general: every valid degree; piper: the paper's PP x EP mesh (tp = 1, dp = ep, ep <= g x N_h)."""
    a2a: Literal["flat", "halo", "any"] = "any"
    """Expert all-to-all algorithms to consider."""
    schedules: tuple[str, ...] = SCHEDULES
    """Pipeline schedules to consider."""
    recompute: tuple[str, ...] = RECOMPUTE
    """Activation recomputation modes to consider."""
    zero: tuple[int, ...] = (0, 1)
    """ZeRO stages to consider."""
    mbs: tuple[int, ...] = (1, 2, 4, 8)
    """Micro-batch sizes (sequences) to consider."""
    virtual_stages: int = 2
    """Model chunks per rank for the interleaved schedule."""
    memory_headroom: float = 0.0
    """Fraction of device memory kept free: a plan fits when peak <= (1 - headroom) x memory."""

    def a2a_names(self) -> tuple[str, ...]:
        return A2A if self.a2a == "any" else (self.a2a,)


@dataclass(frozen=True)
class Space:
    """The structurally valid candidates of one allocation, as int64 arrays named like ``Candidates``' fields."""

    fields: dict[str, np.ndarray]
    """Candidate arrays (codes index SCHEDULES / RECOMPUTE / A2A)."""
    total: int
    """Candidates enumerated, valid or not."""
    reasons: dict[str, int] = field(default_factory=dict)
    """Structural reason -> rejected candidates (only reasons that occurred)."""

    def __len__(self) -> int:
        return len(self.fields["dp"])


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, ascending."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def world_size(platform, nodes: int) -> int:
    return nodes * platform.devices_per_node


def enumerate_space(model, platform, training, nodes: int, options: SearchOptions = SearchOptions()) -> Space:
    """Every candidate of ``nodes`` nodes of ``platform``; the structurally valid ones returned as arrays."""
    world = world_size(platform, nodes)
    grid = _structural_grid(model, platform, world, options)
    first, reason_masks = _structural_reasons(model, platform, training, grid, options)
    _check_batch_admits_some_dp(training, grid, reason_masks, world)
    n_expand = len(options.schedules) * len(options.recompute) * len(options.zero) * len(options.a2a_names())
    reasons = {name: int(count) * n_expand for name, count in first.items() if count}
    valid = {k: v[~np.any(reason_masks, axis=0)] for k, v in grid.items()}
    fields, more = _expand(model, training, valid, options, platform.devices_per_node)
    for name, count in more.items():
        reasons[name] = reasons.get(name, 0) + count
    total = len(grid["pp"]) * n_expand
    return Space(fields=fields, total=total, reasons=reasons)


# ---- step 1: the structural grid --------------------------------------------------------------------
def _structural_grid(model, platform, world: int, options: SearchOptions) -> dict[str, np.ndarray]:
    """Meshgrid of (pp, tp, ep, etp, mbs) over divisor lists, kept where pp x tp divides the world."""
    divs = np.array(divisors(world), dtype=np.int64)
    mbs = np.array(sorted(set(options.mbs)), dtype=np.int64)
    if options.strategy == "piper":
        pp, m = (a.ravel() for a in np.meshgrid(divs, mbs, indexing="ij"))
        one = np.ones_like(pp)
        dp = world // pp
        return {"pp": pp, "tp": one, "dp": dp, "ep": dp.copy(), "etp": one.copy(), "mbs": m}
    ep_values = np.array(_ep_values(model, world), dtype=np.int64)
    etp_values = np.array(divisors(platform.devices_per_node), dtype=np.int64)
    pp, tp, ep, etp, m = (a.ravel() for a in np.meshgrid(divs, divs, ep_values, etp_values, mbs, indexing="ij"))
    keep = world % (pp * tp) == 0
    grid = {"pp": pp[keep], "tp": tp[keep], "ep": ep[keep], "etp": etp[keep], "mbs": m[keep]}
    grid["dp"] = world // (grid["pp"] * grid["tp"])
    if model.moe is None:   # a dense model: no expert axes; etp is irrelevant, keep etp = 1
        sel = grid["etp"] == 1
        grid = {k: v[sel] for k, v in grid.items()}
    return grid


def _ep_values(model, world: int) -> list[int]:
    """ep values to try: divisors of the world and of the expert count (1 for a dense model)."""
    if model.moe is None:
        return [1]
    return sorted(set(divisors(world)) | set(divisors(model.moe.num_experts)))


def _structural_reasons(model, platform, training, g: dict[str, np.ndarray], options: SearchOptions):
    """(first-reason counts, stacked masks): masks[i] is True where STRUCTURAL_REASONS[i] applies."""
    heads, kv = model.attention.num_heads, model.attention.kv_heads
    dpn = platform.devices_per_node
    experts = model.moe.num_experts if model.moe is not None else 1
    expert_ffn = model.moe.expert.intermediate_size if model.moe is not None else 1
    piper = options.strategy == "piper"
    masks = np.stack([
        g["pp"] > model.num_layers,
        g["tp"] > dpn,
        (heads % g["tp"] != 0) | (kv % g["tp"] != 0),
        g["tp"] % g["etp"] != 0,
        expert_ffn % g["etp"] != 0,
        experts % g["ep"] != 0,
        (g["dp"] * g["tp"]) % (g["ep"] * g["etp"]) != 0,
        (g["ep"] > dpn * platform.network.nodes_per_switch) if piper else np.zeros_like(g["pp"], dtype=bool),
        training.global_batch % (g["dp"] * g["mbs"]) != 0,
    ])
    return _first_reason_counts(masks, STRUCTURAL_REASONS), masks


def _first_reason_counts(masks: np.ndarray, names: tuple[str, ...]) -> dict[str, int]:
    """Count each rejected row under the first reason that applies to it."""
    if masks.shape[1] == 0:
        return {}
    any_reason = masks.any(axis=0)
    first = np.argmax(masks, axis=0)[any_reason]
    counts = np.bincount(first, minlength=len(names))
    return {name: int(c) for name, c in zip(names, counts) if c}


def _check_batch_admits_some_dp(training, grid, masks: np.ndarray, world: int) -> None:
    """A global batch that no otherwise-valid dp (with any mbs) divides is a user error, not an empty result."""
    batch_row = STRUCTURAL_REASONS.index("batch_not_divisible")
    others_ok = ~np.delete(masks, batch_row, axis=0).any(axis=0)
    if others_ok.any() and not (others_ok & ~masks[batch_row]).any():
        dps = sorted({int(d) for d in grid["dp"][others_ok]})
        raise PiperError(f"global_batch={training.global_batch} is not divisible by dp x mbs for any valid "
                         f"plan of {world} devices (dp can be {', '.join(map(str, dps[:8]))}); "
                         f"use a multiple of {min(dps)}", field="--global-batch")


# ---- step 2: schedule, recompute, zero, a2a ------------------------------------------------------------
def _expand(model, training, valid: dict[str, np.ndarray], options: SearchOptions, devices_per_node: int):
    """Valid structural rows x (schedule, recompute, zero, a2a); returns (Candidates fields, reason counts)."""
    sched = np.array([SCHEDULES.index(s) for s in options.schedules], dtype=np.int64)
    recomp = np.array([RECOMPUTE.index(r) for r in options.recompute], dtype=np.int64)
    zero = np.array(sorted(set(options.zero)), dtype=np.int64)
    a2a = np.array([A2A.index(a) for a in options.a2a_names()], dtype=np.int64)
    row, s, r, z, a = (x.ravel() for x in np.meshgrid(np.arange(len(valid["pp"])), sched, recomp, zero, a2a,
                                                         indexing="ij"))
    f = {k: v[row] for k, v in valid.items()}
    f.update(schedule=s, recompute=r, zero=z, a2a=a)
    f["num_microbatches"] = training.global_batch // (f["dp"] * f["mbs"])
    interleaved = s == SCHEDULES.index("interleaved")
    f["virtual_stages"] = np.where(interleaved, options.virtual_stages, 1).astype(np.int64)
    twins = _Twins(halo_one_node="flat" in options.a2a_names(),
                   selective="none" in options.recompute and training.flash_attention)
    masks = _expanded_masks(model, f, interleaved, devices_per_node, twins)
    counts = _first_reason_counts(masks, EXPANDED_REASONS)
    keep = ~masks.any(axis=0)
    return {k: np.ascontiguousarray(f[k][keep]) for k in CANDIDATE_FIELDS}, counts


@dataclass(frozen=True)
class _Twins:
    """Which duplicate rules apply: only when the twin that is kept is in the space too."""

    halo_one_node: bool
    selective: bool


def _expanded_masks(model, f: dict[str, np.ndarray], interleaved: np.ndarray, devices_per_node: int,
                    twins: _Twins) -> np.ndarray:
    edp = f["dp"] * f["tp"] // (f["ep"] * f["etp"])
    # expert groups are ep x etp consecutive ranks, aligned on multiples of their size (DESIGN.md rank order)
    groups_in_one_node = devices_per_node % (f["ep"] * f["etp"]) == 0
    return np.stack([
        interleaved & (f["pp"] < 2),
        interleaved & (f["pp"] * f["virtual_stages"] > model.num_layers),
        interleaved & (f["num_microbatches"] % f["pp"] != 0),
        (f["pp"] == 1) & (f["schedule"] == SCHEDULES.index("gpipe")),
        (f["num_microbatches"] == 1) & (f["schedule"] == SCHEDULES.index("gpipe")),
        (f["ep"] == 1) & (f["a2a"] == A2A.index("halo")),
        (f["dp"] == 1) & (edp == 1) & (f["zero"] == 1),
        twins.halo_one_node & (f["ep"] > 1) & groups_in_one_node & (f["a2a"] == A2A.index("halo")),
        twins.selective & (f["recompute"] == RECOMPUTE.index("selective")),
    ])


def take(fields: dict[str, np.ndarray], index) -> dict[str, np.ndarray]:
    """A subset of candidate arrays (boolean mask or integer indices)."""
    return {k: v[index] for k, v in fields.items()}


def describe(fields: dict[str, np.ndarray], i: int) -> dict:
    """Candidate ``i`` as plain Python values with names instead of codes (for output and ParallelPlan)."""
    out = {k: int(fields[k][i]) for k in CANDIDATE_FIELDS}
    out["schedule"] = SCHEDULES[out["schedule"]]
    out["recompute"] = RECOMPUTE[out["recompute"]]
    out["a2a"] = A2A[out["a2a"]]
    out["edp"] = out["dp"] * out["tp"] // (out["ep"] * out["etp"])
    return out
