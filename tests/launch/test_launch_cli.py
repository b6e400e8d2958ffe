"""`piper launch` / `piper compare` through the CLI: injection, --force, --dry-run, refusals, compare numbers."""

import json
import shlex

import pytest
from click.testing import CliRunner

from launch_plans import write_plan
from piper_plan.cli.main import cli
from piper_plan.compare import compare
from piper_plan.launch.job import for_the_runtime
from piper_plan.planfile import read_plan_file

INJECTIONS = ["a;rm -rf /", "x\n#SBATCH --nodes=999", "$(id)", "`id`", "a b", "a'b", 'a"b', "a|b", "a&&b", "../x", ""]


def run(*args, env=None):
    return CliRunner().invoke(cli, [str(a) for a in args], env=env)


@pytest.fixture
def plan(tmp_path):
    return write_plan(tmp_path / "plan.json", "frontier", 2, {"pp": 2, "dp": 8, "ep": 8})


@pytest.mark.parametrize("option", ["--job-name", "--partition", "--account", "--time"])
@pytest.mark.parametrize("value", INJECTIONS)
def test_injection_is_rejected_and_nothing_written(tmp_path, plan, option, value):
    out = tmp_path / "job"
    result = run("launch", "--plan", plan, "--out", out, option, value)
    assert result.exit_code == 2, result.output
    assert option.lstrip("-").replace("-", "_").replace("job_name", "job_name") in result.output or "not allowed" in result.output
    assert not out.exists()


@pytest.mark.parametrize("bad", ["job\nx", "job%j", "job\\x", "a-hetjob"])
def test_out_path_sbatch_cannot_read_is_rejected(tmp_path, plan, bad):
    result = run("launch", "--plan", plan, "--out", tmp_path / bad)
    assert result.exit_code == 2 and "--out-dir=" in result.output and "not allowed: it " in result.output
    assert not (tmp_path / bad).exists()


@pytest.mark.parametrize("folder", ["job dir", "ünï", "job$HOME;x`id`"])
def test_any_job_directory_sbatch_reads_is_written(tmp_path, plan, folder):
    """Spaces, letters of any script and shell characters were refused; sbatch reads them quoted, bash shell-quoted."""
    out = tmp_path / folder
    result = run("launch", "--plan", plan, "--out-dir", out)
    assert result.exit_code == 0, result.output
    assert (out / "job.sbatch").is_file() and f"--plan {shlex.quote(str(out / 'plan.json'))}" in result.output + \
        (out / "job.sbatch").read_text()


def test_the_dry_run_default_directory_is_named_as_a_default_not_as_out_dir(tmp_path, plan, monkeypatch):
    """Without --out-dir, a refusal named --out-dir='.../job', an option never given."""
    (tmp_path / "a%b").mkdir()
    monkeypatch.chdir(tmp_path / "a%b")
    result = run("launch", "--plan", plan, "--dry-run")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {str(tmp_path / 'a%b' / 'job')!r} (--dry-run's default job directory "
                                    "./job, as no --out-dir was given) is not allowed: "), result.stderr
    assert "--out-dir=" not in result.stderr


def test_env_injection_in_platform_is_rejected(tmp_path):
    plan = write_plan(tmp_path / "plan.json", "frontier", 2, {"pp": 2, "dp": 8, "ep": 8})
    data = json.loads(plan.read_text())
    data["platform"]["launch"]["env"]["EVIL"] = "$(touch /tmp/pwned)"      # a hand-edited (or received) file
    plan.write_text(json.dumps(data))
    result = run("launch", "--plan", plan, "--out", tmp_path / "job")
    assert result.exit_code == 2 and result.stderr.startswith(f"error: {plan}: platform.launch: launch.env.EVIL=")
    assert not (tmp_path / "job").exists()


def test_writes_three_files_and_force(tmp_path, plan):
    out = tmp_path / "job"
    first = run("launch", "--plan", plan, "--out", out, "--json")
    assert first.exit_code == 0, first.output
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "job.sbatch", "plan.json"]
    assert json.loads((out / "plan.json").read_text())["nodes"] == 2
    report = json.loads(first.stdout)
    assert report["job_id"] is None and report["out"] == str(out) and report["world"] == 16
    again = run("launch", "--plan", plan, "--out", out)
    assert again.exit_code == 2 and "--force" in again.output
    forced = run("launch", "--plan", plan, "--out", out, "--force", "--steps", "9")
    assert forced.exit_code == 0, forced.output
    assert "--steps 9" in (out / "job.sbatch").read_text()


def test_dry_run_prints_and_writes_nothing(tmp_path, plan):
    out = tmp_path / "job"
    result = run("launch", "--plan", plan, "--out", out, "--dry-run")
    assert result.exit_code == 0 and result.stdout.startswith("#!/bin/bash") and "#SBATCH --nodes=2" in result.stdout
    assert not out.exists()
    as_json = run("launch", "--plan", plan, "--out", out, "--dry-run", "--json")
    assert as_json.exit_code == 0, as_json.output
    report = json.loads(as_json.stdout)
    assert report["script"] == result.stdout and (report["nodes"], report["world"]) == (2, 16)
    assert report["ranks_per_node"] == 8 and report["platform"] == "frontier"
    assert not out.exists()
    bare = run("launch", "--plan", plan, "--dry-run")          # no --out-dir: the script names ./job (before: refused)
    assert bare.exit_code == 0 and "/job" in bare.stdout, bare.output
    needs = run("launch", "--plan", plan)
    assert needs.exit_code == 2 and "Missing option '--out-dir'" in needs.output


def test_plan_outside_runtime_capability_is_refused(tmp_path):
    plan = write_plan(tmp_path / "plan.json", "frontier", 2, {"pp": 2, "dp": 4, "tp": 2, "sequence_parallel": False},
                      model="tiny-dense")     # a dense model: MoE with tp > 1 and no sequence parallelism is no plan
    result = run("launch", "--plan", plan, "--out", tmp_path / "job")
    assert result.exit_code == 2 and "parallel.sequence_parallel=false with tp=2" in result.output
    assert not (tmp_path / "job").exists()


def test_no_sbatch_on_path_is_a_clear_error(tmp_path, plan):
    result = run("launch", "--plan", plan, "--out", tmp_path / "job", "--submit", env={"PATH": str(tmp_path)})
    assert result.exit_code == 2 and "sbatch not found on PATH" in result.output


def test_plan_from_options_runs_the_search(tmp_path):
    out = tmp_path / "j"
    result = run("launch", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "2", "--seq", "64",
                 "--global-batch", "8", "--out", out, "--json")
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "plan.json").read_text())
    assert saved["nodes"] == 2 and saved["parallel"]["tp"] == 1  # --runnable: the runtime has no tp
    assert json.loads(result.stdout[result.stdout.index("{"):])["world"] == 4
    half = run("launch", "--model", "tiny-moe", "--out", tmp_path / "k")
    assert half.exit_code == 2 and "--platform" in half.output


# compare: hand-made numbers. Steps 1..3; step 1 is warm-up and left out.
RECORDS = [
    {"step": 1, "step_time_s": 9.0, "tokens_per_s": 10.0, "time_s": {"a2a": 1.0},
     "memory_bytes": [{"total_bytes": 100}, {"total_bytes": 300}]},
    {"step": 2, "step_time_s": 2.0, "tokens_per_s": 50.0, "time_s": {"a2a": 0.5},
     "memory_bytes": [{"total_bytes": 120}, {"total_bytes": 250}]},
    {"step": 3, "step_time_s": 2.5, "tokens_per_s": 40.0, "time_s": {"a2a": 0.5},
     "memory_bytes": [{"total_bytes": 110}, {"total_bytes": 260}]},
]
PREDICTION = {"step_time_s": 1.5, "tokens_per_s": 60.0, "a2a_share": 0.2,
              "time": {"breakdown": {"compute/attention": 1.0, "moe/dispatch/intra_node": 0.2, "moe/combine/intra_node": 0.1}},
              "memory": {"peak_bytes": 330, "per_stage": [{"total_bytes": 150}, {"total_bytes": 330}]}}


def test_compare_numbers():
    result = compare(PREDICTION, RECORDS)
    assert result["steps_measured"] == 2
    # measured step time = median(2.0, 2.5) = 2.25; rel = (1.5 - 2.25) / 2.25 = -1/3
    assert result["step_time_s"]["measured"] == 2.25
    assert result["step_time_s"]["rel_error"] == pytest.approx(-1 / 3)
    # tokens/s: median(50, 40) = 45; (60 - 45) / 45 = 1/3
    assert result["tokens_per_s"]["rel_error"] == pytest.approx(1 / 3)
    # a2a share: measured median(0.5/2.0, 0.5/2.5) = median(0.25, 0.2) = 0.225; predicted (0.2 + 0.1) / 1.5 = 0.2
    assert result["a2a_share"]["measured"] == pytest.approx(0.225)
    assert result["a2a_share"]["predicted"] == pytest.approx(0.2)
    # memory: max over all steps, per stage: 120 and 300
    mem = result["memory_bytes_per_stage"]
    assert [m["measured"] for m in mem] == [120, 300]
    assert mem[0]["rel_error"] == pytest.approx((150 - 120) / 120) and mem[1]["rel_error"] == pytest.approx(0.1)


def test_compare_cli_json(tmp_path):
    job = tmp_path / "job"
    (job / "run").mkdir(parents=True)
    write_plan(job / "plan.json", "frontier", 2, {"pp": 2, "dp": 8, "ep": 8},
               prediction={"memory": PREDICTION["memory"]})          # the estimate's own (coherent) figures
    stored = json.loads((job / "plan.json").read_text())["prediction"]["step_time_s"]
    (job / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    result = run("compare", job / "run", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    # the run is piper's runtime's: measured against the plan as it runs it (unfused kernels), not the file's
    # fused-kernel figure, and told so
    predicted = for_the_runtime(read_plan_file(job / "plan.json"))[0].prediction.step_time_s
    assert predicted > stored and "the run ran piper's runtime" in result.stderr
    assert data["step_time_s"]["rel_error"] == pytest.approx(predicted / 2.25 - 1)     # measured: median 2.25 s
    table = run("compare", job)
    assert table.exit_code == 0, table.output


def test_launch_prices_the_plan_again_not_the_figures_written_beside_it(tmp_path, plan):
    """A hand-edited plan.json (here 16x the global batch) launched with the wall time and memory of its old
    prediction; now the job is sized by what the plan costs, the user is told, and the job's plan.json carries it.
    A file whose own figures are right launches silently, unchanged."""
    same = run("launch", "--plan", plan, "--out-dir", tmp_path / "same")
    assert same.exit_code == 0 and "stored prediction" not in same.stderr
    assert (tmp_path / "same" / "plan.json").read_text() == plan.read_text()
    data = json.loads(plan.read_text())
    old_step = data["prediction"]["step_time_s"]
    data["training"]["global_batch"] *= 16
    data["parallel"]["num_microbatches"] *= 16
    data["runtime"]["steps"] = 1000
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    res = run("launch", "--plan", edited, "--out-dir", tmp_path / "job")
    assert res.exit_code == 0, res.stderr
    assert f"{edited}: its stored prediction (step {old_step:.4g} s" in res.stderr
    written = json.loads((tmp_path / "job" / "plan.json").read_text())["prediction"]["step_time_s"]
    assert written > 10 * old_step
    as_run = for_the_runtime(read_plan_file(tmp_path / "job" / "plan.json"))[0].prediction.step_time_s
    assert f"step_time_s: {as_run:.4g}" in (tmp_path / "job" / "README.md").read_text()


def test_a_job_of_piper_s_runtime_is_sized_by_its_pricing_not_another_engine_s(tmp_path):
    """DeepSeek-V3 on 32 H200 nodes priced as Megatron-Core runs it (fused kernels, 5.07 s a step when written; 67 s
    since h200 prices Megatron-Core's host work per GEMM call, 32 local experts a layer): its job, which runs piper's
    runtime (13.3 s a step as that prices it, its own host overhead measured on an H200), got 1,000 steps' wall time
    from the plan file's step (3:02 for 3.7 h of steps when written). Now the wall time and the README take the
    runtime's figures, and the user is told."""
    plan = tmp_path / "ds.json"
    assert run("estimate", "--model", "deepseek-v3", "--platform", "h200", "--nodes", "32", "--dp", "4", "--tp", "4",
               "--pp", "16", "--ep", "8", "--zero", "1", "--seq", "1024", "-o", plan).exit_code == 0
    saved = json.loads(plan.read_text())["prediction"]["step_time_s"]
    as_run = for_the_runtime(read_plan_file(plan))[0].prediction.step_time_s
    assert saved > 2 * as_run
    res = run("launch", "--plan", plan, "--out-dir", tmp_path / "job", "--steps", "1000", "--json")
    assert res.exit_code == 0, res.stderr
    hours, minutes, _ = map(int, json.loads(res.stdout)["time"].split(":"))
    assert 1000 * as_run < (hours * 60 + minutes) * 60 < 1000 * saved
    assert f"step_time_s: {as_run:.4g}" in (tmp_path / "job" / "README.md").read_text()
    assert "the job runs piper's runtime" in res.stderr and f"step {as_run:.4g} s" in res.stderr


def test_stale_note_only_when_its_figures_differ(tmp_path, plan):
    """A stored step time off by 0.2% (the same plan priced on another machine's numpy and scipy came out 0.15%
    apart): no note that the file was edited; the job's plan.json still carries the prediction piper computes now."""
    data = json.loads(plan.read_text())
    fresh_step = data["prediction"]["step_time_s"]
    data["prediction"]["step_time_s"] *= 1 + 2e-3
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    res = run("launch", "--plan", edited, "--out-dir", tmp_path / "job")
    assert res.exit_code == 0, res.stderr
    assert "stored prediction" not in res.stderr
    assert json.loads((tmp_path / "job" / "plan.json").read_text())["prediction"]["step_time_s"] == fresh_step


@pytest.mark.parametrize("field, value, shown", [("fits", False, "fits False"), ("placement", "somewhere", "placement "
                                                 "somewhere"), ("scopes", {"dp": "system"}, "scopes dp system")])
def test_an_edited_verdict_is_noted_as_an_edited_figure_is(tmp_path, plan, field, value, shown):
    """Before: a stored prediction's fit verdict, placement or scopes edited by hand went unnoted (estimate --plan
    and launch noted step time, peak memory and node count only)."""
    data = json.loads(plan.read_text())
    fresh = data["prediction"][field]
    data["prediction"][field] = value
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    for command in (("estimate", "--plan", edited), ("launch", "--plan", edited, "--out-dir", tmp_path / "job")):
        res = run(*command)
        assert res.exit_code == 0, res.stderr
        assert f"{shown}) is not what its plan costs now (" in res.stderr and "the file was edited" in res.stderr
    assert json.loads((tmp_path / "job" / "plan.json").read_text())["prediction"][field] == fresh


def test_a_file_saved_before_a_group_was_named_is_not_called_edited(tmp_path, plan):
    """Plan files saved before cp's scope was named (2026-12-01) lack scopes.cp: not an edit."""
    data = json.loads(plan.read_text())
    del data["prediction"]["scopes"]["cp"]
    older = tmp_path / "older.json"
    older.write_text(json.dumps(data))
    res = run("estimate", "--plan", older)
    assert res.exit_code == 0 and "stored prediction" not in res.stderr, res.stderr


def test_the_job_carries_the_prediction_piper_computes_not_the_files(tmp_path, plan):
    """Figures a prediction may hold but this plan's does not (mfu, hfu doubled) are not copied into the job."""
    data = json.loads(plan.read_text())
    fresh = data["prediction"]
    data["prediction"] = {**fresh, "mfu": 2 * fresh["mfu"], "hfu": 2 * fresh["hfu"]}
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    assert run("launch", "--plan", edited, "--out-dir", tmp_path / "job").exit_code == 0
    written = json.loads((tmp_path / "job" / "plan.json").read_text())["prediction"]
    assert (written["mfu"], written["hfu"]) == (fresh["mfu"], fresh["hfu"])


@pytest.mark.parametrize("edit, field, needle", [
    ({"mfu": 5.0}, "prediction.mfu", "allowed: 0 to 2 (the device's peak FLOP/s, attention counted non-causally)"),
    ({"hfu": 2.5}, "prediction.hfu", "allowed: 0 to 2"),
    ({"mfu_megatron": 2.0}, "prediction.mfu_megatron", "allowed: 0 to 1"),
    ({"mfu": 0.5, "hfu": 0.01}, "prediction.hfu", "is below mfu=0.5"),
])
def test_impossible_prediction_is_one_line(tmp_path, plan, edit, field, needle):
    data = json.loads(plan.read_text())
    data["prediction"].update(edit)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    res = run("launch", "--plan", edited, "--out-dir", tmp_path / "job")
    assert res.exit_code == 2 and not (tmp_path / "job").exists()
    line = res.stderr.strip()
    assert "\n" not in line and line.startswith(f"error: {edited}: {field}: ") and needle in line, line


def test_a_palm_utilisation_above_one_is_read(tmp_path, plan):
    """PaLM's MFU counts attention non-causally: a long-sequence plan may pass 1 (refused before); Megatron's not."""
    data = json.loads(plan.read_text())
    data["prediction"].update(mfu=1.2, hfu=1.3)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    assert run("launch", "--plan", edited, "--out-dir", tmp_path / "job", "--dry-run").exit_code == 0


def test_prediction_within_rounding_is_read(tmp_path, plan):
    """hfu = mfu (nothing recomputed) rounded apart in the last digits: still a plan."""
    data = json.loads(plan.read_text())
    p = data["prediction"]
    p.update(hfu=p["mfu"] * (1 - 1e-9), tokens_per_s=float(f"{p['tokens_per_s']:.3g}"))
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    assert run("launch", "--plan", edited, "--out-dir", tmp_path / "job", "--dry-run").exit_code == 0


def test_platform_errors_of_a_plan_file_name_it(tmp_path, plan):
    """launch.env and the dtype's peak are checked after the file is read; their one line still names it."""
    data = json.loads(plan.read_text())
    data["training"]["dtype"] = "fp8"                     # frontier lists no fp8 peak
    no_peak = tmp_path / "no_peak.json"
    no_peak.write_text(json.dumps(data))
    res = run("launch", "--plan", no_peak, "--out-dir", tmp_path / "job", "--dry-run")
    assert res.exit_code == 2 and res.stderr.startswith(f"error: {no_peak}: training.dtype: platform frontier has no "
                                                        "peak for dtype=fp8"), res.stderr


@pytest.mark.parametrize("flags, said", [
    (["--dropout"], "options.dropout=true (the runtime trains without dropout)"),
    (["--recompute", "selective", "--recompute-modules", "core_attn,moe"],
     "options.recompute_modules=core_attn,moe with recompute=selective (the runtime recomputes core_attn only)")])
def test_options_that_change_the_training_are_refused(tmp_path, flags, said):
    """A plan saved with dropout layers or selective recompute beyond the runtime's own: the runtime would train
    something else than the plan, so launch says what in one line and writes nothing (before: launched)."""
    saved, out = tmp_path / "plan.json", tmp_path / "job"
    made = run("estimate", "--model", "tiny-moe", "--platform", "frontier", "--nodes", "1", "--dp", "8", "--ep", "8",
               *flags, "-o", saved)
    assert made.exit_code == 0, made.output
    result = run("launch", "--plan", saved, "--out", out, "--dry-run")
    assert result.exit_code == 2 and said in result.stderr and result.stderr.count("\n") == 1
    assert not out.exists()


def test_recompute_modules_that_act_on_nothing_are_said_and_do_not_stop_a_launch(tmp_path):
    """shared_experts on a model without shared experts recomputes nothing (Megatron-Core skips it; piper prices
    nothing): estimate said nothing and launch refused the plan as recomputing other modules than the runtime's.
    Now estimate notes it and launch takes the plan; a module that does act (moe) is still refused."""
    saved = tmp_path / "plan.json"
    common = ("estimate", "--model", "tiny-moe", "--platform", "frontier", "--nodes", "1", "--dp", "8", "--ep", "8",
              "--recompute", "selective")
    made = run(*common, "--recompute-modules", "shared_experts", "-o", saved)
    assert made.exit_code == 0, made.output
    assert "recompute modules shared_experts (it has no shared experts) act on nothing in tiny-moe" in made.stderr
    assert run("launch", "--plan", saved, "--out", tmp_path / "job", "--dry-run").exit_code == 0
    acting = tmp_path / "acting.json"
    assert run(*common, "--recompute-modules", "shared_experts,moe", "-o", acting).exit_code == 0
    refused = run("launch", "--plan", acting, "--out", tmp_path / "job2", "--dry-run")
    assert refused.exit_code == 2 and "the runtime recomputes core_attn only" in refused.stderr


def test_a_run_of_its_warm_up_step_only_is_said_to_be_so():
    """A run stopped after its first step: compare called that warm-up step "steady" (its figures allocation's and
    connections', its optimizer state not yet made)."""
    assert compare(PREDICTION, [dict(RECORDS[0], warmup=True)])["warmup_only"] is True
    assert compare(PREDICTION, RECORDS)["warmup_only"] is False


def test_a_plan_file_without_a_prediction_is_priced_and_checked_as_any_other(tmp_path):
    """Before: without `prediction` (or with `{}`) launch and run checked no memory (Mixtral on 8 Frontier nodes,
    85.81 GiB of 64 as piper's runtime runs it, got a 13-minute job), while estimate --plan and compare refused it."""
    saved = tmp_path / "plan.json"
    done = run("estimate", "--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "8", "--dp", "32", "--pp",
               "2", "--ep", "8", "--zero", "1", "-o", saved)
    assert done.exit_code == 0, done.output
    data = json.loads(saved.read_text())
    refusal = run("launch", "--plan", saved, "--dry-run").stderr.split("prediction.fits: ", 1)[-1]
    for prediction in (None, {}):
        if prediction is None:
            data.pop("prediction", None)
        else:
            data["prediction"] = prediction
        bare = tmp_path / "bare.json"
        bare.write_text(json.dumps(data))
        for command in (("launch", "--plan", bare, "--dry-run"), ("run", "--plan", bare, "--out-dir", tmp_path / "r")):
            res = run(*command)
            assert res.exit_code == 2 and res.stderr == f"error: {bare}: {refusal}", res.stderr
        priced = run("estimate", "--plan", bare, "--json")
        assert priced.exit_code == 0 and "holds no prediction; priced now" in priced.stderr
        assert json.loads(priced.stdout)["step_time_s"] == pytest.approx(json.loads(saved.read_text())["prediction"]
                                                                         ["step_time_s"], rel=5e-3)


def test_a_dry_run_warns_of_a_partial_segment_and_the_readme_says_whose_figures_it_shows(tmp_path):
    """Before: the segment warning was printed only by a launch that wrote the job without --json; the job README
    called the runtime-priced figures plan.json's, which holds the fused engine's."""
    saved = tmp_path / "gb.json"
    assert run("estimate", "--model", "qwen3-30b-a3b", "--platform", "gb200-nvl72", "--nodes", "18", "--dp", "72",
               "--ep", "8", "--global-batch", "1152", "-o", saved).exit_code == 0
    for extra in (("--dry-run", "--json"), ("--dry-run",), ("--json",)):
        res = run("launch", "--plan", saved, "--out-dir", tmp_path / "job", "--force", *extra)
        assert res.exit_code == 0 and "warning: 18 nodes is not a multiple of the platform's 16-node segment" \
            in res.stderr, (extra, res.stderr)
        if "--json" in extra:
            assert "Slurm keeps only 2 nodes together" in json.loads(res.stdout)["segment_warning"]
    readme = (tmp_path / "job" / "README.md").read_text()
    stored = json.loads((tmp_path / "job" / "plan.json").read_text())["prediction"]["step_time_s"]
    assert f"plan.json's own prediction assumed another engine's fused kernels (step {stored:.4g} s" in readme
