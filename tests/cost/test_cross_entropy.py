"""The LM loss's saved bytes per logit by kernel (CostOptions.cross_entropy_fusion_impl): Megatron-Core's native
cross entropy keeps an fp32 softmax, Transformer Engine's overwrites the bf16 logits with their gradient."""

from __future__ import annotations

import pytest

from piper_plan.catalog import load_model, load_platform
from piper_plan.cost.evaluate import estimate
from piper_plan.cost.options import PIPER_RUNTIME_OPTIONS, CostOptions
from piper_plan.errors import PiperError
from piper_plan.specs import ParallelPlan, TrainingSpec

MODEL = load_model("tiny-mla")
H100 = load_platform("dgx-h100")
TRAINING = TrainingSpec(seq_len=32, global_batch=2)
PLAN = ParallelPlan(mbs=2, num_microbatches=1)


def _stage(options):
    est = estimate(MODEL, H100, TRAINING, 1, PLAN, options=options)
    return est.memory.per_stage[-1].components, est.step_time_s


def test_te_loss_keeps_the_bf16_logits_not_an_fp32_softmax():
    """2 sequences x 32 tokens x vocab x (4 - 2) B less on the last stage; the step time is the same."""
    native, t_native = _stage(CostOptions())
    te, t_te = _stage(CostOptions(cross_entropy_fusion_impl="te"))
    saved = 2 * 32 * MODEL.vocab_size * (4 - 2)
    assert native["activations/logits"] - te["activations/logits"] == pytest.approx(saved)
    assert t_te == t_native


def test_piper_runtime_keeps_its_own_loss_whatever_the_option():
    runtime, _ = _stage(PIPER_RUNTIME_OPTIONS)
    flagged, _ = _stage(CostOptions(**{**PIPER_RUNTIME_OPTIONS.__dict__, "cross_entropy_fusion_impl": "te"}))
    assert flagged["activations/logits"] == runtime["activations/logits"]


def test_unknown_impl_is_one_error_line():
    with pytest.raises(PiperError, match=r"cross_entropy_fusion_impl names 'fused'; allowed: native, te"):
        CostOptions(cross_entropy_fusion_impl="fused")
