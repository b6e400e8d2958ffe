"""What ``piper calibrate show`` prints: curve summaries (pure, JSON-able) and their rich rendering."""

from __future__ import annotations

import pandas as pd

from piper_plan.calibration.schema import source_kind


def _ranges(frame: pd.DataFrame, columns: list[str]) -> dict:
    return {c: [_num(frame[c].min()), _num(frame[c].max())] for c in columns}


def _num(v):
    return v.item() if hasattr(v, "item") else v


def _kinds(frame: pd.DataFrame) -> dict:
    return {k: int(n) for k, n in frame["source"].map(source_kind).value_counts().items()}


def summary(cal) -> dict:
    """Per curve: the measured ranges (outside them queries are flagged extrapolated) and seed/measured counts."""
    out = {"directory": str(cal.directory), "sources": cal.sources, "gemm": [], "attention": [], "collectives": [],
           "memory": []}
    for dtype, f in cal.gemm.groupby("dtype"):
        out["gemm"].append({"dtype": dtype, "rows": len(f), "kinds": _kinds(f), "range": _ranges(f, ["m", "n", "k", "groups"]),
                            "tflops": [float(f.tflops.min()), float(f.tflops.max())]})
    for (dtype, pass_, causal), f in cal.attention.groupby(["dtype", "pass", "causal"]):
        out["attention"].append({"dtype": dtype, "pass": pass_, "causal": bool(causal), "rows": len(f), "kinds": _kinds(f),
                                 "range": _ranges(f, ["seq_len", "num_heads", "head_dim"]),
                                 "tflops": [float(f.tflops.min()), float(f.tflops.max())]})
    for (op, scope), f in cal.collectives.groupby(["op", "scope"]):
        ranks = sorted({int(n * g) for n, g in zip(f.num_nodes, f.ranks_per_node)})
        out["collectives"].append({"op": op, "scope": scope, "rows": len(f), "kinds": _kinds(f), "num_ranks": ranks,
                                   "bytes_per_rank": [int(f.bytes_per_rank.min()), int(f.bytes_per_rank.max())],
                                   "busbw_GBps": [float(f.busbw_GBps.min()), float(f.busbw_GBps.max())]})
    for kernel, f in cal.memory.groupby("kernel"):     # the cost model takes each kernel's fastest row
        out["memory"].append({"kernel": kernel, "rows": len(f), "kinds": _kinds(f),
                              "elements": [int(f.elements.min()), int(f.elements.max())],
                              "GBps": [float(f.GBps.min()), float(f.GBps.max())]})
    return out


def render_tables(cal, data: dict, console, print_table) -> None:
    """The sources' lines on ``console``, the tables through ``print_table`` (the CLI's: whole at any width)."""
    from rich.table import Table

    for line in data["sources"]:
        console.print(line, markup=False)
    print_table(_gemm_table(cal, Table))
    print_table(_attention_table(cal, Table))
    print_table(_collectives_table(cal, Table))
    if data["memory"]:
        print_table(_memory_table(data["memory"], Table))
    ranges = Table(title="extrapolation: queries outside these measured ranges are flagged")
    for col in ("curve", "measured range"):
        ranges.add_column(col)
    for kind in ("gemm", "attention", "collectives"):
        for c in data[kind]:
            name = " ".join(str(c[k]) for k in ("dtype", "pass", "causal", "op", "scope") if k in c)
            span = c.get("range") or {"num_ranks": c["num_ranks"], "bytes_per_rank": c["bytes_per_rank"]}
            ranges.add_row(f"{kind} {name}", "; ".join(f"{k} {v}" for k, v in span.items()))
    print_table(ranges)


def _gemm_table(cal, Table):
    t = Table(title=f"GEMM ({len(cal.gemm)} rows)")
    for col in ("dtype", "m", "n", "k", "groups", "TFLOPS", "kind"):
        t.add_column(col, justify="right")
    for r in cal.gemm.itertuples(index=False):
        t.add_row(r.dtype, str(r.m), str(r.n), str(r.k), str(r.groups), f"{r.tflops:.3g}", source_kind(r.source))
    return t


def _attention_table(cal, Table):
    t = Table(title=f"attention ({len(cal.attention)} rows)")
    for col in ("dtype", "pass", "causal", "batch", "seq", "heads", "head_dim", "TFLOPS", "kind"):
        t.add_column(col, justify="right")
    for r in cal.attention.itertuples(index=False):
        t.add_row(r.dtype, r[2], str(r.causal), str(r.batch), str(r.seq_len), str(r.num_heads), str(r.head_dim),
                  f"{r.tflops:.3g}", source_kind(r.source))
    return t


def _collectives_table(cal, Table):
    t = Table(title=f"collectives ({len(cal.collectives)} rows)")
    for col in ("op", "scope", "nodes x ranks", "bytes/rank", "time us", "busbw GB/s", "kind"):
        t.add_column(col, justify="right")
    for r in cal.collectives.itertuples(index=False):
        t.add_row(r.op, r.scope, f"{r.num_nodes} x {r.ranks_per_node}", str(r.bytes_per_rank), f"{r.seconds * 1e6:.4g}",
                  f"{r.busbw_GBps:.3g}", source_kind(r.source))
    return t


def _memory_table(memory: list[dict], Table):
    t = Table(title="memory-bound kernels (the cost model streams each at its fastest row)")
    for col in ("kernel", "rows", "elements", "GB/s"):
        t.add_column(col, justify="right")
    for m in memory:
        t.add_row(m["kernel"], str(m["rows"]), " .. ".join(f"{e:,}" for e in m["elements"]),
                  " .. ".join(f"{g:.4g}" for g in m["GBps"]))
    return t


def plot_curves(cal, path: str):
    """A PNG: GEMM TFLOPS vs tokens, attention TFLOPS vs sequence, collective busbw vs bytes (log axes)."""
    from piper_plan.plots import pyplot, save_png

    fig, axes = pyplot().subplots(1, 3, figsize=(16, 4.5))
    for (dtype, n, k, g), f in cal.gemm.groupby(["dtype", "n", "k", "groups"]):
        axes[0].plot(f.m, f.tflops, marker="o", label=f"{dtype} n{n} k{k} g{g}")
    for (dtype, p, c, h, d), f in cal.attention.groupby(["dtype", "pass", "causal", "num_heads", "head_dim"]):
        axes[1].plot(f.seq_len, f.tflops, marker="o", label=f"{dtype} {p} {'causal' if c else 'full'} h{h} d{d}")
    for (op, scope, nn, g), f in cal.collectives.groupby(["op", "scope", "num_nodes", "ranks_per_node"]):
        axes[2].plot(f.bytes_per_rank, f.busbw_GBps, marker="o", label=f"{op} {scope} {nn}x{g}")
    for ax, (x, y) in zip(axes, (("tokens m", "TFLOPS"), ("seq_len", "TFLOPS"), ("bytes per rank", "busbw GB/s"))):
        ax.set_xscale("log"), ax.set_yscale("log"), ax.set_xlabel(x), ax.set_ylabel(y), ax.legend(fontsize=5)
    fig.suptitle(str(cal.directory))
    fig.tight_layout()
    return save_png(fig, path)
