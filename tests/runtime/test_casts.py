"""runtime/casts.py: one 16-bit copy per weight and step, one autograd node per use. torch.autocast's own weight
cache shares one cast node across micro-batches, and autograd then runs it last in every later micro-batch's
backward: these tests show that on torch's nn.Linear and check that the runtime's Linear does not."""

import pytest
import torch
from torch import nn

from piper_plan.runtime.casts import Linear, casts_once_per_step


def _two_micro_batches(first, second):
    """Events of two micro-batches' backward under bf16 autocast (one step: one autocast region, as Trainer runs it)
    and the weight gradients they leave."""
    events = []
    second.weight.register_post_accumulate_grad_hook(lambda p: events.append("second weight"))
    with torch.autocast("cpu", dtype=torch.bfloat16), casts_once_per_step():
        for _ in range(2):
            x = torch.randn(4, 8, requires_grad=True)
            x.register_hook(lambda g: events.append("first input"))
            second(first(x)).float().square().sum().backward()
    return events, [first.weight.grad.clone(), second.weight.grad.clone()]


def _layers(kind, seed=0):
    torch.manual_seed(seed)
    return kind(8, 8), kind(8, 8)


def test_autocasts_cached_cast_runs_last_in_later_micro_batches_and_the_runtimes_linear_does_not():
    torch.manual_seed(1)
    plain_events, plain_grads = _two_micro_batches(*_layers(nn.Linear))
    assert plain_events == ["second weight", "first input", "first input", "second weight"]
    torch.manual_seed(1)
    ours_events, ours_grads = _two_micro_batches(*_layers(Linear))
    assert ours_events == ["second weight", "first input"] * 2
    for ours, plain in zip(ours_grads, plain_grads):
        torch.testing.assert_close(ours, plain, rtol=0, atol=0)    # the same casts and products, in another order


@pytest.mark.parametrize("bias", [True, False])
def test_the_runtimes_linear_is_torchs_in_fp32(bias):
    ours, theirs = Linear(8, 4, bias=bias), nn.Linear(8, 4, bias=bias)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 8)
    with casts_once_per_step():
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
