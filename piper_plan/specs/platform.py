"""PlatformSpec: a machine's devices, nodes, network and launch settings. Every fact carries a source.

Scopes, from fastest to slowest: ``node`` (intra-node links), ``switch`` (nodes on one switch),
``group`` (one dragonfly group / cabinet), ``system``. Bandwidths are per direction, in GB/s (1e9 B/s).
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from piper_plan.specs.base import Citation, FolderName, Name, Spec
from piper_plan.specs.training import Fp8Recipe
from piper_plan.specs.vocab import Precision, Scope

MAX_NODES = 100_000
"""Most nodes a platform may have or a plan may use (Frontier has 9,408); checked before anything is sized by it."""
MAX_DEVICES_PER_NODE = 1024
"""Most devices (ranks) per node."""
MAX_MEMORY_BYTES = 2**50
"""Largest memory figure (device memory, framework bytes): 1 PiB."""
Flops = Annotated[float, Field(ge=1e6, le=1e18)]
"""A device's peak FLOP/s: between 1 MFLOP/s and 1 EFLOP/s (an H100's dense FP8 peak is about 2e15); outside it
the cost model's times over- or underflow."""
Bandwidth = Annotated[float, Field(ge=1e-3, le=1e6)]
"""A bandwidth in GB/s: between 1 MB/s and 1 PB/s."""
Efficiency = Annotated[float, Field(ge=1e-3, le=1)]
"""A fraction of peak a kernel class reaches: at least 0.1% (below it, a corrupt figure: 5e-324 overflows the time
derived from it), at most 1."""
TEMPLATE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\.sbatch")
"""A launch template is a file name (no folders) ending in .sbatch: platforms/templates/<name>."""

SCOPES: tuple[str, ...] = Scope.values()
"""Scope names, narrowest first (specs.vocab.Scope)."""
"""Network scopes, fastest first; a group of ranks spans the widest scope any two of its ranks cross."""

Dtype = Precision


class DeviceSpec(Spec):
    """One accelerator (one GCD on Frontier) or one CPU rank."""

    name: Name
    """Device name as the vendor states it (AMD MI250X GCD)."""
    memory_bytes: int = Field(ge=1, le=MAX_MEMORY_BYTES)
    """Device memory usable by one rank, in bytes."""
    peak_flops: dict[Dtype, Flops] = Field(min_length=1)
    """Dense matrix peak, FLOP/s, per dtype."""
    memory_bandwidth_GBps: Bandwidth
    """Device memory bandwidth, GB/s."""
    source: Citation
    """Citation or measuring command for these numbers."""


class LinkClassSpec(Spec):
    """A class of intra-node device-to-device links (Frontier: 200 GB/s GCD pairs, 50-100 GB/s across packages)."""

    name: Name
    """Short label (same_package, cross_package)."""
    bandwidth_GBps: Bandwidth
    """Per direction, GB/s."""
    device_pairs: list[tuple[int, int]] | None = None
    """Local device pairs joined by this class; None = every pair not listed elsewhere."""
    source: Citation
    """Citation."""


class NodeSpec(Spec):
    """One node: its devices, links and NICs."""

    devices_per_node: int = Field(ge=1, le=MAX_DEVICES_PER_NODE)
    """Ranks (devices) per node."""
    link_classes: list[LinkClassSpec] = Field(min_length=1)
    """Intra-node link classes."""
    num_nics: int = Field(ge=0, le=MAX_DEVICES_PER_NODE)
    """Network interfaces per node (0 = single-node machine)."""
    nic_bandwidth_GBps: float = Field(ge=0, le=1e6)
    """Per NIC, per direction, GB/s."""
    device_nic: list[int] | None = None
    """NIC index of each local device (Frontier: the two GCDs of a package share a NIC); None = round robin."""
    relay_copy_GBps: float = Field(default=0.0, ge=0, le=1e6)
    """Per rank, GB/s of output of HALO's row copies (the gathers before phases I-III and the final reorder,
    runtime/halo.py) when every rank copies at once; 0 = not priced (cost/comm.py, ``relay_copy_bytes``)."""
    serial_phases: bool = False
    """HALO's phase I does not run beside phases II + III: CPU ranks on fewer cores than ranks, where concurrent
    phases share the same cores (measured: docs/halo-measured.md, phase probe). False: ``max(I, II + III)``."""
    nodes_share_host: bool = False
    """Every node of a job runs on one host (scripts/netemu.sh's emulated network): node-scope work that all nodes
    do at once, the intra-node rows of a multi-node all-to-all (HALO's phases I and III, flat's local rows), shares
    that host's cores, so it takes ``nodes`` x what one node takes alone, as the node-scope calibration measures it
    (bench_collectives times node groups on node 0 only). Measured: docs/halo-measured.md, phase probe."""
    host_step_us: float = Field(default=0.0, ge=0, le=1e7)
    """Microseconds the host adds to every dependent step of an expert all-to-all (a flat exchange is one step,
    each HALO phase one), beyond the network's latency: CPU ranks that outnumber the host's cores wait to be
    scheduled (calibrated on the emulated network: docs/halo-measured.md). 0 = not priced (cost/comm.py)."""
    halo_step_us: float | None = Field(default=None, ge=0, le=1e7)
    """The same for each of HALO's three phases, where it differs from a flat exchange's step (each phase gathers
    rows and posts its sends on per-direction communicators: more host work per step than one all_to_all_single);
    calibrated from a tiny HALO exchange at a rate no predicted point uses. None = host_step_us."""
    host_step_hidden: float = Field(default=0.0, ge=0, le=1)
    """Fraction of a step's host time that runs while the step's inter-node transfer is on the wire (other ranks'
    host work while one rank's bytes cross a shaped link): a step costs its wire time and host step less
    ``host_step_hidden x min(host step, wire time)``. Calibrated from a flat exchange at a rate no predicted point
    uses (docs/halo-measured.md); 0 = the host step adds to the wire time in full (cost/comm.py)."""
    source: Citation
    """Citation."""

    @model_validator(mode="after")
    def _check(self) -> "NodeSpec":
        if self.device_nic is not None:
            if len(self.device_nic) != self.devices_per_node:
                raise ValueError(f"device_nic has {len(self.device_nic)} entries, devices_per_node={self.devices_per_node}")
            bad = [n for n in self.device_nic if not 0 <= n < max(self.num_nics, 1)]
            if bad:
                raise ValueError(f"device_nic names NICs {bad}; allowed 0..{self.num_nics - 1}")
        names = [link.name for link in self.link_classes]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"link class {twice[0]!r} is named twice; each link class needs its own name")
        for link in self.link_classes:
            bad = [p for p in link.device_pairs or [] if p[0] == p[1] or not all(0 <= d < self.devices_per_node for d in p)]
            if bad:
                raise ValueError(f"link class {link.name}: device_pairs {bad[:3]} are not pairs of two local devices "
                                 f"0..{self.devices_per_node - 1}")
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

    bandwidth_GBps: Bandwidth
    """Per rank, per direction, GB/s, when every rank of the scope sends at once."""
    latency_us: float = Field(ge=0, le=1e7)
    """One-message latency, microseconds."""
    source: Citation
    """Citation or derivation."""


class NetworkSpec(Spec):
    """The interconnect between nodes."""

    nodes_per_switch: int = Field(default=1, ge=1, le=MAX_NODES)
    """Nodes on one switch (Frontier: 4 per Rosetta switch)."""
    nodes_per_group: int = Field(default=1, ge=1, le=MAX_NODES)
    """Nodes in one dragonfly group / cabinet (Frontier: 128)."""
    num_groups: int = Field(default=1, ge=1, le=MAX_NODES)
    """Dragonfly groups in the machine."""
    segment_nodes: int | None = Field(default=None, ge=1, le=MAX_NODES)
    """Nodes a job is given per switch when placed compactly, in whole segments that never straddle a switch (Slurm's
    topology/block ``--segment``: a rack-scale NVLink domain); None = switches filled completely."""
    scopes: dict[Scope, ScopeLinkSpec] = Field(min_length=1)
    """Per-scope bandwidth/latency: the fallback when calibration data lacks a collective."""
    global_taper: float = Field(default=1.0, gt=0, le=1000)
    """Injection : global-link bandwidth ratio (Frontier ~1.75): what scopes.system's bandwidth is, scopes.group's
    divided by it (checked where both are listed; the cost model prices the scopes' figures)."""
    a2a_posts_all: bool = False
    """An all-to-all posts every peer's message before it waits for any (gloo's alltoallv): one latency per
    exchange, not one per peer (cost/comm.py). False: one latency per peer (pairwise exchange)."""
    link_burst_bytes: float = Field(default=0.0, ge=0, le=1e12)
    """Bytes an inter-node link passes at once after it was idle, before its rate holds: a shaped link's token
    bucket (tc tbf ``burst``: scripts/netemu.sh sets max(64 KiB, 50 us of traffic)). An exchange's wire time on
    its busiest NIC is then ``max(bytes - burst, 0) / rate`` (cost/comm.py). 0 = no bucket (real NICs)."""
    half_duplex_connections: bool = False
    """One connection carries one direction at a time (gloo over TCP, measured: docs/halo-measured.md), so a
    ``p2p`` calibration row (sendrecv: both ways on one connection) moves its bytes twice over; a one-way
    transfer of b bytes then costs the p2p row of b / 2 (cost/comm.py ``_one_way_seconds``)."""
    source: Citation
    """Citation."""

    @model_validator(mode="after")
    def _check(self) -> "NetworkSpec":
        if self.segment_nodes is not None and self.segment_nodes > self.nodes_per_switch:
            raise ValueError(f"segment_nodes = {self.segment_nodes} exceeds nodes_per_switch = {self.nodes_per_switch}")
        if self.nodes_per_group % self.nodes_per_switch:
            raise ValueError(f"nodes_per_group = {self.nodes_per_group} is not a whole number of switches of "
                             f"nodes_per_switch = {self.nodes_per_switch} (a group is made of whole switches)")
        group, system = self.scopes.get("group"), self.scopes.get("system")
        if group and system and not math.isclose(system.bandwidth_GBps, group.bandwidth_GBps / self.global_taper,
                                                  rel_tol=0.01):
            raise ValueError(f"global_taper = {self.global_taper:g}, but scopes.system.bandwidth_GBps = "
                             f"{system.bandwidth_GBps:g} is not scopes.group's {group.bandwidth_GBps:g} / "
                             f"{self.global_taper:g} = {group.bandwidth_GBps / self.global_taper:.4g} (within 1%): "
                             "the taper is what the global links leave of a group's rate")
        if self.nodes_per_group * self.num_groups > MAX_NODES:
            raise ValueError(f"nodes_per_group x num_groups = {self.nodes_per_group * self.num_groups:,} nodes; "
                             f"at most {MAX_NODES:,}")
        return self

    @property
    def max_nodes(self) -> int:
        """Nodes one job can have: every slot, or under segments ``segment_nodes`` of each switch."""
        slots = self.nodes_per_group * self.num_groups
        if self.segment_nodes is None:
            return slots
        return slots // self.nodes_per_switch * self.segment_nodes


class LaunchSpec(Spec):
    """How jobs start on this platform (rendered by piper launch)."""

    template: str
    """sbatch template file name under platforms/templates/ (a name, never a path: a received plan.json must not
    point a job script at a file of its choosing)."""
    backend: Literal["nccl", "gloo"] = "nccl"
    """torch.distributed backend (rccl answers to nccl)."""
    device: Literal["cuda", "cpu"] = "cuda"
    """torch device type of a rank."""
    cpus_per_task: int = Field(default=1, ge=1, le=4096)
    """srun -c."""
    gpus_per_task: int = Field(default=1, ge=0, le=MAX_DEVICES_PER_NODE)
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

    @field_validator("template")
    @classmethod
    def _template_name(cls, value: str) -> str:
        if not TEMPLATE_NAME_RE.fullmatch(value):
            raise ValueError("not a template name; allowed: a file name ending in .sbatch (letters, "
                             "digits, '.', '_', '-'; no folders) from platforms/templates/")
        return value
    """Where these settings come from."""

    @model_validator(mode="after")
    def _job_script_values(self) -> "LaunchSpec":
        """What `piper launch` writes into a job script is checked when the platform is read (before: `platform
        show` and `estimate -o` took a module name, environment value or option that launch then refused)."""
        from piper_plan.errors import PiperError
        from piper_plan.launch.validate import launch_block

        try:
            launch_block(self)
        except PiperError as exc:
            raise ValueError(exc.message) from None
        return self


class EfficiencySpec(Spec):
    """Roofline fallback used when a platform has no calibration CSVs (the output says so)."""

    gemm: Efficiency
    """Fraction of dense peak reached by large GEMMs."""
    attention: Efficiency
    """Fraction of dense peak reached by attention kernels."""
    gemm_by_dtype: dict[Dtype, Efficiency] = {}
    """Measured GEMM fraction of that dtype's peak where it differs from ``gemm`` (e.g. fp8 matmuls reach a lower
    fraction than bf16 ones); a dtype not named here uses ``gemm``."""
    fp8_recipe_time: dict[Fp8Recipe, Annotated[float, Field(ge=1.0, le=10.0)]] = {}
    """Measured time of an fp8 recipe's linear-layer GEMMs over the fp8 kernel's own (the quantization, amax and
    scale work a GEMM of that recipe carries: 1 to 10); a recipe not named here is priced at the kernel rate and
    the output says so."""
    fp8_blockwise_runs_as_mxfp8: bool = False
    """The device has no blockwise-scaled fp8 GEMM of its own and Transformer Engine runs the blockwise recipe as
    MXFP8 (Blackwell: "On Blackwell (SM100+), FP8 Block is emulated via MXFP8", TransformerEngine docs/examples/
    gemm_profiling/gemm_profiling.rst): an fp8 blockwise run's linear GEMMs are priced at mxfp8's rate, never
    faster than an mxfp8 run's."""
    host_s_per_gemm_call: float = Field(default=0.0, ge=0, le=1e-2)
    """Host seconds per GEMM call of a training step (the Python, framework and launch work of one linear's
    forward, dgrad or wgrad with its casts): a layer cannot run faster than its host work (cost/overhead.py,
    host_floor_terms). 0 = host work always hidden (not priced)."""
    source: Citation
    """Citation."""

    def gemm_fraction(self, dtype: str) -> float:
        """The GEMM efficiency in force for ``dtype``."""
        return self.gemm_by_dtype.get(dtype, self.gemm)


class MemoryOverheadSpec(Spec):
    """Memory the framework takes beyond the model's own tensors."""

    framework_bytes: int = Field(ge=0, le=MAX_MEMORY_BYTES)
    """Fixed per-rank overhead (runtime context, communication buffers), bytes."""
    fragmentation: float = Field(ge=0, lt=1)
    """Fraction of the tensor memory lost to allocator fragmentation."""
    source: Citation
    """Citation or measurement."""


class PlatformSpec(Spec):
    """A machine."""

    name: FolderName
    """Catalog name (frontier); its calibration folder is calibration/<name>/."""
    description: str = ""
    """One line for people."""
    device: DeviceSpec
    node: NodeSpec
    network: NetworkSpec
    efficiency: EfficiencySpec
    memory: MemoryOverheadSpec
    launch: LaunchSpec
    max_nodes: int | None = Field(default=None, ge=1, le=MAX_NODES)
    """Largest allocation the machine can give; None = nodes_per_group x num_groups."""

    @model_validator(mode="after")
    def _check(self) -> "PlatformSpec":
        if self.max_nodes is not None and self.max_nodes > self.network.max_nodes:
            raise ValueError(f"max_nodes = {self.max_nodes:,} exceeds the {self.network.max_nodes:,} nodes the network "
                             "describes (nodes_per_group x num_groups, segments counted): nodes beyond it sit in no "
                             "group; allowed: at most that")
        if self.node_limit > 1 and self.node.injection_GBps == 0:
            raise ValueError(f"node.num_nics={self.node.num_nics}, node.nic_bandwidth_GBps="
                             f"{self.node.nic_bandwidth_GBps:g}: a platform of {self.node_limit:,} nodes needs "
                             "NICs with bandwidth (set max_nodes: 1 for a single-node machine)")
        if self.launch.gpus_per_task > self.devices_per_node:
            raise ValueError(f"launch.gpus_per_task={self.launch.gpus_per_task} exceeds node.devices_per_node="
                             f"{self.devices_per_node}: one task per device; allowed: 0 to {self.devices_per_node}")
        if self.efficiency.fp8_blockwise_runs_as_mxfp8 and self.peak_dtype("mxfp8") is None:
            raise ValueError("efficiency.fp8_blockwise_runs_as_mxfp8=true prices fp8 blockwise GEMMs at mxfp8's "
                             "rate: device.peak_flops needs an mxfp8 entry")
        if self.node_limit > 1 and set(self.network.scopes) == {"node"}:
            raise ValueError(f"network.scopes lists only 'node': a platform of {self.node_limit:,} nodes needs the "
                             "scopes its inter-node traffic crosses (switch, and group / system where they differ; "
                             "an unlisted scope is priced as the next wider one listed), or max_nodes: 1")
        return self

    @property
    def devices_per_node(self) -> int:
        return self.node.devices_per_node

    @property
    def node_limit(self) -> int:
        return self.max_nodes or self.network.max_nodes

    def peak_dtype(self, dtype: str) -> str | None:
        """Whose entry of device.peak_flops prices ``dtype``: its own, else (bf16 / fp16) the other 16-bit
        format's; None where neither is listed."""
        peaks = self.device.peak_flops
        return next((name for name in (dtype, {"bf16": "fp16", "fp16": "bf16"}.get(dtype, dtype)) if name in peaks),
                    None)

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (peak_dtype's entry)."""
        peaks, name = self.device.peak_flops, self.peak_dtype(dtype)
        if name is not None:
            return peaks[name]
        from piper_plan.errors import PiperError

        raise PiperError(f"platform {self.name} has no peak for dtype={dtype}; has {sorted(str(p) for p in peaks)}",
                         field="device.peak_flops")
