"""The rows are sorted while the count exchange travels (``start_layout``), and the shared experts run while the
dispatch exchange is in flight, forward and backward (``dispatch_async``; runtime/moe.py, runtime/dispatch.py);
the result is the one of the unoverlapped layer bit for bit.

One process, a world-1 gloo group: the exchange path runs (asynchronously) without spawning ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from piper_plan.catalog import load_model


def _moe(group, overlap: bool):
    from piper_plan.runtime.dispatch import FlatDispatcher
    from piper_plan.runtime.moe import MoE

    spec = load_model("tiny-mla")  # one shared expert
    moe = MoE(spec.hidden_size, spec.moe, 0, 1, group, FlatDispatcher(group), overlap_shared=overlap)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # modules are built empty (runtime/model.py initialises a stage): a seeded init here
        for p in moe.parameters():
            p.normal_(0.0, 0.1, generator=gen)
    return moe, spec


def _record(monkeypatch, moe, log):
    real = dist.all_to_all_single

    class Logged:
        def __init__(self, work, name):
            self.work, self.name = work, name

        def wait(self):
            log.append(self.name)
            return self.work.wait()

    def spy(out, inp, *args, async_op=False, **kwargs):
        work = real(out, inp, *args, async_op=async_op, **kwargs)
        counts = "counts " if not inp.is_floating_point() else ""
        log.append(counts + ("start" if async_op else "exchange"))
        return Logged(work, counts + "wait") if async_op else work

    monkeypatch.setattr(dist, "all_to_all_single", spy)
    shared = moe.shared[0]
    shared.register_forward_hook(lambda *a: log.append("shared forward"))
    shared.register_full_backward_hook(lambda *a: log.append("shared backward"))


def test_shared_experts_run_between_start_and_wait_in_both_passes(world1, monkeypatch):
    moe, spec = _moe(world1, overlap=True)
    log: list[str] = []
    _record(monkeypatch, moe, log)
    x = torch.randn(1, 16, spec.hidden_size, requires_grad=True)
    y = moe(x)
    assert log == ["counts start", "counts wait", "start", "shared forward", "wait", "exchange"], log
    log.clear()
    y.square().sum().backward()
    # combine's reverse (synchronous), then dispatch's reverse started, the shared experts' backward, its wait
    assert log == ["exchange", "start", "shared backward", "wait"], log


def test_without_overlap_the_exchanges_are_synchronous(world1, monkeypatch):
    moe, spec = _moe(world1, overlap=False)
    log: list[str] = []
    _record(monkeypatch, moe, log)
    moe(torch.randn(1, 16, spec.hidden_size)).sum().backward()
    assert "start" not in log and "wait" not in log, log


def test_rows_are_sorted_while_the_counts_travel(world1, monkeypatch):
    """The count exchange starts before the rows' permutation (argsort, index_select) and is read after it."""
    moe, spec = _moe(world1, overlap=True)
    log: list[str] = []
    _record(monkeypatch, moe, log)
    real_argsort = torch.argsort
    monkeypatch.setattr(torch, "argsort", lambda *a, **k: log.append("argsort") or real_argsort(*a, **k))
    moe(torch.randn(1, 16, spec.hidden_size))
    assert log[:3] == ["counts start", "argsort", "counts wait"], log


def test_overlap_changes_nothing_in_the_result(world1):
    results = []
    for overlap in (True, False):
        moe, spec = _moe(world1, overlap)
        torch.manual_seed(1)
        x = torch.randn(2, 16, spec.hidden_size, requires_grad=True)
        y = moe(x)
        y.square().sum().backward()
        results.append((y.detach(), x.grad, [p.grad for p in moe.parameters()]))
    (y1, gx1, gp1), (y2, gx2, gp2) = results
    assert torch.equal(y1, y2) and torch.equal(gx1, gx2)
    assert all(torch.equal(a, b) for a, b in zip(gp1, gp2))


def test_the_exchange_handle_keeps_no_graph_alive(world1):
    """The graph of an overlapped layer is freed by reference counting (no cycle through the exchange handle):
    a forward whose output is dropped releases every saved tensor without the cycle collector. With a cycle,
    nodes backward never reaches keep their saved tensors until a collection (a pipeline stage's peak grew by
    a third: benchmarks/closed_loop.py, pp2 dp2 ep2 stage 0). gloo's worker thread may still hold an exchanged
    tensor for a moment after ``wait()`` returns (its Work is released when the thread finishes its bookkeeping;
    seen once under load in CI), so the saved bytes get up to 2 s to reach zero: a cycle, with the collector
    disabled, never does."""
    import gc
    import time

    from piper_plan.runtime.accounting import SavedTensorTracker

    moe, spec = _moe(world1, overlap=True)
    tracker = SavedTensorTracker(moe)
    gc.disable()
    try:
        with tracker.hooks():
            y = moe(torch.randn(1, 16, spec.hidden_size, requires_grad=True))
        assert tracker.live_bytes > 0
        del y
        deadline = time.monotonic() + 2.0
        while tracker.live_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tracker.live_bytes == 0
    finally:
        gc.enable()
