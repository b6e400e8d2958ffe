"""A plan as Megatron-LM ``pretrain_gpt.py`` arguments: the same architecture, degrees, batch, recomputation and
precision. Flag names are Megatron-LM's (``megatron/training/arguments.py``); tests/export/megatron_flags.txt
lists the ones piper may write, with the commit they were read from, and a test holds every exported flag to it.
"""

from __future__ import annotations

from piper_plan.cost.memory import moe_saved_rows
from piper_plan.errors import PiperError
from piper_plan.export.script import (job_script, option_notes, piper_only, prediction_options,
                                      recompute_modules, torchrun_launcher)
from piper_plan.specs.parallel import layout_string

INSTEAD = {
    "halo": "Megatron's alltoall token dispatcher (--moe-token-dispatcher-type alltoall; flex for DeepEP) sends one "
            "flat all-to-all per MoE layer",
    "migration": "Megatron keeps experts where they start; its router balances load (auxiliary loss, or the "
                 "expert bias of --moe-router-enable-expert-bias)",
    "always": "the data (--mock-data with a NullTokenizer stands in: give --data-path and a tokenizer), piper's "
              "checkpoint-on-signal requeue and its metrics.jsonl for `piper compare`",
    "optimizer": "written as --lr, --lr-decay-style, --min-lr, --lr-warmup-iters / -init, --weight-decay, "
                 "--clip-grad, --seed (and --moe-aux-loss-coeff; --optimizer sgd for SGD); Adam's betas and epsilon, "
                 "where Adam runs, are Megatron's defaults",
}
SGD = [["--optimizer", "sgd"], ["--sgd-momentum", "0"]]
"""Megatron-LM arguments.py at 307dcf3: --optimizer adam|sgd (_add_training_args, default adam) and --sgd-momentum
(_add_regularization_args, default 0.9)."""
PRECISION_FLAGS = {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": [], "fp8": ["--bf16"], "mxfp8": ["--bf16"]}
FP8_FORMAT = {"delayed": "hybrid", "tensorwise": "hybrid", "blockwise": "e4m3", "mxfp8": "e4m3"}
"""Megatron's --fp8-recipe -> --fp8-format: each Transformer Engine recipe's own default format (DelayedScaling and
Float8CurrentScaling HYBRID, Float8BlockScaling and MXFP8BlockScaling E4M3: transformer_engine/common/recipe/
__init__.py at 000b637); --fp8-format also turns fp8 on (its default None = off)."""
RECOMPUTE = {"none": [], "selective": [["--recompute-granularity", "selective"]],
             "full": [["--recompute-granularity", "full"], ["--recompute-method", "uniform"],
                      ["--recompute-num-layers", "1"]]}
NO_DROPOUT = [["--hidden-dropout", "0"], ["--attention-dropout", "0"]]
"""Megatron's dropout defaults are 0.1; a plan priced without dropout layers (piper's default) turns them off."""
OPTION_FLAGS = {
    "shared_expert_overlap": "not written: Megatron's --moe-shared-expert-overlap",
    "ep_dispatch": "not written: Megatron's --moe-token-dispatcher-type flex with DeepEP or HybridEP",
    "cuda_graph_scope": "not written: Megatron's CUDA-graph flags (--cuda-graph-scope) for your version",
    "tp_overlap": "not written: Megatron's --tp-comm-overlap (Transformer Engine's userbuffers)",
    "a2a_overlap": "not written: Megatron's --overlap-moe-expert-parallel-comm for your version",
    "p2p_overlap": "not written: Megatron overlaps pipeline sends under interleaving by default",
    "dp_overlap": "not written: Megatron's --overlap-grad-reduce and --overlap-param-gather",
}
"""Prediction options Megatron has a setting for that the export leaves to the user (note only)."""
QK_NORM = {"per_head": "--qk-layernorm", "weightless": "--qk-l2-norm"}
"""piper's q/k norm -> Megatron's flag (per-head RMSNorm as in Qwen3; the weightless L2 norm of Llama 4)."""
MEGATRON_FSDP = [["--use-megatron-fsdp"], ["--ckpt-format", "fsdp_dtensor"]]
"""The sharding strategy acts under Megatron FSDP only, which needs its own checkpoint format (arguments.py at
000c4ac, validate_args)."""
ZERO = {0: [], 1: [["--use-distributed-optimizer"]],
        2: [["--use-distributed-optimizer"], *MEGATRON_FSDP, ["--data-parallel-sharding-strategy", "optim_grads"]],
        3: [["--use-distributed-optimizer"], *MEGATRON_FSDP,
            ["--data-parallel-sharding-strategy", "optim_grads_params"]]}


def _ffn(model):
    """The FFN whose width Megatron's --ffn-hidden-size describes: the dense one, else the experts'."""
    return model.dense_ffn or model.moe.expert


def _gate_ffn(model):
    """The FFN whose gate the flags state for every FFN: the first the model builds (ModelSpec.ffns: dense FFNs
    where a dense layer has one, else the experts)."""
    return next(iter(model.ffns.values()))


def model_arguments(model, seq_len: int) -> list[list[str]]:
    """Architecture flags: sizes, attention (GQA or MLA), MLP, MoE."""
    a = model.attention
    ffn = _ffn(model)
    lines = [["--num-layers", str(model.num_layers)], ["--hidden-size", str(model.hidden_size)],
             ["--num-attention-heads", str(a.num_heads)], ["--ffn-hidden-size", str(ffn.intermediate_size)],
             ["--seq-length", str(seq_len)], ["--max-position-embeddings", str(model.max_seq_len or seq_len)],
             ["--vocab-size", str(model.vocab_size)],
             ["--normalization", "RMSNorm" if model.norm.kind == "rmsnorm" else "LayerNorm"],
             ["--position-embedding-type", "learned_absolute" if model.learned_position_embeddings else "rope"]]
    lines += activation_arguments(_gate_ffn(model))
    if not ffn.bias:
        lines.append(["--disable-bias-linear"])
    if a.qkv_bias:
        lines.append(["--add-qkv-bias"])
    if not model.tie_embeddings:
        lines.append(["--untie-embeddings-and-output-weights"])
    if a.kind == "mla":
        lines += [["--multi-latent-attention"], ["--kv-lora-rank", str(a.kv_lora_rank)],
                  ["--qk-head-dim", str(a.qk_nope_head_dim)], ["--qk-pos-emb-head-dim", str(a.qk_rope_head_dim)],
                  ["--v-head-dim", str(a.v_head_dim)]]
        if a.q_lora_rank is not None:
            lines.append(["--q-lora-rank", str(a.q_lora_rank)])
    else:
        if a.kv_heads != a.num_heads:
            lines += [["--group-query-attention"], ["--num-query-groups", str(a.kv_heads)]]
        if a.head_dim is not None:
            lines.append(["--kv-channels", str(a.head_dim)])
    if a.qk_norm in QK_NORM or a.kind == "mla":
        # MLA: the q_a / kv_a latent norms of DeepSeek's attention exist in Megatron-Core only under --qk-layernorm
        # (models/gpt/gpt_layer_specs.py, Megatron-Core 0.15.0: linear_q_up_proj / linear_kv_up_proj with the fused
        # layer norm when qk_layernorm is set)
        lines.append([QK_NORM.get(a.qk_norm, "--qk-layernorm")])
    if model.moe is not None:
        lines += moe_arguments(model)
    if model.mtp_layers:
        lines.append(["--mtp-num-layers", str(model.mtp_layers)])
    return lines + attention_variant_arguments(model)


def activation_arguments(ffn) -> list[list[str]]:
    """The FFN's gate: SwiGLU (--swiglu), or gpt-oss's clamped quick-GELU GLU (--quick-geglu with its offset and
    clamp; Megatron-LM arguments.py at 307dcf3, _add_network_size_args); a plain GELU is Megatron's default. Only
    these are written: what Megatron builds from them is built_gate, and gate_notes names what differs."""
    if not ffn.gated or ffn.activation_name not in ("silu", "quick_gelu"):
        return []
    if ffn.activation_name == "silu":
        return [["--swiglu"]]
    lines = [["--quick-geglu"]]
    if ffn.glu_linear_offset:
        lines.append(["--glu-linear-offset", f"{ffn.glu_linear_offset:g}"])
    if ffn.activation_clamp is not None:
        lines.append(["--activation-func-clamp-value", f"{ffn.activation_clamp:g}"])
    return lines


def built_gate(ffn) -> str:
    """The gate Megatron builds for every FFN from activation_arguments(ffn): --swiglu runs its fused SwiGLU, which
    takes no offset or clamp (bias_swiglu_impl in megatron/core/transformer/mlp.py at 00caa53); --quick-geglu with
    both; no flag, a plain GELU MLP."""
    flags = {line[0] for line in activation_arguments(ffn)}
    if "--swiglu" in flags:
        return "gated silu"
    return _gate(ffn) if "--quick-geglu" in flags else "gelu"


def gate_notes(model) -> list[str]:
    """Each of the model's FFNs (ModelSpec.ffns) whose gate is not the one Megatron builds from the flags."""
    built, notes = built_gate(_gate_ffn(model)), []
    for role, ffn in model.ffns.items():
        gate = _gate(ffn)
        if gate == built:
            continue
        hint = "set gated_linear_unit and activation_func in its config" if ffn.gated else \
            "set activation_func in its config"
        if built == "gated silu" and ffn.gated and ffn.activation_name == "silu":      # its offset or clamp differs
            hint = ("--no-bias-swiglu-fusion with --glu-linear-offset / --activation-func-clamp-value runs its unfused "
                    "GLU, which applies them to a dense MLP (mlp.py at 00caa53; the experts' path not checked)")
        notes.append(f"the flags make Megatron build {built} FFNs; the model's {role} are {gate}, which no flag "
                     f"written states: {hint}")
    return notes


def _gate(ffn) -> str:
    """An FFN's gate in words (its activation, offset and clamp)."""
    extra = (f", offset {ffn.glu_linear_offset:g}" if ffn.glu_linear_offset else "") + \
        (f", clamp {ffn.activation_clamp:g}" if ffn.activation_clamp is not None else "")
    return f"{'gated ' if ffn.gated else ''}{ffn.activation_name}{extra}"


def attention_variant_arguments(model) -> list[list[str]]:
    """Sliding windows and learnable sinks as Megatron-Bridge's GPT-OSS provider sets them (src/megatron/bridge/
    models/gpt_oss/gpt_oss_provider.py at 355cef4: window_size (128, 0) for the Hugging Face sliding_window 128,
    softmax_type learnable). --window-size takes 'left,right' as one word; --window-attn-skip-freq a list, 1 for a
    window layer and 0 for a full one (Megatron-LM arguments.py at 000c4ac, tuple_type and moe_freq_type)."""
    a, lines = model.attention, []
    if a.sliding_window is not None:
        pattern = [0 if a.window_of(i) is None else 1 for i in range(model.num_layers)]
        lines += [["--window-size", f"{a.sliding_window},0"],
                  ["--window-attn-skip-freq", "[" + ",".join(map(str, pattern)) + "]"]]
    if a.sinks:
        lines.append(["--softmax-type", "learnable"])
    return lines


def model_notes(model) -> list[str]:
    """What of the architecture the exported flags leave out (set it for your Megatron version)."""
    a, m, notes = model.attention, model.moe, []
    if a.qk_norm == "full":
        notes.append("q/k norm over all heads: not written (Megatron's --qk-layernorm is per head)")
    if m is not None and m.routing_groups and m.routing_group_score_top != 2:
        notes.append(f"group-limited routing: Megatron ranks a group by its best 2 expert scores; this model ranks "
                     f"it by its best {m.routing_group_score_top}")
    if m is not None and m.scoring == "sigmoid":
        notes.append("not in piper's model spec, so not written: an aux-loss-free expert bias "
                     "(--moe-router-enable-expert-bias) and a routed scaling factor (--moe-router-topk-scaling-factor)"
                     " such as DeepSeek-V3's 2.5")
    if not model.learned_position_embeddings:
        notes.append("not in piper's model spec, so Megatron's defaults apply: the rotary base and scaling "
                     "(--rotary-base 10000) and the norm epsilon (--norm-epsilon 1e-5); set the model's own")
    return notes + gate_notes(model)


def moe_arguments(model) -> list[list[str]]:
    m = model.moe
    pattern = [1 if model.is_moe_layer(i) else 0 for i in range(model.num_layers)]
    lines = [["--num-experts", str(m.num_experts)], ["--moe-router-topk", str(m.top_k)],
             ["--moe-ffn-hidden-size", str(m.expert.intermediate_size)],
             ["--moe-router-score-function", m.scoring], ["--moe-token-dispatcher-type", "alltoall"],
             ["--moe-grouped-gemm"]]
    if not all(pattern):
        lines.append(["--moe-layer-freq", "[" + ",".join(map(str, pattern)) + "]"])
    if m.routing_groups:
        lines += [["--moe-router-num-groups", str(m.routing_groups)],
                  ["--moe-router-group-topk", str(m.routing_group_top_k)]]
    if m.scoring == "softmax" and not m.normalize_top_k:
        lines.append(["--moe-router-pre-softmax"])      # softmax over all experts; by default over the top-k only
    if m.num_shared_experts:
        width = (m.shared_expert or m.expert).intermediate_size
        lines.append(["--moe-shared-expert-intermediate-size", str(m.num_shared_experts * width)])
    if m.capacity_factor is not None:           # token dropping, each expert padded to its capacity: as priced
        lines += [["--moe-expert-capacity-factor", f"{m.capacity_factor:g}"], ["--moe-pad-expert-input-to-capacity"]]
    return lines


def parallel_arguments(pf) -> tuple[list[list[str]], list[str]]:
    """Degrees, batch, schedule, recomputation, ZeRO and precision flags, and the notes on what differs."""
    p, t, notes = pf.parallel, pf.training, []
    lines = [["--tensor-model-parallel-size", str(p.tp)], ["--pipeline-model-parallel-size", str(p.pp)],
             ["--context-parallel-size", str(getattr(p, "cp", 1))],
             ["--micro-batch-size", str(p.mbs)], ["--global-batch-size", str(t.global_batch)],
             ["--train-iters", str(pf.runtime.steps)]]
    if pf.model.moe is not None:
        lines += [["--expert-model-parallel-size", str(p.ep)], ["--expert-tensor-parallel-size", str(p.etp)]]
    if p.tp > 1 and p.sequence_parallel:
        lines.append(["--sequence-parallel"])
    chunks = p.chunk_layers(pf.model.num_layers)
    if chunks is not None and len(set(chunks)) > 1:
        # unequal interleaved chunks: Megatron-Core's layout, which sets vp itself (arguments.py takes at most one
        # of it and --num-virtual-stages-per-pipeline-rank)
        lines.append(["--pipeline-model-parallel-layout", layout_string(chunks, pf.model.mtp_layers)])
    else:
        if p.schedule == "interleaved":
            lines.append(["--num-virtual-stages-per-pipeline-rank", str(p.virtual_stages)])
        lines += split_arguments(p.stage_layers(pf.model.num_layers), pf.model.mtp_layers)
    lines += recompute_arguments(pf, notes) + zero_arguments(p, notes)
    lines += precision_arguments(t)
    if p.schedule == "gpipe" and p.pp > 1:
        notes.append("schedule gpipe -> Megatron runs 1F1B (same bubble, fewer activations in flight)")
    return lines, notes


def precision_arguments(training) -> list[list[str]]:
    """The 16-bit format, an 8-bit recipe (--fp8-format with --fp8-recipe) and the gradients' width. Megatron's
    default differs by format (arguments.py at 000c4ac, validate_args): under --bf16 fp32 main gradients unless told
    --grad-reduce-in-bf16; under --fp16 gradients in fp16 unless told --accumulate-allreduce-grads-in-fp32."""
    flags = PRECISION_FLAGS[training.dtype]
    lines = [[flag] for flag in flags]
    recipe = training.fp8_recipe or (training.dtype if training.dtype == "mxfp8" else None)
    if recipe is not None:
        lines += [["--fp8-format", FP8_FORMAT[recipe]], ["--fp8-recipe", recipe]]
    if training.grad_bytes == 2 and "--bf16" in flags:
        lines.append(["--grad-reduce-in-bf16"])
    if training.grad_bytes == 4 and "--fp16" in flags:
        lines.append(["--accumulate-allreduce-grads-in-fp32"])
    return lines


def recompute_arguments(pf, notes: list[str]) -> list[list[str]]:
    """Recomputation flags: selective names the plan's modules (Megatron-Core's names, its default core_attn)."""
    if pf.parallel.recompute != "selective":
        return RECOMPUTE[pf.parallel.recompute]
    modules = recompute_modules(pf)
    if not modules:
        notes.append("recompute selective with no modules: nothing is recomputed (no recompute flag written)")
        return []
    return RECOMPUTE["selective"] + [["--recompute-modules", *modules]]


def zero_arguments(p, notes: list[str]) -> list[list[str]]:
    """ZeRO flags; HSDP (dp_replicate > 1) as Megatron FSDP's distributed-optimizer instances (its outer replicas)."""
    if p.dp_replicate == 1:
        return ZERO[p.zero]
    notes.append(f"dp_replicate {p.dp_replicate} (HSDP) -> --num-distributed-optimizer-instances {p.dp_replicate}: "
                 f"Megatron FSDP shards within dp x cp / {p.dp_replicate} = {p.dp * p.cp // p.dp_replicate} ranks and "
                 f"replicates across {p.dp_replicate} (unsharded outer replicas: Megatron FSDP's "
                 "--outer-dp-sharding-strategy no_shard)")
    return ZERO[p.zero] + [["--num-distributed-optimizer-instances", str(p.dp_replicate)]]


def optimizer_arguments(pf) -> list[list[str]]:
    """The plan's learning-rate schedule, weight decay, clipping, balance-loss weight and seed (planfile
    RuntimeBlock), as Megatron-LM names them (arguments.py at 307dcf3: _add_learning_rate_args,
    _add_regularization_args, _add_initialization_args). Without --lr Megatron cannot build its scheduler (its
    default is None). Warmup starts at lr / (warmup + 1), as piper's runtime does; clipping off is --clip-grad 0."""
    r, optimizer = pf.runtime, pf.training.optimizer
    lines = [["--lr", f"{r.lr:g}"], ["--lr-decay-style", r.lr_schedule], ["--min-lr", f"{r.lr * r.min_lr_ratio:g}"],
             ["--lr-warmup-iters", str(r.warmup_steps)], ["--lr-warmup-init", f"{r.lr / (r.warmup_steps + 1):g}"],
             ["--weight-decay", f"{r.weight_decay_for(optimizer):g}"], ["--clip-grad", f"{r.grad_clip_norm or 0:g}"],
             ["--seed", str(r.seed)]]
    if optimizer == "sgd":
        lines += SGD
    if pf.model.moe is not None:
        lines.append(["--moe-aux-loss-coeff", f"{r.aux_loss_coeff:g}"])
    return lines


def training_arguments(pf) -> list[list[str]]:
    """Dropout (off unless the prediction priced it), the fused cross entropy the prediction assumed, the MTP
    loss weight and the optimizer's settings."""
    options = prediction_options(pf)
    lines = optimizer_arguments(pf) + ([] if options.dropout else list(NO_DROPOUT))
    if options.cross_entropy_fusion_impl != "native":
        lines += [["--cross-entropy-loss-fusion"], ["--cross-entropy-fusion-impl", options.cross_entropy_fusion_impl]]
    if pf.model.mtp_layers:
        lines.append(["--mtp-loss-scaling-factor", f"{pf.runtime.mtp_loss_weight:g}"])
    return lines


def setting_notes(pf) -> list[str]:
    """What of the prediction's options and the MoE block the flags leave out."""
    notes = option_notes(pf, OPTION_FLAGS)
    rows = moe_saved_rows(prediction_options(pf))
    if pf.model.moe is not None and rows:
        notes.append(f"the prediction priced {rows} token-row buffer(s) per MoE layer (2: Megatron-Core before v0.13); "
                     "since v0.13 it keeps none: re-price with --cost-option moe_saved_rows=0 for a recent Megatron")
    if pf.training.optimizer == "sgd":
        notes.append("SGD as piper's runtime runs it: no momentum (torch.optim.SGD's default; Megatron's is 0.9) and "
                     "no weight decay (RuntimeBlock.weight_decay_for)")
    return notes


def split_arguments(layers: list[int], mtp_layers: int) -> list[list[str]]:
    """Megatron's first / last stage layer counts when only they differ from an even middle; else its layout (one
    chunk per stage)."""
    if len(set(layers)) <= 1:
        return []
    middle = layers[1:-1]
    if len(set(middle)) <= 1:
        return [["--decoder-first-pipeline-num-layers", str(layers[0])],
                ["--decoder-last-pipeline-num-layers", str(layers[-1])]]
    return [["--pipeline-model-parallel-layout", layout_string(layers, mtp_layers)]]


def arguments(pf) -> tuple[list[list[str]], list[str]]:
    parallel, notes = parallel_arguments(pf)
    data = [["--mock-data"], ["--tokenizer-type", "NullTokenizer"]]
    return (model_arguments(pf.model, pf.training.seq_len) + parallel + training_arguments(pf) + data,
            model_notes(pf.model) + notes + setting_notes(pf) + piper_only(pf, INSTEAD))


def flags(pf) -> list[str]:
    """Every flag name the export writes (for the check against Megatron-LM's list)."""
    return [group[0] for group in arguments(pf)[0]]


def check_runs_in_megatron(pf) -> None:
    """What Megatron-LM refuses at start-up (arguments.py at 000c4ac, validate_args): one error line before a script
    is written. (MoE with tp > 1 but no sequence parallelism, which Megatron-Core 0.15.0's moe_layer.py refuses in
    the first step, is no valid plan at all: plans.py moe_tp_without_sp.)"""
    if pf.model.moe is not None and pf.training.dtype == "fp16":
        raise PiperError("Megatron-LM trains MoE grouped GEMMs and expert parallelism in bf16 only: export a bf16 plan",
                         field="training.dtype")


def environment(pf) -> list[str]:
    """Variables the script exports: Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS=1 under tp > 1 or cp > 1 before
    Blackwell (arguments.py at 000c4ac, validate_args; on Blackwell it is allowed too), but not under Megatron FSDP
    (zero 2 / 3), which requires it unset or above 1 and only warns about tp / cp (arguments.py at 307dcf3)."""
    p = pf.parallel
    return ["CUDA_DEVICE_MAX_CONNECTIONS=1"] if (p.tp > 1 or p.cp > 1) and p.zero < 2 else []


def script(pf) -> str:
    check_runs_in_megatron(pf)
    lines, notes = arguments(pf)
    return job_script("Megatron-LM", pf, torchrun_launcher(pf, ["pretrain_gpt.py"]), lines, notes,
                      exports=environment(pf))
