"""The runtime's 16-bit copies of its fp32 weights under autocast (zero 0 / 1 on a GPU; runtime/train.py
precision_path): one copy per weight and step, and one autograd node per use.

Inside ``casts_once_per_step`` (Trainer.forward_backward enters it for the step) ``step_cast`` hands out views of
one copy per weight, made at its first use, so the later micro-batches and recomputations do not cast again. Each
use is its own autograd node (``_FromStepCopy``), whose backward casts that use's 16-bit weight gradient to fp32.
A single cast node shared by the micro-batches, as torch.autocast's own weight cache shares its casts, keeps the
step's first sequence number. Autograd then runs it after every other node of each later micro-batch's backward, and
every layer's 16-bit weight gradient waits for it: on an H200, +2.06 GiB on two Mixtral layers, and switch-base ran
out of memory (docs/gpu-check.md). The experts' grouped GEMMs (not on autocast's cast lists) and the runtime's
``Linear`` layers take their weights from here; DTensor weights (tensor parallelism) keep autocast's own cast.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

_step_casts: dict | None = None
"""The compute-dtype copies made in this step, inside ``casts_once_per_step`` (None outside)."""


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """autocast's dtype where autocast is on for x's device, else x's."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


@contextlib.contextmanager
def casts_once_per_step():
    """Inside, each weight is cast to the compute dtype once (module docstring). Cast in every micro-batch, the
    experts' casts took as long as their GEMMs on an H200 (docs/gpu-check.md)."""
    global _step_casts
    outer, _step_casts = _step_casts, {}
    try:
        yield
    finally:
        _step_casts = outer


class _FromStepCopy(torch.autograd.Function):
    """A parameter in a lower precision, from the step's copy: forward hands out a view of the copy, backward casts
    the gradient back to the parameter's dtype (module docstring: why one node per use)."""

    @staticmethod
    def forward(ctx, param, copy):
        ctx.dtype = param.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


def step_cast(p: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``p`` in ``dtype``: inside ``casts_once_per_step``, from the step's copy (a new one once the parameter changed
    in place); else (and for DTensor parameters) a fresh cast. A write through ``p.data`` does not move
    ``p._version``: nothing may write a parameter that way inside a step (expert migration writes between steps)."""
    if p is None or p.dtype == dtype:
        return p
    if _step_casts is None or isinstance(p, DTensor):
        return p.to(dtype)
    held = _step_casts.get((id(p), dtype))
    if held is None or held[0] is not p or held[1] != p._version:
        with torch.no_grad():
            held = _step_casts[(id(p), dtype)] = (p, p._version, p.detach().to(dtype))
    return _FromStepCopy.apply(p, held[2]) if torch.is_grad_enabled() and p.requires_grad else held[2]


class Linear(nn.Linear):
    """torch's Linear whose weight and bias come from ``step_cast`` under autocast (in fp32, and for DTensor weights,
    exactly nn.Linear)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x)
        if dtype == self.weight.dtype or isinstance(self.weight, DTensor):
            return super().forward(x)
        return F.linear(x, step_cast(self.weight, dtype), step_cast(self.bias, dtype))
