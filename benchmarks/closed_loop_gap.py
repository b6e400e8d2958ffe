"""Where the closed loop's step-time gap sits, on one rank (no collectives, no core sharing).

One process trains tiny-moe (seq 128, mbs 1, fp32, 8 micro-batches) with piper's runtime and prints, per
micro-batch forward + backward:

- predicted: the cost model with calibration/local-cpu (framework overhead from overhead.csv + FLOP / byte
  priced compute), for the same one-rank plan;
- hot loop: the whole micro-batch repeated back to back, fastest sample (how overhead.csv times its pieces);
- single calls: each micro-batch timed alone, as the runtime's step runs them (median, p10, p90).

The first difference is the model's pricing of the pieces; the second is what a hot loop hides (caches and
allocator state warm from the previous identical call). A benchmark: it prints figures, it asserts nothing.
``--profile N``: also the N operators with the most self time under torch.profiler (per micro-batch).
Run: .venv/bin/python benchmarks/closed_loop_gap.py [--calls 80] [--profile 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODEL, PLATFORM, SEQ, MICROBATCHES = "tiny-moe", "local-cpu", 128, 8


def one_rank_inputs():
    """(model, one-device platform, training, plan): the closed loop's setting on a single rank."""
    from piper_plan.catalog import load_model, load_platform
    from piper_plan.specs import ParallelPlan, TrainingSpec

    platform = load_platform(PLATFORM)
    platform = platform.model_copy(update={"node": platform.node.model_copy(update={"devices_per_node": 1})})
    training = TrainingSpec(seq_len=SEQ, global_batch=MICROBATCHES, dtype="fp32", weight_bytes=4, grad_bytes=4,
                            master_bytes=0)
    return load_model(MODEL), platform, training, ParallelPlan(mbs=1, num_microbatches=MICROBATCHES)


def predicted_per_microbatch(model, platform, training, plan) -> dict[str, float]:
    """Seconds per micro-batch: framework overhead, FLOP / byte priced compute, and their sum."""
    from piper_plan.calibration import load_calibration
    from piper_plan.cost.evaluate import estimate
    from piper_plan.cost.options import PIPER_RUNTIME_OPTIONS

    est = estimate(model, platform, training, 1, plan, calibration=load_calibration(PLATFORM),
                   options=PIPER_RUNTIME_OPTIONS)
    parts = est.time.breakdown
    overhead = parts.get("framework/layer", 0.0)
    compute = sum(v for k, v in parts.items() if k.startswith("compute/"))
    return {"overhead": overhead / MICROBATCHES, "compute": compute / MICROBATCHES,
            "total": (overhead + compute) / MICROBATCHES}


def microbatch_call(model, platform, training, plan):
    """A zero-argument call running micro-batch i forward + backward as Trainer.forward_backward does."""
    from piper_plan.planfile import parse_plan_dict, plan_file_dict
    from piper_plan.runtime import train as rt

    from piper_plan.calibration.bench_overhead import _free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    cfg = parse_plan_dict(plan_file_dict(model, platform, training, 1, plan, "compact", None), "closed_loop_gap plan")
    trainer = rt.Trainer(cfg, 0, 1, rt._init(cfg, 0, 1, 0))
    x, y = trainer.batch(0)
    state = {"i": 0}

    def call():
        i = state["i"] = (state["i"] + 1) % MICROBATCHES
        for q in trainer.module.parameters():
            q.grad = None
        with trainer.tracker.hooks():
            loss = trainer.loss_fn(trainer.module(x[i:i + 1]), y[i:i + 1])
        loss.backward()
    return call


def single_call_seconds(call, calls: int) -> list[float]:
    for _ in range(5):
        call()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return sorted(samples)


def profile_lines(call, top: int, calls: int = 10) -> list[str]:
    """The ``top`` operators by self CPU time per micro-batch, with their input shapes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(calls):
            call()
    events = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / calls
    lines = [f"  torch.profiler, per micro-batch (profiled: {total / 1e3:.2f} ms of self time):"]
    for e in events[:top]:
        lines.append(f"    {e.key[:40]:40s} {e.self_cpu_time_total / calls / 1e3:6.2f} ms  {e.count // calls:4d} calls  "
                     f"{str(e.input_shapes)[:60]}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=80, help="single calls timed")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print the N costliest operators")
    args = ap.parse_args(argv)
    import torch

    from piper_plan.calibration.bench_overhead import min_seconds

    torch.set_num_threads(1)
    inputs = one_rank_inputs()
    pred = predicted_per_microbatch(*inputs)
    call = microbatch_call(*inputs)
    hot = min_seconds(call)
    single = single_call_seconds(call, args.calls)
    median = statistics.median(single)
    p10, p90 = single[len(single) // 10], single[(9 * len(single)) // 10]
    ms = 1e3
    print(f"{MODEL}, seq {SEQ}, mbs 1, fp32, one rank, one thread; per micro-batch forward + backward:")
    print(f"  predicted     {pred['total'] * ms:7.2f} ms  (framework overhead {pred['overhead'] * ms:.2f} + "
          f"FLOP/byte-priced compute {pred['compute'] * ms:.2f})")
    print(f"  hot loop      {hot * ms:7.2f} ms  fastest sample   (model {100 * (pred['total'] / hot - 1):+.1f}%)")
    print(f"  single calls  {median * ms:7.2f} ms  median, p10 {p10 * ms:.2f}, p90 {p90 * ms:.2f}   "
          f"(model {100 * (pred['total'] / median - 1):+.1f}%, hot loop {100 * (hot / median - 1):+.1f}%)")
    if args.profile:
        print("\n".join(profile_lines(call, args.profile)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
