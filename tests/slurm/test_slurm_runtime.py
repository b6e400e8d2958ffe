"""Real Slurm end to end with piper's runtime: launch -> train tiny MoE on 2 emulated nodes -> compare;
USR1 -> checkpoint -> requeue -> resume gives the same final loss as an uninterrupted run."""

from __future__ import annotations

import json
import subprocess

import pytest
from click.testing import CliRunner

from slurm_wait import wait_for_job, wait_until
from piper_plan.cli.main import cli
from test_slurm_launch import cpu_plan, launch

pytestmark = pytest.mark.slurm


def data_pp(plan) -> int:
    return json.loads(plan.read_text())["parallel"]["pp"]


def submit_train_compare(plan, tmp_path) -> dict:
    """piper launch --submit (4 steps) -> wait for the job -> piper compare --json of its run."""
    result = launch("--plan", plan, "--out", tmp_path / "job", "--submit", "--json", "--steps", "4", "--time", "00:08:00")
    assert result.exit_code == 0, result.output
    job_id = json.loads(result.stdout)["job_id"]
    info = wait_for_job(job_id, timeout_s=400)
    assert info.get("JobState") == "COMPLETED", (tmp_path / "job" / f"slurm-{job_id}.out").read_text()
    compared = CliRunner().invoke(cli, ["compare", str(tmp_path / "job" / "run"), "--json"])
    assert compared.exit_code == 0, compared.output
    return json.loads(compared.stdout)


def test_end_to_end_tiny_moe_and_compare(slurm_cluster, tmp_path):
    """piper plan --save -> piper launch --submit -> the runtime trains (halo, migration on) -> piper compare."""
    plan = tmp_path / "plan.json"
    planned = CliRunner().invoke(cli, ["plan", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "2",
                                       "--seq", "64", "--global-batch", "8", "--strategy", "piper", "--a2a", "halo",
                                       "--migration", "--runnable", "--save", str(plan)])
    assert planned.exit_code == 0, planned.output
    data = json.loads(plan.read_text())
    assert data["parallel"]["a2a"] == "halo" and data["migration"]["enabled"] and data["nodes"] == 2
    data = submit_train_compare(plan, tmp_path)
    assert data["steps_measured"] == 3  # 4 steps, the first (warm-up) left out
    for key in ("step_time_s", "tokens_per_s", "a2a_share"):
        q = data[key]
        assert q["predicted"] > 0 and q["measured"] > 0
        assert q["rel_error"] == (q["predicted"] - q["measured"]) / q["measured"]
    assert len(data["memory_bytes_per_stage"]) == data_pp(plan)


def test_requeue_resume_equals_uninterrupted(slurm_cluster, tmp_path):
    """Two jobs of one plan side by side (2 nodes each): one runs straight through; the other gets USR1
    mid-run -> checkpoint -> exit 75 -> scontrol requeue -> restart with --resume. Same final loss."""
    steps = 12
    plan = cpu_plan(tmp_path / "plan.json")
    ids = {}
    for name in ("straight", "requeued"):
        result = launch("--plan", plan, "--out", tmp_path / name, "--submit", "--json", "--steps", steps,
                        "--time", "00:08:00", "--job-name", f"piper-{name}")
        assert result.exit_code == 0, result.output
        ids[name] = json.loads(result.stdout)["job_id"]
    metrics = tmp_path / "requeued" / "run" / "metrics.jsonl"
    lines = lambda: len(metrics.read_text().splitlines()) if metrics.exists() else 0  # noqa: E731
    wait_until(lambda: lines() >= 3, 240, "3 logged steps of the requeued job")
    subprocess.run(["scancel", "--signal=USR1", "--batch", ids["requeued"]], check=True)
    infos = {name: wait_for_job(job_id, timeout_s=400) for name, job_id in ids.items()}
    log = (tmp_path / "requeued" / f"slurm-{ids['requeued']}.out").read_text()
    assert all(i.get("JobState") == "COMPLETED" for i in infos.values()), (infos, log)
    assert int(infos["requeued"]["Restarts"]) == 1 and "requeueing job" in log and "--resume" in log
    straight, requeued = (json.loads((tmp_path / n / "run" / "summary.json").read_text()) for n in ids)
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    print(f"requeued (restarts {infos['requeued']['Restarts']}): final loss {requeued['final_loss']!r}; "
          f"uninterrupted: {straight['final_loss']!r}")
    assert requeued["final_loss"] == straight["final_loss"]


def test_tensor_parallel_plan_end_to_end_and_compare(slurm_cluster, tmp_path):
    """A tp2 plan (dp2 tp2 ep2 zero 3 on 2 emulated nodes): piper estimate -o -> launch --submit -> trains -> compare."""
    plan = tmp_path / "plan.json"
    saved = CliRunner().invoke(cli, ["estimate", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "2",
                                     "--seq", "64", "--global-batch", "8", "--dp", "2", "--tp", "2", "--pp", "1",
                                     "--ep", "2", "--zero", "3", "-o", str(plan)])
    assert saved.exit_code == 0, saved.output
    assert json.loads(plan.read_text())["parallel"]["tp"] == 2
    data = submit_train_compare(plan, tmp_path)
    assert data["steps_measured"] == 3 and data["step_time_s"]["measured"] > 0
    print("tp2 compare:", {k: data[k] for k in ("step_time_s", "tokens_per_s")})
