"""fp8 GEMM calibration: torch's scaled GEMMs timed (on this CPU as on a GPU; the grouped fp8 kernel is GPU-only,
so here the per-group fallback runs), and a sweep on a device without 8-bit GEMMs leaving fp8 out."""

from __future__ import annotations

import pytest

from piper_plan.calibration.bench_gemm import GemmPoint, fp8_gemm_error, gemm_points, measure_gemm
from piper_plan.calibration.sweep import SweepOptions, SweepResult, _runnable_gemm_points
from piper_plan.catalog import load_platform
from piper_plan.errors import PiperError


def test_an_fp8_gemm_is_timed_with_torchs_scaled_gemm_plain_and_per_group():
    import torch

    cpu = torch.device("cpu")
    assert fp8_gemm_error(cpu) is None
    seconds, how = measure_gemm(GemmPoint("fp8", 16, 64, 32, 1), cpu, repeats=2, warmup=1)
    assert seconds > 0 and how == "torch._scaled_mm"
    seconds, how = measure_gemm(GemmPoint("fp8", 16, 64, 32, 3), cpu, repeats=2, warmup=1)
    assert seconds > 0 and how == "torch._scaled_mm per group"   # torch._scaled_grouped_mm has no CPU kernel


def test_the_gpu_sweep_has_fp8_points_beside_bf16_and_the_cpu_sweep_none():
    gpu = {p.dtype for p in gemm_points("cuda", quick=True)}
    assert gpu == {"bf16", "fp8"} and "fp8" not in {p.dtype for p in gemm_points("cpu", quick=False)}


@pytest.mark.parametrize("platform_name", ["frontier", "h200"])
def test_fp8_points_leave_the_sweep_where_the_device_runs_no_fp8(tmp_path, platform_name, monkeypatch):
    """MI250X (no fp8 peak) never tries; an H200 whose torch refuses the kernel says why; --dtype fp8 then is one
    error line, before any point is measured."""
    from types import SimpleNamespace

    import piper_plan.calibration.bench_gemm as bench

    monkeypatch.setattr(bench, "fp8_gemm_error", lambda device: "no fp8 kernel for this device")
    platform = load_platform(platform_name)
    gpu, result = SimpleNamespace(type="cuda"), SweepResult()   # a GPU stand-in: only its type is read here
    default = SweepOptions(platform=platform_name, out_dir=tmp_path, quick=True, only=("gemm",))
    points = _runnable_gemm_points(default, platform, gpu, "GPU X", result)
    assert points and {p.dtype for p in points} == {"bf16"}
    why = "platform frontier has no fp8 peak in device.peak_flops" if platform_name == "frontier" else \
        "this torch runs no fp8 GEMM on it (torch._scaled_mm: no fp8 kernel for this device)"
    assert result.messages == [f"gemm: fp8 not measured on GPU X: {why}"]
    asked = SweepOptions(platform=platform_name, out_dir=tmp_path, quick=True, only=("gemm",), dtypes=("bf16", "fp8"))
    with pytest.raises(PiperError, match=r"--dtype fp8: not measurable on GPU X: .*; allowed here: bf16$"):
        _runnable_gemm_points(asked, platform, gpu, "GPU X", SweepResult())
