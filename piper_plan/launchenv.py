"""The launcher's environment, read in one place: torchrun's or srun's variables -> rank, world, local rank.

No torch import. Used by the training runtime and by both collective benchmarks (calibration), so that every
process piper starts agrees on who it is.

- torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
- srun:     SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NUM_NODES (or SLURM_NNODES)
- PIPER_EMULATE_TOPOLOGY="NxR" makes consecutive ranks N emulated nodes of R ranks (one host standing in
  for several nodes).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from piper_plan.errors import PiperError

MAX_LOCAL_RANKS = 64
"""Most processes piper starts on one machine itself (`piper bench a2a`, `piper run`; each pays a torch start-up)."""


def signal_name(signum: int) -> str:
    """SIGSEGV for 11; "signal N" for a number no signal has."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_text(returncode: int) -> str:
    """A started process's exit status in words: "exit code 1", or "killed by SIGSEGV" (Popen's -11)."""
    return f"killed by {signal_name(-returncode)}" if returncode < 0 else f"exit code {returncode}"


@dataclass(frozen=True)
class LaunchEnv:
    """Who this process is in the launched job."""

    rank: int
    world_size: int
    local_rank: int
    ranks_per_node: int
    launcher: str
    """"torchrun", "srun" or "none" (a lone process)."""

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def launched(self) -> bool:
        return self.launcher != "none"


def _int(environ: Mapping[str, str], name: str) -> int:
    text = environ[name]
    try:
        return int(text)
    except ValueError:
        raise PiperError(f"{text!r} is not an integer", field=f"environment {name}") from None


def read_launch_env(environ: Mapping[str, str] = os.environ) -> LaunchEnv:
    """The launch environment; a lone process (no launcher variables, or srun with one task) is rank 0 of 1."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        rank, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
        local = _int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0
        per_node = _int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else world
        launcher = "torchrun"
    elif "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ and _int(environ, "SLURM_NTASKS") > 1:
        rank, world = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_NTASKS")
        local = _int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0
        nodes_var = "SLURM_JOB_NUM_NODES" if "SLURM_JOB_NUM_NODES" in environ else "SLURM_NNODES"
        nodes = _int(environ, nodes_var) if nodes_var in environ else 1
        per_node = max(world // max(nodes, 1), 1)
        launcher = "srun"
    else:
        return LaunchEnv(0, 1, 0, 1, "none")
    if not 0 <= rank < world:
        raise PiperError(f"rank {rank} outside world size {world}", field="environment RANK / SLURM_PROCID")
    emulate = environ.get("PIPER_EMULATE_TOPOLOGY")
    if emulate:
        nodes, per_node = _emulated_shape(emulate, world)
        local = rank % per_node
    return LaunchEnv(rank, world, local, per_node, launcher)


def _emulated_shape(text: str, world: int) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() and len(p) <= 7 and int(p) > 0 for p in parts):
        raise PiperError(f"{text!r}; allowed: NODESxRANKS, e.g. 2x4", field="environment PIPER_EMULATE_TOPOLOGY")
    nodes, per_node = int(parts[0]), int(parts[1])
    if nodes * per_node != world:
        raise PiperError(f"{text} makes {nodes * per_node} ranks, the job has {world}",
                         field="environment PIPER_EMULATE_TOPOLOGY")
    return nodes, per_node


def check_visible_devices(visible_devices: int, ranks_per_node: int, launcher: str) -> None:
    """One device per rank of the node: srun with --gpus-per-task=1 shows each task its own one; torchrun and
    `piper run`'s local launcher show every rank all of the node's, which must then be at least one per rank (with
    fewer, device_index puts two ranks on one device, which NCCL refuses after they have started)."""
    if visible_devices >= ranks_per_node or (launcher == "srun" and visible_devices == 1):
        return
    raise PiperError(f"{ranks_per_node} ranks on this node, one device each, but torch sees {visible_devices}: "
                     f"run on a node with {ranks_per_node} devices, or plan for a platform whose node.devices_per_node "
                     f"is {visible_devices}", field="device")


def device_index(local_rank: int, visible_devices: int) -> int:
    """The device this rank uses: with one visible device per task (``--gpus-per-task=1``) always 0, else its
    local rank modulo the visible count."""
    if visible_devices < 1:
        raise PiperError("no accelerator is visible to this process", field="device")
    return local_rank % visible_devices
