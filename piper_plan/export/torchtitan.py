"""A plan as a torchtitan 0.3 launch: ``--module`` / ``--config`` naming a registered configuration, then
``--section.key`` overrides for the degrees, batch, recomputation and precision.

Names follow torchtitan 0.3.0's own sources: ``torchtitan/config/manager.py`` (ConfigManager: --module, --config),
``torchtitan/config/configs.py`` (ParallelismConfig, TrainingConfig fields), ``torchtitan/distributed/
activation_checkpoint.py`` (the ``activation_checkpoint:none|selective|full`` choice) and each model's
``config_registry.py`` (the registered configurations below). The tests parse the output with torchtitan's
ConfigManager and check its ParallelDims at the plan's world size.
"""

from __future__ import annotations

import math

from piper_plan.errors import PiperError
from piper_plan.export.script import (capacity_note, gradient_precision, job_script, option_notes, piper_only,
                                      recompute_modules, torchrun_launcher)

MODELS: dict[str, tuple[str, str]] = {
    "deepseek-v3": ("deepseek_v3", "deepseek_v3_671b"),
    "qwen3-30b-a3b": ("qwen3", "qwen3_30b_a3b"),
    "gpt-oss-120b": ("gpt_oss", "gpt_oss_120b"),
}
"""piper catalog model -> (torchtitan module, registered configuration of the same architecture)."""
FP8_CONFIGS = {"deepseek-v3": "deepseek_v3_671b_float8"}
"""Registered float8 variants (torchtitan's converters live in the configuration, not on the command line)."""
SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B"}
"""piper schedule -> torch.distributed.pipelining schedule name (ParallelismConfig.pipeline_parallel_schedule)."""
PRECISION = {"bf16": "bfloat16", "fp32": "float32", "fp8": "bfloat16"}
"""piper dtype -> TrainingConfig.mixed_precision_param (fp8: bf16 training with the float8 configuration)."""
STAGE_LESS_LAYERS = 2
"""ParallelismConfig's first- and last-stage 'less layers' defaults (1 each): the embedding and the output head
count as one layer each when torchtitan splits layers over stages."""

REGISTERED = "torchtitan's registered configuration decides it, not this command line"
OPTION_NOTES = {"dropout": "torchtitan's models have no dropout layers", "shared_expert_overlap": REGISTERED,
                "ep_dispatch": REGISTERED, "cross_entropy_fusion_impl": REGISTERED, "cuda_graph_scope": REGISTERED,
                "tp_overlap": REGISTERED, "a2a_overlap": REGISTERED, "p2p_overlap": REGISTERED,
                "dp_overlap": REGISTERED, "moe_saved_rows": REGISTERED,
                "unfused_kernels": REGISTERED}
"""Prediction options torchtitan's command line cannot set (note only)."""

INSTEAD = {
    "halo": "torchtitan's expert parallelism sends one flat all-to-all per MoE layer",
    "migration": "torchtitan keeps experts where they start and balances load with the auxiliary-loss-free expert "
                 "bias (its MoE.Config.load_balance_coeff; no expert moves between ranks)",
    "always": "piper's layer split per stage (torchtitan splits layers itself), its checkpoint-on-signal requeue, "
              "and its metrics.jsonl for `piper compare`",
}


NOT_COMPARED = {"source": True, "notes": True, "mtp_layers": True, "moe": {"capacity_factor": True}}
"""ModelSpec fields a plan may change under the catalog name (a pydantic ``exclude``): its description, the MTP
modules torchtitan's registered configurations do not have, and the capacity factor (`piper plan --capacity-factor`
sets it: routing, not architecture); setting_notes says neither is carried over."""


def config_names(model) -> tuple[str, str]:
    """The torchtitan module and registered configuration of the plan's model: the catalog model of that name, whose
    architecture the registered configuration has; a plan whose model block was changed under the name is refused
    (torchtitan would train the registered architecture, not the plan's)."""
    from piper_plan.catalog import load_model

    if model.name not in MODELS:
        raise PiperError(f"torchtitan 0.3 has no registered configuration for model {model.name!r}; "
                         f"exportable: {', '.join(MODELS)}", field="model")
    changed = _first_difference(model.model_dump(mode="json", exclude=NOT_COMPARED),
                                load_model(model.name).model_dump(mode="json", exclude=NOT_COMPARED))
    if changed:
        field, planned, catalog = changed
        raise PiperError(f"{planned!r}, but the catalog's {model.name} (torchtitan's registered {MODELS[model.name][1]}) "
                         f"has {catalog!r}: torchtitan would train the registered architecture, not this plan's; "
                         "allowed: the catalog model's figures", field=f"model.{field}")
    return MODELS[model.name]


def _first_difference(planned, catalog, where: str = ""):
    """(dotted field, planned value, catalog value) of the first difference, or None."""
    if isinstance(planned, dict) and isinstance(catalog, dict):
        for key in sorted(planned.keys() | catalog.keys()):
            found = _first_difference(planned.get(key), catalog.get(key), f"{where}.{key}" if where else key)
            if found:
                return found
        return None
    return None if planned == catalog else (where, planned, catalog)


def dp_split(plan) -> tuple[int, int]:
    """(data_parallel_replicate_degree, data_parallel_shard_degree). zero >= 1 shards over dp / dp_replicate
    (FSDP; HSDP with dp_replicate replicas of that shard group); zero 0 replicates, except that torchtitan's experts
    borrow their ranks from the shard axis (dp_shard x cp x tp = efsdp x ep), so the smallest shard degree that
    holds ep is used."""
    cp = getattr(plan, "cp", 1)
    if plan.zero >= 1:
        shard = plan.dp // plan.dp_replicate
    else:
        shard = next(s for s in range(1, plan.dp + 1) if plan.dp % s == 0 and (s * cp * plan.tp) % plan.ep == 0) \
            if (plan.dp * cp * plan.tp) % plan.ep == 0 else plan.dp
    if (shard * cp * plan.tp) % plan.ep:
        raise PiperError(f"ep={plan.ep} does not divide data_parallel_shard_degree x cp x tp = {shard} x {cp} x "
                         f"{plan.tp} = {shard * cp * plan.tp}: torchtitan's experts take their ranks from the dense "
                         "shard group x cp x tp", field="parallel.ep")
    return plan.dp // shard, shard


def dp_notes(p, replicate: int, shard: int) -> list[str]:
    """How torchtitan's data-parallel axes differ from the plan's ZeRO stage and HSDP."""
    if p.zero == 0:
        return [f"zero 0 -> HSDP replicate {replicate} x shard {shard}: torchtitan's experts borrow the shard axis"] \
            if shard > 1 else []
    notes = ["zero 1 -> FSDP keeping parameters gathered from forward to backward (torchtitan has no "
             "optimizer-only sharding; it also shards gradients and parameters)"] if p.zero == 1 else []
    if replicate > 1:
        efsdp = shard * getattr(p, "cp", 1) * p.tp // p.ep
        notes.append(f"dp_replicate {replicate} (HSDP) -> replicate {replicate} x shard {shard}; torchtitan's experts "
                     f"shard over efsdp = {efsdp} and are replicated across the {replicate} replicas (piper shards "
                     f"them over edp = {p.edp})")
    return notes


def setting_notes(pf, config: str) -> list[str]:
    """What of the plan's model, recomputation, MoE block and prediction options the command line leaves out."""
    notes = option_notes(pf, OPTION_NOTES) + capacity_note(pf, "torchtitan's MoE is dropless")
    if pf.parallel.recompute == "selective":
        notes.append(f"recompute selective ({', '.join(recompute_modules(pf)) or 'no modules'}) -> torchtitan's "
                     "per-op selective AC (it saves attention and every second matmul output and recomputes the "
                     "rest; it has no per-module choice)")
    if pf.model.mtp_layers:
        notes.append(f"not carried over: multi-token prediction ({pf.model.mtp_layers} module(s)): torchtitan's "
                     f"registered {config} has none")
    return notes


REDUCE_FLAG = "--training.mixed_precision_reduce"
"""TrainingConfig.mixed_precision_reduce: the dtype of FSDP's gradient reductions, applied when
data_parallel_shard_degree > 1; torchtitan 0.3 takes "float32" only."""


def gradient_arguments(training, shard: int) -> tuple[list[list[str]], list[str]]:
    """The plan's gradient precision: fp32 (4 bytes) under FSDP as torchtitan's float32 reduction dtype, written;
    anything else a note (torchtitan 0.3 has no other gradient-precision setting on its command line)."""
    if training.grad_bytes == 4 and shard > 1:
        return [[REDUCE_FLAG, "float32"]], [f"{gradient_precision(training)} -> {REDUCE_FLAG} float32 (the dtype of "
                                            "FSDP's gradient reductions)"]
    why = ("takes only float32" if training.grad_bytes != 4
           else "applies only when data_parallel_shard_degree > 1, and this export's is 1")
    return [], [f"not carried over: {gradient_precision(training)} (torchtitan 0.3's {REDUCE_FLAG[2:]}, the dtype of "
                f"FSDP's gradient reductions, {why})"]


def layers_per_virtual_stage(num_layers: int, stages: int) -> int | None:
    """pipeline_parallel_layers_per_stage giving ``stages`` stages (torchtitan: ceil((L + 2) / n) stages), or None."""
    total = num_layers + STAGE_LESS_LAYERS
    return next((n for n in range(1, total + 1) if math.ceil(total / n) == stages), None)


def arguments(pf) -> tuple[list[list[str]], list[str]]:
    """(argument groups, notes) of the torchtitan command for plan file ``pf``."""
    model, p, t = pf.model, pf.parallel, pf.training
    module, config = config_names(model)
    notes: list[str] = []
    if p.etp != 1:
        raise PiperError(f"etp={p.etp}: torchtitan 0.3 has no expert tensor parallelism (its experts take whole "
                         "ranks from the dp x tp region); export a plan with etp=1", field="parallel.etp")
    if t.dtype not in PRECISION or (t.dtype == "fp8" and model.name not in FP8_CONFIGS):
        raise PiperError(f"training dtype {t.dtype!r}: torchtitan 0.3 trains {model.name} in bf16 or fp32"
                         + (" (fp8 via a registered float8 configuration)" if model.name in FP8_CONFIGS else ""),
                         field="training.dtype")
    if t.dtype == "fp8":
        config = FP8_CONFIGS[model.name]
        notes.append(f"fp8 recipe {t.fp8_recipe} (as priced) -> {config} scales rowwise, one scale per row (torchtitan "
                     "0.3.0 Float8LinearConverter recipe_name 'rowwise'; it needs torchao)")
    replicate, shard = dp_split(p)
    gradient_lines, gradient_notes = gradient_arguments(t, shard)
    notes += dp_notes(p, replicate, shard) + gradient_notes + setting_notes(pf, config)
    lines = [["--module", module], ["--config", config],
             ["--parallelism.data_parallel_replicate_degree", str(replicate)],
             ["--parallelism.data_parallel_shard_degree", str(shard)],
             ["--parallelism.tensor_parallel_degree", str(p.tp)],
             ["--parallelism.pipeline_parallel_degree", str(p.pp)],
             ["--parallelism.expert_parallel_degree", str(p.ep)],
             ["--parallelism.context_parallel_degree", str(getattr(p, "cp", 1))],
             ["--parallelism.pipeline_parallel_microbatch_size", str(p.mbs)],
             ["--training.local_batch_size", str(p.mbs * (p.num_microbatches if p.pp > 1 else 1))],
             ["--training.global_batch_size", str(t.global_batch)],
             ["--training.seq_len", str(t.seq_len)],
             ["--training.steps", str(pf.runtime.steps)],
             ["--training.mixed_precision_param", PRECISION[t.dtype]], *gradient_lines]
    if p.zero >= 1:
        lines.append(["--parallelism.fsdp_reshard_after_forward", "always" if p.zero == 3 else "never"])
    if p.tp > 1 and not p.sequence_parallel:
        lines.append(["--parallelism.no-enable-sequence-parallel"])
    if p.pp > 1 or p.ep > 1:     # Trainer.Config refuses CUDA graphs with pipelining or the all-to-all dispatcher
        lines.append(["--training.disable_cuda_graphs"])
    if p.pp > 1:
        lines.append(["--parallelism.pipeline_parallel_schedule", SCHEDULES[p.schedule]])
        if p.schedule == "interleaved" and p.virtual_stages != 2:
            per_stage = layers_per_virtual_stage(model.num_layers, p.pp * p.virtual_stages)
            if per_stage is None:
                raise PiperError(f"virtual_stages={p.virtual_stages}: no torchtitan layers-per-stage gives "
                                 f"{p.pp * p.virtual_stages} stages of {model.num_layers} layers",
                                 field="parallel.virtual_stages")
            lines.append(["--parallelism.pipeline_parallel_layers_per_stage", str(per_stage)])
    lines.append([f"activation_checkpoint:{p.recompute}"])
    return lines, notes + piper_only(pf, INSTEAD)


def flat_arguments(pf) -> list[str]:
    """The torchtitan arguments as one list (what ConfigManager.parse_args takes)."""
    return [word for group in arguments(pf)[0] for word in group]


def script(pf) -> str:
    lines, notes = arguments(pf)
    return job_script("torchtitan 0.3", pf, torchrun_launcher(pf, ["-m", "torchtitan.train"]), lines, notes)
