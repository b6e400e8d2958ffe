"""Memory-bound kernel sweep (torch, imported lazily): the rates at which a device streams the runtime's
elementwise work, which the cost model prices by bytes (cost/compute.py ``Rates.memory_seconds``).

A datasheet's memory bandwidth is an upper bound no kernel reaches, and kernels differ: on an H200 (4.8 TB/s) a
copy streamed 4,048 GB/s, and the runtime's fused AdamW and its gradient casts ran slower still
(docs/gpu-check.md). Each kernel is timed as the runtime runs it, and its row holds the bytes it moves in device
memory (read + written), so that bytes / seconds is the rate the model divides its own byte counts by:

- ``copy``: ``dst.copy_(src)`` in the compute precision (bf16 on a GPU, fp32 on a CPU): 2 x size bytes. The rate
  of the model's elementwise terms (norms, activations, residual adds, permutations);
- ``cast``: an fp32 tensor cast to 16 bits and a 16-bit one cast to fp32 (the runtime's once-per-step weight copy
  and each micro-batch's gradient cast: runtime/casts.py, cost/step.py ``runtime_copy_seconds``): 2 x (4 + 2) bytes
  per element;
- ``accumulate``: ``a.add_(b)`` in fp32 (a micro-batch's gradient added to the held one): 12 bytes per element;
- ``optimizer``: one step of the runtime's optimizer (AdamW; fused on a GPU: runtime/optim.py ``Optimizers``) over
  4 fp32 tensors with gradients: parameter, gradient and both moments read, parameter and moments written, 28 bytes
  per element;
- ``clip``: the global gradient norm and the clip's scaling (runtime/optim.py ``global_grad_norm``,
  ``clip_grads``: ``get_total_norm`` + ``_foreach_mul_``) over the same 4 fp32 gradients: 12 bytes per element.

Sizes: large enough that launches vanish (the model takes each kernel's fastest row); ``piper calibrate --only
memory`` writes memory.csv.
"""

from __future__ import annotations

from dataclasses import dataclass

OPTIMIZER_TENSORS = 4
"""The optimizer and clip rows step this many equal tensors (one fused multi-tensor call, as the runtime's)."""
BYTES_PER_ELEMENT = {"copy": None, "cast": 2 * (4 + 2), "accumulate": 12, "optimizer": 28, "clip": 12}
"""Bytes read + written per element of each kernel; copy: twice the compute precision's width."""


@dataclass(frozen=True)
class MemoryPoint:
    kernel: str
    elements: int

    def key(self, device: str) -> tuple:
        return (device, self.kernel, self.elements)

    @property
    def label(self) -> str:
        return f"memory {self.kernel} {self.elements:,} elements"


def memory_points(device_type: str, quick: bool) -> list[MemoryPoint]:
    """Two sizes per kernel, 2^24 and 2^26 elements (64 and 256 MiB per fp32 tensor: a CPU's copy row is then the
    256 MiB copy platforms/local-cpu.yaml quotes its bandwidth from, beyond its caches); quick: 2^24 on a CPU, 2^26
    on a GPU."""
    sizes = (2**24, 2**26)
    sizes = sizes[-1:] if quick and device_type == "cuda" else sizes[:1] if quick else sizes
    return [MemoryPoint(k, n) for k in BYTES_PER_ELEMENT for n in sizes]


def compute_dtype_name(device_type: str) -> str:
    """The precision the runtime computes in on this device type: what the copy row streams."""
    return "bf16" if device_type == "cuda" else "fp32"


def bytes_moved(point: MemoryPoint, device_type: str) -> int:
    """Bytes one call of ``point`` reads and writes."""
    per = BYTES_PER_ELEMENT[point.kernel]
    if per is None:
        per = 2 * (2 if compute_dtype_name(device_type) == "bf16" else 4)
    return per * point.elements


def measure_memory(point: MemoryPoint, device, repeats: int, warmup: int) -> float:
    """Median seconds of one call of ``point``'s kernel on ``device``."""
    from piper_plan.calibration.timing import median_seconds

    return median_seconds(_kernel_call(point, device), device, warmup, repeats)


def _kernel_call(point: MemoryPoint, device):
    import torch

    from piper_plan.calibration.timing import torch_dtype

    n = point.elements
    if point.kernel == "copy":
        dtype = torch_dtype(compute_dtype_name(device.type))
        src, dst = torch.ones(n, device=device, dtype=dtype), torch.empty(n, device=device, dtype=dtype)
        return lambda: dst.copy_(src)
    if point.kernel == "cast":
        wide, narrow = torch.ones(n, device=device), torch.empty(n, device=device, dtype=torch.bfloat16)

        def cast():
            narrow.copy_(wide)
            wide.copy_(narrow)
        return cast
    if point.kernel == "accumulate":
        held, new = torch.zeros(n, device=device), torch.ones(n, device=device)
        return lambda: held.add_(new)
    params = [torch.nn.Parameter(torch.ones(n // OPTIMIZER_TENSORS, device=device)) for _ in range(OPTIMIZER_TENSORS)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    if point.kernel == "clip":
        grads = [p.grad for p in params]

        def clip():
            norm = torch.nn.utils.get_total_norm(grads)
            torch._foreach_mul_(grads, torch.clamp(1.0 / (norm + 1e-6), max=1.0))
        return clip
    from piper_plan.runtime.optim import adamw_options

    optimizer = torch.optim.AdamW(params, lr=1e-6, **adamw_options(device))
    return optimizer.step
