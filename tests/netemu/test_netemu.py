"""The emulated multi-node network (scripts/netemu.sh): it comes up and goes away leaving nothing behind, refuses
what it cannot do in one line, shapes the uplinks, and HALO equals all_to_all_single over it.

Tests marked ``netemu`` need root and iproute2; they skip without them, except under CI=true, where they fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from piper_plan.calibration.netemu import NetworkSpec, parse_network, script_path
from piper_plan.errors import PiperError

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(script_path())
NAME = f"t{os.getpid() % 10**6}"


@pytest.fixture
def netemu_host():
    """Root and iproute2, or skip (fail under CI=true)."""
    missing = [why for ok, why in ((os.geteuid() == 0, "root"), (shutil.which("ip") and shutil.which("tc"), "iproute2"))
               if not ok]
    if missing:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"the emulated network needs {' and '.join(missing)} (CI=true: never skipped)")
        pytest.skip(f"the emulated network needs {' and '.join(missing)}")
    yield
    subprocess.run([SCRIPT, "down", "--name", NAME], capture_output=True, timeout=60)


def netemu(*args: str, timeout: float = 60, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=timeout, env=env)


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{NAME}-")]


def root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def test_network_spec_parses_and_refuses_in_one_line():
    assert parse_network("uplink_GBps=0.2,uplinks=2") == NetworkSpec(0.2, 2)
    assert parse_network(" uplink_GBps=0.05 ").uplinks == 1
    assert NetworkSpec(0.2, 2).text == "uplink_GBps=0.2,uplinks=2"
    for bad, needle in (("uplinks=2", "no uplink_GBps"), ("uplink_GBps=fast", "not a plain number"),
                        ("uplink_GBps=0.2,nics=2", "'nics=2' unknown"), ("uplink_GBps=0.2,uplinks=0", "uplinks 1..8"),
                        ("uplink_GBps=1,uplink_GBps=2", "given twice"), ("uplink_GBps=1_0", "not a plain number"),
                        ("uplink_GBps=\uff12", "not a plain number"), ("", "no uplink_GBps"),
                        ("uplink_GBps=0.2,latency_us=2000000", "latency_us 0..1,000,000"),
                        ("uplink_GBps=0.2,latency_us=99999999999999999", "not a plain number")):
        with pytest.raises(PiperError, match=needle) as err:
            parse_network(bad)
        assert "\n" not in str(err.value) and "--emulate-network" in str(err.value)
    from click.testing import CliRunner

    from piper_plan.cli.main import cli

    result = CliRunner().invoke(cli, ["bench", "a2a", "--emulate-network", "uplinks=2", "--no-save"])
    assert result.exit_code == 2 and "no uplink_GBps" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(cli, ["bench", "a2a", "--emulate-network", "", "--no-save"])   # not "no network"
    assert result.exit_code == 2 and "no uplink_GBps" in result.output


@pytest.mark.netemu
@pytest.mark.distributed  # starts rank processes in namespaces: the multi-process tier
def test_network_comes_up_shaped_and_goes_away_leaving_nothing(netemu_host):
    before = root_links()
    up = netemu("up", "--name", NAME, "--nodes", "3", "--uplinks", "2", "--uplink-GBps", "0.1")
    assert up.returncode == 0, up.stderr
    assert f"netemu {NAME}: 3 nodes" in up.stderr and "10.231.k.(i+1)/24" in up.stderr  # says what it set up
    assert sorted(namespaces()) == sorted([f"{NAME}-br", f"{NAME}-n0", f"{NAME}-n1", f"{NAME}-n2"])
    addrs = subprocess.run(["ip", "-n", f"{NAME}-n2", "-br", "addr"], capture_output=True, text=True).stdout
    assert "10.231.0.3/24" in addrs and "10.231.1.3/24" in addrs
    qdiscs = subprocess.run(["tc", "-n", f"{NAME}-br", "qdisc", "show"], capture_output=True, text=True).stdout
    assert qdiscs.count("tbf") == 6 and "rate 800Mbit" in qdiscs  # 0.1 GB/s into each of 3 x 2 uplinks
    bursts = {float(b) for b in re.findall(r"burst (\d+)b", qdiscs)}  # the bucket the model prices, as tc keeps it
    assert bursts and all(b == pytest.approx(NetworkSpec(0.1, 2).burst_bytes, rel=0.01) for b in bursts), qdiscs
    routes = subprocess.run(["ip", "-n", f"{NAME}-n0", "route"], capture_output=True, text=True).stdout
    assert "default" not in routes  # nothing routed outside the emulated subnets
    assert root_links() == before  # the host's own namespace is untouched
    again = netemu("up", "--name", NAME, "--nodes", "2", "--uplink-GBps", "0.1")
    assert again.returncode == 3 and "already up" in again.stderr
    assert netemu("down", "--name", NAME).returncode == 0
    assert namespaces() == [] and root_links() == before


@pytest.mark.netemu
@pytest.mark.distributed  # starts rank processes in namespaces: the multi-process tier
def test_run_removes_the_network_after_a_failing_or_hanging_command(netemu_host):
    failed = netemu("run", "--name", NAME, "--nodes", "2", "--ranks-per-node", "2", "--uplink-GBps", "0.1", "--",
                    "sh", "-c", 'test "$RANK" != 3')  # rank 3 fails: the others stop, the exit status is its
    assert failed.returncode == 1 and namespaces() == []
    hung = netemu("run", "--name", NAME, "--nodes", "2", "--uplink-GBps", "0.1", "--timeout", "1", "--", "sleep", "30")
    assert hung.returncode == 124 and "still running after 1 s" in hung.stderr and namespaces() == []


@pytest.mark.netemu
def test_refusals_are_one_line(netemu_host, tmp_path):
    cases = [(["up", "--name", NAME, "--nodes", "2", "--uplink-GBps", "0.1", "--latency-us", "100"], "sch_netem"),
             (["up", "--name", NAME, "--nodes", "1", "--uplink-GBps", "0.1"], "--nodes '1'"),
             (["up", "--name", NAME, "--nodes", "2", "--uplink-GBps", "abc"], "--uplink-GBps 'abc'")]
    netem = subprocess.run(["sh", "-c", "modinfo sch_netem || ls /sys/module/sch_netem"], capture_output=True)
    if netem.returncode == 0:
        cases = cases[1:]  # this kernel has netem: a latency is honoured, not refused
    for args, needle in cases:
        done = netemu(*args)
        assert done.returncode == 3 and needle in done.stderr and done.stderr.count("\n") == 1, done.stderr
    bare = tmp_path / "bin"  # a PATH with the shell's tools but without ip and tc
    bare.mkdir()
    for tool in ("id", "awk", "grep"):
        (bare / tool).symlink_to(shutil.which(tool))
    no_iproute = subprocess.run(["/bin/bash", SCRIPT, "up", "--name", NAME, "--nodes", "2", "--uplink-GBps", "0.1"],
                                capture_output=True, text=True, timeout=30, env={**os.environ, "PATH": str(bare)})
    assert no_iproute.returncode == 3 and "needs iproute2" in no_iproute.stderr
    if shutil.which("setpriv"):
        user = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SCRIPT, "up", "--nodes",
                               "2", "--uplink-GBps", "0.1"], capture_output=True, text=True, timeout=30)
        assert user.returncode == 3 and "needs root" in user.stderr
    assert namespaces() == []


@pytest.mark.netemu
@pytest.mark.distributed
def test_shaping_holds_and_halo_equals_all_to_all_single_over_the_network(netemu_host, tmp_path):
    # One network, one spawn: one-way p2p across an uplink (shaped) and inside a node (loopback, unshaped) ...
    out = tmp_path / "shaping.json"
    done = netemu("run", "--name", NAME, "--nodes", "2", "--ranks-per-node", "2", "--uplinks", "2",
                  "--uplink-GBps", "0.1", "--", sys.executable, "-m", "piper_plan.calibration.bench_shaping",
                  str(out), str(4 * 2**20), timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    rates = json.loads(out.read_text())
    assert 0.08 <= rates["inter_node_GBps"] <= 0.11, rates  # set: 0.1 GB/s per uplink (tbf); -20% (load) / +10% here
    assert rates["intra_node_GBps"] > 0.3, rates  # loopback inside the node: not shaped
    assert rates["statistic"] == "fastest of 5", rates  # a link's capacity: noise on a shared host only adds time
    # both ways at once: one gloo connection carries one direction at a time, two communicators both (HALO phase II)
    assert rates["two_way_two_connections_GBps"] > 1.4 * rates["two_way_one_connection_GBps"], rates
    assert namespaces() == []
    # ... then HALO against all_to_all_single, outputs and gradients, over the emulated network (the CLI path).
    from click.testing import CliRunner

    from piper_plan.cli.main import cli

    args = ["bench", "a2a", "--nodes", "2", "--ranks-per-node", "2", "--emulate-network", "uplink_GBps=0.1,uplinks=2",
            "--algo", "flat,halo", "--sizes", "4K,64K", "--verify", "--repeats", "1", "--no-save", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert report["passed"] and report["network"] == "uplink_GBps=0.1,uplinks=2"
    assert [s["checks"] for s in report["sizes"]] == [20, 20]  # 5 checks x 4 ranks per size
    assert [s["bytes_per_rank"] for s in report["sizes"]] == [4096, 65536]
    assert all(set(s["seconds"]) == {"flat", "halo"} for s in report["sizes"])
    assert namespaces() == []
