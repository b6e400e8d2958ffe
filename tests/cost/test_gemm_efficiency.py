"""Measured GEMM efficiency per precision (efficiency.gemm_by_dtype): fp8 matmuls reach a different fraction of
their peak than bf16 ones (MAMF tables), and a dtype the map does not name keeps efficiency.gemm."""

from __future__ import annotations

import pytest

from piper_plan.catalog import load_platform, parse_spec
from piper_plan.cost.compute import Rates
from piper_plan.errors import PiperError
from piper_plan.specs.platform import PlatformSpec

BIG = 16384     # a compute-bound square GEMM: the roofline's min() picks the peak


def _with_efficiency(platform, **fields):
    data = platform.model_dump(mode="json")
    data["efficiency"].update(fields)
    return type(platform).model_validate(data)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_each_precision_runs_at_its_own_measured_fraction_of_its_peak(dtype):
    platform = _with_efficiency(load_platform("dgx-h100"), gemm=0.8, gemm_by_dtype={"fp8": 0.5})
    rate = float(Rates(platform, dtype).gemm_flops_per_s(BIG, BIG, BIG))
    assert rate == pytest.approx({"bf16": 0.8, "fp8": 0.5}[dtype] * platform.peak_flops(dtype))


def test_the_shipped_h100_prices_fp8_below_twice_bf16():
    """MAMF: H100 fp8 1402.6 vs bf16 794.5 TFLOPS, 1.77x, not the 2x of the peaks."""
    platform = load_platform("dgx-h100")
    ratio = Rates(platform, "fp8").gemm_flops_per_s(BIG, BIG, BIG) / Rates(platform, "bf16").gemm_flops_per_s(
        BIG, BIG, BIG)
    assert float(ratio) == pytest.approx(1402.6 / 794.5, rel=0.01)


def test_an_unknown_precision_in_the_map_is_one_clear_error():
    data = load_platform("dgx-h100").model_dump(mode="json")
    data["efficiency"]["gemm_by_dtype"] = {"fp9": 0.5}
    with pytest.raises(PiperError, match="gemm_by_dtype"):
        parse_spec(PlatformSpec, data, "dgx-h100.yaml")
