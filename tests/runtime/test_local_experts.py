"""The expert loop's backward: one gradient buffer per stacked weight, not one per expert."""

import torch

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
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(10, 8, requires_grad=True)
    out = experts(x, [3, 0, 5, 2])
    names = graph_node_names(out.grad_fn)
    assert "SelectBackward0" not in names
    assert names.count("UnbindBackward0") == 3          # w_in, w_gate, w_out


def test_unbound_experts_compute_what_per_expert_weights_compute():
    experts = LocalExperts(3, 8, FFNSpec(intermediate_size=16, gated=True, bias=True))
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(9, 8, requires_grad=True)
    counts = [4, 0, 5]
    out = experts(x, counts)
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
