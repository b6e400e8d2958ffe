"""Counting host synchronisations on CPU: what would make the host wait for the device on a GPU.

Two recorders run together:
- a ``TorchDispatchMode`` that sees every aten op: ``_local_scalar_dense`` (``.item()``, ``bool(t)``, ``int(t)``)
  and every op whose output shape depends on the data (``nonzero``, boolean-mask indexing, ``masked_select``,
  ``repeat_interleave`` / ``bincount`` without an output size, ``unique``...);
- a ``TorchFunctionMode`` that sees the Python-level reads that never reach the dispatcher as an op on CPU
  (``.tolist()``, ``.numpy()``, ``.cpu()``: on a GPU each is a device-to-host copy). ``.to(device)`` is not
  counted: in the runtime it moves host-built indices to the device, which does not wait for the device.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_ALWAYS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.nonzero_static.default,
           aten.masked_select.default, aten.argwhere.default, aten._unique2.default, aten.unique_dim.default,
           aten.unique_consecutive.default, aten.bincount.default}
"""Ops that read device data on the host or size their output from it (bincount: max(minlength, max + 1))."""


def _is_data_dependent(func, args, kwargs) -> bool:
    if func in _ALWAYS:
        return True
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
        return kwargs.get("output_size") is None
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
        return any(i is not None and i.dtype == torch.bool for i in indices)
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_data_dependent(func, args, kwargs):
            self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **kwargs)


_HOST_READS = {"tolist", "numpy", "cpu"}


class _Function(TorchFunctionMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _HOST_READS:
            self.counts[f"Tensor.{name}"] += 1
        return func(*args, **kwargs)


class HostSyncCounter:
    """``with HostSyncCounter() as c: ...`` then ``c.counts`` (op name -> calls) and ``c.total``."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self._modes = (_Function(self.counts), _Dispatch(self.counts))

    def __enter__(self) -> "HostSyncCounter":
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def count_moe_layer(moe, hidden: int, tokens: int = 32) -> tuple[HostSyncCounter, HostSyncCounter]:
    """Host synchronisations of one forward and one backward of an MoE layer on ``tokens`` random tokens."""
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    with HostSyncCounter() as fwd:
        y = moe(x)
    with HostSyncCounter() as bwd:
        y.square().sum().backward()
    return fwd, bwd
