"""Ranks on an emulated multi-node network: the Python side of ``scripts/netemu.sh`` (no torch).

``--emulate-network uplink_GBps=0.2,uplinks=2[,latency_us=L]`` names a network: every emulated node is a Linux
network namespace with ``uplinks`` rate-limited uplinks (tc tbf) into a bridge namespace, ranks of one node share
its namespace (loopback inside the node). ``run_on_network`` asks the script to build it, start the ranks inside
it (torchrun-style variables, gloo over the uplink addresses 10.231.<uplink>.<node+1>) and remove it afterwards,
whatever happened. Root and iproute2 are needed; without them the script refuses in one line (exit 3), which
becomes a PiperError here.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from piper_plan.errors import PiperError

REFUSED_EXIT = 3
"""scripts/netemu.sh's exit status when it cannot or will not run (not root, no iproute2, bad argument)."""
FIELDS = ("uplink_GBps", "uplinks", "latency_us")
MAX_LATENCY_US = 1_000_000
"""Largest added one-way latency (a second: beyond any network piper plans for)."""
_PLAIN_NUMBER = re.compile(r"[0-9]{1,12}(?:\.[0-9]{0,12})?|\.[0-9]{1,12}", re.ASCII)
"""What a value may be: up to 12 ASCII digits with an optional decimal point and up to 12 more (no sign, exponent,
underscore or other digits)."""


@dataclass(frozen=True)
class NetworkSpec:
    """An emulated network: per node ``uplinks`` uplinks of ``uplink_GBps`` each way; optional added latency."""

    uplink_GBps: float
    uplinks: int = 1
    latency_us: int = 0

    @property
    def burst_bytes(self) -> float:
        """The tbf bucket scripts/netemu.sh gives every uplink direction (``shape``: max(64 KiB, 50 us of
        traffic)): what a link passes at line speed after it was idle (platform network.link_burst_bytes)."""
        return max(65536.0, round(self.uplink_GBps * 1e9 * 50e-6))

    @property
    def text(self) -> str:
        """The ``--emulate-network`` spelling."""
        extra = f",latency_us={self.latency_us}" if self.latency_us else ""
        return f"uplink_GBps={self.uplink_GBps:g},uplinks={self.uplinks}{extra}"


def parse_network(text: str) -> NetworkSpec:
    """``"uplink_GBps=0.2,uplinks=2"`` -> NetworkSpec(0.2, 2); a bad item is one line naming it."""
    allowed = "allowed: uplink_GBps=<GB/s per uplink>,uplinks=<count>[,latency_us=<us>], e.g. uplink_GBps=0.2,uplinks=2"
    values: dict[str, str] = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        key, _, value = item.partition("=")
        if key not in FIELDS or not value:
            raise PiperError(f"{item!r} unknown; {allowed}", field="--emulate-network")
        if key in values:
            raise PiperError(f"{key} given twice in {text!r}; {allowed}", field="--emulate-network")
        if not _PLAIN_NUMBER.fullmatch(value):
            raise PiperError(f"{item!r}: {value[:40]!r} is not a plain number (up to 12 ASCII digits, a point, up to 12 more); {allowed}", field="--emulate-network")
        values[key] = value
    if "uplink_GBps" not in values:
        raise PiperError(f"{text!r} has no uplink_GBps; {allowed}", field="--emulate-network")
    try:
        spec = NetworkSpec(float(values["uplink_GBps"]), int(values.get("uplinks", 1)), int(values.get("latency_us", 0)))
    except ValueError:
        raise PiperError(f"{text!r}: uplinks and latency_us are whole numbers; {allowed}", field="--emulate-network") from None
    if not (0.001 <= spec.uplink_GBps <= 10 and 1 <= spec.uplinks <= 8 and 0 <= spec.latency_us <= MAX_LATENCY_US):
        raise PiperError(f"{text!r}: uplink_GBps 0.001..10, uplinks 1..8, latency_us 0..{MAX_LATENCY_US:,}",
                         field="--emulate-network")
    return spec


def script_path() -> Path:
    path = Path(__file__).resolve().parents[2] / "scripts" / "netemu.sh"
    if not path.is_file():
        raise PiperError(f"{path} not found: the emulated network needs piper's source tree (scripts/netemu.sh)")
    return path


def network_args(spec: NetworkSpec, nodes: int, name: str) -> list[str]:
    """scripts/netemu.sh options for ``spec`` on ``nodes`` nodes."""
    args = ["--name", name, "--nodes", str(nodes), "--uplinks", str(spec.uplinks), "--uplink-GBps", f"{spec.uplink_GBps:g}"]
    return args + (["--latency-us", str(spec.latency_us)] if spec.latency_us else [])


def unique_name() -> str:
    """A network name no other process of this host uses at the same time (the script allows 8 characters)."""
    return f"p{os.getpid() % 10**7}"


def run_on_network(spec: NetworkSpec, nodes: int, ranks_per_node: int, command: list[str], timeout_s: float,
                   name: str | None = None) -> subprocess.CompletedProcess:
    """Build the network, run ``command`` as ``nodes x ranks_per_node`` ranks inside it, remove it; raise on failure."""
    if nodes < 2:
        raise PiperError(f"{nodes} node(s): an emulated network needs at least 2", field="--nodes")
    args = [str(script_path()), "run", *network_args(spec, nodes, name or unique_name()),
            "--ranks-per-node", str(ranks_per_node), "--timeout", str(int(timeout_s)), "--", *command]
    done = subprocess.run(args, capture_output=True, text=True, cwd=os.getcwd(), timeout=timeout_s + 60)
    if done.returncode == REFUSED_EXIT:
        raise PiperError(_last_line(done.stderr, "scripts/netemu.sh refused"))
    if done.returncode != 0:
        raise PiperError(f"ranks on the emulated network failed (exit {done.returncode}): "
                         f"{_last_line(done.stderr, 'no output')}")
    return done


def _last_line(text: str, default: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip() and not re.match(r"^\s*(File|\^)", ln)]
    return lines[-1] if lines else default
