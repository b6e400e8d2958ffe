"""What every export shares: the job script's layout, the torchrun launcher, and the lines on what only piper's
runtime does."""

from __future__ import annotations

import shlex

from piper_plan.launch.local import MASTER_PORT


def piper_only(plan_file, instead: dict[str, str]) -> list[str]:
    """Comment lines: what only piper's runtime does (and whether this plan uses it), what the engine does instead,
    and what else stays behind."""
    p, m = plan_file.parallel, plan_file.migration
    halo = "this plan uses it" if p.a2a == "halo" else "this plan does not use it"
    migration = "enabled in this plan" if m.enabled else "not enabled in this plan"
    return [f"only piper's runtime: the HALO hierarchical all-to-all ({halo}); here: {instead['halo']}",
            f"only piper's runtime: live expert migration ({migration}); here: {instead['migration']}",
            f"not carried over: {instead['always']}"]


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
            "--rdzv-backend=c10d", f"--rdzv-endpoint=${{MASTER_ADDR}}:{MASTER_PORT}", *tail]
