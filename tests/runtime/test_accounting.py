"""The runtime's saved-tensor accounting returns to zero after each backward (no leaked activations)."""

import torch

from piper_plan.catalog import load_model
from piper_plan.runtime.accounting import SavedTensorTracker
from piper_plan.runtime.model import StageModel, init_stage, shrink_spec
from piper_plan.runtime.pipeline import lm_loss


def test_saved_tensors_are_released_after_backward_without_balance_loss():
    spec = shrink_spec(load_model("tiny-moe"))
    module = StageModel(spec, 0, spec.num_layers, {"aux_loss_coeff": 0.0})  # router probabilities unused
    init_stage(module, 0)
    tracker = SavedTensorTracker(module)
    x = torch.randint(0, spec.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    peaks = []
    for _ in range(3):
        with tracker.hooks():
            loss = lm_loss(module(x[:, :-1]), x[:, 1:])
        loss.backward()
        del loss
        peaks.append(tracker.peak_bytes)
        assert tracker.live_bytes == 0
        tracker.reset_peak()
    assert peaks[0] > 0 and peaks[0] == peaks[1] == peaks[2]


def test_an_output_saved_by_its_own_op_is_released_when_dropped():
    """exp() saves its output; a graph that backward never reaches must still be freed once dropped."""
    import gc

    tracker = SavedTensorTracker(torch.nn.Linear(1, 1))
    x = torch.randn(1000, requires_grad=True)
    with tracker.hooks():
        unused = x.exp()
    assert tracker.live_bytes == 4000
    del unused
    gc.collect()
    assert tracker.live_bytes == 0
