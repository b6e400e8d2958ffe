"""piper's vocabulary: one enum per axis of a plan and per kind of thing the model prices (DESIGN.md).

Every other module takes its names from here: the specs (pydantic validates the strings into these enums), the
vectorised cost model (a candidate stores an axis as the integer ``code`` of its member, in declaration order),
the search, the calibration schema and the runtime. No module restates a name list, and no formula compares a
code with a bare integer: ``c.schedule == Schedule.GPIPE.code``.

The members are ``StrEnum``: ``Schedule.ONE_F_ONE_B == "1f1b"``, ``f"{member}"`` is its value, and JSON holds
the plain string.
"""

from __future__ import annotations

from enum import StrEnum


class Vocab(StrEnum):
    """An axis of the vocabulary: members in code order."""

    @property
    def code(self) -> int:
        """The member's integer code in vectorised arrays (its declaration index)."""
        return type(self)._member_names_.index(self.name)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """Every value, in code order."""
        return tuple(m.value for m in cls)

    @classmethod
    def of_code(cls, code: int) -> "Vocab":
        return list(cls)[int(code)]

    @classmethod
    def codes(cls, values) -> list[int]:
        """Codes of values given as strings or members."""
        return [cls(v).code for v in values]


class Schedule(Vocab):
    """Pipeline schedule (Narayanan et al. 2021, sec. 2.2)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"


class Recompute(Vocab):
    """Activation recomputation (Korthikanti et al. 2022)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class A2A(Vocab):
    """Expert all-to-all algorithm: one message per peer, or the Piper paper's hierarchical HALO."""

    FLAT = "flat"
    HALO = "halo"


class LayerSplit(Vocab):
    """How a plan's layers are split over pipeline stages (cost/pipeline.py owns the rule).

    ``auto`` is what ``piper plan`` does: price the even and the FLOP-balanced split, keep the one that fits,
    then the faster. A saved plan always carries the resolved ``layers_per_stage``."""

    EVEN = "even"
    BALANCED = "balanced"
    AUTO = "auto"
    EXPLICIT = "explicit"
    """The plan's own ``layers_per_stage`` list."""


class Scope(Vocab):
    """Network scope a group of ranks spans, narrowest first (placement/layout.py)."""

    NODE = "node"
    SWITCH = "switch"
    GROUP = "group"
    SYSTEM = "system"


class CollectiveOp(Vocab):
    """Collectives the cost model prices and calibration measures (nccl-tests' ops, plus HALO's)."""

    ALL_TO_ALL = "all_to_all"
    HALO_ALL_TO_ALL = "halo_all_to_all"
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    P2P = "p2p"


class Precision(Vocab):
    """Number formats of GEMMs and tensors."""

    FP32 = "fp32"
    TF32 = "tf32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"
    MXFP8 = "mxfp8"


class Placement(Vocab):
    """Allocation shape: fewest switches and groups, or every node on a different one."""

    COMPACT = "compact"
    SPREAD = "spread"


A2A_TIME_PREFIX = "moe/"
"""Prefix of the time breakdown entries of the expert all-to-all: the dispatch and combine exchanges, the count
exchange (``moe/layout``) and the waits at them (``moe/sync_wait``): what the runtime's a2a timer covers
(runtime/dispatch.py). The all-to-all share of a step (cost/evaluate.py) and ``piper compare``'s a2a term both
count these."""
