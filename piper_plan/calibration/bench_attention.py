"""Attention sweep driver (torch, imported lazily): ``scaled_dot_product_attention`` forward and backward.

FLOPs follow ``schema.attention_flops`` (4 b h s^2 d forward, twice that backward, half when causal).
The backward time is that of ``torch.autograd.grad`` of the output w.r.t. q, k and v (graph kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product


@dataclass(frozen=True)
class AttentionPoint:
    dtype: str
    pass_: str
    batch: int
    seq_len: int
    num_heads: int
    head_dim: int
    causal: bool

    def key(self, device: str) -> tuple:
        return (device, self.dtype, self.pass_, self.batch, self.seq_len, self.num_heads, self.num_heads,
                self.head_dim, self.causal)

    @property
    def label(self) -> str:
        return f"attention {self.pass_} s={self.seq_len} h={self.num_heads} d={self.head_dim} causal={self.causal}"


def attention_points(device_type: str, quick: bool) -> list[AttentionPoint]:
    if device_type == "cuda":
        dtypes, seqs, heads, dims = ("bf16",), ((1024, 4096) if quick else (512, 1024, 2048, 4096, 8192)), (16, 32), (64, 128)
        batch = 1
    else:
        dtypes, seqs, heads, dims = ("fp32",), ((128, 512) if quick else (128, 256, 512, 1024)), (4,), ((32, 64) if quick else (32, 64, 128))
        batch = 1
    return [AttentionPoint(dt, p, batch, s, h, d, c)
            for dt, p, s, h, d, c in product(dtypes, ("fwd", "bwd"), seqs, heads, dims, (False, True))]


def measure_attention(point: AttentionPoint, device, repeats: int, warmup: int) -> float:
    """Median seconds of one forward, or one backward, SDPA call."""
    import torch
    import torch.nn.functional as F

    from piper_plan.calibration.timing import median_seconds, torch_dtype

    shape = (point.batch, point.num_heads, point.seq_len, point.head_dim)
    dtype = torch_dtype(point.dtype)
    need_grad = point.pass_ == "bwd"
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=need_grad) for _ in range(3))
    if not need_grad:
        with torch.no_grad():
            return median_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=point.causal),
                                  device, warmup, repeats)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=point.causal)
    grad = torch.randn_like(out)
    return median_seconds(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), device, warmup, repeats)
