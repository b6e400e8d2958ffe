"""The search against the Piper paper's results: best predicted TFLOPS per GCD vs the published numbers.

Cases (piper-paper.md, "Results"): the weak-scaling family (16 / 128 / 256 experts on 8 / 64 / 128 nodes) and
the four X-MoE models on Piper's GPU counts 8 / 32 / 80 / 512 (1 / 4 / 10 / 64 Frontier nodes). The search runs
under --strategy piper (the paper's PP x EP mesh) and, for reference, the general space.
Writes docs/paper-search.md and prints the same table.

Assumptions (the paper does not publish them): global batch 1024 sequences for X-MoE Medium/Large/Super (X-MoE's
GBS; 8192 for Small); every model priced in bf16: X-MoE trained in fp16 (piper-paper.md), which on MI250X has the
same matrix peak as bf16 (platforms/frontier.yaml peak_flops), and calibration/frontier measured bf16 only (fp16
would fall back to the roofline); routing perfectly balanced (routing_skew 1).

The weak-scaling family's global batch is not published either. Weak scaling keeps the work per GCD constant, so
the batch is S sequences per GCD with one S for all three sizes; S is FITTED on the 110B row alone (the grid
below, the value whose best plan comes closest to the paper's 45.15), and the 862B and 1.7T rows and the weak-
scaling efficiency are held out (validation/piper-frontier-moe.yaml marks the 110B row split: fit). The
sensitivity table in the output shows every S for all three rows. The goal is within 25%; the table reports
what comes out.

Run: .venv/bin/python benchmarks/paper_search.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "paper-search.md"

WEAK_SEQUENCES_PER_GCD_GRID = (0.5, 1, 2, 4, 8, 16)
"""Candidate sequences per GCD for the weak-scaling family's unpublished global batch (powers of two)."""

# (model, nodes, paper TFLOPS per GCD, citation); seq 4096, bf16, global batch = S x GCDs
WEAK_CASES = [
    ("piper-weak-110b", 8, 45.15, "Piper weak scaling, 16 experts, 64 GPUs"),
    ("piper-weak-862b", 64, 39.38, "Piper weak scaling, 128 experts, 512 GPUs"),
    ("piper-weak-1.7t", 128, 33.04, "Piper weak scaling, 256 experts, 1024 GPUs"),
]
WEAK_FIT_ROW = "piper-weak-110b"

# (model, nodes, seq_len, global_batch, dtype, paper TFLOPS per GCD, citation)
XMOE_CASES = [
    ("xmoe-small", 1, 2048, 8192, "bf16", 90.44, "Piper vs X-MoE table, Small 10.1B, 8 GPUs"),
    ("xmoe-medium", 4, 4096, 1024, "bf16", 57.83, "Piper vs X-MoE table, Medium 55.2B, 32 GPUs"),
    ("xmoe-large", 10, 4096, 1024, "bf16", 46.89, "Piper vs X-MoE table, Large 201.4B, 80 GPUs"),
    ("xmoe-super", 64, 4096, 1024, "bf16", 36.96, "Piper vs X-MoE table, Super 545.4B, 512 GPUs"),
]


def weak_cases(sequences_per_gcd: float) -> list[tuple]:
    """The weak-scaling rows in CASES form, with a global batch of ``sequences_per_gcd`` per GCD."""
    return [(name, nodes, 4096, int(sequences_per_gcd * nodes * 8), "bf16", paper, cite)
            for name, nodes, paper, cite in WEAK_CASES]


def pick_sequences_per_gcd(fit_row_tflops: dict[float, float | None], paper: float) -> float:
    """The grid value whose predicted TFLOPS on the fit row is closest to the paper (relative error);
    ties go to the larger batch. Pure: ``fit_row_tflops`` maps S -> the best plan's TFLOPS (None: nothing fits)."""
    scored = [(abs(v - paper) / paper, -s, s) for s, v in fit_row_tflops.items() if v is not None]
    if not scored:
        raise ValueError("no grid value gives a feasible plan on the fit row")
    return min(scored)[2]


def weak_sensitivity(calibration) -> tuple[float, dict[float, dict[str, float | None]]]:
    """(fitted S, {S: {weak model: best predicted TFLOPS}}) over the grid."""
    table = {}
    for spg in WEAK_SEQUENCES_PER_GCD_GRID:
        table[spg] = {}
        for name, nodes, seq, batch, dtype, _, _ in weak_cases(spg):
            _, best = best_plan(name, nodes, seq, batch, dtype, "piper", calibration)
            table[spg][name] = best["tflops_per_device"] if best else None
    paper = next(p for n, _, p, _ in WEAK_CASES if n == WEAK_FIT_ROW)
    return pick_sequences_per_gcd({s: row[WEAK_FIT_ROW] for s, row in table.items()}, paper), table


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


def run_cases(calibration, sequences_per_gcd: float) -> list[dict]:
    rows = []
    for name, nodes, seq, batch, dtype, paper, cite in weak_cases(sequences_per_gcd) + XMOE_CASES:
        piper_r, piper_best = best_plan(name, nodes, seq, batch, dtype, "piper", calibration)
        _, general_best = best_plan(name, nodes, seq, batch, dtype, "general", calibration)
        predicted = piper_best["tflops_per_device"] if piper_best else None
        rows.append({"envelope": envelope(piper_r, paper), "model": name, "nodes": nodes, "gcds": nodes * 8, "seq": seq, "batch": batch, "paper": paper,
                     "cite": cite, "piper": piper_best, "general": general_best, "predicted": predicted,
                     "rel_error": None if predicted is None else (predicted - paper) / paper,
                     "feasible": piper_r.feasible, "split": "fit" if name == WEAK_FIT_ROW else "held out"})
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


# Forward milliseconds per layer of X-MoE Small on one node (8 GCDs, EP 8, mbs 1, s 2048), the X-MoE lab's profile
# (../shared/reference/platforms.md "Measured on Frontier"): QKV, attention, out-projection, all-to-all dispatch +
# combine; expert GEMMs at ~43 TFLOPS.
SMALL_PROFILE_FWD_MS = {"qkv": 0.73, "attention": 0.85, "out_proj": 0.30, "all_to_all": 0.65 + 0.68}
SMALL_PROFILE_EXPERT_TFLOPS = 43.0


def small_profile_bound() -> dict:
    """TFLOPS per GCD that the lab's own per-layer profile of X-MoE Small allows: forward = the profiled pieces +
    the expert GEMMs at their profiled rate (router, norms and elementwise left out: an optimistic bound), training
    = 3 x forward (backward = 2 x forward), model FLOPs by piper's count (PaLM: 6 x active parameters + attention)."""
    from piper_plan.catalog import load_model
    from piper_plan.cost.flops import model_flops_per_token

    model, seq = load_model("xmoe-small"), 2048
    moe, d = model.moe, model.hidden_size
    expert_fwd_flops = seq * moe.top_k * 2 * 2 * d * moe.expert.intermediate_size     # per GCD (EP 8, balanced)
    fwd_s = sum(SMALL_PROFILE_FWD_MS.values()) / 1e3 + expert_fwd_flops / (SMALL_PROFILE_EXPERT_TFLOPS * 1e12)
    flops_per_layer = model_flops_per_token(model, seq) * seq / model.num_layers
    return {"forward_ms": 1e3 * fwd_s, "tflops": flops_per_layer / (3 * fwd_s) / 1e12}


def render(rows: list[dict], fit: tuple, calibration_note: str, seconds: float) -> str:
    spg, sensitivity = fit
    lines = ["# Search vs the Piper paper (Frontier, TFLOPS per GCD)", "",
             "Generated by `benchmarks/paper_search.py` (do not edit by hand). Paper numbers: "
             "`../shared/reference/piper-paper.md` (Dash & Wang, arXiv 2605.05049). Best plan under `--strategy piper` "
             "(PP x EP mesh, tp = 1, dp = ep, ep <= 32); the general space's best beside it.", "",
             f"Calibration: {calibration_note}. Goal: within {TOLERANCE:.0%} of the paper.", "",
             "| model | nodes | GCDs | global batch | split | best piper plan | predicted | paper | error | within 25% "
             "| general best | general TFLOPS |",
             "|---|---:|---:|---:|---|---|---:|---:|---:|---|---|---:|"]
    for r in rows:
        pred = "-" if r["predicted"] is None else f"{r['predicted']:.1f}"
        err = "-" if r["rel_error"] is None else f"{100 * r['rel_error']:+.0f}%"
        ok = "-" if r["rel_error"] is None else ("yes" if abs(r["rel_error"]) <= TOLERANCE else "**no**")
        gen = r["general"]
        lines.append(f"| {r['model']} | {r['nodes']} | {r['gcds']} | {r['batch']} | {r['split']} | {plan_text(r['piper'])} "
                     f"| {pred} | {r['paper']:.2f} | {err} | {ok} | {plan_text(gen)} "
                     f"| {'-' if gen is None else format(gen['tflops_per_device'], '.1f')} |")
    eff = weak_efficiency(rows)
    held = [abs(r["rel_error"]) for r in rows if r["split"] == "held out" and r["rel_error"] is not None]
    lines += ["", f"Held-out rows: {len(held)}, mean |error| {100 * sum(held) / len(held):.1f}%, "
              f"{sum(e <= TOLERANCE for e in held)} within 25%.", "",
              f"Weak-scaling efficiency 64 -> 1024 GCDs (TFLOPS per GCD at 1024 / at 64; held out): predicted "
              f"{'-' if eff is None else format(100 * eff, '.0f') + '%'}, paper {100 * PAPER_WEAK_EFFICIENCY:.0f}%.", "",
              "Assumptions: global batch 1024 sequences for X-MoE Medium/Large/Super (Small: 8192, X-MoE's setting); "
              "every model priced in bf16 (X-MoE trained in fp16, the same MI250X matrix peak; calibration/frontier "
              "measured bf16 only), balanced routing; the paper does not publish its batch "
              f"sizes or parallel configurations. Weak-scaling family: {spg:g} sequence(s) per GCD, fitted on the "
              f"{WEAK_FIT_ROW} row (below).", "",
              *sensitivity_lines(sensitivity, spg),
              f"Search time for all cases: {seconds:.1f} s.", "", *envelope_lines(rows), *small_bound_lines(), ANALYSIS]
    return "\n".join(lines)


def small_bound_lines() -> list[str]:
    b = small_profile_bound()
    return ["## X-MoE Small against its own lab's profile", "",
            f"The X-MoE lab's single-node per-layer profile of Small (../shared/reference/platforms.md: QKV / "
            f"attention / out-projection forward 0.73 / 0.85 / 0.30 ms, all-to-all 0.65 + 0.68 ms, expert GEMMs ~{SMALL_PROFILE_EXPERT_TFLOPS:.0f} "
            f"TFLOPS) gives {b['forward_ms']:.2f} ms forward per layer at mbs 1; with backward = 2 x forward and "
            f"piper's FLOP count that is **{b['tflops']:.1f} TFLOPS per GCD** before any pipeline bubble, router, "
            "norm or optimizer time, against the paper's 90.44.", ""]


def sensitivity_lines(table: dict, chosen: float) -> list[str]:
    names = [n for n, *_ in WEAK_CASES]
    lines = ["## The weak-scaling batch: fitted on one row, the others held out", "",
             "Predicted best TFLOPS per GCD (error vs the paper) for each candidate S sequences per GCD; S is chosen "
             f"on {WEAK_FIT_ROW} alone (closest to the paper), the other two columns are the held-out test.", "",
             "| S per GCD | " + " | ".join(f"{n} ({'fit' if n == WEAK_FIT_ROW else 'held out'})" for n in names) + " |",
             "|---:|" + "---:|" * len(names)]
    paper = {n: p for n, _, p, _ in WEAK_CASES}
    for spg, row in table.items():
        cells = ["-" if row[n] is None else f"{row[n]:.1f} ({100 * (row[n] - paper[n]) / paper[n]:+.0f}%)" for n in names]
        mark = " **(fitted)**" if spg == chosen else ""
        lines.append(f"| {spg:g}{mark} | " + " | ".join(cells) + " |")
    return lines + [""]


ANALYSIS = """## Analysis (no model constant tuned to these numbers; one unpublished input fitted on one row)

Result: 6 of 7 rows within 25%; the six held-out rows have a mean |error| of 16.1% and the predicted weak-scaling
efficiency is 65% against the paper's 73%. X-MoE Small is the exception (-43%).

- **The weak-scaling batch is the one fitted input.** The paper publishes neither the batch nor the
  configuration of its weak-scaling runs. Weak scaling keeps the work per GCD constant, so one number, S
  sequences per GCD, sets all three batches. It is chosen on the 110B row alone; the sensitivity table shows that
  the three rows move together with S, so the held-out 862B and 1.7T rows test how the model scales across sizes,
  not a per-row choice. S = 1 (a global batch of one sequence per GCD: 64 / 512 / 1,024) gives +9% / +8% / -2%.
  At S = 1 and PP = 8 the 110B pipeline runs 8 micro-batches per step through 8 stages: the bubble, not the
  kernels, is what keeps that run at 45 TFLOPS, and at 1,024 GCDs (PP = 32 forced) it is larger still, hence the
  falling efficiency. The previous version of this benchmark assumed S = 16 without looking at the paper and was
  +57% / +61% / +83% (its table is in git history): the model matches the paper's weak scaling only if the paper
  ran small batches, which the paper itself cannot confirm.
- **The paper's number against every feasible plan** (table above): inside the range of the model's feasible
  plans for 110B, 862B, Medium and Large; above the best plan for 1.7T (by 2%), Super (by 23%) and Small
  (by 43%): where the model errs it errs pessimistic.
- **X-MoE Small (-43%).** Its best plan (pp1 ep8, mbs 4) spends most of its time in 64 fine-grained experts
  (d 2048, d_ffn 1408) and short-sequence attention, priced by the seed rows of the same lab's profiles at this
  shape (expert GEMMs 43 TFLOPS, attention 20 TFLOPS forward). No feasible plan exceeds 51 TFLOPS, and the
  lab's own per-layer profile of this model allows 37.7 (section above); the paper's 90.44 (47% of peak) is
  above every rate measured at these shapes under PaLM's active-parameter FLOP count. Its
  FLOP convention is not published (X-MoE pads experts to a capacity factor of 1.25). Raising the attention
  rows to the paper's own "60-120 TFLOPS" floor (an experiment with a modified copy of the calibration, not
  committed) only brings Small to -34%. Left as a documented gap.
- **Expert GEMMs outside the measured hull.** Until 2026-11-30 a 64-group [768 x 1408 x 2048] expert GEMM took
  the 120 TFLOPS of a 32-group [2048 x 2048 x 7168] row, because the nearest-point rule weighted the group count
  like a shape dimension; it now takes the rate of the nearest per-GEMM shape (tests/calibration/
  test_calibration_curves.py), which moved Small from -27% to -43%.
- **Checked, no error found:** EP groups are consecutive ranks (EP 8 inside a node, EP 32 in one switch group);
  each rank sends mbs x s x k rows of d x 2 B per dispatch and per combine, 4 all-to-alls per MoE layer and
  micro-batch (the paper's lower bound 4 b s k d / (EP B_NIC)); the 110B stage 0 is far over 64 GB without
  checkpointing under the paper's own M(i) (4 b H s^2: scores materialised), so its runs recompute, and the
  model's winners do (rc = full).
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
    fit = weak_sensitivity(calibration)
    rows = run_cases(calibration, fit[0])
    text = render(rows, fit, note, time.perf_counter() - start)
    atomic_write_text(DOC, text)
    print(text)


if __name__ == "__main__":
    main()
