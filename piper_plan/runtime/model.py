"""A decoder-only (MoE) transformer built from a ModelSpec, one pipeline stage (or model chunk) at a time.

Legend: B batch, S sequence, D hidden, H query heads, G key/value heads, hd head width, V vocabulary,
r rope width, n nope width, dv value width (MLA).
Parameter shapes follow the Hugging Face reference modules so that numel sums equal
``piper_plan.specs.params.count_params`` component by component (tests/runtime/test_model_breadth.py checks
every catalog model). Initialisation is a function of (seed, global layer, expert) only, so any split over
pp / ep / virtual stages builds exactly the weights of the single-process model (std 0.02, output projections
0.02 / sqrt(2 L): GPT-2 / Megatron's scheme).

What each spec feature builds (reference module in brackets):
- attention gqa / mha [LlamaAttention]; mla [DeepseekV3Attention: q_a -> RMSNorm -> q_b (or a full-rank q),
  kv_a_with_mqa -> RMSNorm -> kv_b, a rope part shared by all heads, v_head_dim values, scale 1/sqrt(n + r)].
  RoPE is the half-split layout with theta = 10000 (the spec carries no rope_theta; DeepSeek's interleaved
  layout is a fixed permutation of q_b / kv_a columns, so the function class is the same).
- qk_norm per_head [Qwen3: RMSNorm(hd) on q and k before RoPE]; full [OLMoE: RMSNorm(H hd) / RMSNorm(G hd)
  before RoPE]; weightless [Llama 4's L2Norm: RMS normalisation without weight, after RoPE].
- sinks [gpt-oss: one learned logit per head joins the softmax denominator and is dropped from the output].
- sliding_window [gpt-oss layer_types "sliding_attention": a causal mask over the window's keys, itself and the
  window - 1 before it (transformers' sliding_window_causal_mask_function), in the layers AttentionSpec.window_of
  picks, from the global layer index, so every pp / virtual-stage split windows the same layers].
- norm.per_layer 2: pre-norm x + A(n1 x), then x + M(n2 x). 3 [Arctic, modeling_arctic.py with
  parallel_attn_mlp_res]: h = x + A(n1 x); out = h + R(n3 h) + MoE(n2 x) (the MoE reads the pre-attention
  input; n2 h when parallel_attn_mlp is false). 4 [Grok-1 model.py DecoderLayer]: h = x + n3(A(n1 x));
  out = h + n4(M(n2 h)) (sandwich norms).
- parallel_attn_mlp with 2 or 4 norms [GPT-NeoX use_parallel_residual]: out = x + A(n1 x) + M(n2 x).
- moe.parallel_dense_ffn is the Block's ``residual_mlp`` R (built here, beside the MoE, so that Arctic's
  different input can reach it); with 2 or 4 norms it reads the MoE's input and adds to its output.
Recompute (torch.utils.checkpoint, non-reentrant): full = each whole layer, selective = the attention core
(softmax(q k^T) v, Megatron-LM's selective recomputation, Korthikanti et al. 2022).
Multi-token prediction (mtp_layers > 0) [DeepSeek-V3 report sec. 2.2; Megatron-Core multi_token_prediction.py]:
module k (``mtp.<num_layers + k>``, as the Hugging Face DeepSeek-V3 checkpoint names it ``layers.61``) on the last
stage: eh_proj([hnorm(h); enorm(Emb(tokens shifted by k + 1))]) (2d -> d, no bias), one Block shaped like the
model's last layer, its own final norm; h is the main model's final (normed) hidden state for k = 0, module
k - 1's output after. The embedding and LM head are the main model's: at pp > 1 the last stage holds a copy of
the embedding under the same name (``embed``), initialised alike and its gradient summed with the first stage's
(train.py), as Megatron-Core keeps it. The loss over the modules is runtime/pipeline.py MTPLoss.
"""

from __future__ import annotations

import contextlib
import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

from piper_plan.errors import PiperError
from piper_plan.runtime.casts import Linear, compute_dtype, step_cast
from piper_plan.runtime.moe import FFN, MoE
from piper_plan.runtime.tensor_parallel import local_tensor
from piper_plan.specs.vocab import Recompute

RECOMPUTE = Recompute.values()
NORM_EPS = 1e-5


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm, its weight cast to the input's dtype where they differ (16-bit activations under autocast,
    fp32 weights): torch runs rms_norm's fused kernel only when the two match, else a chain of elementwise kernels
    (torch 2.11 on an H200: "Mismatch dtype between input and weight ... Cannot dispatch to fused implementation",
    docs/gpu-check.md). Megatron-Core's norms take 16-bit weights too. Unchanged in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight is not None and weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


def make_norm(norm, width: int) -> nn.Module:
    if norm.kind == "rmsnorm":
        return RMSNorm(width, eps=NORM_EPS)
    return nn.LayerNorm(width, eps=NORM_EPS, bias=norm.bias)


def rotary(x_BHSd: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021), half-split layout as in Llama / Mixtral."""
    S, hd = x_BHSd.shape[-2], x_BHSd.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, device=x_BHSd.device, dtype=torch.float32) / hd)
    ang_Sh = torch.arange(S, device=x_BHSd.device, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang_Sh.cos().repeat(1, 2).to(x_BHSd.dtype), ang_Sh.sin().repeat(1, 2).to(x_BHSd.dtype)
    x1, x2 = x_BHSd[..., : hd // 2], x_BHSd[..., hd // 2:]
    return x_BHSd * cos + torch.cat((-x2, x1), -1) * sin


def causal_window_mask(S: int, window: int, device) -> torch.Tensor:
    """[S, S] bool, True where query i may attend key j: j <= i and j > i - window (itself and the window - 1 keys
    before it; transformers' sliding_window_causal_mask_function, masking_utils.py)."""
    offset_SS = torch.arange(S, device=device)[:, None] - torch.arange(S, device=device)[None, :]
    return (offset_SS >= 0) & (offset_SS < window)


def attention_core(q_BHSd, k_BGSd, v_BGSe, sinks_H=None, window: int | None = None):
    """Causal softmax(q k^T / sqrt(d)) v; G key/value heads serve H / G query heads each (GQA: SDPA's
    ``enable_gqa``, no expanded copy of K and V, where no mask is needed). With sinks (gpt-oss) each head's
    softmax also normalises over one learned logit that carries no value. ``window``: each query attends to itself
    and the window - 1 keys before it (sliding-window layers); None or >= S = every earlier key. Returns
    [B, H, S, e]."""
    H, G, S = q_BHSd.shape[1], k_BGSd.shape[1], q_BHSd.shape[-2]
    allowed_SS = causal_window_mask(S, window, q_BHSd.device) if window is not None and window < S else None
    if sinks_H is None and allowed_SS is None:
        return F.scaled_dot_product_attention(q_BHSd, k_BGSd, v_BGSe, is_causal=True, enable_gqa=G != H)
    # K and V repeated per query head: SDPA's enable_gqa with a mask runs only in its math backend, which holds
    # every S x S score (its memory-efficient kernel takes the mask but not the grouped heads)
    k_BHSd, v_BHSe = (t.repeat_interleave(H // G, dim=1) if G != H else t for t in (k_BGSd, v_BGSe))
    if sinks_H is None:
        return F.scaled_dot_product_attention(q_BHSd, k_BHSd, v_BHSe, attn_mask=allowed_SS)
    scores = (q_BHSd @ k_BHSd.transpose(-1, -2)) / math.sqrt(q_BHSd.shape[-1])
    if allowed_SS is None:
        allowed_SS = causal_window_mask(S, S, scores.device)
    scores = scores.masked_fill(~allowed_SS, float("-inf"))
    sink = sinks_H.to(scores.dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, S, 1)
    probs = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
    return probs @ v_BHSe


class _Core(nn.Module):
    """The attention core, checkpointed under selective recompute; ``window`` as attention_core's."""

    def __init__(self, recompute: bool, window: int | None = None) -> None:
        super().__init__()
        self.recompute, self.window = recompute, window

    def forward(self, q, k, v, sinks=None):
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(attention_core, q, k, v, sinks, self.window, use_reentrant=False)
        return attention_core(q, k, v, sinks, self.window)


class Attention(nn.Module):
    """MHA / GQA with RoPE and a causal mask (sliding over ``window`` keys where set); optional q/k/v/o biases,
    qk-norm and sinks."""

    def __init__(self, spec, selective: bool = False, window: int | None = None) -> None:
        super().__init__()
        a, d, hd = spec.attention, spec.hidden_size, spec.head_dim
        self.h, self.g, self.hd, self.qk_norm = a.num_heads, a.kv_heads, hd, a.qk_norm
        self.q = Linear(d, self.h * hd, bias=a.qkv_bias)
        self.k = Linear(d, self.g * hd, bias=a.qkv_bias)
        self.v = Linear(d, self.g * hd, bias=a.qkv_bias)
        self.o = Linear(self.h * hd, d, bias=a.o_bias)
        self.q_norm, self.k_norm = self._qk_norms(spec)
        self.sinks = nn.Parameter(torch.zeros(self.h)) if a.sinks else None
        self.core = _Core(selective, window)

    def _qk_norms(self, spec):
        kind = spec.attention.qk_norm
        if kind == "per_head":
            return RMSNorm(self.hd, eps=NORM_EPS), RMSNorm(self.hd, eps=NORM_EPS)
        if kind == "full":
            return RMSNorm(self.h * self.hd, eps=NORM_EPS), RMSNorm(self.g * self.hd, eps=NORM_EPS)
        if kind == "weightless":
            return (RMSNorm(self.hd, eps=NORM_EPS, elementwise_affine=False),
                    RMSNorm(self.hd, eps=NORM_EPS, elementwise_affine=False))
        return None, None

    def _heads(self, x_BSD):
        B, S, _ = x_BSD.shape
        q, k, v = self.q(x_BSD), self.k(x_BSD), self.v(x_BSD)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, S, -1, self.hd).transpose(1, 2)      # -1: this rank's heads (tensor_parallel.py)
        k = k.view(B, S, -1, self.hd).transpose(1, 2)
        v = v.view(B, S, -1, self.hd).transpose(1, 2)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q), rotary(k)
        if self.qk_norm == "weightless":
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x_BSD):
        B, S, _ = x_BSD.shape
        q, k, v = self._heads(x_BSD)
        sinks = None if self.sinks is None else local_tensor(self.sinks)  # this rank's heads' sinks
        y = self.core(q, k, v, sinks)
        return self.o(y.transpose(1, 2).reshape(B, S, -1))


class MLAttention(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention (training form: K and V decompressed per head)."""

    def __init__(self, spec, selective: bool = False, window: int | None = None) -> None:
        super().__init__()
        a, d = spec.attention, spec.hidden_size
        self.h, self.n, self.r, self.dv, self.c = (a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim,
                                                   a.v_head_dim, a.kv_lora_rank)
        qk = self.n + self.r
        if a.q_lora_rank is None:
            self.q = Linear(d, self.h * qk, bias=False)
        else:
            self.q_a = Linear(d, a.q_lora_rank, bias=a.qkv_bias)
            self.q_a_norm = RMSNorm(a.q_lora_rank, eps=NORM_EPS)
            self.q_b = Linear(a.q_lora_rank, self.h * qk, bias=False)
        self.kv_a = Linear(d, self.c + self.r, bias=a.qkv_bias)
        self.kv_a_norm = RMSNorm(self.c, eps=NORM_EPS)
        self.kv_b = Linear(self.c, self.h * (self.n + self.dv), bias=False)
        self.o = Linear(self.h * self.dv, d, bias=a.o_bias)
        self.core = _Core(selective, window)

    def _query(self, x_BSD):
        if hasattr(self, "q"):
            return self.q(x_BSD)
        return self.q_b(self.q_a_norm(self.q_a(x_BSD)))

    def forward(self, x_BSD):
        B, S, _ = x_BSD.shape
        q = self._query(x_BSD).view(B, S, -1, self.n + self.r).transpose(1, 2)   # -1: this rank's heads
        q_nope, q_rope = q.split((self.n, self.r), -1)
        c_BSc, k_rope_BSr = self.kv_a(x_BSD).split((self.c, self.r), -1)
        kv = self.kv_b(self.kv_a_norm(c_BSc)).view(B, S, -1, self.n + self.dv).transpose(1, 2)
        k_nope, v = kv.split((self.n, self.dv), -1)
        k_rope_BSr = local_tensor(k_rope_BSr, partial_grad=True)  # one rope key for all heads: grad summed over tp
        k_rope = rotary(k_rope_BSr.unsqueeze(1)).expand(B, k_nope.shape[1], S, self.r)
        q = torch.cat((q_nope, rotary(q_rope)), -1)
        k = torch.cat((k_nope, k_rope), -1)
        y = self.core(q, k, v)
        return self.o(y.transpose(1, 2).reshape(B, S, -1))


def build_attention(spec, selective: bool = False, window: int | None = None) -> nn.Module:
    kind = MLAttention if spec.attention.kind == "mla" else Attention
    return kind(spec, selective, window)


class Block(nn.Module):
    """One transformer layer; the norm layout follows norm.per_layer and parallel_attn_mlp (module docstring)."""

    def __init__(self, spec, layer: int, moe_kwargs: dict, recompute: str = "none", is_moe: bool | None = None) -> None:
        """is_moe: None = the spec's layer pattern at ``layer`` (an MTP block passes spec.mtp_is_moe)."""
        super().__init__()
        d, per = spec.hidden_size, spec.norm.per_layer
        self.per_layer, self.parallel = per, spec.parallel_attn_mlp
        self.norm1, self.norm2 = make_norm(spec.norm, d), make_norm(spec.norm, d)
        self.norm3 = make_norm(spec.norm, d) if per >= 3 else None
        self.norm4 = make_norm(spec.norm, d) if per >= 4 else None
        # an MTP block (layer >= num_layers) is shaped like the model's last layer, its window too
        window = spec.attention.window_of(min(layer, spec.num_layers - 1))
        self.attn = build_attention(spec, selective=recompute == "selective", window=window)
        self.is_moe = spec.is_moe_layer(layer) if is_moe is None else is_moe
        self.mlp, self.residual_mlp = self._mlp(spec, moe_kwargs)
        self.full_recompute = recompute == "full"

    def _mlp(self, spec, moe_kwargs):
        if not self.is_moe:
            return FFN(spec.hidden_size, spec.dense_ffn), None
        m = spec.moe
        routed = MoE(spec.hidden_size, m.model_copy(update={"parallel_dense_ffn": None}), **moe_kwargs)
        residual = FFN(spec.hidden_size, m.parallel_dense_ffn) if m.parallel_dense_ffn is not None else None
        return routed, residual

    def forward(self, x):
        if self.full_recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False, context_fn=self._recompute_contexts)
        return self._forward(x)

    def _forward(self, x_BSD):
        if self.per_layer == 3:
            return self._arctic(x_BSD)
        post_attn = self.norm3 if self.norm3 is not None else nn.Identity()
        post_mlp = self.norm4 if self.norm4 is not None else nn.Identity()
        h = x_BSD + post_attn(self.attn(self.norm1(x_BSD)))
        mlp_in = self.norm2(x_BSD if self.parallel else h)
        out = self.mlp(mlp_in)
        if self.residual_mlp is not None:
            out = out + self.residual_mlp(mlp_in)
        return h + post_mlp(out)

    def _arctic(self, x_BSD):
        """Arctic (3 norms): the residual MLP reads n3(h), the MoE n2(x) (parallel) or n2(h)."""
        h = x_BSD + self.attn(self.norm1(x_BSD))
        out = h + self.mlp(self.norm2(x_BSD if self.parallel else h))
        return out + self.residual_mlp(self.norm3(h))

    def _recompute_contexts(self):
        """(forward, recompute) contexts: the recomputation must not count routed tokens a second time."""
        return contextlib.nullcontext(), _KeepCounters(self.mlp if self.is_moe else None)


class _KeepCounters:
    """Restores a MoE's expert_tokens after a recomputed forward."""

    def __init__(self, moe) -> None:
        self.moe, self.saved = moe, None

    def __enter__(self):
        if self.moe is not None:
            self.saved = self.moe.expert_tokens.clone()
        return self

    def __exit__(self, *exc):
        if self.moe is not None:
            self.moe.expert_tokens.copy_(self.saved)
        return False


class MTPModule(nn.Module):
    """One multi-token-prediction depth (module docstring): hidden [B, S, D] of the depth before and the embedding of
    the tokens it is to see next [B, S, D] -> its normed hidden state [B, S, D] for the shared LM head."""

    def __init__(self, spec, layer: int, moe_kwargs: dict, recompute: str = "none") -> None:
        super().__init__()
        d = spec.hidden_size
        self.hnorm, self.enorm = make_norm(spec.norm, d), make_norm(spec.norm, d)
        self.eh_proj = Linear(2 * d, d, bias=False)
        self.block = Block(spec, layer, moe_kwargs, recompute, is_moe=spec.mtp_is_moe)
        self.final_norm = make_norm(spec.norm, d)

    def forward(self, h_BSD, emb_BSD):
        x_BSD = self.eh_proj(torch.cat((self.hnorm(h_BSD), self.enorm(emb_BSD)), -1))
        return self.final_norm(self.block(x_BSD))


class StageModel(nn.Module):
    """The layers [first_layer, first_layer + num_layers) of the model (+ embedding on the first stage,
    + final norm and LM head on the last). Input: tokens [B, S] (first) or hidden [B, S, D]; output: hidden
    or fp32 logits [B, S, V] (last; its final hidden states where ``return_hidden``)."""

    def __init__(self, spec, first_layer: int, num_layers: int, moe_kwargs: dict | None = None,
                 recompute: str = "none") -> None:
        super().__init__()
        assert recompute in RECOMPUTE, recompute
        self.spec, self.first_layer = spec, first_layer
        self.is_first, self.is_last = first_layer == 0, first_layer + num_layers == spec.num_layers
        d = spec.hidden_size
        mtp = spec.mtp_layers if self.is_last else 0
        self.embed = nn.Embedding(spec.vocab_size, d) if self.is_first or mtp else None
        self.pos = nn.Embedding(spec.max_seq_len, d) if self.is_first and spec.learned_position_embeddings else None
        self.layers = nn.ModuleDict({str(i): Block(spec, i, moe_kwargs or {}, recompute)
                                     for i in range(first_layer, first_layer + num_layers)})
        self.final_norm = make_norm(spec.norm, d) if self.is_last and spec.norm.final else None
        tied = spec.tie_embeddings and self.is_first
        self.lm_head = Linear(d, spec.vocab_size, bias=False) if self.is_last and not tied else None
        self.mtp = nn.ModuleDict({str(spec.num_layers + k): MTPModule(spec, spec.num_layers + k, moe_kwargs or {},
                                                                      recompute) for k in range(mtp)})
        """The MTP modules (last stage), run by the loss (pipeline.MTPLoss) on this stage's final hidden states."""
        self.return_hidden = bool(mtp)
        """Last stage: return the final hidden states; the loss applies ``logits`` to them chunk by chunk
        (pipeline.ChunkedLoss: no fp32 logits of the whole micro-batch) or runs the MTP modules on them."""

    def forward(self, x):
        if self.is_first:
            x = self.embed(x)
            if self.pos is not None:
                x = x + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.layers.values():
            x = block(x)
        if not self.is_last:
            return x
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x if self.return_hidden else self.logits(x)

    def head_weight(self, h_BSD):
        """The LM head's weight (or the tied embedding's) as one micro-batch's loss calls share it: one use of its
        16-bit step copy (casts.step_cast) for every loss chunk and MTP module, whose gradients autograd adds in 16
        bits before its one cast to fp32; None where the weight is a DTensor (tp: the head module runs each time)."""
        weight = self.lm_head.weight if self.lm_head is not None else self.embed.weight
        return None if isinstance(weight, DTensor) else step_cast(weight, compute_dtype(h_BSD))

    def logits(self, h_BSD, weight=None):
        """fp32 logits [B, S, V] of final hidden states: the LM head, or the tied embedding; ``weight``: the head
        weight a caller took once for several calls (head_weight)."""
        if weight is not None:
            logits = F.linear(h_BSD, weight)
        elif self.lm_head is not None:
            logits = self.lm_head(h_BSD)
        else:
            logits = F.linear(h_BSD, step_cast(self.embed.weight, compute_dtype(h_BSD)))
        return logits.float()

    def moe_layers(self) -> dict[int, MoE]:
        """MoE blocks by global layer index; an MTP module's at num_layers + k."""
        blocks = {**self.layers, **{i: m.block for i, m in self.mtp.items()}}
        return {int(i): b.mlp for i, b in blocks.items() if b.is_moe}

    def blocks(self) -> dict[str, Block]:
        """Every transformer block by FQN prefix (``layers.<i>``, ``mtp.<i>.block``)."""
        return {**{f"layers.{i}": b for i, b in self.layers.items()},
                **{f"mtp.{i}.block": m.block for i, m in self.mtp.items()}}


class VirtualStages(nn.Module):
    """This rank's model chunks under the interleaved schedule: chunk v holds pipeline stage
    pp_index + v x pp of pp x virtual_stages (Megatron-LM's interleaved assignment, Narayanan et al. 2021).
    Called directly (pp = 1) it runs its chunks in order."""

    def __init__(self, chunks: list[StageModel]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.spec = chunks[0].spec
        self.is_first, self.is_last = chunks[0].is_first, chunks[-1].is_last

    def forward(self, x):
        for chunk in self.chunks:
            x = chunk(x)
        return x

    def moe_layers(self) -> dict[int, MoE]:
        out: dict[int, MoE] = {}
        for chunk in self.chunks:
            out.update(chunk.moe_layers())
        return out


def chunk_layers(spec, plan) -> list[int]:
    """Layers of each of the pp x virtual_stages model chunks (interleaved: equal chunks, as Megatron-LM and
    ``piper estimate`` require); for other schedules the plan's stage split."""
    if plan.schedule != "interleaved":
        return plan.stage_layers(spec.num_layers)
    n = plan.pp * plan.virtual_stages
    if spec.num_layers % n:
        raise PiperError(f"schedule=interleaved needs num_layers={spec.num_layers} divisible by pp x virtual_stages "
                         f"= {plan.pp} x {plan.virtual_stages}", field="parallel.virtual_stages")
    per_rank = [spec.num_layers // plan.pp] * plan.pp
    if plan.layers_per_stage is not None and list(plan.layers_per_stage) != per_rank:
        raise PiperError(f"schedule=interleaved splits layers evenly ({per_rank} per rank); layers_per_stage="
                         f"{plan.layers_per_stage} is not that split", field="parallel.layers_per_stage")
    return [spec.num_layers // n] * n


def build_rank_module(spec, plan, pp_index: int, moe_kwargs: dict, seed: int | None) -> nn.Module:
    """This rank's module: a StageModel, or VirtualStages for the interleaved schedule; initialised from
    ``seed``, or left for ``materialize`` (seed None: built under ``torch.device("meta")`` it holds no storage)."""
    layers = chunk_layers(spec, plan)
    if plan.schedule != "interleaved":
        module = StageModel(spec, sum(layers[:pp_index]), layers[pp_index], moe_kwargs, plan.recompute)
    else:
        stages = [pp_index + v * plan.pp for v in range(plan.virtual_stages)]
        module = VirtualStages([StageModel(spec, sum(layers[:s]), layers[s], moe_kwargs, plan.recompute)
                                for s in stages])
    if seed is not None:
        init_stage(module, seed)
    return module


def materialize(module: nn.Module, device, seed: int) -> None:
    """Allocate a module built on the meta device (after any tp split and FSDP2 sharding: each parameter then
    holds only this rank's part) on ``device`` and run the seeded initialisation into it (torchtitan's order:
    build on meta, parallelise, ``to_empty``, initialise). The values equal ``init_stage`` of the whole model."""
    module.to_empty(device=device)
    init_stage(module, seed)


# ---- deterministic initialisation --------------------------------------------------------------
def _generator(seed: int, *key: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(hash((seed,) + key) & 0x7FFF_FFFF_FFFF)
    return g


def _value(shape, name: str, gen: torch.Generator, std_out: float) -> torch.Tensor:
    """Norm weights 1, biases 0, output projections N(0, std_out), everything else N(0, 0.02) (fp32, host)."""
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name and leaf == "weight":
        return torch.ones(shape)
    if leaf.startswith("b") and leaf != "weight" or leaf == "bias":
        return torch.zeros(shape)
    std = std_out if (".o." in name or ".down." in name or leaf == "w_out") else 0.02
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def _local_part(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The part of the whole-model ``value`` that this rank's ``param`` holds: a DTensor's (tensor parallel or
    FSDP2 shard) local piece, cut locally (``src_data_rank=None``: no communication); a plain tensor: all."""
    if not isinstance(param, DTensor):
        return value
    return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local()


def _fill(param: torch.Tensor, name: str, gen: torch.Generator, std_out: float) -> None:
    value = _local_part(param, _value(param.shape, name, gen, std_out))
    with torch.no_grad():
        local_tensor(param).copy_(value.to(param.dtype))


def _fill_expert(param: torch.Tensor, j: int, name: str, gen: torch.Generator, std_out: float) -> None:
    """Local expert j's slice of a stacked [El, ...] parameter (FSDP2 shards experts on dim 1, never dim 0)."""
    value = _local_part(param, _value((1, *param.shape[1:]), name, gen, std_out))[0]
    with torch.no_grad():
        local_tensor(param)[j].copy_(value.to(param.dtype))


def init_stage(model: StageModel, seed: int) -> None:
    """Initialise every parameter from (seed, layer[, expert]) so that any pp/ep/tp/FSDP2 split equals the
    whole; the MoE buffers to their start values (identity slots, zero counts)."""
    if isinstance(model, VirtualStages):
        for chunk in model.chunks:
            init_stage(chunk, seed)
        return
    std_out = 0.02 / math.sqrt(2 * model.spec.num_layers)
    for name, p in model.named_parameters():
        if not name.startswith(("layers.", "mtp.")):  # embedding (and its MTP copy), positions, final norm, LM head
            _fill(p, name, _generator(seed, -1, zlib.crc32(name.encode())), 0.02)
    for idx, layer in {**model.layers, **model.mtp}.items():   # an MTP module: one stream, as a layer's
        gen = _generator(seed, int(idx))
        for name, p in layer.named_parameters():
            if ".experts." not in f".{name}":
                _fill(p, name, gen, std_out)
        block = layer.block if isinstance(layer, MTPModule) else layer
        if block.is_moe:
            _init_experts(block.mlp, seed, int(idx), std_out)


def _init_experts(moe: MoE, seed: int, layer: int, std_out: float) -> None:
    for j in range(moe.num_local):
        gen = _generator(seed, layer, moe.first_expert + j)
        for name, p in moe.experts.named_parameters():
            _fill_expert(p, j, name, gen, std_out)
    with torch.no_grad():
        moe.slot_of_expert.copy_(torch.arange(moe.spec.num_experts))
        moe.expert_tokens.zero_()


# ---- reduced-size copies of catalog models -----------------------------------------------------
SHRUNK_WINDOW = 4
"""Keys of a sliding window in a reduced spec."""


def _shrunk_heads(a, hidden_size: int) -> dict:
    """Heads kept if they divide hidden_size with >= 8 per head, else 4; kv heads kept if they divide; a sliding
    window cut to SHRUNK_WINDOW keys."""
    heads = a.num_heads if hidden_size % a.num_heads == 0 and hidden_size // a.num_heads >= 8 else 4
    kv = max(1, min(a.kv_heads, heads))
    kv = kv if heads % kv == 0 else heads
    upd = {"num_heads": heads, "num_kv_heads": heads if a.kind in ("mha", "mla") else kv, "head_dim": None}
    if a.sliding_window is not None:      # a window the test sequences (12-128 tokens) outgrow, so it masks
        upd["sliding_window"] = min(a.sliding_window, SHRUNK_WINDOW)
    if a.kind == "mla":  # DeepSeek's proportions (nope 128 : rope 64 : v 128) at 1/8, ranks at 32 / 16
        upd.update(q_lora_rank=None if a.q_lora_rank is None else 32, kv_lora_rank=16, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=16)
    return upd


def shrink_spec(spec, hidden_size: int = 64, num_layers: int | None = 4, num_experts: int | None = None,
                vocab_size: int = 512, ffn_size: int = 128, mtp_layers: int | None = 0):
    """A reduced-width/-depth copy of a catalog spec (same structure: attention kind and options, a sliding window
    of SHRUNK_WINDOW keys, norms, gating, biases, shared experts and their gate, dense/MoE pattern, ties,
    positions) for CPU tests; MTP modules dropped unless ``mtp_layers`` says how many to keep (None: the spec's)."""
    attn = spec.attention.model_copy(update=_shrunk_heads(spec.attention, hidden_size))
    upd = {"hidden_size": hidden_size, "num_layers": num_layers or spec.num_layers, "vocab_size": vocab_size,
           "attention": attn, "max_seq_len": min(spec.max_seq_len or 1024, 1024),
           "mtp_layers": spec.mtp_layers if mtp_layers is None else mtp_layers}
    if spec.dense_ffn is not None:
        upd["dense_ffn"] = spec.dense_ffn.model_copy(update={"intermediate_size": ffn_size})
    if spec.moe is not None:
        upd["moe"] = _shrunk_moe(spec.moe, ffn_size, num_experts, upd["num_layers"])
    data = spec.model_copy(update=upd).model_dump()
    return type(spec).model_validate(data)


def _groups_hold(m, num_experts: int, top_k: int) -> bool:
    """Whether ``m``'s routing groups still split ``num_experts`` experts with room for ``top_k`` of them."""
    per_group = num_experts // m.routing_groups
    return (num_experts % m.routing_groups == 0 and top_k <= m.routing_group_top_k * per_group
            and m.routing_group_score_top <= per_group)


def _shrunk_moe(m, ffn_size: int, num_experts: int | None, num_layers: int):
    upd = {"expert": m.expert.model_copy(update={"intermediate_size": ffn_size // 2}),
           "num_experts": num_experts or min(m.num_experts, 8)}
    upd["top_k"] = min(m.top_k, upd["num_experts"])
    if m.routing_groups and not _groups_hold(m, upd["num_experts"], upd["top_k"]):
        upd.update(routing_groups=None, routing_group_top_k=None, routing_group_score_top=1)   # too few experts left
    if m.shared_expert is not None:
        upd["shared_expert"] = m.shared_expert.model_copy(update={"intermediate_size": ffn_size})
    if m.parallel_dense_ffn is not None:
        upd["parallel_dense_ffn"] = m.parallel_dense_ffn.model_copy(update={"intermediate_size": ffn_size})
    upd["layers"] = _shrunk_moe_layers(m.layers, num_layers)
    return m.model_copy(update=upd)


def _shrunk_moe_layers(layers, num_layers: int):
    """The MoE-layer rule at the reduced depth, at least one MoE layer kept (a moe block must select one): the
    explicit layers that exist (else the last), first_k_dense below the depth, the period's pattern where it
    still selects a layer (else every layer after the dense ones)."""
    if layers.explicit is not None:
        kept = [i for i in layers.explicit if i < num_layers]
        return layers.model_copy(update={"explicit": kept or [num_layers - 1]})
    rule = layers.model_copy(update={"first_k_dense": min(layers.first_k_dense, num_layers - 1)})
    if not any(rule.is_moe(i) for i in range(num_layers)):
        rule = rule.model_copy(update={"every": 1, "phase": 0})
    return rule
