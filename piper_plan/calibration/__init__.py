"""Calibration data: CSV schema, validated loading, log-space curves (pandas/scipy), and torch bench drivers.

``load_calibration`` / ``Calibration`` are the API the cost model reads. The bench drivers
(bench_gemm, bench_attention, bench_collectives) import torch lazily; importing this package never does.
"""

from piper_plan.calibration.curves import Calibration, load_calibration

__all__ = ["Calibration", "load_calibration"]
