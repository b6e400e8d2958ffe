"""`piper calibrate` argument errors, the Slurm sweep script, and the hint without a distributed environment."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from piper_plan.cli.main import cli


def test_missing_platform_and_bad_only_exit_2(tmp_path):
    none = CliRunner().invoke(cli, ["calibrate"])
    assert none.exit_code == 2 and "--platform is required" in none.output
    bad = CliRunner().invoke(cli, ["calibrate", "--platform", "local-cpu", "--only", "gemm,fft", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "unknown ['fft']" in bad.output


@pytest.mark.bench
def test_dtype_keeps_the_compute_sweeps_to_the_precisions_named(tmp_path):
    """``--dtype fp32`` on a CPU measures no bf16 GEMM (50x slower there without bf16 instructions) and says so in
    every row's source; a precision the device's sweep lacks, or ``--dtype`` without a compute sweep, is one line."""
    import pandas as pd

    ok = CliRunner().invoke(cli, ["calibrate", "--platform", "local-cpu", "--quick", "--only", "gemm", "--dtype", "fp32",
                                  "--out", str(tmp_path)])
    assert ok.exit_code == 0, ok.output
    rows = pd.read_csv(tmp_path / "gemm.csv")
    assert set(rows["dtype"]) == {"fp32"} and len(rows) == 13
    assert rows["source"].str.contains("--dtype fp32").all()
    from piper_plan.calibration.timing import cpu_isa_flags, cpu_name

    device = json.loads((tmp_path / "metadata.json").read_text())["device"]
    assert device["isa_flags"] == cpu_isa_flags() and device["name"] == cpu_name()     # what compare tells apart
    for args, needle in ((["--only", "gemm,attention", "--dtype", "fp32,fp16"],
                          "--dtype fp16: on a cpu device the sweeps measure: gemm fp32, bf16; attention fp32"),
                         (["--only", "collectives", "--dtype", "bf16"], "--only collectives selects neither"),
                         (["--dtype", " , "], "names nothing")):
        bad = CliRunner().invoke(cli, ["calibrate", "--platform", "local-cpu", *args, "--out", str(tmp_path / "bad")])
        assert bad.exit_code == 2 and needle in bad.stderr and bad.stderr.count("\n") == 1, bad.output
        assert not (tmp_path / "bad").exists()
    from piper_plan.calibration.sweep import SweepOptions, check_dtypes

    both = SweepOptions(platform="local-cpu", out_dir=tmp_path, quick=True, only=("gemm", "attention"), dtypes=("bf16",))
    assert check_dtypes(both, "cpu") == ["attention: nothing measured, its sweep on a cpu device has no bf16 point "
                                         "(it measures fp32)"]


def test_the_slurm_sweep_passes_dtype_on_and_checks_it_before_writing(tmp_path):
    ok = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", "frontier", "--nodes", "2", "--dtype", "bf16",
                                  "--out-dir", str(tmp_path), "-o", str(tmp_path / "job.sbatch")])
    assert ok.exit_code == 0, ok.output
    assert "--only gemm,attention,memory --out-dir" in (tmp_path / "job.sbatch").read_text()
    assert "--resume --dtype bf16" in (tmp_path / "job.sbatch").read_text()
    bad = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", "frontier", "--nodes", "2", "--dtype", "fp32",
                                   "--out-dir", str(tmp_path), "-o", str(tmp_path / "bad.sbatch")])
    assert bad.exit_code == 2 and "--dtype fp32: on a cuda device the sweeps measure: gemm bf16, fp8; attention bf16" \
        in bad.stderr and not (tmp_path / "bad.sbatch").exists()
    no_fp8 = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", "frontier", "--nodes", "2", "--dtype", "fp8",
                                      "--out-dir", str(tmp_path), "-o", str(tmp_path / "fp8.sbatch")])
    assert no_fp8.exit_code == 2 and no_fp8.stderr.count("\n") == 1, no_fp8.output
    assert "--dtype fp8: platform frontier's device has no 8-bit GEMMs (device.peak_flops has bf16, fp16)" in \
        no_fp8.stderr and not (tmp_path / "fp8.sbatch").exists()
    h200 = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", "h200", "--nodes", "2", "--dtype", "bf16,fp8",
                                    "--out-dir", str(tmp_path), "-o", str(tmp_path / "h200.sbatch")])
    assert h200.exit_code == 0 and "--dtype bf16,fp8" in (tmp_path / "h200.sbatch").read_text(), h200.output


def test_a_sweep_option_before_a_subcommand_is_one_line_not_dropped(tmp_path):
    """`piper calibrate --dtype fp8 slurm ...` wrote a script without --dtype (the group's options were ignored)."""
    done = CliRunner().invoke(cli, ["calibrate", "--dtype", "fp8", "--quick", "slurm", "--platform", "frontier",
                                    "--nodes", "2", "--out-dir", str(tmp_path / "cal")])
    assert done.exit_code == 2 and done.stderr.count("\n") == 1, done.output
    assert "--quick, --dtype before `slurm` is an option of `piper calibrate` itself" in done.stderr
    assert not (tmp_path / "cal").exists()


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
    compute, collectives = [line for line in lines if line.startswith("srun ")]
    # the GEMM and attention sweeps on one device of the first node (the docs promised them from this job; it
    # ran the collective sweep only), then the collectives over every device of the 4 nodes
    for part in ("--nodes=1 --ntasks=1 --ntasks-per-node=1", "--gpus-per-task=1",
                 "-m piper_plan.cli.main calibrate --platform frontier --only gemm,attention", "--resume"):
        assert part in compute
    for part in ("--ntasks=32", "--ntasks-per-node=8", "--cpus-per-task=7", "--gpus-per-task=1", "--gpu-bind=closest",
                 "-m piper_plan.calibration.bench_collectives --platform frontier", "--resume"):
        assert part in collectives
    assert any(line.startswith("#SBATCH --output=/") and line.endswith("/calibration/frontier/"
                                                                        "piper-calibrate-frontier-%j.out")
               for line in lines)
    assert "module load rccl-net-plugin" in lines and 'export NCCL_SOCKET_IFNAME="hsn0"' in lines
    assert os.access(script, os.X_OK)


def test_slurm_script_cpu_platform_has_no_gpus(tmp_path):
    script = tmp_path / "cpu.sbatch"
    result = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", "local-cpu", "--nodes", "2", "--output", str(script)])
    assert result.exit_code == 0, result.output
    srun = [line for line in script.read_text().splitlines() if line.startswith("srun ")]
    assert "--ntasks=4" in srun[-1] and not any("gpus-per-task" in line for line in srun)
    as_json = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", "local-cpu", "--nodes", "2", "--output",
                                       str(script), "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout) == {"platform": "local-cpu", "nodes": 2, "script": str(script),
                                          "out_dir": json.loads(as_json.stdout)["out_dir"], "job_id": None}
    assert as_json.stderr == f"wrote {script}\n"


def test_slurm_script_names_a_platform_whose_name_has_spaces_as_one_token(tmp_path):
    """A platform's name may be any printable line; sbatch reads #SBATCH options unquoted (a space splits one,
    '%j' is its pattern), so the job and output names carry the name as one token."""
    import yaml

    data = yaml.safe_load((Path(__file__).parents[2] / "platforms" / "local-cpu.yaml").read_text())
    data["name"] = "my cluster %j"
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    script = tmp_path / "c.sbatch"
    result = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", str(tmp_path / "p.yaml"), "--nodes", "1",
                                      "--out-dir", str(tmp_path / "rows"), "--output", str(script)])
    assert result.exit_code == 0, result.output
    lines = script.read_text().splitlines()
    assert "#SBATCH --job-name=piper-calibrate-my-cluster-j" in lines
    assert f"#SBATCH --output={tmp_path / 'rows'}/piper-calibrate-my-cluster-j-%j.out" in lines


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
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1    # no progress display's blank line
    assert not (tmp_path / "gemm.csv").exists()


def test_a_malformed_csv_to_merge_into_is_named_before_anything_is_measured(tmp_path, monkeypatch):
    """Before: the sweep (minutes) and the overhead benchmark (40 s) ran, then the merge refused the file and the
    measured rows were lost."""
    from piper_plan.calibration import bench_overhead, sweep

    def measured(*args, **kwargs):
        raise AssertionError("measured before the file it merges into was read")

    monkeypatch.setattr(sweep, "_compute_sweeps", measured)
    monkeypatch.setattr(bench_overhead, "overhead_rows", measured)
    (tmp_path / "gemm.csv").write_text("garbage\n")
    (tmp_path / "overhead.csv").write_text("op,size\nx\n")
    gemm = CliRunner().invoke(cli, ["calibrate", "--platform", "local-cpu", "--only", "gemm", "--out-dir", str(tmp_path)])
    assert gemm.exit_code == 2 and f"{tmp_path / 'gemm.csv'}: line 1: missing columns" in gemm.stderr, gemm.output
    overhead = CliRunner().invoke(cli, ["calibrate", "overhead", "--platform", "local-cpu", "--out-dir", str(tmp_path)])
    assert overhead.exit_code == 2 and f"{tmp_path / 'overhead.csv'}: line 2" in overhead.stderr, overhead.output


def test_numbers_only_python_reads_are_not_numbers(tmp_path):
    """float() reads 4_5.12 as 45.12 and Arabic-Indic digits as digits; nccl-tests and CSV writers print neither."""
    import pytest

    from piper_plan.calibration.io import read_table
    from piper_plan.calibration.nccl_tests import parse_nccl_tests
    from piper_plan.calibration.schema import ATTENTION
    from piper_plan.errors import PiperError

    header = "#       size         count      type   redop    root     time   algbw   busbw #wrong\n"
    for bad in ("4_5.12", "\u0664\u0665.12"):
        with pytest.raises(PiperError, match="line 2: not a number in"):
            parse_nccl_tests(header + f"     1048576        262144     float    none      -1    {bad}   23.24   11.62      0\n")
    path = tmp_path / "attention.csv"
    row = "cpu,fp32,fwd,1,128,8,{kv},64,true,{s},{t},measured: x\n"
    good_t = 4 * 128**2 * 8 * 64 * 0.5 / 1e-3 / 1e12
    path.write_text(",".join(ATTENTION.column_names) + "\n" + row.format(kv=8, s="1_0e-4", t=good_t))
    with pytest.raises(PiperError, match="line 2: column seconds: '1_0e-4' is not a number"):
        read_table(path, ATTENTION)
    path.write_text(",".join(ATTENTION.column_names) + "\n" + row.format(kv=3, s="1e-3", t=good_t))
    with pytest.raises(PiperError, match="line 2: num_kv_heads=3 does not divide num_heads=8"):
        read_table(path, ATTENTION)


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


def test_slurm_only_and_out_dir(tmp_path):
    script, rows = tmp_path / "c.sbatch", tmp_path / "rows"
    result = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", "local-cpu", "--nodes", "2", "--only",
                                      "collectives", "--out-dir", str(rows), "--output", str(script)])
    assert result.exit_code == 0, result.output
    srun = [line for line in script.read_text().splitlines() if line.startswith("srun ")]
    assert len(srun) == 1 and "bench_collectives" in srun[0] and f"--out {rows}" in srun[0]
    assert rows.is_dir()                                  # sbatch opens the job's log there and creates no folder
    spaced = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", "local-cpu", "--nodes", "2", "--out-dir",
                                      str(tmp_path / "a b"), "--output", str(tmp_path / "d.sbatch")])
    assert spaced.exit_code == 0, spaced.output                  # sbatch reads it quoted (before: refused)
    assert f'#SBATCH --output="{tmp_path / "a b"}/piper-calibrate-local-cpu-%j.out"' in \
        (tmp_path / "d.sbatch").read_text().splitlines()
    pattern = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", "local-cpu", "--nodes", "2", "--out-dir",
                                       str(tmp_path / "a%b"), "--output", str(tmp_path / "g.sbatch")])
    assert "--out-dir" in _one_error_line(pattern) and not (tmp_path / "a%b").exists()
    bad = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", "local-cpu", "--nodes", "2", "--only", "gemm,x",
                                   "--output", str(tmp_path / "e.sbatch")])
    assert "--only" in _one_error_line(bad) and not (tmp_path / "e.sbatch").exists()
    (tmp_path / "afile").write_text("x\n")           # mkdir raised NotADirectoryError (a traceback, exit 1)
    blocked = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", "local-cpu", "--nodes", "2", "--out-dir",
                                       str(tmp_path / "afile" / "rows"), "--output", str(tmp_path / "f.sbatch")])
    assert "is a file, not a folder" in _one_error_line(blocked)


def test_slurm_job_names_a_platform_file_by_its_path(tmp_path):
    # the job passed --platform <the file's name>, which no catalog on the nodes knows: it failed after the queue
    import yaml

    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "platforms" / "local-cpu.yaml").read_text())
    data["name"] = "mysite"
    (tmp_path / "mysite.yaml").write_text(yaml.safe_dump(data))
    script = tmp_path / "m.sbatch"
    result = CliRunner().invoke(cli, ["calibrate", "slurm", "--platform", str(tmp_path / "mysite.yaml"), "--nodes",
                                      "2", "--out-dir", str(tmp_path / "rows"), "--output", str(script)])
    assert result.exit_code == 0, result.output
    srun = [line for line in script.read_text().splitlines() if line.startswith("srun ")]
    assert len(srun) == 2 and all(f"--platform {tmp_path / 'mysite.yaml'} " in line for line in srun)


def test_a_calibration_folder_without_attention_csv_says_the_file_is_missing(tmp_path, monkeypatch):
    """Before: 'attention.csv: no calibration rows', as if the file were there and empty."""
    import shutil

    root = Path(__file__).parents[2]
    for folder in ("models", "platforms"):
        shutil.copytree(root / folder, tmp_path / folder)
    shutil.copytree(root / "calibration" / "local-cpu", tmp_path / "calibration" / "local-cpu")
    (tmp_path / "calibration" / "local-cpu" / "attention.csv").unlink()
    monkeypatch.setenv("PIPER_HOME", str(tmp_path))
    result = CliRunner().invoke(cli, ["estimate", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1",
                                      "--dp", "2", "--ep", "2"])
    assert _one_error_line(result).endswith("local-cpu/attention.csv: no such file in the calibration folder "
                                            "(piper calibrate measures it)")


def test_an_attention_csv_with_its_header_only_says_what_to_do(tmp_path, monkeypatch):
    """A fuzzing pass: the line named the file but not what would help."""
    import shutil

    root = Path(__file__).parents[2]
    for folder in ("models", "platforms"):
        shutil.copytree(root / folder, tmp_path / folder)
    shutil.copytree(root / "calibration" / "local-cpu", tmp_path / "calibration" / "local-cpu")
    attention = tmp_path / "calibration" / "local-cpu" / "attention.csv"
    attention.write_text(attention.read_text().splitlines()[0] + "\n")
    monkeypatch.setenv("PIPER_HOME", str(tmp_path))
    result = CliRunner().invoke(cli, ["estimate", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1",
                                      "--dp", "2", "--ep", "2"])
    assert _one_error_line(result).endswith("local-cpu/attention.csv: no calibration rows: the file holds its header "
                                            "only (piper calibrate measures them; --no-calibration prices with the "
                                            "platform's roofline instead)")


def test_what_keeps_plan_from_a_fresh_calibration_is_said_when_it_is_written(tmp_path):
    """Rows faster than the platform file's peak (a CPU platform file describing another machine) and a directory
    `plan` does not read: before, calibrate exited 0 without a word, and the first `piper plan` refused the rows or
    priced with none of them."""
    import shutil

    from piper_plan.cli.calibrate import _planning_warnings

    shutil.copytree(Path(__file__).resolve().parents[2] / "calibration" / "local-cpu", tmp_path / "cal")
    gemm = tmp_path / "cal" / "gemm.csv"
    lines = gemm.read_text().splitlines()
    fields = lines[1].split(",")
    fields[6] = repr(float(fields[6]) * 0.0943203 / 5.0)       # seconds for 5 TFLOP/s: above local-cpu's bf16 peak
    fields[7] = "5.0"
    gemm.write_text("\n".join([lines[0], ",".join(fields), *lines[2:]]) + "\n")
    said = _planning_warnings("local-cpu", (tmp_path / "cal").resolve())
    assert said[0].startswith("warning: a bf16 row measures 5 TFLOP/s, above the device's peak of 0.4866")
    assert "set device.peak_flops to it" in said[0] and "refuse this calibration" in said[0]
    assert said[1].startswith("note: `piper plan`, `estimate` and `launch` read ") and str(tmp_path) in said[1]
    shown = CliRunner().invoke(cli, ["calibrate", "show", "--platform", "platforms/local-cpu.yaml", "--json"])
    assert shown.exit_code == 0, shown.output                 # a platform file, as calibrate itself takes


@pytest.mark.parametrize("device, needle", [
    ({"name": "Another CPU (1 rank)", "type": "cpu"}, "holds the calibration of 'Another CPU (1 rank)' and this "
                                                      "machine's device is "),
    # a VM names different CPUs alike ('AMD EPYC'): the instruction sets tell them apart (bf16 GEMMs 71-366x apart)
    ({"name": None, "type": "cpu", "isa_flags": "avx512_bf16 avx512f"}, "with instruction sets 'avx512_bf16 "
                                                                       "avx512f', and this machine's has "),
    ("AMD EPYC", "metadata.json: device: expected a mapping"),
], ids=["another-name", "same-name-other-isa", "not-a-mapping"])
def test_a_folder_of_another_device_is_not_mixed_with_this_ones(tmp_path, device, needle):
    """`piper calibrate --platform local-cpu` on another CPU added its rows beside the folder's and rewrote its
    device: one line, before anything is measured, and nothing written."""
    if isinstance(device, dict) and device["name"] is None:
        from piper_plan.calibration.timing import cpu_name

        device["name"] = cpu_name()
    (tmp_path / "metadata.json").write_text(json.dumps({"device": device}))
    done = CliRunner().invoke(cli, ["calibrate", "--platform", "local-cpu", "--quick", "--only", "gemm", "--dtype",
                                    "fp32", "--out-dir", str(tmp_path)])
    assert done.exit_code == 2 and done.stderr.count("\n") == 1, done.output
    assert needle in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metadata.json"]


def test_a_calibration_that_measures_nothing_leaves_the_folder_as_it_was(tmp_path):
    """--only collectives on an nccl platform without a job measures nothing: it said "wrote nothing" and still
    rewrote metadata.json (a seed's provenance replaced by this command), or made a folder holding only that."""
    import shutil

    kept = tmp_path / "frontier"
    shutil.copytree(Path(__file__).resolve().parents[2] / "calibration" / "frontier", kept)
    before = (kept / "metadata.json").read_text()
    for out in (kept, tmp_path / "new"):
        result = CliRunner().invoke(cli, ["calibrate", "--platform", "frontier", "--quick", "--only", "collectives",
                                          "--out-dir", str(out)])
        assert result.exit_code == 0 and "wrote nothing" in result.stderr, result.output
    assert (kept / "metadata.json").read_text() == before and not (tmp_path / "new").exists()
