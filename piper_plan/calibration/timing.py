"""Timing for the bench drivers (torch imported by the caller): warm-up, repeats, median.

GPUs (CUDA or ROCm/HIP, both ``torch.cuda``): CUDA events around the kernel. CPU: ``time.perf_counter``.
A sample repeats the call until it lasts ``min_sample_s``, so microsecond kernels are not timer noise. Two or more
operations compared with each other are timed in alternation (``interleaved_call_times``), a call's time taken over
all ranks (``exchange_spans``).
The figure is the median of the samples, or (``statistic="min"``) the fastest: on a host shared with other work
the noise only adds time, so the fastest sample is the uncontended time (used on the emulated network,
benchmarks/halo_network.py).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable


STATISTICS = {"median": statistics.median, "min": min}
"""How the samples of one measurement become its figure."""
MAX_CALLS = 10_000
"""Timed (or untimed warm-up) calls of one measurement at most: a benchmark, not an endless loop."""


def median_seconds(fn: Callable[[], object], device, warmup: int, repeats: int, min_sample_s: float = 1e-3) -> float:
    """Median seconds of one ``fn()`` call over ``repeats`` samples, after ``warmup`` calls."""
    return call_seconds(fn, device, warmup, repeats, min_sample_s, "median")


def call_seconds(fn: Callable[[], object], device, warmup: int, repeats: int, min_sample_s: float = 1e-3,
                 statistic: str = "median") -> float:
    """Seconds of one ``fn()`` call over ``repeats`` samples after ``warmup`` calls: their median or minimum."""
    for _ in range(warmup):
        fn()
    _sync(device)
    inner = _inner_calls(fn, device, min_sample_s)
    samples = [_sample(fn, device, inner) / inner for _ in range(repeats)]
    return STATISTICS[statistic](samples)


def interleaved_call_times(fns: dict[str, Callable[[], object]], device, warmup: int, repeats: int,
                           before: Callable[[], object] | None = None) -> dict[str, list[tuple[float, float]]]:
    """(start on this host's monotonic clock, seconds) of every timed call of each of ``fns``: ``repeats`` rounds
    after ``warmup`` calls of each, a round one call of every fn, starting one further along each round (A B, B A,
    ...), so a slow spell of the host falls on all of them alike and their ratio holds on a noisy machine.
    ``before`` runs untimed ahead of every call (a barrier: each call then starts from quiet links, as one exchange
    between two layers' compute does, instead of overlapping the previous call's stragglers)."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    _sync(device)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(repeats):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            if before is not None:
                before()
                _sync(device)
            start = time.perf_counter()
            times[name].append((start, _sample(fns[name], device, 1)))
    return times


def exchange_spans(per_rank: list[list[tuple[float, float]]], shared_clock: bool) -> list[float]:
    """Seconds of each call of a collective from every rank's (start, seconds) of it: from the first rank's start to
    the last rank's end where the ranks read one clock (one host: a late starter delays the others, and a rank's own
    span alone would miss what it waited for before it began), else the slowest rank's own span."""
    calls = zip(*per_rank)
    if shared_clock:
        return [max(t + d for t, d in call) - min(t for t, _ in call) for call in calls]
    return [max(d for _, d in call) for call in calls]


def slowest_rank_seconds(seconds: float, device, group=None) -> float:
    """The largest of every rank's ``seconds`` (collective over ``group``): a collective row's time is the
    slowest rank's median (calibration/schema.py, collectives.csv ``seconds``)."""
    import torch
    import torch.distributed as dist

    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest.item())


def _inner_calls(fn, device, min_sample_s: float) -> int:
    one = _sample(fn, device, 1)
    return max(1, min(1000, int(min_sample_s / max(one, 1e-9)) + 1)) if one < min_sample_s else 1


def _sample(fn, device, calls: int) -> float:
    if device.type == "cuda":
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3  # ms -> s
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - t0


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}[name]


def device_name(device) -> str:
    """The vendor's name of ``device`` (GPU name, or the CPU model from /proc/cpuinfo)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return cpu_name()


def cpu_name() -> str:
    """This machine's CPU as calibration names a CPU device: its model from /proc/cpuinfo, one rank per core."""
    import platform as pyplatform
    from pathlib import Path

    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + " (1 rank)"
    return pyplatform.processor() or "cpu"


ISA_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4")
"""The /proc/cpuinfo flags that name a CPU's vector instruction sets (the GEMM kernels torch can use)."""


def cpu_isa_flags() -> str | None:
    """This CPU's vector instruction-set flags (ISA_FLAG_PREFIXES), sorted and space-separated; None where
    /proc/cpuinfo is unreadable. Beside the model name they tell apart machines a VM names alike ('AMD EPYC'): on
    one with avx2 and no avx512 flag, bf16 GEMMs ran 71-366x slower than the committed local-cpu calibration's
    (2026-12-05)."""
    from pathlib import Path

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((line for line in text.splitlines() if line.startswith("flags")), None)
    if line is None:
        return None
    return " ".join(sorted(f for f in line.split(":", 1)[1].split() if f.startswith(ISA_FLAG_PREFIXES)))
