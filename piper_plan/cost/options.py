"""Modelling choices that are not facts of the model, the platform or the plan: stated, never silent."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostOptions:
    """Explicit assumptions of the resource model (defaults = the pessimistic, nothing-overlapped case)."""

    dropout: bool = False
    """Dropout layers (and their 1-byte masks) are present (Megatron GPT in Korthikanti's Table 2); modern
    MoE pre-training runs without dropout."""
    unfused_kernels: bool = False
    """Activations as piper's own runtime saves them (unfused PyTorch kernels, runtime/model.py and moe.py): each
    RMSNorm keeps its input, normalised input and fp32 rstd; GQA keys / values stay unexpanded (SDPA's
    enable_gqa) except on the sink path, which expands them to every head; RoPE keeps its cos / sin tables;
    SwiGLU keeps silu(gate) beside gate, up and product (4 x d_ffn);
    the MoE block keeps one combine buffer, not dispatch + combine. False = Megatron-style fused kernels
    (Korthikanti et al. 2022 as written). Tier-4 test: tests/validation/test_activation_terms.py."""
    tp_overlap: float = 0.0
    """Fraction of tensor-parallel collective time hidden behind compute."""
    a2a_overlap: float = 0.0
    """Fraction of expert all-to-all time hidden behind compute (e.g. shared experts or the other micro-batch)."""
    p2p_overlap: float = 0.0
    """Fraction of pipeline p2p time hidden behind compute."""
    dp_overlap: float = 0.0
    """Fraction of data-parallel gradient sync hidden behind the backward pass of the last micro-batch."""
    migration_fraction: float = 0.0
    """Amortised expert-migration time as a fraction of step time (the Piper paper bounds it below 5%)."""


DEFAULT_OPTIONS = CostOptions()

PIPER_RUNTIME_OPTIONS = CostOptions(unfused_kernels=True)
"""How piper's own torch runtime runs (plans it will execute: `plan --runnable`, `launch`, `estimate
--piper-runtime`): unfused PyTorch kernels; every other assumption as the defaults."""
