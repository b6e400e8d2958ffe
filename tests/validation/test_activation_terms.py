"""Analytic equals real (DESIGN.md tier 4): with ``CostOptions(unfused_kernels=True)`` the resource model's
activation bytes per pipeline stage equal what piper's runtime saves for backward (autograd saved-tensor hooks,
runtime/accounting.py), term by term: unfused RMSNorm (input, normalised, rstd),
GQA k/v unexpanded (SDPA enable_gqa; expanded where the core masks explicitly: sinks, sliding windows),
RoPE cos/sin tables, SwiGLU's silu(gate), one combine buffer, router ids, the loss's fp32 log-softmax; the sink
path's [s, s + 1] softmax and the masks; selective recompute dropping the core."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from piper_plan.catalog import load_model, load_platform  # noqa: E402
from piper_plan.cost.evaluate import estimate  # noqa: E402
from piper_plan.cost.options import CostOptions  # noqa: E402
from piper_plan.specs import ParallelPlan, TrainingSpec  # noqa: E402


def _saved_bytes(model, seq: int, mbs: int, first: int, layers: int, recompute: str = "none") -> int:
    from piper_plan.runtime.accounting import SavedTensorTracker
    from piper_plan.runtime.model import StageModel, init_stage
    from piper_plan.runtime.pipeline import lm_loss

    torch.manual_seed(0)
    torch.set_num_threads(1)
    module = StageModel(model, first, layers, {}, recompute)
    init_stage(module, 0)
    tracker = SavedTensorTracker(module)
    tokens = torch.randint(0, model.vocab_size, (mbs, seq + 1))
    x = tokens[:, :-1] if first == 0 else torch.randn(mbs, seq, model.hidden_size, requires_grad=True)
    with tracker.hooks():
        out = module(x)
        loss = lm_loss(out, tokens[:, 1:]) if module.is_last else out.sum()
    peak = tracker.peak_bytes
    loss.backward()
    return peak


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-moe-plain", "tiny-dense"])
@pytest.mark.parametrize("seq,mbs,pp", [(128, 1, 1), (64, 2, 2)])
def test_stage_activations_equal_runtime_saved_bytes(name, seq, mbs, pp):
    model = load_model(name)
    training = TrainingSpec(seq_len=seq, global_batch=mbs, dtype="fp32", weight_bytes=4, grad_bytes=4, master_bytes=0)
    plan = ParallelPlan(pp=pp, mbs=mbs, num_microbatches=1, schedule="gpipe")
    est = estimate(model, load_platform("local-cpu"), training, 1, plan, options=CostOptions(unfused_kernels=True))
    layers = plan.stage_layers(model.num_layers)
    for stage in range(pp):
        comps = est.memory.per_stage[stage].components
        predicted = sum(v for k, v in comps.items() if k.startswith("activations/"))
        measured = _saved_bytes(model, seq, mbs, sum(layers[:stage]), layers[stage])
        # exact but for a few scalars (the loss, rstd of a [1]-shaped reduction): < 0.1%
        assert predicted == pytest.approx(measured, rel=1e-3), (name, stage, predicted, measured)


def _attention_variant(**attention):
    model = load_model("tiny-moe")
    data = model.model_dump()
    data["attention"].update(attention)
    return type(model).model_validate(data)


@pytest.mark.parametrize("attention", [{"sinks": True}, {"sliding_window": 16, "sliding_window_every": 2},
                                       {"sliding_window": 16, "sliding_window_every": 2, "sinks": True}],
                         ids=["sinks", "window", "window_sinks"])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_masked_attention_cores_equal_runtime_saved_bytes(attention, recompute):
    """Where the runtime masks explicitly it keeps more than SDPA's log-sum-exp: K and V repeated per head and the
    mask, and on the sink path the [s, s + 1] softmax (s^2: 4x the bytes at twice the sequence); selective
    recompute drops all of it with the core. A window as long as the sequence masks nothing extra."""
    model = _attention_variant(**attention)
    for seq in (64, 128):
        training = TrainingSpec(seq_len=seq, global_batch=1, dtype="fp32", weight_bytes=4, grad_bytes=4,
                                master_bytes=0)
        plan = ParallelPlan(mbs=1, num_microbatches=1, recompute=recompute)
        est = estimate(model, load_platform("local-cpu"), training, 1, plan, options=CostOptions(unfused_kernels=True))
        predicted = sum(v for k, v in est.memory.per_stage[0].components.items()     # saved, not rebuilt in backward
                        if k.startswith("activations/") and k != "activations/recompute_working")
        assert predicted == pytest.approx(_saved_bytes(model, seq, 1, 0, model.num_layers, recompute), rel=1e-3)
    long_window = _attention_variant(sliding_window=128)
    plain = [estimate(m, load_platform("local-cpu"), training, 1, plan, options=CostOptions(unfused_kernels=True))
             .memory.per_stage[0].components["activations/attention"] for m in (long_window, load_model("tiny-moe"))]
    assert plain[0] == plain[1]


def test_fused_default_is_unchanged_and_smaller():
    """The default (Megatron's fused kernels, Korthikanti et al. 2022) keeps fewer bytes than piper's runtime."""
    model = load_model("tiny-moe")
    training = TrainingSpec(seq_len=128, global_batch=1, dtype="fp32", weight_bytes=4, grad_bytes=4, master_bytes=0)
    plan = ParallelPlan(mbs=1, num_microbatches=1)
    acts = []
    for opts in (CostOptions(), CostOptions(unfused_kernels=True)):
        comps = estimate(model, load_platform("local-cpu"), training, 1, plan, options=opts).memory.per_stage[0]
        acts.append(sum(v for k, v in comps.components.items() if k.startswith("activations/")))
    # per layer, fused: attention 165,888 + MoE 664,576 B; 4 layers + the embedding's int64 token ids 1,024 (128 x 8
    # B; its output is layer 0's norm input, counted there) + logits 262,144 (hand count: 128 tokens x 512
    # vocabulary x the loss's 4-byte fp32 softmax)
    assert acts[0] == pytest.approx(4 * (165_888 + 65_536 + 9_216 + 131_072 + 458_752) + 1_024 + 262_144)
    assert acts[1] > acts[0]


def test_megatron_core_permutation_keeps_no_token_rows():
    """moe_saved_rows=0 (Megatron-Core >= v0.13) drops exactly the default's two [k s x h] buffers per MoE layer."""
    model = load_model("tiny-moe")
    training = TrainingSpec(seq_len=128, global_batch=1, dtype="fp32", weight_bytes=4, grad_bytes=4, master_bytes=0)
    plan = ParallelPlan(mbs=1, num_microbatches=1)
    buffers = []
    for opts in (CostOptions(), CostOptions(moe_saved_rows=0), CostOptions(unfused_kernels=True)):
        comps = estimate(model, load_platform("local-cpu"), training, 1, plan, options=opts).memory.per_stage[0]
        buffers.append(comps.components["activations/moe/buffers"])
    rows = 128 * model.moe.top_k * model.hidden_size * 4 * model.num_moe_layers   # k s x h fp32, every MoE layer
    assert buffers == [2 * rows, 0.0, rows]


def test_token_rows_are_streamed_whether_or_not_they_are_saved():
    """The dispatch permutation and the combine write and read their [k s x h] rows in every case: moe_saved_rows
    changes the memory, not the elementwise time (before this, 0 also dropped the rows' traffic)."""
    model = load_model("tiny-moe")
    training = TrainingSpec(seq_len=128, global_batch=1)
    plan = ParallelPlan(mbs=1, num_microbatches=1)
    seconds = [estimate(model, load_platform("dgx-h100"), training, 1, plan, options=opts).time.breakdown[
        "compute/elementwise"] for opts in (CostOptions(), CostOptions(moe_saved_rows=0))]
    assert seconds[1] == pytest.approx(seconds[0]) and seconds[0] > 0
