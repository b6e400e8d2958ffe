"""Live expert migration (Piper paper, reference/piper-paper.md "Expert migration"; issue 8, runtime part).

Legend: L MoE layers this rank holds (its stage, or all its chunks when interleaved; rows in global-layer
order), E experts per layer, G = ep ranks of the expert-parallel (EP) group, El = E / G slots per rank.
Experts have **logical** ids (the router's output index, what metrics.jsonl's ``expert_tokens`` is indexed by)
and live in **slots**: slot s of a layer is local index ``s % El`` of the stacked ``LocalExperts`` weights on
EP group-rank ``s // El``. ``MoE.slot_of_expert``
(int64 ``[E]``, a persistent buffer, so checkpoints keep the placement) maps logical expert -> slot; the router
is never touched, so a migration leaves the function the model computes exactly unchanged.

At a step boundary every ``interval`` steps (:meth:`ExpertMigrator.step_boundary`), on every rank of a stage:

1. loads: tokens per logical expert summed over the last ``window`` steps (this rank's routing decisions);
   summed over the EDP group (all_reduce), then gathered over the EP group (all_gather) and summed, so every
   rank of the stage holds the stage's integer token counts, bit-identical on every EP group;
2. plan: EP group-rank 0 runs ``placement.migration.hill_climb`` (threshold, max_iters from the plan) and
   broadcasts the swaps inside its EP group;
3. move: the slots whose occupant changes are exchanged point-to-point inside the EP group (one packed byte
   buffer per peer, ``batch_isend_irecv``): weights, gradients when present, and every optimizer state tensor
   shaped like the parameter (Adam ``exp_avg``, ``exp_avg_sq``; an fp32 master where one exists as optimizer
   state). Adam's ``step`` is per stacked tensor, not per expert: it travels along and is checked equal.

Replicas: the EDP ranks holding the same experts (one per EP group of the stage) see identical loads (step 1),
so their rank-0 schedulers plan identical swaps and every replica applies the same permutation — expert
replicas stay bit-identical without exchanging anything across EP groups. With ZeRO-1 the owner of an expert
tensor's optimizer shard is the same EDP index in every EP group (same parameter list), so both ends of a
transfer hold the state or neither does. With zero 2/3 (runtime/sharding.py) the experts are FSDP2-sharded over edp
on dim 1: every edp rank holds the same slice of every local expert, so each EP group exchanges the local shards
(``to_local()``) of the moved slots, of their gradients and of their optimizer state (1/edp of the bytes each),
and the EP groups together move whole experts; nothing crosses EP groups.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from piper_plan.planfile import MigrationBlock
from piper_plan.placement.migration import Swap, hill_climb, rank_loads, step_max_over_mean


# ---- pure: slot maps and transfer lists ------------------------------------------------------------
def apply_swaps(slot_of_LE: np.ndarray, swaps) -> np.ndarray:
    """Slot maps ``[L, E]`` (logical expert -> slot) after the swaps, in order; the input is not modified."""
    out = np.array(slot_of_LE, dtype=np.int64, copy=True)
    for s in swaps:
        out[s.layer, s.expert_a], out[s.layer, s.expert_b] = out[s.layer, s.expert_b], out[s.layer, s.expert_a]
    return out


@dataclass(frozen=True)
class Move:
    """The expert now in slot ``src_slot`` of row ``row`` goes to slot ``dst_slot``."""

    row: int
    src_slot: int
    dst_slot: int


def slot_moves(before_LE: np.ndarray, after_LE: np.ndarray) -> list[Move]:
    """Every slot whose occupant changes, ordered by (row, destination slot) — the order both ends use."""
    moves = []
    for row in range(before_LE.shape[0]):
        for expert in np.argsort(after_LE[row], kind="stable"):
            src, dst = int(before_LE[row, expert]), int(after_LE[row, expert])
            if src != dst:
                moves.append(Move(row, src, dst))
    return moves


def rank_transfers(moves: list[Move], num_local: int, me: int) -> tuple[dict, dict, list]:
    """This EP group-rank's share: ({peer: [Move] to send}, {peer: [Move] to receive}, [local Move])."""
    sends: dict[int, list[Move]] = {}
    recvs: dict[int, list[Move]] = {}
    local = []
    for m in moves:
        src, dst = m.src_slot // num_local, m.dst_slot // num_local
        if src == me and dst == me:
            local.append(m)
        elif src == me:
            sends.setdefault(dst, []).append(m)
        elif dst == me:
            recvs.setdefault(src, []).append(m)
    return sends, recvs, local


def placement_from_slots(slot_of_LE: np.ndarray, num_local: int) -> np.ndarray:
    """Logical expert -> EP group-rank, ``[L, E]`` (the planner's placement)."""
    return np.asarray(slot_of_LE, dtype=np.int64) // num_local


# ---- torch: what travels with an expert ----------------------------------------------------------
def _adam_states(optimizers) -> list[dict]:
    """The state dicts of the wrapped torch optimizers (ZeroRedundancyOptimizer keeps its shard in .optim)."""
    return [getattr(o, "optim", o).state for o in optimizers]


def slot_tensors(experts: torch.nn.Module, optimizers) -> list[torch.Tensor]:
    """Every tensor stacked ``[El, ...]`` that belongs to an expert slot: parameters, gradients when present,
    and optimizer state shaped like the parameter. Same order on every rank (named_parameters, sorted keys)."""
    from piper_plan.runtime.sharding import local

    states = _adam_states(optimizers)
    out = []
    for _, p in experts.named_parameters():
        out.append(local(p.data))
        if p.grad is not None:
            out.append(local(p.grad))
        for st in states:
            for key in sorted(st.get(p, {})):
                v = st[p][key]
                if torch.is_tensor(v) and v.shape == p.shape:
                    out.append(local(v))
    return out


def step_counters(experts: torch.nn.Module, optimizers) -> torch.Tensor:
    """float64 ``[n]``: the optimizer's ``step`` of every stacked expert tensor that has one."""
    steps = [float(st[p]["step"]) for _, p in experts.named_parameters()
             for st in _adam_states(optimizers) if "step" in st.get(p, {})]
    return torch.tensor(steps, dtype=torch.float64)


def pack(tensors: list[torch.Tensor], local_slots: list[int], extra: torch.Tensor) -> torch.Tensor:
    """uint8 buffer: for each slot, each tensor's row ``[slot]`` (raw bytes), then ``extra``'s bytes."""
    parts = [t[j].contiguous().reshape(-1).view(torch.uint8) for j in local_slots for t in tensors]
    parts.append(extra.to(tensors[0].device).contiguous().view(torch.uint8))
    return torch.cat(parts)


def packed_bytes(tensors: list[torch.Tensor], num_slots: int, extra: torch.Tensor) -> int:
    return num_slots * sum(t[0].numel() * t.element_size() for t in tensors) + extra.numel() * extra.element_size()


def unpack(buf: torch.Tensor, tensors: list[torch.Tensor], local_slots: list[int], extra_like: torch.Tensor):
    """Write ``buf`` (from :func:`pack`) into rows ``local_slots`` of ``tensors``; return the extra tensor."""
    offset = 0
    for j in local_slots:
        for t in tensors:
            n = t[0].numel() * t.element_size()
            t[j].copy_(buf[offset: offset + n].clone().view(t.dtype).view(t[j].shape))  # clone: aligned
            offset += n
    n = extra_like.numel() * extra_like.element_size()
    return buf[offset: offset + n].cpu().clone().view(extra_like.dtype)


# ---- the load monitor ----------------------------------------------------------------------------
class LoadMonitor:
    """Tokens per logical expert of each MoE layer, summed over the last ``window`` steps (int64 ``[L, E]``)."""

    def __init__(self, moe_layers: dict, window: int) -> None:
        self.layers = [moe_layers[i] for i in sorted(moe_layers)]
        self.history: deque = deque(maxlen=max(1, window))

    def observe(self) -> None:
        """Call once per step, after the step and before the counters are reset."""
        self.history.append(np.stack([m.expert_tokens.cpu().numpy().astype(np.int64) for m in self.layers]))

    def window_tokens(self) -> np.ndarray:
        if not self.history:
            return np.zeros((len(self.layers), self.layers[0].spec.num_experts), dtype=np.int64)
        return np.sum(np.stack(self.history), axis=0)


# ---- the migrator ------------------------------------------------------------------------------------
class ExpertMigrator:
    """This rank's part of migration for the MoE layers of its stage. Every rank of the stage calls
    :meth:`observe` after each step and :meth:`step_boundary` at each step boundary (collective over the
    stage's EP and EDP groups)."""

    def __init__(self, moe_layers: dict, optimizers: list, ep_group, ep_ranks: list[int], edp_group,
                 settings: MigrationBlock, rank: int) -> None:
        self.layer_ids = sorted(moe_layers)
        self.layers = [moe_layers[i] for i in self.layer_ids]
        self.optimizers, self.settings = optimizers, settings
        self.ep_group, self.ep_ranks, self.edp_group = ep_group, list(ep_ranks), edp_group
        self.me = self.ep_ranks.index(rank)
        self.num_local = self.layers[0].num_local
        self.monitor = LoadMonitor(moe_layers, settings.window_steps)
        self.device = self.layers[0].experts.w_in.device

    @classmethod
    def from_trainer(cls, trainer, settings: MigrationBlock) -> "ExpertMigrator | None":
        """For a runtime Trainer; None when there is nothing to migrate (disabled, ep = 1, no MoE layer here)."""
        layers = trainer.module.moe_layers()
        if not settings.enabled or trainer.cfg.parallel.ep < 2 or not layers:
            return None
        mesh = trainer.mesh
        mine = next(g for g in mesh.ep_group_ranks if trainer.rank in g)
        return cls(layers, trainer.optimizer.optims, mesh.ep_group, mine, mesh.edp_group, settings, trainer.rank)

    # -- public
    def observe(self) -> None:
        self.monitor.observe()

    def step_boundary(self, step: int) -> dict | None:
        """After step ``step`` (0-based) finished: migrate when ``(step + 1) % interval == 0``."""
        if (step + 1) % self.settings.interval:
            return None
        return self.migrate(step + 1)

    def slot_maps(self) -> np.ndarray:
        """int64 ``[L, E]``: logical expert -> slot, per MoE layer of this stage."""
        return np.stack([m.slot_of_expert.cpu().numpy() for m in self.layers]).astype(np.int64)

    def migrate(self, step: int) -> dict:
        """Gather loads, plan (EP rank 0), broadcast, move. Returns this rank's event (JSON-ready)."""
        marks = [_now(self.device)]
        tokens_LE = self.stage_tokens()
        marks.append(_now(self.device))
        before = self.slot_maps()
        result = hill_climb(tokens_LE, placement_from_slots(before, self.num_local), len(self.ep_ranks),
                            self.settings.threshold, self.settings.max_iters) if self.me == 0 else None
        swaps = self._broadcast_swaps(result.swaps if result is not None else ())
        after = apply_swaps(before, swaps)
        marks.append(_now(self.device))
        sent = self.apply(before, after)
        marks.append(_now(self.device))
        seconds = {k: b - a for k, a, b in zip(("gather_s", "plan_s", "move_s"), marks, marks[1:])}
        return self._event(step, tokens_LE, before, after, swaps, sent, seconds)

    def stage_tokens(self) -> np.ndarray:
        """int64 ``[L, E]``: the window's tokens per logical expert over every rank of the stage."""
        local = torch.from_numpy(self.monitor.window_tokens()).to(self.device)
        if self.edp_group is not None:
            dist.all_reduce(local, group=self.edp_group)
        parts = [torch.empty_like(local) for _ in self.ep_ranks]
        dist.all_gather(parts, local, group=self.ep_group)
        return torch.stack(parts).sum(0).cpu().numpy()

    def apply(self, before_LE: np.ndarray, after_LE: np.ndarray) -> int:
        """Move the experts from slot maps ``before`` to ``after`` (collective over the EP group) and install
        ``after``; returns the bytes this rank sent."""
        moves = slot_moves(before_LE, after_LE)
        sends, recvs, local = rank_transfers(moves, self.num_local, self.me)
        sent = self._exchange(sends, recvs, local)
        for m, row in zip(self.layers, after_LE):
            m.slot_of_expert.copy_(torch.as_tensor(row, dtype=torch.int64))
        return sent

    # -- internals
    def _broadcast_swaps(self, swaps) -> list[Swap]:
        """EP rank 0's swaps -> every rank of the EP group (a count, then an int64 [n, 5] tensor)."""
        rows = torch.tensor([[s.layer, s.expert_a, s.rank_a, s.expert_b, s.rank_b] for s in swaps],
                            dtype=torch.int64).reshape(-1, 5).to(self.device)
        count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=self.device)
        dist.broadcast(count, src=self.ep_ranks[0], group=self.ep_group)
        if self.me != 0:
            rows = torch.empty((int(count.item()), 5), dtype=torch.int64, device=self.device)
        if rows.numel():
            dist.broadcast(rows, src=self.ep_ranks[0], group=self.ep_group)
        return [Swap(*map(int, r)) for r in rows.cpu().tolist()]

    def _exchange(self, sends: dict, recvs: dict, local: list) -> int:
        """Pack, send/receive in one batch_isend_irecv, then write (so every source is read before overwritten)."""
        tensors = [slot_tensors(m.experts, self.optimizers) for m in self.layers]
        steps = [step_counters(m.experts, self.optimizers) for m in self.layers]
        out = {peer: self._pack_rows(tensors, steps, ms, "src_slot") for peer, ms in sends.items()}
        inbox = {peer: torch.empty(self._rows_bytes(tensors, steps, ms), dtype=torch.uint8, device=self.device)
                 for peer, ms in recvs.items()}
        copies = [(m, [t[m.src_slot % self.num_local].clone() for t in tensors[m.row]]) for m in local]
        ops = [dist.P2POp(dist.isend, buf, self.ep_ranks[p], self.ep_group) for p, buf in sorted(out.items())]
        ops += [dist.P2POp(dist.irecv, buf, self.ep_ranks[p], self.ep_group) for p, buf in sorted(inbox.items())]
        for req in dist.batch_isend_irecv(ops) if ops else []:
            req.wait()
        for peer, buf in inbox.items():
            self._unpack_rows(buf, tensors, steps, recvs[peer])
        for m, rows in copies:
            for t, r in zip(tensors[m.row], rows):
                t[m.dst_slot % self.num_local].copy_(r)
        return sum(int(b.numel()) for b in out.values())

    def _by_row(self, moves: list, attr: str) -> dict[int, list[int]]:
        rows: dict[int, list[int]] = {}
        for m in moves:
            rows.setdefault(m.row, []).append(getattr(m, attr) % self.num_local)
        return rows

    def _pack_rows(self, tensors, steps, moves, attr) -> torch.Tensor:
        return torch.cat([pack(tensors[row], js, steps[row]) for row, js in sorted(self._by_row(moves, attr).items())])

    def _rows_bytes(self, tensors, steps, moves) -> int:
        return sum(packed_bytes(tensors[row], len(js), steps[row])
                   for row, js in self._by_row(moves, "dst_slot").items())

    def _unpack_rows(self, buf, tensors, steps, moves) -> None:
        offset = 0
        for row, js in sorted(self._by_row(moves, "dst_slot").items()):
            n = packed_bytes(tensors[row], len(js), steps[row])
            theirs = unpack(buf[offset: offset + n], tensors[row], js, steps[row])
            assert torch.equal(theirs, steps[row]), f"optimizer step differs in the EP group: {theirs} vs {steps[row]}"
            offset += n

    def _event(self, step, tokens_LE, before, after, swaps, sent, seconds: dict) -> dict:
        """This rank's record. ``experts_moved``: logical experts whose EP rank changed (the planner's count);
        ``seconds`` = gather (loads) + plan (incl. the broadcast) + move (p2p)."""
        ep = len(self.ep_ranks)
        rank_before = rank_loads(tokens_LE, placement_from_slots(before, self.num_local), ep)
        rank_after = rank_loads(tokens_LE, placement_from_slots(after, self.num_local), ep)
        return {"step": step, "layers": self.layer_ids, "ep_group": self.ep_ranks[0], "num_swaps": len(swaps),
                "swaps": [{**s.as_dict(), "layer": self.layer_ids[s.layer]} for s in swaps],
                "experts_moved": int((before // self.num_local != after // self.num_local).sum()), "bytes_sent": sent,
                "seconds": sum(seconds.values()), **seconds,
                "max_over_mean_before": step_max_over_mean(rank_before),
                "max_over_mean_after": step_max_over_mean(rank_after)}


def _now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def merge_events(reports: list[dict]) -> list[dict]:
    """Rank 0: every rank's migration event of one step -> one event per stage (metrics.jsonl ``migrations``):
    the swaps (identical across the stage's EP groups) and ``bytes_moved`` summed over the stage's ranks.

    Time: the loads gather is the first collective after the step, so a rank that finished its step early
    waits there for the slowest one (step skew, not migration). The last rank to arrive waits for no one, so
    the smallest ``gather_s`` over the ranks is the gather's own time; plan and move are the slowest rank's.
    ``seconds`` = that gather + the slowest plan + the slowest move."""
    by_stage: dict[int, list[dict]] = {}
    for r in reports:
        if r.get("migration"):
            by_stage.setdefault(r["stage"], []).append(r["migration"])
    events = []
    for stage, evs in sorted(by_stage.items()):
        first = evs[0]
        parts = {"gather_s": min(e["gather_s"] for e in evs), "plan_s": max(e["plan_s"] for e in evs),
                 "move_s": max(e["move_s"] for e in evs)}
        events.append({"stage": stage, "step": first["step"], "layers": first["layers"],
                       "num_swaps": first["num_swaps"], "swaps": first["swaps"],
                       "experts_moved": first["experts_moved"], "ep_groups": len({e["ep_group"] for e in evs}),
                       "bytes_moved": sum(e["bytes_sent"] for e in evs), "seconds": sum(parts.values()), **parts,
                       "max_over_mean_before": first["max_over_mean_before"],
                       "max_over_mean_after": first["max_over_mean_after"]})
    return events
