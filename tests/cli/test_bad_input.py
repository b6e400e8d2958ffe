"""Bad input through every cheap command: one ``error:`` line on stderr, exit code 2, no traceback, no file
half-written; --json happy paths print one JSON document on stdout (DESIGN.md, Conventions)."""

import json
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from piper_plan.catalog import read_structured
from piper_plan.cli.main import cli
from piper_plan.cli.status import run_dir_summary

ROOT = Path(__file__).resolve().parents[2]
TINY = ("--model", "tiny-moe", "--platform", "local-cpu", "--seq", "128", "--global-batch", "8")
ESTIMATE = ("estimate", *TINY, "--nodes", "1", "--dp", "2", "--ep", "2")


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_one_line_error(result, *needles):
    """Exit 2, a single stderr line starting with 'error:', no traceback; each needle appears in it."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def plan_json(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    result = run(*ESTIMATE, "--save", path, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(path.read_text())


def write(path: Path, obj) -> Path:
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


# ---- reading files -------------------------------------------------------------------------------------
def test_binary_and_directory_spec_files(tmp_path):
    binary = tmp_path / "m.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert_one_line_error(run("model", "show", binary), str(binary), "UTF-8")
    assert_one_line_error(run("platform", "show", tmp_path / "dir.yaml"), "file not found")
    (tmp_path / "d.yaml").mkdir()
    assert_one_line_error(run("model", "show", tmp_path / "d.yaml"), "is a directory")


@pytest.mark.parametrize("change, needles", [
    (lambda d: {**d, "parallel": [1]}, ["parallel: Input should be an object"]),
    (lambda d: {k: v for k, v in d.items() if k != "parallel"}, ["parallel: Field required"]),
    (lambda d: {**d, "placement": "weird"}, ["placement", "'weird'"]),
    (lambda d: {**d, "schema_version": 6}, ["schema_version", "reads 1, 2, 3, 4, 5"]),
    (lambda d: {**d, "schema_version": 3.0}, ["schema_version", "3.0; this piper reads 1, 2, 3, 4, 5"]),
    (lambda d: {**d, "training": {**d["training"], "dtype": "fp8"}}, ["training.dtype", "no peak for dtype=fp8"]),
    (lambda d: {**d, "prediction": {**d["prediction"], "step_time_s": "abc"}}, ["prediction.step_time_s"]),
    (lambda d: {**d, "prediction": {**d["prediction"], "step_time_s": -1}}, ["prediction.step_time_s"]),
    (lambda d: {**d, "prediction": {**d["prediction"], "memory": {}}}, ["prediction.memory"]),
    (lambda d: {**d, "parallel": {**d["parallel"], "edp": 7}}, ["parallel.edp", "edp=7"]),
    (lambda d: {**d, "moe": {**d["moe"], "capacity_factor": -5}}, ["moe.capacity_factor", "(got -5)"]),
    # figures a prediction derives from its others, edited alone (compare and export showed them as the plan's)
    (lambda d: {**d, "prediction": {**d["prediction"], "tokens_per_s": 1}},
     ["prediction.tokens_per_s: 1.0, but tflops_per_device x 1e12 x devices / model_flops_per_token = "]),
    (lambda d: {**d, "prediction": {**d["prediction"], "a2a_share": 0.9}},
     ["prediction.a2a_share: 0.9, but the moe/ terms of time.breakdown / step_time_s = ", "within 1%"]),
])
def test_launch_refuses_a_broken_plan_naming_the_input_file(tmp_path, plan_json, change, needles):
    plan = write(tmp_path / "in.json", change(plan_json))
    line = assert_one_line_error(run("launch", "--plan", plan, "--out", tmp_path / "job"), *needles)
    assert str(plan) in line
    assert not (tmp_path / "job").exists()


def test_plan_whose_nodes_do_not_match_names_the_input_not_the_copy(tmp_path, plan_json):
    plan = write(tmp_path / "in.json", {**plan_json, "nodes": 3})
    line = assert_one_line_error(run("launch", "--plan", plan, "--out", tmp_path / "job"), "world_mismatch", "3 nodes")
    assert line.startswith(f"error: {plan}:")
    assert not (tmp_path / "job").exists()


# ---- numbers and option combinations ---------------------------------------------------------------------
@pytest.mark.parametrize("extra, needles", [
    (("--routing-skew", "inf"), ["routing_skew", "finite"]),
    (("--routing-skew", "nan"), ["routing_skew"]),
    (("--global-batch", str(10**23)), ["global_batch", "2147483648"]),
    (("--seq", str(2**31 + 1)), ["seq_len"]),
    (("--nodes", "abc"), ["--nodes", "'abc'"]),
])
def test_estimate_bad_numbers(extra, needles):
    assert_one_line_error(run(*ESTIMATE, *extra), *needles)


def test_click_usage_errors_are_one_line():
    assert_one_line_error(run("models", "--bogus"), "--bogus", "--help")
    assert_one_line_error(run("no-such-command"), "no-such-command")
    assert_one_line_error(run("model", "show"), "MODEL")
    assert_one_line_error(run("plan", *TINY, "--nodes", "1", "--top", "-1"), "--top")


def test_incompatible_options():
    assert_one_line_error(run("plan", *TINY, "--nodes", "1", "--json", "--csv"), "--json", "--csv")
    assert_one_line_error(run("plan", *TINY, "--nodes", "8..4"), "8..4")
    assert_one_line_error(run("launch", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "0",
                              "--out", "/tmp/never-written"), "nodes=0")


def test_launch_dry_run_cannot_combine_with_submit(tmp_path, plan_json):
    plan = write(tmp_path / "in.json", plan_json)
    assert_one_line_error(run("launch", "--plan", plan, "--out", tmp_path / "job", "--dry-run", "--submit"),
                          "--dry-run")


def test_migrate_simulate_refuses_sizes_that_would_exhaust_memory():
    assert_one_line_error(run("migrate", "simulate", "--ep", "2", "--experts", "100000000"), "--experts")
    assert_one_line_error(run("migrate", "simulate", "--ep", "2", "--experts", "1024", "--layers", "100000"),
                          "load cells")
    assert_one_line_error(run("migrate", "simulate", "--ep", "2", "--experts", "8", "--threshold", "nan"), "--threshold")
    # within both limits above, yet minutes of hill climbing (8,192 experts per rank compared pairwise per swap)
    assert_one_line_error(run("migrate", "simulate", "--ep", "2", "--experts", "16384", "--layers", "64"),
                          "64 layers x 16 swaps x (8,192 experts per rank)^2")


def test_calibrate_bad_arguments_fail_before_measuring(tmp_path):
    assert_one_line_error(run("calibrate", "--platform", "local-cpu", "--only", "", "--out", tmp_path), "--only")
    out = tmp_path / "x.sbatch"
    assert_one_line_error(run("calibrate", "slurm", "--platform", "frontier", "--nodes", "2", "--time", "abc", "--output", out), "time='abc'")
    assert_one_line_error(run("calibrate", "slurm", "--platform", "frontier", "--nodes", "2", "--account", "a;b", "--output", out), "account")
    assert not out.exists()


# ---- writing files ---------------------------------------------------------------------------------------
def test_save_under_a_file_is_one_line_and_writes_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for args in ((*ESTIMATE, "--save", blocker / "plan.json"), ("plan", *TINY, "--nodes", "1", "--save",
                                                                blocker / "plan.json"),
                 ("reproduce", "halo", "--out", blocker / "halo.md")):
        assert_one_line_error(run(*args), "is a file, not a folder")
    assert blocker.read_text() == "x"


def test_written_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        assert run(*ESTIMATE, "--save", tmp_path / "plan.json").exit_code == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "plan.json").stat().st_mode) == 0o644   # mkstemp alone gives 0o600


# ---- compare and status: metrics.jsonl -------------------------------------------------------------------
RECORD = {"schema_version": 1, "step": 1, "step_time_s": 2.0, "tokens_per_s": 4.0, "time_s": {"a2a": 0.5},
          "memory_bytes": [100]}


@pytest.mark.parametrize("lines, needles", [
    ([RECORD, 5], ["line 2", "JSON object"]),
    ([RECORD, {**RECORD, "schema_version": 2}], ["line 2", "schema_version=2"]),
    ([{**RECORD, "time_s": "x"}], ["line 1", "time_s"]),
    ([{**RECORD, "step_time_s": "slow"}], ["step_time_s"]),
    ([{k: v for k, v in RECORD.items() if k != "step"}], ["line 1", "step: Field required"]),
    # before: "memory_bytes.0.StageMemory.total_bytes: ...; memory_bytes.0.constrained-float: ..." (both union forms)
    ([{**RECORD, "memory_bytes": [{"total_bytes": -1}]}], ["memory_bytes.0.total_bytes: Input should be greater"]),
    ([{**RECORD, "memory_bytes": [-1]}], ["memory_bytes.0.total_bytes: Input should be greater than or equal to 0"]),
    ([{**RECORD, "memory_bytes": ["x"]}], ["memory_bytes.0: Input should be an object (a mapping of field names"]),
    # before: a TypeError traceback in compare (a string or an object as the RSS), or a negative RSS shown
    ([{**RECORD, "memory_bytes": [{"total_bytes": 1, "process_peak_rss_bytes": "big"}]}],
     ["memory_bytes.0.process_peak_rss_bytes: Input should be a valid number"]),
    ([{**RECORD, "memory_bytes": [{"total_bytes": 1, "process_peak_rss_bytes": {}}]}],
     ["memory_bytes.0.process_peak_rss_bytes: Input should be a valid number"]),
    ([{**RECORD, "memory_bytes": [{"total_bytes": 1, "process_peak_rss_bytes": -5}]}],
     ["memory_bytes.0.process_peak_rss_bytes: Input should be greater than or equal to 0"]),
    ([{**RECORD, "memory_bytes": [{"total_bytes": 1, "stage": "0"}]}], ["memory_bytes.0.stage"]),
    # before: any truthy value marked the step warm-up (compare then kept the real warm-up step)
    ([{**RECORD, "warmup": "false"}], ["warmup: Input should be a valid boolean"]),
])
def test_compare_bad_metrics_lines(tmp_path, plan_json, lines, needles):
    write(tmp_path / "plan.json", plan_json)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = run("compare", tmp_path)
    assert_one_line_error(result, "metrics.jsonl", *needles)
    assert "StageMemory" not in result.stderr and "constrained-float" not in result.stderr


def test_compare_bad_plan_and_happy_json(tmp_path, plan_json):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(RECORD) + "\n")
    write(tmp_path / "plan.json", "{oops")
    assert_one_line_error(run("compare", tmp_path), "plan.json", "malformed JSON")
    write(tmp_path / "plan.json", plan_json)
    result = run("compare", tmp_path, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["step_time_s"]["measured"] == 2.0


def test_status_reads_past_a_truncated_last_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(RECORD) + "\n" + '{"step": 2, "lo')
    summary = run_dir_summary(tmp_path)
    assert summary["steps_logged"] == 2 and summary["last"]["step"] == 1
    assert_one_line_error(run("status", "1", "--dir", tmp_path / "missing"), "--dir")


# ---- --json happy paths: one JSON document on stdout ------------------------------------------------------
@pytest.mark.parametrize("args", [("models",), ("platforms",), ("model", "show", "tiny-moe"),
                                  ("platform", "show", "local-cpu"), ESTIMATE, ("plan", *TINY, "--nodes", "1"),
                                  ("migrate", "simulate", "--ep", "2", "--experts", "8")])
def test_json_goes_to_stdout(args):
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)


def test_bench_a2a_never_picks_a_platform_to_write_into():
    assert_one_line_error(run("bench", "a2a"), "--platform", "--no-save")
    assert_one_line_error(run("bench", "a2a", "--no-save", "--out-dir", "somewhere"), "--no-save writes no rows")
    # its option took a Path, so '' arrived as the folder '.': rows went into the working directory
    assert_one_line_error(run("bench", "a2a", "--platform", "local-cpu", "--out-dir", ""), "--out-dir: '' names no directory")


@pytest.mark.parametrize("platform", ["frontier", "h200"])
def test_bench_a2a_writes_no_gloo_rows_into_a_gpu_platform(tmp_path, platform):
    """Before: this host's gloo ranks wrote their timings into a GPU platform's collectives.csv (or --out-dir), and
    its expert all-to-all was priced at them: Qwen3-30B on 4 Frontier nodes from 100 s a step to 444,100 s."""
    assert_one_line_error(run("bench", "a2a", "--platform", platform, "--nodes", "2", "--ranks-per-node", "2",
                              "--out-dir", tmp_path / "rows"), f"{platform} runs nccl on cuda devices",
                          "would run gloo here")
    assert not (tmp_path / "rows").exists()


@pytest.mark.parametrize("args,needle", [
    (["--nodes", "20", "--ranks-per-node", "8"], "160 local processes"),
    (["--nodes", "2", "--ranks-per-node", "4", "--sizes", "4G"], "needs ~"),
    (["--nodes", "1", "--ranks-per-node", "1"], "1 x 1: an all-to-all needs 2 ranks or more"),   # rows divided by 0
    (["--sizes", "4K,4096"], "'4096' is 4096 bytes again; give each size once"),    # "wrote 4 rows" for 2
    # whole float32 rows per peer: 3 and 1 bytes both sent 8; refused after the whole run, or two equal rows printed
    (["--nodes", "1", "--ranks-per-node", "2", "--sizes", "3,1"], "3 and 1 bytes both carry 8 bytes per rank on 2"),
    (["--nodes", "1", "--ranks-per-node", "2", "--sizes", "4K,4100"], "4096 and 4100 bytes both carry 4096"),
])
def test_bench_a2a_refuses_a_local_spawn_the_machine_cannot_hold(args, needle):
    res = CliRunner().invoke(cli, ["bench", "a2a", "--no-save", *args])
    assert res.exit_code == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in res.output


# ---- hostile input found by a fuzzing pass (2026-12-02) ---------------------------------------------------
def test_a_name_with_a_newline_never_reaches_a_script(tmp_path):
    # a platform or model name is printed into job scripts' comments: one printable line, or refused
    platform = yaml_copy(tmp_path, "platforms/local-cpu.yaml", name="cpu\ntouch /tmp/owned #")
    out = tmp_path / "job"
    assert_one_line_error(run("launch", "--model", "tiny-moe", "--platform", platform, "--nodes", 1, "--out-dir", out),
                          "name: a name is one line, not blank")
    assert not out.exists()                               # no job directory, no script
    model = yaml_copy(tmp_path, "models/tiny-moe.yaml", name="tiny\tmoe")
    assert_one_line_error(run("model", "show", model), "name: a name is one line, not blank")
    model = yaml_copy(tmp_path, "models/tiny-moe.yaml", name="tiny\u202emoe")      # right-to-left override
    assert_one_line_error(run("model", "show", model), "or format character")


def yaml_copy(tmp_path: Path, relative: str, **changes) -> Path:
    import yaml

    root = Path(__file__).resolve().parents[2]
    data = {**yaml.safe_load((root / relative).read_text()), **changes}
    path = tmp_path / Path(relative).name
    path.write_text(yaml.safe_dump(data))
    return path


def test_an_output_path_that_is_a_pipe_is_refused_not_replaced(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert_one_line_error(run(*ESTIMATE, "-o", fifo), "not a regular file")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_an_output_link_is_written_through_and_a_system_file_refused(tmp_path):
    """-o link.json replaced the link with a file; -o /dev/stdout (stdout redirected to a file) replaced the system's
    /dev/stdout link."""
    target, link = tmp_path / "real.json", tmp_path / "link.json"
    target.write_text("{}")
    link.symlink_to(target)
    assert run(*ESTIMATE, "-o", link).exit_code == 0
    assert link.is_symlink() and json.loads(target.read_text())["schema_version"] >= 1
    system = tmp_path / "stdout"
    system.symlink_to("/proc/self/fd/1")
    for path in ("/dev/stdout", "/dev/null", "/proc/self/status", system):
        assert_one_line_error(run(*ESTIMATE, "-o", path), "is a device or kernel file")
    assert os.path.islink("/dev/stdout")
    (tmp_path / "loop1").symlink_to("loop2")                    # a loop was replaced by a regular file, silently
    (tmp_path / "loop2").symlink_to("loop1")
    assert_one_line_error(run(*ESTIMATE, "-o", tmp_path / "loop1"), "a symbolic link loop")
    assert (tmp_path / "loop1").is_symlink() and (tmp_path / "loop2").is_symlink()
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):      # a tmpfs of ordinary files: written
        shm = Path("/dev/shm") / f"piper-test-{os.getpid()}.json"
        try:
            assert run(*ESTIMATE, "-o", shm).exit_code == 0 and shm.is_file()
        finally:
            shm.unlink(missing_ok=True)


def test_an_output_that_is_one_of_the_inputs_is_refused(tmp_path):
    model = tmp_path / "m.yaml"
    model.write_text((Path(__file__).parents[2] / "models" / "tiny-moe.yaml").read_text())
    before = model.read_text()
    args = ("estimate", "--model", model, "--platform", "local-cpu", "--nodes", 1, "--dp", 2, "--ep", 2)
    assert_one_line_error(run(*args, "-o", model), f"{model}: -o: is also this command's --model input")
    assert_one_line_error(run(*args, "--plot", model), f"{model}: --plot: is also this command's --model input")
    assert model.read_text() == before


def test_an_output_that_is_a_catalog_input_or_another_output_is_refused(tmp_path, monkeypatch):
    """Inputs given by catalog name (models/<name>.yaml under PIPER_HOME), every --dataset of validate, and two
    outputs of one command naming one file: each one line, nothing written (before: each silently replaced)."""
    import shutil

    root = Path(__file__).parents[2]
    for folder in ("models", "platforms", "validation"):
        shutil.copytree(root / folder, tmp_path / folder)
    monkeypatch.setenv("PIPER_HOME", str(tmp_path))
    model, dataset = tmp_path / "models" / "tiny-moe.yaml", tmp_path / "validation" / "piper-migration-table4.yaml"
    before = model.read_text(), dataset.read_text()
    args = ("estimate", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", 1, "--dp", 2, "--ep", 2)
    assert_one_line_error(run(*args, "-o", model), f"{model}: -o: is also this command's --model input")
    assert_one_line_error(run("validate", "--dataset", "korthikanti-a100", "--dataset", "piper-migration-table4",
                              "-o", dataset), f"{dataset}: -o: is also this command's --dataset input")
    assert (model.read_text(), dataset.read_text()) == before
    both = tmp_path / "both.png"
    assert_one_line_error(run(*args, "-o", both, "--plot", both),
                          f"{both}: -o: is also this command's --plot output: one would replace the other")
    assert not both.exists()


def test_launch_writes_none_of_its_files_when_one_is_blocked(tmp_path):
    out = tmp_path / "job"
    (out / "README.md").mkdir(parents=True)
    result = run("launch", *TINY, "--nodes", 1, "--out-dir", out, "--force")   # notes the plan it chose, then:
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.stderr.strip().splitlines()[-1].endswith("README.md: cannot write: is a directory; give a file name")
    assert sorted(p.name for p in out.iterdir()) == ["README.md"]


def test_notes_wait_for_the_estimate_so_an_error_stays_one_line():
    """A routing-skew note and an unused-modules note used to print before a later error: three lines, exit 2."""
    args = ("estimate", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", 1, "--dp", 2, "--routing-skew", 8)
    assert_one_line_error(run(*args, "--recompute-modules", "mla_up_proj"), "names mla_up_proj")
    ok = run(*args, "--ep", 2, "--recompute-modules", "moe_act")
    assert ok.exit_code == 0 and "priced as 2" in ok.stderr and "change nothing in it" in ok.stderr, ok.stderr


def test_launch_takes_back_its_files_when_a_write_fails_on_the_way(tmp_path, monkeypatch):
    """A write that fails after the checks (the disk fills up between files): the files written before it are
    taken back, an earlier plan.json restored under --force, so the folder is as it was, not half a job."""
    import piper_plan.launch.job as job
    from piper_plan.errors import PiperError

    out = tmp_path / "job"
    out.mkdir()
    (out / "plan.json").write_text("an earlier plan")
    real = job.atomic_write_text

    def full_disk(path, text):
        if Path(path).name == "README.md":
            raise PiperError("cannot write: No space left on device", path=str(path))
        return real(path, text)

    monkeypatch.setattr(job, "atomic_write_text", full_disk)
    result = run("launch", *TINY, "--nodes", 1, "--out-dir", out, "--force")
    assert result.exit_code == 2 and result.stderr.strip().splitlines()[-1].endswith("No space left on device")
    assert sorted(p.name for p in out.iterdir()) == ["plan.json"]
    assert (out / "plan.json").read_text() == "an earlier plan"


@pytest.mark.parametrize("args, needle", [
    (("--routing-skew", "1e308"), "routing_skew: Input should be less than or equal to 65536"),  # before: step nan
    (("--routing-skew", "1e100"), "routing_skew: Input should be less than or equal to 65536"),
    (("--dp", 2**63), "dp: Input should be less than or equal to 1048576"),   # beyond numpy's int64
    (("--mbs", 2**62), "mbs: Input should be less than or equal to 1048576"),
])
def test_estimate_out_of_range_is_one_line(args, needle):
    import warnings

    with warnings.catch_warnings(record=True) as seen:   # numpy's overflow warnings would bury the line
        warnings.simplefilter("always")
        result = run(*ESTIMATE, *args)
    assert_one_line_error(result, needle)
    assert not [w for w in seen if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in seen]


def test_a_plan_of_more_ranks_than_any_machine_is_refused():
    assert_one_line_error(run(*ESTIMATE, "--pp", 2**20, "--dp", 2**20), "a plan has at most 1,048,576")


def test_migrate_seed_and_halo_report_name(tmp_path):
    assert_one_line_error(run("migrate", "simulate", "--ep", 8, "--experts", 64, "--seed", -1), "--seed")
    assert_one_line_error(run("reproduce", "halo", "-o", tmp_path / "halo.png"), "give the Markdown report's name")
    assert not (tmp_path / "halo.png").exists()


@pytest.mark.parametrize("change, needles", [
    (lambda d: d["rows"][0]["parallel"].update(tp="abc"), ["rows[", "parallel: tp: Input should be a valid integer"]),
    (lambda d: d["rows"][0]["parallel"].update(tp=0), ["parallel: tp: Input should be greater than or equal to 1"]),
    (lambda d: d["rows"][0].update(published=0), ["published: Input should be greater than or equal to 0.000000001"]),
    (lambda d: d["rows"][0].update(nodes=-1), ["nodes: Input should be greater than or equal to 1"]),
    (lambda d: d["rows"][0].update(global_batch=0), ["global_batch: Input should be greater than or equal to 1"]),
    (lambda d: d["training"].update(seq_len="x"), ["training: seq_len: Input should be a valid integer"]),
    (lambda d: d.update(rows=[]), ["rows: List should have at least 1 item"]),
])
def test_a_dataset_row_is_checked_before_any_row_is_priced(tmp_path, change, needles):
    path = changed_dataset(tmp_path, "korthikanti-a100", change)
    assert_one_line_error(run("validate", "--dataset", path), str(path), *needles)


def changed_dataset(tmp_path: Path, name: str, change) -> Path:
    import yaml

    data = read_structured(Path(__file__).resolve().parents[2] / "validation" / f"{name}.yaml")
    change(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("change, needle", [
    (lambda d: d["migration"].update(gpus=0), ": migration: gpus: Input should be greater than or equal to 1"),
    (lambda d: d["migration"].update(bandwidth_Bps=1e-300),    # before: predicted inf, exit 1, JSON 'Infinity'
     ": migration: bandwidth_Bps: Input should be greater than or equal to 1"),
    (lambda d: d["rows"][0].update(migration={"gpus": "8"}), "rows[switch-base].migration: gpus: Input should be a"),
    (lambda d: d["rows"][0].update(facts={}), "rows[switch-base].facts: num_experts: Field required"),
    (lambda d: d["rows"][0]["facts"].update(hidden_size="big"), "facts: hidden_size: Input should be a valid integer"),
    (lambda d: d["rows"][0].update(facts={}, model="no-such-model"), "rows[switch-base].model: unknown model"),
    # before: priced (0.066 GB per GPU), exit 1 on the tolerance; `migrate simulate` refuses the same layer
    (lambda d: d["rows"][0]["facts"].update(num_experts=7), "facts.num_experts: 7 experts do not divide over 8 GPUs"),
])
def test_a_migration_row_is_checked_too(tmp_path, change, needle):
    path = changed_dataset(tmp_path, "piper-migration-table4", change)
    assert_one_line_error(run("validate", "--dataset", path), needle)


def test_more_ranks_than_a_plan_may_have_and_a_balanced_split_too_deep(tmp_path):
    import yaml

    root = Path(__file__).resolve().parents[2]
    data = yaml.safe_load((root / "platforms" / "h200.yaml").read_text())
    data["node"]["device_nic"] = None
    data["node"]["devices_per_node"] = 1024
    data["network"]["nodes_per_group"], data["network"]["num_groups"] = 1024, 2
    big = tmp_path / "big.yaml"
    big.write_text(yaml.safe_dump(data))
    assert_one_line_error(run("plan", "--model", "tiny-moe", "--platform", big, "--nodes", 2048),
                          "2048 nodes x 1024 devices = 2,097,152 ranks; piper plans at most 1,048,576")
    deep = yaml_copy(tmp_path, "models/tiny-moe.yaml", num_layers=1100)
    assert_one_line_error(run("estimate", "--model", deep, "--platform", "local-cpu", "--nodes", 1, "--pp", 2,
                              "--seq", 128, "--global-batch", 8, "--layers-split", "balanced"),
                          "layers_split=balanced", "computed up to 1024")


@pytest.mark.parametrize("search, needle", [({"mbs": [0]}, "search: mbs.0: Input should be greater than or equal to 1"),
                                            ({"schedules": ["bogus"]}, "search: schedules.0: Input should be"),
                                            ({"memory_headroom": 1.5}, "search: memory_headroom: Input should be less"),
                                            ({"bogus": 1}, "search: bogus: unknown field")])
def test_a_dataset_rows_search_is_bounded(tmp_path, search, needle):
    path = changed_dataset(tmp_path, "piper-frontier-moe", lambda d: d["rows"][0].update(search=search))
    assert_one_line_error(run("validate", "--dataset", path), "rows[", needle)


# ---- piper run: runtime settings the ranks would crash on; compare: metrics of another job -----------------------
@pytest.mark.parametrize("runtime, needle", [
    ({"seed": -1}, "runtime.seed: Input should be greater than or equal to 0 (got -1)"),
    ({"seed": 99999999999999999999}, "runtime.seed: Input should be less than or equal to 9223372036854775807"),
    ({"lr": 1e300}, "runtime.lr: Input should be less than or equal to 10000"),
    ({"aux_loss_coeff": 1e300}, "runtime.aux_loss_coeff: Input should be less than or equal to 10000"),
    ({"weight_decay": 1e39}, "runtime.weight_decay: Input should be less than or equal to 10000"),
    ({"grad_clip_norm": 1e39}, "runtime.grad_clip_norm: Input should be less than or equal to 10000"),
    ({"mtp_loss_weight": 1e39}, "runtime.mtp_loss_weight: Input should be less than or equal to 10000"),
])
def test_run_refuses_runtime_settings_torch_cannot_hold(tmp_path, plan_json, runtime, needle):
    plan = write(tmp_path / "plan.json", {**plan_json, "runtime": {**plan_json["runtime"], **runtime}})
    assert_one_line_error(run("run", "--plan", plan, "--steps", 1, "--out-dir", tmp_path / "R"), str(plan), needle)
    assert not (tmp_path / "R").exists()


@pytest.mark.parametrize("option, value, needle", [
    ("--lr", "1e300", "lr: Input should be less than or equal to 10000"),
    ("--lr", "1e30", "lr: Input should be less than or equal to 10000"),
    ("--aux-loss-coeff", "1e300", "aux_loss_coeff: Input should be less than or equal to 10000"),
    ("--lr", "0", "lr: Input should be greater than 0"),
    ("--lr", "inf", "lr: Input should be"),
])
def test_run_options_torch_cannot_hold_are_one_line(tmp_path, plan_json, option, value, needle):
    plan = write(tmp_path / "plan.json", plan_json)
    result = run("run", "--plan", plan, "--steps", 1, "--out-dir", tmp_path / "R", option, value)
    assert_one_line_error(result, "runtime options", needle)


def test_compare_refuses_metrics_of_another_job_and_no_tokens(tmp_path, plan_json):
    write(tmp_path / "plan.json", plan_json)                     # global batch 8 x seq 128 = 1,024 tokens a step
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({**RECORD, "tokens": 2 * 64, "tokens_per_s": 64.0}) + "\n")
    assert_one_line_error(run("compare", tmp_path), str(metrics), "tokens=128 a step",
                          "global_batch 8 x seq_len 128 = 1,024", "another job")
    metrics.write_text(json.dumps({**RECORD, "tokens": 0}) + "\n")
    assert_one_line_error(run("compare", tmp_path), str(metrics), "line 1", "tokens: Input should be greater than or "
                          "equal to 1")
    metrics.write_text(json.dumps({**RECORD, "tokens": 8 * 128, "tokens_per_s": 512.0}) + "\n")
    assert run("compare", tmp_path, "--json").exit_code == 0


@pytest.mark.parametrize("lines, needles", [
    ([RECORD, RECORD], ["line 2", "step=1 after step 1", "steps must increase"]),
    ([{**RECORD, "step": 3}, RECORD], ["line 2", "step=1 after step 3"]),
    ([{**RECORD, "time_s": {"a2a": 0.5, "compute": 50.0}}], ["line 1", "time_s.compute=50 s", "step_time_s=2 s"]),
    ([RECORD, {**RECORD, "step": 2, "tokens": 1024, "tokens_per_s": 1.0}],
     ["line 2", "tokens_per_s=1", "1,024 / 2 s = 512", "within 1%"]),
    ([{**RECORD, "memory_bytes": [100] * 16}], ["step 1", "memory_bytes has 16 entries", "pp=1", "plan.json"]),
])
def test_compare_refuses_metrics_that_contradict_themselves_or_the_plan(tmp_path, plan_json, lines, needles):
    """Accepted before: duplicate or backward steps, a component longer than its step, tokens_per_s off
    tokens / step_time_s, more memory entries than the plan's pipeline stages."""
    write(tmp_path / "plan.json", plan_json)                     # pp 1, 1,024 tokens a step
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert_one_line_error(run("compare", tmp_path), "metrics.jsonl", *needles)


def test_compare_accepts_what_the_runtime_writes_at_the_edges(tmp_path, plan_json):
    """Migration is timed after the step (it may be longer); timers and rates within their tolerance pass."""
    write(tmp_path / "plan.json", plan_json)
    lines = [{**RECORD, "time_s": {"a2a": 2.02, "migration": 50.0}},
             {**RECORD, "step": 5, "tokens": 1024, "tokens_per_s": 512.0 * 1.009, "memory_bytes": [100]}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = run("compare", tmp_path, "--json")
    assert result.exit_code == 0, result.output


def test_compare_takes_the_steps_of_the_plans_layout_after_a_resume_under_another(tmp_path, plan_json):
    """Before: a run resumed under pp 1 after pp 2 (plan.json replaced, the pp 2 records kept) was refused (2 memory
    entries > pp=1) and its summary raised IndexError; now compare and the summary take the pp 1 steps."""
    from piper_plan.runtime.metrics import summarise

    write(tmp_path / "plan.json", plan_json)                     # pp 1, 1,024 tokens a step
    here = plan_json["parallel"]
    other = {**here, "pp": 2}
    old = [{**RECORD, "step": s, "tokens": 1024, "tokens_per_s": 102.4, "step_time_s": 10.0,
            "memory_bytes": [{"total_bytes": 900}, {"total_bytes": 800}],
            "parallel": other, "loss": 5.0} for s in (1, 2)]
    new = [{**RECORD, "step": s, "tokens": 1024, "tokens_per_s": 512.0, "memory_bytes": [{"total_bytes": 100}],
            "parallel": here,
            "loss": 4.0} for s in (3, 4, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in old + new))
    result = run("compare", tmp_path, "--json")
    assert result.exit_code == 0, result.output
    measured = json.loads(result.stdout)
    assert "note: 2 of 5 steps ran under another parallel layout" in result.stderr
    assert measured["step_time_s"]["measured"] == pytest.approx(2.0) and len(measured["memory_bytes_per_stage"]) == 1
    assert measured["steps_measured"] == 2                         # steps 4 and 5: step 3, the first, warms up
    summary = summarise(old + new)
    assert (summary["steps"], summary["step_time_s"], summary["peak_memory_bytes"]) == (5, 2.0, [100])
    unnamed = [{k: v for k, v in r.items() if k != "parallel"} for r in old]   # written by an earlier piper
    assert summarise(unnamed + new)["peak_memory_bytes"] == [100]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in old))
    assert_one_line_error(run("compare", tmp_path), "metrics.jsonl", "no step ran under the parallel layout")


def test_gradients_narrower_than_the_weights_and_a_window_pattern_without_a_window(tmp_path):
    """Accepted silently before (2-byte gradients of 4-byte weights halved the gradient memory; sliding_window_every
    without a window was ignored): one line each."""
    assert_one_line_error(run("estimate", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1",
                              "--dp", "2", "--ep", "2", "--grad-bytes", "2"),
                          "grad_bytes=2 is narrower than the weights' weight_bytes=4")
    text = (Path(__file__).parents[2] / "models" / "gpt-oss-120b.yaml").read_text()
    model = tmp_path / "m.yaml"
    model.write_text(text.replace("sliding_window: 128", "sliding_window: null"))
    assert "sliding_window: null" in model.read_text()
    assert_one_line_error(run("estimate", "--model", str(model), "--platform", "dgx-h100", "--nodes", "8",
                              "--dp", "64", "--ep", "64"),
                          f"{model}: attention: sliding_window_every=2 picks the layers of a sliding window")


def test_an_output_that_names_no_file_is_refused_and_a_group_of_partial_switches_too(tmp_path):
    for out in ("", "  ", str(tmp_path / "x.json") + "/", "-"):     # '-' is no stdout here: it was a file named '-'
        assert_one_line_error(run(*ESTIMATE, "-o", out), "-o:", "names no file")
    assert not (tmp_path / "x.json").exists() and not Path("-").exists()
    import yaml

    data = yaml.safe_load((Path(__file__).parents[2] / "platforms" / "local-cpu.yaml").read_text())
    data["network"]["nodes_per_group"] = 6
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    assert_one_line_error(run("estimate", "--model", "tiny-moe", "--platform", path, "--nodes", 1, "--dp", 2,
                              "--ep", 2), "nodes_per_group = 6 is not a whole number of switches")


@pytest.mark.parametrize("pairs", [[[99, 100]], [[-1, 0]], [[0, 0]]])
def test_link_device_pairs_outside_the_node_are_refused(tmp_path, pairs):
    import yaml

    data = yaml.safe_load((Path(__file__).parents[2] / "platforms" / "frontier.yaml").read_text())
    data["node"]["link_classes"][0]["device_pairs"] = pairs
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    assert_one_line_error(run("estimate", "--model", "tiny-moe", "--platform", path, "--nodes", 1, "--dp", 8,
                              "--ep", 8), "device_pairs", "are not pairs of two local devices 0..7")


@pytest.mark.parametrize("args, needles", [
    (("--recompute", "selective", "--recompute-modules", "moe_act", "--cost-option", "recompute_modules=[mlp]"),
     ["--cost-option: 'recompute_modules=[mlp]' sets what --recompute-modules already sets: give it once"]),
    (("--dropout", "--cost-option", "dropout=false"), ["'dropout=false' sets what --dropout already sets"]),
    (("--cost-option", "dropout=true", "--cost-option", "dropout=false"),     # before: the last one won, silently
     ["--cost-option: 'dropout=false' sets dropout a second time: give it once"]),
    (("--cost-option", "ep_dispatch=PER_NODE"), ["--cost-option ep_dispatch: ep_dispatch names 'PER_NODE'"]),
])
def test_a_cost_option_given_twice_or_out_of_its_choices_names_the_flag(args, needles):
    """Before: the --cost-option value silently won over --recompute-modules; a bad choice blamed 'options.X'."""
    assert_one_line_error(run(*ESTIMATE, *args), *needles)


def test_plan_dtype_any_inside_a_list_is_one_clear_line():
    """Before: "(a list or 'any' only for piper plan)", said by piper plan."""
    assert_one_line_error(run("plan", *TINY, "--nodes", "1", "--dtype", "any,fp8"),
                          "--dtype: 'any,fp8': 'any' stands alone")


@pytest.mark.parametrize("option", ["--repeats", "--warmup"])
def test_bench_call_counts_are_bounded(option):
    """Before: --repeats 1e21 ran until killed."""
    assert_one_line_error(run("bench", "a2a", "--no-save", "--nodes", 1, "--ranks-per-node", 2, "--sizes", "4K", option,
                              "999999999999999999999"), f"Invalid value for '{option}'", "<=10000")


# ---- seventh fuzzing round (2026-12-03): the launch block, status, token data, step counts -------------------
@pytest.mark.parametrize("edit, needle", [
    ({"sbatch": ["--output=/etc/cron.d/x"]}, "the job script sets --output itself"),
    ({"sbatch": ["-D=/"]}, "the job script sets -D itself"),
    ({"sbatch": ["--outp=/etc/x"]}, "the job script sets --output itself"),
    ({"env": {"SLURM_RESTART_COUNT": "1"}}, "launch.env='SLURM_RESTART_COUNT' is not allowed"),
    ({"env": {"IFS": "/"}}, "launch.env='IFS' is not allowed: it changes how bash runs the job script"),
])
def test_a_platform_launch_block_cannot_override_the_job_script(tmp_path, plan_json, edit, needle):
    """Before: a plan's platform.launch could add '#SBATCH --output=...' after piper's own line (sbatch takes the
    last) and export IFS before the script's own $(...)."""
    data = json.loads(json.dumps(plan_json))
    data["platform"]["launch"].update(edit)
    plan = write(tmp_path / "p.json", data)
    assert_one_line_error(run("launch", "--plan", plan, "--out", tmp_path / "job", "--dry-run"), needle)
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize("args, needle", [(("--time", "1-\u0660\u0662:00:00"), "time="),
                                          (("--steps", str(10**10)), "--steps")])
def test_launch_refuses_unicode_digits_in_time_and_absurd_steps(tmp_path, plan_json, args, needle):
    plan = write(tmp_path / "p.json", plan_json)
    assert_one_line_error(run("launch", "--plan", plan, "--out", tmp_path / "job", "--dry-run", *args), needle)


def test_calibrate_slurm_checks_the_launch_block_as_launch_does(tmp_path):
    """Before: `piper calibrate slurm` wrote a platform's env values as they were: export X="$(id)" ran id. (Since
    refused when the platform file is read, as every command reads it.)"""
    import yaml

    root = Path(__file__).resolve().parents[2]
    data = yaml.safe_load((root / "platforms" / "local-cpu.yaml").read_text())
    for launch, needle in (({"env": {"X": "$(id)"}}, "p.yaml: launch: launch.env.X='$(id)' is not allowed"),
                           ({"sbatch": ["-t5"]}, "p.yaml: launch: launch.sbatch='-t5' is not allowed: the job script "
                                                 "sets -t itself")):
        data["launch"] = {**data["launch"], **launch}
        path = write(tmp_path / "p.yaml", yaml.safe_dump(data))
        out = tmp_path / "cal.sbatch"
        assert_one_line_error(run("calibrate", "slurm", "--platform", path, "--nodes", 2, "--output", out), needle)
        assert not out.exists()
        data["launch"] = {k: v for k, v in data["launch"].items() if k not in launch}


@pytest.mark.parametrize("latest", [b"\xff\xfe", b"\x1b]0;PWNED\x07\x1b[2J5\n"])
def test_status_reads_checkpoints_latest_as_a_step_number(tmp_path, latest):
    """Before: bytes that are not UTF-8 raised UnicodeDecodeError; escape sequences were printed to the terminal.
    Now the checkpoint reads as damaged (escaped), and the job's state and metrics are still shown."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_bytes(latest)
    shown = run_dir_summary(tmp_path)["checkpoint"]
    assert shown.startswith("damaged (") and "\x1b" not in shown and "\n" not in shown, shown
    (tmp_path / "checkpoints" / "latest").write_text("12\n")
    assert run_dir_summary(tmp_path)["checkpoint"] == "12"


def test_blank_token_data_and_absurd_steps_are_refused_before_any_rank(tmp_path, plan_json):
    """Before: runtime.data "" passed the plan check and crashed every rank (IsADirectoryError on '.')."""
    for edit, args, needle in (({"data": " "}, (), "runtime.data"), ({}, ("--steps", str(10**10)), "--steps"),
                               ({"warmup_steps": 10**12}, (), "runtime.warmup_steps")):
        data = json.loads(json.dumps(plan_json))
        data.setdefault("runtime", {}).update(edit)
        plan = write(tmp_path / "p.json", data)
        assert_one_line_error(run("run", "--plan", plan, "--out-dir", tmp_path / "R", *args), needle)
        assert not (tmp_path / "R").exists()


def test_token_file_that_is_a_fifo_or_holds_ids_beyond_the_vocabulary(tmp_path):
    """Before: a FIFO as runtime.data blocked np.memmap for ever; a token id >= vocab_size crashed the embedding."""
    import numpy as np

    from piper_plan.errors import PiperError
    from piper_plan.runtime.data import MemmapTokens, open_token_file

    fifo = tmp_path / "fifo.bin"
    os.mkfifo(fifo)
    with pytest.raises(PiperError, match="not a regular file"):
        open_token_file(fifo, 512, 8)
    tokens = np.arange(64, dtype=np.uint16)
    tokens[40] = 60000
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    source = MemmapTokens(path, 512, 8)
    assert source.batch(0, 2).shape == (2, 9)                       # tokens 0..17
    with pytest.raises(PiperError, match="token 60000 at token index 40 is not allowed; allowed: 0 to vocab_size - 1"):
        source.batch(2, 2)                                          # tokens 32..49


def test_compare_takes_peak_bytes_where_total_bytes_is_null():
    from piper_plan.compare import measured_memory_per_stage

    assert measured_memory_per_stage([{"memory_bytes": [{"total_bytes": None, "peak_bytes": 7.0}]}]) == [7.0]


@pytest.mark.parametrize("line, needle", [
    ("           0             0     float    none      -1     0.19    0.00    0.00      0     0.18    0.00    0.00    N/A\n",
     "every data row has size 0"),
    ("     1048576        262144     float    none      -1    45.10   23.25 0e+2000000      0    44.80   23.41   40.96      0\n",
     "busbw '0e+2000000' out of range"),
])
def test_import_nccl_tests_without_data_or_with_an_unreadable_exponent(tmp_path, line, needle):
    """Before: a log of zero-byte rows wrote a header-only collectives.csv; 0e+2000000 raised decimal.Overflow."""
    header = ("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw"
              "   busbw #wrong\n#        (B)    (elements)                               (us)  (GB/s)  (GB/s)       "
              "     (us)  (GB/s)  (GB/s)\n")
    log = write(tmp_path / "a2a.log", header + line)
    assert_one_line_error(run("calibrate", "import-nccl-tests", log, "--op", "all_to_all", "--nodes", 1,
                              "--ranks-per-node", 2, "--scope", "node", "--platform", "local-cpu", "--out-dir",
                              tmp_path / "cal"), needle)
    assert not (tmp_path / "cal" / "collectives.csv").exists()


@pytest.mark.parametrize("args, needle", [
    (("plan", "--model", "tiny-moe", "--platform", "local-cpu", "--min-nodes", "--nodes", "4096"),
     "--nodes: nodes=4096; local-cpu has 1 to"),
    (("plan", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "\uff11"), "is not a node count"),
    ((*ESTIMATE, "--pp", "2", "--dp", "1", "--ep", "1", "--layers-per-stage", "\u0661,\u0661"), "--layers-per-stage"),
    # before: click's int() read '1_0' as ten and Arabic-Indic or full-width digits as numbers
    ((*ESTIMATE, "--nodes", "1_0"), "'--nodes': '1_0' is not a valid integer"),
    ((*ESTIMATE, "--dp", "\u0662"), "'--dp': '\u0662' is not a valid integer"),
    (("launch", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1", "--steps", "\uff15"),
     "'--steps': '\uff15' is not a valid integer"),
    ((*ESTIMATE, "--cost-option", "moe_saved_rows=100000000"), "moe_saved_rows: Input should be less than or equal to 2"),
    ((*ESTIMATE, "--cost-option", "migration_fraction=1"), "migration_fraction: Input should be less than 1"),
    # before: accepted, and priced as one row per chunk (0.185 s against 0.067 s at 1024), where a plan file refuses 0
    ((*ESTIMATE, "--cost-option", "unfused_kernels=true", "--cost-option", "loss_chunk_rows=0"),
     "loss_chunk_rows: Input should be greater than or equal to 1"),
    ((*ESTIMATE, "--cost-option", "moe_saved_rows=\x07"), "malformed YAML: unacceptable character #x0007"),
])
def test_planner_options_of_round_seven(args, needle):
    """Before: a --min-nodes start beyond the platform said 'nothing fits' (exit 3); Unicode digits parsed as
    counts; a million saved MoE buffers priced a 1e8 GiB plan; migration_fraction 1 doubled the step; a control
    character in a --cost-option value was PyYAML's traceback (its reader refuses it as the loader is made)."""
    assert_one_line_error(run(*args), needle)


def test_a_skew_beyond_the_ep_group_is_priced_at_its_most_and_said():
    result = run(*ESTIMATE, "--routing-skew", "1000")
    assert result.exit_code == 0, result.output
    assert "note: --routing-skew 1000 is priced as 2, the most an ep=2 group can see" in result.stderr, result.stderr


@pytest.mark.parametrize("edit, needle", [
    ({"moe": {"routing_skew": 1e308}}, "moe.routing_skew: Input should be less than or equal to 65536"),
    ({"moe": {"routing_skew": 2.0}}, "moe.routing_skew: 2.0, but training.routing_skew is 1.0"),
    ({"moe": {"capacity_factor": 1.25}}, "moe.capacity_factor: 1.25, but model.moe.capacity_factor is null"),
    ({"training": {"weight_bytes": True}}, "training.weight_bytes: a boolean is not a number"),
    ({"parallel": {"zero": True}}, "parallel.zero: a boolean is not a number"),
    ({"model": {"name": " "}}, "model.name: a name is one line, not blank"),
    ({"model": {"name": "m" * 300}}, "model.name: a name is at most 256 characters"),
    # before: "error: options: bogus: unknown field", no file, and the field named without its block
    ({"prediction": {"options": {"bogus": 1}}}, "p.json: prediction.options: bogus: unknown field"),
    # before: blamed on prediction.tokens_per_s, which piper derives from the node count
    ({"prediction": {"nodes": 4096}}, "p.json: prediction.nodes: 4096, but nodes is"),
])
def test_a_plan_file_that_contradicts_itself_or_types_a_boolean(tmp_path, plan_json, edit, needle):
    """Before: each was read (true as 1; a skew of 1e308 beside training's 1.0)."""
    data = json.loads(json.dumps(plan_json))
    for block, fields in edit.items():
        data[block].update(fields)
    plan = write(tmp_path / "p.json", data)
    assert_one_line_error(run("export", plan, "--engine", "megatron"), needle)


def test_the_overhead_benchmark_for_a_gpu_platform_is_refused_without_a_gpu():
    """It times the runtime's modules on the platform's device; recorded on this machine's CPU for frontier, its
    rows priced every GPU layer at CPU speed (and without concurrency rows, 8 ranks per node 8x slower)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the benchmark runs on it")
    assert_one_line_error(run("calibrate", "overhead", "--platform", "frontier", "--no-concurrency"),
                          "--platform", "frontier runs on launch.device=cuda", "torch sees no GPU here")


WITHOUT = """import sys
for name in {blocked!r}:
    sys.modules[name] = None          # as if not installed: `import name` raises ModuleNotFoundError
from piper_plan.cli.main import main
sys.argv = ["piper", *{args!r}]
main()
"""


@pytest.mark.parametrize("blocked, args, extra", [
    (["torch"], ["bench", "a2a", "--nodes", "2", "--ranks-per-node", "2", "--no-save"], "runtime"),
    (["torch"], ["calibrate", "overhead", "--platform", "local-cpu", "--out-dir", "{tmp}"], "runtime"),
    (["matplotlib"], [*ESTIMATE, "--plot", "{tmp}/m.png"], "plot"),
])
def test_a_command_needing_an_extra_not_installed_says_which_in_one_line(tmp_path, blocked, args, extra):
    # the planner's install (pip install -e .) has no torch: `piper bench a2a` printed a ModuleNotFoundError
    # traceback and exited 1, the code of a failed check
    import subprocess
    import sys

    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = subprocess.run([sys.executable, "-c", WITHOUT.format(blocked=blocked, args=args)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert f"pip install -e '.[{extra}]' in piper's checkout" in lines[0] and blocked[0] in lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("blocked, args", [
    (["pandas"], ["calibrate", "show", "--platform", "local-cpu"]),
    # torch installed, a module inside it missing (a build without distributed): not "torch is not installed"
    (["torch.distributed"], ["bench", "a2a", "--nodes", "2", "--ranks-per-node", "2", "--no-save"]),
])
def test_a_module_no_extra_installs_keeps_its_traceback(blocked, args):
    # a missing module that is not an optional package is a broken installation, not bad input
    import subprocess
    import sys

    code = WITHOUT.format(blocked=blocked, args=args)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and blocked[0] in proc.stderr, proc.stderr[-2000:]


# ---- hostile input found by a fuzzing pass (2026-12-03) ---------------------------------------------------
def test_migrate_holds_a_file_or_model_to_its_expert_limit(tmp_path):
    # the 16,384-expert limit held --experts only: a metrics file of 32,768 experts (or a model of 65,536) grew
    # the process to 24 GB until it was killed
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(json.dumps({"step": 1, "expert_tokens": [[1] * 16_385]}) + "\n")
    assert_one_line_error(run("migrate", "simulate", "--ep", 5, "--skew", metrics), str(metrics), "16,384 experts")
    model = yaml_copy(tmp_path, "models/tiny-moe.yaml")
    import yaml

    data = yaml.safe_load(model.read_text())
    data["moe"]["num_experts"] = 65_536
    model.write_text(yaml.safe_dump(data))
    assert_one_line_error(run("migrate", "simulate", "--ep", 2, "--model", model, "--platform", "local-cpu",
                              "--skew", "zipf:2"), "65,536", "16,384 experts")


@pytest.mark.parametrize("layout, needle", [("()*99999999999999999999", "expand past"),
                                            ("Et*\u0663|tL", "a repeat piper cannot read")])
def test_a_layout_repeat_is_bounded_and_ascii(layout, needle):
    # '()*10**20' raised OverflowError (exit 1); an Arabic-Indic 3 was read as 3
    args = ["estimate", *TINY, "--nodes", 1, "--dp", 1, "--pp", 2, "--ep", 1, "--schedule", "interleaved",
            "--virtual-stage-layers", layout]
    assert_one_line_error(run(*args), needle)


def test_an_out_dir_through_a_broken_link_is_refused_before_any_work(tmp_path, plan_json):
    # run started its ranks, which each failed at mkdir (87 lines of tracebacks); reproduce paper computed for 3 s
    # and then raised FileExistsError; launch --dry-run printed a script the real launch could not write
    dangling, loop = tmp_path / "dangling", tmp_path / "loop"
    dangling.symlink_to(tmp_path / "nowhere")
    loop.symlink_to(loop)
    plan = write(tmp_path / "p.json", plan_json)
    for folder in (dangling, loop / "x"):
        assert_one_line_error(run("run", "--plan", plan, "--steps", 1, "--out-dir", folder), "symbolic link")
        assert_one_line_error(run("reproduce", "paper", "--out-dir", folder), "symbolic link")
        assert_one_line_error(run("launch", "--plan", plan, "--out-dir", folder, "--dry-run"), "symbolic link")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "loop", "p.json"]


def test_reproduce_paper_does_not_replace_a_readme_it_did_not_write(tmp_path):
    (tmp_path / "README.md").write_text("mine\n")
    assert_one_line_error(run("reproduce", "paper", "--out-dir", tmp_path), "README.md", "not a report")
    assert (tmp_path / "README.md").read_text() == "mine\n"


def test_a_platform_holds_no_more_nodes_than_its_network_describes(tmp_path):
    # local-cpu's network is 4 nodes in one group: max_nodes 100,000 priced 1,000 nodes at a scope it never lists
    platform = yaml_copy(tmp_path, "platforms/local-cpu.yaml", max_nodes=100_000)
    assert_one_line_error(run("platform", "show", platform), "max_nodes", "100,000")


def test_launch_names_the_platform_file_whose_launch_block_is_bad(tmp_path):
    # the error named the temporary plan.json launch had made (and removed), after a search
    import yaml

    platform = yaml_copy(tmp_path, "platforms/local-cpu.yaml")
    data = yaml.safe_load(platform.read_text())
    data["launch"]["partition"] = "batch\n#SBATCH --output=/tmp/pwn"
    platform.write_text(yaml.safe_dump(data))
    line = assert_one_line_error(run("launch", "--model", "tiny-moe", "--platform", platform, "--nodes", 1,
                                     "--out-dir", tmp_path / "job"), str(platform), "partition")
    assert "piper-launch-" not in line and not (tmp_path / "job").exists()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a running process has used (/proc/<pid>/stat fields 14 and 15)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_what_the_system_refuses_is_one_line_not_a_traceback(tmp_path):
    """A path component over 255 bytes (any command, any file argument), stdout on a full device and a closed stdout
    were tracebacks (OSError, AttributeError on sys.stdout None); Ctrl-C said "Aborted!" and exited 1, a failed
    check's code."""
    import resource
    import signal
    import subprocess
    import sys
    import time

    piper = Path(sys.executable).parent / "piper"
    long_name = tmp_path / ("a" * 300 + ".json")
    for args in (["export", str(long_name), "--engine", "megatron"],
                 ["plan", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1", "-o", str(long_name)]):
        done = run(*args)
        assert done.exit_code == 2 and done.stderr.count("\n") == 1, done.output
        assert done.stderr.startswith(f"error: {str(long_name)[:117]}...: File name too long"), done.stderr
    with open("/dev/full", "w") as full:
        done = subprocess.run([str(piper), "models"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr == "error: the system refused a read or write: No space left on " \
                                                   "device\n", done.stderr
    closed = subprocess.run(f"{piper} models >&-", shell=True, stderr=subprocess.PIPE, text=True, timeout=60)
    assert closed.returncode == 141 and closed.stderr == "", closed.stderr
    simulate = [str(piper), "migrate", "simulate", "--ep", "2", "--experts", "8", "--max-iters", "0", "--layers"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([*simulate, "1"], stdout=subprocess.DEVNULL, check=True, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    whole_small_run_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    slow = subprocess.Popen([*simulate, "131072"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while _cpu_seconds(slow.pid) < whole_small_run_s + 0.3:     # past its start-up: into the command's own work
        assert slow.poll() is None, "the slow run ended before it could be interrupted"
        time.sleep(0.05)
    slow.send_signal(signal.SIGINT)
    assert slow.wait(timeout=60) == 130 and "Traceback" not in slow.stderr.read()


@pytest.mark.parametrize("args, folder", [(("validate",), "validation"), (("models",), "models"),
                                          (("platforms",), "platforms"), (ESTIMATE, "models")])
def test_a_piper_home_without_its_catalog_is_one_line(tmp_path, monkeypatch, args, folder):
    """Before: `piper validate` passed with no dataset checked (exit 0, {"datasets": [], "ok": true}), `models` and
    `platforms` printed empty tables, and an estimate said "unknown model 'tiny-moe'; known: " (nothing)."""
    monkeypatch.setenv("PIPER_HOME", str(tmp_path / "typo"))
    assert_one_line_error(run(*args), f"{tmp_path / 'typo' / folder} does not exist", "PIPER_HOME=")


@pytest.mark.parametrize("name, target, said", [("overhead.csv", "/nowhere/overhead.csv", "a symbolic link to nothing"),
                                                ("gemm.csv", "gemm.csv", "a symbolic link loop")])
def test_a_calibration_file_that_is_a_broken_link_is_one_line(tmp_path, monkeypatch, name, target, said):
    """Before: such a link read as an absent file, and the plan was priced without it (a dangling overhead.csv:
    0.0877 s -> 0.0325 s a step, host time not priced) without a word."""
    import shutil

    for folder in ("models", "platforms"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    shutil.copytree(ROOT / "calibration" / "local-cpu", tmp_path / "calibration" / "local-cpu")
    (tmp_path / "calibration" / "local-cpu" / name).unlink()
    (tmp_path / "calibration" / "local-cpu" / name).symlink_to(target)
    monkeypatch.setenv("PIPER_HOME", str(tmp_path))
    assert_one_line_error(run(*ESTIMATE), f"calibration/local-cpu/{name}: {said}")


def test_a_plan_file_given_as_a_platform_is_named_so(tmp_path, plan_json):
    """Before: one line listing 19 missing and unknown fields of a platform spec."""
    plan = write(tmp_path / "p.json", plan_json)
    for args in (("calibrate", "show", "--platform", plan), ("estimate", "--model", "tiny-moe", "--platform", plan,
                                                             "--nodes", "1")):
        assert_one_line_error(run(*args), "p.json: a plan file, not a platform file")
