"""The chunked LM loss (runtime/pipeline.py ChunkedLoss) on one in-process rank: the same loss and gradients as the
whole-logits loss (fp32), and no fp32 logits tensor larger than one chunk, forward or backward. The tp2 (untied and
tied heads) and tp2 x pp2 x zero 3 cases run in tests/runtime/test_tensor_parallel.py's spawns."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from piper_plan.planfile import parse_plan_dict
from piper_plan.runtime.pipeline import ChunkedLoss, lm_loss
from plans import plan_dict

SEQ, MBS, MICRO = 32, 2, 2
VOCAB, HIDDEN = 512, 64  # tiny-moe
CHUNK_ROWS = 24  # 12 positions x 2 sequences: chunks of 12, 12 and 8 positions (the last one short)


def _trainer(chunk_rows):
    from piper_plan.runtime.train import Trainer

    plan = plan_dict(pp=1, dp=1, ep=1, num_microbatches=MICRO, mbs=MBS, seq_len=SEQ)
    plan["runtime"]["loss_chunk_rows"] = chunk_rows
    return Trainer(parse_plan_dict(plan, "test plan"), 0, 1, torch.device("cpu"))


class _LargestLogits(TorchDispatchMode):
    """The most elements of any fp32 logits-like tensor an op produced: [..., V], not the head weight's [D, V]
    transpose."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() and t.shape[-1] == VOCAB \
                    and tuple(t.shape) != (HIDDEN, VOCAB):
                self.numel = max(self.numel, t.numel())
        return out


def _run(trainer):
    mode = _LargestLogits()
    with mode:
        losses = trainer.forward_backward(0)
    return losses, {n: q.grad.clone() for n, q in trainer.module.named_parameters()}, mode.numel


def test_chunked_loss_equals_whole_logits_and_holds_one_chunk(world1):
    whole_losses, whole_grads, whole_numel = _run(_trainer(None))
    trainer = _trainer(CHUNK_ROWS)
    assert isinstance(trainer.loss_fn, ChunkedLoss) and trainer.module.return_hidden
    losses, grads, numel = _run(trainer)
    torch.testing.assert_close(torch.stack(losses), torch.stack(whole_losses), rtol=1e-6, atol=0)
    assert grads.keys() == whole_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, whole_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert whole_numel == MBS * SEQ * VOCAB  # the test sees the whole micro-batch's logits where they exist
    assert numel == CHUNK_ROWS * VOCAB       # chunked: one chunk's, forward and backward


def test_short_micro_batches_keep_the_whole_logits_loss(world1):
    assert _trainer(MBS * SEQ).loss_fn is lm_loss  # rows <= chunk rows: one chunk, no recomputation


def test_chunk_rows_must_be_positive():
    plan = plan_dict(pp=1, dp=1, ep=1)
    plan["runtime"]["loss_chunk_rows"] = 0
    with pytest.raises(Exception, match="loss_chunk_rows"):
        parse_plan_dict(plan, "test plan")


def test_the_chunks_share_one_16_bit_head_weight_per_micro_batch(world1, monkeypatch):
    """Under 16-bit autocast each loss chunk took its own use of the head's step copy: each chunk's bf16 [V, D]
    gradient was cast to fp32 and added in fp32 (chunks x the copies the cost model prices). Taken once per
    micro-batch (StageModel.head_weight), the chunked loss makes as many weight-gradient casts as the whole-logits
    one, and the gradients agree."""
    from piper_plan.runtime import casts
    from piper_plan.runtime.train import Trainer

    monkeypatch.setattr(Trainer, "_autocast", lambda self: torch.autocast("cpu", dtype=torch.bfloat16))
    real, calls = casts._FromStepCopy.backward, []
    monkeypatch.setattr(casts._FromStepCopy, "backward", staticmethod(lambda ctx, g: calls.append(1) or real(ctx, g)))
    counts, grads = [], []
    for chunk_rows in (None, CHUNK_ROWS):
        calls.clear()
        trainer = _trainer(chunk_rows)
        torch.manual_seed(0)
        trainer.forward_backward(0)
        counts.append(len(calls))
        grads.append({n: q.grad.clone() for n, q in trainer.module.named_parameters()})
    assert counts[0] == counts[1] > 0, counts
    torch.testing.assert_close(grads[1]["lm_head.weight"], grads[0]["lm_head.weight"], rtol=2e-2, atol=2e-3)
