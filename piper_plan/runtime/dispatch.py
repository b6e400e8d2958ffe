"""The flat expert-parallel dispatcher: layout first, then dispatch, then combine (DeepEP's API shape).

Shapes (legend): R = rows this rank sends (token-expert assignments), S = rows it receives, D = features,
ep = members of the expert-parallel group. Rows are grouped by destination in group-rank order on the way
out (dispatch) and by source in group-rank order on the way in; combine is the exact reverse exchange.

``layout`` exchanges the per-destination counts with ONE ``all_to_all_single``; ``dispatch``/``combine``
are one ``all_to_all_single`` each with split sizes (list-form ``all_to_all`` fails on gloo with unequal
sizes: reference/environment.md) and are differentiable: the backward of dispatch is combine and vice versa.
As an extension, ``layout`` also accepts counts per (destination, local expert) [ep, n_local]; the layout then
carries ``recv_expert_counts`` [ep][n_local] (still one exchange) and the same counts as a tensor.
Host synchronisation: one read of the exchanged counts per layout (tests/runtime/test_host_syncs.py).
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
    recv_expert_counts_tensor: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """The same as an int64 [ep x n_local] tensor where the exchange left it (the expert GEMMs' group sizes
    without a second host copy)."""


class CommTimer:
    """Seconds spent inside the dispatcher's collectives, without synchronising the device: on GPUs a pair
    of CUDA events on the current stream around each collective (their elapsed time is resolved when
    ``seconds`` is read, after the step's own synchronisation); on CPU (gloo: collectives complete before
    they return) the wall clock around the call."""

    def __init__(self) -> None:
        self._host_s = 0.0
        self._events: list = []

    def reset(self) -> None:
        self._host_s, self._events = 0.0, []

    def run(self, fn, *args, device: torch.device | None = None):
        if device is not None and device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args)
            end.record()
            self._events.append((start, end))
            return out
        begin = time.perf_counter()
        out = fn(*args)
        self._host_s += time.perf_counter() - begin
        return out

    @property
    def seconds(self) -> float:
        """Total so far (waits for the recorded events' completion on GPUs: read it at the step's end)."""
        return self._host_s + sum(s.elapsed_time(e) for s, e in self._events) / 1e3


def _exchange(x_RD: torch.Tensor, send: tuple[int, ...], recv: tuple[int, ...], group, timer) -> torch.Tensor:
    out = x_RD.new_empty((sum(recv),) + tuple(x_RD.shape[1:]))
    timer.run(lambda: dist.all_to_all_single(out, x_RD.contiguous(), list(recv), list(send), group=group),
              device=x_RD.device)
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


class PendingLayout:
    """A count exchange in flight (``start_layout``): ``wait()`` returns the dispatcher's layout."""

    def __init__(self, finish) -> None:
        self._finish = finish

    def wait(self):
        return self._finish()


class PendingExchange:
    """A dispatch in flight (``FlatDispatcher.dispatch_async``): ``wait()`` returns the received rows.

    Two autograd nodes around the exchange, so that work between start and wait overlaps it in both passes:
    forward, ``_StartAllToAll`` starts the exchange and ``wait`` completes it; backward, ``_WaitAllToAll``
    starts the reverse exchange and ``_StartAllToAll`` completes it, and autograd runs the backward of what the
    forward ran in between (created after the start, so it is ready first) while the rows travel."""

    def __init__(self, timer: CommTimer) -> None:
        self.timer = timer
        self.exchange = None
        """(send counts, receive counts, group) of the forward exchange."""
        self.out = self.work = self.grad_out = self.grad_work = None
        """The forward exchange's output and Work; the reverse exchange's (backward)."""

    def wait(self) -> torch.Tensor:
        out, self.out = self.out, None  # the handle keeps no tensor of the graph: no cycle through autograd's
        return _WaitAllToAll.apply(out, self)  # nodes, which would keep unreached nodes' saved tensors alive


class ReadyExchange:
    """A dispatch that completed when it was started (a dispatcher without an asynchronous exchange)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def wait(self) -> torch.Tensor:
        return self.rows


def _start_exchange(x_RD: torch.Tensor, send, recv, group, timer):
    out = x_RD.new_empty((sum(recv),) + tuple(x_RD.shape[1:]))
    work = timer.run(lambda: dist.all_to_all_single(out, x_RD.contiguous(), list(recv), list(send), group=group,
                                                    async_op=True), device=x_RD.device)
    return out, work


class _StartAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, send, recv, group, pending):
        ctx.pending = pending
        out, pending.work = _start_exchange(x_RD, send, recv, group, pending.timer)
        return out

    @staticmethod
    def backward(ctx, _grad_SD):
        pending = ctx.pending
        grad_RD, work = pending.grad_out, pending.grad_work
        pending.grad_out = pending.grad_work = None
        pending.timer.run(work.wait, device=grad_RD.device)
        return grad_RD, None, None, None, None


class _WaitAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out_SD, pending):
        ctx.pending = pending
        work, pending.work = pending.work, None
        pending.timer.run(work.wait, device=out_SD.device)
        return out_SD.view_as(out_SD)

    @staticmethod
    def backward(ctx, grad_SD):
        pending = ctx.pending
        send, recv, group = pending.exchange
        pending.grad_out, pending.grad_work = _start_exchange(grad_SD, recv, send, group, pending.timer)
        return grad_SD, None


class FlatDispatcher:
    """One all_to_all_single over the whole EP group (the baseline HALO improves on)."""

    def __init__(self, group) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.timer = CommTimer()

    def layout(self, send_counts: torch.Tensor) -> DispatchLayout:
        """send_counts: int64 [ep] (or [ep, n_local]) rows per destination; one all_to_all_single, then ONE
        host read of the sent and received counts together (the split sizes must be Python ints)."""
        return self.start_layout(send_counts).wait()

    def start_layout(self, send_counts: torch.Tensor) -> "PendingLayout":
        """``layout`` with its count exchange started, not waited for: work that needs no count (the rows'
        permutation, runtime/moe.py) runs while it travels; ``.wait()`` reads the counts and builds the layout."""
        flat = send_counts.reshape(-1).to(torch.int64)
        recv = torch.empty_like(flat)
        work = self.timer.run(lambda: dist.all_to_all_single(recv, flat, group=self.group, async_op=True),
                              device=flat.device)
        return PendingLayout(lambda: self._layout(send_counts.dim() == 2, flat, recv, work))

    def _layout(self, per_expert: bool, flat, recv, work) -> DispatchLayout:
        self.timer.run(work.wait, device=flat.device)
        send_host, recv_host = torch.stack([flat, recv]).view(2, self.size, -1).tolist()
        if not per_expert:
            return DispatchLayout(tuple(r[0] for r in send_host), tuple(r[0] for r in recv_host))
        return DispatchLayout(tuple(sum(r) for r in send_host), tuple(sum(r) for r in recv_host),
                              tuple(tuple(r) for r in recv_host), recv)

    def dispatch(self, x_RD: torch.Tensor, layout: DispatchLayout) -> torch.Tensor:
        """x_RD rows grouped by destination -> x_SD rows grouped by source; differentiable."""
        return _AllToAll.apply(x_RD, layout.send_counts, layout.recv_counts, self.group, self.timer)

    def dispatch_async(self, x_RD: torch.Tensor, layout: DispatchLayout) -> PendingExchange:
        """``dispatch`` started, not waited for: compute that needs no received row runs before ``.wait()``
        (the shared experts, runtime/moe.py), and its backward runs while the reverse exchange travels."""
        pending = PendingExchange(self.timer)
        pending.exchange = (layout.send_counts, layout.recv_counts, self.group)
        pending.out = _StartAllToAll.apply(x_RD, layout.send_counts, layout.recv_counts, self.group, pending)
        return pending

    def combine(self, y_SD: torch.Tensor, layout: DispatchLayout) -> torch.Tensor:
        """The reverse of dispatch: y_SD rows grouped by source -> y_RD in this rank's send order."""
        return _AllToAll.apply(y_SD, layout.recv_counts, layout.send_counts, self.group, self.timer)
