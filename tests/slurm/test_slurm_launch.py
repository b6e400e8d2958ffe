"""Real Slurm (tier 6): the local multi-node cluster accepts, runs and requeues what `piper launch` emits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_wait import wait_for_job, wait_until
from launch_plans import platform_dict, write_plan
from piper_plan.cli.main import cli
from piper_plan.launch import submit
from piper_plan.launch.job import prepare, write_job
from piper_plan.launch.render import LaunchOptions

pytestmark = pytest.mark.slurm
HERE = Path(__file__).resolve().parent


def launch(*args):
    return CliRunner().invoke(cli, ["launch", *[str(a) for a in args]])


def cpu_plan(path: Path, nodes: int = 2) -> Path:
    """local-cpu: nodes x devices_per_node CPU ranks, pp=1, ep=2."""
    dpn = platform_dict("local-cpu")["node"]["devices_per_node"]
    return write_plan(path, "local-cpu", nodes, {"dp": nodes * dpn, "ep": 2})


FRONTIER_CASES = [(1, {"pp": 2, "dp": 4, "ep": 4}), (2, {"pp": 2, "dp": 8, "ep": 8}),
                  (4, {"pp": 4, "dp": 8, "ep": 8})]
DGX_CASES = [(1, {"dp": 8, "ep": 8}), (2, {"pp": 2, "dp": 8, "ep": 4})]


LAUNCH_CASES = ([("frontier", n, p, "tiny-moe") for n, p in FRONTIER_CASES]
                + [("frontier", 4, {"dp": 32, "ep": 16}, "switch-base")]       # expert groups span nodes: --switches
                + [("dgx-h100", n, p, "tiny-moe") for n, p in DGX_CASES])


@pytest.mark.parametrize("platform,nodes,parallel,model", LAUNCH_CASES)
def test_sbatch_test_only_accepts_emitted_scripts(slurm_cluster, tmp_path, platform, nodes, parallel, model):
    plan = write_plan(tmp_path / "plan.json", platform, nodes, parallel, model=model)
    result = launch("--plan", plan, "--out", tmp_path / "job", "--account", "piperci", "--check")
    assert result.exit_code == 0, result.output       # --check: sbatch --test-only accepted the written job
    answer = submit.would_accept(tmp_path / "job" / "job.sbatch")
    assert answer.ok, answer.message
    assert "on nodes" in answer.message


def test_too_many_nodes_reports_slurms_reason(slurm_cluster, tmp_path):
    plan = write_plan(tmp_path / "plan.json", "frontier", 8, {"pp": 2, "dp": 32, "ep": 8})
    result = launch("--plan", plan, "--out", tmp_path / "job", "--submit")
    assert result.exit_code == 2
    # Slurm's own words (EnforcePartLimits=ALL in slurm-local.sh, as on sites that reject impossible jobs)
    # ("More processors requested than permitted" for this 64-rank request on 4 batch nodes)
    assert "sbatch refused the job" in result.output
    assert "Batch job submission failed: More processors requested than permitted" in result.output


def test_gloo_all_reduce_across_emulated_nodes(slurm_cluster, tmp_path):
    """The local-cpu template's rendezvous: one srun task per rank on 2 nodes, torch gloo all_reduce."""
    out = tmp_path / "job"
    prepared = prepare(cpu_plan(tmp_path / "plan.json"), out, LaunchOptions(time="00:05:00"), python=sys.executable,
                       command=(sys.executable, str(HERE / "gloo_allreduce_job.py"), str(out)))
    write_job(prepared)
    job_id = submit.submit(prepared.script_path)
    info = wait_for_job(job_id, timeout_s=240)
    assert info.get("JobState") == "COMPLETED", (info, (out / "slurm-%s.out" % info.get("JobId")).read_text())
    status = CliRunner().invoke(cli, ["status", job_id, "--json"])
    assert status.exit_code == 0, status.output
    assert json.loads(status.stdout)["state"] == "COMPLETED" and json.loads(status.stdout)["nodes"] == "node[1-2]"
    world = prepared.job.world
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    assert [r["sum"] for r in records] == [world * (world + 1) / 2] * world  # sum of rank + 1
    assert len({r["node"] for r in records}) == prepared.job.nodes == 2
    assert {r["local_rank"] for r in records} == set(range(prepared.job.ranks_per_node))


def test_usr1_checkpoint_requeue_resume(slurm_cluster, tmp_path):
    """--signal=B:USR1 path: batch shell traps USR1 -> step -> exit 75 -> scontrol requeue -> restart --resume."""
    out = tmp_path / "job"
    prepared = prepare(cpu_plan(tmp_path / "plan.json"), out, LaunchOptions(time="00:05:00"), python=sys.executable,
                       command=(sys.executable, str(HERE / "requeue_job.py"), str(out)))
    write_job(prepared)
    job_id = submit.submit(prepared.script_path)
    events = lambda: [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()] \
        if (out / "events.jsonl").exists() else []  # noqa: E731
    world = prepared.job.world
    wait_until(lambda: sum(e["what"] == "start" for e in events()) == world, 120, "every rank started")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    info = wait_for_job(job_id, timeout_s=240)
    log = (out / f"slurm-{job_id}.out").read_text()
    assert info.get("JobState") == "COMPLETED", (info, log)
    first = [e for e in events() if e["restart"] == 0]
    second = [e for e in events() if e["restart"] == 1]
    assert sorted(e["what"] for e in first) == ["checkpoint"] * world + ["start"] * world
    assert all(not e["resume"] for e in first)
    assert sorted(e["what"] for e in second) == ["done"] * world + ["start"] * world
    assert all(e["resume"] for e in second)
    assert int(info.get("Restarts", 0)) == 1


def test_calibrate_slurm_measures_gemm_attention_and_collectives(slurm_cluster, tmp_path, monkeypatch):
    """`piper calibrate slurm`'s job on 2 nodes: GEMM and attention rows from one task, collective rows at node and
    switch scope from all ranks, its log beside them, nothing in the directory it was submitted from."""
    from piper_plan.calibration.io import read_table
    from piper_plan.calibration.schema import TABLES

    monkeypatch.chdir(tmp_path)
    rows = tmp_path / "rows"
    result = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", "local-cpu", "--nodes", "2", "--quick",
                                      "--out-dir", str(rows), "--python", sys.executable, "--time", "00:10:00",
                                      "--output", str(tmp_path / "cal.sbatch"), "--submit", "--json"])
    assert result.exit_code == 0, result.output
    job_id = json.loads(result.stdout)["job_id"]
    info = wait_for_job(job_id, timeout_s=480)
    log = rows / f"piper-calibrate-local-cpu-{job_id}.out"
    assert info.get("JobState") == "COMPLETED", (info, log.read_text() if log.exists() else "no log")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.sbatch", "rows"]
    for kind in ("gemm", "attention", "collectives"):
        frame = read_table(rows / f"{kind}.csv", TABLES[kind])
        assert len(frame) > 0 and frame["source"].str.startswith("measured: ").all()
    scopes = set(read_table(rows / "collectives.csv", TABLES["collectives"])["scope"])
    assert {"node", "switch"} <= scopes
