"""`piper run --plan`: inputs checked before torch, local ranks started by torch's elastic launcher, and the
torchrun / srun lines for a plan that needs an allocation."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from piper_plan.cli.main import cli
from piper_plan.launch.local import Layout, srun_command, torchrun_command

PIPER = Path(sys.executable).parent / "piper"
TINY = ["--model", "tiny-moe", "--platform", "local-cpu", "--seq", "64", "--global-batch", "8", "--runnable"]
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}


def saved_plan(tmp_path: Path, *args: str) -> Path:
    path = tmp_path / "plan.json"
    done = CliRunner().invoke(cli, ["plan", *args, "-o", str(path)])
    assert done.exit_code == 0, done.output
    return path


def torch_free(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`piper ARGS` in a fresh interpreter that reports on exit whether torch was imported."""
    code = ("import sys, atexit; atexit.register(lambda: print('torch imported:', 'torch' in sys.modules, "
            "file=sys.stderr)); from piper_plan.cli.main import main; sys.argv = ['piper', *sys.argv[1:]]; main()")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env=CLEAN_ENV)


def test_a_missing_plan_is_one_line_before_torch(tmp_path):
    done = torch_free(tmp_path, "run", "--plan", "nope.json")
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["error: nope.json: no such file", "torch imported: False"]


def test_a_multi_node_plan_prints_the_torchrun_and_srun_lines(tmp_path):
    plan = saved_plan(tmp_path, "--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "2", "--runnable")
    done = torch_free(tmp_path, "run", "--plan", str(plan), "--steps", "5", "--json")
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().endswith("torch imported: False")
    out = json.loads(done.stdout)
    assert out["launched"] is False and (out["nodes"], out["ranks_per_node"], out["world"]) == (2, 8, 16)
    torchrun = shlex.split(out["torchrun"].replace('"$MASTER_ADDR:29500"', "HOST:29500"))
    assert torchrun[1:3] == ["--nnodes=2", "--nproc-per-node=8"] and "--rdzv-endpoint=HOST:29500" in torchrun
    assert torchrun[-7:] == ["piper_plan.runtime.train", "--plan", str(plan), "--out", str(tmp_path / "run"),
                             "--steps", "5"]
    srun = shlex.split(out["srun"].split(" MASTER_PORT=29500 ", 1)[1])
    assert srun[:6] == ["srun", "--nodes=2", "--ntasks=16", "--ntasks-per-node=8", "--cpus-per-task=7",
                        "--gpus-per-task=1"]
    human = CliRunner().invoke(cli, ["run", "--plan", str(plan)])
    assert human.exit_code == 0 and "torchrun --nnodes=2" in human.stdout and "srun --nodes=2" in human.stdout
    assert human.stderr.startswith("piper run: not started here: the plan needs 2 nodes x 8 GPU ranks")


def test_run_refuses_what_launch_refuses_instead_of_printing_its_commands(tmp_path):
    """The README's first plan (Mixtral on 8 Frontier nodes, not --runnable) does not fit as piper's runtime runs it:
    `launch` refused it while `run` printed torchrun / srun lines that would run out of memory. Both refuse it now,
    in the same line."""
    plan = saved_plan(tmp_path, "--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "8")
    ran = CliRunner().invoke(cli, ["run", "--plan", str(plan)])
    launched = CliRunner().invoke(cli, ["launch", "--plan", str(plan), "--out-dir", str(tmp_path / "job")])
    assert ran.exit_code == launched.exit_code == 2 and "torchrun" not in ran.stdout
    assert "priced as piper's runtime runs it" in ran.stderr and ran.stderr == launched.stderr
    assert not (tmp_path / "run").exists()


def test_run_prices_the_file_again_before_its_check_as_launch_does(tmp_path):
    """A runnable plan whose sequence was edited to 8192: launch priced it again and refused it; run checked the
    stored prediction and printed torchrun / srun lines."""
    plan = saved_plan(tmp_path, "--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "8", "--runnable")
    data = json.loads(plan.read_text())
    data["training"]["seq_len"] = 8192
    plan.write_text(json.dumps(data))
    ran = CliRunner().invoke(cli, ["run", "--plan", str(plan)])
    launched = CliRunner().invoke(cli, ["launch", "--plan", str(plan), "--out-dir", str(tmp_path / "job")])
    assert ran.exit_code == launched.exit_code == 2 and ran.stderr == launched.stderr, ran.output
    assert "does not fit" in ran.stderr and "is not what its plan costs now" in ran.stderr


def test_where_a_layout_runs():
    assert Layout(1, 8, "cuda", 7, 1).runs_here                      # one node: its devices are here
    assert not Layout(2, 8, "cuda", 7, 1).runs_here                  # GPU nodes are real nodes
    assert Layout(2, 2, "cpu", 1, 0).runs_here and Layout(2, 2, "cpu", 1, 0).emulated_topology == "2x2"
    assert not Layout(40, 2, "cpu", 1, 0).runs_here                  # more processes than piper starts here
    cpu = Layout(3, 2, "cpu", 1, 0)
    assert "--gpus-per-task" not in srun_command(cpu, ["--plan", "p"])
    assert torchrun_command(cpu, ["--plan", "a b"]).endswith("-m piper_plan.runtime.train --plan 'a b'")


def test_bad_options_are_one_line(tmp_path):
    plan = saved_plan(tmp_path, *TINY, "--nodes", "1")
    for args, needle in ((["--steps", "0"], "--steps"), (["--lr", "nan"], "lr")):
        done = CliRunner().invoke(cli, ["run", "--plan", str(plan), *args])
        lines = done.stderr.strip().splitlines()
        assert done.exit_code == 2 and len(lines) == 1 and needle in lines[0], done.output


@pytest.mark.distributed
def test_a_two_rank_local_plan_trains_without_torchrun(tmp_path):
    plan = saved_plan(tmp_path, *TINY, "--nodes", "1")
    assert json.loads(plan.read_text())["parallel"]["dp"] * json.loads(plan.read_text())["parallel"]["pp"] == 2
    done = subprocess.run([str(PIPER), "run", "--plan", str(plan), "--steps", "2", "--out-dir", "run", "--json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=CLEAN_ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)                              # stdout: the summary alone
    assert summary["run_dir"] == "run" and summary["steps"] == 2 and summary["exit_code"] == 0
    assert summary["world"] == 2 and summary["final_loss"] > 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # CPU ranks: each stage's largest process peak RSS beside the tensor accounting (more than the tensors: the
    # interpreter, torch and gloo live there too)
    assert all(m["process_peak_rss_bytes"] > m["total_bytes"] > 0 for r in rows for m in r["memory_bytes"])
    assert rows[0].get("warmup") is True and "warmup" not in rows[1]     # this invocation's first step
    assert done.stderr.startswith("piper run: 2 local ranks, run directory run")


@pytest.mark.parametrize("extra", [["--capacity-factor", "1.25"], ["--tp", "2", "--etp", "2", "--dp", "1", "--ep", "1"]])
def test_run_refuses_outside_the_capability_list_in_launch_s_line(tmp_path, extra):
    """A plan outside the runtime's capability list: `run` said "parallel: the runtime cannot run: ..." (no file, the
    wrong field, no re-plan hint) where `launch` names the file; both now say launch's line."""
    plan = tmp_path / "plan.json"
    made = CliRunner().invoke(cli, ["estimate", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1",
                                    "--dp", "2", "--ep", "2", "--seq", "64", "--global-batch", "8", *extra, "-o",
                                    str(plan)])
    assert made.exit_code == 0, made.output
    ran = CliRunner().invoke(cli, ["run", "--plan", str(plan), "--out-dir", str(tmp_path / "run")])
    launched = CliRunner().invoke(cli, ["launch", "--plan", str(plan), "--out-dir", str(tmp_path / "job")])
    assert ran.exit_code == launched.exit_code == 2 and ran.stderr == launched.stderr, (ran.stderr, launched.stderr)
    assert f"{plan}: the runtime cannot run this plan" in ran.stderr and not (tmp_path / "run").exists()
