"""The trainer from the command line: torchrun with 4 ranks (metrics.jsonl, summary, profile trace), SIGUSR1
checkpoint + exit 75 + resume, and bad input (clear error from rank 0, every rank exits, no hang)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from piper_plan.catalog import load_model
from plans import plan_dict

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc: int, plan: dict, tmp: Path, *extra: str, timeout=240, popen=False):
    path = tmp / "plan.json"
    path.write_text(json.dumps(plan))
    cmd = [TORCHRUN, "--nproc-per-node", str(nproc), "--master-port", str(_port()), "-m",
           "piper_plan.runtime.train", "--plan", str(path), "--out", str(tmp / "run"), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if popen:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _records(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.distributed
def test_torchrun_four_ranks_writes_metrics_and_trace(tmp_path):
    plan = plan_dict(pp=2, dp=2, ep=2, schedule="gpipe", num_microbatches=2)
    proc = _torchrun(4, plan, tmp_path, "--steps", "3", "--profile", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _records(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["schema_version"] == 1 and r["tokens"] == 4 * 16
        assert len(r["memory_bytes"]) == 2 and all(m["total_bytes"] > 0 for m in r["memory_bytes"])
        # top-2 routing: every MoE layer sees tokens x k assignments, by logical expert id
        assert sorted(r["expert_tokens"]) == ["0", "1", "2", "3"]
        assert all(sum(c) == 64 * 2 and len(c) == 8 for c in r["expert_tokens"].values())
        assert r["time_s"]["a2a"] > 0 and r["migrations"] == []
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (tmp_path / "run" / "plan.json").is_file()  # kept beside metrics.jsonl for `piper compare RUN_DIR`
    assert summary["steps"] == 3 and summary["exit_code"] == 0
    assert list((tmp_path / "run").glob("trace_step1_rank*.json"))


def _srun_style(world: int, plan: dict, tmp: Path, *extra: str) -> list[subprocess.Popen]:
    """One process per rank with SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, as srun starts them on Frontier."""
    path = tmp / "plan.json"
    path.write_text(json.dumps(plan))
    port = str(_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world),
               "SLURM_LOCALID": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        cmd = [sys.executable, "-m", "piper_plan.runtime.train", "--plan", str(path), "--out", str(tmp / "run"), *extra]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.distributed
def test_sigusr1_checkpoints_exits_75_and_resume_continues(tmp_path):
    plan = plan_dict(pp=2, dp=1, ep=1, num_microbatches=2, seq_len=64, steps=400)
    procs = _srun_style(2, plan, tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert all(p.poll() is None for p in procs), [p.stderr.read()[-2000:] for p in procs]
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGUSR1)  # one rank signalled: every rank must stop at the same step
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [75, 75], [p.stderr.read()[-2000:] for p in procs]
    stopped = _records(tmp_path)[-1]["step"]
    assert 2 <= stopped < 400
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == str(stopped)
    procs = _srun_style(2, plan, tmp_path, "--resume", "--steps", str(stopped + 2))
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert [r["step"] for r in _records(tmp_path)] == list(range(1, stopped + 3))


@pytest.mark.distributed
def test_bad_input_clear_error_every_rank_exits(tmp_path):
    two = plan_dict(pp=2, dp=1, ep=1)
    cases = {
        "world": (plan_dict(pp=2, dp=2, ep=2), "but the launcher started 2"),
        "cuda": ({**two, "platform": {**two["platform"], "launch": {**two["platform"]["launch"], "device": "cuda"}}},
                 "launch.device"),
        "data": (plan_dict(pp=2, dp=1, ep=1, data=str(tmp_path / "missing.bin")), "missing.bin"),
    }
    for name, (plan, needle) in cases.items():
        case_dir = tmp_path / name
        case_dir.mkdir()
        proc = _torchrun(2, plan, case_dir, timeout=90)
        assert proc.returncode != 0, name
        assert needle in proc.stderr, (name, proc.stderr[-2000:])
        assert proc.stderr.count("error: ") == 1, name  # rank 0 only


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.distributed
def test_bad_resume_one_line_exit_2_nothing_overwritten(tmp_path):
    """--resume from a checkpoint the plan cannot load: a missing shard, another model, a layout that cannot hold
    the model (a stage without layers: found when plan.json is read). Every case: the trainer exits 2 with one
    error line (rank 0), the other rank is ended, the run directory is byte-for-byte unchanged."""
    proc = _torchrun(2, plan_dict(pp=2, dp=1, ep=1, steps=2, checkpoint_interval=2), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    (run / "checkpoints" / "step_2" / "__1_0.distcp").unlink()
    other = load_model("tiny-moe").model_dump(mode="json")
    other["moe"]["num_experts"] = 4
    cases = {"missing shard": (plan_dict(pp=1, dp=2, ep=2, steps=4, num_microbatches=1), "shard file __1_0.distcp is missing"),
             "another model": (plan_dict(pp=2, dp=1, ep=1, steps=4, model_dict=other),
                               "another model: model.moe.num_experts: 8 (checkpoint) vs 4 (plan)"),
             "cannot hold": (plan_dict(pp=2, dp=1, ep=1, steps=4, layers_per_stage=[4, 0]), "layers_per_stage")}
    before = _tree(run)
    for name, (plan, needle) in cases.items():
        proc = _torchrun(2, plan, tmp_path, "--resume", timeout=90)
        # torchrun exits 1 when a rank fails; the trainer's own code is in its report
        assert re.search(r"exitcode\s*:\s*2 ", proc.stderr), (name, proc.stderr[-2000:])
        assert needle in proc.stderr and proc.stderr.count("error: ") == 1, (name, proc.stderr[-2000:])
        assert _tree(run) == before, name


@pytest.mark.distributed
def test_resume_keeps_the_runs_own_schedule_and_refuses_another_training(tmp_path):
    """Before: the learning rate's cosine took --steps (else the plan's runtime.steps) afresh on every --resume, so a
    run resumed as its stop line says went on to the plan's total on another schedule, without a word; and a
    checkpoint without the run's plan.json beside it took another global batch silently."""
    first = _torchrun(2, plan_dict(pp=2, dp=1, ep=1, steps=4, checkpoint_interval=2), tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "run"
    whole = [r["loss"] for r in _records(tmp_path)]
    (run / "checkpoints" / "latest").write_text("2\n")                # as if stopped after step 2
    (run / "plan.json").unlink()                                       # the checkpoint alone says what it holds
    other = plan_dict(pp=2, dp=1, ep=1, steps=4, checkpoint_interval=2)
    other["training"]["global_batch"] *= 2
    other["parallel"]["num_microbatches"] *= 2
    refused = _torchrun(2, other, tmp_path, "--resume", timeout=90)
    assert "the checkpoint is of another training: training.global_batch: 2 (checkpoint) vs 4 (plan)" \
        in refused.stderr and refused.stderr.count("error: ") == 1, refused.stderr[-2000:]
    again = _torchrun(2, plan_dict(pp=2, dp=1, ep=1, steps=100, checkpoint_interval=2), tmp_path, "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "--resume: the run continues to its own 4 steps (plan.json's runtime.steps: 100" in again.stderr
    assert [r["loss"] for r in _records(tmp_path)] == whole              # steps 3 and 4 on the run's own cosine
    (run / "checkpoints" / "latest").write_text("2\n")
    longer = _torchrun(2, plan_dict(pp=2, dp=1, ep=1, steps=4, checkpoint_interval=2), tmp_path, "--resume",
                       "--steps", "6")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "--steps 6: the checkpoint's run scheduled its learning rate over 4 steps; from step 2 it follows the " \
        "cosine of 6 steps" in longer.stderr
    assert [r["step"] for r in _records(tmp_path)] == list(range(1, 7))
