"""The closed loop on this machine: calibrate -> predict -> run -> compare (-> fit), for a tiny MoE model.

1. calibration/local-cpu/ (measured by ``piper calibrate --platform local-cpu --quick`` when absent);
2. for each of >= 8 distinct plans (pp / ep / dp / mbs / schedule / a2a / zero), ``cost.evaluate.estimate`` with
   that calibration and plan.json written by ``planfile.write_plan_file``;
3. the runtime runs it under torchrun (gloo CPU ranks, one thread each, emulated NODESxRANKS topology);
4. ``compare.compare``: predicted vs measured step time (steady-state median) and memory per stage (the runtime's
   tensor accounting on CPU: parameters, gradients, optimizer state, activations saved for backward);
5. ``calibration.fit`` on the same runs (in-sample: shows what the overlap/efficiency knobs can absorb).

A benchmark, not a CI gate (targets: step time within 15% mean, memory within 10% mean). Writes docs/closed-loop.md.
Run: .venv/bin/python benchmarks/closed_loop.py [--steps 6] [--out /tmp/piper-closed-loop]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PY = Path(sys.executable)
MODEL, PLATFORM, SEQ, BATCH = "tiny-moe", "local-cpu", 128, 8

# (label, nodes, parallel) — local-cpu has 2 ranks per node; at most 4 ranks (the machine has 2 cores)
PLANS = [
    ("dp2 ep2", 1, dict(dp=2, ep=2, mbs=1)),
    ("dp2 ep2 mbs2", 1, dict(dp=2, ep=2, mbs=2)),
    ("dp2 ep1 (dense dp)", 1, dict(dp=2, ep=1, mbs=1)),
    ("pp2 gpipe", 1, dict(pp=2, mbs=1, schedule="gpipe")),
    ("pp2 1f1b mbs2", 1, dict(pp=2, mbs=2, schedule="1f1b")),
    ("dp4 ep4 flat", 2, dict(dp=4, ep=4, mbs=1, a2a="flat")),
    ("dp4 ep4 halo", 2, dict(dp=4, ep=4, mbs=1, a2a="halo")),
    ("pp2 dp2 ep2 1f1b", 2, dict(pp=2, dp=2, ep=2, mbs=1, schedule="1f1b")),
    ("dp4 ep2 zero1", 2, dict(dp=4, ep=2, mbs=1, zero=1)),
]


def ensure_calibration() -> None:
    from piper_plan.catalog import calibration_dir

    if not list(calibration_dir(PLATFORM).glob("*.csv")):
        subprocess.run([str(PY.parent / "piper"), "calibrate", "--platform", PLATFORM, "--quick"], check=True, cwd=ROOT)


def write_plan(run_dir: Path, nodes: int, par: dict, calibration) -> tuple[dict, object]:
    from piper_plan.catalog import load_model, load_platform
    from piper_plan.cost.evaluate import estimate
    from piper_plan.planfile import write_plan_file
    from piper_plan.specs import ParallelPlan, TrainingSpec

    model, platform = load_model(MODEL), load_platform(PLATFORM)
    training = TrainingSpec(seq_len=SEQ, global_batch=BATCH, dtype="fp32", weight_bytes=4, grad_bytes=4,
                            master_bytes=0)
    plan = ParallelPlan(**par, num_microbatches=BATCH // (par.get("dp", 1) * par["mbs"]))
    prediction = estimate(model, platform, training, nodes, plan, calibration=calibration)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_plan_file(run_dir / "plan.json", model, platform, training, nodes, plan, "compact", prediction,
                    migration={"enabled": False})
    return prediction, plan


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_plan(run_dir: Path, nodes: int, world: int, steps: int) -> list[dict]:
    cmd = [str(PY.parent / "torchrun"), "--nproc-per-node", str(world), "--master-port", str(_port()), "-m",
           "piper_plan.runtime.train", "--plan", str(run_dir / "plan.json"), "--out", str(run_dir),
           "--steps", str(steps), "--aux-loss-coeff", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PIPER_EMULATE_TOPOLOGY": f"{nodes}x{world // nodes}"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{run_dir}: runtime exit {proc.returncode}: {proc.stderr[-2000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def measure(out: Path, steps: int, calibration) -> list[dict]:
    from piper_plan.compare import compare

    rows = []
    for i, (label, nodes, par) in enumerate(PLANS):
        run_dir = out / f"run{i}"
        prediction, plan = write_plan(run_dir, nodes, par, calibration)
        t0 = time.perf_counter()
        records = run_plan(run_dir, nodes, plan.pp * plan.dp * plan.tp, steps)
        c = compare(tensor_prediction(prediction), records)
        mem = [q for q in c["memory_bytes_per_stage"] if q["rel_error"] is not None]
        rows.append({"plan": label, "nodes": nodes, "run_dir": str(run_dir), "step": c["step_time_s"],
                     "memory": mem, "wall_s": time.perf_counter() - t0})
        print(f"{label:20s} step pred {c['step_time_s']['predicted']:.4f} s meas {c['step_time_s']['measured']:.4f} s "
              f"({100 * c['step_time_s']['rel_error']:+.1f}%) | memory "
              + " ".join(f"{100 * q['rel_error']:+.1f}%" for q in mem), flush=True)
    return rows


def tensor_prediction(prediction: dict) -> dict:
    """The prediction with each stage's memory reduced to tensors (no framework / fragmentation overhead): what
    the runtime's CPU tensor accounting measures (RSS would be dominated by torch itself)."""
    stages = []
    for s in prediction["memory"]["per_stage"]:
        comp = s["components"]
        stages.append({**s, "total_bytes": s["total_bytes"] - comp.get("framework", 0.0) - comp.get("fragmentation", 0.0)})
    return {**prediction, "memory": {**prediction["memory"], "per_stage": stages}}


def mape(values: list[float]) -> float:
    return 100 * sum(abs(v) for v in values) / len(values)


def report(rows: list[dict], fit_result) -> str:
    step_errors = [r["step"]["rel_error"] for r in rows]
    mem_errors = [q["rel_error"] for r in rows for q in r["memory"]]
    lines = ["# Closed loop on this machine: calibrate -> plan -> run -> compare", "",
             "Generated by `benchmarks/closed_loop.py`; a benchmark, not a CI gate. Model tiny-moe, seq "
             f"{SEQ}, global batch {BATCH}, fp32, platform local-cpu (gloo CPU ranks, 2 per emulated node), "
             "calibration/local-cpu/ from `piper calibrate --platform local-cpu --quick`. Measured: steady-state "
             "median step time; memory = the runtime's CPU tensor accounting (parameters, gradients, optimizer "
             "state, activations saved for backward), max over steps.", "",
             "| plan | nodes | predicted step s | measured step s | error | memory error per stage |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        s = r["step"]
        mem = ", ".join(f"{100 * q['rel_error']:+.1f}%" for q in r["memory"])
        lines.append(f"| {r['plan']} | {r['nodes']} | {s['predicted']:.4f} | {s['measured']:.4f} | "
                     f"{100 * s['rel_error']:+.1f}% | {mem} |")
    lines += ["", f"Step time MAPE {mape(step_errors):.1f}% (target 15%); memory MAPE {mape(mem_errors):.1f}% "
              f"(target 10%) over {len(rows)} plans.", ""]
    if fit_result is not None and fit_result.values:
        fitted = ", ".join(f"{k} {fit_result.before[k]:.3g} -> {v:.3g}" for k, v in fit_result.values.items())
        lines.append(f"`piper calibrate fit` on the same runs (in-sample): {fitted}; step MAPE "
                     f"{fit_result.mape_before_pct:.1f}% -> {fit_result.mape_after_pct:.1f}%.")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default="/tmp/piper-closed-loop")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "closed-loop.md"))
    args = ap.parse_args()
    ensure_calibration()
    from piper_plan.calibration import load_calibration
    from piper_plan.calibration.fit import fit, read_run
    from piper_plan.fileio import atomic_write_text

    calibration = load_calibration(PLATFORM)
    rows = measure(Path(args.out), args.steps, calibration)
    fit_result = fit([read_run(r["run_dir"]) for r in rows], calibration)
    text = report(rows, fit_result)
    atomic_write_text(args.doc, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
