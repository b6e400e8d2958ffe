"""Expert migration planning: move experts between the ranks of one expert-parallel (EP) group so that
tokens per rank even out. PURE numpy; no torch, no I/O.

Shapes: ``E`` experts per MoE layer, ``G`` ranks in the EP group (``ep``), ``L`` MoE layers, ``n = E / G``
experts per rank. A placement maps each (logical) expert to a rank of the group: int array ``[L, E]`` with
values in ``0..G-1``, each rank holding exactly ``n`` experts of every layer. Loads are tokens routed to each
expert (counts or expected counts, any non-negative numbers): ``[E]`` (one layer) or ``[L, E]``.

Three planners, each returning a frozen :class:`MigrationResult`:

- :func:`hill_climb` — the Piper paper's scheduler (reference/piper-paper.md, "Expert migration"): when a
  layer's max / mean rank load exceeds ``threshold``, for up to ``max_iters`` iterations take the most and the
  least loaded rank and apply the single expert swap between them that most reduces their gap; stop when no
  swap reduces it. A swap of loads ``a`` (from the max rank, load ``H``) and ``b`` (min rank, load ``l``) with
  ``delta = a - b`` leaves the gap ``|H - l - 2 delta|``; it helps iff ``0 < delta < H - l``. Then both new
  loads lie strictly inside ``(l, H)``, so the maximum rank load never rises, and the sum of squared rank
  loads falls by ``2 delta (H - l - delta) > 0``, so the search terminates even without ``max_iters``.
- :func:`greedy_replacement` — a full re-placement by longest-processing-time first with ``n`` slots per rank
  (the balanced packing of DeepSeek's EPLB, ``deepseek-ai/EPLB`` ``balanced_packing``), as a baseline.
- :func:`optimal_replacement` — the exact minimum of the maximum rank load by enumerating every partition into
  equal groups (small cases only), to measure how far the other two are from the best possible.

Worked example (one layer, E = 4, G = 2; pinned by tests/placement/test_migration.py)::

    loads = [8, 6, 2, 1], placement = [0, 0, 1, 1]  -> rank loads [14, 3], mean 8.5, max/mean 1.647
    hill climbing: gap 11; candidate swaps (a, b) -> |11 - 2 (a - b)|: (8,2) 1, (8,1) 3, (6,2) 3, (6,1) 1
    -> first best: expert 0 <-> expert 2 -> placement [1, 0, 0, 1], rank loads [8, 9], max/mean 1.0588
    next: max rank 1 (9), min rank 0 (8), gap 1: no swap with 0 < delta < 1 -> stop. 1 swap, 2 experts moved.
    optimum over the 3 partitions {0,1|2,3} 14, {0,2|1,3} 10, {0,3|1,2} 9 -> max load 9: hill climbing is optimal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import numpy as np


SWAP_RTOL = 1e-9
"""A swap must shift more than this fraction of the mean rank load (and leave the gap shrunk by as much), so
floating-point noise never triggers a swap; exact integer token counts are unaffected."""


@dataclass(frozen=True)
class Swap:
    """Expert ``expert_a`` (on ``rank_a``) and expert ``expert_b`` (on ``rank_b``) trade places in MoE layer
    ``layer`` (the row of the loads array, i.e. the layer's position among MoE layers). Experts are logical ids;
    ranks are indices inside the EP group (0..G-1), so a swap never leaves the group."""

    layer: int
    expert_a: int
    rank_a: int
    expert_b: int
    rank_b: int

    def as_dict(self) -> dict[str, int]:
        return {"layer": self.layer, "expert_a": self.expert_a, "rank_a": self.rank_a,
                "expert_b": self.expert_b, "rank_b": self.rank_b}


@dataclass(frozen=True)
class MigrationResult:
    """What a planner decided for every layer. Arrays are read-only.

    placement_before, placement_after: int ``[L, E]``; rank_loads_before / _after: float ``[L, G]``;
    triggered: bool ``[L]`` (the layer's max/mean exceeded the threshold, so the planner ran on it).
    """

    algorithm: str
    ep: int
    placement_before: np.ndarray
    placement_after: np.ndarray
    rank_loads_before: np.ndarray
    rank_loads_after: np.ndarray
    triggered: np.ndarray
    swaps: tuple[Swap, ...]

    @property
    def imbalance_before(self) -> np.ndarray:
        """float ``[L]``: max / mean rank load of each layer before."""
        return max_over_mean(self.rank_loads_before)

    @property
    def imbalance_after(self) -> np.ndarray:
        """float ``[L]``: max / mean rank load of each layer after."""
        return max_over_mean(self.rank_loads_after)

    @property
    def max_over_mean_before(self) -> float:
        """Whole-model figure: sum over layers of the max rank load / sum of the mean (see step_max_over_mean)."""
        return step_max_over_mean(self.rank_loads_before)

    @property
    def max_over_mean_after(self) -> float:
        return step_max_over_mean(self.rank_loads_after)

    @property
    def num_swaps(self) -> int:
        return len(self.swaps)

    @property
    def experts_moved(self) -> int:
        """Experts (over all layers) whose rank differs between before and after."""
        return int((self.placement_before != self.placement_after).sum())

    @property
    def experts_sent_per_rank(self) -> np.ndarray:
        """int ``[G]``: experts each rank sends away (all layers together) to go from before to after."""
        moved = self.placement_before != self.placement_after
        return np.bincount(self.placement_before[moved], minlength=self.ep).astype(np.int64)


# ---- basic quantities ---------------------------------------------------------------------------------
def contiguous_placement(num_experts: int, ep: int, num_layers: int | None = None) -> np.ndarray:
    """The default placement: expert e on rank e // (E / G). Shape ``[E]``, or ``[L, E]`` with num_layers."""
    _check_divides(num_experts, ep)
    row = np.arange(num_experts, dtype=np.int64) // (num_experts // ep)
    return row if num_layers is None else np.tile(row, (num_layers, 1))


def rank_loads(loads_LE: np.ndarray, placement_LE: np.ndarray, ep: int) -> np.ndarray:
    """Tokens per rank: ``[L, E]`` loads and placement -> float ``[L, G]``."""
    loads_LE, placement_LE = np.atleast_2d(loads_LE), np.atleast_2d(placement_LE)
    num_layers = loads_LE.shape[0]
    flat = placement_LE + ep * np.arange(num_layers)[:, None]
    sums = np.bincount(flat.ravel(), weights=loads_LE.ravel().astype(np.float64), minlength=num_layers * ep)
    return sums.reshape(num_layers, ep)


def max_over_mean(rank_loads_G: np.ndarray) -> np.ndarray:
    """max / mean over the last axis (``[..., G] -> [...]``); 1.0 where no token arrived."""
    mean = rank_loads_G.mean(axis=-1)
    peak = rank_loads_G.max(axis=-1)
    return np.where(mean > 0, peak / np.where(mean > 0, mean, 1.0), 1.0)


def step_max_over_mean(rank_loads_LG: np.ndarray) -> float:
    """One figure for a step: sum_l max_g / sum_l mean_g. Each layer's expert phase lasts as long as its most
    loaded rank, so this is the step's expert time relative to a perfectly balanced one."""
    mean = float(rank_loads_LG.mean(axis=-1).sum())
    return float(rank_loads_LG.max(axis=-1).sum()) / mean if mean > 0 else 1.0


def lower_bound_max_load(loads_E: np.ndarray, ep: int) -> float:
    """A lower bound on any placement's max rank load for one layer: the mean, and the rank that holds the
    heaviest expert holds n - 1 others, at least the n - 1 lightest ones."""
    loads = np.sort(np.asarray(loads_E, dtype=np.float64))
    per_rank = loads.size // ep
    return max(float(loads.sum()) / ep, float(loads[-1] + loads[: per_rank - 1].sum()))


# ---- hill climbing (the paper) --------------------------------------------------------------------------
def hill_climb(loads: np.ndarray, placement: np.ndarray, ep: int, threshold: float = 1.1,
               max_iters: int = 16) -> MigrationResult:
    """The paper's swap search on every layer whose max/mean rank load exceeds ``threshold``.

    loads ``[E]`` or ``[L, E]``; placement ``[E]`` (the same for all layers) or ``[L, E]``; at most
    ``max_iters`` swaps per layer. Returns placements ``[L, E]`` and the swaps in the order applied.
    """
    loads_LE, before_LE = _normalise(loads, placement, ep)
    after_LE = before_LE.copy()
    triggered = max_over_mean(rank_loads(loads_LE, before_LE, ep)) > threshold
    swaps: list[Swap] = []
    for layer in np.flatnonzero(triggered):
        swaps += _hill_climb_layer(loads_LE[layer], after_LE[layer], ep, max_iters, int(layer))
    return _result("hill_climb", ep, loads_LE, before_LE, after_LE, triggered, swaps)


def _hill_climb_layer(loads_E: np.ndarray, placement_E: np.ndarray, ep: int, max_iters: int,
                      layer: int) -> list[Swap]:
    """Swap in place on ``placement_E`` (int ``[E]``); returns the swaps applied."""
    swaps = []
    for _ in range(max_iters):
        swap = _best_swap(loads_E, placement_E, ep, layer)
        if swap is None:
            break
        placement_E[swap.expert_a], placement_E[swap.expert_b] = swap.rank_b, swap.rank_a
        swaps.append(swap)
    return swaps


def _best_swap(loads_E: np.ndarray, placement_E: np.ndarray, ep: int, layer: int) -> Swap | None:
    """The swap between the most and least loaded rank that most reduces their gap (first on ties), or None."""
    per_rank = np.bincount(placement_E, weights=loads_E, minlength=ep)
    hi, lo = int(np.argmax(per_rank)), int(np.argmin(per_rank))
    gap = per_rank[hi] - per_rank[lo]
    tol = SWAP_RTOL * per_rank.mean()
    on_hi, on_lo = np.flatnonzero(placement_E == hi), np.flatnonzero(placement_E == lo)
    delta = loads_E[on_hi][:, None] - loads_E[on_lo][None, :]
    new_gap = np.where((delta > tol) & (delta < gap - tol), np.abs(gap - 2 * delta), np.inf)
    best = int(np.argmin(new_gap))
    if not np.isfinite(new_gap.flat[best]):
        return None
    i, j = divmod(best, on_lo.size)
    return Swap(layer=layer, expert_a=int(on_hi[i]), rank_a=hi, expert_b=int(on_lo[j]), rank_b=lo)


# ---- full re-placement: greedy LPT baseline and the exact optimum ------------------------------------------
def greedy_replacement(loads: np.ndarray, placement: np.ndarray, ep: int,
                       threshold: float = 1.0) -> MigrationResult:
    """EPLB-style balanced packing of every triggered layer: experts by decreasing load, each to the least
    loaded rank that still has a free slot (n per rank). Kept only where it lowers the max rank load."""
    return _replace("greedy", loads, placement, ep, threshold, _lpt_groups)


def optimal_replacement(loads: np.ndarray, placement: np.ndarray, ep: int, threshold: float = 1.0,
                        max_partitions: int = 200_000) -> MigrationResult:
    """The placement with the smallest max rank load, by enumerating all E! / ((n!)^G G!) partitions into
    equal groups (branch and bound). Raises ValueError when that count exceeds ``max_partitions``."""
    count = num_equal_partitions(np.shape(loads)[-1], ep)
    if count > max_partitions:
        raise ValueError(f"{count} partitions of {np.shape(loads)[-1]} experts into {ep} ranks; limit {max_partitions}")
    return _replace("optimal", loads, placement, ep, threshold, _optimal_groups)


def num_equal_partitions(num_experts: int, ep: int) -> int:
    """Ways to split E labelled experts into G unlabelled groups of n = E / G: E! / ((n!)^G G!)."""
    per_rank = num_experts // ep
    return math.factorial(num_experts) // (math.factorial(per_rank) ** ep * math.factorial(ep))


def _replace(name, loads, placement, ep, threshold, grouper) -> MigrationResult:
    loads_LE, before_LE = _normalise(loads, placement, ep)
    loads_before = rank_loads(loads_LE, before_LE, ep)
    triggered = max_over_mean(loads_before) > threshold
    after_LE = before_LE.copy()
    for layer in np.flatnonzero(triggered):
        groups = grouper(loads_LE[layer], ep)
        candidate = _relabel(groups, before_LE[layer], ep)
        if rank_loads(loads_LE[layer], candidate, ep).max() < loads_before[layer].max():
            after_LE[layer] = candidate
    swaps = [s for layer in range(after_LE.shape[0])
             for s in swaps_realising(before_LE[layer], after_LE[layer], layer)]
    return _result(name, ep, loads_LE, before_LE, after_LE, triggered, swaps)


def _lpt_groups(loads_E: np.ndarray, ep: int) -> np.ndarray:
    """Longest processing time first with n slots per rank -> group id per expert, int ``[E]``."""
    per_rank = loads_E.size // ep
    group_E = np.empty(loads_E.size, dtype=np.int64)
    total_G, count_G = np.zeros(ep), np.zeros(ep, dtype=np.int64)
    for expert in np.argsort(-loads_E, kind="stable"):
        open_total = np.where(count_G < per_rank, total_G, np.inf)
        g = int(np.argmin(open_total))
        group_E[expert] = g
        total_G[g] += loads_E[expert]
        count_G[g] += 1
    return group_E


def _optimal_groups(loads_E: np.ndarray, ep: int) -> np.ndarray:
    """Exact min-max partition into equal groups -> group id per expert, int ``[E]``.

    Experts are taken heaviest first; a new group is opened by the heaviest unassigned expert, so each
    partition is visited once; a branch stops when its max group load reaches the best found (LPT's to start).
    """
    order = np.argsort(-loads_E, kind="stable")
    w = loads_E[order].astype(np.float64)
    per_rank = w.size // ep
    best_groups = _lpt_groups(loads_E, ep)[order]
    best = [np.bincount(best_groups, weights=w, minlength=ep).max(), best_groups]
    _search(w, per_rank, np.full(w.size, -1, dtype=np.int64), 0, 0.0, best)
    group_E = np.empty_like(best[1])
    group_E[order] = best[1]
    return group_E


def _search(w, per_rank, group, g, peak, best) -> None:
    """Fill group g with the first unassigned item and per_rank - 1 of the rest; recurse to g + 1."""
    free = np.flatnonzero(group < 0)
    if free.size == 0:
        if peak < best[0]:
            best[0], best[1] = peak, group.copy()
        return
    head, rest = free[0], free[1:]
    for others in combinations(rest, per_rank - 1):
        members = [head, *others]
        load = w[members].sum()
        if max(peak, load) >= best[0]:
            continue
        group[members] = g
        _search(w, per_rank, group, g + 1, max(peak, load), best)
        group[members] = -1


def _relabel(group_E: np.ndarray, placement_E: np.ndarray, ep: int) -> np.ndarray:
    """Name the new groups after old ranks so that few experts move: greedily match the (group, rank) pairs
    sharing the most experts (not an optimal assignment; pure numpy). Returns a placement ``[E]``."""
    pairs, shared = np.unique(np.asarray(group_E, np.int64) * ep + placement_E, return_counts=True)
    rank_of_group, taken = np.full(ep, -1, dtype=np.int64), np.zeros(ep, dtype=bool)
    for flat in pairs[np.argsort(-shared, kind="stable")]:      # most shared first; ties: lower (group, rank)
        g, r = divmod(int(flat), ep)
        if rank_of_group[g] < 0 and not taken[r]:
            rank_of_group[g], taken[r] = r, True
    free = iter(np.flatnonzero(~taken))      # groups sharing no expert with a free rank: lowest free rank first
    for g in np.flatnonzero(rank_of_group < 0):
        rank_of_group[g] = next(free)
    return rank_of_group[group_E]


def swaps_realising(before_E: np.ndarray, after_E: np.ndarray, layer: int = 0) -> list[Swap]:
    """Pairwise swaps that turn placement ``before_E`` into ``after_E`` (equal experts per rank in both).

    Each swap puts at least one expert at its final rank (both when two experts want each other's rank), so
    there are at most as many swaps as moved experts."""
    current = np.array(before_E, dtype=np.int64)
    swaps = []
    for a in np.flatnonzero(current != after_E):
        if current[a] == after_E[a]:
            continue
        src, dst = int(current[a]), int(after_E[a])
        leaving = np.flatnonzero((current == dst) & (after_E != dst))
        exact = leaving[after_E[leaving] == src]
        b = int(exact[0] if exact.size else leaving[0])
        swaps.append(Swap(layer=layer, expert_a=int(a), rank_a=src, expert_b=b, rank_b=dst))
        current[a], current[b] = dst, src
    assert np.array_equal(current, after_E)
    return swaps


# ---- pricing ------------------------------------------------------------------------------------------
def migration_seconds(result: MigrationResult, bytes_per_expert: float, bandwidth_Bps: float) -> float:
    """Time to move the experts: the rank that sends the most bytes, at ``bandwidth_Bps`` per direction.

    All ranks send and receive at once (full duplex links), so the busiest sender sets the time; this is
    how the paper's Table IV prices a full reassignment (bytes sent per GPU / link bandwidth)."""
    return float(result.experts_sent_per_rank.max(initial=0)) * bytes_per_expert / bandwidth_Bps


@dataclass(frozen=True)
class MovePricing:
    """What moving one expert costs on one EP group: bytes per expert and the bandwidth it moves at."""

    params_per_expert: int
    bytes_per_param: int
    counted: str
    """Which training state the bytes include (e.g. 'weights 2 + fp32 master 4 + optimizer 8 B/param')."""
    scope: str
    """Widest network scope the EP group spans: node, switch, group or system."""
    bandwidth_GBps: float
    source: str
    """Which platform field the bandwidth comes from."""

    @property
    def bytes_per_expert(self) -> int:
        return self.params_per_expert * self.bytes_per_param

    @property
    def bandwidth_Bps(self) -> float:
        return self.bandwidth_GBps * 1e9


def expert_move_pricing(model, platform, training, ep: int, with_grads: bool = False,
                        placement: str = "compact") -> MovePricing:
    """Price a migrated expert of ``model`` inside an EP group of ``ep`` ranks on ``platform``.

    Bytes: the expert's parameters (specs.params.ffn_params) x the per-parameter state that must move:
    working weights + fp32 master + optimizer state (TrainingSpec; 2 + 4 + 8 = 14 B by default). Gradients
    are left out by default because migration runs at a step boundary, after the optimizer step
    (reference/piper-paper.md, "Expert migration" [inferred]); ``with_grads`` adds them, giving the paper's
    16 B/param = 48 d d_ffn bytes for a 3-matrix expert.
    """
    from piper_plan.specs.params import ffn_params

    t = training
    parts = [("weights", t.weight_bytes)] + ([("grads", t.grad_bytes)] if with_grads else [])
    parts += [("fp32 master", t.master_bytes), ("optimizer", t.optimizer_bytes)]
    parts = [(name, b) for name, b in parts if b]
    counted = " + ".join(f"{name} {b}" for name, b in parts) + " B/param"
    scope, bandwidth_GBps, source = ep_group_bandwidth(platform, ep, placement)
    return MovePricing(params_per_expert=ffn_params(model.moe.expert, model.hidden_size),
                       bytes_per_param=sum(b for _, b in parts), counted=counted, scope=scope,
                       bandwidth_GBps=bandwidth_GBps, source=source)


def ep_group_bandwidth(platform, ep: int, placement: str = "compact") -> tuple[str, float, str]:
    """(scope, GB/s per direction, field) of an EP group of ``ep`` consecutive ranks (DESIGN.md rank order).

    Inside one node: the slowest link class joining any two of its local devices (platform node.link_classes).
    Across nodes: the scope the group spans on a ``compact`` or ``spread`` allocation (placement.layout,
    the cost model's own scope logic) and that scope's network.scopes bandwidth."""
    per_node = platform.node.devices_per_node
    if ep <= per_node:
        pairs = list(combinations(range(ep), 2)) or [(0, 0)]
        slowest = min((_link_class(platform.node, pair) for pair in pairs), key=lambda c: c.bandwidth_GBps)
        return "node", slowest.bandwidth_GBps, f"node.link_classes[{slowest.name}]"
    from piper_plan.placement.layout import allocation, group_span

    nodes = math.lcm(ep, per_node) // per_node
    scope = group_span(allocation(platform, nodes, placement), 1, ep).scope
    if scope not in platform.network.scopes:
        from piper_plan.errors import PiperError

        raise PiperError(f"platform {platform.name} has no network.scopes.{scope} entry; an EP group of {ep} "
                         f"ranks spans {scope} scope", field=f"network.scopes.{scope}")
    return scope, platform.network.scopes[scope].bandwidth_GBps, f"network.scopes.{scope}"


def _link_class(node, pair: tuple[int, int]):
    """The link class joining two local devices: the one listing the pair, else the catch-all class."""
    for c in node.link_classes:
        if c.device_pairs and {pair, pair[::-1]} & set(map(tuple, c.device_pairs)):
            return c
    catch_all = [c for c in node.link_classes if c.device_pairs is None]
    return catch_all[0] if catch_all else min(node.link_classes, key=lambda c: c.bandwidth_GBps)


def summary(result: MigrationResult, pricing: MovePricing | None = None) -> dict:
    """A result as JSON-ready numbers; bytes_moved and time_s are None without pricing.

    bytes_moved counts each expert whose rank changed once (the net transfer from before to after);
    time_s is the busiest sender's bytes at the group's bandwidth (migration_seconds)."""
    moved = result.experts_moved
    return {
        "before": {"max_over_mean": result.max_over_mean_before, "per_layer": result.imbalance_before.tolist()},
        "after": {"max_over_mean": result.max_over_mean_after, "per_layer": result.imbalance_after.tolist()},
        "layers_triggered": int(result.triggered.sum()),
        "num_swaps": result.num_swaps,
        "experts_moved": moved,
        "max_experts_sent_per_rank": int(result.experts_sent_per_rank.max(initial=0)),
        "bytes_moved": None if pricing is None else moved * pricing.bytes_per_expert,
        "time_s": None if pricing is None else migration_seconds(result, pricing.bytes_per_expert, pricing.bandwidth_Bps),
    }


def bound_max_over_mean(loads: np.ndarray, ep: int) -> float:
    """The step figure (step_max_over_mean) no placement can beat: per layer lower_bound_max_load."""
    loads_LE = np.atleast_2d(np.asarray(loads, dtype=np.float64))
    mean = loads_LE.sum() / ep
    bound = sum(lower_bound_max_load(row, ep) for row in loads_LE)
    return float(bound / mean) if mean > 0 else 1.0


# ---- helpers ------------------------------------------------------------------------------------------
def _check_divides(num_experts: int, ep: int) -> None:
    if ep < 1 or num_experts % ep:
        raise ValueError(f"ep={ep} must divide num_experts={num_experts}")


def _normalise(loads, placement, ep) -> tuple[np.ndarray, np.ndarray]:
    """-> loads float ``[L, E]`` and a private int copy of the placement ``[L, E]``; checks equal slots."""
    loads_LE = np.atleast_2d(np.asarray(loads, dtype=np.float64))
    num_layers, num_experts = loads_LE.shape
    _check_divides(num_experts, ep)
    if (loads_LE < 0).any() or not np.isfinite(loads_LE).all():
        raise ValueError("loads must be finite and non-negative")
    placement_LE = np.broadcast_to(np.asarray(placement, dtype=np.int64), loads_LE.shape).copy()
    counts = np.apply_along_axis(np.bincount, 1, placement_LE.clip(0, ep - 1), minlength=ep)
    if placement_LE.min() < 0 or placement_LE.max() >= ep or (counts != num_experts // ep).any():
        raise ValueError(f"placement must put exactly {num_experts // ep} experts on each of the {ep} ranks")
    return loads_LE, placement_LE


def _result(name, ep, loads_LE, before_LE, after_LE, triggered, swaps) -> MigrationResult:
    arrays = [before_LE, after_LE, rank_loads(loads_LE, before_LE, ep), rank_loads(loads_LE, after_LE, ep),
              np.asarray(triggered, dtype=bool)]
    for a in arrays:
        a.setflags(write=False)
    return MigrationResult(name, ep, *arrays[:4], triggered=arrays[4], swaps=tuple(swaps))
