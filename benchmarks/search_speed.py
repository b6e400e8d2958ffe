"""Search speed figures (a benchmark that prints numbers; no timed assertions).

1. Cost-model evaluations per second on one core: ``piper_plan.cost.evaluate.evaluate`` over ~1M candidates
   (the structurally valid candidates of DeepSeek-V3 on 2,048 Frontier nodes, tiled to the size asked).
2. The whole search (enumerate + evaluate + rank) for that case, in-process.
3. ``piper plan --model deepseek-v3 --platform frontier --nodes 2048 --json`` wall time, CLI start-up included.
4. ``piper --help`` wall time.

Run: .venv/bin/python benchmarks/search_speed.py [--candidates 1000000] [--repeat 3]
Pins itself to one CPU (sched_setaffinity) and one BLAS thread before importing numpy.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PIPER = ROOT / ".venv" / "bin" / "piper"


def best_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def evaluations_per_second(n_candidates: int, repeat: int) -> tuple[float, int]:
    from piper_plan.catalog import load_model, load_platform
    from piper_plan.cost.evaluate import evaluate
    from piper_plan.plans import PlanBatch
    from piper_plan.search.space import enumerate_space
    from piper_plan.specs import TrainingSpec

    model, platform, training = load_model("deepseek-v3"), load_platform("frontier"), TrainingSpec()
    space = enumerate_space(model, platform, training, 2048)
    reps = -(-n_candidates // len(space))
    fields = {k: np.tile(v, reps)[:n_candidates] for k, v in space.fields.items()}
    cand = PlanBatch.from_arrays(fields)
    seconds = best_seconds(lambda: evaluate(model, platform, training, 2048, cand), repeat)
    return n_candidates / seconds, len(space)


def distinct_evaluations_per_second(n_candidates: int, repeat: int) -> float:
    """As evaluations_per_second, but every candidate distinct: the tiled copies get num_microbatches x 1, x 2,
    ... so that no per-key reuse in the cost model can exploit the tiling (the honest worst case)."""
    from piper_plan.catalog import load_model, load_platform
    from piper_plan.cost.evaluate import evaluate
    from piper_plan.plans import PlanBatch
    from piper_plan.search.space import enumerate_space
    from piper_plan.specs import TrainingSpec

    model, platform, training = load_model("deepseek-v3"), load_platform("frontier"), TrainingSpec()
    space = enumerate_space(model, platform, training, 2048)
    reps = -(-n_candidates // len(space))
    fields = {k: np.tile(v, reps)[:n_candidates] for k, v in space.fields.items()}
    copy = np.repeat(np.arange(reps), len(space))[:n_candidates]
    fields["num_microbatches"] = fields["num_microbatches"] * (1 + copy)
    cand = PlanBatch.from_arrays(fields)
    return n_candidates / best_seconds(lambda: evaluate(model, platform, training, 2048, cand), repeat)


def whole_search_seconds(repeat: int) -> tuple[float, int, int]:
    from piper_plan.catalog import load_model, load_platform
    from piper_plan.search.engine import search
    from piper_plan.specs import TrainingSpec

    model, platform, training = load_model("deepseek-v3"), load_platform("frontier"), TrainingSpec()
    results = []
    seconds = best_seconds(lambda: results.append(search(model, platform, training, 2048)), repeat)
    r = results[-1]
    return seconds, r.candidates_total, len(r.fields["dp"])


def cli_seconds(args: list[str], repeat: int) -> float:
    def run():
        subprocess.run([str(PIPER), *args], check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return best_seconds(run, repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"host: {os.uname().nodename}, python {sys.version.split()[0]}, numpy {np.__version__}, "
          f"pinned to CPU {sorted(os.sched_getaffinity(0))}")
    try:
        rate, n_valid = evaluations_per_second(args.candidates, args.repeat)
        print(f"cost-model evaluations: {rate:,.0f} candidates/s on one core "
              f"({args.candidates:,} candidates = the {n_valid:,} structurally valid DeepSeek-V3 x 2048-node ones, tiled)")
        print(f"cost-model evaluations, all {args.candidates:,} candidates distinct: "
              f"{distinct_evaluations_per_second(args.candidates, args.repeat):,.0f} candidates/s on one core")
        seconds, total, evaluated = whole_search_seconds(args.repeat)
        print(f"whole search, DeepSeek-V3 on 2048 Frontier nodes (in-process): {seconds:.3f} s for {total:,} "
              f"candidates enumerated, {evaluated:,} evaluated ({total / seconds:,.0f} candidates/s)")
    except ImportError as exc:
        print(f"cost model not importable ({exc}); evaluation figures skipped")
    plan_args = ["plan", "--model", "deepseek-v3", "--platform", "frontier", "--nodes", "2048", "--json"]
    print(f"`piper {' '.join(plan_args)}` wall incl. start-up: {cli_seconds(plan_args, args.repeat):.3f} s")
    print(f"`piper --help` wall: {cli_seconds(['--help'], max(args.repeat, 5)):.3f} s")


if __name__ == "__main__":
    main()
