"""Modelling choices that are not facts of the model, the platform or the plan: stated, never silent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from piper_plan.errors import PiperError

Fraction = Annotated[float, Field(ge=0, le=1)]


RECOMPUTE_MODULES = ("core_attn", "mla_up_proj", "mlp", "moe_act", "layernorm", "shared_experts", "moe")
"""The selective-recompute modules CostOptions.recompute_modules may name."""
EP_DISPATCH = ("per_expert", "per_node")
"""The values CostOptions.ep_dispatch may take."""
CROSS_ENTROPY_IMPLS = ("native", "te")
"""The values CostOptions.cross_entropy_fusion_impl may take (Megatron-Core's names)."""
CUDA_GRAPH_SCOPES = ("attn", "mlp", "moe_router")
"""The parts of a layer CostOptions.cuda_graph_scope may name (Megatron-Core's ``--cuda-graph-scope`` values whose
host work piper prices; a dropless MoE layer's routed experts have dynamic shapes and are never captured)."""


@dataclass(frozen=True)
class CostOptions:
    """Explicit assumptions of the resource model (defaults = the pessimistic, nothing-overlapped case). A file's
    ``options`` mapping is read by ``cost_options`` (pydantic checks the annotations; no name outside them)."""

    __pydantic_config__ = {"extra": "forbid"}

    dropout: bool = False
    """Dropout layers (and their 1-byte masks) are present (Megatron GPT in Korthikanti's Table 2); modern
    MoE pre-training runs without dropout."""
    unfused_kernels: bool = False
    """Activations as piper's own runtime saves them (unfused PyTorch kernels, runtime/model.py and moe.py): each
    RMSNorm keeps its input, normalised input and fp32 rstd; GQA keys / values stay unexpanded (SDPA's
    enable_gqa) except where the core masks explicitly (sinks; a sliding window shorter than the sequence), which
    repeats them to every head and keeps the mask, and on the sink path the [s, s + 1] softmax
    (memory.runtime_masked_core_bytes); RoPE keeps its cos / sin tables;
    an FFN keeps what its eager activation saves (memory.unfused_ffn_saved; SwiGLU: silu(gate) beside gate, up
    and product, 4 x d_ffn);
    the MoE block keeps one combine buffer, not dispatch + combine. False = Megatron-style fused kernels
    (Korthikanti et al. 2022 as written). Tier-4 test: tests/validation/test_activation_terms.py."""
    moe_saved_rows: Annotated[int, Field(ge=0, le=2)] | None = None
    """Token-row buffers [rows sent x hidden] a MoE layer saves for backward besides its input and the experts'
    own activations. None = by kernels: 1 with ``unfused_kernels`` (piper's runtime: the combine's multiply by the
    routing weights keeps the combined rows, runtime/moe.py ``_routed``; measured by tests/runtime/
    test_analytic_vs_real.py), else 2 (dispatch send + combine receive: Megatron-Core before v0.13, the
    assumption the Frontier datasets were validated with). 0 = Megatron-Core since v0.13's memory-efficient
    permutation (its MoE README, 2025/07: the probs multiplication moved into the experts' activation function;
    permute is an ``index_select`` and unpermute a ``scatter_add``, which save only indices:
    megatron/core/transformer/moe/moe_utils.py at commit 00611e6e); datasets of such runs set it. At most 2: no
    implementation cited here keeps more."""
    loss_chunk_rows: Annotated[int, Field(ge=1)] | None = None
    """With ``unfused_kernels``: the runtime's chunked LM loss (planfile.RuntimeBlock.loss_chunk_rows, runtime/
    pipeline.py ChunkedLoss): a micro-batch of more than this many tokens keeps no fp32 log-softmax of the whole
    vocabulary (its chunks are checkpointed); None = the whole micro-batch's (Megatron's loss, and the runtime's
    at or under the limit)."""
    cross_entropy_fusion_impl: str = "native"
    """What the LM loss keeps per logit until its backward (Megatron's kernels; ``unfused_kernels`` keeps the
    runtime's own): ``native``, Megatron-Core's vocab-parallel cross entropy, an fp32 softmax (it casts the logits
    to fp32 and saves the exponentials: megatron/core/tensor_parallel/cross_entropy.py and fusions/
    fused_cross_entropy.py); ``te``, Transformer Engine's parallel_cross_entropy, whose forward writes the
    gradient into the logits in place, in their dtype, and keeps nothing else of vocabulary size
    (transformer_engine/pytorch/cross_entropy.py), Megatron-Core's ``cross_entropy_fusion_impl="te"``."""
    recompute_modules: tuple[str, ...] = ("core_attn",)
    """What a plan's ``recompute: selective`` re-runs in backward, as Megatron-Core names its modules
    (TransformerConfig.recompute_modules with recompute_granularity "selective"; its default is core_attn):
    ``core_attn`` the attention core (its score matrices; nothing under flash attention), ``mla_up_proj`` MLA's
    up-projections (q, k, v of every head rebuilt from the compressed latents), ``mlp`` the dense MLP, ``moe_act``
    the experts' activation function (its output, the second GEMM's input), ``layernorm`` the norms before
    attention and MLP (their outputs), ``shared_experts`` a MoE layer's shared experts (everything they save; a
    no-op without them, as in Megatron-Core), ``moe`` the whole MoE block: router, dispatch all-to-all, experts,
    combine all-to-all and shared experts run again in backward from its saved input (MoELayer.forward's
    checkpoint of ``custom_forward``, megatron/core/transformer/moe/moe_layer.py at 0011998; it subsumes
    ``moe_act`` and ``shared_experts`` there). A module's input stays saved; its forward runs again in backward."""
    tp_overlap: Fraction = 0.0
    """Fraction of tensor-parallel collective time hidden behind compute."""
    a2a_overlap: Fraction = 0.0
    """Fraction of expert all-to-all time hidden behind compute (e.g. shared experts or the other micro-batch)."""
    shared_expert_overlap: bool = False
    """The dispatch exchange runs while the shared experts compute, forward and backward (flat all-to-all):
    piper's runtime (runtime.shared_expert_overlap); Megatron-Core's ``moe_shared_expert_overlap``, off by
    default there."""
    p2p_overlap: Fraction = 0.0
    """Fraction of pipeline p2p time hidden behind compute."""
    dp_overlap: Fraction = 0.0
    """Fraction of data-parallel gradient sync hidden behind the backward pass of the last micro-batch."""
    migration_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Amortised expert-migration time per step as a fraction of the step without it (0.05 adds 5%; the Piper
    paper bounds it below 5%); below 1."""
    ep_dispatch: str = "per_expert"
    """How the expert all-to-all sends a token to other nodes: ``per_expert``, one copy per chosen expert
    (Megatron-Core's alltoall dispatcher, piper's runtime); ``per_node``, one copy per destination node, fanned out
    over NVLink there (DeepEP's and HybridEP's normal kernels: Megatron-Core's flex dispatcher), so the network
    carries the expected distinct remote nodes of a token instead of its remote experts (cost/terms.py,
    node_copy_fraction). For NIC-joined nodes; an NVLink domain wider than a node is not deduplicated."""
    cuda_graph_scope: tuple[str, ...] = ()
    """Layer parts replayed from CUDA graphs, whose host work is therefore not priced by the host floor
    (cost/overhead.py, host_floor_terms): ``attn`` the attention linears, ``mlp`` a dense layer's MLP, ``moe_router``
    the router and the shared experts (Megatron-Core's scopes of the same names; the DeepSeek-V3 GB200 guide in
    NVIDIA/Megatron-LM docs/discussions captures ``attn moe_router moe_preprocess``)."""

    def __post_init__(self) -> None:
        for name in ("recompute_modules", "cuda_graph_scope"):
            object.__setattr__(self, name, tuple(_names_in(name, getattr(self, name), _ALLOWED[name])))
        _names_in("ep_dispatch", [self.ep_dispatch], EP_DISPATCH)
        _names_in("cross_entropy_fusion_impl", [self.cross_entropy_fusion_impl], CROSS_ENTROPY_IMPLS)


_ALLOWED = {"recompute_modules": RECOMPUTE_MODULES, "cuda_graph_scope": CUDA_GRAPH_SCOPES}


def module_absent(model) -> dict[str, str | None]:
    """Why each recompute module has nothing to act on in ``model`` (None: it acts; flash attention aside)."""
    moe = model.moe
    return {"core_attn": None, "layernorm": None,
            "mla_up_proj": None if model.attention.kind == "mla" else f"its attention is {model.attention.kind}, not mla",
            "moe_act": None if moe is not None else "it has no MoE layer",
            "moe": None if moe is not None else "it has no MoE layer",
            "mlp": None if model.num_dense_layers else "every layer is MoE",
            "shared_experts": None if moe is not None and moe.num_shared_experts else "it has no shared experts"}


def acting_modules(model, modules) -> tuple[str, ...]:
    """The recompute ``modules`` that drop or re-run anything in ``model`` (the others price as nothing)."""
    absent = module_absent(model)
    return tuple(m for m in modules if absent.get(m) is None)


def check_modules_exist(model, modules, field: str = "--recompute-modules / options.recompute_modules") -> None:
    """One PiperError line when selective recompute names a module ``model`` does not have where Megatron-Core
    refuses it too (TransformerConfig.__post_init__, megatron/core/transformer/transformer_config.py at d2c5e8b):
    mla_up_proj without multi_latent_attention; moe_act without moe_grouped_gemm, which a model without MoE layers
    does not set. ``mlp`` on a model without dense layers, ``shared_experts`` without shared experts and ``moe``
    without MoE layers stay allowed: Megatron-Core skips them there (transformer_layer.py sets ``recompute_mlp``
    only where the layer is not MoE; only a MoELayer reads ``moe``), and piper prices them as nothing
    (acting_modules)."""
    absent = module_absent(model)
    missing = [f"{name} ({absent[name]})" for name in ("mla_up_proj", "moe_act") if name in modules and absent[name]]
    if missing:
        raise PiperError(f"names {', '.join(missing)}, which {model.name} does not have; modules that act on it: "
                         f"{', '.join(acting_modules(model, RECOMPUTE_MODULES))}", field=field)


def _names_in(field: str, values, allowed: tuple[str, ...]):
    """``values`` when each is one of ``allowed``, else one error line naming the field, the values and the choices."""
    unknown = [v for v in values if v not in allowed]
    if unknown:
        raise PiperError(f"{field} names {', '.join(map(repr, unknown))}; allowed: {', '.join(allowed)}",
                         field=f"options.{field}")
    return values


def cost_options(values: dict, field: str = "options") -> CostOptions:
    """CostOptions from a file's ``options`` mapping (plain JSON data), validated as the spec files are (pydantic,
    strict JSON mode): an unknown name, a value of the wrong type or out of range, or a name outside a field's
    choices is one PiperError line. A whole float stands for a count (plan files wrote moe_saved_rows as 2.0) and a
    tuple for a list (``dataclasses.asdict`` of a CostOptions)."""
    from piper_plan.catalog import parse_spec

    plain = {k: int(v) if isinstance(v, float) and v.is_integer() else list(v) if isinstance(v, tuple) else v
             for k, v in values.items()}
    try:
        return parse_spec(CostOptions, plain, "", field=field)
    except PiperError as exc:               # a named choice's own check names its field as a file's options.<name>
        if field == "options" or not (exc.field or "").startswith("options."):
            raise
        raise PiperError(exc.message, path=exc.path, field=f"{field} {exc.field.removeprefix('options.')}") from None


DEFAULT_OPTIONS = CostOptions()

PIPER_RUNTIME_OPTIONS = CostOptions(unfused_kernels=True, loss_chunk_rows=1024, shared_expert_overlap=True)   # planfile.RuntimeBlock's default
"""How piper's own torch runtime runs (plans it will execute: `plan --runnable`, `launch`, `estimate
--piper-runtime`): unfused PyTorch kernels; every other assumption as the defaults."""


def as_the_runtime_runs(options: CostOptions, loss_chunk_rows=PIPER_RUNTIME_OPTIONS.loss_chunk_rows,
                        shared_expert_overlap=PIPER_RUNTIME_OPTIONS.shared_expert_overlap) -> CostOptions:
    """``options`` as piper's runtime would run the plan: its kernels (PIPER_RUNTIME_OPTIONS, with a plan file's
    runtime block where given) and the options' migration share; what changes the training (dropout, recompute
    modules) is capability.options_problems' to refuse, not this to price."""
    from dataclasses import replace

    return replace(PIPER_RUNTIME_OPTIONS, loss_chunk_rows=loss_chunk_rows, shared_expert_overlap=shared_expert_overlap,
                   migration_fraction=options.migration_fraction)
