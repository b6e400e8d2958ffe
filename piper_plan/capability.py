"""What the torch runtime (piper_plan.runtime) can execute: the single capability list of DESIGN.md.

No torch import: ``plan --runnable`` and ``launch`` read this to keep to plans the runtime runs.
``unsupported_features`` returns one line per feature a plan or model needs that the runtime lacks; a plan is
runnable when it is valid (``piper_plan.plans``) and needs nothing outside this list (``runnable_problems``).
"""

from __future__ import annotations

RUNTIME_CAPABILITY: dict[str, tuple] = {
    "schedule": ("gpipe", "1f1b", "interleaved"),
    "etp": (1,),
    "cp": (1,),
    "recompute": ("none", "selective", "full"),
    "zero": (0, 1, 2, 3),
    "a2a": ("flat", "halo"),
    "attention": ("mha", "gqa", "mla"),
    "qk_norm": ("none", "per_head", "full", "weightless"),
    "norm_per_layer": (2, 3, 4),
    "dtype": ("fp32", "bf16"),
}
"""Allowed values per feature. Everything else a ModelSpec can say is built (runtime/model.py): q/k/v/o
biases, attention sinks, sliding-window attention, LayerNorm with bias, parallel attention + MLP, shared experts
and their gate, router bias, sigmoid routing, dense layers by first_k_dense / every / phase / explicit, the
parallel dense FFN, learned positions; any virtual_stages whose chunks split num_layers evenly (unequal chunks,
which the planner prices, are not run); any tp the plan rules allow (runtime/tensor_parallel.py, always with
sequence parallelism; MLA splits q or q_b, kv_b and o, and keeps q_a, kv_a and their norms whole), with zero 0-3
(zero 1: runtime/optim.py). Not run: expert tensor parallelism (etp > 1: out of the default search,
benchmarks/etp_value.py), a capacity factor (the runtime is dropless), tied embeddings over more than one model
chunk, 0 or 1 norms per layer, 3 norms per layer without Arctic's residual MLP in every layer, fp16 / fp8 /
mxfp8, context parallelism (cp > 1), and the ``_tp_problems`` below. Multi-token-prediction modules
(mtp_layers > 0) are built on the last stage (runtime/model.py MTPModule, the loss runtime/pipeline.py MTPLoss)
with every pp, tp, ep and zero above."""


FEWER_MICROBATCHES_THAN_STAGES = ("schedule=1f1b with fewer micro-batches than pp stages (torch's Schedule1F1B "
                                  "needs one per stage; gpipe runs them)")


def _plan_problems(plan) -> list[str]:
    cap, out = RUNTIME_CAPABILITY, []
    for field in ("schedule", "etp", "recompute", "zero", "a2a"):
        value = getattr(plan, field)
        if value not in cap[field]:
            out.append(f"parallel.{field}={value} (runtime supports {', '.join(map(str, cap[field]))})")
    if plan.cp not in cap["cp"]:
        out.append(f"parallel.cp={plan.cp} (the runtime has no context parallelism)")
    return out


def _microbatch_problems(plan) -> list[str]:
    """torch's Schedule1F1B needs at least one micro-batch per stage (GPipe does not; interleaved's
    divisibility by pp is a plan rule)."""
    if plan.schedule == "1f1b" and plan.pp > 1 and plan.num_microbatches < plan.pp:
        return [FEWER_MICROBATCHES_THAN_STAGES]
    return []


def too_few_microbatches(fields) -> "np.ndarray":
    """``_microbatch_problems`` over a search's candidate fields (schedule codes, pp, num_microbatches)."""
    from piper_plan.specs.vocab import Schedule

    return ((fields["schedule"] == Schedule.ONE_F_ONE_B.code) & (fields["pp"] > 1)
            & (fields["num_microbatches"] < fields["pp"]))


def _attention_problems(model) -> list[str]:
    cap, a, out = RUNTIME_CAPABILITY, model.attention, []
    if a.kind not in cap["attention"]:
        out.append(f"attention.kind={a.kind!r} (runtime supports {', '.join(cap['attention'])})")
    if a.qk_norm not in cap["qk_norm"]:
        out.append(f"attention.qk_norm={a.qk_norm!r} (runtime supports {', '.join(cap['qk_norm'])})")
    return out


def _norm_problems(model) -> list[str]:
    per = model.norm.per_layer
    if per not in RUNTIME_CAPABILITY["norm_per_layer"]:
        return [f"norm.per_layer={per} (runtime supports 2, 3 (Arctic), 4 (Grok-1))"]
    if per == 3 and (model.moe is None or model.moe.parallel_dense_ffn is None or model.num_dense_layers):
        return ["norm.per_layer=3 is Arctic's layout: it needs moe.parallel_dense_ffn and every layer MoE"]
    return []


def _split_problems(model, plan) -> list[str]:
    chunks = plan.pp * plan.virtual_stages
    out = []
    sizes = plan.chunk_layers(model.num_layers)
    if sizes is not None and len(set(sizes)) > 1:
        out.append(f"interleaved model chunks of unequal layers (virtual_stage_layers, or Megatron-Core's split of "
                   f"num_layers={model.num_layers} over pp x virtual_stages; the runtime builds equal chunks only)")
    if model.tie_embeddings and chunks > 1:
        out.append(f"tie_embeddings=true with pp x virtual_stages = {chunks} "
                   "(runtime ties only within one model chunk)")
    return out


def _model_problems(model, plan) -> list[str]:
    out = _attention_problems(model) + _norm_problems(model) + _split_problems(model, plan)
    if model.vocab_size is None:
        out.append("vocab_size=null (runtime needs a vocabulary)")
    if model.moe is not None and model.moe.capacity_factor is not None:
        out.append(f"moe.capacity_factor={model.moe.capacity_factor} (runtime is dropless)")
    return out


def _tp_problems(model, plan, training) -> list[str]:
    """What of a tp > 1 plan the runtime cannot split (runtime/tensor_parallel.py); empty when tp = 1."""
    tp = plan.tp
    if tp == 1:
        return []
    out = []
    if not plan.sequence_parallel:
        out.append(f"parallel.sequence_parallel=false with tp={tp} (the runtime always runs sequence parallelism "
                   "with tensor parallelism)")
    if model.attention.qk_norm == "full":
        out.append(f"attention.qk_norm='full' with tp={tp} (a norm over all heads is not split)")
    if model.tie_embeddings and not model.norm.final:
        out.append(f"tie_embeddings=true without a final norm with tp={tp}")
    if model.mtp_layers and (model.tie_embeddings or model.learned_position_embeddings):
        out.append(f"mtp_layers={model.mtp_layers} with tie_embeddings or learned positions and tp={tp} (the MTP "
                   "modules read the sequence-sharded hidden states of an untied head)")
    sizes = {"vocab_size": model.vocab_size or 0}
    if training is not None:
        sizes["training.seq_len"] = training.seq_len
    moe = model.moe
    for name, ffn in (("dense_ffn", model.dense_ffn),
                      ("moe.shared_expert", moe.shared if moe is not None and moe.num_shared_experts else None),
                      ("moe.parallel_dense_ffn", moe.parallel_dense_ffn if moe is not None else None)):
        if ffn is not None:
            sizes[f"{name}.intermediate_size"] = ffn.intermediate_size
    out += [f"{name}={value} is not divisible by tp={tp} (tensor parallelism splits it evenly)"
            for name, value in sizes.items() if value % tp]
    return out


def uses_fsdp(plan) -> bool:
    """Whether the runtime wraps this plan's stages in FSDP2 (zero 2 or 3 with dp > 1: runtime/sharding.py)."""
    return plan.zero >= 2 and plan.dp > 1


def _fsdp_problems(model, plan) -> list[str]:
    """FSDP2 shards expert weights over edp on dim 1 (hidden / expert width), which must divide evenly; HSDP
    (dp_replicate > 1) runs with tp = 1 (tests/runtime/test_fsdp_runtime.py), not yet composed with tp."""
    if plan.dp_replicate > 1 and plan.tp > 1:
        return [f"parallel.dp_replicate={plan.dp_replicate} with tp={plan.tp} (HSDP runs with tp = 1 only)"]
    if not uses_fsdp(plan) or plan.edp == 1 or model.moe is None:
        return []
    bad = sorted(s for s in {model.hidden_size, model.moe.expert.intermediate_size} if s % plan.edp)
    if not bad:
        return []
    return [f"parallel.zero={plan.zero} shards expert weights over edp={plan.edp} on the hidden/expert width, "
            f"which must be divisible by edp (got {bad})"]


def _training_problems(training) -> list[str]:
    if training is None or training.dtype in RUNTIME_CAPABILITY["dtype"]:
        return []
    why = {"fp16": "it has no loss scaling", "fp8": "it has no 8-bit GEMMs", "mxfp8": "it has no 8-bit GEMMs"}
    return [f"training.dtype={training.dtype} (runtime supports fp32, bf16: {why.get(training.dtype, 'not built')})"]


def unsupported_features(plan, model, training=None) -> list[str]:
    """What ``plan`` on ``model`` (trained as ``training``, when given) needs that the runtime cannot do (the plan
    assumed valid)."""
    return (_plan_problems(plan) + _model_problems(model, plan) + _training_problems(training)
            + _tp_problems(model, plan, training) + _fsdp_problems(model, plan))


def options_problems(options, plan, model, training) -> list[str]:
    """What a plan's cost options ask of the training itself that the runtime does not do: dropout layers, and
    selective recompute of modules other than its own (CostOptions; ``options`` a CostOptions). Modules that act on
    nothing in ``model`` (shared_experts without shared experts; core_attn under flash attention) are left out of
    the comparison: they change nothing the runtime would do otherwise."""
    from piper_plan.cost.options import PIPER_RUNTIME_OPTIONS, acting_modules

    def acting(modules) -> set[str]:
        return set(acting_modules(model, modules)) - ({"core_attn"} if training.flash_attention else set())

    out = ["options.dropout=true (the runtime trains without dropout)"] if options.dropout else []
    own = PIPER_RUNTIME_OPTIONS.recompute_modules
    if plan.recompute == "selective" and acting(options.recompute_modules) != acting(own):
        out.append(f"options.recompute_modules={','.join(options.recompute_modules)} with recompute=selective (the "
                   f"runtime recomputes {', '.join(own)} only)")
    return out


def runtime_missing(plan, model, training=None) -> list[str]:
    """``unsupported_features`` and what the plan's batch split asks of torch's schedules (``_microbatch_problems``):
    everything a whole plan (its micro-batches set) needs that the runtime lacks."""
    return unsupported_features(plan, model, training) + _microbatch_problems(plan)


def runnable_problems(model, platform, training, nodes: int, plan) -> list[str]:
    """Why piper's runtime cannot run ``plan``: its validity problems, then what it needs outside the capability
    list; empty = runnable."""
    from piper_plan.plans import plan_problems

    return plan_problems(model, platform, training, nodes, plan) or runtime_missing(plan, model, training)
