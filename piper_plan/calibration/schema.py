"""The calibration CSV schema (DESIGN.md, "Shared file formats"): columns, units, allowed values and ranges.

One table per file: ``gemm.csv``, ``attention.csv``, ``collectives.csv``, ``memory.csv``. Every row carries a ``source``:
``measured: <command> on <host> <date>`` for rows ``piper calibrate`` wrote, ``seed: <citation>; <derivation>``
for rows derived from published numbers, ``imported: <file>`` for nccl-tests / rccl-tests output.
Units live in the column names where they are not SI (``algbw_GBps``); ``seconds`` and ``bytes_per_rank`` are SI.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from piper_plan.specs.platform import MAX_DEVICES_PER_NODE, MAX_NODES
from piper_plan.specs.vocab import CollectiveOp, Precision, Scope

DTYPES = Precision.values()
PASSES = ("fwd", "bwd")
OPS = CollectiveOp.values()
SCOPES = Scope.values()
SOURCE_KINDS = ("measured", "seed", "imported")


@dataclass(frozen=True)
class Column:
    """One CSV column: its kind ('int', 'float', 'str', 'bool'), allowed values or numeric range, and meaning."""

    name: str
    kind: str
    doc: str
    choices: tuple[str, ...] | None = None
    min_value: float | None = None
    min_inclusive: bool = True
    max_value: float | None = None
    """Largest value allowed (inclusive); None = any finite number."""


def _pos_int(name: str, doc: str) -> Column:
    return Column(name, "int", doc, min_value=1, max_value=2.0**53)


MAX_MEASURED = 1e6
"""Largest seconds, TFLOPS or GB/s a calibration row may hold (a million seconds is eleven days; no device does a
million TFLOPS or moves a million GB/s): beyond it a row is a corrupt measurement."""


MIN_MEASURED = 1e-9
"""Smallest seconds, TFLOPS or GB/s a calibration row may hold (a nanosecond; a thousand FLOP/s; one byte per
second): below it a row is a corrupt measurement, and a denormal such as 5e-324 overflows what is derived from it."""


def _pos_float(name: str, doc: str) -> Column:
    return Column(name, "float", doc, min_value=MIN_MEASURED, max_value=MAX_MEASURED)


@dataclass(frozen=True)
class Table:
    """One calibration file: its columns in order and the columns that identify one measured point."""

    name: str
    columns: tuple[Column, ...]
    key: tuple[str, ...]
    row_check: Callable[[dict], str | None] | None = None
    """A check across the columns of one parsed row: None when fine, else what is wrong."""

    @property
    def filename(self) -> str:
        return f"{self.name}.csv"

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]


RATE_TOLERANCE = 0.01
"""A row's stored tflops may differ by 1 % (relative) from the FLOPs / seconds its other columns give (the writer
rounds to 6 significant digits); further off, the row contradicts itself."""


def rate_problem(row: dict, column: str, derived: float, formula: str) -> str | None:
    """What is wrong with a row whose rate ``column`` is not ``derived`` (``formula``: how it follows from the row's
    other columns) within RATE_TOLERANCE, else None."""
    if abs(row[column] - derived) <= RATE_TOLERANCE * derived:
        return None
    return f"column {column}: {row[column]:g}, but {formula} = {derived:.6g}; allowed within {RATE_TOLERANCE:.0%} of it"


def tflops_problem(row: dict, flops: float, formula: str) -> str | None:
    """What is wrong with a row whose ``tflops`` column is not ``flops`` / seconds / 1e12 (``formula``: how the FLOPs
    follow from the row), else None."""
    return rate_problem(row, "tflops", flops / row["seconds"] / 1e12, f"{formula} / seconds / 1e12")


SOURCE = Column("source", "str", "what measured the row (measured: command + host) or the citation + derivation (seed:)")

GEMM = Table(
    "gemm",
    (
        Column("device", "str", "device name"),
        Column("dtype", "str", "operand dtype", choices=DTYPES),
        _pos_int("m", "rows of the left operand = tokens"),
        _pos_int("n", "output features"),
        _pos_int("k", "input features (the reduced dimension)"),
        _pos_int("groups", "GEMMs of this shape run as one grouped call (1 = plain)"),
        _pos_float("seconds", "time of the whole call (all groups), median over repeats"),
        _pos_float("tflops", "2 m n k groups / seconds / 1e12"),
        SOURCE,
    ),
    key=("device", "dtype", "m", "n", "k", "groups"),
    row_check=lambda row: tflops_problem(row, gemm_flops(row["m"], row["n"], row["k"], row["groups"]),
                                         "2 m n k groups"),
)

def _attention_row_problem(row: dict) -> str | None:
    """Grouped-query heads (num_kv_heads divides num_heads: each key/value head serves a group of query heads), then
    the row's tflops against its FLOPs and seconds."""
    if row["num_heads"] % row["num_kv_heads"]:
        return (f"num_kv_heads={row['num_kv_heads']} does not divide num_heads={row['num_heads']}; allowed: a "
                "divisor (= num_heads for multi-head attention, 1 for multi-query)")
    return tflops_problem(row, float(attention_flops(row["batch"], row["seq_len"], row["num_heads"], row["head_dim"],
                                                     row["causal"], row["pass"])), "the attention FLOPs")


ATTENTION = Table(
    "attention",
    (
        Column("device", "str", "device name"),
        Column("dtype", "str", "q/k/v dtype", choices=DTYPES),
        Column("pass", "str", "fwd or bwd (bwd = the gradient of q, k, v)", choices=PASSES),
        _pos_int("batch", "sequences per call"),
        _pos_int("seq_len", "tokens per sequence (query = key length)"),
        _pos_int("num_heads", "query heads"),
        _pos_int("num_kv_heads", "key/value heads (= num_heads for MHA)"),
        _pos_int("head_dim", "features per head"),
        Column("causal", "bool", "causal mask"),
        _pos_float("seconds", "time of one call, median over repeats"),
        _pos_float("tflops", "attention FLOPs / seconds / 1e12; FLOPs = 4 b h s^2 d (fwd), x2 for bwd, x1/2 if causal"),
        SOURCE,
    ),
    key=("device", "dtype", "pass", "batch", "seq_len", "num_heads", "num_kv_heads", "head_dim", "causal"),
    row_check=_attention_row_problem,
)


def scope_problem(scope: str, num_nodes: int) -> str | None:
    """Scope ``node`` is one node; every wider scope spans at least two (else the row is measured at another scope)."""
    if scope == "node" and num_nodes != 1:
        return f"scope node with num_nodes={num_nodes}; scope node is one node (use switch, group or system)"
    if scope != "node" and num_nodes < 2:
        return f"scope {scope} with num_nodes={num_nodes}; one node is scope node"
    return None


IMPORTED_ROUNDING_GBps = 0.005
"""Half the last digit of the bandwidths nccl-tests prints (two decimals): an imported row written before 2026-12-03
held the printed algbw and busbw, so they may be this far from bytes / seconds beyond RATE_TOLERANCE."""


def _collective_row_problem(row: dict) -> str | None:
    """Scope against nodes, at least two ranks, and the bandwidths the row's bytes and seconds give (algbw =
    bytes / seconds, busbw = algbw x the op's factor: a busbw of another rank count is a wrong --ranks-per-node)."""
    ranks = row["num_nodes"] * row["ranks_per_node"]
    if ranks < 2:
        return (f"num_nodes={row['num_nodes']} x ranks_per_node={row['ranks_per_node']}: a collective needs 2 ranks "
                "or more")
    algbw, busbw = collective_bandwidths_GBps(row["op"], ranks, row["bytes_per_rank"], row["seconds"])
    imported = source_kind(row["source"]) == "imported"
    printed = IMPORTED_ROUNDING_GBps if imported else 0.0
    for name, derived, formula, rounding in (
            ("algbw_GBps", algbw, "bytes_per_rank / seconds / 1e9", printed),
            ("busbw_GBps", busbw, f"algbw x {row['op']}'s factor at {ranks} ranks",
             printed * (1 + busbw_factor(row["op"], ranks)))):
        if abs(row[name] - derived) > RATE_TOLERANCE * derived + rounding:
            hint = "; or import the log again (piper calibrate import-nccl-tests)" if imported else ""
            return (f"column {name}: {row[name]:g}, but {formula} = {derived:.6g}; allowed within "
                    f"{RATE_TOLERANCE:.0%} of it{' and the printed rounding' if imported else ''}{hint}")
    return scope_problem(row["scope"], row["num_nodes"])


COLLECTIVES = Table(
    "collectives",
    (
        Column("op", "str", "collective", choices=OPS),
        Column("scope", "str", "widest network scope the group spans", choices=SCOPES),
        Column("num_nodes", "int", "nodes in the group", min_value=1, max_value=MAX_NODES),
        Column("ranks_per_node", "int", "ranks of the group on each node", min_value=1, max_value=MAX_DEVICES_PER_NODE),
        _pos_int("bytes_per_rank", "nccl-tests 'size' for this op (bytes)"),
        _pos_float("seconds", "time of one call (the slowest rank), median over repeats"),
        _pos_float("algbw_GBps", "bytes_per_rank / seconds / 1e9 (nccl-tests algbw)"),
        Column("busbw_GBps", "float", "algbw x the op's factor from nccl-tests PERFORMANCE.md", min_value=0.0,
               max_value=MAX_MEASURED),
        SOURCE,
    ),
    key=("op", "scope", "num_nodes", "ranks_per_node", "bytes_per_rank"),
    row_check=_collective_row_problem,
)

MEMORY_KERNELS = ("copy", "cast", "accumulate", "optimizer", "clip")
"""The memory-bound kernels ``memory.csv`` measures (calibration/bench_memory.py says what each moves)."""


MEMORY = Table(
    "memory",
    (
        Column("device", "str", "device name"),
        Column("kernel", "str", "the memory-bound kernel timed (bench_memory.py)", choices=MEMORY_KERNELS),
        _pos_int("elements", "elements of each tensor the kernel streams"),
        _pos_int("bytes", "bytes the call reads and writes in device memory"),
        _pos_float("seconds", "time of one call, median over repeats"),
        _pos_float("GBps", "bytes / seconds / 1e9"),
        SOURCE,
    ),
    key=("device", "kernel", "elements"),
    row_check=lambda row: rate_problem(row, "GBps", row["bytes"] / row["seconds"] / 1e9, "bytes / seconds / 1e9"),
)

TABLES: dict[str, Table] = {t.name: t for t in (GEMM, ATTENTION, COLLECTIVES, MEMORY)}


def gemm_flops(m, n, k, groups=1):
    """FLOPs of ``groups`` forward GEMMs [m x k] @ [k x n]: 2 m n k each (a multiply and an add)."""
    return 2.0 * m * n * k * groups


def attention_flops(batch, seq_len, num_heads, head_dim, causal, pass_: str):
    """Attention-core FLOPs (scores and weighted sum; no projections): 4 b h s^2 d forward.

    QK^T and PV are two matmuls of 2 b h s^2 d each (FlashAttention's benchmark convention); the backward
    pass has twice the matmuls (dQ, dK, dV, dP), so 8 b h s^2 d; a causal mask halves both, as in
    FlashAttention's ``flops(..., causal)``. Scalar or numpy arrays.
    """
    fwd = 4.0 * batch * num_heads * seq_len**2 * head_dim
    factor = {"fwd": 1.0, "bwd": 2.0}[pass_]
    import numpy as np

    return fwd * factor * np.where(causal, 0.5, 1.0)


def busbw_factor(op: str, num_ranks: int) -> float:
    """busbw / algbw per nccl-tests PERFORMANCE.md: all_reduce 2(n-1)/n; all_gather, reduce_scatter and
    all_to_all (n-1)/n; p2p (sendrecv) 1. HALO all-to-all moves the same data as all_to_all."""
    n = num_ranks
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all", "halo_all_to_all"):
        return (n - 1) / n
    return 1.0


def collective_bandwidths_GBps(op: str, num_ranks: int, bytes_per_rank: float, seconds: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s as nccl-tests defines them: algbw = bytes_per_rank / seconds, busbw = algbw x the op's
    factor at ``num_ranks`` (busbw_factor). What every collectives.csv row holds."""
    algbw = bytes_per_rank / seconds / 1e9
    return algbw, algbw * busbw_factor(op, num_ranks)


def source_kind(source: str) -> str:
    """'measured', 'seed' or 'imported' from a row's source text (its prefix before ':')."""
    head = source.split(":", 1)[0].strip().lower()
    return head if head in SOURCE_KINDS else "seed"
