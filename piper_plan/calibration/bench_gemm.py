"""GEMM sweep driver (torch, imported lazily): dense shapes and tall-and-skinny expert shapes.

A point is one forward GEMM [m x k] @ [k x n] (m = tokens), or ``groups`` of them as one grouped call
(``torch._grouped_mm`` where the installed torch has it, else ``torch.bmm`` over equal groups).
An fp8 point (GPUs with 8-bit GEMMs) is torch's scaled GEMM with E4M3 inputs, one fp32 scale per tensor and bf16
output (``torch._scaled_mm``: the kernel of per-tensor "current" scaling); grouped, ``torch._scaled_grouped_mm``
with row-wise scales where the device runs it, else one ``torch._scaled_mm`` call per group (what Transformer
Engine's grouped linear does: one cuBLAS GEMM per expert).
Expert shapes run from a handful of tokens per expert to many thousands: the paper's observation that
fine-grained MoE with few tokens per expert gives slow tall-and-skinny GEMMs is what these rows calibrate.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product


@dataclass(frozen=True)
class GemmPoint:
    dtype: str
    m: int
    n: int
    k: int
    groups: int

    def key(self, device: str) -> tuple:
        return (device, self.dtype, self.m, self.n, self.k, self.groups)

    @property
    def label(self) -> str:
        return f"gemm {self.dtype} m={self.m} n={self.n} k={self.k} g={self.groups}"


# (n, k) feature pairs: expert up/down projections of the catalog's MoE families (d, d_ffn):
# DeepSeek-MoE 2048/1408, DeepSeek-V2 5120/1536, DeepSeek-V3 7168/2048, Mixtral 4096/14336 (models/*.yaml).
_GPU_FEATURES = ((1408, 2048), (2048, 1408), (1536, 5120), (5120, 1536), (2048, 7168), (7168, 2048),
                 (14336, 4096), (4096, 14336), (4096, 4096), (8192, 8192))
_CPU_FEATURES = ((512, 256), (256, 512), (1024, 1024))
_CPU_FEATURES_QUICK = ((512, 256), (256, 512))


def gemm_points(device_type: str, quick: bool) -> list[GemmPoint]:
    """The sweep: tokens m over powers of 4, feature pairs, plain and grouped calls, per dtype."""
    if device_type == "cuda":   # fp8: measured where the device has 8-bit GEMMs (fp8_gemm_error)
        dtypes, feats = ("bf16", "fp8"), _GPU_FEATURES[:4] if quick else _GPU_FEATURES
        ms = (16, 256, 4096) if quick else tuple(4**i for i in range(1, 8))  # 4 .. 16384 tokens
        groups = (1, 8) if quick else (1, 4, 16)
    else:
        dtypes, feats = ("fp32", "bf16"), _CPU_FEATURES_QUICK if quick else _CPU_FEATURES
        ms = (8, 64, 512) if quick else (4, 16, 64, 256, 1024, 4096)
        groups = (1, 4) if quick else (1, 4, 16)
    points = [GemmPoint(d, m, n, k, g) for d, (n, k), m, g in product(dtypes, feats, ms, groups)]
    if device_type == "cpu":   # quick: 512, as one bf16 1024^3 GEMM took 2.6 s on a CPU without bf16 instructions
        points += [GemmPoint(d, s, s, s, 1) for d in dtypes for s in ((512,) if quick else (1024, 2048))]
    return points


def measure_gemm(point: GemmPoint, device, repeats: int, warmup: int) -> tuple[float, str]:
    """Median seconds of one (grouped) GEMM call, and how it was called."""
    import torch

    from piper_plan.calibration.timing import median_seconds, torch_dtype

    g, m, n, k = point.groups, point.m, point.n, point.k
    if point.dtype == "fp8":
        fn, how = _fp8_call(g, m, n, k, device)
    else:
        dtype = torch_dtype(point.dtype)
        a = torch.randn(g * m, k, device=device, dtype=dtype)
        b = torch.randn(g, k, n, device=device, dtype=dtype)
        fn, how = _grouped_call(a, b, g, m) if g > 1 else ((lambda: a @ b[0]), "matmul")
    with torch.no_grad():
        return median_seconds(fn, device, warmup, repeats), how


def fp8_torch_dtype(device):
    """The E4M3 format the device's fp8 GEMMs take: torch's fnuz variant on MI300 (gfx94x), else the OCP one."""
    import torch

    hip = device.type == "cuda" and torch.version.hip is not None
    if hip and "gfx94" in torch.cuda.get_device_properties(device).gcnArchName:
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def fp8_gemm_error(device) -> str | None:
    """None where one small fp8 GEMM runs on ``device``, else why not (first line of torch's error)."""
    try:
        fn, _how = _fp8_call(1, 16, 32, 32, device)
        fn()
    except (RuntimeError, TypeError, NotImplementedError, AttributeError) as err:
        # a kernel missing for this device or dtype; AttributeError: a torch without _scaled_mm or float8 dtypes
        return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return None


def _fp8_call(g: int, m: int, n: int, k: int, device):
    """A timed fp8 GEMM call of ``g`` groups and how it is made (module docstring). B is column-major, as torch's
    scaled GEMMs require."""
    import torch

    f8 = fp8_torch_dtype(device)
    a = torch.randn(g * m, k, device=device).to(f8)
    b = torch.randn(g, n, k, device=device).to(f8).transpose(-2, -1)
    one = torch.ones((), device=device)

    def scaled(x, w):
        return torch._scaled_mm(x, w, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    if g == 1:
        return (lambda: scaled(a, b[0])), "torch._scaled_mm"
    grouped = getattr(torch, "_scaled_grouped_mm", None)
    if grouped is not None:
        offs = torch.arange(1, g + 1, device=device, dtype=torch.int32) * m
        scale_a, scale_b = torch.ones(g * m, device=device), torch.ones(g, n, device=device)
        try:
            grouped(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)
            return (lambda: grouped(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)), \
                "torch._scaled_grouped_mm"
        except (RuntimeError, TypeError, NotImplementedError):
            pass  # this torch or device has no grouped fp8 kernel: one scaled GEMM per group
    rows = a.view(g, m, k)
    return (lambda: [scaled(rows[i], b[i]) for i in range(g)]), "torch._scaled_mm per group"


def _grouped_call(a, b, g: int, m: int):
    import torch

    offs = torch.arange(1, g + 1, device=a.device, dtype=torch.int32) * m
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is not None:
        try:
            grouped(a, b, offs=offs)
            return (lambda: grouped(a, b, offs=offs)), "torch._grouped_mm"
        except (RuntimeError, TypeError, NotImplementedError):
            grouped = None  # this torch's private grouped GEMM refuses the dtype/device: time bmm instead
    a3 = a.view(g, m, -1)
    return (lambda: torch.bmm(a3, b)), "torch.bmm"
