"""Hostile input found by fuzzing the CLI (2026-12-02, third round): each case is one ``error:`` line and exit 2
(or, where the input is valid, a quiet correct answer), never a traceback, a hang or a file outside its folder."""

import json
import os
import stat
import time
from pathlib import Path

import pytest
import yaml

from piper_plan import fileio
from piper_plan.calibration import io as calibration_io
from piper_plan.calibration.schema import GEMM
from piper_plan.errors import PiperError
from test_bad_input import ESTIMATE, assert_one_line_error, run

FIXTURES = Path(__file__).resolve().parents[1] / "specs" / "fixtures"
ROOT = Path(__file__).resolve().parents[2]


# ---- Hugging Face configs: per-layer lists -------------------------------------------------------------
@pytest.mark.parametrize("fixture, field, value, needle", [
    ("qwen3-30b-a3b.json", "mlp_only_layers", 5, "list of layer indices 0..47"),
    ("qwen3-30b-a3b.json", "mlp_only_layers", "abc", "list of layer indices"),
    ("qwen3-30b-a3b.json", "mlp_only_layers", [999], "got [999]"),
    ("qwen3-30b-a3b.json", "mlp_only_layers", [-1], "got [-1]"),
    ("llama4-scout.json", "moe_layers", 5, "moe_layers"),
    ("qwen3-30b-a3b.json", "num_hidden_layers", 10**9, "in 1..10,000"),
])
def test_hf_layer_lists_are_checked(tmp_path, fixture, field, value, needle):
    config = json.loads((FIXTURES / fixture).read_text())
    *parents, key = field.split(".")
    target = config
    for name in parents:
        target = target[name]
    target[key] = value
    if field == "num_hidden_layers":
        config["mlp_only_layers"] = [0]     # once built a list over every layer before the count was bounded
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert_one_line_error(run("model", "import", path), str(path), needle)


def test_hf_dense_layer_list_still_imports(tmp_path):
    config = json.loads((FIXTURES / "qwen3-30b-a3b.json").read_text())
    config["mlp_only_layers"] = [0, 47]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = run("model", "import", path, "--json")
    assert result.exit_code == 0, result.output
    layers = json.loads(result.stdout)["spec"]["moe"]["layers"]["explicit"]
    assert 0 not in layers and 47 not in layers and len(layers) == 46


# ---- names are folder names --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../../escaped", "/tmp/elsewhere", "a\\b", ".."])
def test_a_platform_name_cannot_leave_the_calibration_folder(tmp_path, name):
    data = yaml.safe_load((ROOT / "platforms" / "local-cpu.yaml").read_text())
    data["name"] = name
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "job.sbatch"
    assert_one_line_error(run("calibrate", "slurm", "--platform", path, "--nodes", 2, "--output", out),
                          "name", "no '/'")
    assert not out.exists() and not (tmp_path.parent / "escaped").exists()


# ---- calibration CSVs ---------------------------------------------------------------------------------
def _gemm(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gemm.csv"
    path.write_text(",".join(GEMM.column_names) + "\n" + text)
    return path


@pytest.mark.parametrize("row, needle", [
    ("cpu,fp32,64,64,64,1,0.1,1.0,measured: x\ry\n", "line 2: not a CSV row"),
    ("cpu,fp32,64,64,64,1,0.1,1.0," + "x" * 200_000 + "\n", "not a CSV row (field larger than field limit"),
    ("cpu,fp32,64,64,64,1,0.1,5e-324,measured: x\n", "allowed >= 1e-09"),
])
def test_calibration_rows_csv_cannot_read_are_one_line(tmp_path, row, needle):
    with pytest.raises(Exception) as err:
        calibration_io.read_columns(_gemm(tmp_path, row), GEMM)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_calibration_table_has_a_row_limit_checked_before_it_is_parsed(tmp_path):
    rows = "".join(f"cpu,fp32,{m},64,64,1,0.1,1.0,measured: x\n" for m in range(1, calibration_io.MAX_ROWS + 2))
    with pytest.raises(Exception, match="10,001 rows; a calibration table holds at most 10,000"):
        calibration_io.read_columns(_gemm(tmp_path, rows), GEMM)


def test_a_denormal_efficiency_is_refused(tmp_path):
    data = yaml.safe_load((ROOT / "platforms" / "local-cpu.yaml").read_text())
    data["efficiency"]["gemm"] = 5e-324
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    assert_one_line_error(run("platform", "show", path), "efficiency.gemm", "greater than or equal to 0.001")


def test_plan_refuses_rates_that_price_no_trainable_job(tmp_path, monkeypatch):
    """Calibration rows valid one by one (the slowest GEMM rate a row may hold) whose plans price beyond what an
    estimate can hold: `plan` refuses in one line as `estimate` does, instead of ranking inf / NaN."""
    home = tmp_path / "home"
    home.mkdir()
    for name in ("models", "platforms"):
        (home / name).symlink_to(ROOT / name)
    cal = home / "calibration" / "local-cpu"
    cal.mkdir(parents=True)
    for src in (ROOT / "calibration" / "local-cpu").iterdir():
        if src.name != "gemm.csv":
            (cal / src.name).write_bytes(src.read_bytes())
    lines = (ROOT / "calibration" / "local-cpu" / "gemm.csv").read_text().splitlines()
    header = lines[0].split(",")
    slow = []
    for line in lines[1:]:
        fields = line.split(",")
        m, n, k, groups = (int(fields[header.index(c)]) for c in ("m", "n", "k", "groups"))
        seconds = min(1e6, 2 * m * n * k * groups / 1e-9 / 1e12)      # 1e-9 TFLOPS where seconds allow (<= 1e6)
        tflops = 2 * m * n * k * groups / seconds / 1e12               # the row's columns agree
        fields[header.index("seconds")], fields[header.index("tflops")] = f"{seconds:.6g}", f"{tflops:.6g}"
        slow.append(",".join(fields))
    (cal / "gemm.csv").write_text("\n".join([lines[0], *slow]) + "\n")
    monkeypatch.setenv("PIPER_HOME", str(home))
    plan = ("plan", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", 1, "--seq", 128, "--global-batch",
            16384)   # about 2e9 s a step at these rates (global batch 8: 1.1e6 s, ranked as it should be)
    assert_one_line_error(run(*plan), "step_time_s", "no trainable job")
    assert_one_line_error(run(*plan, "--json"), "step_time_s")


# ---- documents ---------------------------------------------------------------------------------------
def test_a_yaml_spec_over_its_size_limit_is_refused_before_parsing(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("x: [" + "1," * (fileio.MAX_YAML_BYTES // 2) + "1]\n")
    start = time.perf_counter()
    assert_one_line_error(run("platform", "show", path), str(path), "the limit is 262,144")
    assert time.perf_counter() - start < 5      # refused by size; parsing it would take about 4 s


# ---- options ------------------------------------------------------------------------------------------
def test_import_nccl_tests_bounds_its_counts(tmp_path):
    log = tmp_path / "nccl.log"
    log.write_text("#  size count type redop root time algbw busbw #wrong time algbw busbw #wrong\n"
                   "   1024   256 float none -1 10.1 0.10 0.19 0 10.0 0.10 0.19 0\n")
    for option, value in (("--ranks-per-node", 10**20), ("--nodes", 10**9)):
        args = {"--nodes": 1, "--ranks-per-node": 2, option: value}
        assert_one_line_error(run("calibrate", "import-nccl-tests", log, "--op", "all_to_all", "--scope", "node",
                                  "--platform", "local-cpu", "--out-dir", tmp_path / "cal",
                                  *[str(x) for kv in args.items() for x in kv]), option)
    assert not (tmp_path / "cal").exists()


def test_migrate_skew_extremes_print_no_warnings():
    result = run("migrate", "simulate", "--experts", 64, "--ep", 8, "--skew", "zipf:1e308", "--json")
    assert result.exit_code == 0 and result.stderr == "", result.stderr
    assert_one_line_error(run("migrate", "simulate", "--experts", 64, "--ep", 8, "--skew", ""), "--skew is empty")


# ---- Slurm that does not answer ----------------------------------------------------------------------
def _fake_slurm(tmp_path: Path, message: str) -> str:
    """A PATH whose squeue and scontrol fail with ``message`` (as a Slurm client whose controller is down)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("squeue", "scontrol"):
        script = bin_dir / tool
        script.write_text(f"#!/bin/sh\necho 'slurm_load_jobs error: {message}' >&2\nexit 1\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def test_status_says_slurm_did_not_answer_not_that_the_job_is_unknown(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_slurm(tmp_path, "Unable to contact slurm controller (connect failure)"))
    line = assert_one_line_error(run("status", "12345"), "Unable to contact slurm controller")
    assert "does not know" not in line
    assert_one_line_error(run("status", "12345", "--dir", tmp_path), "Unable to contact slurm controller")


def test_a_controller_that_is_down_is_said_at_once_not_after_slurms_retries(tmp_path, monkeypatch):
    """squeue, sbatch and scontrol show retry an unreachable controller for about 18 s each; ``scontrol ping`` says
    DOWN at once, and then none of them is run."""
    bin_dir, asked = tmp_path / "bin", tmp_path / "asked"
    bin_dir.mkdir()
    ping = ('if [ "$1" = ping ]; then echo "Slurmctld(primary) at head is DOWN"; echo "** RESTORE SLURMCTLD DAEMON '
            'TO SERVICE **"; exit 1; fi\n')
    for tool in ("squeue", "scontrol", "sbatch"):
        script = bin_dir / tool
        script.write_text("#!/bin/sh\n" + (ping if tool == "scontrol" else "") + f"echo {tool} >> {asked}\nexit 1\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert_one_line_error(run("status", "12345"), "the Slurm controller does not answer",
                          "scontrol ping: Slurmctld(primary) at head is DOWN")
    from piper_plan.launch import submit

    (tmp_path / "job.sbatch").write_text("#!/bin/bash\n")
    with pytest.raises(PiperError, match="sbatch not run: the Slurm controller does not answer"):
        submit.submit(tmp_path / "job.sbatch")
    cal = run("calibrate", "slurm", "--platform", "local-cpu", "--nodes", 1, "--out-dir", tmp_path / "cal", "--submit")
    assert cal.exit_code == 2 and cal.stderr.splitlines()[-1].startswith("error: sbatch not run: the Slurm "
                                                                         "controller does not answer"), cal.output
    assert not asked.exists()


def test_a_job_id_is_ascii_digits_and_a_long_one_is_not_echoed_whole():
    """str.isdigit took a superscript two (then Slurm was asked about it); a 5,000-digit id was echoed in full."""
    assert_one_line_error(run("status", "\u00b2"), r"job id '\xb2' is not allowed", "ASCII digits, at most 10")
    line = assert_one_line_error(run("status", "7" * 5000), "is not allowed")
    assert len(line) < 200 and "7777'..." in line


def test_status_of_a_job_slurm_forgot_still_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_slurm(tmp_path, "Invalid job id specified"))
    assert_one_line_error(run("status", "12345"), "Slurm does not know it")


# ---- what the runtime runs ----------------------------------------------------------------------------
def test_runnable_plans_give_1f1b_a_micro_batch_per_stage(tmp_path):
    """torch's Schedule1F1B needs num_microbatches >= pp: `plan --runnable` offers no 1F1B plan with fewer (it once
    ranked pp 2 x 1 micro-batch first, and `piper run` died in torch), and `run` / `launch` refuse one in one line."""
    result = run("plan", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", 1, "--runnable", "--seq", 64,
                 "--global-batch", 2, "--top", 100, "--json")
    assert result.exit_code == 0, result.output
    plans = json.loads(result.stdout)["plans"]
    assert plans and not [p for p in plans if p["schedule"] == "1f1b" and p["num_microbatches"] < p["pp"]]
    plan = tmp_path / "p.json"
    assert run("estimate", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", 1, "--pp", 2, "--dp", 1,
               "--ep", 1, "--mbs", 1, "--seq", 64, "--global-batch", 1, "--schedule", "1f1b", "-o", plan).exit_code == 0
    assert_one_line_error(run("run", "--plan", plan, "--steps", 1, "--out-dir", tmp_path / "r"),
                          "fewer micro-batches than pp")
    assert_one_line_error(run("launch", "--plan", plan, "--out-dir", tmp_path / "j", "--dry-run"),
                          "fewer micro-batches than pp")


def test_only_a_platform_name_is_a_folder_name(tmp_path):
    """Device and model names may hold '/' (torch names an MI250X "AMD Instinct MI250X/MI250"); an HF config whose
    _name_or_path is './' imports under its folder's name, not '.'."""
    data = yaml.safe_load((ROOT / "platforms" / "local-cpu.yaml").read_text())
    data["device"]["name"] = "AMD Instinct MI250X/MI250"
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    assert run("platform", "show", path).exit_code == 0
    config = json.loads((FIXTURES / "qwen3-30b-a3b.json").read_text())
    config["_name_or_path"] = "./"
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    result = run("model", "import", folder / "config.json", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["spec"]["name"] == "my-model"


def test_status_dir_must_be_a_piper_job_directory(tmp_path, monkeypatch):
    """Before: `status 999999 --dir /` printed 'job 999999: None (reason None, ...)' and exited 0."""
    monkeypatch.setenv("PATH", _fake_slurm(tmp_path, "Invalid job id specified"))
    assert_one_line_error(run("status", "12345", "--dir", tmp_path), "is not a piper job directory")
    (tmp_path / "job.sbatch").write_text("#!/bin/bash\n")
    result = run("status", "12345", "--dir", tmp_path)
    assert result.exit_code == 0 and "job 12345: not known to Slurm" in result.stdout and "None (" not in result.stdout


def test_a_path_that_is_no_regular_file_says_what_it_is(tmp_path):
    """Before: /dev/null, a FIFO and a link loop were all 'file not found'."""
    fifo, loop, dangling = tmp_path / "fifo", tmp_path / "loop", tmp_path / "dangling"
    os.mkfifo(fifo)
    loop.symlink_to(loop)
    dangling.symlink_to(tmp_path / "nowhere")
    for path, needle in ((fifo, "not a regular file (a device, FIFO or socket)"), ("/dev/null", "not a regular file"),
                         (loop, "a symbolic link loop"), (dangling, "a symbolic link to nothing"),
                         (tmp_path / "missing.yaml", "file not found")):
        assert_one_line_error(run("model", "show", path), f"{path}: {needle}")


def test_status_dir_takes_a_run_directory_too(tmp_path, monkeypatch):
    """Before: `status 1 --dir RUN` (a `piper run --out-dir` folder, which holds plan.json) looked for RUN/run and
    printed '0 steps logged' beside the run's own metrics.jsonl."""
    monkeypatch.setenv("PATH", _fake_slurm(tmp_path, "Invalid job id specified"))
    run_dir = tmp_path / "myrun"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 9.5}\n{"step": 2, "loss": 9.25}\n')
    result = run("status", "12345", "--dir", run_dir, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)["run"]
    assert summary["steps_logged"] == 2 and summary["last"]["loss"] == 9.25 and summary["run_dir"] == str(run_dir)
    (run_dir / "job.sbatch").write_text("#!/bin/bash\n")      # a job directory keeps its run under run/
    assert json.loads(run("status", "12345", "--dir", run_dir, "--json").stdout)["run"]["steps_logged"] == 0


def _asking_slurm(tmp_path: Path) -> tuple[str, Path]:
    """A PATH whose squeue, scontrol and sbatch note each call in the returned file (and fail)."""
    bin_dir, asked = tmp_path / "bin", tmp_path / "asked"
    bin_dir.mkdir()
    for tool in ("squeue", "scontrol", "sbatch"):
        (bin_dir / tool).write_text(f"#!/bin/sh\necho {tool} >> {asked}\nexit 1\n")
        (bin_dir / tool).chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}", asked


def test_status_of_a_local_run_needs_no_job_id_and_asks_no_slurm(tmp_path, monkeypatch):
    """Before: `piper status --dir RUN` was click's "Missing argument 'JOB_ID'": a local `piper run` has none."""
    path, asked = _asking_slurm(tmp_path)
    monkeypatch.setenv("PATH", path)
    run_dir = tmp_path / "myrun"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 9.5}\n{"step": 2, "loss": 9.25}\n')
    shown = run("status", "--dir", run_dir)
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.startswith(f"{run_dir}: run without a summary yet (still running under Slurm, or stopped "
                                   "before its end) (a run directory; no Slurm job id")
    assert "2 steps logged" in shown.stdout and "sbatch" not in shown.output
    (run_dir / "summary.json").write_text(json.dumps({"steps": 2, "final_loss": 9.25, "exit_code": 0}))
    result = run("status", "--dir", run_dir, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["job_id"] is None and report["state"] is None and report["run"]["state"] == "finished"
    assert report["run"]["summary"]["final_loss"] == 9.25 and report["run"]["steps_logged"] == 2
    assert "summary: exit_code 0, steps 2, final_loss 9.25" in run("status", "--dir", run_dir).stdout
    assert not asked.exists()


def test_status_of_a_run_that_holds_only_its_lock_yet(tmp_path, monkeypatch):
    """A local `piper run` writes its lock file first and metrics.jsonl at its first step (seconds later): status
    said "is not a piper job directory" in between."""
    from piper_plan.rundir import hold_run_dir

    monkeypatch.setenv("PATH", _asking_slurm(tmp_path)[0])
    run_dir = tmp_path / "starting"
    run_dir.mkdir()
    fd = hold_run_dir(run_dir, launcher=True)
    try:
        shown = run("status", "--dir", run_dir, "--json")
        assert shown.exit_code == 0, shown.output
        assert json.loads(shown.stdout)["run"]["state"] == "running"
    finally:
        os.close(fd)


def test_status_without_a_job_id_says_each_state_of_a_run(tmp_path, monkeypatch):
    from piper_plan.rundir import hold_run_dir

    monkeypatch.setenv("PATH", _asking_slurm(tmp_path)[0])
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 9.5}\n')
    (run_dir / "summary.json").write_text(json.dumps({"steps": 1, "exit_code": 75}))
    assert "run checkpointed" in run("status", "--dir", run_dir).stdout
    fd = hold_run_dir(run_dir, launcher=True)           # as `piper run`'s launcher holds it
    try:
        assert json.loads(run("status", "--dir", run_dir, "--json").stdout)["run"]["state"] == "running"
    finally:
        os.close(fd)
    job = tmp_path / "job"                             # as `piper launch` leaves it, before a run
    job.mkdir()
    (job / "job.sbatch").write_text("#!/bin/bash\n")
    line = run("status", "--dir", job).stdout.splitlines()[0]
    assert line.startswith(f"{job}: a `piper launch` job directory, its run not started (no job id given")
    assert_one_line_error(run("status"), "give JOB_ID", "--dir RUN_DIR")


def test_status_where_slurm_is_missing_gives_no_submit_advice(tmp_path, monkeypatch):
    """scontrol missing said 'copy the job directory to a login node and run `sbatch job.sbatch`' for any job."""
    monkeypatch.setenv("PATH", str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    line = assert_one_line_error(run("status", "5", "--dir", tmp_path), "scontrol not found on PATH",
                                 "piper status --dir DIR")
    assert "sbatch" not in line
