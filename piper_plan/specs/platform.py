"""PlatformSpec: a machine's devices, nodes, network and launch settings. Every fact carries a source.

Scopes, from fastest to slowest: ``node`` (intra-node links), ``switch`` (nodes on one switch),
``group`` (one dragonfly group / cabinet), ``system``. Bandwidths are per direction, in GB/s (1e9 B/s).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from piper_plan.specs.base import Spec
from piper_plan.specs.vocab import Precision, Scope

SCOPES: tuple[str, ...] = Scope.values()
"""Scope names, narrowest first (specs.vocab.Scope)."""
"""Network scopes, fastest first; a group of ranks spans the widest scope any two of its ranks cross."""

Dtype = Precision


class DeviceSpec(Spec):
    """One accelerator (one GCD on Frontier) or one CPU rank."""

    name: str
    """Device name as the vendor states it (AMD MI250X GCD)."""
    memory_bytes: PositiveInt
    """Device memory usable by one rank, in bytes."""
    peak_flops: dict[Dtype, PositiveFloat]
    """Dense matrix peak, FLOP/s, per dtype."""
    memory_bandwidth_GBps: PositiveFloat
    """Device memory bandwidth, GB/s."""
    source: str
    """Citation or measuring command for these numbers."""


class LinkClassSpec(Spec):
    """A class of intra-node device-to-device links (Frontier: 200 GB/s GCD pairs, 50-100 GB/s across packages)."""

    name: str
    """Short label (same_package, cross_package)."""
    bandwidth_GBps: PositiveFloat
    """Per direction, GB/s."""
    device_pairs: list[tuple[int, int]] | None = None
    """Local device pairs joined by this class; None = every pair not listed elsewhere."""
    source: str
    """Citation."""


class NodeSpec(Spec):
    """One node: its devices, links and NICs."""

    devices_per_node: PositiveInt
    """Ranks (devices) per node."""
    link_classes: list[LinkClassSpec]
    """Intra-node link classes."""
    num_nics: int = Field(ge=0)
    """Network interfaces per node (0 = single-node machine)."""
    nic_bandwidth_GBps: float = Field(ge=0)
    """Per NIC, per direction, GB/s."""
    device_nic: list[int] | None = None
    """NIC index of each local device (Frontier: the two GCDs of a package share a NIC); None = round robin."""
    source: str
    """Citation."""

    @model_validator(mode="after")
    def _check(self) -> "NodeSpec":
        if self.device_nic is not None:
            if len(self.device_nic) != self.devices_per_node:
                raise ValueError(f"device_nic has {len(self.device_nic)} entries, devices_per_node={self.devices_per_node}")
            bad = [n for n in self.device_nic if not 0 <= n < max(self.num_nics, 1)]
            if bad:
                raise ValueError(f"device_nic names NICs {bad}; allowed 0..{self.num_nics - 1}")
        return self

    @property
    def nic_of_device(self) -> list[int]:
        """NIC index of each local device."""
        if self.device_nic is not None:
            return list(self.device_nic)
        nics = max(self.num_nics, 1)
        per = max(self.devices_per_node // nics, 1)
        return [min(i // per, nics - 1) for i in range(self.devices_per_node)]

    @property
    def min_link_GBps(self) -> float:
        """The slowest intra-node link class, GB/s."""
        return min(c.bandwidth_GBps for c in self.link_classes)

    @property
    def injection_GBps(self) -> float:
        """Node injection bandwidth (all NICs), GB/s."""
        return self.num_nics * self.nic_bandwidth_GBps


class ScopeLinkSpec(Spec):
    """Bandwidth and latency of traffic that crosses one scope."""

    bandwidth_GBps: PositiveFloat
    """Per rank, per direction, GB/s, when every rank of the scope sends at once."""
    latency_us: float = Field(ge=0)
    """One-message latency, microseconds."""
    source: str
    """Citation or derivation."""


class NetworkSpec(Spec):
    """The interconnect between nodes."""

    nodes_per_switch: PositiveInt = 1
    """Nodes on one switch (Frontier: 4 per Rosetta switch)."""
    nodes_per_group: PositiveInt = 1
    """Nodes in one dragonfly group / cabinet (Frontier: 128)."""
    num_groups: PositiveInt = 1
    """Dragonfly groups in the machine."""
    scopes: dict[Scope, ScopeLinkSpec]
    """Per-scope bandwidth/latency: the fallback when calibration data lacks a collective."""
    global_taper: PositiveFloat = 1.0
    """Injection : global-link bandwidth ratio (Frontier ~1.75)."""
    source: str
    """Citation."""

    @property
    def max_nodes(self) -> int:
        return self.nodes_per_group * self.num_groups


class LaunchSpec(Spec):
    """How jobs start on this platform (rendered by piper launch)."""

    template: str
    """sbatch template file under platforms/templates/."""
    backend: Literal["nccl", "gloo"] = "nccl"
    """torch.distributed backend (rccl answers to nccl)."""
    device: Literal["cuda", "cpu"] = "cuda"
    """torch device type of a rank."""
    cpus_per_task: PositiveInt = 1
    """srun -c."""
    gpus_per_task: int = Field(default=1, ge=0)
    """srun --gpus-per-task (0 on CPU platforms)."""
    partition: str | None = None
    """Default partition."""
    sbatch: list[str] = []
    """Extra #SBATCH lines' option text (without '#SBATCH ')."""
    srun: list[str] = []
    """Extra srun options."""
    modules: list[str] = []
    """module load lines."""
    env: dict[str, str] = {}
    """Environment exported in the job."""
    source: str = ""
    """Where these settings come from."""


class EfficiencySpec(Spec):
    """Roofline fallback used when a platform has no calibration CSVs (the output says so)."""

    gemm: float = Field(gt=0, le=1)
    """Fraction of dense peak reached by large GEMMs."""
    attention: float = Field(gt=0, le=1)
    """Fraction of dense peak reached by attention kernels."""
    source: str
    """Citation."""


class MemoryOverheadSpec(Spec):
    """Memory the framework takes beyond the model's own tensors."""

    framework_bytes: int = Field(ge=0)
    """Fixed per-rank overhead (runtime context, communication buffers), bytes."""
    fragmentation: float = Field(ge=0, lt=1)
    """Fraction of the tensor memory lost to allocator fragmentation."""
    source: str
    """Citation or measurement."""


class PlatformSpec(Spec):
    """A machine."""

    name: str = Field(min_length=1)
    """Catalog name (frontier)."""
    description: str = ""
    """One line for people."""
    device: DeviceSpec
    node: NodeSpec
    network: NetworkSpec
    efficiency: EfficiencySpec
    memory: MemoryOverheadSpec
    launch: LaunchSpec
    max_nodes: PositiveInt | None = None
    """Largest allocation the machine can give; None = nodes_per_group x num_groups."""

    @property
    def devices_per_node(self) -> int:
        return self.node.devices_per_node

    @property
    def node_limit(self) -> int:
        return self.max_nodes or self.network.max_nodes

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; bf16 falls back to fp16 and back."""
        peaks = self.device.peak_flops
        for name in (dtype, {"bf16": "fp16", "fp16": "bf16"}.get(dtype, dtype)):
            if name in peaks:
                return peaks[name]
        from piper_plan.errors import PiperError

        raise PiperError(f"platform {self.name} has no peak for dtype={dtype}; has {sorted(str(p) for p in peaks)}",
                         field="device.peak_flops")
