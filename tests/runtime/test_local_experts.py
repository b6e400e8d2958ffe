"""Local experts: grouped GEMMs (torch._grouped_mm) equal the per-expert loop in forward and backward; the loop
is the fallback where the op is missing or the shapes unaligned; the loop's backward keeps one gradient buffer
per stacked weight, not one per expert."""

import pytest
import torch

from piper_plan.runtime import casts
from piper_plan.runtime import moe as moe_module
from piper_plan.runtime.moe import LocalExperts
from piper_plan.specs.model import FFNSpec


def graph_node_names(root) -> list[str]:
    seen, stack, names = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return names


def test_stacked_expert_weights_reach_their_parameters_through_one_unbind_each():
    """Indexing w[e] per expert gave every expert a SelectBackward, whose backward zero-fills a full [El, D, F]
    gradient: El^2 x the expert weights of memory traffic per layer and micro-batch (on CPU, tiny-moe's costliest
    operator: aten::fill_ 8.7 of 24.4 profiled ms per micro-batch, benchmarks/closed_loop_gap.py --profile).
    Unbound once, the El gradients are stacked into one buffer."""
    experts = LocalExperts(4, 8, FFNSpec(intermediate_size=16, gated=True))
    experts.use_grouped = False
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(10, 8, requires_grad=True)
    out = experts(x, torch.tensor([3, 0, 5, 2]))
    names = graph_node_names(out.grad_fn)
    assert "SelectBackward0" not in names
    assert names.count("UnbindBackward0") == 3          # w_in, w_gate, w_out


def test_unbound_experts_compute_what_per_expert_weights_compute():
    experts = LocalExperts(3, 8, FFNSpec(intermediate_size=16, gated=True, bias=True))
    experts.use_grouped = False
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(9, 8, requires_grad=True)
    counts = [4, 0, 5]
    out = experts(x, torch.tensor(counts))
    out.square().sum().backward()
    got = [p.grad.clone() for p in experts.parameters()]
    experts.zero_grad()
    ref = []
    for e, chunk in enumerate(torch.split(x.detach(), counts)):
        h = torch.nn.functional.silu(chunk @ experts.w_gate[e] + experts.b_gate[e]) * (chunk @ experts.w_in[e] + experts.b_in[e])
        ref.append(h @ experts.w_out[e] + experts.b_out[e])
    torch.cat(ref).square().sum().backward()
    assert torch.allclose(out, torch.cat(ref).detach())
    for g, p in zip(got, experts.parameters()):
        assert torch.allclose(g, p.grad)


def _run(experts, x, counts, grouped: bool):
    """Output, input gradient and parameter gradients of one forward + backward (``y.sum()``: the zero-stride
    incoming gradient that _grouped_mm's backward cannot take on its own)."""
    experts.use_grouped = grouped
    experts.zero_grad()
    xg = x.detach().clone().requires_grad_(True)
    out = experts(xg, torch.tensor(counts))
    (out.sum() + out.square().sum()).backward()
    return out.detach(), xg.grad, [p.grad.clone() for p in experts.parameters()]


@pytest.mark.parametrize("gated,bias", [(True, False), (True, True), (False, False), (False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemms_equal_the_per_expert_loop(gated, bias, dtype):
    experts = LocalExperts(4, 16, FFNSpec(intermediate_size=32, gated=gated, bias=bias)).to(dtype)
    torch.manual_seed(0)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    assert experts.grouped, "torch._grouped_mm runs on CPU in the pinned torch (reference/environment.md)"
    x = torch.randn(21, 16, dtype=dtype)
    counts = [7, 0, 9, 5]                               # an empty group; sizes not multiples of 16
    got, ref = _run(experts, x, counts, True), _run(experts, x, counts, False)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got[0], ref[0], **tol)
    torch.testing.assert_close(got[1], ref[1], **tol)
    for g, r in zip(got[2], ref[2]):
        torch.testing.assert_close(g, r, **tol)


def _spy_grouped(monkeypatch) -> list:
    """Count torch._grouped_mm calls; the one-off probe (cached per device and dtype, cleared by other tests) runs
    first, so it is never counted (it made the count 4 instead of 3 in whichever worker had no cached probe)."""
    moe_module._grouped_mm_works("cpu", torch.float32)
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_grouped_path_runs_the_grouped_op(monkeypatch):
    calls = _spy_grouped(monkeypatch)
    experts = LocalExperts(2, 16, FFNSpec(intermediate_size=32, gated=True))
    experts(torch.randn(5, 16), torch.tensor([2, 3]))
    assert len(calls) == 3                               # w_in, w_gate, w_out: one GEMM each for all experts


def test_unaligned_shapes_fall_back_to_the_loop(monkeypatch):
    """hidden 6 fp32 = 24-byte rows: not a multiple of 16 bytes, so the loop runs (and still computes)."""
    calls = _spy_grouped(monkeypatch)
    experts = LocalExperts(2, 6, FFNSpec(intermediate_size=32, gated=True))
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    assert not experts.grouped
    out = experts(torch.randn(5, 6), torch.tensor([2, 3]))
    assert out.shape == (5, 6) and not calls


def test_missing_op_falls_back_to_the_loop(monkeypatch):
    monkeypatch.delattr(torch, "_grouped_mm")
    experts = LocalExperts(2, 16, FFNSpec(intermediate_size=32, gated=True))
    assert not experts.grouped
    assert experts(torch.randn(5, 16), torch.tensor([2, 3])).shape == (5, 16)


def test_a_device_without_a_kernel_falls_back(monkeypatch):
    """The one-off probe turns a kernel that raises (an older ROCm build) into the loop."""
    def broken(*a, **k):
        raise RuntimeError("grouped gemm is not supported on this device")

    moe_module._grouped_mm_works.cache_clear()
    monkeypatch.setattr(torch, "_grouped_mm", broken)
    try:
        experts = LocalExperts(2, 16, FFNSpec(intermediate_size=32, gated=True))
        assert not experts.grouped
        assert experts(torch.randn(5, 16), torch.tensor([2, 3])).shape == (5, 16)
    finally:
        moe_module._grouped_mm_works.cache_clear()


GPT_OSS_GATE = {"activation": "quick_gelu", "glu_linear_offset": 1.0, "activation_clamp": 7.0}


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_gemms_equal_the_loop_under_gpt_oss_gate(bias):
    experts = LocalExperts(4, 16, FFNSpec(intermediate_size=32, bias=bias, **GPT_OSS_GATE))
    torch.manual_seed(0)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=2.0)               # wide enough that the clamp at 7 acts
    x = torch.randn(21, 16)
    got, ref = _run(experts, x, [7, 0, 9, 5], True), _run(experts, x, [7, 0, 9, 5], False)
    for g, r in zip([got[0], got[1], *got[2]], [ref[0], ref[1], *ref[2]]):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-4)


def test_gpt_oss_gate_by_hand():
    """gate 10 -> 7, x sigmoid(1.702 x 7) = 6.9999536; up -10 -> -7, + 1 = -6: -41.99972. gate -1, up 2:
    -sigmoid(-1.702) x 3 = -0.46261. SwiGLU of the same: silu(10) x -10 = -99.99546."""
    gate, up = torch.tensor([10.0, -1.0]), torch.tensor([-10.0, 2.0])
    got = moe_module.activate(FFNSpec(intermediate_size=2, **GPT_OSS_GATE), up, gate)
    torch.testing.assert_close(got, torch.tensor([-41.99972, -0.46261]), rtol=1e-5, atol=1e-5)
    swiglu = moe_module.activate(FFNSpec(intermediate_size=2), up, gate)
    torch.testing.assert_close(swiglu[0], torch.tensor(-99.99546), rtol=1e-6, atol=1e-4)


def _micro_batches(experts, xs, counts, cache: bool):
    """Forward + backward of each micro-batch under bf16 autocast, inside one casts_once_per_step region or not; the
    parameter gradients accumulated over them and the bf16 copies each forward used."""
    import contextlib

    experts.zero_grad()
    used, real = [], moe_module.step_cast
    region = casts.casts_once_per_step() if cache else contextlib.nullcontext()
    with torch.autocast("cpu", dtype=torch.bfloat16), region:
        for x in xs:
            moe_module.step_cast = lambda p, d: used.append(real(p, d)) or used[-1]
            try:
                out = experts(x, torch.tensor(counts))
            finally:
                moe_module.step_cast = real
            (out.float().square().sum()).backward()
    return [p.grad.clone() for p in experts.parameters()], used


def test_expert_weights_are_cast_once_per_step_and_the_gradients_are_unchanged():
    """On an H200 each micro-batch's cast of all local experts to bf16 took as long as their GEMMs
    (docs/gpu-check.md); inside casts_once_per_step the first micro-batch's copies serve the others, and every
    micro-batch's gradient still reaches the fp32 parameters, equal to casting afresh each time."""
    experts = LocalExperts(4, 16, FFNSpec(intermediate_size=32, gated=True, bias=True))
    torch.manual_seed(0)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    xs = [torch.randn(12, 16) for _ in range(3)]
    counts = [3, 0, 5, 4]
    fresh, fresh_used = _micro_batches(experts, xs, counts, cache=False)
    cached, cached_used = _micro_batches(experts, xs, counts, cache=True)
    for g, r in zip(cached, fresh):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    per_batch = len(list(experts.parameters()))
    storage = lambda used: {t.untyped_storage().data_ptr() for t in used}   # noqa: E731
    assert len(storage(fresh_used)) == 3 * per_batch        # a new copy of each weight per micro-batch
    assert len(storage(cached_used)) == per_batch           # one copy of each for the step
    assert all(t.dtype == torch.bfloat16 for t in cached_used)
    with torch.no_grad():
        experts.w_in.add_(1.0)                                   # changed in place: the next cast is new
    with torch.autocast("cpu", dtype=torch.bfloat16), casts.casts_once_per_step():
        first = moe_module.step_cast(experts.w_in, torch.bfloat16)
        with torch.no_grad():
            experts.w_in.mul_(2.0)
        again = moe_module.step_cast(experts.w_in, torch.bfloat16)
        assert again.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    assert casts._step_casts is None


def test_each_micro_batchs_weight_gradient_is_cast_where_its_layer_is_differentiated():
    """One cast node shared by all micro-batches (as torch.autocast's cache shares its casts) has the step's first
    sequence number: in every later micro-batch's backward autograd ran it last, after the other layers, and every
    layer's 16-bit weight gradient waited until then (on an H200: +2.06 GiB for two Mixtral layers, switch-base out
    of memory; docs/gpu-check.md). Two chained expert layers: the second's gradient must reach its parameter
    before the first layer's input gradient is computed, in the second micro-batch too."""
    spec = FFNSpec(intermediate_size=32, gated=True)
    first, second = LocalExperts(2, 16, spec), LocalExperts(2, 16, spec)
    for p in [*first.parameters(), *second.parameters()]:
        torch.nn.init.normal_(p, std=0.2)
    counts, events = torch.tensor([3, 5]), []
    second.w_in.register_post_accumulate_grad_hook(lambda p: events.append("second layer's w_in gradient"))
    with torch.autocast("cpu", dtype=torch.bfloat16), casts.casts_once_per_step():
        for micro_batch in range(2):
            x = torch.randn(8, 16, requires_grad=True)
            x.register_hook(lambda g: events.append("first layer's input gradient"))
            second(first(x, counts), counts).float().square().sum().backward()
    assert events == ["second layer's w_in gradient", "first layer's input gradient"] * 2, events
