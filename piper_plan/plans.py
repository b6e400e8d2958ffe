"""One plan type and one validity check.

- ``PlanBatch``: a struct of arrays of parallel plans (one int64 array per ``ParallelPlan`` field; enum axes as
  their ``specs.vocab`` codes). The search enumerates one, the cost model prices one, ``estimate`` is a batch of
  one (``PlanBatch.of(plan)``).
- ``problems(model, platform, training, nodes, plans)``: per plan, the first reason it is **invalid** (a name of
  ``INVALID_REASONS``) or ``None``. It is the only place that decides validity: the search, ``estimate``,
  ``launch`` (from options and from ``--plan``) and the runtime at start-up all call it (``check_plan`` is its
  one-plan form, with a message naming every value involved).

Invalid means the plan cannot be run as stated. What the search additionally drops is named apart and lives
with the search (search/space.py): duplicates of a kept twin, strategy restrictions (``--strategy piper``), and
fit (``out_of_memory``); what piper's own runtime cannot execute is the capability list (capability.py).

Pure numpy and specs: no torch, no I/O.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Callable

import numpy as np

from piper_plan.errors import PiperError
from piper_plan.specs.parallel import MAX_BALANCED_LAYERS, MAX_RANKS, ParallelPlan, even_split, interleaved_chunk_split, model_chunks, rank_layers
from piper_plan.specs.vocab import A2A, LayerSplit, Recompute, Schedule

ENUM_FIELDS = {"schedule": Schedule, "recompute": Recompute, "a2a": A2A, "layers_split": LayerSplit}
"""Plan fields stored as vocabulary codes in a PlanBatch."""


@dataclass(frozen=True)
class PlanBatch:
    """Struct of arrays: every field an int64 array of the same length N; enum fields hold vocabulary codes.

    ``explicit_layers`` carries the ``layers_per_stage`` lists of plans whose ``layers_split`` is explicit
    (a batch of one from ``PlanBatch.of``); the search never makes such plans."""

    dp: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    ep: np.ndarray
    etp: np.ndarray
    mbs: np.ndarray
    num_microbatches: np.ndarray
    schedule: np.ndarray
    virtual_stages: np.ndarray
    recompute: np.ndarray
    zero: np.ndarray
    a2a: np.ndarray
    sequence_parallel: np.ndarray
    layers_split: np.ndarray
    cp: np.ndarray = 1
    """Context-parallel degree (1 where a caller does not say)."""
    dp_replicate: np.ndarray = 1
    """HSDP replicas of the dense FSDP2 shard group (1 where a caller does not say; the search keeps 1)."""
    explicit_layers: tuple | None = None
    explicit_chunks: tuple | None = None
    """The ``virtual_stage_layers`` lists (None where a plan has none) of a batch of one from ``PlanBatch.of``."""

    def __post_init__(self):
        names = array_fields()
        arrays = np.broadcast_arrays(*(np.atleast_1d(np.asarray(getattr(self, n), np.int64)) for n in names))
        for name, a in zip(names, arrays):
            object.__setattr__(self, name, np.ascontiguousarray(a))
        object.__setattr__(self, "_edp", self.dp * self.cp * self.tp // (self.ep * self.etp))
        object.__setattr__(self, "_dp_cp", self.dp * self.cp)
        object.__setattr__(self, "_dense_shard", self._dp_cp // self.dp_replicate)
        object.__setattr__(self, "_seq_share", self.mbs / self.cp)

    def __len__(self) -> int:
        return len(self.dp)

    @property
    def edp(self) -> np.ndarray:
        """Ranks holding the same experts: dp x cp x tp / (ep x etp)."""
        return self._edp

    @property
    def world(self) -> np.ndarray:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def dp_cp(self) -> np.ndarray:
        """Ranks holding the same dense weights: dense gradients are reduced (and ZeRO shards) over dp x cp."""
        return self._dp_cp

    @property
    def dense_shard(self) -> np.ndarray:
        """Ranks the dense weights' ZeRO state is sharded over: dp x cp / dp_replicate (HSDP's shard group)."""
        return self._dense_shard

    @property
    def seq_share(self) -> np.ndarray:
        """Sequences' worth of tokens one rank processes per micro-batch: mbs / cp (context parallelism)."""
        return self._seq_share

    @classmethod
    def of(cls, plan: ParallelPlan) -> "PlanBatch":
        """A batch of one plan."""
        values = {name: getattr(plan, name) for name in array_fields()}
        for name, vocab in ENUM_FIELDS.items():
            values[name] = vocab(values[name]).code
        chunks = (tuple(plan.virtual_stage_layers),) if plan.virtual_stage_layers is not None else None
        layers = plan.layers_per_stage
        if layers is None and chunks is not None and len(chunks[0]) == plan.pp * plan.virtual_stages:
            layers = rank_layers(list(chunks[0]), plan.pp)             # the ranks' layers: the chunks' sums
            values["layers_split"] = LayerSplit.EXPLICIT.code
        explicit = (tuple(layers),) if layers is not None else None
        return cls(**values, explicit_layers=explicit, explicit_chunks=chunks)

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> "PlanBatch":
        return cls(**{name: arrays[name] for name in array_fields()})

    def chunks_of(self, i: int) -> list[int] | None:
        """Plan i's explicit ``virtual_stage_layers`` list, None where it states none."""
        chunks = None if self.explicit_chunks is None else self.explicit_chunks[i]
        return None if chunks is None else list(chunks)

    def plan(self, i: int, layers_per_stage=None) -> ParallelPlan:
        """Plan i as a ParallelPlan (with ``layers_per_stage`` its split is explicit)."""
        values = {name: int(getattr(self, name)[i]) for name in array_fields()}
        for name, vocab in ENUM_FIELDS.items():
            values[name] = vocab.of_code(values[name])
        if layers_per_stage is None and self.explicit_layers is not None:
            layers_per_stage = list(self.explicit_layers[i])
        chunks = self.chunks_of(i)
        if chunks is not None and len(chunks) == values["pp"] * values["virtual_stages"]:
            layers_per_stage = rank_layers(chunks, values["pp"])     # the ranks' layers are the chunks' sums
        if layers_per_stage is not None:
            values["layers_split"] = LayerSplit.EXPLICIT
        return ParallelPlan(**values, layers_per_stage=layers_per_stage, virtual_stage_layers=chunks)

    def take(self, index) -> "PlanBatch":
        """A subset (boolean mask or indices)."""
        picked = np.atleast_1d(np.arange(len(self))[index])
        explicit, chunks = (None if lists is None else tuple(lists[int(i)] for i in picked)
                            for lists in (self.explicit_layers, self.explicit_chunks))
        return PlanBatch(**{name: getattr(self, name)[index] for name in array_fields()}, explicit_layers=explicit,
                         explicit_chunks=chunks)

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in array_fields()}

    def describe(self, i: int) -> dict:
        """Plan i as plain Python values, enum axes by name, with its derived ``edp``."""
        return described({name: int(getattr(self, name)[i]) for name in array_fields()})


def described(codes: dict[str, int]) -> dict:
    """One plan's array fields (ints, enum axes as codes) as plain Python values, enum axes by name, with its
    derived ``edp`` (PlanBatch's rule)."""
    out = dict(codes)
    out["sequence_parallel"] = bool(out["sequence_parallel"])     # a flag, as in ParallelPlan and plan.json
    for name, vocab in ENUM_FIELDS.items():
        out[name] = vocab.of_code(out[name]).value
    out["edp"] = out["dp"] * out["cp"] * out["tp"] // (out["ep"] * out["etp"])
    return out


@functools.cache
def array_fields() -> tuple[str, ...]:
    """PlanBatch's array fields, in declaration order."""
    return tuple(f.name for f in fields(PlanBatch) if f.name not in ("explicit_layers", "explicit_chunks"))


# ---- validity -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """What every plan of one question shares: the model, the machine, the training run, the allocation."""

    model: object
    platform: object
    training: object
    nodes: int

    @property
    def world(self) -> int:
        return self.nodes * self.platform.devices_per_node

    @property
    def num_experts(self) -> int:
        return self.model.moe.num_experts if self.model.moe is not None else 1

    @property
    def expert_ffn(self) -> int:
        return self.model.moe.expert.intermediate_size if self.model.moe is not None else 1


@dataclass(frozen=True)
class Rule:
    """One validity rule: ``broken(setting, plans) -> bool [N]`` and its one-line message for plan ``p``."""

    name: str
    broken: Callable
    message: Callable
    level: str = "structural"
    """What it depends on: "allocation" (the setting alone: no plan of it is valid), "structural" (dp, tp, pp,
    ep, etp, mbs: the search applies it before expanding the other axes, search/space.py) or "schedule"."""


def _none(c) -> np.ndarray:
    return np.zeros(len(c), dtype=bool)


def _interleaved(c) -> np.ndarray:
    return c.schedule == Schedule.INTERLEAVED.code


def _explicit_split_broken(s: Setting, c) -> np.ndarray:
    out = _none(c)
    if c.explicit_layers is None:
        return out | (c.layers_split == LayerSplit.EXPLICIT.code)
    interleaved = _interleaved(c)
    for i, layers in enumerate(c.explicit_layers):
        pp = int(c.pp[i])
        wrong = len(layers) != pp or sum(layers) != s.model.num_layers or min(layers, default=0) < 1
        out[i] = wrong or (bool(interleaved[i]) and list(layers) != _interleaved_ranks(s, c, i))
    return out


def plan_chunks(num_layers: int, c, i: int) -> list[int] | None:
    """Plan i's model chunks (interleaved): its explicit ``virtual_stage_layers``, else the Megatron-Core rule
    (specs.parallel.model_chunks; None where that has no split)."""
    return model_chunks(num_layers, int(c.pp[i]), int(c.virtual_stages[i]), c.chunks_of(i))


def _interleaved_ranks(s: Setting, c, i: int) -> list[int]:
    """Each rank's layers under plan i's chunks (the even split where it has none)."""
    return _ranks_over(plan_chunks(s.model.num_layers, c, i), s.model.num_layers, int(c.pp[i]))


def _rank_split(plan: ParallelPlan, num_layers: int) -> list[int]:
    """Each rank's layers under ``plan``'s interleaved chunks (the even split where it has none)."""
    return _ranks_over(plan.chunk_layers(num_layers), num_layers, plan.pp)


def _ranks_over(chunks: list[int] | None, num_layers: int, pp: int) -> list[int]:
    return rank_layers(chunks, pp) if chunks is not None else even_split(num_layers, pp)


def _no_chunk_split(s: Setting, c) -> np.ndarray:
    """Interleaved plans whose layers Megatron-Core's rule (specs.parallel.interleaved_chunk_split, which depends
    on pp x v only) cannot split into pp x v chunks, and no explicit list."""
    n = c.pp * c.virtual_stages
    distinct, inverse = np.unique(n, return_inverse=True)
    ruled = np.array([interleaved_chunk_split(s.model.num_layers, 1, int(k)) is not None for k in distinct], bool)
    out = _interleaved(c) & ~ruled[inverse.ravel()]
    if c.explicit_chunks is not None:
        out &= np.array([chunks is None for chunks in c.explicit_chunks])
    return out


def _chunks_broken(s: Setting, c) -> np.ndarray:
    """An explicit ``virtual_stage_layers`` list: interleaved only, pp x v entries summing to num_layers, every
    rank >= 1 layer."""
    out = _none(c)
    if c.explicit_chunks is None:
        return out
    interleaved = _interleaved(c)
    for i, chunks in enumerate(c.explicit_chunks):
        if chunks is None:
            continue
        pp, n = int(c.pp[i]), int(c.pp[i] * c.virtual_stages[i])
        out[i] = (not interleaved[i] or len(chunks) != n or sum(chunks) != s.model.num_layers
                  or min(rank_layers(list(chunks), pp)) < 1)
    return out


def cp_splits_sequence(cp, seq_len: int):
    """Whether context parallelism ``cp`` (scalar or array) can split a sequence of ``seq_len`` tokens: cp 1, or
    2 cp equal chunks (the load-balanced causal split)."""
    cp = np.asarray(cp)
    return (cp <= 1) | (seq_len % (2 * np.maximum(cp, 1)) == 0)


def _h(s: Setting) -> tuple[int, int]:
    return s.model.attention.num_heads, s.model.attention.kv_heads


RULES: tuple[Rule, ...] = (
    Rule("nodes_out_of_range", lambda s, c: _none(c) | (not 1 <= s.nodes <= s.platform.node_limit),
         lambda s, p: f"nodes={s.nodes}; {s.platform.name} has 1 to {s.platform.node_limit} nodes",
         level="allocation"),
    Rule("seq_exceeds_model",
         lambda s, c: _none(c) | (s.model.max_seq_len is not None and s.training.seq_len > s.model.max_seq_len),
         lambda s, p: f"seq_len={s.training.seq_len} exceeds {s.model.name}'s max_seq_len={s.model.max_seq_len}",
         level="allocation"),
    Rule("world_beyond_limit", lambda s, c: _none(c) | (s.world > MAX_RANKS),
         lambda s, p: f"{s.nodes} nodes x {s.platform.devices_per_node} devices = {s.world:,} ranks; piper plans at "
                      f"most {MAX_RANKS:,}", level="allocation"),
    Rule("world_mismatch", lambda s, c: c.world != s.world,
         lambda s, p: f"pp x dp x cp x tp = {p.pp} x {p.dp} x {p.cp} x {p.tp} = {p.world} must equal the world size "
                      f"{s.nodes} nodes x {s.platform.devices_per_node} = {s.world}"),
    Rule("cp_not_divisor_seq", lambda s, c: ~cp_splits_sequence(c.cp, s.training.seq_len),
         lambda s, p: f"cp={p.cp} needs seq_len={s.training.seq_len} divisible by 2 x cp = {2 * p.cp} (the "
                      "load-balanced causal split cuts each sequence into 2 cp equal chunks)"),
    Rule("balanced_split_too_deep", lambda s, c: (c.layers_split == LayerSplit.BALANCED.code) & (c.pp > 1)
         & (c.virtual_stages == 1) & (s.model.num_layers > MAX_BALANCED_LAYERS),
         lambda s, p: f"layers_split=balanced: {s.model.name} has {s.model.num_layers} layers; the FLOP-balanced "
                      f"split is computed up to {MAX_BALANCED_LAYERS} (pp x layers^2 work); use even or explicit"),
    Rule("pp_exceeds_layers", lambda s, c: c.pp > s.model.num_layers,
         lambda s, p: f"pp={p.pp} must be <= num_layers={s.model.num_layers}"),
    Rule("tp_exceeds_node", lambda s, c: c.tp > s.platform.devices_per_node,
         lambda s, p: f"tp={p.tp} must be <= devices_per_node={s.platform.devices_per_node} (tp stays in a node)"),
    Rule("tp_not_divisor_heads", lambda s, c: (_h(s)[0] % c.tp != 0) | (_h(s)[1] % c.tp != 0),
         lambda s, p: f"tp={p.tp} must divide num_heads={_h(s)[0]} and num_kv_heads={_h(s)[1]}"),
    Rule("dense_model_expert_axes", lambda s, c: (c.ep * c.etp > 1) if s.model.moe is None else _none(c),
         lambda s, p: f"ep={p.ep}, etp={p.etp}: {s.model.name} is dense (no experts); use ep=1, etp=1"),
    Rule("moe_tp_without_sp",
         lambda s, c: ((c.tp > 1) & (c.sequence_parallel == 0)) if s.model.moe is not None else _none(c),
         lambda s, p: f"tp={p.tp} with sequence_parallel off: an MoE model's tp > 1 runs with sequence parallelism "
                      "only (Megatron-Core's moe_layer.py refuses it without; piper's runtime always shards the "
                      "sequence; the experts' rows would otherwise be every token, tp times over)"),
    Rule("sp_not_divisor_seq",
         lambda s, c: (c.tp > 1) & (c.sequence_parallel != 0) & (s.training.seq_len % (c.cp * c.tp) != 0),
         lambda s, p: f"tp={p.tp} with sequence parallelism needs each rank's sequence, seq_len / cp = "
                      f"{s.training.seq_len} / {p.cp}, divisible by tp (the tp group splits it evenly: Megatron-Core's "
                      "_split_along_first_dim asserts it)"),
    Rule("etp_not_divisor_tp", lambda s, c: c.tp % c.etp != 0,
         lambda s, p: f"etp={p.etp} must divide tp={p.tp} (expert tensor parallelism runs inside the tp group)"),
    Rule("etp_not_divisor_ffn", lambda s, c: (s.expert_ffn % c.etp != 0) if s.model.moe is not None else _none(c),
         lambda s, p: f"etp={p.etp} must divide the expert intermediate size {s.expert_ffn}"),
    Rule("ep_not_divisor", lambda s, c: s.num_experts % c.ep != 0,
         lambda s, p: f"ep={p.ep} must divide num_experts={s.num_experts}"),
    Rule("ep_etp_not_divisor_ranks", lambda s, c: (c.dp * c.cp * c.tp) % (c.ep * c.etp) != 0,
         lambda s, p: f"ep x etp = {p.ep} x {p.etp} must divide a stage's dp x cp x tp = {p.dp} x {p.cp} x {p.tp} "
                      "ranks"),
    Rule("dp_replicate_not_divisor_dp", lambda s, c: c.dp % c.dp_replicate != 0,
         lambda s, p: f"dp_replicate={p.dp_replicate} must divide dp={p.dp} (HSDP: replicas of a shard group)"),
    Rule("dp_replicate_needs_fsdp", lambda s, c: (c.dp_replicate > 1) & (c.zero < 2),
         lambda s, p: f"dp_replicate={p.dp_replicate} needs zero 2 or 3 (HSDP shards with FSDP2; got zero={p.zero})"),
    Rule("batch_not_divisible", lambda s, c: s.training.global_batch % (c.dp * c.mbs) != 0,
         lambda s, p: f"global_batch={s.training.global_batch} must be divisible by dp x mbs = {p.dp} x {p.mbs}"),
    Rule("microbatches_mismatch",                  # where dp x mbs divides the batch: else the rule above says it
         lambda s, c: (s.training.global_batch % (c.dp * c.mbs) == 0)
         & (c.num_microbatches * c.dp * c.mbs != s.training.global_batch), level="schedule",
         message=lambda s, p: f"num_microbatches={p.num_microbatches} must equal global_batch / (dp x mbs) = "
                              f"{s.training.global_batch} / ({p.dp} x {p.mbs})"),
    Rule("virtual_stages_not_interleaved", lambda s, c: ~_interleaved(c) & (c.virtual_stages != 1),
         lambda s, p: f"virtual_stages={p.virtual_stages} needs schedule=interleaved (got {p.schedule})",
         level="schedule"),
    Rule("interleaved_needs_pp", lambda s, c: _interleaved(c) & (c.pp < 2),
         lambda s, p: f"schedule=interleaved needs pp >= 2 (got pp={p.pp})", level="schedule"),
    Rule("interleaved_layers_not_divisible", _no_chunk_split,
         lambda s, p: f"schedule=interleaved needs num_layers={s.model.num_layers} (or + 1, + 2: Megatron-Core's "
                      f"account_for_loss / _embedding_in_pipeline_split) divisible by pp x virtual_stages = {p.pp} x "
                      f"{p.virtual_stages}, or an explicit virtual_stage_layers list",
         level="schedule"),
    Rule("virtual_stage_layers_invalid", _chunks_broken,
         lambda s, p: f"virtual_stage_layers={p.virtual_stage_layers} must be given with schedule=interleaved and have "
                      f"pp x virtual_stages = {p.pp} x {p.virtual_stages} entries summing to num_layers="
                      f"{s.model.num_layers}, every rank holding >= 1 layer", level="schedule"),
    Rule("interleaved_microbatches_not_divisible", lambda s, c: _interleaved(c) & (c.num_microbatches % c.pp != 0),
         lambda s, p: f"schedule=interleaved needs num_microbatches={p.num_microbatches} divisible by pp={p.pp}",
         level="schedule"),
    Rule("layers_per_stage_invalid", _explicit_split_broken,
         lambda s, p: f"layers_per_stage={p.layers_per_stage} must have pp={p.pp} entries of >= 1 layer summing to "
                      f"num_layers={s.model.num_layers}" + (" and, interleaved, be each rank's layers over its "
                                                          f"chunks {_rank_split(p, s.model.num_layers)}"
                                                          if p.schedule == Schedule.INTERLEAVED else ""),
         level="schedule"),
)
INVALID_REASONS: tuple[str, ...] = tuple(r.name for r in RULES)
"""Every reason a plan is invalid, in the order ``problems`` checks them (a plan counts under the first)."""


def problem_masks(model, platform, training, nodes: int, plans: PlanBatch, rules=RULES) -> np.ndarray:
    """[R, N] booleans: masks[i] is True where ``rules[i]`` is broken."""
    setting = Setting(model, platform, training, nodes)
    masks = np.zeros((len(rules), len(plans)), dtype=bool)
    for i, rule in enumerate(rules):
        masks[i] = rule.broken(setting, plans)
    return masks


def first_reasons(masks: np.ndarray) -> np.ndarray:
    """Per plan: the index of the first broken rule, or -1 where none is."""
    if masks.shape[0] == 0:
        return np.full(masks.shape[1], -1)
    return np.where(masks.any(axis=0), np.argmax(masks, axis=0), -1)


def problems(model, platform, training, nodes: int, plans: PlanBatch) -> list[str | None]:
    """Per plan: the name of the first reason it is invalid (``INVALID_REASONS``), or None for a valid plan."""
    codes = first_reasons(problem_masks(model, platform, training, nodes, plans))
    return [None if c < 0 else INVALID_REASONS[c] for c in codes]


def reason_counts(masks: np.ndarray, names) -> dict[str, int]:
    """Each plan counted under the first reason that applies to it (only reasons that occurred)."""
    codes = first_reasons(masks)
    counts = np.bincount(codes[codes >= 0], minlength=len(names))
    return {name: int(n) for name, n in zip(names, counts) if n}


def plan_problems(model, platform, training, nodes: int, plan: ParallelPlan) -> list[str]:
    """Every rule ``plan`` breaks, each as one message naming the values involved (empty: valid)."""
    masks = problem_masks(model, platform, training, nodes, PlanBatch.of(plan))
    setting = Setting(model, platform, training, nodes)
    return [f"{r.name}: {r.message(setting, plan)}" for r, broken in zip(RULES, masks[:, 0]) if broken]


def check_setting(model, platform, training, nodes: int) -> None:
    """Raise one PiperError line when no plan of this setting can be valid (the allocation-level rules)."""
    setting = Setting(model, platform, training, nodes)
    one = PlanBatch.of(ParallelPlan())
    found = [r for r in RULES if r.level == "allocation" and r.broken(setting, one).any()]
    if found:
        fields = {"nodes_out_of_range": "--nodes", "seq_exceeds_model": "--seq"}
        raise PiperError("; ".join(r.message(setting, None) for r in found), field=fields.get(found[0].name))


def check_plan(model, platform, training, nodes: int, plan: ParallelPlan, path: str | None = None) -> None:
    """Raise one PiperError line listing every rule ``plan`` breaks."""
    found = plan_problems(model, platform, training, nodes, plan)
    if found:
        raise PiperError("invalid plan: " + "; ".join(found), path=path, field="parallel")
