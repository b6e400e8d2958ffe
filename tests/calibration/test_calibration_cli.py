"""`piper calibrate` argument errors, the Slurm sweep script, and the hint without a distributed environment."""

from __future__ import annotations

import json
import os

from click.testing import CliRunner

from piper_plan.cli.main import cli


def test_missing_platform_and_bad_only_exit_2(tmp_path):
    none = CliRunner().invoke(cli, ["calibrate"])
    assert none.exit_code == 2 and "--platform is required" in none.output
    bad = CliRunner().invoke(cli, ["calibrate", "--platform", "local-cpu", "--only", "gemm,fft", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "unknown ['fft']" in bad.output


def test_nccl_platform_without_distributed_env_explains_how_to_launch(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    result = CliRunner().invoke(cli, ["calibrate", "--platform", "frontier", "--only", "collectives", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "piper calibrate slurm --platform frontier" in result.output and "srun" in result.output
    assert not (tmp_path / "collectives.csv").exists()


def test_slurm_script_from_launch_block(tmp_path):
    script = tmp_path / "cal.sbatch"
    result = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", "frontier", "--nodes", "4", "--account", "abc123",
                                      "--output", str(script)])
    assert result.exit_code == 0, result.output
    text = script.read_text()
    lines = text.splitlines()
    assert "#SBATCH --nodes=4" in lines and "#SBATCH --account=abc123" in lines and "#SBATCH --partition=batch" in lines
    srun = next(line for line in lines if line.startswith("srun "))
    for part in ("--ntasks=32", "--ntasks-per-node=8", "--cpus-per-task=7", "--gpus-per-task=1", "--gpu-bind=closest",
                 "-m piper_plan.calibration.bench_collectives --platform frontier", "--resume"):
        assert part in srun
    assert "module load rccl-net-plugin" in lines and 'export NCCL_SOCKET_IFNAME="hsn0"' in lines
    assert os.access(script, os.X_OK)


def test_slurm_script_cpu_platform_has_no_gpus(tmp_path):
    script = tmp_path / "cpu.sbatch"
    result = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", "local-cpu", "--nodes", "2", "--output", str(script)])
    assert result.exit_code == 0, result.output
    srun = next(line for line in script.read_text().splitlines() if line.startswith("srun "))
    assert "--ntasks=4" in srun and "gpus-per-task" not in srun
    as_json = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", "local-cpu", "--nodes", "2", "--output",
                                       str(script), "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout) == {"platform": "local-cpu", "nodes": 2, "script": str(script),
                                          "out_dir": json.loads(as_json.stdout)["out_dir"], "job_id": None}
    assert as_json.stderr == f"wrote {script}\n"


def _one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    return lines[0]


def test_slurm_refuses_more_nodes_than_the_platform_has(tmp_path):
    """local-cpu has 4 nodes: 5 is refused as `piper estimate` refuses it (nodes_out_of_range), before any file."""
    script = tmp_path / "a.sbatch"
    for platform, nodes, limit in (("local-cpu", "5", "1 to 4 nodes"), ("frontier", "100000", "frontier has 1 to")):
        result = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", platform, "--nodes", nodes,
                                          "--output", str(script)])
        line = _one_error_line(result)
        assert "--nodes" in line and f"nodes={nodes}" in line and limit in line, line
        assert not script.exists()
    at_limit = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", "local-cpu", "--nodes", "4", "--output",
                                        str(script)])
    assert at_limit.exit_code == 0 and "#SBATCH --nodes=4" in script.read_text().splitlines()


def test_slurm_refuses_a_blank_python(tmp_path):
    script = tmp_path / "c.sbatch"
    for python in ("", "   "):
        result = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", "local-cpu", "--nodes", "2", "--python",
                                          python, "--output", str(script)])
        line = _one_error_line(result)
        assert "--python" in line and f"python={python!r}" in line, line
        assert not script.exists()


def test_gpu_platform_without_gpu_refuses_compute_sweep(tmp_path):
    result = CliRunner().invoke(cli, ["calibrate", "--platform", "frontier", "--only", "gemm", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "torch sees no GPU" in result.output
    assert not (tmp_path / "gemm.csv").exists()


def test_frontier_groups_cover_every_scope():
    from piper_plan.calibration.bench_collectives import p2p_groups, plan_groups
    from piper_plan.catalog import load_platform
    from piper_plan.launchenv import LaunchEnv

    net = load_platform("frontier").network  # 4 nodes per switch, 128 per group
    groups = plan_groups(LaunchEnv(0, 8 * 256, 0, 8, "srun"), net, quick=True)
    assert [(g.scope, g.num_nodes, len(g.ranks)) for g in groups] == [
        ("node", 1, 8), ("switch", 4, 32), ("group", 128, 1024), ("system", 256, 2048)]
    pairs = p2p_groups(LaunchEnv(0, 8 * 8, 0, 8, "srun"), net)
    assert [(p.scope, p.ranks) for p in pairs] == [("node", (0, 1)), ("switch", (0, 24)), ("group", (0, 56))]
