"""HALO: the plan is a permutation equal to all_to_all_single's (pure, many cases), and the torch
dispatcher equals all_to_all_single exactly, gradients included, on 2x2, 2x4 and 4x2 emulated topologies."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from piper_plan.errors import PiperError
from piper_plan.runtime.halo import node_members, plan_exchange, relay_of
from piper_plan.runtime.topology import (emulated_topology, parse_emulate, topology_from_env,
                                         topology_from_node_keys)

sys.path.insert(0, str(Path(__file__).parent))  # halo_worker, importable by spawned ranks too

FRONTIER_NIC = [0, 0, 1, 1, 2, 2, 3, 3]  # platforms/frontier.yaml device_nic (OLCF guide: 2 GCDs per NIC)


# ---------------------------------------------------------------- topology

def test_topology_from_node_keys_numbers_nodes_by_first_appearance():
    topo = topology_from_node_keys(["b", "a", "b", "a", "b"], devices_per_node=8, device_nic=FRONTIER_NIC)
    assert topo.node_of_rank == (0, 1, 0, 1, 0)
    assert topo.local_rank_of_rank == (0, 0, 1, 1, 2)
    assert topo.nic_of_rank == (0, 0, 0, 0, 1)
    assert topo.num_nodes == 2 and topo.ranks_on_node(1) == [1, 3]


def test_emulate_env_overrides_and_checks_world(monkeypatch):
    monkeypatch.setenv("PIPER_EMULATE_TOPOLOGY", "4x2")
    topo = topology_from_env(8, devices_per_node=8, device_nic=FRONTIER_NIC)
    assert topo.node_of_rank == (0, 0, 1, 1, 2, 2, 3, 3)
    assert topo.nic_of_rank == (0, 0) * 4
    with pytest.raises(PiperError, match="has 8 ranks, the job has 6"):
        topology_from_env(6, devices_per_node=8, device_nic=None)
    assert parse_emulate(" 2X4 ") == (2, 4)
    with pytest.raises(PiperError, match="NODESxRANKS_PER_NODE"):
        parse_emulate("2x0")


def test_without_process_group_all_ranks_share_this_node(monkeypatch):
    monkeypatch.delenv("PIPER_EMULATE_TOPOLOGY", raising=False)
    monkeypatch.setenv("SLURM_NODEID", "3")
    topo = topology_from_env(2, devices_per_node=8, device_nic=FRONTIER_NIC)
    assert topo.node_of_rank == (0, 0) and topo.local_rank_of_rank == (0, 1)
    assert topology_from_env(3, devices_per_node=2, device_nic=[0, 1]).nic_of_rank == (0, 1, 0)  # CPU ranks wrap


# ---------------------------------------------------------------- pure plan

def test_relays_are_nic_affine_on_two_frontier_nodes():
    topo = emulated_topology(2, 8, 8, FRONTIER_NIC)
    relays = [relay_of(s, 1, topo.node_of_rank, topo.nic_of_rank) for s in range(8)]
    assert relays == list(range(8, 16))  # local rank j of node 0 -> local rank j of node 1
    nics_used = [topo.nic_of_rank[r] for r in relays]
    assert sorted(nics_used) == [0, 0, 1, 1, 2, 2, 3, 3]  # all 4 NICs carry 2 GCDs' traffic each


def test_hand_worked_plan_on_two_nodes_of_two():
    # Ranks 0,1 on node 0; 2,3 on node 1; equal NICs, so relay(0)=2, relay(1)=3 and back.
    counts = np.array([[1, 2, 3, 4],
                       [0, 0, 5, 0],
                       [6, 0, 0, 1],
                       [0, 7, 2, 0]])
    plan = plan_exchange(counts, 0, node_of=[0, 0, 1, 1], nic_of=[0, 1, 0, 1])
    assert plan.intra_send_splits == [1, 2] and plan.intra_recv_splits == [1, 0]
    assert plan.inter_sends == [(2, 3 + 4)]                   # rows 3..9 of x, all to relay 2
    assert plan.inter_send_index.tolist() == list(range(3, 10))
    assert plan.inter_recvs == [(2, 6 + 0)]                   # rank 0 relays rank 2's rows for node 0
    assert plan.relay_send_splits == [6, 0]                   # 6 rows for itself, none for rank 1 (counts[2, 1] = 0)
    assert plan.relay_recv_splits == [6, 0]                   # via relay 0: counts[2, 0]; via relay 1: counts[3, 0]
    # result grouped by source: 1 row from 0, 0 from 1, 6 from 2, 0 from 3
    assert plan.output_index.tolist() == [0] + list(range(1, 7))


def simulate(counts: np.ndarray, node_of: list[int], nic_of: list[int]) -> None:
    """Run every rank's plan with numpy as the wire; assert each result equals all_to_all_single's."""
    size = len(node_of)
    rows = [np.array([(s, d, i) for d in range(size) for i in range(counts[s, d])], dtype=np.int64).reshape(-1, 3)
            for s in range(size)]
    plans = [plan_exchange(counts, g, node_of, nic_of) for g in range(size)]
    members = node_members(node_of)
    intra_out = {g: _intra(plans, members[node_of[g]], g, rows, "intra") for g in range(size)}
    wire = {}
    for s in range(size):
        packed, offset = rows[s][plans[s].inter_send_index], 0
        for peer, n in plans[s].inter_sends:
            wire[(s, peer)], offset = packed[offset:offset + n], offset + n
        assert offset == len(packed)
    relay_in = {g: np.concatenate([wire.pop((src, g)) for src, _ in plans[g].inter_recvs] + [np.zeros((0, 3), int)])
                for g in range(size)}
    assert not wire, f"unreceived messages {list(wire)}"
    for g in range(size):
        relay_out = _intra(plans, members[node_of[g]], g, relay_in, "relay")
        got = np.concatenate([intra_out[g], relay_out])[plans[g].output_index]
        want = np.concatenate([rows[s][rows[s][:, 1] == g] for s in range(size)])
        assert np.array_equal(got, want), (g, got.tolist(), want.tolist())


def _intra(plans, mine, g, inputs, phase):
    """Rank g's output of an all_to_all_single among ``mine`` (phase 'intra' reads x, 'relay' the relay buffer)."""
    parts = []
    for s in mine:
        index, splits = getattr(plans[s], f"{phase}_send_index"), getattr(plans[s], f"{phase}_send_splits")
        offsets = np.cumsum([0] + splits)
        k = mine.index(g)
        parts.append(inputs[s][index][offsets[k]:offsets[k + 1]])
    assert [len(p) for p in parts] == getattr(plans[g], f"{phase}_recv_splits")
    return np.concatenate(parts + [np.zeros((0, 3), int)])


@st.composite
def layouts(draw):
    """A group of 1..9 ranks on 1..4 nodes (any order, uneven), NICs, and a count matrix with zeros."""
    size = draw(st.integers(1, 9))
    node_of = draw(st.lists(st.integers(0, 3), min_size=size, max_size=size))
    nic_of = draw(st.lists(st.integers(0, 3), min_size=size, max_size=size))
    flat = draw(st.lists(st.integers(0, 4) | st.just(0), min_size=size * size, max_size=size * size))
    return np.array(flat, dtype=np.int64).reshape(size, size), node_of, nic_of


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_plan_equals_all_to_all_single(layout):
    simulate(*layout)


# ---------------------------------------------------------------- torch, spawned ranks

EP_CONFIGS = {  # (nodes, ranks per node) -> EP groups: whole world, per node, across nodes, uneven / partial
    (2, 2): [[[0, 1, 2, 3]], [[0, 2], [1, 3]], [[0, 1], [2, 3]], [[0, 1, 2]]],
    (2, 4): [[list(range(8))], [[0, 1, 4, 5], [2, 3, 6, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]],
             [[0, 1, 2, 4], [3, 5, 6, 7]]],
    (4, 2): [[list(range(8))], [[0, 2, 4, 6], [1, 3, 5, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]], [[1, 2, 3, 4, 5, 6]]],
}
CASES_PER_CONFIG = 6


def count_matrices(sizes: list[int], num: int) -> list[list[list[list[int]]]]:
    """``num`` hypothesis-drawn cases; each holds one count matrix per EP group (zeros, empty ranks)."""
    cases = []

    @st.composite
    def matrix(draw, size):
        counts = np.array(draw(st.lists(st.integers(0, 6) | st.just(0), min_size=size * size,
                                        max_size=size * size))).reshape(size, size)
        if draw(st.booleans()):
            counts[draw(st.integers(0, size - 1)), :] = 0  # a rank that sends nothing
        if draw(st.booleans()):
            counts[:, draw(st.integers(0, size - 1))] = 0  # a rank that receives nothing
        return counts.tolist()

    @settings(max_examples=num, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.tuples(*[matrix(s) for s in sizes]))
    def collect(case):
        cases.append(list(case))

    collect()
    return cases[:num]


def prepared_configs(topo) -> tuple[list[dict], int]:
    configs, expected_checks = [], 0
    for i, groups in enumerate(EP_CONFIGS[topo]):
        matrices = count_matrices([len(g) for g in groups], CASES_PER_CONFIG)
        cases = [{"counts": m, "dim": 1 + k % 3, "seed": 100 * i + k} for k, m in enumerate(matrices)]
        configs.append({"ep_groups": groups, "cases": cases})
        expected_checks += sum(len(g) for g in groups) * (5 * len(cases) + 3)
    return configs, expected_checks


def run_exchange_cases(topo, out_dir: Path, train_plans: dict | None = None) -> None:
    """One spawn: every EP configuration's cases; each rank's checks and errors land in out_dir."""
    from halo_worker import run_cases

    from piper_plan.calibration.bench_a2a import spawn_gloo

    configs, expected_checks = prepared_configs(topo)
    assert all(len(c["cases"]) == CASES_PER_CONFIG for c in configs)
    spawn_gloo(run_cases, topo[0] * topo[1], topo, configs, str(out_dir), train_plans, timeout_s=120)
    reports = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(topo[0] * topo[1])]
    errors = [e for r in reports for e in r["errors"]]
    assert errors == []
    assert sum(r["checks"] for r in reports) == expected_checks


@pytest.mark.distributed
@pytest.mark.parametrize("topo", [(2, 4), (4, 2)], ids=["2x4", "4x2"])
def test_halo_equals_all_to_all_single_on_emulated_nodes(topo, tmp_path):
    run_exchange_cases(topo, tmp_path)


@pytest.mark.distributed
def test_2x2_halo_equals_all_to_all_single_and_training_with_halo_equals_flat(tmp_path):
    # Training: pp=1, dp=ep=4 on 2 emulated nodes x 2, so every MoE layer's EP group spans both nodes.
    import torch
    from plans import plan_dict

    plans = {}
    for a2a in ("flat", "halo"):
        plans[a2a] = plan_dict(pp=1, dp=4, ep=4, num_microbatches=2)
        plans[a2a]["parallel"]["a2a"] = a2a
    run_exchange_cases((2, 2), tmp_path, plans)
    for rank in range(4):
        run = torch.load(tmp_path / f"train{rank}.pt", weights_only=False)
        assert (run["flat"]["dispatcher"], run["halo"]["dispatcher"]) == ("FlatDispatcher", "HaloDispatcher")
        assert None not in run["flat"]["losses"]
        assert run["halo"]["losses"] == run["flat"]["losses"]  # bit for bit: HALO moves the same rows
        for step, (g_halo, g_flat) in enumerate(zip(run["halo"]["grads"], run["flat"]["grads"])):
            assert g_halo.keys() == g_flat.keys()
            for name in g_flat:
                assert torch.equal(g_halo[name], g_flat[name]), f"rank {rank} step {step} {name}"


def test_simulation_catches_a_wrong_plan(monkeypatch):
    # the check can fail: reverse rank 0's output order and the simulated result no longer matches
    counts = np.array([[0, 1, 1, 0], [1, 0, 0, 2], [0, 1, 0, 1], [3, 0, 1, 0]])
    node_of, nic_of = [0, 0, 1, 1], [0, 1, 0, 1]
    original = plan_exchange

    def wrong(c, me, n, k):
        plan = original(c, me, n, k)
        return replace(plan, output_index=plan.output_index[::-1].copy()) if me == 0 else plan

    simulate(counts, node_of, nic_of)
    monkeypatch.setitem(globals(), "plan_exchange", wrong)
    with pytest.raises(AssertionError):
        simulate(counts, node_of, nic_of)


def test_collective_rows_follow_nccl_tests_definitions():
    from types import SimpleNamespace

    from piper_plan.calibration.bench_a2a import BenchResult, SizeResult, collective_rows, message_shape
    from piper_plan.calibration.bench_collectives import scope_of_nodes

    result = BenchResult(2, 4, "gloo", True, (SizeResult(8192, {"flat": 0.002, "halo": 0.004}),))
    rows = {r["op"]: r for r in collective_rows(result, "switch", "measured: test")}
    assert rows["all_to_all"]["algbw_GBps"] == pytest.approx(8192 / 0.002 / 1e9)        # 4.096e-3 GB/s
    assert rows["halo_all_to_all"]["busbw_GBps"] == pytest.approx(8192 / 0.004 / 1e9 * 7 / 8)
    assert {r["num_nodes"] for r in rows.values()} == {2} and rows["all_to_all"]["ranks_per_node"] == 4
    assert message_shape(4096, 8) == (2, 64)      # 4096 B / 8 peers = 512 B = 2 rows of 64 float32
    assert message_shape(64, 8) == (1, 2)         # 8 B per peer: one row of 2 float32
    network = SimpleNamespace(nodes_per_switch=4, nodes_per_group=128)
    assert [scope_of_nodes(n, network) for n in (1, 4, 5, 129)] == ["node", "switch", "group", "system"]


@pytest.mark.distributed
def test_bench_cli_verifies_and_writes_rows(tmp_path):
    from click.testing import CliRunner

    from piper_plan.calibration.io import read_table
    from piper_plan.calibration.schema import COLLECTIVES
    from piper_plan.cli.main import cli

    args = ["bench", "a2a", "--nodes", "2", "--ranks-per-node", "1", "--sizes", "4K,16K", "--verify",
            "--repeats", "1", "--platform", "local-cpu", "--out-dir", str(tmp_path), "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and [s["checks"] for s in report["sizes"]] == [10, 10]  # 5 checks x 2 ranks
    frame = read_table(tmp_path / "collectives.csv", COLLECTIVES)
    assert sorted(frame["op"]) == ["all_to_all"] * 2 + ["halo_all_to_all"] * 2
    assert sorted(set(frame["bytes_per_rank"])) == [4096, 16384]
    ratio = frame["busbw_GBps"] / frame["algbw_GBps"]
    assert np.allclose(ratio, 1 / 2, rtol=1e-4)  # nccl-tests alltoall busbw = algbw x (n-1)/n, n = 2


@pytest.mark.slurm
def test_bench_under_srun_detects_nodes_from_slurm(tmp_path):
    # 2 Slurm nodes x 2 tasks (scripts/slurm-local.sh): the topology comes from SLURM_NODEID, not emulation.
    import os
    import shutil
    import subprocess

    from piper_plan.calibration.bench_a2a import free_port

    ok = shutil.which("srun") and subprocess.run(["sinfo", "-h"], capture_output=True, timeout=10).returncode == 0
    if not ok:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("local Slurm unavailable under CI=true; run scripts/slurm-local.sh")
        pytest.skip("local Slurm unavailable; run scripts/slurm-local.sh")
    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "bench.sh"
    script.write_text(f"#!/bin/bash\nexport MASTER_ADDR=127.0.0.1 MASTER_PORT={free_port()} OMP_NUM_THREADS=1\n"
                      f"cd {root}\nunset PIPER_EMULATE_TOPOLOGY\n"
                      f"exec {Path(sys.executable).parent / 'piper'} bench a2a --verify --sizes 4K --repeats 1 "
                      f"--no-save --json\n")
    script.chmod(0o755)
    proc = subprocess.run(["srun", "-p", "cpu", "-N", "2", "-n", "4", "--ntasks-per-node=2", str(script)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert (report["num_nodes"], report["ranks_per_node"], report["emulated"]) == (2, 2, False)
    assert report["passed"] and report["sizes"][0]["checks"] == 20
