"""PNG pictures of piper's results (the ``plot`` extra: matplotlib): data in, file out.

Pure plotting: each function takes plain data (arrays, dicts) that the library computed and writes one PNG
atomically (``piper_plan.fileio``). matplotlib is imported only when a picture is drawn, with the Agg backend (no
display needed), so ``piper --help`` and the planner never load it.
"""

from __future__ import annotations

import io
from pathlib import Path

from piper_plan.errors import PiperError
from piper_plan.fileio import atomic_write_bytes, check_writable

GiB = 2**30
DPI = 120

REASON_COLOURS = {"out_of_memory": "tab:red", "not_runnable": "tab:orange"}
"""Colour of each reason an evaluated candidate is rejected for (plan plot); other reasons are grey."""
MEMORY_COLOURS = {"weights": "tab:blue", "gradients": "tab:orange", "optimizer": "tab:green",
                  "activations": "tab:red", "framework + fragmentation": "tab:grey", "other": "tab:purple"}
"""The stacked components of the estimate plot, bottom to top."""


def check_plot_path(path: str | Path, option: str = "--plot") -> Path:
    """Refuse now (before any work) a picture path piper cannot write or that is not a .png file."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise PiperError(f"{path.name!r}: a plot is written as PNG; give a file name ending in .png", field=option)
    check_writable(path)
    return path


def pyplot():
    """matplotlib.pyplot with the Agg backend; a missing extra is one PiperError line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PiperError("--plot needs matplotlib: pip install -e '.[plot]' in piper's checkout (its extra plot)") \
            from None
    return plt


def save_png(fig, path: str | Path) -> Path:
    """Render ``fig`` to PNG in memory, close it, and write the file atomically."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")      # a long title or label is never cut off
    pyplot().close(fig)
    return atomic_write_bytes(path, buf.getvalue())


# ---- piper plan ----------------------------------------------------------------------------------------
def plan_plot(path, tokens_per_s, peak_bytes, status, pareto, best: int | None, limit_bytes: float,
              title: str) -> Path:
    """Throughput vs peak memory of every evaluated candidate: feasible ones in blue, the rejected ones coloured by
    reason (``status``: "feasible" or the reason, one per candidate), the Pareto set joined by a line, the chosen
    plan starred, the device limit as a vertical line."""
    import numpy as np

    plt = pyplot()
    tokens, mem_GiB, status = np.asarray(tokens_per_s), np.asarray(peak_bytes) / GiB, np.asarray(status)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for reason in [r for r in np.unique(status) if r != "feasible"]:
        sel = status == reason
        ax.scatter(mem_GiB[sel], tokens[sel], s=6, alpha=0.35, color=REASON_COLOURS.get(reason, "tab:grey"),
                   label=f"{reason} ({np.count_nonzero(sel):,})", rasterized=True)
    sel = status == "feasible"
    ax.scatter(mem_GiB[sel], tokens[sel], s=8, alpha=0.6, color="tab:blue", label=f"fits ({np.count_nonzero(sel):,})",
               rasterized=True)
    front = np.asarray(pareto, dtype=int)
    if len(front):
        ax.plot(mem_GiB[front], tokens[front], "-o", color="black", ms=4, lw=1, label=f"Pareto set ({len(front)})")
    if best is not None:
        ax.scatter([mem_GiB[best]], [tokens[best]], marker="*", s=260, color="gold", edgecolor="black", zorder=5,
                   label="chosen plan")
    ax.axvline(limit_bytes / GiB, color="tab:red", ls="--", lw=1, label=f"device limit {limit_bytes / GiB:.0f} GiB")
    ax.set_xscale("log")
    ax.set_xlabel("peak memory per device (GiB, log)")
    ax.set_ylabel("predicted tokens/s")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_png(fig, path)


# ---- piper estimate ------------------------------------------------------------------------------------
def memory_groups(components: dict[str, float]) -> dict[str, float]:
    """One stage's memory components (estimate's names) summed into MEMORY_COLOURS' groups, in bytes."""
    groups = dict.fromkeys(MEMORY_COLOURS, 0.0)
    for name, nbytes in components.items():
        if name.startswith("activations/"):
            key = "activations"
        elif name in ("framework", "fragmentation"):
            key = "framework + fragmentation"
        else:
            key = name if name in groups else "other"
        groups[key] += nbytes
    return groups


def estimate_plot(path, stages: list[dict[str, float]], device_bytes: float, title: str) -> Path:
    """Memory per pipeline stage, stacked by component (``stages``: one components dict per stage, bytes),
    against the device's memory as a horizontal line."""
    plt = pyplot()
    grouped = [memory_groups(c) for c in stages]
    x = list(range(len(stages)))
    fig, ax = plt.subplots(figsize=(min(12.0, max(6.0, 0.25 * len(stages) + 4)), 4.5))
    bottom = [0.0] * len(stages)
    for group, colour in MEMORY_COLOURS.items():
        heights = [g[group] / GiB for g in grouped]
        if not any(heights):
            continue
        ax.bar(x, heights, bottom=bottom, color=colour, label=group, width=0.75)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.axhline(device_bytes / GiB, color="black", ls="--", lw=1, label=f"device {device_bytes / GiB:.0f} GiB")
    ax.set_xticks(x, [str(i) for i in x], fontsize=8 if len(x) <= 32 else 6)
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("GiB per device")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return save_png(fig, path)


# ---- piper compare -------------------------------------------------------------------------------------
def compare_plot(path, steps: list[int], step_time_s: list[float], predicted_step_s: float | None,
                 terms: dict[str, dict], title: str) -> Path:
    """Left: measured step time per step against the predicted one. Right: each time term (compare's
    ``time_s``: {predicted, measured} seconds per step), predicted and measured side by side."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(steps, step_time_s, "-o", ms=3, label="measured")
    if predicted_step_s is not None:
        left.axhline(predicted_step_s, color="tab:orange", ls="--", label=f"predicted {predicted_step_s:.4g} s")
    left.set_xlabel("step")
    left.set_ylabel("step time (s)")
    left.xaxis.get_major_locator().set_params(integer=True)      # steps are whole (a resumed run's few steps too)
    left.legend(fontsize=8)
    names = list(terms)
    x = list(range(len(names)))
    for offset, side, colour in ((-0.2, "predicted", "tab:orange"), (0.2, "measured", "tab:blue")):
        values = [terms[n][side] or 0.0 for n in names]
        right.bar([i + offset for i in x], values, width=0.4, color=colour, label=side)
    right.set_xticks(x, names)
    right.set_ylabel("seconds per step")
    right.set_title("measured: median of steady steps (migration: mean)", fontsize=8)
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_png(fig, path)
