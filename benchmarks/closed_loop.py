"""The closed loop on this machine: calibrate -> predict -> run -> compare (-> fit, held out), for a tiny MoE model.

1. calibrate: calibration/local-cpu/*.csv copied to OUT/calibration, then the load-sensitive parts re-measured
   there right before the runs (``piper calibrate overhead`` and ``piper calibrate --quick --only collectives``),
   so that calibration and runs see the same shared 2-core machine (``--no-recalibrate``: use the files as they are);
2. for each of >= 8 distinct plans (pp / ep / dp / mbs / schedule / a2a / zero), ``cost.evaluate.estimate`` with
   that calibration (GEMM / attention / collective curves + framework overhead) and CostOptions describing
   piper's own runtime; plan.json written by ``planfile.write_plan_file``;
3. the runtime runs it under torchrun (gloo CPU ranks, one thread each, emulated NODESxRANKS topology);
4. compare: step time = steady-state median (``compare.compare``); memory per stage = the runtime's tensor
   accounting on CPU (parameters, gradients, optimizer state, activations saved for backward), the MINIMUM over
   steps (with ep > 1 the saved bytes follow each step's routing; the model prices balanced routing);
5. ``calibration.fit`` on every other plan; the error on the held-out plans is reported separately.

A benchmark, not a CI gate (targets: step time within 15% mean, memory within 10% mean). Writes docs/closed-loop.md.
Run: .venv/bin/python benchmarks/closed_loop.py [--steps 8] [--out /tmp/piper-closed-loop] [--no-recalibrate]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
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


def runtime_options():
    """CostOptions that describe piper's own runtime (unfused kernels: what its autograd saves)."""
    from dataclasses import fields

    from piper_plan.cost.options import CostOptions

    names = {f.name for f in fields(CostOptions)}
    return CostOptions(**({"unfused_kernels": True} if "unfused_kernels" in names else {}))


def piper(*args: str) -> None:
    subprocess.run([str(PY.parent / "piper"), *args], check=True, cwd=ROOT)


def prepare_calibration(out: Path, recalibrate: bool) -> Path:
    """OUT/calibration: the committed local-cpu files, with overhead and collectives re-measured now."""
    from piper_plan.catalog import calibration_dir

    src, dst = calibration_dir(PLATFORM), out / "calibration"
    if not list(src.glob("*.csv")):
        piper("calibrate", "--platform", PLATFORM, "--quick")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, dst / f.name)
    if recalibrate:
        piper("calibrate", "overhead", "--platform", PLATFORM, "--out", str(dst))
        (dst / "collectives.csv").unlink(missing_ok=True)
        piper("calibrate", "--platform", PLATFORM, "--quick", "--only", "collectives", "--out", str(dst))
    return dst


def load_cal(directory: Path):
    from piper_plan.calibration import load_calibration
    from piper_plan.calibration.overhead import load_overhead

    cal = load_calibration(directory)
    if getattr(cal, "overhead", None) is None:
        cal.overhead = load_overhead(directory)
    return cal


def write_plan(run_dir: Path, nodes: int, par: dict, calibration, options) -> tuple[dict, object]:
    from piper_plan.catalog import load_model, load_platform
    from piper_plan.cost.evaluate import estimate
    from piper_plan.planfile import write_plan_file
    from piper_plan.specs import ParallelPlan, TrainingSpec

    model, platform = load_model(MODEL), load_platform(PLATFORM)
    training = TrainingSpec(seq_len=SEQ, global_batch=BATCH, dtype="fp32", weight_bytes=4, grad_bytes=4,
                            master_bytes=0)
    plan = ParallelPlan(**par, num_microbatches=BATCH // (par.get("dp", 1) * par["mbs"]))
    prediction = estimate(model, platform, training, nodes, plan, calibration=calibration, options=options)
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


def tensor_stage_bytes(prediction) -> list[tuple[float, float]]:
    """Per stage (tensor bytes, activation bytes) predicted: no framework / fragmentation overhead (what the
    runtime's CPU tensor accounting measures; RSS would be dominated by torch itself)."""
    out = []
    for s in prediction.memory.per_stage:
        comp = s.components
        acts = sum(v for k, v in comp.items() if k.startswith("activations/"))
        out.append((s.total_bytes - comp.get("framework", 0.0) - comp.get("fragmentation", 0.0), acts))
    return out


def measured_stage_bytes(records: list[dict]) -> list[tuple[float, float]]:
    """Per stage (tensor bytes, activation bytes): the minimum over the steady steps (see the module docstring;
    the first step is left out: AdamW creates its state at its first step, after the runtime's memory reading)."""
    from piper_plan.compare import steady_steps

    records = steady_steps(records)
    stages = len(records[0]["memory_bytes"])
    out = []
    for i in range(stages):
        best = min((r["memory_bytes"][i] for r in records), key=lambda m: m["total_bytes"])
        out.append((float(best["total_bytes"]), float(best["activations_bytes"])))
    return out


def rel(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def measure(out: Path, steps: int, calibration, options, reuse: bool = False) -> list[dict]:
    from piper_plan.compare import compare, steady_steps

    rows = []
    for i, (label, nodes, par) in enumerate(PLANS):
        run_dir = out / f"run{i}"
        t0 = time.perf_counter()
        if reuse and (run_dir / "metrics.jsonl").is_file():      # re-predict, keep the measured run
            records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
            prediction, plan = write_plan(run_dir, nodes, par, calibration, options)
        else:
            prediction, plan = write_plan(run_dir, nodes, par, calibration, options)
            records = run_plan(run_dir, nodes, plan.pp * plan.dp * plan.tp, steps)
        step = compare(prediction.to_json(), records)["step_time_s"]
        times = [r["step_time_s"] for r in steady_steps(records)]
        mem = [{"total": rel(p[0], m[0]), "activations": rel(p[1], m[1])}
               for p, m in zip(tensor_stage_bytes(prediction), measured_stage_bytes(records))]
        breakdown = {k: v for k, v in prediction.time.breakdown.items() if v}
        rows.append({"plan": label, "nodes": nodes, "run_dir": str(run_dir), "step": step, "memory": mem,
                     "spread": (min(times), max(times)), "breakdown": breakdown,
                     "measured_time_s": {k: statistics.median(r["time_s"].get(k, 0.0) for r in steady_steps(records))
                                         for k in ("a2a", "p2p", "dp_sync")},
                     "wall_s": time.perf_counter() - t0})
        print(f"{label:20s} step pred {step['predicted']:.4f} s meas {step['measured']:.4f} s "
              f"({100 * step['rel_error']:+.1f}%) | memory "
              + " ".join(f"{100 * q['total']:+.1f}% (act {100 * q['activations']:+.1f}%)" for q in mem), flush=True)
    return rows


def mape(values: list[float]) -> float:
    return 100 * sum(abs(v) for v in values) / len(values)


FIT_NAMES = ["overhead.scale", "a2a_overlap", "p2p_overlap", "dp_overlap"]


def fit_held_out(rows: list[dict], calibration, options) -> dict:
    """Fit on every other plan; the error on the others, before and after."""
    from piper_plan.calibration.fit import fit, holdout_mape_pct, read_run, split_runs

    runs = [read_run(r["run_dir"]) for r in rows]
    fit_set, held = split_runs(runs)
    result = fit(fit_set, calibration, FIT_NAMES, options=options)
    before, after = holdout_mape_pct(result.values, held, calibration, options)
    return {"result": result, "fit_runs": [Path(r.path).name for r in fit_set],
            "held_out_runs": [Path(r.path).name for r in held], "held_before": before, "held_after": after}


COMM_PREFIXES = ("moe/", "pipeline/", "dp/")
"""Predicted terms the runtime's timers (a2a, p2p, dp_sync in metrics.jsonl) measure, waits included."""


def split_of(row: dict) -> dict[str, tuple[float, float]]:
    """(predicted, measured) seconds of the step's collectives and waits, and of everything else (compute,
    framework overhead, optimizer)."""
    pred_comm = sum(v for k, v in row["breakdown"].items() if k.startswith(COMM_PREFIXES))
    meas_comm = sum(row["measured_time_s"].values())
    step = row["step"]
    return {"comm": (pred_comm, meas_comm),
            "rest": (step["predicted"] - pred_comm, step["measured"] - meas_comm)}


def split_table(rows: list[dict]) -> list[str]:
    lines = ["Where the error sits: the runtime times its all-to-all, pipeline p2p and gradient sync (waits for a "
             "peer included); the rest of the step is compute, framework overhead and the optimizer.", "",
             "| plan | collectives + waits: predicted / measured s | error | the rest: predicted / measured s | error |",
             "|---|---|---|---|---|"]
    rest_errors = []
    for r in rows:
        parts = split_of(r)
        (pc, mc), (pr, mr) = parts["comm"], parts["rest"]
        comm_err = f"{100 * rel(pc, mc):+.0f}%" if mc > 0 else "-"
        rest_errors.append(rel(pr, mr))
        lines.append(f"| {r['plan']} | {pc:.4f} / {mc:.4f} | {comm_err} | {pr:.4f} / {mr:.4f} | "
                     f"{100 * rest_errors[-1]:+.1f}% |")
    return lines + ["", f"The rest of the step: MAPE {mape(rest_errors):.1f}%.", ""]


def report(rows: list[dict], fitted: dict | None, calibration, recalibrated: bool) -> str:
    step_errors = [r["step"]["rel_error"] for r in rows]
    mem_errors = [q["total"] for r in rows for q in r["memory"]]
    act_errors = [q["activations"] for r in rows for q in r["memory"]]
    ov = getattr(calibration, "overhead", None)
    lines = ["# Closed loop on this machine: calibrate -> plan -> run -> compare", "",
             "Generated by `benchmarks/closed_loop.py`; a benchmark, not a CI gate. Model tiny-moe, seq "
             f"{SEQ}, global batch {BATCH}, fp32, platform local-cpu (gloo CPU ranks, 2 per emulated node, all on "
             "this 2-core machine, shared with other work). Calibration: calibration/local-cpu/ with "
             + ("framework overhead and collectives re-measured right before the runs "
                "(`piper calibrate overhead`, `piper calibrate --quick --only collectives`)" if recalibrated else
                "the committed files") + ". Predictions use CostOptions(unfused_kernels=True): piper's runtime "
             "saves what unfused PyTorch kernels save. Measured: step time = steady-state median (min-max of the "
             "steady steps beside it); memory = the runtime's CPU tensor accounting (parameters, gradients, "
             "optimizer state, activations saved for backward), minimum over steps.", "",
             "| plan | nodes | predicted step s | measured step s (min-max) | error | memory error per stage "
             "(activations) |", "|---|---|---|---|---|---|"]
    for r in rows:
        s, (lo, hi) = r["step"], r["spread"]
        mem = ", ".join(f"{100 * q['total']:+.1f}% ({100 * q['activations']:+.1f}%)" for q in r["memory"])
        lines.append(f"| {r['plan']} | {r['nodes']} | {s['predicted']:.4f} | {s['measured']:.4f} ({lo:.3f}-{hi:.3f}) "
                     f"| {100 * s['rel_error']:+.1f}% | {mem} |")
    lines += ["", f"**Step time MAPE {mape(step_errors):.1f}%** (target 15%); **memory MAPE {mape(mem_errors):.1f}%** "
              f"(target 10%; activations alone {mape(act_errors):.1f}%) over {len(rows)} plans.", ""]
    lines += split_table(rows)
    if ov is not None:
        lines += [f"Framework overhead used (measured): attention layer {ov.attention_layer_s * 1e6:.0f} us, MoE block "
                  f"{ov.moe_block_s * 1e6:.0f} us + {ov.moe_per_local_expert_s * 1e6:.0f} us per local expert, head+loss "
                  f"{ov.head_loss_s * 1e6:.0f} us per micro-batch (forward + backward); optimizer "
                  f"{ov.optimizer_s * 1e6:.0f} us + {ov.optimizer_per_tensor_s * 1e6:.1f} us per tensor; lockstep: "
                  + ", ".join(f"{n} ranks slowdown x{f:.2f}, wait {w * 1e6:.0f} us per collective" for n, f, w in
                              zip(ov.concurrency_ranks, ov.concurrency_factor, ov.sync_wait_s)) + ".", ""]
    if fitted is not None:
        res = fitted["result"]
        vals = ", ".join(f"{k} {res.before[k]:.3g} -> {v:.3g}" for k, v in res.values.items())
        lines.append(f"`calibrate fit` on {', '.join(fitted['fit_runs'])} (in-sample MAPE {res.mape_before_pct:.1f}% -> "
                     f"{res.mape_after_pct:.1f}%): {vals}. **Held out** ({', '.join(fitted['held_out_runs'])}): step "
                     f"MAPE {fitted['held_before']:.1f}% -> {fitted['held_after']:.1f}%. The fit is reported, not used "
                     "for the table above: nothing in the table was tuned to these runs.")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="/tmp/piper-closed-loop")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "closed-loop.md"))
    ap.add_argument("--no-recalibrate", action="store_true", help="use calibration/local-cpu as committed")
    ap.add_argument("--no-fit", action="store_true")
    ap.add_argument("--reuse", action="store_true",
                    help="keep OUT's calibration and measured runs; only predict, compare and fit again")
    args = ap.parse_args()
    from piper_plan.fileio import atomic_write_text

    out = Path(args.out)
    cal_dir = out / "calibration" if args.reuse else prepare_calibration(out, not args.no_recalibrate)
    calibration = load_cal(cal_dir)
    options = runtime_options()
    rows = measure(out, args.steps, calibration, options, args.reuse)
    fitted = None if args.no_fit else fit_held_out(rows, calibration, options)
    text = report(rows, fitted, calibration, not args.no_recalibrate)
    (out / "rows.json").write_text(json.dumps([{k: v for k, v in r.items()} for r in rows], indent=1, default=str))
    if args.doc:
        atomic_write_text(args.doc, text + analysis_text())
    print(text)
    return 0


def analysis_text() -> str:
    return "\n" + ANALYSIS


ANALYSIS = """## Diagnosis (2026-11-30)

tiny-moe (d 64, 4 MoE layers, 8 experts top-2), seq 128, fp32, one thread per rank, on this 2-core VM.

- **A runtime performance bug, found by this loop and fixed.** On one rank (no collectives, no core sharing:
  `benchmarks/closed_loop_gap.py --profile 4`) a micro-batch took 13.6 ms in a hot loop against 11.6 ms
  predicted, and torch.profiler put `aten::fill_` first: 96 zero-fills per micro-batch of [8, 64, 128] and
  [8, 128, 64] tensors, 8.7 of 24.4 profiled ms. The expert loop indexed the stacked expert weights per expert
  (`w_in[e]`); each index's backward zero-fills a gradient of the whole stack, so a layer's backward wrote
  El^2 x its expert weights (at DeepSeek-V3's 32 experts per GPU: 32 x 2.8 GB per layer and micro-batch). The
  loop now unbinds each stack once (runtime/moe.py; test: tests/runtime/test_local_experts.py): the same
  micro-batch runs in 11.6-12.7 ms hot, 12.0-12.8 ms median as single calls, model within 0-10% of it
  (three runs of the benchmark, the spread is this machine's).
- **Framework overhead, not FLOPs.** Of the 11.6 ms predicted, 7.4 ms is the measured per-operator overhead of
  the runtime's modules (`piper calibrate overhead`, overhead.csv: ~0.55 ms per attention layer, ~0.4 ms +
  ~70 us per local expert per MoE block, under the runtime's saved-tensor hooks); the FLOP / byte model prices
  4.2 ms.
- **Waiting at collectives.** The runtime does 5 blocking exchanges per MoE layer and micro-batch (count layout,
  dispatch and combine forward and backward) and 2 p2p waits per pipeline micro-batch. A rank computing
  between them is preempted at a different moment than its peer, which waits; the table above ("collectives +
  waits") shows this wait, not bandwidth, is most of the measured exchange time. The lockstep rows of
  overhead.csv (N gloo ranks, 1 or 3 MoE-block workloads per collective) price it as a slowdown per unit of
  work plus a wait per collective; both are now measured by the same ranks in alternating rounds. Measured one
  after the other, the load's drift between the two had moved the 2-rank excess between slowdown and wait
  (x2.47 + 0 us against x1.00 + 337 us in two runs minutes apart, docs/closed-loop.md of the previous
  version); paired, three standalone `piper calibrate overhead --out DIR` runs gave x1.16 - x1.33 and
  271 - 400 us, and the two in-loop re-measurements since x1.35 + 0 us and x1.36 + 351 us.

## What still limits it

- **This machine's noise.** Step time MAPE of whole runs of this benchmark: on 2026-11-30 18.7% (before the
  expert-loop fix, lockstep rows measured one after the other), 24.5% (after the fix), then with the paired
  lockstep probe 22.2% and 14.6% with the same code; on 2026-12-01 28.2, 22.4, 22.9 and 19.6% (the last is the
  table above). Single steps vary by up to 30% inside one run (the min-max column). The 2-rank slowdown the
  model multiplies every plan's compute by was measured between x1.16 and x1.71 from one calibration to the
  next on 2026-11-30, and x2.34 in the table's run. The 15% target was met by one run of eight, not reliably.
- **Collective waits are under-predicted** in most plans (the table above): the lockstep probe puts one
  collective after ~1 ms of uniform work; the runtime's MoE layer has five exchanges between uneven pieces of
  0.05-0.5 ms, and data-dependent expert loads (a rank with more tokens makes its peer wait). Pipeline p2p waits
  are priced by the collective curve and the bubble, not by the probe.
- **Fitting does not rescue it, and says so.** `calibrate fit` of a global overhead scale and the overlap
  factors on every other plan is reported above with its held-out error: a global knob cannot absorb errors
  whose sign differs between plan families and between runs.
- **Memory is not the problem:** within ~1% per stage (activations within ~2-6%: the dispatch permutation's
  index tensors with ep > 1, and ~179 KB per micro-batch in flight that torch.distributed.pipelining's first
  stage saves beyond the same stage run in one process).
"""


if __name__ == "__main__":
    sys.exit(main())
