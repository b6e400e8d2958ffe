"""The prepared check of piper's runtime on one GPU (or, with ``--device cpu``, on this machine's CPU).

One process, offline, torch >= 2.6; each section of the report is written as soon as it is measured (a cut-off
run still reports), to ``docs/gpu-check.md`` unless ``--out`` says otherwise:

1. calibration: ``piper calibrate --quick``'s GEMM (plain and grouped), attention and memory-bound kernel sweeps on
   this device (no collectives), on a GPU ``piper calibrate overhead``'s rows (the runtime's host time), plus the
   exact GEMM shapes of the two models below, into OUT's calibration directory;
2. for two shrunk MoE models with catalog shapes (Mixtral 8x7B's hidden and expert sizes with 2 layers and
   4 experts; one DeepSeek-V3 MoE layer: its hidden size, MLA and 2048-wide experts, 32 of them, top-8, one
   shared expert), the cost model's prediction with that calibration, then ~20 training steps of piper's runtime
   at world 1 (``runtime.train.Trainer``): step time (median after 2 warm-up steps), peak memory
   (``torch.cuda.max_memory_allocated`` on GPUs, the runtime's tensor accounting on CPU), tokens/s and MFU,
   predicted vs measured;
3. the runtime's grouped-expert GEMM rate (``LocalExperts`` forward at the step's tokens per expert) vs the
   calibrated grouped-GEMM rate of the same shape; on a GPU, how long the host takes to issue a step against the
   step (a step the host cannot issue faster than the device runs it waits on the host).

``--device cpu`` uses smaller shapes (hidden 128) and finishes in well under a minute here. Targets on a GPU
(benchmark figures, not tests): step time within 15% of the prediction, peak memory within 5%, grouped GEMMs at
>= 70% of the calibrated rate. A benchmark: it prints and writes figures, it asserts nothing.
Run: .venv/bin/python benchmarks/gpu_check.py [--device cuda|cpu] [--steps 20] [--profile] [--out docs/gpu-check.md]
"""

from __future__ import annotations

import argparse
import platform as pyplatform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BUDGET_S = {"cuda": 225.0, "cpu": 55.0}
"""Wall-clock budget: later sections are skipped (and say so) once it is spent."""
WARMUP_STEPS = 2


# ---- the two models (pure: specs only) ----------------------------------------------------------------
def _variant(spec, **update):
    """A validated copy of a ModelSpec with top-level fields and ``moe`` / ``attention`` sub-fields replaced."""
    data = spec.model_dump()
    for key in ("moe", "attention"):
        if key in update:
            data[key] = {**data[key], **update.pop(key)}
    data.update(update)
    return type(spec).model_validate(data)


def check_models(device: str) -> list[tuple[str, object]]:
    """(label, ModelSpec): Mixtral-style and DeepSeek-V3-style MoE, catalog shapes on GPUs, hidden 128 on CPU."""
    from piper_plan.catalog import load_model
    from piper_plan.runtime.model import shrink_spec

    mixtral, deepseek = load_model("mixtral-8x7b"), load_model("deepseek-v3")
    dense_first = {"layers": {**deepseek.moe.layers.model_dump(), "first_k_dense": 0}}
    if device == "cpu":
        mix = shrink_spec(mixtral, hidden_size=128, num_layers=2, num_experts=4, vocab_size=512, ffn_size=512)
        ds = shrink_spec(deepseek, hidden_size=128, num_layers=1, num_experts=16, vocab_size=512, ffn_size=128)
        return [("Mixtral-style (hidden 128, expert 256, 2 layers, 4 experts top-2)", mix),
                ("DeepSeek-V3-style (hidden 128, expert 64, 1 MoE layer, 16 experts top-8, 1 shared)",
                 _variant(ds, moe={**dense_first, "shared_expert": ds.moe.expert.model_dump()}))]
    mix = _variant(mixtral, name="mixtral-8x7b-2L4E", num_layers=2, moe={"num_experts": 4})
    ds = _variant(deepseek, name="deepseek-v3-1L32E", num_layers=1, vocab_size=32000,
                  moe={**dense_first, "num_experts": 32})
    return [("Mixtral 8x7B shapes (hidden 4096, expert 14336, 2 layers, 4 experts top-2)", mix),
            ("DeepSeek-V3 shapes (hidden 7168, MLA, expert 2048, 1 MoE layer, 32 experts top-8, 1 shared; "
             "vocabulary 32000)", ds)]


def check_inputs(spec, device: str, seq_len: int, microbatches: int, cpu_peaks: dict | None = None):
    """(platform, training, plan) of the world-1 run: a one-device copy of h200 / local-cpu. cpu_peaks: this CPU's
    best measured FLOP/s per precision where it beats local-cpu's (measured_peaks)."""
    from piper_plan.catalog import load_platform
    from piper_plan.specs import ParallelPlan, TrainingSpec

    platform = load_platform("h200" if device == "cuda" else "local-cpu")
    platform = platform.model_copy(update={"node": platform.node.model_copy(update={"devices_per_node": 1})})
    if cpu_peaks:
        peaks = {**platform.device.peak_flops, **cpu_peaks}
        platform = platform.model_copy(update={"device": platform.device.model_copy(update={"peak_flops": peaks})})
    training = TrainingSpec.for_device(device, seq_len=seq_len, global_batch=microbatches)
    return platform, training, ParallelPlan(mbs=1, num_microbatches=microbatches, zero=0)


# ---- the report ---------------------------------------------------------------------------------------
class Report:
    """Markdown sections, the whole file rewritten atomically after each one (a cut-off run keeps them)."""

    def __init__(self, path: Path) -> None:
        self.path, self.sections = path, []

    def add(self, text: str) -> None:
        from piper_plan.fileio import atomic_write_text

        self.sections.append(text.strip() + "\n")
        atomic_write_text(self.path, "\n".join(self.sections))
        print(text.strip() + "\n", flush=True)


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _pct(measured: float, predicted: float) -> str:
    return f"{100 * (predicted / measured - 1):+.1f}%" if measured else "-"


# ---- measurements -------------------------------------------------------------------------------------
def calibrate(device, platform_name: str, out_dir: Path, models, seq_len: int) -> str:
    """The quick GEMM + attention sweeps, then each model's own expert and projection GEMM shapes."""
    from piper_plan.calibration.bench_gemm import GemmPoint, measure_gemm
    from piper_plan.calibration.io import merge_rows
    from piper_plan.calibration.schema import GEMM, gemm_flops
    from piper_plan.calibration.sweep import SweepOptions, run_calibration
    from piper_plan.calibration.timing import device_name

    start = time.perf_counter()
    dtype = "bf16" if device.type == "cuda" else "fp32"     # the precision the runs below train in
    opts = SweepOptions(platform=platform_name, out_dir=out_dir, quick=True, only=("gemm", "attention", "memory"),
                        dtypes=(dtype,),
                        command=f"piper calibrate --platform {platform_name} --quick --only gemm,attention,memory "
                                f"--dtype {dtype}")
    result = run_calibration(opts)
    name, rows = device_name(device), []
    for p in {q for _, spec in models for q in model_gemm_points(spec, dtype, seq_len)}:
        seconds, _ = measure_gemm(p, device, repeats=5, warmup=2)
        rows.append({"device": name, "dtype": p.dtype, "m": p.m, "n": p.n, "k": p.k, "groups": p.groups,
                     "seconds": seconds, "tflops": gemm_flops(p.m, p.n, p.k, p.groups) / seconds / 1e12,
                     "source": f"measured: benchmarks/gpu_check.py (the model's shape) on {name}"})
    merge_rows(out_dir, GEMM, rows)
    written = ", ".join(f"{k} {n} rows" for k, n in result.rows_written.items())
    return (f"## 1. Calibration on this device\n\n`{opts.command}` ({written}) plus "
            f"{len(rows)} GEMM rows at the two models' own shapes (expert GEMMs grouped over the local experts), "
            f"{time.perf_counter() - start:.1f} s. Peak GEMM rate measured: "
            f"{max(r['tflops'] for r in rows):.3f} TFLOPS ({dtype}).")


def measured_peaks(cal_dir: Path, platform_name: str) -> dict:
    """Per precision, the best GEMM rate the fresh calibration measured, where it is above the platform's peak:
    local-cpu's peak is the best GEMM rate of the CPU it was measured on (platforms/local-cpu.yaml), and a faster
    CPU here would otherwise be refused as beating its datasheet."""
    from piper_plan.calibration import load_calibration
    from piper_plan.catalog import load_platform

    listed, calibration = load_platform(platform_name).device.peak_flops, load_calibration(cal_dir)
    best = {d: calibration.fastest_tflops("gemm", d) * 1e12 for d in listed}
    return {d: v for d, v in best.items() if v > listed[d]}


def model_gemm_points(spec, dtype: str, seq_len: int) -> list:
    """The forward GEMMs of one micro-batch (mbs 1) of ``spec``: expert up/gate and down as grouped calls at
    balanced tokens per expert, the shared experts and the LM head as plain calls."""
    from piper_plan.calibration.bench_gemm import GemmPoint

    d, m = spec.hidden_size, spec.moe
    per_expert = max(1, seq_len * m.top_k // m.num_experts)
    f = m.expert.intermediate_size
    points = [GemmPoint(dtype, per_expert, f, d, m.num_experts), GemmPoint(dtype, per_expert, d, f, m.num_experts),
              GemmPoint(dtype, seq_len, spec.vocab_size, d, 1)]
    if m.num_shared_experts:
        s = m.shared.intermediate_size
        points += [GemmPoint(dtype, seq_len, s, d, 1), GemmPoint(dtype, seq_len, d, s, 1)]
    return points


def predict(spec, platform, training, plan, calibration_dir: Path) -> dict:
    from piper_plan.calibration import load_calibration
    from piper_plan.cost.evaluate import estimate
    from piper_plan.cost.options import PIPER_RUNTIME_OPTIONS

    return estimate(spec, platform, training, 1, plan, calibration=load_calibration(calibration_dir),
                    options=PIPER_RUNTIME_OPTIONS).to_json()


def train(spec, platform, training, plan, device, steps: int) -> dict:
    """~``steps`` runtime steps at world 1; per-step seconds and peak memory bytes (the trainer's reports)."""
    import torch

    from piper_plan.planfile import parse_plan_dict, plan_file_dict
    from piper_plan.runtime.train import Trainer, preflight

    data = plan_file_dict(spec, platform, training, 1, plan, "compact", None, runtime={"steps": steps})
    cfg = parse_plan_dict(data, "gpu_check plan")
    preflight(cfg, 1, torch.cuda.is_available())
    start = time.perf_counter()
    trainer = Trainer(cfg, 0, 1, device)
    build_s = time.perf_counter() - start
    reports = [trainer.train_step(step).report() for step in range(steps)]
    return {"trainer": trainer, "build_s": build_s, "seconds": [r["seconds"] for r in reports],
            "memory": max(r["memory"]["total_bytes"] for r in reports), "loss": [r["loss"] for r in reports]}


def grouped_rates(trainer, spec, device, seq_len: int) -> dict:
    """TFLOPS of the runtime's LocalExperts forward (all local experts, balanced rows) and of the calibrated
    grouped GEMM at the same shape (one GEMM of the three, same tokens per expert)."""
    import contextlib

    import torch

    from piper_plan.calibration.bench_gemm import GemmPoint, measure_gemm
    from piper_plan.calibration.schema import gemm_flops
    from piper_plan.calibration.timing import median_seconds
    from piper_plan.runtime.casts import casts_once_per_step

    moe = next(iter(trainer.module.moe_layers().values()))
    m, d = spec.moe, spec.hidden_size
    per_expert, experts, f = max(1, seq_len * m.top_k // m.num_experts), moe.num_local, m.expert.intermediate_size
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(per_expert * experts, d, device=device, dtype=dtype)
    counts = torch.full((experts,), per_expert, dtype=torch.int64, device=device)
    cast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    def forward():
        with cast:
            moe.experts(x, counts)

    with torch.no_grad(), casts_once_per_step():      # the weights' 16-bit copies made once, as a training step does
        runtime_s = median_seconds(forward, device, warmup=3, repeats=10)
    gemms = 3 if m.expert.gated else 2
    flops = gemms * gemm_flops(per_expert, f, d, experts)
    calibrated_s, how = measure_gemm(GemmPoint("bf16" if device.type == "cuda" else "fp32", per_expert, f, d, experts),
                                     device, repeats=10, warmup=3)
    return {"runtime_tflops": flops / runtime_s / 1e12, "calibrated_tflops": flops / gemms / calibrated_s / 1e12,
            "grouped": moe.experts.grouped, "how": how, "shape": f"{experts} experts x {per_expert} rows, {d} x {f}"}


def model_section(index: int, label: str, spec, pred: dict, run: dict, rates: dict | None, platform, training,
                  tokens: int) -> str:
    steady = run["seconds"][WARMUP_STEPS:] or run["seconds"]
    step_s = statistics.median(steady)
    tokens_s = tokens / step_s
    flops_token = pred["model_flops_per_token"]
    peak = platform.peak_flops(training.dtype)
    mfu = flops_token * tokens_s / peak
    mem_pred = pred["memory"]["peak_bytes"]
    framework = platform.memory.framework_bytes
    gib = 2**30
    rows = [["step time (s)", f"{pred['step_time_s']:.4g}", f"{step_s:.4g}", _pct(step_s, pred["step_time_s"])],
            ["peak memory (GiB)", f"{mem_pred / gib:.3f}", f"{run['memory'] / gib:.3f}", _pct(run["memory"], mem_pred)],
            ["peak memory without the framework reserve (GiB)", f"{(mem_pred - framework) / gib:.3f}",
             f"{run['memory'] / gib:.3f}", _pct(run["memory"], mem_pred - framework)],
            ["tokens/s", f"{pred['tokens_per_s']:.4g}", f"{tokens_s:.4g}", _pct(tokens_s, pred["tokens_per_s"])],
            ["MFU", f"{pred['mfu']:.3f}", f"{mfu:.3f}", _pct(mfu, pred["mfu"])]]
    text = [f"## {index}. {label}", "",
            f"{spec.num_layers} layer{'s' * (spec.num_layers > 1)}, {spec.moe.num_experts} experts top-{spec.moe.top_k}, seq {training.seq_len}, "
            f"{tokens // training.seq_len} micro-batches of 1 sequence, {training.dtype}; {len(run['seconds'])} steps "
            f"(median of the steps after {WARMUP_STEPS} warm-up steps; model built in {run['build_s']:.1f} s); loss "
            f"{run['loss'][0]:.3f} -> {run['loss'][-1]:.3f}. Prediction: `cost.evaluate.estimate` with section 1's "
            f"calibration and the runtime's cost options. MFU = model FLOPs/token x tokens/s / "
            f"{peak / 1e12:.4g} TFLOPS ({training.dtype} peak of the platform). Error = predicted / measured - 1.",
            "", _table(["", "predicted", "measured", "error"], rows), "",
            "Predicted step by component (ms): " + ", ".join(
                f"{k} {1e3 * v:.3g}" for k, v in sorted(pred["time"]["breakdown"].items(), key=lambda kv: -kv[1])
                if v > 0) + "."]
    if rates is not None:
        ratio = rates["runtime_tflops"] / rates["calibrated_tflops"]
        text += ["", f"Grouped expert GEMMs ({rates['shape']}): the runtime's LocalExperts forward "
                 f"({'torch._grouped_mm' if rates['grouped'] else 'per-expert loop (fallback)'}, gate/up/down and "
                 f"the activation) {rates['runtime_tflops']:.4g} TFLOPS vs the calibrated grouped GEMM "
                 f"({rates['how']}) {rates['calibrated_tflops']:.4g} TFLOPS: {100 * ratio:.0f}%."]
    return "\n".join(text)


def host_section(trainer, device, first_step: int, steps: int = 3) -> str:
    """GPU: how long the host takes to issue a step (from its start to the step's closing
    ``torch.cuda.synchronize``) against the step, and how many of one more step's calls wait for the device
    (``torch.cuda.set_sync_debug_mode``'s warnings): a step whose issue time is its whole time waits on the host."""
    import warnings

    import torch

    if device.type != "cuda":
        return ""
    real, marks = torch.cuda.synchronize, []

    def marked(*args, **kwargs):
        marks.append(time.perf_counter())
        return real(*args, **kwargs)
    issue, whole = [], []
    torch.cuda.synchronize = marked
    try:
        for step in range(first_step, first_step + steps):
            real()
            marks.clear()
            start = time.perf_counter()
            trainer.train_step(step)
            end = time.perf_counter()
            issue.append((marks[0] if marks else end) - start)
            whole.append(end - start)
    finally:
        torch.cuda.synchronize = real
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step(first_step + steps)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    waits = sum("synchroniz" in str(w.message) for w in caught)
    return (f"Host: {steps} more steps took {statistics.median(whole):.4g} s (median); the host issued each in "
            f"{statistics.median(issue):.4g} s (until the step's closing synchronize). One more step had {waits} "
            "calls that waited for the device (torch.cuda.set_sync_debug_mode).")


def profile_section(trainer, device, first_step: int, steps: int = 2, rows: int = 25) -> str:
    """torch.profiler's table of ``steps`` more training steps: the operators and kernels that took the most
    device time (GPU) or CPU time (CPU), self time first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for step in range(first_step, first_step + steps):
            trainer.train_step(step)
        if cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70)
    return (f"Where {steps} more steps spent their {'device' if cuda else 'CPU'} time (torch.profiler, "
            f"sorted by {key}):\n\n```\n{table.strip()}\n```")


# ---- the run ------------------------------------------------------------------------------------------
def header(device, args) -> str:
    import torch

    from piper_plan.calibration.timing import device_name

    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["# GPU check of piper's runtime", "",
             f"`{' '.join(['benchmarks/gpu_check.py'] + sys.argv[1:])}` on {device_name(device)} "
             f"({device.type}), torch {torch.__version__}, Python {pyplatform.python_version()}, {when}.", ""]
    if device.type == "cpu":
        lines += ["**This is the CPU run: no GPU was available to this task.** The shapes are shrunk to hidden 128; "
                  "the figures check that the script and the runtime's measurements work end to end, not GPU "
                  "performance. The same script with `--device cuda` runs the catalog shapes on one GPU. Measured on a "
                  "machine shared with other work: CPU step times vary by tens of percent between runs. Peak memory on "
                  "CPU is the runtime's tensor accounting, which holds no framework reserve: compare it with the row "
                  "without the reserve.", ""]
    return "\n".join(lines)


def _init_world1(device) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "gpu-check.md")
    ap.add_argument("--profile", action="store_true",
                    help="add torch.profiler's table of 2 more steps after each model's section")
    ap.add_argument("--calibration-dir", type=Path, default=None,
                    help="where the calibration CSVs go (default: a temporary directory)")
    args = ap.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no GPU; use --device cpu", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _init_world1(device)
    seq_len = 1024 if device.type == "cuda" else 128
    microbatches = 4 if device.type == "cuda" else 2
    report = Report(args.out)
    report.add(header(device, args))
    models = check_models(device.type)
    with tempfile.TemporaryDirectory(prefix="piper-gpu-check-") as tmp:
        cal_dir = args.calibration_dir or Path(tmp) / "calibration"
        platform_name = "h200" if device.type == "cuda" else "local-cpu"
        report.add(calibrate(device, platform_name, cal_dir, models, seq_len))
        cpu_peaks = None
        if device.type == "cuda":
            report.add(_measure_overhead(device, cal_dir))
        if device.type == "cpu":
            _copy_overhead(cal_dir)
            cpu_peaks = measured_peaks(cal_dir, platform_name)
            if cpu_peaks:
                report.add("This CPU's GEMMs are faster than local-cpu's peak (the best rate of the CPU it was "
                           "measured on): the peak below is this CPU's best measured rate, "
                           + ", ".join(f"{d} {v / 1e12:.4g} TFLOPS" for d, v in cpu_peaks.items()) + ".")
        for index, (label, spec) in enumerate(models, start=2):
            if time.perf_counter() - t0 > BUDGET_S[device.type]:
                report.add(f"## {index}. {label}\n\nskipped: the {BUDGET_S[device.type]:.0f} s budget was spent.")
                continue
            platform, training, plan = check_inputs(spec, device.type, seq_len, microbatches, cpu_peaks)
            pred = predict(spec, platform, training, plan, cal_dir)
            run = train(spec, platform, training, plan, device, args.steps)
            rates = grouped_rates(run["trainer"], spec, device, seq_len)
            report.add(model_section(index, label, spec, pred, run, rates, platform, training,
                                     seq_len * microbatches))
            if device.type == "cuda":
                report.add(host_section(run["trainer"], device, first_step=args.steps))
            if args.profile:
                report.add(profile_section(run["trainer"], device, first_step=args.steps + 4))
            del run
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report.add(f"Total {time.perf_counter() - t0:.1f} s.")
    return 0


def _measure_overhead(device, cal_dir: Path) -> str:
    """GPU: the runtime's host overhead measured on this device (`piper calibrate overhead`'s rows) joins the
    calibration, so the prediction prices the step's wait on its host (cost/batch.py host_floor)."""
    from piper_plan.calibration.bench_overhead import overhead_rows
    from piper_plan.calibration.io import merge_rows
    from piper_plan.calibration.overhead import OVERHEAD

    start = time.perf_counter()
    rows = overhead_rows("piper calibrate overhead --platform h200", device=device)
    merge_rows(cal_dir, OVERHEAD, rows)
    shown = {f"{r['op']}" + (f" ({r['size']})" if r["size"] > 1 else ""): r["seconds"] * 1e3 for r in rows
             if r["op"] in ("attention_layer", "attention_layer_forward", "head_loss")
             or (r["op"].startswith("moe_block") and r["size"] == 4)}
    return (f"The runtime's host overhead on this device (`piper calibrate overhead --platform h200`, "
            f"{len(rows)} rows, {time.perf_counter() - start:.1f} s), ms per micro-batch: "
            + ", ".join(f"{k} {v:.3g}" for k, v in shown.items()) + ".")


def _copy_overhead(cal_dir: Path) -> None:
    """CPU: the framework overhead measured on this machine (calibration/local-cpu/overhead.csv) joins the
    fresh sweeps, so the prediction prices per-layer overhead as `piper estimate` does here."""
    import shutil

    source = ROOT / "calibration" / "local-cpu" / "overhead.csv"
    if source.is_file():
        shutil.copy(source, cal_dir / "overhead.csv")


if __name__ == "__main__":
    sys.exit(main())
