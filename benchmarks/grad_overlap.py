"""Step time with the zero 0/1 gradient all-reduce overlapped with backward (runtime/grad_sync.py, the default)
against the blocking reduction after backward (the hooks removed: every bucket reduced in sync_grads, the old
path), on CPU gloo ranks. Both trainers live in the same processes and run alternating steps, so that the load of
this shared machine falls on both alike. Prints the median step time of each, rank 0's wall clock.

Plan: closed_loop.py's first one (tiny-moe, seq 128, global batch 8, dp2 ep2, mbs 1: 4 micro-batches), with the
default 25 MiB buckets (tiny-moe's dense gradients fit one: the reduction starts at the last parameter's last
accumulation) and with 64 KiB buckets (launched as backward goes).

Run: .venv/bin/python benchmarks/grad_overlap.py [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "runtime")]  # the test harness's plans and spawner

SMALL_BUCKET_BYTES = 64 * 1024


def worker(rank: int, world: int, port: int, jobs: list, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from piper_plan.planfile import parse_plan_dict
    from piper_plan.runtime.train import Trainer
    from workers import finish, init

    init(rank, world, port)
    (_, _, kwargs), = jobs
    cfg = parse_plan_dict(kwargs["plan"], "benchmark plan")
    trainers = {name: Trainer(cfg, rank, world, torch.device("cpu")) for name in ("overlapped", "small buckets",
                                                                                 "blocking")}
    trainers["blocking"].reducer.remove()
    trainers["small buckets"].reducer.remove()
    trainers["small buckets"].reducer = trainers["small buckets"]._reducer(SMALL_BUCKET_BYTES)
    seconds = {name: [] for name in trainers}
    for step in range(kwargs["steps"]):
        for name, trainer in trainers.items():
            dist.barrier()
            start = time.perf_counter()
            trainer.train_step(step)
            seconds[name].append(time.perf_counter() - start)
    finish({"bench": seconds}, rank, out_dir)


def main() -> None:
    from plans import plan_dict
    from workers import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="steps per trainer, the first two warm-up (at least 3)")
    args = ap.parse_args()
    if args.steps < 3:
        ap.error(f"--steps {args.steps}: at least 3 (the first two steps warm up and are not counted)")
    plan = plan_dict(pp=1, dp=2, ep=2, mbs=1, num_microbatches=4, seq_len=128)
    with tempfile.TemporaryDirectory() as tmp:
        results = spawn(2, [("bench", "bench", {"plan": plan, "steps": args.steps})], Path(tmp), target=worker)
    seconds = results[0]["bench"]
    for name, times in seconds.items():
        steady = times[2:]  # the first steps warm up
        print(f"{name:14s} median step {statistics.median(steady) * 1e3:.1f} ms "
              f"(min {min(steady) * 1e3:.1f}, max {max(steady) * 1e3:.1f}; {len(steady)} steps)")


if __name__ == "__main__":
    main()
