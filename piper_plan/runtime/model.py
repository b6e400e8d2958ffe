"""A decoder-only (MoE) transformer built from a ModelSpec, one pipeline stage at a time.

Legend: B batch, S sequence, D hidden, H query heads, G key/value heads, hd head width, V vocabulary.
Parameter shapes follow the Hugging Face reference modules so that numel sums equal
``piper_plan.specs.params.count_params`` (a test checks it). Initialisation is a function of
(seed, global layer, expert) only, so any split over pp / ep builds exactly the weights of the
single-process model (std 0.02, output projections 0.02 / sqrt(2 L): GPT-2 / Megatron's scheme).
RoPE uses theta = 10000 (the spec does not carry rope_theta). MLA is not built (capability.py says so).
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from piper_plan.runtime.moe import FFN, MoE


def make_norm(norm, hidden: int) -> nn.Module:
    if norm.kind == "rmsnorm":
        return nn.RMSNorm(hidden, eps=1e-5)
    return nn.LayerNorm(hidden, eps=1e-5, bias=norm.bias)


def rotary(x_BHSd: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021), half-split layout as in Llama / Mixtral."""
    S, hd = x_BHSd.shape[-2], x_BHSd.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, device=x_BHSd.device, dtype=torch.float32) / hd)
    ang_Sh = torch.arange(S, device=x_BHSd.device, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang_Sh.cos().repeat(1, 2).to(x_BHSd.dtype), ang_Sh.sin().repeat(1, 2).to(x_BHSd.dtype)
    x1, x2 = x_BHSd[..., : hd // 2], x_BHSd[..., hd // 2:]
    return x_BHSd * cos + torch.cat((-x2, x1), -1) * sin


class Attention(nn.Module):
    """MHA / GQA with RoPE and a causal mask (scaled_dot_product_attention)."""

    def __init__(self, spec) -> None:
        super().__init__()
        a, d, hd = spec.attention, spec.hidden_size, spec.head_dim
        self.h, self.g, self.hd = a.num_heads, a.kv_heads, hd
        self.q = nn.Linear(d, self.h * hd, bias=a.qkv_bias)
        self.k = nn.Linear(d, self.g * hd, bias=a.qkv_bias)
        self.v = nn.Linear(d, self.g * hd, bias=a.qkv_bias)
        self.o = nn.Linear(self.h * hd, d, bias=a.o_bias)

    def forward(self, x_BSD):
        B, S, _ = x_BSD.shape
        q = rotary(self.q(x_BSD).view(B, S, self.h, self.hd).transpose(1, 2))
        k = rotary(self.k(x_BSD).view(B, S, self.g, self.hd).transpose(1, 2))
        v = self.v(x_BSD).view(B, S, self.g, self.hd).transpose(1, 2)
        if self.g != self.h:
            k, v = (t.repeat_interleave(self.h // self.g, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, S, self.h * self.hd))


class Block(nn.Module):
    """Pre-norm transformer layer: x + attn(norm(x)); x + mlp(norm(x)) with mlp = MoE or dense FFN."""

    def __init__(self, spec, layer: int, moe_kwargs: dict) -> None:
        super().__init__()
        self.norm1, self.norm2 = make_norm(spec.norm, spec.hidden_size), make_norm(spec.norm, spec.hidden_size)
        self.attn = Attention(spec)
        self.is_moe = spec.is_moe_layer(layer)
        self.mlp = MoE(spec.hidden_size, spec.moe, **moe_kwargs) if self.is_moe else FFN(spec.hidden_size, spec.dense_ffn)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class StageModel(nn.Module):
    """The layers [first_layer, first_layer + num_layers) of the model (+ embedding on the first stage,
    + final norm and LM head on the last). Input: tokens [B, S] (first) or hidden [B, S, D]; output: hidden
    or fp32 logits [B, S, V] (last)."""

    def __init__(self, spec, first_layer: int, num_layers: int, moe_kwargs: dict | None = None) -> None:
        super().__init__()
        self.spec, self.first_layer = spec, first_layer
        self.is_first, self.is_last = first_layer == 0, first_layer + num_layers == spec.num_layers
        d = spec.hidden_size
        self.embed = nn.Embedding(spec.vocab_size, d) if self.is_first else None
        self.pos = nn.Embedding(spec.max_seq_len, d) if self.is_first and spec.learned_position_embeddings else None
        self.layers = nn.ModuleDict({str(i): Block(spec, i, moe_kwargs or {})
                                     for i in range(first_layer, first_layer + num_layers)})
        self.final_norm = make_norm(spec.norm, d) if self.is_last and spec.norm.final else None
        tied = spec.tie_embeddings and self.is_first
        self.lm_head = nn.Linear(d, spec.vocab_size, bias=False) if self.is_last and not tied else None

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
        head = self.lm_head.weight if self.lm_head is not None else self.embed.weight
        return F.linear(x, head).float()

    def moe_layers(self) -> dict[int, MoE]:
        return {int(i): b.mlp for i, b in self.layers.items() if b.is_moe}


# ---- deterministic initialisation --------------------------------------------------------------
def _generator(seed: int, *key: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(hash((seed,) + key) & 0x7FFF_FFFF_FFFF)
    return g


def _fill(param: torch.Tensor, name: str, gen: torch.Generator, std_out: float) -> None:
    """Norm weights 1, biases 0, output projections N(0, std_out), everything else N(0, 0.02)."""
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name and leaf == "weight":
        value = torch.ones(param.shape)
    elif leaf.startswith("b") and leaf != "weight" or leaf == "bias":
        value = torch.zeros(param.shape)
    else:
        std = std_out if (".o." in name or ".down." in name or leaf == "w_out") else 0.02
        value = torch.empty(param.shape).normal_(0.0, std, generator=gen)
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


def init_stage(model: StageModel, seed: int) -> None:
    """Initialise every parameter from (seed, layer[, expert]) so that any pp/ep split equals the whole."""
    std_out = 0.02 / math.sqrt(2 * model.spec.num_layers)
    for name, p in model.named_parameters():
        if not name.startswith("layers."):  # embedding, positions, final norm, LM head: one stream each
            _fill(p, name, _generator(seed, -1, zlib.crc32(name.encode())), 0.02)
    for idx, block in model.layers.items():
        gen = _generator(seed, int(idx))
        for name, p in block.named_parameters():
            if ".experts." not in f".{name}":
                _fill(p, name, gen, std_out)
        if block.is_moe:
            _init_experts(block.mlp, seed, int(idx), std_out)


def _init_experts(moe: MoE, seed: int, layer: int, std_out: float) -> None:
    for j in range(moe.num_local):
        gen = _generator(seed, layer, moe.first_expert + j)
        for name, p in moe.experts.named_parameters():
            _fill(p[j], name, gen, std_out)


def shrink_spec(spec, hidden_size: int = 64, num_layers: int | None = 4, num_experts: int | None = None,
                vocab_size: int = 512, ffn_size: int = 128):
    """A reduced-width/-depth copy of a catalog spec (same structure: attention kind, gating, shared experts,
    dense/MoE pattern) for CPU tests. Heads are kept if they divide hidden_size, else reduced to 4."""
    a = spec.attention
    heads = a.num_heads if hidden_size % a.num_heads == 0 and hidden_size // a.num_heads >= 8 else 4
    kv = max(1, min(a.kv_heads, heads)) if heads % max(1, min(a.kv_heads, heads)) == 0 else heads
    attn = a.model_copy(update={"num_heads": heads, "num_kv_heads": kv if a.kind != "mha" else heads, "head_dim": None})
    upd = {"hidden_size": hidden_size, "num_layers": num_layers or spec.num_layers, "vocab_size": vocab_size,
           "attention": attn, "max_seq_len": min(spec.max_seq_len or 1024, 1024)}
    if spec.dense_ffn is not None:
        upd["dense_ffn"] = spec.dense_ffn.model_copy(update={"intermediate_size": ffn_size})
    if spec.moe is not None:
        m = spec.moe
        moe_upd = {"expert": m.expert.model_copy(update={"intermediate_size": ffn_size // 2}),
                   "num_experts": num_experts or min(m.num_experts, 8)}
        moe_upd["top_k"] = min(m.top_k, moe_upd["num_experts"])
        if m.shared_expert is not None:
            moe_upd["shared_expert"] = m.shared_expert.model_copy(update={"intermediate_size": ffn_size})
        if m.parallel_dense_ffn is not None:
            moe_upd["parallel_dense_ffn"] = m.parallel_dense_ffn.model_copy(update={"intermediate_size": ffn_size})
        upd["moe"] = m.model_copy(update=moe_upd)
    data = spec.model_copy(update=upd).model_dump()
    return type(spec).model_validate(data)
