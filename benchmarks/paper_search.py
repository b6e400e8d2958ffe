"""The search against the Piper paper's results: best predicted TFLOPS per GCD vs the published numbers.

Cases (piper-paper.md, "Results"): the weak-scaling family (16 / 128 / 256 experts on 8 / 64 / 128 nodes) and
the four X-MoE models on Piper's GPU counts 8 / 32 / 80 / 512 (1 / 4 / 10 / 64 Frontier nodes). The search runs
under --strategy piper (the paper's PP x EP mesh) and, for reference, the general space.
Writes docs/paper-search.md and prints the same table.

Assumptions (the paper does not publish them): global batch 1024 sequences for X-MoE Medium/Large/Super (X-MoE's
GBS; 8192 for Small); the weak-scaling family keeps the work per GCD constant, 16 sequences per GCD (1024 / 8192 /
16384 sequences on 64 / 512 / 1024 GCDs) — a fixed 1024 would be strong scaling in data: with PP = 32 (the only
valid plan at 1024 GCDs) and dp = 32 it leaves 32 micro-batches for 32 stages, a 49% pipeline bubble;
X-MoE models in fp16 (X-MoE's setting), the weak-scaling family in bf16; routing perfectly balanced (routing_skew 1). The goal is within 25%; the table reports what comes out.

Run: .venv/bin/python benchmarks/paper_search.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "paper-search.md"

WEAK_SEQUENCES_PER_GCD = 16
"""Weak scaling holds the work per GCD constant: 16 sequences per GCD (1024 at 64 GCDs) [assumption]."""

# (model, nodes, seq_len, global_batch, dtype, paper TFLOPS per GCD, citation)
CASES = [
    ("piper-weak-110b", 8, 4096, WEAK_SEQUENCES_PER_GCD * 64, "bf16", 45.15, "Piper weak scaling, 16 experts, 64 GPUs"),
    ("piper-weak-862b", 64, 4096, WEAK_SEQUENCES_PER_GCD * 512, "bf16", 39.38,
     "Piper weak scaling, 128 experts, 512 GPUs"),
    ("piper-weak-1.7t", 128, 4096, WEAK_SEQUENCES_PER_GCD * 1024, "bf16", 33.04,
     "Piper weak scaling, 256 experts, 1024 GPUs"),
    ("xmoe-small", 1, 2048, 8192, "fp16", 90.44, "Piper vs X-MoE table, Small 10.1B, 8 GPUs"),
    ("xmoe-medium", 4, 4096, 1024, "fp16", 57.83, "Piper vs X-MoE table, Medium 55.2B, 32 GPUs"),
    ("xmoe-large", 10, 4096, 1024, "fp16", 46.89, "Piper vs X-MoE table, Large 201.4B, 80 GPUs"),
    ("xmoe-super", 64, 4096, 1024, "fp16", 36.96, "Piper vs X-MoE table, Super 545.4B, 512 GPUs"),
]
PAPER_WEAK_EFFICIENCY = 0.73   # Piper: 73% weak-scaling efficiency 64 -> 1024 GPUs (33.04 / 45.15)
TOLERANCE = 0.25


def best_plan(model_name: str, nodes: int, seq: int, batch: int, dtype: str, strategy: str, calibration):
    from piper_plan.catalog import load_model, load_platform
    from piper_plan.search.engine import search
    from piper_plan.search.space import SearchOptions
    from piper_plan.specs import TrainingSpec

    model, platform = load_model(model_name), load_platform("frontier")
    training = TrainingSpec(seq_len=seq, global_batch=batch, dtype=dtype)
    r = search(model, platform, training, nodes, SearchOptions(strategy=strategy), calibration=calibration)
    return r, (r.row(r.best) if r.feasible else None)


def run_cases(calibration) -> list[dict]:
    rows = []
    for name, nodes, seq, batch, dtype, paper, cite in CASES:
        piper_r, piper_best = best_plan(name, nodes, seq, batch, dtype, "piper", calibration)
        _, general_best = best_plan(name, nodes, seq, batch, dtype, "general", calibration)
        predicted = piper_best["tflops_per_device"] if piper_best else None
        rows.append({"envelope": envelope(piper_r, paper), "model": name, "nodes": nodes, "gcds": nodes * 8, "seq": seq, "batch": batch, "paper": paper,
                     "cite": cite, "piper": piper_best, "general": general_best, "predicted": predicted,
                     "rel_error": None if predicted is None else (predicted - paper) / paper,
                     "feasible": piper_r.feasible})
    return rows


def envelope(result, paper: float) -> dict | None:
    """Predicted TFLOPS per GCD over every feasible --strategy piper plan (the paper publishes its chosen
    configuration for none of these runs): min / median / max, and the share of plans within 25% of the paper."""
    import numpy as np

    if not result.feasible:
        return None
    tflops = np.asarray(result.evaluation.tflops_per_device)[result.order]
    near = np.abs(tflops - paper) <= TOLERANCE * paper
    return {"plans": int(tflops.size), "min": float(tflops.min()), "median": float(np.median(tflops)),
            "max": float(tflops.max()), "share_within": float(near.mean())}


def envelope_lines(rows: list[dict]) -> list[str]:
    lines = ["## The paper's number against every feasible plan", "",
             "The paper does not publish the configuration behind any of these numbers. Over every feasible "
             "`--strategy piper` plan (same batch, same calibration), the model's predicted TFLOPS per GCD span:", "",
             "| model | feasible plans | min | median | max | paper | paper inside [min, max] | plans within 25% of the paper |",
             "|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        e = r["envelope"]
        if e is None:
            lines.append(f"| {r['model']} | 0 | - | - | - | {r['paper']:.2f} | - | - |")
            continue
        inside = "yes" if e["min"] <= r["paper"] <= e["max"] else "**no**"
        lines.append(f"| {r['model']} | {e['plans']} | {e['min']:.1f} | {e['median']:.1f} | {e['max']:.1f} | "
                     f"{r['paper']:.2f} | {inside} | {100 * e['share_within']:.0f}% |")
    return lines + [""]


def plan_text(p: dict | None) -> str:
    if p is None:
        return "nothing fits"
    return (f"pp{p['pp']} ep{p['ep']} dp{p['dp']} tp{p['tp']} mbs{p['mbs']} {p['schedule']} "
            f"rc={p['recompute']} z{p['zero']} {p['a2a']}")


def weak_efficiency(rows: list[dict]) -> float | None:
    by = {r["model"]: r for r in rows}
    lo, hi = by["piper-weak-110b"]["predicted"], by["piper-weak-1.7t"]["predicted"]
    return None if lo is None or hi is None else hi / lo


def render(rows: list[dict], calibration_note: str, seconds: float) -> str:
    lines = ["# Search vs the Piper paper (Frontier, TFLOPS per GCD)", "",
             "Generated by `benchmarks/paper_search.py` (do not edit by hand). Paper numbers: "
             "`reference/piper-paper.md` (Dash & Wang, arXiv 2605.05049). Best plan under `--strategy piper` "
             "(PP x EP mesh, tp = 1, dp = ep, ep <= 32); the general space's best beside it.", "",
             f"Calibration: {calibration_note}. Goal: within {TOLERANCE:.0%} of the paper.", "",
             "| model | nodes | GCDs | best piper plan | predicted | paper | error | within 25% | general best | general TFLOPS |",
             "|---|---:|---:|---|---:|---:|---:|---|---|---:|"]
    for r in rows:
        pred = "-" if r["predicted"] is None else f"{r['predicted']:.1f}"
        err = "-" if r["rel_error"] is None else f"{100 * r['rel_error']:+.0f}%"
        ok = "-" if r["rel_error"] is None else ("yes" if abs(r["rel_error"]) <= TOLERANCE else "**no**")
        gen = r["general"]
        lines.append(f"| {r['model']} | {r['nodes']} | {r['gcds']} | {plan_text(r['piper'])} | {pred} | {r['paper']:.2f} "
                     f"| {err} | {ok} | {plan_text(gen)} | {'-' if gen is None else format(gen['tflops_per_device'], '.1f')} |")
    eff = weak_efficiency(rows)
    lines += ["", f"Weak-scaling efficiency 64 -> 1024 GCDs (TFLOPS per GCD at 1024 / at 64): predicted "
              f"{'-' if eff is None else format(100 * eff, '.0f') + '%'}, paper {100 * PAPER_WEAK_EFFICIENCY:.0f}%.", "",
              "Assumptions: global batch 1024 sequences for X-MoE Medium/Large/Super (Small: 8192, X-MoE's setting); "
              f"weak-scaling family {WEAK_SEQUENCES_PER_GCD} sequences per GCD (1024 / 8192 / 16384: constant work "
              "per GCD, the definition of weak scaling); X-MoE models fp16, weak-scaling family bf16, balanced "
              "routing; the paper does not publish its batch sizes or parallel configurations.", "",
              f"Search time for all cases: {seconds:.1f} s.", "", *envelope_lines(rows), ANALYSIS]
    return "\n".join(lines)


ANALYSIS = """## Analysis of the gaps (no constant tuned to these held-out numbers)

Result: 3 of 7 within 25%. The table above ("every feasible plan") is the key: for the three weak-scaling sizes
even the *slowest* feasible plan is predicted faster than the paper's number, and for X-MoE Small the *fastest*
is predicted slower. No choice of the unpublished configuration (schedule, micro-batch, recompute, ZeRO, PP / EP
split) reconciles them: the gap is in the rates (the calibration's kernel rates or the paper's executor), or in
the FLOP convention, not in the search. The two groups pull in opposite directions (weak family 1.6-1.8x above
the paper, Small 0.57x), so no single efficiency factor could absorb both; none was fitted. Checked for modelling
errors:

- **Batch assumption.** At 1024 GCDs the only valid Piper plan is PP = 32, EP = dp = 32; a fixed global batch of
  1024 would leave 32 micro-batches for 32 stages (a 49% bubble: predicted weak-scaling efficiency 42%). Weak
  scaling keeps the work per GCD constant; with 16 sequences per GCD the 1.7T winner has a small bubble (test:
  tests/search/test_engine.py `test_paper_search_weak_scaling_keeps_work_per_gcd`). The batch does not move
  the 110B row (64 or more micro-batches either way), which is +57% on its own.
- **Scope of EP groups.** ep = dp groups of consecutive ranks (DESIGN.md rank order): EP 8 stays in one node,
  EP 32 spans 4 nodes of one switch on a compact allocation (estimate `scopes`: ep = switch, pp = group);
  correct. HALO phase II (inter-node) has no calibration rows on Frontier yet: alpha-beta, and the estimate
  says so.
- **All-to-all volume.** Each rank sends mbs x s x k token rows of d x 2 B per dispatch (and the same per
  combine), 4 all-to-alls per MoE layer per micro-batch in training (2 forward, 2 backward): the paper's lower
  bound 4 b s k d / (EP B_NIC) per rank; correct.
- **Expert GEMM shapes, weak family.** Received rows per rank mbs x s x k (balanced routing), split over E / EP
  local experts as a grouped GEMM: 110B (EP 8, 2 experts per rank) runs 8,192-row GEMMs of [5120 x 20480],
  priced at ~110 TFLOPS (flagged extrapolation from the largest seed rows; rocBLAS reaches ~60% of the 191.5
  peak, platforms.md). Compute dominates and the all-to-all stays inside a node. The paper's 45 TFLOPS is below
  what its lab's single-node profiles reach for expert GEMMs (~95-120) and below its own single-layer ceiling
  for the similar Mixtral 8x22B layer (129.4, one node); its executor (PyTorch pipelining + Tutel, piper-paper.md)
  loses more than the model's bubble, recompute and communication terms account for. Not modelled, not tuned.
- **Activation memory.** The paper's own M(i) (4 b H s^2: scores materialised) puts the 110B stage 0 far over
  64 GB without checkpointing, so its runs recompute; the model's winners recompute too (rc = full). Pricing
  non-flash attention (the paper's memory model) moves the weak family only from +57/+61/+83% to about
  +49/+53/+74% (measured with this script's search and `TrainingSpec(flash_attention=False)`).
- **X-MoE Small.** Its grouped expert GEMM was, until 2026-11-30, priced at 120 TFLOPS: outside the seed rows'
  hull the nearest point was chosen with the group count weighted like a shape dimension, so a 64-group
  [768 x 1408 x 2048] query took the rate of a 32-group [2048 x 2048 x 7168] row. It now takes the rate of the
  nearest per-GEMM shape (its own family, 43 TFLOPS measured at 1,536 rows; test:
  tests/calibration/test_calibration_curves.py), which moved Small from -27% to -43%. The paper's 90.44 TFLOPS
  (47% of peak) for 1,408-wide experts is above every rate the same lab measured at these shapes under PaLM's
  active-parameter FLOP count; its FLOP convention is not published (X-MoE pads experts to a capacity factor of
  1.25). Left as a documented gap.
"""


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from piper_plan.fileio import atomic_write_text

    try:
        from piper_plan.calibration import load_calibration
        calibration = load_calibration("frontier")
    except ImportError:
        calibration = None
    note = ("calibration/frontier (" + ", ".join(getattr(calibration, "sources", [])[:3]) + ")") if calibration \
        else "none (the platform's roofline efficiency fallback)"
    start = time.perf_counter()
    rows = run_cases(calibration)
    text = render(rows, note, time.perf_counter() - start)
    atomic_write_text(DOC, text)
    print(text)


if __name__ == "__main__":
    main()
