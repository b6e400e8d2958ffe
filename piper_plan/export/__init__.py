"""``piper export``: the same model and degrees as a plan.json, as a launch for another training engine.

Pure rendering (no torch, no I/O): ``render(plan_file, engine)`` returns the job script's text. Each engine module
maps piper's plan onto the engine's own options and refuses, as one PiperError line, what the engine cannot
express (a model it has no configuration for, a degree it does not have). Every script ends with what only
piper's runtime does and what the engine uses instead (PIPER_ONLY).
"""

from __future__ import annotations

import shlex

from piper_plan.errors import PiperError

ENGINES = ("torchtitan", "megatron")


def render(plan_file, engine: str) -> str:
    """The job script (bash) that runs ``plan_file``'s model and degrees under ``engine``."""
    if engine == "torchtitan":
        from piper_plan.export.torchtitan import script
    elif engine == "megatron":
        from piper_plan.export.megatron import script
    else:
        raise PiperError(f"engine {engine!r}; allowed: {', '.join(ENGINES)}", field="--engine")
    return script(plan_file)


def piper_only(plan_file, instead: dict[str, str]) -> list[str]:
    """Comment lines: what of the plan only piper's runtime does, and what the engine does instead."""
    lines = []
    if plan_file.parallel.a2a == "halo":
        lines.append(f"HALO hierarchical all-to-all (piper only): {instead['halo']}")
    if plan_file.migration.enabled:
        lines.append(f"live expert migration (piper only): {instead['migration']}")
    lines.append(f"not carried over from piper: {instead['always']}")
    return lines


def job_script(engine: str, plan_file, launcher: list[str], lines: list[list[str]], notes: list[str]) -> str:
    """A bash script: a header naming the plan, the notes as comments, then the launch: ``launcher`` and the
    engine's arguments, one group of ``lines`` per line."""
    p = plan_file.parallel
    head = [
        "#!/usr/bin/env bash",
        f"# {engine} launch for piper's plan: {plan_file.model.name} on {plan_file.nodes} x {plan_file.platform.name} "
        f"nodes ({p.world} ranks)",
        f"# piper degrees: dp={p.dp} tp={p.tp} pp={p.pp} ep={p.ep} etp={p.etp} edp={p.edp} mbs={p.mbs} "
        f"microbatches={p.num_microbatches} schedule={p.schedule} recompute={p.recompute} zero={p.zero} a2a={p.a2a}",
        "# Run on every node of the allocation with MASTER_ADDR set to the first node (as `piper run` prints).",
    ]
    body = " \\\n  ".join([_join(launcher)] + [_join(words) for words in lines])
    return "\n".join(head + [f"# {n}" for n in notes] + ["set -euo pipefail", body]) + "\n"


def _join(tokens: list[str]) -> str:
    """Shell words; a token naming a variable ($MASTER_ADDR) is double-quoted so that the shell expands it."""
    return " ".join(f'"{t}"' if "$" in t else shlex.quote(t) for t in tokens)


def torchrun_launcher(plan_file, tail: list[str]) -> list[str]:
    """torchrun for the plan's allocation: one process per device, c10d rendezvous on $MASTER_ADDR."""
    return ["torchrun", f"--nnodes={plan_file.nodes}", f"--nproc-per-node={plan_file.platform.devices_per_node}",
            "--rdzv-backend=c10d", "--rdzv-endpoint=${MASTER_ADDR}:29500", *tail]
