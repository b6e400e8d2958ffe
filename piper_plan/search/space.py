"""Candidate generation: every (dp, cp, tp, pp, ep, etp, mbs, schedule, recompute, zero, a2a) of one allocation.

Pure numpy (no torch, no I/O). Vocabulary from DESIGN.md and docs/design-notes.md:
``world = nodes x devices_per_node = pp x dp x cp x tp``; experts regroup a stage's ``dp x cp x tp`` ranks as
``ep x etp x edp``; ``num_microbatches = global_batch / (dp x mbs)``.

The space is a cartesian product: divisor lists per axis, broadcast with ``np.meshgrid`` (no Python loop per
candidate). Validity is ``piper_plan.plans``' rules, applied in two steps so that the big product never
materialises for structurally invalid rows:

1. the *structural* grid (pp, tp, cp, ep, etp, mbs) with ``pp x tp x cp`` dividing the world (dp is derived), checked by
   the rules that depend on those fields only; each invalid row is counted under its first reason, times the
   number of (schedule, recompute, zero, a2a) combinations it stands for;
2. the valid rows times (schedule, recompute, zero, a2a), checked by the remaining rules, then by the search's
   own named masks, which are not validity: the strategy restriction (``STRATEGY_REASONS``) and duplicates of a
   kept twin (``DUPLICATE_REASONS``).

Every enumerated candidate is counted under exactly one name (the first that applies, in the order invalid,
strategy, duplicate), so the counts add up to the rejected total, and the invalid counts equal the tally of
``plans.problems`` over the whole enumerated space (tests/search/test_validity.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from piper_plan.cost.options import DEFAULT_OPTIONS, acting_modules
from piper_plan.errors import CountRefused, PiperError
from piper_plan.plans import (RULES, PlanBatch, array_fields, check_setting, cp_splits_sequence, described,
                              problem_masks, reason_counts)
from piper_plan.specs.parallel import Degree
from piper_plan.specs.vocab import A2A, LayerSplit, Recompute, Schedule

ScheduleName = Literal[Schedule.values()]
RecomputeName = Literal[Recompute.values()]

CANDIDATE_FIELDS: tuple[str, ...] = array_fields()
STRUCTURAL_RULES = tuple(r for r in RULES if r.level != "schedule")
SCHEDULE_RULES = tuple(r for r in RULES if r.level == "schedule")

STRATEGY_REASONS: tuple[str, ...] = (
    "ep_exceeds_switch_group",          # --strategy piper: ep <= devices_per_node x nodes_per_switch
)
DUPLICATE_REASONS: tuple[str, ...] = (
    "duplicate_pp1_schedule",                   # pp = 1: GPipe and 1F1B are the same run (1F1B kept)
    "duplicate_one_microbatch_schedule",        # one micro-batch: GPipe and 1F1B are the same run (1F1B kept)
    "duplicate_no_all_to_all",                  # ep = 1: no expert all-to-all, halo = flat (flat kept)
    "duplicate_zero_no_replicas",               # dp x cp = 1, edp = 1 or dense: ZeRO 1-3 shard nothing (zero=0 kept)
    "duplicate_halo_one_node",                  # every expert group inside one node: HALO is its phase I = flat
    "duplicate_selective_flash",                # flash attention keeps no scores: selective = none (none kept)
)


@dataclass(frozen=True)
class SearchOptions:
    """What the search may choose. Defaults: the full (general) space. The annotations bound what a dataset row's
    ``search`` mapping may say (validated by pydantic, catalog.parse_spec); the CLI checks its own options."""

    __pydantic_config__ = {"extra": "forbid"}

    strategy: Literal["general", "piper"] = "general"
    """general: every valid degree; piper: the paper's PP x EP mesh (tp = 1, dp = ep, ep <= g x N_h)."""
    a2a: Literal["flat", "halo", "any"] = "any"
    """Expert all-to-all algorithms to consider."""
    schedules: tuple[ScheduleName, ...] = Schedule.values()
    """Pipeline schedules to consider."""
    recompute: tuple[RecomputeName, ...] = Recompute.values()
    """Activation recomputation modes to consider."""
    zero: tuple[Literal[0, 1, 2, 3], ...] = (0, 1, 2, 3)
    """ZeRO stages to consider."""
    mbs: tuple[Degree, ...] = (1, 2, 4, 8)
    """Micro-batch sizes (sequences) to consider."""
    cp: tuple[Degree, ...] | None = None
    """Context-parallel degrees to consider; None = ``default_cp(seq_len)``."""
    virtual_stages: tuple[Degree, ...] | None = None
    """Model chunks per rank the interleaved schedule is tried with, each a plan of its own (a count whose chunks
    Megatron-Core's rule cannot lay out is dropped by the schedule rules); None: ``chunk_counts``' default."""
    expert_tp: bool = False
    """Also search expert tensor parallelism (etp > 1). Off by default: piper's runtime never tensor-splits experts,
    and in piper's own cost model etp > 1 is the best plan in 1 of 9 catalog cases, by 1.4%
    (benchmarks/etp_value.py)."""
    memory_headroom: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    """Fraction of device memory kept free: a plan fits when peak <= (1 - headroom) x memory."""

    def a2a_names(self) -> tuple[str, ...]:
        return A2A.values() if self.a2a == "any" else (self.a2a,)

    def chunk_counts(self) -> tuple[int, ...]:
        """``virtual_stages`` as given, else 2, 3 and 4 for the general strategy and 2 for the paper's mesh (the
        space its reproduction and the piper-frontier-moe rows were searched in, weak-110b's fit included). The
        general space searched 2 only until 2026-12-05: the published vp 3 and 4 runs (Korthikanti et al.'s 175B and
        530B, NVIDIA's DeepSeek-V3 and Qwen3-235B rows) were outside it, and its best plan could be slower than
        they are as priced (530B on 35 DGX A100: 38.9 s against the published vp 3's 36.6)."""
        if self.virtual_stages is not None:
            return tuple(sorted(set(self.virtual_stages)))
        return (2,) if self.strategy == "piper" else (2, 3, 4)


@dataclass(frozen=True)
class Space:
    """The structurally valid candidates of one allocation, as int64 arrays named like ``Candidates``' fields."""

    fields: dict[str, np.ndarray]
    """PlanBatch arrays (enum axes as specs.vocab codes)."""
    total: int
    """Candidates enumerated, valid or not."""
    reasons: dict[str, int] = field(default_factory=dict)
    """Reason -> rejected candidates (invalid, strategy, duplicate; only reasons that occurred)."""

    def batch(self) -> PlanBatch:
        return PlanBatch.from_arrays(self.fields)

    def __len__(self) -> int:
        return len(self.fields["dp"])


CP_MIN_SEQ_LEN = 16384
"""Shortest sequence for which the default space tries context parallelism: below it a rank's chunk falls under
8k tokens at cp = 2, where the KV ring is hard to hide behind attention (Megatron-Core's long-context recipes
start at 16k-32k)."""
DEFAULT_CP = (1, 2, 4, 8)
"""cp values of the default space for sequences of CP_MIN_SEQ_LEN tokens or more."""


def default_cp(seq_len: int) -> tuple[int, ...]:
    """The cp values the search tries by default: 1, and from CP_MIN_SEQ_LEN tokens on 2, 4 and 8."""
    return DEFAULT_CP if seq_len >= CP_MIN_SEQ_LEN else (1,)


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, ascending."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def world_size(platform, nodes: int) -> int:
    return nodes * platform.devices_per_node


def enumerate_space(model, platform, training, nodes: int, options: SearchOptions = SearchOptions(),
                    recompute_modules: tuple[str, ...] = DEFAULT_OPTIONS.recompute_modules) -> Space:
    """Every candidate of ``nodes`` nodes of ``platform``; the ones kept returned as arrays. ``recompute_modules``:
    what selective recompute re-runs (the cost options'), which decides whether it duplicates no recompute."""
    check_setting(model, platform, training, nodes)
    world = world_size(platform, nodes)
    _check_cp_divides_world(options, world)
    _check_cp_divides_sequence(options, training.seq_len)
    grid = structural_grid(model, platform, training, world, options)
    masks = problem_masks(model, platform, training, nodes, grid, STRUCTURAL_RULES)
    _check_batch_admits_some_dp(training, grid, masks, world)
    n_expand = schedule_variants(options) * len(options.recompute) * len(options.zero) * len(options.a2a_names())
    names = tuple(r.name for r in STRUCTURAL_RULES)
    reasons = {name: count * n_expand for name, count in reason_counts(masks, names).items()}
    expanded = expand(grid.take(~masks.any(axis=0)), training, options)
    masks = np.concatenate([problem_masks(model, platform, training, nodes, expanded, SCHEDULE_RULES),
                            search_masks(model, platform, training, expanded, options, recompute_modules)])
    names = tuple(r.name for r in SCHEDULE_RULES) + STRATEGY_REASONS + DUPLICATE_REASONS
    for name, count in reason_counts(masks, names).items():
        reasons[name] = reasons.get(name, 0) + count
    keep = expanded.take(~masks.any(axis=0))
    return Space(fields=keep.arrays(), total=len(grid) * n_expand, reasons=reasons)


# ---- step 1: the structural grid --------------------------------------------------------------------
def structural_grid(model, platform, training, world: int, options: SearchOptions) -> PlanBatch:
    """Meshgrid of (pp, tp, ep, etp, mbs) over divisor lists, kept where pp x tp divides the world; the other
    axes at their first value (step 2 expands them)."""
    divs = np.array(divisors(world), dtype=np.int64)
    mbs = np.array(sorted(set(options.mbs)), dtype=np.int64)
    if options.strategy == "piper":
        pp, m = (a.ravel() for a in np.meshgrid(divs, mbs, indexing="ij"))
        one = np.ones_like(pp)
        grid = {"pp": pp, "tp": one, "cp": one, "dp": world // pp, "ep": world // pp, "etp": one, "mbs": m}
    else:
        ep_values = np.array(_ep_values(model, world), dtype=np.int64)
        etp_values = np.array(divisors(platform.devices_per_node) if options.expert_tp else [1], dtype=np.int64)
        cp_values = np.array(sorted(set(options.cp or default_cp(training.seq_len))), dtype=np.int64)
        pp, tp, cp, ep, etp, m = (a.ravel() for a in np.meshgrid(divs, divs, cp_values, ep_values, etp_values, mbs,
                                                                 indexing="ij"))
        keep = world % (pp * tp * cp) == 0
        grid = {"pp": pp[keep], "tp": tp[keep], "cp": cp[keep], "ep": ep[keep], "etp": etp[keep], "mbs": m[keep]}
        grid["dp"] = world // (grid["pp"] * grid["tp"] * grid["cp"])
        if model.moe is None:   # a dense model: no expert axes; etp is irrelevant, keep etp = 1
            sel = grid["etp"] == 1
            grid = {k: v[sel] for k, v in grid.items()}
    n = len(grid["pp"])
    return PlanBatch(**grid, num_microbatches=np.maximum(training.global_batch // (grid["dp"] * grid["mbs"]), 1),
                     schedule=np.full(n, Schedule.ONE_F_ONE_B.code), virtual_stages=1,
                     recompute=Recompute.NONE.code, zero=0, a2a=A2A.FLAT.code, sequence_parallel=1,
                     layers_split=LayerSplit.AUTO.code)


def _ep_values(model, world: int) -> list[int]:
    """ep values to try: divisors of the world and of the expert count (1 for a dense model)."""
    if model.moe is None:
        return [1]
    return sorted(set(divisors(world)) | set(divisors(model.moe.num_experts)))


def _check_cp_divides_world(options: SearchOptions, world: int) -> None:
    """Context-parallel degrees asked for (--cp) of which none divides the world are a user error, not an empty
    result."""
    if options.cp and not any(world % cp == 0 for cp in options.cp):
        raise CountRefused(f"{','.join(map(str, options.cp))}: no context-parallel degree divides the world of {world} "
                         f"devices (nodes x devices_per_node); cp can be a divisor of {world}", field="--cp")


def _check_cp_divides_sequence(options: SearchOptions, seq_len: int) -> None:
    """Asked-for context-parallel degrees of which none splits the sequence (plans.py rule cp_not_divisor_seq: 2 cp
    equal chunks) are a user error, as in `estimate`, not "nothing fits"."""
    if options.cp and not cp_splits_sequence(list(options.cp), seq_len).any():
        raise PiperError(f"{','.join(map(str, options.cp))}: no context-parallel degree splits the sequence of "
                         f"{seq_len} tokens into 2 x cp equal chunks (the load-balanced causal split); cp > 1 needs "
                         f"seq_len divisible by 2 x cp", field="--cp")


def cp_left_out(options: SearchOptions, world: int, seq_len: int) -> list[str]:
    """The asked-for context-parallel degrees (--cp) that no plan of ``world`` devices at ``seq_len`` tokens can
    have, each with why (the checks above refuse the list only when no degree is left)."""
    out = []
    for cp in options.cp or ():
        if world % cp:
            out.append(f"cp {cp} does not divide the world of {world} devices")
        elif not cp_splits_sequence([cp], seq_len).any():
            out.append(f"cp {cp} does not split the sequence of {seq_len} tokens into 2 x cp equal chunks")
    return out


def _check_batch_admits_some_dp(training, grid: PlanBatch, masks: np.ndarray, world: int) -> None:
    """A global batch that no otherwise-valid dp (with any mbs) divides is a user error, not an empty result."""
    batch_row = [r.name for r in STRUCTURAL_RULES].index("batch_not_divisible")
    others_ok = ~np.delete(masks, batch_row, axis=0).any(axis=0)
    if others_ok.any() and not (others_ok & ~masks[batch_row]).any():
        dps = sorted({int(d) for d in grid.dp[others_ok]})
        raise CountRefused(f"global_batch={training.global_batch} is not divisible by dp x mbs for any valid "
                         f"plan of {world} devices (dp can be {', '.join(map(str, dps[:8]))}); "
                         f"use a multiple of {min(dps)}", field="--global-batch")


# ---- step 2: schedule, recompute, zero, a2a ------------------------------------------------------------
def expand(valid: PlanBatch, training, options: SearchOptions) -> PlanBatch:
    """Structurally valid rows x (schedule, recompute, zero, a2a)."""
    sched = np.array(Schedule.codes(options.schedules), dtype=np.int64)
    recomp = np.array(Recompute.codes(options.recompute), dtype=np.int64)
    zero = np.array(sorted(set(options.zero)), dtype=np.int64)
    a2a = np.array(A2A.codes(options.a2a_names()), dtype=np.int64)
    row, s, r, z, a = (x.ravel() for x in np.meshgrid(np.arange(len(valid)), sched, recomp, zero, a2a,
                                                         indexing="ij"))
    f = valid.take(row).arrays()
    f.update(schedule=s, recompute=r, zero=z, a2a=a)
    f["num_microbatches"] = training.global_batch // (f["dp"] * f["mbs"])
    return PlanBatch.from_arrays(_with_virtual_stages(f, options))


def schedule_variants(options: SearchOptions) -> int:
    """Schedules x chunk counts one structural candidate expands to: the interleaved schedule once per
    ``virtual_stages`` value, the others once."""
    interleaved = Schedule.INTERLEAVED.value in options.schedules
    return len(options.schedules) - interleaved + interleaved * len(options.chunk_counts())


def _with_virtual_stages(f: dict[str, np.ndarray], options: SearchOptions) -> dict[str, np.ndarray]:
    """Candidate arrays with each interleaved row repeated once per ``virtual_stages`` value (consecutively, in
    ascending order) and every other row kept once at virtual_stages 1."""
    interleaved = f["schedule"] == Schedule.INTERLEAVED.code
    values = np.array(options.chunk_counts(), dtype=np.int64)
    rows = np.repeat(np.arange(len(interleaved)), np.where(interleaved, len(values), 1))
    out = {k: v[rows] for k, v in f.items()}
    vp = np.ones(len(rows), dtype=np.int64)
    vp[interleaved[rows]] = np.tile(values, int(interleaved.sum()))
    out["virtual_stages"] = vp
    return out


def search_masks(model, platform, training, c: PlanBatch, options: SearchOptions,
                 recompute_modules: tuple[str, ...] = DEFAULT_OPTIONS.recompute_modules) -> np.ndarray:
    """[len(STRATEGY_REASONS) + len(DUPLICATE_REASONS), N]: what the search drops besides invalid plans. A
    duplicate rule applies only when the twin it keeps is in the space too; selective recompute duplicates none
    only under flash attention with nothing but core_attn acting on the model (other modules drop activations and
    add time; cost/options.py acting_modules)."""
    dpn = platform.devices_per_node
    piper = options.strategy == "piper"
    gpipe, halo = c.schedule == Schedule.GPIPE.code, c.a2a == A2A.HALO.code
    groups_in_one_node = dpn % (c.ep * c.etp) == 0       # expert groups: ep x etp consecutive, aligned ranks
    halo_twin = "flat" in options.a2a_names()
    zero_twin = 0 in options.zero       # nothing to shard: zero >= 1 is zero 0 (a dense model has no expert replicas)
    acting = acting_modules(model, recompute_modules)
    selective_twin = "none" in options.recompute and training.flash_attention and set(acting) <= {"core_attn"}
    return np.stack([
        (c.ep > dpn * platform.network.nodes_per_switch) if piper else np.zeros(len(c), dtype=bool),
        (c.pp == 1) & gpipe,
        (c.num_microbatches == 1) & gpipe,
        (c.ep == 1) & halo,
        zero_twin & (c.dp_cp == 1) & ((c.edp == 1) | (model.moe is None)) & (c.zero >= 1),
        halo_twin & (c.ep > 1) & groups_in_one_node & halo,
        selective_twin & (c.recompute == Recompute.SELECTIVE.code),
    ])


def take(fields: dict[str, np.ndarray], index) -> dict[str, np.ndarray]:
    """A subset of candidate arrays (boolean mask or integer indices)."""
    return {k: v[index] for k, v in fields.items()}


def describe(fields: dict[str, np.ndarray], i: int) -> dict:
    """Candidate ``i`` as plain Python values with names instead of codes (for output and ParallelPlan)."""
    codes = {}
    for name in array_fields():                    # candidate i alone: a batch of every candidate per call was O(n^2)
        values = np.atleast_1d(fields[name])
        codes[name] = int(values[i if len(values) > 1 else 0])
    return described(codes)
