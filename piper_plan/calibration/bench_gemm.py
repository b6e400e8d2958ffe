"""GEMM sweep driver (torch, imported lazily): dense shapes and tall-and-skinny expert shapes.

A point is one forward GEMM [m x k] @ [k x n] (m = tokens), or ``groups`` of them as one grouped call
(``torch._grouped_mm`` where the installed torch has it, else ``torch.bmm`` over equal groups).
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
    if device_type == "cuda":
        dtypes, feats = ("bf16",), _GPU_FEATURES[:4] if quick else _GPU_FEATURES
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

    dtype = torch_dtype(point.dtype)
    g, m, n, k = point.groups, point.m, point.n, point.k
    a = torch.randn(g * m, k, device=device, dtype=dtype)
    b = torch.randn(g, k, n, device=device, dtype=dtype)
    fn, how = _grouped_call(a, b, g, m) if g > 1 else ((lambda: a @ b[0]), "matmul")
    with torch.no_grad():
        return median_seconds(fn, device, warmup, repeats), how


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
