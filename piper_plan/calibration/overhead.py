"""``overhead.csv``: the framework-overhead rows ``piper calibrate --only overhead`` measures (bench_overhead.py),
and their loading into the cost model's :class:`piper_plan.cost.overhead.FrameworkOverhead`. No torch.

Columns: ``op`` (attention_layer, dense_mlp, moe_block, head_loss, optimizer_tensor, concurrency, autograd_op;
attention_layer_forward and moe_block_forward: the forward alone, what full recompute runs again),
``size`` (moe_block: local experts; optimizer_tensor: parameter tensors stepped; concurrency: ranks running at
once on the host; otherwise 1), ``seconds`` (median of one call: forward + backward of the block for one
micro-batch; one optimizer step; concurrency: per-rank seconds of the reference workload), ``source``.
Block rows are the fastest sample (the piece's own cost); concurrency rows are the mean seconds per iteration of
the moe_block workload with 4 local experts while ``size`` gloo ranks run it in lockstep (a tiny all_reduce after
each call): their ratio to that block's row is the slowdown a rank sees from the host's load, from ranks sharing
its cores and from waiting at each collective for a peer that was preempted. lockstep_outside / lockstep_wait
(``bench_overhead --launched-ranks``, e.g. ranks on the emulated network) time one moe_block workload and a small
all_to_all after it apart, per rank: the seconds outside the exchange per workload, and the seconds inside it
beyond the fastest exchange alone; where present for a rank count they give that count's slowdown and wait.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from piper_plan.calibration.schema import MIN_MEASURED, SOURCE, Column, Table, _pos_int

CONCURRENCY_WORKLOAD_EXPERTS = 4      # bench_overhead.measure_concurrency runs moe_block with 4 local experts
OVERHEAD_OPS = ("autograd_op", "attention_layer", "dense_mlp", "moe_block", "head_loss", "optimizer_tensor",
                "concurrency", "concurrency_coarse", "lockstep_outside", "lockstep_wait", "attention_layer_forward",
                "moe_block_forward")
COARSE_CALLS = 3       # bench_overhead.COARSE_CALLS: workloads per collective in the concurrency_coarse rows
MAX_CALL_SECONDS = 600.0
"""Longest one call an overhead row may hold: the benchmark times small runtime modules, its whole run about 40 s
on 2 cores (``piper calibrate overhead``); a call of over ten minutes is a corrupt row, not a measurement, and
every step of every plan would carry it."""
OVERHEAD = Table(
    "overhead",
    (
        Column("op", "str", "what was timed", choices=OVERHEAD_OPS),
        _pos_int("size", "moe_block: local experts; optimizer_tensor: tensors; concurrency: ranks at once; else 1"),
        Column("seconds", "float", "median seconds of one call (forward + backward for blocks), one rank",
               min_value=MIN_MEASURED, max_value=MAX_CALL_SECONDS),
        SOURCE,
    ),
    key=("op", "size"),
)


def read_overhead(directory: str | Path) -> dict | None:
    """The validated columns of ``directory/overhead.csv`` (io.read_columns: no pandas, which pricing a plan never
    imports), or None when absent."""
    from piper_plan.calibration.io import columns_if_present

    return columns_if_present(directory, OVERHEAD)


class _ByOp:
    """overhead.csv's rows by op: (sizes, seconds) as float arrays sorted by size. (Its own few lines, not
    curves.Rows: curves loads this module, and the layering admits no cycle.)"""

    def __init__(self, columns) -> None:
        self.op = np.asarray(columns["op"], dtype=str)
        self.size = np.asarray(columns["size"], dtype=float)
        self.seconds = np.asarray(columns["seconds"], dtype=float)
        self.sources = sorted(set(np.asarray(columns["source"], dtype=str).tolist()))

    def __call__(self, op: str) -> tuple[np.ndarray, np.ndarray]:
        mine = self.op == op
        order = np.argsort(self.size[mine], kind="stable")
        return self.size[mine][order], self.seconds[mine][order]

    def at(self, op: str, size: float) -> float | None:
        sizes, seconds = self(op)
        hit = seconds[sizes == size]
        return float(hit[0]) if hit.size else None


def overhead_from_rows(columns):
    """rows (a mapping of column -> values: read_columns' dict or a DataFrame) -> FrameworkOverhead (linear fits over
    local experts and tensors; concurrency relative to 1 rank)."""
    from piper_plan.cost.overhead import FrameworkOverhead, linear_fit

    rows = _ByOp(columns)

    def single(op):
        sizes, seconds = rows(op)
        return float(seconds[0] / sizes[0]) if sizes.size else 0.0

    moe = rows("moe_block")
    moe_a, moe_b = linear_fit(*moe) if moe[0].size else (0.0, 0.0)
    opt = rows("optimizer_tensor")
    opt_a, opt_b = linear_fit(*opt) if opt[0].size else (0.0, 0.0)
    conc = rows("concurrency")
    ranks, factor, wait = (1,), (1.0,), (0.0,)
    alone = rows.at("moe_block", CONCURRENCY_WORKLOAD_EXPERTS)
    if conc[0].size and alone is not None:
        ranks, factor, wait = _slowdown_and_wait(conc, rows("concurrency_coarse"), alone)
        factor, wait = _timed_apart(ranks, factor, wait, rows("lockstep_outside"), rows("lockstep_wait"), alone)
    return FrameworkOverhead(single("attention_layer"), single("dense_mlp"), moe_a, moe_b, single("head_loss"),
                             opt_a, opt_b, ranks, factor, "; ".join(rows.sources), wait, _forward_share(rows))


def _forward_share(rows: _ByOp) -> float:
    """The forward's share of a layer's forward + backward: (attention_layer_forward + moe_block_forward) over
    (attention_layer + moe_block) at the forward row's expert count; 0 without forward rows."""
    fwd_attn, attn = rows.at("attention_layer_forward", 1), rows.at("attention_layer", 1)
    sizes, fwd_moe = rows("moe_block_forward")
    both = rows.at("moe_block", sizes[0]) if sizes.size else None
    if fwd_attn is None or attn is None or both is None:
        return 0.0
    return min((fwd_attn + float(fwd_moe[0])) / (attn + both), 1.0)


def _slowdown_and_wait(fine, coarse, workload_s: float):
    """(ranks, slowdown, wait seconds per collective) from the lockstep rows ((sizes, seconds) each): an iteration
    of g workloads and one collective takes g x workload x slowdown + wait (g = 1 fine, COARSE_CALLS coarse);
    without coarse rows the whole excess is slowdown (wait 0)."""
    ranks = tuple(int(v) for v in fine[0])
    t1, tg = dict(zip(ranks, fine[1].tolist())), dict(zip((int(v) for v in coarse[0]), coarse[1].tolist()))
    factor, wait = [], []
    for n in ranks:
        if n in tg:
            slow = max((tg[n] - t1[n]) / ((COARSE_CALLS - 1) * workload_s), 1.0)
            factor.append(slow)
            wait.append(max(t1[n] - workload_s * slow, 0.0))
        else:
            factor.append(max(t1[n] / workload_s, 1.0))
            wait.append(0.0)
    return ranks, tuple(factor), tuple(wait)


def _timed_apart(ranks, factor, wait, outside, waited, workload_s: float):
    """(slowdown, wait) per entry of ``ranks``, replaced where the lockstep_outside / lockstep_wait rows ((sizes,
    seconds) each) timed the workload and the exchange apart (bench_overhead --launched-ranks): slowdown = the
    workload's time outside the exchange over its time alone, wait = the time inside the exchange beyond the
    exchange alone. As the runtime's timers split a step, so the wait lands on the exchanges, not on the compute."""
    out_s = dict(zip((int(v) for v in outside[0]), outside[1].tolist()))
    wait_s = dict(zip((int(v) for v in waited[0]), waited[1].tolist()))
    both = [n in out_s and n in wait_s for n in ranks]
    factor = tuple(max(out_s[n] / workload_s, 1.0) if ok else f for n, f, ok in zip(ranks, factor, both))
    wait = tuple(wait_s[n] if ok else w for n, w, ok in zip(ranks, wait, both))
    return factor, wait


def load_overhead(directory: str | Path):
    """FrameworkOverhead of a calibration directory, or None when it has no overhead.csv."""
    columns = read_overhead(directory)
    return None if columns is None or not len(columns["op"]) else overhead_from_rows(columns)
