"""Where ``piper run`` puts a plan's ranks: on this machine (a plan of one node, or a CPU plan whose emulated nodes
fit here), or on an allocation, for which it prints the exact torchrun and srun lines instead.

Pure: no torch, no subprocess. The CLI (cli/run.py) starts the local ranks with torch's elastic launcher.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from piper_plan.launchenv import MAX_LOCAL_RANKS

RUNTIME_MODULE = "piper_plan.runtime.train"
MASTER_PORT = 29500
"""torchrun's default rendezvous port (also the runtime's default MASTER_PORT)."""


@dataclass(frozen=True)
class Layout:
    """The ranks a plan asks for: ``nodes`` x ``ranks_per_node`` on ``device`` ("cpu" or "cuda")."""

    nodes: int
    ranks_per_node: int
    device: str
    cpus_per_task: int
    gpus_per_task: int
    srun_extra: tuple[str, ...] = ()

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def runs_here(self) -> bool:
        """One node always; several only as CPU ranks with an emulated topology (as `piper bench a2a` does)."""
        return self.world <= MAX_LOCAL_RANKS and (self.nodes == 1 or self.device == "cpu")

    @property
    def emulated_topology(self) -> str | None:
        """PIPER_EMULATE_TOPOLOGY for local ranks standing in for several nodes (launchenv.py)."""
        return f"{self.nodes}x{self.ranks_per_node}" if self.nodes > 1 else None


def layout_of(plan_file) -> Layout:
    """The layout of a read plan (``planfile.PlanFile``: its world fills its nodes, checked on read)."""
    launch = plan_file.platform.launch
    return Layout(nodes=plan_file.nodes, ranks_per_node=plan_file.platform.devices_per_node, device=launch.device,
                  cpus_per_task=launch.cpus_per_task, gpus_per_task=launch.gpus_per_task,
                  srun_extra=tuple(launch.srun))


def runtime_args(plan: str, out_dir: str, steps: int | None, resume: bool, profile: int, lr: float | None,
                 aux_loss_coeff: float | None) -> list[str]:
    """The runtime's own options (python -m piper_plan.runtime.train) for ``piper run``'s."""
    args = ["--plan", plan, "--out", out_dir]
    args += ["--steps", str(steps)] if steps is not None else []
    args += ["--profile", str(profile)] if profile else []
    args += ["--lr", repr(lr)] if lr is not None else []
    args += ["--aux-loss-coeff", repr(aux_loss_coeff)] if aux_loss_coeff is not None else []
    return args + (["--resume"] if resume else [])


def torchrun_command(layout: Layout, args: list[str], torchrun: str = "torchrun") -> str:
    """The line to run on every node of the allocation (MASTER_ADDR: the first node's host name)."""
    head = [torchrun, f"--nnodes={layout.nodes}", f"--nproc-per-node={layout.ranks_per_node}",
            "--rdzv-backend=c10d", "--rdzv-id=piper"]
    return (shlex.join(head) + f' --rdzv-endpoint="$MASTER_ADDR:{MASTER_PORT}" '
            + shlex.join(["-m", RUNTIME_MODULE, *args]))


def srun_command(layout: Layout, args: list[str], python: str = "python3") -> str:
    """The line to run once inside the allocation (salloc / sbatch): one task per device, rendezvous on the first
    node, as `piper launch`'s job script does (the runtime reads SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID)."""
    srun = ["srun", f"--nodes={layout.nodes}", f"--ntasks={layout.world}",
            f"--ntasks-per-node={layout.ranks_per_node}", f"--cpus-per-task={layout.cpus_per_task}"]
    srun += [f"--gpus-per-task={layout.gpus_per_task}"] if layout.gpus_per_task else []
    srun += list(layout.srun_extra)
    return (f'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) MASTER_PORT={MASTER_PORT} '
            + shlex.join([*srun, python, "-m", RUNTIME_MODULE, *args]))
