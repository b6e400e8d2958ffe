"""Search speed figures of issue 17 (a benchmark that prints numbers; no timed assertions).

1. Cost-model evaluations per second on one core, on the calibrated platform (calibration/frontier, the curves
   ``piper plan --platform frontier`` prices with), and without calibration (the roofline fallback), labelled:
   ``piper_plan.cost.evaluate.evaluate`` over ``--candidates`` candidates: the structurally valid candidates of
   DeepSeek-V3 on 2,048 Frontier nodes tiled to that size, once as plain copies ("tiled") and once with every copy
   made distinct ("distinct": copy j has num_microbatches x (j + 1), so that no per-key reuse can exploit the
   tiling). Median of ``--repeat`` runs, wall time and CPU time (the rate per core is per CPU second: on a shared
   machine the pinned core also runs other processes, which wall time would count).
2. The whole search (enumerate + evaluate + rank) of that case in-process, calibrated, median of ``--repeat``.
3. Median of ``--runs`` whole-process runs (start-up and output included) of
   ``piper plan --model deepseek-v3 --platform frontier --nodes 2048`` and of whole Frontier
   (``--nodes 9408 --global-batch 8064``), each run's time printed; goals: under 2 s and under 3 s.
4. ``piper --help`` wall time (median of ``--runs``).

Run: .venv/bin/python benchmarks/search_speed.py [--candidates 1000000] [--repeat 5] [--runs 5]
The in-process figures pin the benchmark to one CPU (sched_setaffinity) and one BLAS thread (set before numpy is
imported); the whole-process runs get the CPUs and environment the benchmark was started with, as a user's
``piper plan`` would.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_USER_ENV = dict(os.environ)
_USER_CPUS = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"
if _USER_CPUS is not None:
    os.sched_setaffinity(0, {sorted(_USER_CPUS)[0]})

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PIPER = Path(sys.executable).parent / "piper"
DSV3_2048 = ["plan", "--model", "deepseek-v3", "--platform", "frontier", "--nodes", "2048"]
WHOLE_FRONTIER = ["plan", "--model", "deepseek-v3", "--platform", "frontier", "--nodes", "9408",
                  "--global-batch", "8064"]
GOALS_S = {"DSV3 @2048": 2.0, "whole Frontier": 3.0}
GOAL_CALIBRATED_PER_S = 1_000_000


def median_seconds(fn, repeat: int) -> tuple[float, float]:
    """(median wall seconds, median CPU seconds) of ``repeat`` calls of ``fn``."""
    wall, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def setting():
    from piper_plan.catalog import load_model, load_platform
    from piper_plan.specs import TrainingSpec

    return load_model("deepseek-v3"), load_platform("frontier"), TrainingSpec()


def frontier_calibration():
    """The calibration ``piper plan --platform frontier`` uses (cli/common.py platform_calibration)."""
    from piper_plan.cli.common import platform_calibration

    calibration = platform_calibration("frontier")
    if calibration is None:
        raise SystemExit("calibration/frontier has no CSVs: the calibrated figure cannot be measured")
    return calibration


def candidates(n_candidates: int, distinct: bool):
    """(PlanBatch of n_candidates, number of structurally valid DSV3 x 2048-node candidates tiled into it)."""
    from piper_plan.plans import PlanBatch
    from piper_plan.search.space import enumerate_space

    space = enumerate_space(*setting(), 2048)
    reps = -(-n_candidates // len(space))
    fields = {k: np.tile(v, reps)[:n_candidates] for k, v in space.fields.items()}
    if distinct:
        copy = np.repeat(np.arange(reps), len(space))[:n_candidates]
        fields["num_microbatches"] = fields["num_microbatches"] * (1 + copy)
    return PlanBatch.from_arrays(fields), len(space)


def evaluation_rates(batch, calibration, repeat: int) -> tuple[float, float]:
    """(candidates per wall second, per CPU second): median of ``repeat`` evaluations, after one warm-up (the
    calibration's interpolators are built once per process, as in a search)."""
    from piper_plan.cost.evaluate import evaluate

    model, platform, training = setting()
    run = lambda: evaluate(model, platform, training, 2048, batch, calibration=calibration)   # noqa: E731
    run()
    wall, cpu = median_seconds(run, repeat)
    return len(batch) / wall, len(batch) / cpu


def whole_search(calibration, repeat: int) -> tuple[float, int, int]:
    from piper_plan.search.engine import search

    results = []
    seconds, _ = median_seconds(lambda: results.append(search(*setting(), 2048, calibration=calibration)), repeat)
    r = results[-1]
    return seconds, r.candidates_total, len(r.fields["dp"])


def process_seconds(args: list[str], runs: int) -> list[float]:
    """Wall seconds of ``runs`` whole-process runs of ``piper ARGS`` (output discarded), on the user's CPUs and
    environment."""
    def restore_cpus():
        if _USER_CPUS is not None:
            os.sched_setaffinity(0, _USER_CPUS)

    times = []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run([str(PIPER), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=_USER_ENV, preexec_fn=restore_cpus, check=False)
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit(f"`piper {' '.join(args)}` exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return times


def print_rates(label: str, n: int, calibration, repeat: int) -> None:
    for distinct in (False, True):
        batch, n_valid = candidates(n, distinct)
        wall, cpu = evaluation_rates(batch, calibration, repeat)
        kind = "all distinct" if distinct else f"the {n_valid:,} valid DSV3 x 2048-node candidates tiled"
        goal = ""
        if calibration is not None and distinct:     # per core: evaluations per CPU second of the pinned core
            goal = f"; goal >= {GOAL_CALIBRATED_PER_S:,} per CPU second: " \
                   f"{'met' if cpu >= GOAL_CALIBRATED_PER_S else 'NOT met'}"
        print(f"cost-model evaluations, {label}, {n:,} candidates ({kind}): {wall:,.0f} /s wall, "
              f"{cpu:,.0f} /s CPU, one core (median of {repeat}){goal}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5, help="in-process repeats (median)")
    parser.add_argument("--runs", type=int, default=5, help="whole-process runs (median)")
    args = parser.parse_args()
    import piper_plan

    print(f"host: {os.uname().nodename}, python {sys.version.split()[0]}, numpy {np.__version__}, "
          f"piper_plan from {Path(piper_plan.__file__).parent}, load average {os.getloadavg()[0]:.2f}")
    calibration = frontier_calibration()
    print_rates("calibrated (calibration/frontier)", args.candidates, calibration, args.repeat)
    print_rates("uncalibrated (roofline fallback)", args.candidates, None, args.repeat)
    seconds, total, evaluated = whole_search(calibration, args.repeat)
    print(f"whole search in-process, DeepSeek-V3 on 2048 Frontier nodes, calibrated: {seconds:.3f} s for "
          f"{total:,} candidates enumerated, {evaluated:,} evaluated (median of {args.repeat})")
    for (name, goal), plan_args in zip(GOALS_S.items(), (DSV3_2048, WHOLE_FRONTIER)):
        times = process_seconds(plan_args, args.runs)
        median = statistics.median(times)
        print(f"{name}: `piper {' '.join(plan_args)}` whole process: median {median:.3f} s of {args.runs} "
              f"({', '.join(f'{t:.2f}' for t in times)}); goal < {goal:.0f} s: {'met' if median < goal else 'NOT met'}")
    print(f"`piper --help` whole process: median {statistics.median(process_seconds(['--help'], args.runs)):.3f} s")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
