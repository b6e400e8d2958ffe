"""What the torch runtime (piper_plan.runtime) can execute: the single capability list of DESIGN.md.

No torch import: ``plan --runnable`` and ``launch`` read this to keep to plans the runtime runs.
``unsupported_features`` returns one line per feature a plan or model needs that the runtime lacks.
"""

from __future__ import annotations

RUNTIME_CAPABILITY: dict[str, tuple] = {
    "schedule": ("gpipe", "1f1b"),
    "tp": (1,),
    "etp": (1,),
    "virtual_stages": (1,),
    "recompute": ("none",),
    "zero": (0, 1),
    "a2a": ("flat", "halo"),
    "attention": ("mha", "gqa"),
    "qk_norm": ("none",),
    "norm_per_layer": (2,),
}
"""Allowed values per feature. Everything else a ModelSpec can say (biases, shared experts and their gate,
sigmoid routing, dense layers, parallel dense FFN, learned positions) is built; tied embeddings only with pp=1."""


def _plan_problems(plan) -> list[str]:
    cap, out = RUNTIME_CAPABILITY, []
    for field in ("schedule", "tp", "etp", "virtual_stages", "recompute", "zero", "a2a"):
        value = getattr(plan, field)
        if value not in cap[field]:
            out.append(f"parallel.{field}={value!r} (runtime supports {', '.join(map(str, cap[field]))})")
    return out


def _model_problems(model, plan) -> list[str]:
    cap, out, a = RUNTIME_CAPABILITY, [], model.attention
    if a.kind not in cap["attention"]:
        out.append(f"attention.kind={a.kind!r} (runtime supports {', '.join(cap['attention'])})")
    if a.qk_norm not in cap["qk_norm"]:
        out.append(f"attention.qk_norm={a.qk_norm!r} (runtime supports none)")
    if a.sinks:
        out.append("attention.sinks=true (runtime has no attention sinks)")
    if model.norm.per_layer not in cap["norm_per_layer"]:
        out.append(f"norm.per_layer={model.norm.per_layer} (runtime supports 2)")
    if model.vocab_size is None:
        out.append("vocab_size=null (runtime needs a vocabulary)")
    if model.parallel_attn_mlp:
        out.append("parallel_attn_mlp=true (runtime runs sequential residual blocks)")
    if model.tie_embeddings and plan.pp > 1:
        out.append(f"tie_embeddings=true with pp={plan.pp} (runtime ties only with pp=1)")
    if model.moe is not None and model.moe.capacity_factor is not None:
        out.append(f"moe.capacity_factor={model.moe.capacity_factor} (runtime is dropless)")
    return out


def unsupported_features(plan, model) -> list[str]:
    """What ``plan`` on ``model`` needs that the runtime cannot do; an empty list means runnable."""
    return _plan_problems(plan) + _model_problems(model, plan)
