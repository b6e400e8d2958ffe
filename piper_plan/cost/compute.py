"""Compute time = FLOPs / achieved FLOP/s, the achieved rate by kernel shape.

With calibration data (``Calibration.gemm_flops_per_s`` / ``attention_flops_per_s``, measured by
``piper calibrate`` or seeded from published profiles) the rate of every GEMM is looked up by its shape
(m, n, k, groups); a point outside the measured range is extrapolated and flagged. Without calibration the
platform's roofline fallback is used and the output says so:

    achieved = efficiency.gemm x min(peak, intensity x memory_bandwidth),  intensity = 2 m n k / (bytes moved)

(Williams et al. 2009, roofline), bytes moved = (m k + k n + m n) x dtype bytes; tall-and-skinny GEMMs (an
expert that sees few tokens) have low intensity and come out memory-bound, as the Piper paper observes.
Elementwise kernels (norms, activations, residual adds, permutes) are memory-bound: bytes / bandwidth, at the
rate the calibration measured for the kind of kernel (memory.csv: calibration/bench_memory.py) where it has one.
"""

from __future__ import annotations

import numpy as np

from piper_plan.specs.platform import PlatformSpec


PEAK_MARGIN = 1.02
"""A measured rate may exceed the datasheet peak by this factor (rounding of the rows' tflops column) and no more."""


ROOFLINE_FALLBACK = "roofline fallback"
"""How Rates.source names GEMMs priced from the platform's efficiency, not measured rows (`plan --dtype LIST` looks
for it: cli/plan.mixed_rate_sources)."""


class Rates:
    """Achieved FLOP/s lookups for one platform, dtype and (optional) calibration."""

    def __init__(self, platform: PlatformSpec, dtype: str, calibration=None, fp8_recipe: str | None = None):
        """dtype: the training precision (TrainingSpec.dtype); under fp8 / mxfp8 only GEMMs run at its rate,
        attention at bf16's. fp8_recipe: an fp8 run's recipe (TrainingSpec.fp8_recipe), whose measured time over
        the kernel rate (efficiency.fp8_recipe_time) its linear layers take."""
        from piper_plan.specs.training import LOW_PRECISION_GEMM_DTYPES

        self.platform, self.dtype, self.calibration = platform, dtype, calibration
        self.fp8_recipe = fp8_recipe if dtype == "fp8" else None
        self.recipe_time = platform.efficiency.fp8_recipe_time.get(self.fp8_recipe, 1.0) if self.fp8_recipe else 1.0
        """A linear GEMM's time over its kernel's (the recipe's quantization and scaling work; 1 where unmeasured)."""
        self.attention_dtype = "bf16" if dtype in LOW_PRECISION_GEMM_DTYPES else dtype
        self.gemm_dtype = "mxfp8" if self.emulated_blockwise else dtype
        """The precision whose kernels run the GEMMs: ``dtype``, or mxfp8 for fp8 blockwise where the device runs it
        as MXFP8 (efficiency.fp8_blockwise_runs_as_mxfp8)."""
        self.peak = platform.peak_flops(self.gemm_dtype)
        self.attention_peak = platform.peak_flops(self.attention_dtype)
        self.bandwidth_Bps = platform.device.memory_bandwidth_GBps * 1e9
        self.elem_bytes = 4 if dtype == "fp32" else 1 if dtype in LOW_PRECISION_GEMM_DTYPES else 2
        self.gemm_efficiency = platform.efficiency.gemm_fraction(self.gemm_dtype)
        self.gemm_calibration = calibration if calibration is not None and calibration.has_gemm(self.gemm_dtype) \
            else None
        """The calibration GEMMs are looked up in: None where gemm.csv has no rows of ``gemm_dtype`` (the roofline
        at its own peak, not another precision's measured rates)."""
        self.extrapolated = False
        if calibration is not None:
            self._check_below_peak(calibration)
        self.high_precision = self if self.attention_dtype == dtype else Rates(platform, self.attention_dtype,
                                                                               calibration)
        """The rates of the GEMMs an 8-bit recipe leaves in 16 bits (the router, the output layer, unfused
        attention): Megatron-Core's router multiplies in moe_router_dtype (megatron/core/transformer/moe/router.py,
        TopKRouter.gating) and its output layer is a tensor_parallel.ColumnParallelLinear, not a Transformer Engine
        module (megatron/core/models/gpt/gpt_model.py), so neither runs under Transformer Engine's fp8 autocast."""

    @property
    def emulated_blockwise(self) -> bool:
        """An fp8 blockwise run on a device that runs the recipe as MXFP8 (Blackwell)."""
        return self.fp8_recipe == "blockwise" and self.platform.efficiency.fp8_blockwise_runs_as_mxfp8

    def _check_below_peak(self, calibration) -> None:
        """A calibration row faster than the device's datasheet peak is a broken measurement (it priced MFU at
        199%): one error line naming the file. So is a memory-bound kernel faster than a GPU's memory bandwidth."""
        from piper_plan.errors import PiperError

        for table, dtype, peak in (("gemm", self.gemm_dtype, self.peak), ("attention", self.attention_dtype,
                                                                      self.attention_peak)):
            fastest = calibration.fastest_tflops(table, dtype) * 1e12
            if fastest > PEAK_MARGIN * peak:
                fix = ("for a CPU platform, whose peak is its best measured rate, set device.peak_flops to it (as "
                       "platforms/local-cpu.yaml does)" if self.platform.launch.device == "cpu" else
                       "measure the row again, or correct device.peak_flops if the platform file describes another "
                       "device than the one measured")
                raise PiperError(f"a {dtype} row measures {fastest / 1e12:.4g} TFLOP/s, above the device's peak of "
                                 f"{peak / 1e12:.4g} (platform {self.platform.name}, device.peak_flops.{dtype}): no "
                                 f"kernel beats its datasheet; {fix}", path=str(calibration.directory /
                                                                               f"{table}.csv"))
        if self.platform.launch.device == "cpu":    # a CPU's bandwidth is itself a measured copy, which caches beat
            return
        from piper_plan.calibration.schema import MEMORY_KERNELS

        for kernel in MEMORY_KERNELS:
            rate = calibration.memory_Bps(kernel)
            if rate > PEAK_MARGIN * self.bandwidth_Bps:
                raise PiperError(f"a {kernel} row measures {rate / 1e9:.6g} GB/s, above the device's memory "
                                 f"bandwidth of {self.bandwidth_Bps / 1e9:.6g} (platform {self.platform.name}, "
                                 "device.memory_bandwidth_GBps): no kernel beats its datasheet; measure the row again",
                                 path=str(calibration.directory / "memory.csv"))

    @property
    def source(self) -> str:
        """Where the compute rates come from: the calibration's own sources (with the GEMM fallback where its
        gemm.csv lacks this dtype), else the roofline's efficiencies and their citation; a peak borrowed from the
        other 16-bit format (PlatformSpec.peak_flops) is named."""
        peaks = "".join(f"; the {d} peak is device.peak_flops' {self.platform.peak_dtype(d)} (no {d} entry)"
                        for d in dict.fromkeys((self.gemm_dtype, self.attention_dtype))
                        if self.platform.peak_dtype(d) != d)
        from piper_plan.specs.training import LOW_PRECISION_GEMM_DTYPES

        eff = self.platform.efficiency
        borrowed = f"; no {self.gemm_dtype} GEMM efficiency measured (efficiency.gemm_by_dtype): the 16-bit " \
            f"efficiency.gemm is taken for {self.gemm_dtype}" \
            if self.gemm_dtype in LOW_PRECISION_GEMM_DTYPES and self.gemm_dtype not in eff.gemm_by_dtype else ""
        if self.calibration is None:
            return f"{ROOFLINE_FALLBACK} (efficiency.gemm={self.gemm_efficiency} for {self.gemm_dtype}, " \
                   f"attention={eff.attention}: {eff.source}){peaks}{borrowed}" + self.recipe_source
        listed = getattr(self.calibration, "sources", []) or ["(no sources listed)"]
        gemm = "" if self.gemm_calibration is not None else \
            f"; GEMMs in {self.gemm_dtype}: {ROOFLINE_FALLBACK} (efficiency.gemm={self.gemm_efficiency}: gemm.csv " \
            f"has no {self.gemm_dtype} rows){borrowed}"
        return "calibration: " + "; ".join(listed) + gemm + peaks + self.recipe_source

    @property
    def recipe_source(self) -> str:
        """How an fp8 run's recipe is priced: its measured factor, or that none is measured on this platform."""
        if self.fp8_recipe is None:
            return ""
        if self.emulated_blockwise:
            factor = (f" x {self.recipe_time:g} (efficiency.fp8_recipe_time)" if "blockwise" in
                      self.platform.efficiency.fp8_recipe_time else ", the conversion not measured")
            return (f"; fp8 recipe blockwise: {self.platform.name} runs it as MXFP8 (efficiency."
                    f"fp8_blockwise_runs_as_mxfp8): linear GEMMs at mxfp8's rate{factor}")
        if self.fp8_recipe in self.platform.efficiency.fp8_recipe_time:
            return (f"; fp8 recipe {self.fp8_recipe}: linear GEMMs take {self.recipe_time:g} x their kernel time "
                    "(efficiency.fp8_recipe_time)")
        return (f"; fp8 recipe {self.fp8_recipe}: no time measured for it on {self.platform.name} "
                "(efficiency.fp8_recipe_time): linear GEMMs at the kernel rate")

    def gemm_flops_per_s(self, m, n, k, groups=1):
        """Achieved FLOP/s of a [m x k] @ [k x n] GEMM (``groups`` of them in one grouped call)."""
        if self.gemm_calibration is not None:
            rate, extra = self.gemm_calibration.gemm_flops_per_s(m, n, k, self.gemm_dtype, groups)
            self.extrapolated |= bool(np.any(extra))
            return np.asarray(rate, float)
        m, n, k = (np.maximum(np.asarray(x, float), 1.0) for x in (m, n, k))
        intensity = 2 * m * n * k / ((m * k + k * n + m * n) * self.elem_bytes)
        return self.gemm_efficiency * np.minimum(self.peak, intensity * self.bandwidth_Bps)

    def gemm_seconds(self, m, n, k, groups=1, backward=False):
        """Seconds of the forward GEMM, or of its two backward GEMMs (input grad [m,n]x[n,k], weight grad [k,m]x[m,n])."""
        flops = 2.0 * m * n * k * groups
        if not backward:
            return flops / self.gemm_flops_per_s(m, n, k, groups)
        return flops / self.gemm_flops_per_s(m, k, n, groups) + flops / self.gemm_flops_per_s(k, n, m, groups)

    def linear_seconds(self, m, n, k, groups=1, backward=False):
        """``gemm_seconds`` of a linear layer's GEMM: under fp8, times its recipe's factor (``recipe_time``)."""
        return self.recipe_time * self.gemm_seconds(m, n, k, groups, backward)

    def attention_flops_per_s(self, seq_len, num_heads, head_dim, pass_: str):
        """Achieved FLOP/s of causal attention (fwd or bwd)."""
        if self.calibration is not None:
            rate, extra = self.calibration.attention_flops_per_s(seq_len, num_heads, head_dim, True, pass_,
                                                                 self.attention_dtype)
            self.extrapolated |= bool(np.any(extra))
            return np.asarray(rate, float)
        return self.platform.efficiency.attention * self.attention_peak * np.ones_like(np.asarray(num_heads, float))

    def memory_seconds(self, nbytes, kernel: str = "copy"):
        """Seconds to stream ``nbytes`` through device memory with a memory-bound ``kernel`` (schema.MEMORY_KERNELS:
        copy for elementwise work, cast / accumulate for the runtime's gradient copies, optimizer, clip): at the
        kernel's rate measured in the calibration's memory.csv, else at the platform's memory bandwidth."""
        return nbytes / self.memory_Bps(kernel)

    def memory_Bps(self, kernel: str) -> float:
        """The rate ``memory_seconds`` streams ``kernel`` at (bytes / s)."""
        measured = self.calibration.memory_Bps(kernel) if self.calibration is not None else 0.0
        return measured if measured > 0 else self.bandwidth_Bps
