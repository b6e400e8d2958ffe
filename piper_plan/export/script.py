"""What every export shares: the job script's layout, the torchrun launcher, and the lines on what only piper's
runtime does."""

from __future__ import annotations

import shlex

from piper_plan.cost.options import DEFAULT_OPTIONS, CostOptions, cost_options
from piper_plan.launch.local import MASTER_PORT
from piper_plan.planfile import does_not_fit

READ_OPTIONS = ("dropout", "recompute_modules", "shared_expert_overlap", "ep_dispatch", "cross_entropy_fusion_impl",
                "cuda_graph_scope", "tp_overlap", "a2a_overlap", "p2p_overlap", "dp_overlap", "moe_saved_rows", "unfused_kernels")
"""The prediction options an export reads: written as the engine's flags or named in its notes."""


def piper_only(plan_file, instead: dict[str, str]) -> list[str]:
    """Comment lines: what only piper's runtime does (and whether this plan uses it), what the engine does instead,
    and what else stays behind."""
    p, m = plan_file.parallel, plan_file.migration
    halo = "this plan uses it" if p.a2a == "halo" else "this plan does not use it"
    migration = "enabled in this plan" if m.enabled else "not enabled in this plan"
    launch = plan_file.platform.launch
    device = ([f"not carried over: the plan's platform ({plan_file.platform.name}) runs CPU ranks over "
               f"{launch.backend}; the engine's script runs on GPUs (CUDA, NCCL)"] if launch.device == "cpu" else [])
    return [f"only piper's runtime: the HALO hierarchical all-to-all ({halo}); here: {instead['halo']}",
            f"only piper's runtime: live expert migration ({migration}); here: {instead['migration']}",
            *device, f"not carried over: {instead['always']}", runtime_note(plan_file, instead.get("optimizer"))]


def runtime_note(plan_file, written: str | None) -> str:
    """The plan's optimizer (training.optimizer) and the runtime block's optimizer and loss settings: ``written``
    says which flags carry them, None that none does."""
    r, decay = plan_file.runtime, plan_file.runtime.weight_decay_for(plan_file.training.optimizer)
    clip = "off" if r.grad_clip_norm is None else f"{r.grad_clip_norm:g}"
    aux = f", aux loss {r.aux_loss_coeff:g}" if plan_file.model.moe is not None else ""
    settings = (f"piper's optimizer and loss settings (optimizer {plan_file.training.optimizer}, "
                f"lr {r.lr:g}, {r.lr_schedule} to {r.min_lr_ratio:g} x lr after {r.warmup_steps} warmup steps, "
                f"weight decay {decay:g}, gradient clip {clip}{aux}, seed {r.seed})")
    return f"not carried over: {settings}: set the engine's own" if written is None else f"{settings}: {written}"


def gradient_precision(training) -> str:
    """The plan's gradients in words: bytes per value and, where the plan implies it, their format."""
    if training.grad_bytes == 4:
        kind = " (fp32)" if training.weight_bytes == 4 else " (fp32 main gradients)"
    else:
        kind = " (the weights' dtype)" if training.grad_bytes == training.weight_bytes else ""
    return f"gradients: {training.grad_bytes} bytes per value{kind} in the plan"


def prediction_options(plan_file) -> CostOptions:
    """The options the plan's prediction was priced with, of those an export reads (READ_OPTIONS), checked as a
    file's options are (a bad value is one error line); the defaults where the plan was not priced."""
    stored = plan_file.prediction.options if plan_file.prediction is not None else {}
    return cost_options({name: stored[name] for name in READ_OPTIONS if name in stored})


def recompute_modules(plan_file) -> list[str]:
    """What the plan's ``recompute: selective`` re-runs (Megatron-Core's module names)."""
    return list(prediction_options(plan_file).recompute_modules)


def option_notes(plan_file, where: dict[str, str]) -> list[str]:
    """One 'not carried over' line per option in ``where`` whose value in the prediction is not the default:
    a setting the prediction assumed and the export does not write (``where``: how the engine sets it)."""
    options = prediction_options(plan_file)
    return [f"not carried over: the prediction assumed {name}={_shown(getattr(options, name))} ({hint})"
            for name, hint in where.items() if getattr(options, name) != getattr(DEFAULT_OPTIONS, name)]


def _shown(value) -> str:
    return ",".join(value) if isinstance(value, tuple) else repr(value)


def capacity_note(plan_file, instead: str) -> list[str]:
    """A note on a plan that drops tokens (a capacity factor), for an engine whose export cannot write it
    (torchtitan's MoE is dropless; Megatron's export writes the flags)."""
    factor = plan_file.moe.capacity_factor
    return [] if factor is None else [f"not carried over: capacity factor {factor:g} (tokens beyond it dropped); "
                                      f"{instead}"]


def fit_warning(plan_file) -> str | None:
    """The plan's own prediction does not fit the device (``piper launch`` refuses such a plan), or None."""
    overflow = does_not_fit(plan_file.prediction)
    return f"{overflow} (`piper launch` refuses it; re-plan with `piper plan`)" if overflow else None


def job_script(engine: str, plan_file, launcher: list[str], lines: list[list[str]], notes: list[str],
               exports: list[str] = ()) -> str:
    """A bash script: a header naming the plan, the notes as comments, ``exports`` (NAME=value), then the launch:
    ``launcher`` and the engine's arguments, one group of ``lines`` per line."""
    p = plan_file.parallel
    head = [
        "#!/usr/bin/env bash",
        f"# {engine} launch for piper's plan: {plan_file.model.name} on {plan_file.nodes} x {plan_file.platform.name} "
        f"nodes ({p.world} ranks)",
        f"# piper degrees: {p.settings_text()}",
        "# Run on every node of the allocation with MASTER_ADDR set to the first node (as `piper run` prints).",
    ]
    warning = fit_warning(plan_file)
    head += [f"# warning: {warning}"] if warning else []
    body = " \\\n  ".join([_join(launcher)] + [_join(words) for words in lines])
    exported = [f"export {shlex.quote(pair)}" for pair in exports]
    return "\n".join(head + [f"# {n}" for n in notes] + ["set -euo pipefail", *exported, body]) + "\n"


def _join(tokens: list[str]) -> str:
    """Shell words; a token naming a variable ($MASTER_ADDR) is double-quoted so that the shell expands it."""
    return " ".join(f'"{t}"' if "$" in t else shlex.quote(t) for t in tokens)


def torchrun_launcher(plan_file, tail: list[str]) -> list[str]:
    """torchrun for the plan's allocation: one process per device, c10d rendezvous on $MASTER_ADDR."""
    return ["torchrun", f"--nnodes={plan_file.nodes}", f"--nproc-per-node={plan_file.platform.devices_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=${{MASTER_ADDR}}:{MASTER_PORT}", *tail]
