"""Host synchronisations per MoE layer and micro-batch (counted on CPU: tests/runtime/host_syncs.py).

The count exchange needs its counts on the host (all_to_all_single takes its split sizes as Python ints): one
device-to-host read per MoE layer and micro-batch in forward, none in backward, nothing else data-dependent.
One process, a world-1 gloo group (HashStore): the exchange path runs without spawning ranks.
"""

from __future__ import annotations

import pytest
import torch

from host_syncs import HostSyncCounter, count_moe_layer
from piper_plan.catalog import load_model

FORWARD_SYNCS = 1
"""Per MoE layer and micro-batch with an EP dispatcher: the single read of the exchanged counts."""


def _moe(dispatcher, group=None):
    from piper_plan.runtime.moe import MoE

    torch.manual_seed(0)
    spec = load_model("tiny-moe")
    return MoE(spec.hidden_size, spec.moe, 0, 1, group, dispatcher), spec


def _count(moe, spec):
    return count_moe_layer(moe, spec.hidden_size)


def test_flat_dispatch_syncs_once_per_layer_and_microbatch(world1):
    from piper_plan.runtime.dispatch import FlatDispatcher

    moe, spec = _moe(FlatDispatcher(world1), world1)
    _count(moe, spec)                                   # warm-up
    fwd, bwd = _count(moe, spec)
    assert (fwd.total, bwd.total) == (FORWARD_SYNCS, 0), (dict(fwd.counts), dict(bwd.counts))


def test_local_experts_never_sync():
    """ep = 1 with grouped GEMMs: the group offsets stay on the device."""
    moe, spec = _moe(None)
    fwd, bwd = _count(moe, spec)
    if not moe.experts.grouped:
        pytest.skip("torch._grouped_mm unavailable: the per-expert loop needs the counts on the host")
    assert (fwd.total, bwd.total) == (0, 0), (dict(fwd.counts), dict(bwd.counts))


def test_counter_sees_item_tolist_and_masks():
    """The recorder can fail: each kind of host read is counted."""
    t = torch.arange(6)
    with HostSyncCounter() as c:
        t.sum().item()
        t.tolist()
        t[t > 2]
        torch.repeat_interleave(t[:3], t[:3])
        torch.repeat_interleave(t[:3], t[:3], output_size=3)
    assert c.counts["_local_scalar_dense"] == 1 and c.counts["Tensor.tolist"] == 1
    assert c.counts["index"] == 1 and c.counts["repeat_interleave"] == 1, dict(c.counts)


def test_halo_dispatch_syncs_once_per_layer_and_microbatch(world1):
    from piper_plan.runtime.halo import HaloDispatcher
    from piper_plan.runtime.topology import RankTopology

    halo = HaloDispatcher([0], RankTopology((0,), (0,), (0,)), 0, world1, (None, None))
    moe, spec = _moe(halo, world1)
    _count(moe, spec)
    fwd, bwd = _count(moe, spec)
    assert (fwd.total, bwd.total) == (FORWARD_SYNCS, 0), (dict(fwd.counts), dict(bwd.counts))


def test_a2a_timer_measures_without_synchronising_the_device(world1, monkeypatch):
    """The exchange timer never calls a device-wide barrier (CUDA events on GPUs, the wall clock on CPU),
    and time_s.a2a still counts every exchange: the layout's (start and wait), dispatch (start and wait),
    combine and their backward (the dispatch's reverse: start and wait)."""
    from piper_plan.runtime.dispatch import FlatDispatcher

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("device synchronised in the a2a path"))
    calls = []
    timer_run = FlatDispatcher(world1).timer.run.__func__

    def counted(self, fn, *args, device=None):
        calls.append(1)
        return timer_run(self, fn, *args, device=device)

    monkeypatch.setattr("piper_plan.runtime.dispatch.CommTimer.run", counted)
    dispatcher = FlatDispatcher(world1)
    moe, spec = _moe(dispatcher, world1)
    _count(moe, spec)
    assert len(calls) == 8 and dispatcher.timer.seconds > 0
    dispatcher.timer.reset()
    assert dispatcher.timer.seconds == 0.0


def test_dispatched_tokens_travel_in_the_autocast_dtype(world1, monkeypatch):
    """Under bf16 autocast the dispatched rows are 2 bytes per element, the planner's activation_bytes for bf16
    (TrainingSpec.activation_bytes): rows x hidden x 2 per exchange, out and back."""
    import torch.distributed as dist

    from piper_plan.runtime.dispatch import FlatDispatcher
    from piper_plan.specs import TrainingSpec

    sent = []
    real = dist.all_to_all_single

    def spy(out, inp, *args, **kwargs):
        if inp.is_floating_point():
            sent.append((inp.shape[0], inp.numel() * inp.element_size()))
        return real(out, inp, *args, **kwargs)

    monkeypatch.setattr(dist, "all_to_all_single", spy)
    moe, spec = _moe(FlatDispatcher(world1), world1)
    tokens = 32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moe(torch.randn(1, tokens, spec.hidden_size))
    rows = tokens * spec.moe.top_k
    per_elem = TrainingSpec(dtype="bf16").activation_bytes
    assert sent == [(rows, rows * spec.hidden_size * per_elem)] * 2      # dispatch and combine
