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


def read_overhead(directory: str | Path):
    """The validated rows of ``directory/overhead.csv`` (pandas), or None when absent."""
    from piper_plan.calibration.io import read_if_present

    return read_if_present(directory, OVERHEAD)


def overhead_from_rows(frame):
    """rows -> FrameworkOverhead (linear fits over local experts and tensors; concurrency relative to 1 rank)."""
    from piper_plan.cost.overhead import FrameworkOverhead, linear_fit

    def rows(op):
        return frame[frame["op"] == op].sort_values("size")

    def single(op):
        r = rows(op)
        return float(r["seconds"].iloc[0] / r["size"].iloc[0]) if len(r) else 0.0

    moe = rows("moe_block")
    moe_a, moe_b = linear_fit(moe["size"], moe["seconds"]) if len(moe) else (0.0, 0.0)
    opt = rows("optimizer_tensor")
    opt_a, opt_b = linear_fit(opt["size"], opt["seconds"]) if len(opt) else (0.0, 0.0)
    conc = rows("concurrency")
    ranks, factor = (1,), (1.0,)
    alone = moe[moe["size"] == CONCURRENCY_WORKLOAD_EXPERTS]["seconds"]
    wait = (0.0,)
    if len(conc) and len(alone):
        ranks, factor, wait = _slowdown_and_wait(conc, rows("concurrency_coarse"), float(alone.iloc[0]))
        factor, wait = _timed_apart(ranks, factor, wait, rows("lockstep_outside"), rows("lockstep_wait"),
                                    float(alone.iloc[0]))
    sources = sorted(set(frame["source"]))
    return FrameworkOverhead(single("attention_layer"), single("dense_mlp"), moe_a, moe_b, single("head_loss"),
                             opt_a, opt_b, ranks, factor, "; ".join(sources), wait, _forward_share(rows))


def _forward_share(rows) -> float:
    """The forward's share of a layer's forward + backward: (attention_layer_forward + moe_block_forward) over
    (attention_layer + moe_block) at the forward row's expert count; 0 without forward rows."""
    fwd_attn, fwd_moe, attn, moe = (rows(op) for op in ("attention_layer_forward", "moe_block_forward",
                                                        "attention_layer", "moe_block"))
    if not (len(fwd_attn) and len(fwd_moe) and len(attn)):
        return 0.0
    experts = int(fwd_moe["size"].iloc[0])
    both = moe[moe["size"] == experts]["seconds"]
    if not len(both):
        return 0.0
    share = (float(fwd_attn["seconds"].iloc[0]) + float(fwd_moe["seconds"].iloc[0])) / \
        (float(attn["seconds"].iloc[0]) + float(both.iloc[0]))
    return min(share, 1.0)


def _slowdown_and_wait(fine, coarse, workload_s: float):
    """(ranks, slowdown, wait seconds per collective) from the lockstep rows: an iteration of g workloads and one
    collective takes g x workload x slowdown + wait (g = 1 fine, COARSE_CALLS coarse); without coarse rows the
    whole excess is slowdown (wait 0)."""
    ranks = tuple(int(v) for v in fine["size"])
    t1 = dict(zip(fine["size"], fine["seconds"].astype(float)))
    tg = dict(zip(coarse["size"], coarse["seconds"].astype(float)))
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
    """(slowdown, wait) per entry of ``ranks``, replaced where the lockstep_outside / lockstep_wait rows timed the
    workload and the exchange apart (bench_overhead --launched-ranks): slowdown = the workload's time outside
    the exchange over its time alone, wait = the time inside the exchange beyond the exchange alone. As the
    runtime's timers split a step, so the wait lands on the exchanges, not on the compute."""
    out_s = dict(zip(outside["size"], outside["seconds"].astype(float)))
    wait_s = dict(zip(waited["size"], waited["seconds"].astype(float)))
    both = [n in out_s and n in wait_s for n in ranks]
    factor = tuple(max(out_s[n] / workload_s, 1.0) if ok else f for n, f, ok in zip(ranks, factor, both))
    wait = tuple(wait_s[n] if ok else w for n, w, ok in zip(ranks, wait, both))
    return factor, wait


def load_overhead(directory: str | Path):
    """FrameworkOverhead of a calibration directory, or None when it has no overhead.csv."""
    frame = read_overhead(directory)
    return None if frame is None or frame.empty else overhead_from_rows(frame)
