"""The flat expert-parallel dispatcher: layout first, then dispatch, then combine (DeepEP's API shape).

Shapes (legend): R = rows this rank sends (token-expert assignments), S = rows it receives, D = features,
ep = members of the expert-parallel group. Rows are grouped by destination in group-rank order on the way
out (dispatch) and by source in group-rank order on the way in; combine is the exact reverse exchange.

``layout`` exchanges the per-destination counts with ONE ``all_to_all_single``; ``dispatch``/``combine``
are one ``all_to_all_single`` each with split sizes (list-form ``all_to_all`` fails on gloo with unequal
sizes: reference/environment.md) and are differentiable: the backward of dispatch is combine and vice versa.
As an extension, ``layout`` also accepts counts per (destination, local expert) [ep, n_local]; the layout then
carries ``recv_expert_counts`` [ep][n_local] (still one exchange).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DispatchLayout:
    """The handle shared by dispatch and combine."""

    send_counts: tuple[int, ...]
    """Rows this rank sends to each member of the EP group (group-rank order)."""
    recv_counts: tuple[int, ...]
    """Rows this rank receives from each member."""
    recv_expert_counts: tuple[tuple[int, ...], ...] | None = field(default=None)
    """Per source member, rows for each of this rank's local experts (only when counts were per expert)."""


class CommTimer:
    """Seconds spent inside the dispatcher's collectives (synchronised on GPUs so the time is the wire's)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def run(self, fn, *args):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(*args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - start
        return out


def _exchange(x_RD: torch.Tensor, send: tuple[int, ...], recv: tuple[int, ...], group, timer) -> torch.Tensor:
    out = x_RD.new_empty((sum(recv),) + tuple(x_RD.shape[1:]))
    timer.run(lambda: dist.all_to_all_single(out, x_RD.contiguous(), list(recv), list(send), group=group))
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x_RD, send, recv, group, timer):
        ctx.args = (send, recv, group, timer)
        return _exchange(x_RD, send, recv, group, timer)

    @staticmethod
    def backward(ctx, grad_SD):
        send, recv, group, timer = ctx.args
        return _exchange(grad_SD, recv, send, group, timer), None, None, None, None


class FlatDispatcher:
    """One all_to_all_single over the whole EP group (the baseline HALO improves on)."""

    def __init__(self, group) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.timer = CommTimer()

    def layout(self, send_counts: torch.Tensor) -> DispatchLayout:
        """send_counts: int64 [ep] (or [ep, n_local]) rows per destination; one all_to_all_single."""
        per_expert = send_counts.dim() == 2
        flat = send_counts.reshape(-1).to(torch.int64)
        recv = torch.empty_like(flat)
        self.timer.run(lambda: dist.all_to_all_single(recv, flat, group=self.group))
        if not per_expert:
            return DispatchLayout(tuple(flat.tolist()), tuple(recv.tolist()))
        recv_E = recv.view(self.size, -1)
        return DispatchLayout(tuple(send_counts.sum(1).tolist()), tuple(recv_E.sum(1).tolist()),
                              tuple(tuple(r) for r in recv_E.tolist()))

    def dispatch(self, x_RD: torch.Tensor, layout: DispatchLayout) -> torch.Tensor:
        """x_RD rows grouped by destination -> x_SD rows grouped by source; differentiable."""
        return _AllToAll.apply(x_RD, layout.send_counts, layout.recv_counts, self.group, self.timer)

    def combine(self, y_SD: torch.Tensor, layout: DispatchLayout) -> torch.Tensor:
        """The reverse of dispatch: y_SD rows grouped by source -> y_RD in this rank's send order."""
        return _AllToAll.apply(y_SD, layout.recv_counts, layout.send_counts, self.group, self.timer)
