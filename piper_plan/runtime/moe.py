"""The MoE block: router (top-k, softmax or sigmoid), routed experts split over an EP group, shared experts.

Legend: B batch, S sequence, D hidden, T = B x S tokens, k top-k, E experts, El = E / ep local experts,
F expert width, R = T x k rows this rank sends, X rows it receives. Routed experts live in slots:
EP group-rank j holds slots [j x El, (j + 1) x El) as stacked ``[El, ...]`` parameters; ``slot_of_expert`` maps
the router's logical expert to its slot (the identity until expert migration permutes it: runtime/migration.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from piper_plan.runtime.casts import Linear, compute_dtype, step_cast



ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
               "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}
"""FFNSpec.activation's functions (quick_gelu: Hendrycks & Gimpel's sigmoid approximation, as gpt-oss and
Megatron-Core's quick_gelu compute it)."""


def activate(ffn, up, gate=None):
    """An FFN's non-linearity: act(up) when plain; gated, act(gate) x (up + offset), gate clamped to at most c and
    up to [-c, c] first where the spec clamps (specs/model.py FFNSpec)."""
    act = ACTIVATIONS[ffn.activation_name]
    if gate is None:
        return act(up)
    c = ffn.activation_clamp
    if c is not None:
        gate, up = gate.clamp(max=c), up.clamp(-c, c)
    return act(gate) * (up + ffn.glu_linear_offset if ffn.glu_linear_offset else up)


def ffn_apply(ffn, x_ND, w_in, w_gate, w_out, b_in=None, b_gate=None, b_out=None):
    """Gated (act(x Wg) * (x Wi), SwiGLU by default) or plain (act(x Wi)) MLP, then W_out."""
    h = x_ND @ w_in + (b_in if b_in is not None else 0)
    g = None if w_gate is None else x_ND @ w_gate + (b_gate if b_gate is not None else 0)
    return activate(ffn, h, g) @ w_out + (b_out if b_out is not None else 0)


class FFN(nn.Module):
    """A dense MLP / shared expert: gated = gate, up, down (3 matrices); plain = up, down (2)."""

    def __init__(self, hidden: int, ffn) -> None:
        super().__init__()
        self.spec = ffn
        self.up = Linear(hidden, ffn.intermediate_size, bias=ffn.bias)
        self.gate = Linear(hidden, ffn.intermediate_size, bias=ffn.bias) if ffn.gated else None
        self.down = Linear(ffn.intermediate_size, hidden, bias=ffn.bias)

    def forward(self, x):
        return self.down(activate(self.spec, self.up(x), None if self.gate is None else self.gate(x)))


def grouped_mm_usable(x: torch.Tensor, *weights) -> bool:
    """Whether ``torch._grouped_mm`` can run [X, K] x [El, K, N] here: the op exists, works on this device
    and dtype (probed once), and every row stride is a multiple of 16 bytes (its alignment rule)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    size = x.element_size()
    if any(w.shape[-1] * size % 16 or w.shape[-2] * size % 16 for w in weights if w is not None):
        return False
    return _grouped_mm_works(x.device.type, x.dtype)


@functools.lru_cache(maxsize=None)
def _grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """One tiny forward + backward (some builds lack a kernel for a device or dtype, e.g. older ROCm), apart from
    the caller's autograd: with grad on whatever the caller's mode (a first call under no_grad cached False), and
    its saved tensors kept by hooks of its own (inside a checkpointed block's first forward they were counted
    there, and not in the recomputation, whose call the cache answers: every full-recompute MoE run crashed)."""
    try:
        with torch.inference_mode(False), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            a = torch.ones(8, 16, device=device_type, dtype=dtype, requires_grad=True)
            b = torch.ones(2, 16, 16, device=device_type, dtype=dtype, requires_grad=True)
            offs = torch.tensor([3, 8], dtype=torch.int32, device=device_type)
            _contiguous_grad(torch._grouped_mm(a, b, offs=offs)).sum().backward()
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _contiguous_grad(y: torch.Tensor) -> torch.Tensor:
    """_grouped_mm's backward fails on a zero-stride incoming gradient (``y.sum().backward()``): densify it."""
    if y.requires_grad:
        y.register_hook(lambda g: g.contiguous())
    return y


class LocalExperts(nn.Module):
    """El experts as stacked weights: w_in/w_gate [El, D, F], w_out [El, F, D] (+ biases [El, F] / [El, D]).

    Forward runs each weight as ONE grouped GEMM over all local experts (``torch._grouped_mm``, what the cost
    model prices and calibration measures), group offsets on the device (no host read); where the op is
    unavailable or the shapes unaligned, the per-expert loop (which needs the counts on the host)."""

    def __init__(self, num_local: int, hidden: int, ffn) -> None:
        super().__init__()
        self.spec = ffn
        f = ffn.intermediate_size
        self.w_in = nn.Parameter(torch.empty(num_local, hidden, f))
        self.w_gate = nn.Parameter(torch.empty(num_local, hidden, f)) if ffn.gated else None
        self.w_out = nn.Parameter(torch.empty(num_local, f, hidden))
        self.b_in = nn.Parameter(torch.zeros(num_local, f)) if ffn.bias else None
        self.b_gate = nn.Parameter(torch.zeros(num_local, f)) if ffn.bias and ffn.gated else None
        self.b_out = nn.Parameter(torch.zeros(num_local, hidden)) if ffn.bias else None
        self.use_grouped = True
        """Grouped GEMMs where usable (False: always the loop)."""

    @property
    def grouped(self) -> bool:
        """Whether forward runs grouped GEMMs (for fp32 inputs on this module's device)."""
        x = self.w_in[0, :1]
        return self.use_grouped and grouped_mm_usable(x, self.w_in, self.w_gate, self.w_out)

    def forward(self, x_XD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """x_XD rows grouped by local expert, ``counts_E[e]`` (int64 [El], on x's device) rows for expert e."""
        dtype = compute_dtype(x_XD)
        x_XD_cast = x_XD.to(dtype)
        if not (self.use_grouped and grouped_mm_usable(x_XD_cast, self.w_in, self.w_gate, self.w_out)):
            return self._loop(x_XD, counts_E.tolist())      # autocast casts each expert's weights, per use
        weights = [step_cast(p, dtype) for p in (self.w_in, self.w_gate, self.w_out, self.b_in, self.b_gate, self.b_out)]
        return self._grouped(x_XD_cast, counts_E, *weights)

    def _grouped(self, x_XD, counts_E, w_in, w_gate, w_out, b_in, b_gate, b_out):
        offs = torch.cumsum(counts_E, 0).to(torch.int32)
        expert_X = None
        if b_in is not None:                               # per-row biases: gathered by the row's expert
            expert_X = torch.repeat_interleave(torch.arange(self.w_in.shape[0], device=x_XD.device), counts_E,
                                               output_size=x_XD.shape[0])

        def mm(a, w, b):
            y = _contiguous_grad(torch._grouped_mm(a, w, offs=offs))
            return y if b is None else y + b[expert_X]

        h = activate(self.spec, mm(x_XD, w_in, b_in), None if w_gate is None else mm(x_XD, w_gate, b_gate))
        return mm(h, w_out, b_out)

    def _loop(self, x_XD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        per_expert = self._per_expert_weights()
        outs = [ffn_apply(self.spec, chunk, *(None if w is None else w[e] for w in per_expert))
                for e, chunk in enumerate(torch.split(x_XD, counts))]
        return torch.cat(outs) if outs else x_XD

    def _per_expert_weights(self) -> list:
        """Each stacked weight unbound once into El views. Its backward stacks the El gradients into one
        buffer; indexing ``w[e]`` per expert instead makes every expert's backward zero-fill and add a full
        [El, ...] gradient (El^2 x the expert weights in memory traffic per layer and micro-batch)."""
        return [None if p is None else p.unbind(0)
                for p in (self.w_in, self.w_gate, self.w_out, self.b_in, self.b_gate, self.b_out)]


def group_limited_scores(probs_TE: torch.Tensor, moe) -> torch.Tensor:
    """The scores a group-limited router picks its top_k from: those of each token's ``routing_group_top_k`` best
    expert groups, -inf elsewhere. A group ranks by the sum of its ``routing_group_score_top`` best scores (1: its
    best, DeepSeek-V2's group_limited_greedy; 2: DeepSeek-V3's noaux_tc; transformers models/deepseek_v2 and
    deepseek_v3 routers). The picked experts' weights are their own scores (gathered by the caller)."""
    T, E = probs_TE.shape
    grouped_TGe = probs_TE.view(T, moe.routing_groups, E // moe.routing_groups)
    group_score_TG = grouped_TGe.topk(moe.routing_group_score_top, dim=-1).values.sum(-1)
    best_Tg = group_score_TG.topk(moe.routing_group_top_k, dim=-1).indices
    keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, best_Tg, True)
    return grouped_TGe.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(T, E)


class AuxLossScaler(torch.autograd.Function):
    """Identity on the activations that injects d(aux)/d(aux) = 1 in backward (Megatron's MoEAuxLossAutoScaler),
    so a balance loss computed inside a pipeline stage reaches the router without travelling to the loss."""

    @staticmethod
    def forward(ctx, x, aux):
        ctx.save_for_backward(aux)
        return x

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


class MoE(nn.Module):
    """Router + routed experts (this rank's El of them) + shared experts (+ a parallel dense FFN)."""

    def __init__(self, hidden: int, moe, ep_rank: int = 0, ep_size: int = 1, ep_group=None, dispatcher=None,
                 aux_loss_coeff: float = 0.0, seq_mesh=None, overlap_shared: bool = True) -> None:
        """seq_mesh: the tp DeviceMesh under sequence parallelism (each rank routes its sequence shard; the
        balance loss is the one of the whole sequence), None without. overlap_shared: run the shared experts
        (and a parallel dense FFN) while the dispatch exchange is in flight (planfile.RuntimeBlock)."""
        super().__init__()
        self.seq_mesh, self.overlap_shared = seq_mesh, overlap_shared
        assert moe.num_experts % ep_size == 0, "ep must divide num_experts"
        self.spec, self.ep_size, self.ep_group, self.dispatcher = moe, ep_size, ep_group, dispatcher
        self.num_local = moe.num_experts // ep_size
        self.first_expert = ep_rank * self.num_local
        self.aux_loss_coeff = aux_loss_coeff
        self.router = Linear(hidden, moe.num_experts, bias=moe.router_bias)
        self.experts = LocalExperts(self.num_local, hidden, moe.expert)
        self.shared = nn.ModuleList(FFN(hidden, moe.shared) for _ in range(moe.num_shared_experts))
        self.shared_gate = Linear(hidden, 1, bias=False) if moe.shared_expert_gate else None
        self.parallel_dense = FFN(hidden, moe.parallel_dense_ffn) if moe.parallel_dense_ffn else None
        self.register_buffer("slot_of_expert", torch.arange(moe.num_experts, dtype=torch.int64))
        """Logical expert (router output) -> slot: slot s is local expert s % El of EP rank s // El.
        Identity at start; permuted by expert migration (runtime/migration.py); saved in checkpoints."""
        self.register_buffer("expert_tokens", torch.zeros(moe.num_experts, dtype=torch.int64), persistent=False)
        """Assignments routed to each (logical) expert since the last reset (this rank's tokens; on the device,
        read once per step; not in checkpoints)."""

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        weights_Tk, idx_Tk, probs_TE = self._route(x_TD)
        tokens_E = _counts(idx_Tk.reshape(-1), self.spec.num_experts)
        with torch.no_grad():
            self.expert_tokens += tokens_E
        out_TD, shared_TD = self._routed(x_TD, idx_Tk, weights_Tk, tokens_E)
        out_TD = out_TD + shared_TD
        if self.aux_loss_coeff and torch.is_grad_enabled():
            out_TD = AuxLossScaler.apply(out_TD, self.aux_loss_coeff * self._balance_loss(tokens_E, probs_TE))
        return out_TD.view_as(x_BSD)

    def _route(self, x_TD):
        """Top-k weights and indices of the softmax or sigmoid scores; renormalised to sum 1 when the spec says
        normalize_top_k (Mixtral, DeepSeek-V3), else the raw scores (Switch, Qwen2-MoE, Llama 4)."""
        logits_TE = self.router(x_TD).float()
        probs_TE = logits_TE.softmax(-1) if self.spec.scoring == "softmax" else logits_TE.sigmoid()
        if self.spec.routing_groups:
            idx = group_limited_scores(probs_TE, self.spec).topk(self.spec.top_k, dim=-1).indices
            top = probs_TE.gather(-1, idx)
        else:
            top, idx = probs_TE.topk(self.spec.top_k, dim=-1)
        if self.spec.normalize_top_k:
            top = top / top.sum(-1, keepdim=True)
        return top.to(x_TD.dtype), idx, probs_TE

    def _balance_loss(self, tokens_E, probs_TE):
        """Switch Transformer's auxiliary loss E x sum_e f_e P_e (Fedus et al. 2021, eq. 4), f over the k choices."""
        E, T, prob_sum_E = self.spec.num_experts, probs_TE.shape[0], probs_TE.sum(0)
        if self.seq_mesh is not None:  # sums over the whole sequence: a replicated loss, counted once
            from torch.distributed.tensor import DTensor, Partial

            tokens_E = DTensor.from_local(tokens_E, self.seq_mesh, [Partial()]).full_tensor()
            prob_sum_E = DTensor.from_local(prob_sum_E, self.seq_mesh, [Partial()]).full_tensor()
            T *= self.seq_mesh.size()
        frac_E = tokens_E.to(probs_TE.dtype) / (T * self.spec.top_k)
        return E * (frac_E * prob_sum_E / T).sum()

    def _shared(self, x_TD):
        out = 0
        for ffn in self.shared:
            out = out + ffn(x_TD)
        if self.shared_gate is not None and len(self.shared):
            out = torch.sigmoid(self.shared_gate(x_TD)) * out
        if self.parallel_dense is not None:
            out = out + self.parallel_dense(x_TD)
        return out

    def _routed(self, x_TD, idx_Tk, weights_Tk, tokens_E):
        """(routed experts' output, shared experts' output) [T, D] each; the shared ones computed while the
        dispatch exchange travels where ``overlap_shared``."""
        T, k = idx_Tk.shape
        counts_S = torch.empty_like(tokens_E).scatter_(0, self.slot_of_expert, tokens_E)  # rows per slot
        pending = None if self.dispatcher is None else \
            self.dispatcher.start_layout(counts_S.view(self.ep_size, self.num_local))  # travels while rows sort
        flat_R = self.slot_of_expert[idx_Tk.reshape(-1)]  # rows by slot (= by EP rank, then local expert)
        order_R = torch.argsort(flat_R, stable=True)
        x_RD = x_TD.index_select(0, order_R // k)
        if pending is None:
            y_RD, shared_TD = self.experts(x_RD, counts_S), self._shared(x_TD)
        else:  # bf16 rows under autocast
            y_RD, shared_TD = self._exchange_and_compute(x_RD.to(compute_dtype(x_RD)), pending, x_TD)
        y_TkD = y_RD.index_select(0, torch.argsort(order_R)).view(T, k, -1)
        return (y_TkD.to(weights_Tk.dtype) * weights_Tk.unsqueeze(-1)).sum(1), shared_TD

    def _exchange_and_compute(self, x_RD, pending_layout, x_TD):
        """Finish the count exchange (the one host read of the layer), send rows to their experts' ranks (the
        shared experts run meanwhile), run the local experts on rows regrouped by expert, send the results back."""
        layout = pending_layout.wait()
        if self.overlap_shared:
            pending = self.dispatcher.dispatch_async(x_RD, layout)
            shared_TD = self._shared(x_TD)
            x_XD = pending.wait()
        else:
            x_XD = self.dispatcher.dispatch(x_RD, layout)
        recv_pE = layout.recv_expert_counts_tensor.to(x_XD.device).view(self.ep_size, self.num_local)
        expert_X = torch.arange(self.num_local, device=x_XD.device).repeat(self.ep_size)
        expert_X = torch.repeat_interleave(expert_X, recv_pE.reshape(-1), output_size=x_XD.shape[0])
        perm_X = torch.argsort(expert_X, stable=True)
        y_XD = self.experts(x_XD.index_select(0, perm_X), recv_pE.sum(0))
        y_RD = self.dispatcher.combine(y_XD.index_select(0, torch.argsort(perm_X)), layout)
        return y_RD, (shared_TD if self.overlap_shared else self._shared(x_TD))


def _counts(index: torch.Tensor, size: int) -> torch.Tensor:
    """int64 [size]: occurrences of each value of ``index`` (bincount with a fixed output size: no host read)."""
    return torch.zeros(size, dtype=torch.int64, device=index.device).scatter_add_(0, index, torch.ones_like(index))
