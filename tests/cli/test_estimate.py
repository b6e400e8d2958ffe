"""`piper estimate`: JSON numbers, plan.json round trip, overflow shown (not an error), bad degrees exit 2."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from piper_plan.cli.main import cli
from piper_plan.planfile import read_plan_file

ARGS = ["estimate", "--model", "tiny-moe", "--platform", "frontier", "--nodes", "1", "--dp", "4", "--pp", "2",
        "--ep", "4", "--seq", "256", "--global-batch", "16", "--no-calibration"]


def _run(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def test_estimate_json_has_the_contract_fields():
    result = _run(ARGS + ["--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "hfu"):
        assert data[key] > 0
    assert len(data["memory"]["per_stage"]) == 2
    stage = data["memory"]["per_stage"][0]
    assert stage["total_bytes"] == max(s["total_bytes"] for s in data["memory"]["per_stage"]) \
        or stage["total_bytes"] <= data["memory"]["peak_bytes"]
    assert abs(sum(stage["components"].values()) - stage["total_bytes"]) <= 1e-6 * stage["total_bytes"]
    assert abs(sum(data["time"]["breakdown"].values()) - data["step_time_s"]) <= 1e-9 * data["step_time_s"]
    assert data["tokens_per_s"] == 16 * 256 / data["step_time_s"]


def test_estimate_save_writes_a_readable_plan(tmp_path):
    path = tmp_path / "plan.json"
    result = _run(ARGS + ["--a2a", "halo", "--save", str(path)])
    assert result.exit_code == 0, result.output
    plan = read_plan_file(path)
    assert (plan.parallel.dp, plan.parallel.pp, plan.parallel.ep, plan.parallel.a2a) == (4, 2, 4, "halo")
    assert plan.parallel.layers_per_stage == [2, 2] and plan.parallel.num_microbatches == 4
    raw = json.loads(path.read_text())
    assert raw["schema_version"] == 5 and raw["parallel"]["edp"] == 1
    assert raw["migration"] == {"enabled": False, "threshold": 1.1, "interval": 50, "max_iters": 16,
                                "window": None}                  # off unless --migration, as `piper plan -o` writes it
    assert raw["prediction"]["step_time_s"] > 0
    assert _run(ARGS + ["--migration", "-o", str(path)]).exit_code == 0
    assert json.loads(path.read_text())["migration"]["enabled"] is True


def test_json_states_the_plan_as_the_saved_file_does(tmp_path):
    """`estimate --json`'s parallel block is the saved plan's, its split resolved into the list it priced (before:
    the split as asked, 'balanced', beside a file saying 'explicit' with the same list)."""
    path = tmp_path / "plan.json"
    shown = json.loads(_run(ARGS + ["--layers-split", "balanced", "--json", "-o", str(path)]).stdout)["parallel"]
    saved = json.loads(path.read_text())["parallel"]
    assert shown == saved and shown["layers_split"] == "explicit" and shown["layers_per_stage"] == [2, 2]
    again = json.loads(_run(["estimate", "--plan", str(path), "--json"]).stdout)["parallel"]
    assert again == saved


def test_plan_that_does_not_fit_is_shown_with_its_overflow():
    args = ["estimate", "--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "1", "--dp", "8",
            "--ep", "8", "--seq", "4096", "--global-batch", "64", "--mbs", "8", "--json", "--no-calibration"]
    result = _run(args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["fits"] is False
    assert data["memory"]["overflow_bytes"] == data["memory"]["peak_bytes"] - data["memory"]["device_bytes"] > 0


def test_bad_degrees_are_one_line_errors_exit_2():
    for extra in (["--dp", "3"], ["--ep", "3"], ["--tp", "3", "--dp", "1", "--pp", "8"]):
        result = CliRunner().invoke(cli, ARGS + extra)
        assert result.exit_code == 2, result.output
        assert result.output.startswith("error: ") and result.output.count("\n") == 1


def test_estimate_says_where_the_all_to_all_time_comes_from():
    """Without calibration the expert all-to-all is priced from the platform's network figures, and says so;
    with Frontier's seed calibration (all_to_all rows at the node scope) a one-node group uses them."""
    plain = json.loads(_run(ARGS + ["--json"]).stdout)
    assert plain["sources"]["a2a"] == "platform network figures (alpha-beta)"
    calibrated = json.loads(_run([a for a in ARGS if a != "--no-calibration"] + ["--json"]).stdout)
    assert calibrated["sources"]["a2a"] == "calibration: all_to_all@node"
    assert calibrated["time"]["breakdown"]["moe/dispatch/intra_node"] != plain["time"]["breakdown"]["moe/dispatch/intra_node"]


def test_precision_and_gradient_bytes_are_options_and_reach_the_plan(tmp_path):
    """--dtype fp8 on a platform with an 8-bit rate: faster GEMMs, 8-bit weight copies; --grad-bytes 4 (fp32
    main gradients) costs 2 more bytes per parameter; both are saved in plan.json. Frontier has no fp8: one line."""
    h100 = ["estimate", "--model", "mixtral-8x7b", "--platform", "dgx-h100", "--nodes", "2", "--dp", "8",
            "--pp", "2", "--ep", "8", "--no-calibration", "--json"]
    base = json.loads(_run(h100).stdout)
    fp8 = json.loads(_run(h100 + ["--dtype", "fp8"]).stdout)
    assert fp8["step_time_s"] < base["step_time_s"]
    assert fp8["memory"]["peak_bytes"] > base["memory"]["peak_bytes"]
    saved = tmp_path / "plan.json"
    grad4 = _run(h100 + ["--grad-bytes", "4", "-o", str(saved)])
    assert json.loads(grad4.stdout)["memory"]["peak_bytes"] > base["memory"]["peak_bytes"]
    training = read_plan_file(saved).training
    assert (training.dtype, training.grad_bytes) == ("bf16", 4)
    refused = _run(ARGS + ["--dtype", "fp8"])
    assert refused.exit_code == 2 and "no peak for dtype=fp8" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_dropout_adds_its_masks_to_activations_only_and_the_runtime_refuses_it(tmp_path):
    """--dropout (CostOptions.dropout): 1-byte masks after the attention projection and the MLP (and on the
    attention scores without flash attention): activations grow (and the fragmentation allowance on them),
    nothing else; the plan `plan --dropout` saves carries the prediction `estimate` makes with dropout."""
    from piper_plan.cli.common import platform_calibration
    from piper_plan.cli.options import cost_options
    from piper_plan.cost.evaluate import estimate

    base, drop = (json.loads(_run(ARGS + extra + ["--json"]).stdout) for extra in ([], ["--dropout"]))
    assert drop["options"]["dropout"] is True and base["options"]["dropout"] is False
    for a, b in zip(base["memory"]["per_stage"], drop["memory"]["per_stage"]):
        grown = {k for k in a["components"] if b["components"][k] != a["components"][k]}
        assert grown and all(k.startswith("activations/") or k == "fragmentation" for k in grown), grown
        assert all(b["components"][k] > a["components"][k] for k in grown)
    saved = tmp_path / "plan.json"
    res = CliRunner().invoke(cli, ["plan", "--model", "tiny-moe", "--platform", "frontier", "--nodes", "1", "--seq",
                                   "256", "--global-batch", "16", "--dropout", "-o", str(saved)])
    assert res.exit_code == 0, res.output
    pf = read_plan_file(saved)
    again = estimate(pf.model, pf.platform, pf.training, pf.nodes, pf.parallel, placement=pf.placement,
                     calibration=platform_calibration("frontier"), options=cost_options(False, True))
    assert again.memory.peak_bytes == pf.prediction.memory.peak_bytes
    assert again.memory.peak_bytes > estimate(pf.model, pf.platform, pf.training, pf.nodes, pf.parallel,
                                              placement=pf.placement,
                                              calibration=platform_calibration("frontier")).memory.peak_bytes
    for refused in (ARGS + ["--dropout", "--piper-runtime"],
                    ["plan", "--model", "tiny-moe", "--platform", "frontier", "--nodes", "1", "--dropout", "--runnable"]):
        res = CliRunner().invoke(cli, refused)
        assert res.exit_code == 2 and "trains without dropout" in res.stderr and res.stderr.count("\n") == 1


def test_recompute_modules_are_priced_and_the_runtime_keeps_its_own():
    """--recompute-modules (CostOptions.recompute_modules) changes what --recompute selective saves; the names
    are checked; piper's runtime recomputes the attention core only."""
    args = ["estimate", "--model", "tiny-mla", "--platform", "frontier", "--nodes", "1", "--dp", "8", "--ep", "8",
            "--seq", "256", "--global-batch", "16", "--no-calibration", "--recompute", "selective", "--json"]
    core, more = (json.loads(_run(args + extra).stdout) for extra in ([], ["--recompute-modules", "mla_up_proj,mlp"]))
    assert core["options"]["recompute_modules"] == ["core_attn"]
    assert more["options"]["recompute_modules"] == ["mla_up_proj", "mlp"]
    assert more["memory"]["peak_bytes"] < core["memory"]["peak_bytes"] and more["step_time_s"] > core["step_time_s"]
    for extra, needle in ((["--recompute-modules", "mlp,bogus"],
                           "--recompute-modules: 'mlp,bogus': 'bogus' is not a module piper prices; allowed: a "
                           "comma-separated list of core_attn"),
                          (["--recompute-modules", "mlp", "--piper-runtime"], "recomputes core_attn only")):
        res = CliRunner().invoke(cli, args + extra)
        assert res.exit_code == 2 and needle in res.stderr and res.stderr.count("\n") == 1, res.stderr
    for recompute in ("none", "full"):   # plan ranks these beside selective ones: priced alike, the modules noted
        given = [a for a in args if a != "selective"][:-2] + ["--recompute", recompute, "--json"]
        res = CliRunner().invoke(cli, given + ["--recompute-modules", "mlp"])
        assert res.exit_code == 0 and f"this plan has --recompute {recompute}, so they change nothing" in res.stderr
        without = json.loads(_run(given).stdout)
        assert json.loads(res.stdout)["step_time_s"] == without["step_time_s"]


def test_the_json_names_each_utilisation_figures_flop_convention_and_the_pricing_sources():
    """Issue 17: MFU / HFU in two conventions, both named in the JSON (PaLM and Megatron), and where the rates and
    the host time come from; plan's JSON says the same of its search."""
    est = json.loads(_run(ARGS + ["--json"]).stdout)
    conventions = est["flops_conventions"]
    assert conventions["mfu, hfu, tflops_per_device"].startswith("PaLM")
    assert conventions["mfu_megatron, hfu_megatron"].startswith("Megatron")
    assert est["hfu"] >= est["mfu"] and est["hfu_megatron"] >= est["mfu_megatron"]
    assert est["sources"]["compute"].startswith("roofline fallback") and est["sources"]["host"].startswith("not priced")
    plan = json.loads(_run(["plan", "--model", "tiny-moe", "--platform", "frontier", "--nodes", "1", "--seq", "256",
                            "--global-batch", "16", "--json"]).stdout)
    assert plan["flops_conventions"] == conventions
    assert plan["sources"]["compute"].startswith("calibration: ") and plan["sources"]["host"].startswith("not priced")


def test_a_plan_file_written_before_the_host_source_was_recorded_still_launches(tmp_path):
    """prediction.sources.host came with schema_version 2 unchanged: a file without it must still be read."""
    saved = tmp_path / "plan.json"
    assert _run(ARGS + ["-o", str(saved)]).exit_code == 0
    data = json.loads(saved.read_text())
    del data["prediction"]["sources"]["host"]
    data["prediction"].pop("flops_conventions", None)
    saved.write_text(json.dumps(data))
    res = CliRunner().invoke(cli, ["launch", "--plan", str(saved), "--out-dir", str(tmp_path / "job"), "--dry-run"])
    assert res.exit_code == 0, res.stderr


def test_the_header_and_json_name_every_degree_the_plan_sets():
    # cp, HSDP's replicas and the interleaved chunks per rank were priced but not shown (the header listed
    # dp tp pp ep only, and --json had no degrees at all)
    base = ["estimate", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "4", "--seq", "256",
            "--global-batch", "16"]
    hsdp = [*base[:2], "tiny-dense", *base[3:], "--dp", "2", "--cp", "2", "--tp", "2", "--zero", "3",
            "--dp-replicate", "2", "--no-sequence-parallel"]      # dense: MoE with tp > 1 needs sequence parallelism
    assert base[2] == "tiny-moe"
    def header(args):               # the first lines, before the memory table (the console may wrap them)
        return " ".join(_run(args).stdout.split("Memory per rank")[0].split())

    head = header(hsdp)
    assert "dp=2 cp=2 tp=2 pp=1 ep=1" in head and "zero=3 dp_replicate=2" in head
    assert "sequence_parallel=off" in head
    data = json.loads(_run(hsdp + ["--json"]).stdout)
    assert {k: data["parallel"][k] for k in ("dp", "cp", "tp", "zero", "dp_replicate")} == \
        {"dp": 2, "cp": 2, "tp": 2, "zero": 3, "dp_replicate": 2}
    interleaved = base + ["--dp", "4", "--pp", "2", "--ep", "2", "--schedule", "interleaved", "--virtual-stages", "2"]
    assert "interleaved v=2" in header(interleaved)


def test_time_to_train_names_its_token_budget():
    """The days to train come from TrainingSpec.tokens_to_train (1e12 by default), which the output now names."""
    res = CliRunner().invoke(cli, ["estimate", "--model", "mixtral-8x7b", "--platform", "dgx-h100", "--nodes", "1",
                                   "--dp", "8", "--ep", "8"])
    assert res.exit_code == 0 and "to train mixtral-8x7b on 1e+12 tokens (training.tokens_to_train; " in res.output


def test_a_step_that_is_mostly_host_time_says_so():
    """qwen3-30b-a3b with 16 local experts per rank on dgx-h100: 94% of the step is host time at the fitted
    284.8 us per GEMM call, which the output now flags (the same plan on dgx-a100, no host constant: no line)."""
    args = ["estimate", "--model", "qwen3-30b-a3b", "--nodes", "4", "--dp", "8", "--tp", "4", "--ep", "8",
            "--global-batch", "256"]
    h100 = CliRunner().invoke(cli, [*args, "--platform", "dgx-h100"])
    assert h100.exit_code == 0 and "warning: host time is 94% of this step, priced at 284.8 us per GEMM call" in h100.stderr
    a100 = CliRunner().invoke(cli, [*args, "--platform", "dgx-a100"])
    assert a100.exit_code == 0 and "host time is" not in a100.stderr


def test_utilisation_names_the_peak_it_divides_by():
    """An fp8 plan's MFU is of the fp8 peak (half the same TFLOPS read against bf16's): the output says which."""
    args = ["estimate", "--model", "qwen3-30b-a3b", "--platform", "dgx-h100", "--nodes", "2", "--dp", "16", "--ep", "8"]
    fp8, bf16 = (CliRunner().invoke(cli, [*args, "--dtype", d]) for d in ("fp8", "bf16"))
    assert "MFU and HFU against the fp8 peak, 1979 TFLOPS/device" in fp8.stdout
    assert "MFU and HFU against the bf16 peak, 989 TFLOPS/device" in bf16.stdout
    cpu = CliRunner().invoke(cli, ["estimate", "--model", "mixtral-8x7b", "--platform", "local-cpu", "--nodes", "1",
                                   "--dp", "2", "--ep", "2"])
    assert "MFU and HFU against the fp32 peak, 0.1111 TFLOPS/device" in cpu.stdout     # was "0 TFLOPS/device"


def test_capacity_factor_from_the_command_line():
    """--capacity-factor: token dropping without a model file. 2.0 pads every expert to twice its balanced share
    (slower than dropless at forced balance), 'none' is dropless again, the note says what the factor does, and
    a dense model or a value out of range is one line."""
    base = ["estimate", "--model", "mixtral-8x7b", "--platform", "dgx-h100", "--nodes", "8", "--dp", "64", "--ep", "8",
            "--zero", "1", "--json"]
    runner = CliRunner()
    dropless, padded, none = (runner.invoke(cli, base + extra) for extra in
                              ([], ["--capacity-factor", "2"], ["--capacity-factor", "none"]))
    assert all(r.exit_code == 0 for r in (dropless, padded, none)), padded.output
    step = {name: json.loads(r.stdout)["step_time_s"] for name, r in (("dropless", dropless), ("padded", padded),
                                                                       ("none", none))}
    assert step["padded"] > step["dropless"] == step["none"]
    assert "moe capacity factor 2: each expert computes 2 x its balanced share" in padded.stderr
    for extra, said in ((["--capacity-factor", "0"], "allowed: a number from 0.01 to 1000, or 'none'"),
                        (["--capacity-factor", "x"], "allowed: a number from 0.01 to 1000, or 'none'"),
                        (["--capacity-factor", "8"], "capacity_factor=8 is above num_experts / top_k = 4")):
        bad = runner.invoke(cli, base + extra)
        assert bad.exit_code == 2 and said in bad.stderr and bad.stderr.count("\n") == 1
    dense = runner.invoke(cli, ["estimate", "--model", "gpt-22b", "--platform", "dgx-h100", "--nodes", "8", "--dp",
                                "64", "--capacity-factor", "1"])
    assert dense.exit_code == 2 and "gpt-22b has no MoE layer to drop tokens in" in dense.stderr


def test_a_saved_plan_is_priced_again_from_the_file_alone(tmp_path):
    """`estimate --plan plan.json` prices a saved plan as it states itself (as launch and export do), with the same
    figures `plan -o` stored; a setting option beside it, or no --model / --platform / --nodes without it, is one
    line."""
    path = tmp_path / "plan.json"
    saved = CliRunner().invoke(cli, ["plan", "--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "8",
                                     "-o", str(path)])
    assert saved.exit_code == 0, saved.output
    stored = json.loads(path.read_text())["prediction"]
    again = CliRunner().invoke(cli, ["estimate", "--plan", str(path), "--json"])
    assert again.exit_code == 0 and again.stderr == "", again.output
    fresh = json.loads(again.stdout)
    assert fresh["step_time_s"] == stored["step_time_s"] and fresh["parallel"]["dp"] == 32
    assert fresh["memory"]["peak_bytes"] == stored["memory"]["peak_bytes"]
    human = CliRunner().invoke(cli, ["estimate", "--plan", str(path), "-o", str(tmp_path / "copy.json")])
    assert human.exit_code == 0 and f"step {stored['step_time_s']:.4g} s" in human.stdout, human.output
    assert json.loads((tmp_path / "copy.json").read_text())["prediction"]["step_time_s"] == stored["step_time_s"]
    assert "with a spread allocation: step" in human.stdout and "other_placement" in fresh
    assert json.loads((tmp_path / "copy.json").read_text())["prediction"]["other_placement"] is not None
    for args, needle in ((["--plan", str(path), "--dp", "4", "--model", "x"], "--model, --dp with --plan"),
                         (["--plan", ""], "--plan names no file"),
                         (["--plan", str(path), "--no-sequence-parallel"], "--sequence-parallel/--no-sequence-parallel"),
                         (["--nodes", "8", "--platform", "frontier"], "Missing option '--model'")):
        bad = CliRunner().invoke(cli, ["estimate", *args])
        assert bad.exit_code == 2 and needle in bad.stderr and bad.stderr.count("\n") == 1, bad.output


def test_a_gpu_step_that_waits_on_its_measured_host_says_so():
    """tiny-moe on one H200: the runtime's host overhead measured there (calibration/h200/overhead.csv) is most of
    the step (host/framework), which the output flags with what the figure rests on; Mixtral's step waits on the
    device, and says nothing."""
    tiny = CliRunner().invoke(cli, ["plan", "--model", "tiny-moe", "--platform", "h200", "--nodes", "1", "--runnable",
                                    "--global-batch", "64", "--top", "1"])
    assert tiny.exit_code == 0, tiny.output
    assert "warning: the top plan's step waits on its host for " in tiny.stderr and "`piper calibrate overhead`" \
        in tiny.stderr
    mixtral = CliRunner().invoke(cli, ["estimate", "--model", "mixtral-8x7b", "--platform", "h200", "--nodes", "2",
                                       "--dp", "8", "--pp", "2", "--ep", "8", "--zero", "2", "--piper-runtime"])
    assert mixtral.exit_code == 0, mixtral.output
    assert "waits on its host" not in mixtral.stderr and "host time: the runtime's overhead measured in " \
        "calibration/h200/overhead.csv" in mixtral.output


def test_estimate_says_whether_launch_and_run_take_the_plan():
    """`estimate` printed "fits" for plans `launch` and `run` then refused (cp 2, a capacity factor, ...); it now
    gives their verdict (launch/job.py check_runnable), in the JSON and as a line on stderr."""
    local = ["estimate", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1", "--seq", "128",
             "--global-batch", "8"]
    runnable = json.loads(_run(local + ["--dp", "2", "--ep", "2", "--json"]).stdout)
    assert runnable["runnable_by_piper"] is True and runnable["runtime_refusal"] is None
    with_cp = local + ["--dp", "1", "--cp", "2"]
    shown = _run(with_cp + ["--json"])
    refused = json.loads(shown.stdout)
    assert refused["runnable_by_piper"] is False and "parallel.cp=2" in refused["runtime_refusal"]
    table = _run(with_cp)
    assert table.exit_code == 0 and "`piper launch` / `piper run` refuse this plan: " in table.stdout


def test_a_published_runs_training_block_can_be_stated_on_the_command_line(tmp_path):
    """--master-bytes and --no-flash-attention (a dataset's training block): the command line prices Korthikanti et
    al.'s 22B full-recompute row as `piper validate` does (before: 1.21 s against the dataset's 1.38 s, flash
    attention assumed), and the plan file keeps both settings."""
    from piper_plan.validation import validate

    (result,) = validate(["korthikanti-a100"])
    row = next(r for r in result.rows if r.id == "22b-full-step")
    args = ["estimate", "--model", "gpt-22b", "--platform", "dgx-a100", "--nodes", "1", "--tp", "8", "--mbs", "4",
            "--global-batch", "4", "--seq", "2048", "--dtype", "fp16", "--grad-bytes", "4", "--recompute", "full",
            "--no-sequence-parallel", "--dropout", "--no-flash-attention", "--master-bytes", "4", "--json",
            "-o", str(tmp_path / "p.json")]
    done = CliRunner().invoke(cli, args)
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["step_time_s"] == pytest.approx(row.predicted, rel=1e-12)
    saved = json.loads((tmp_path / "p.json").read_text())["training"]
    assert saved["flash_attention"] is False and saved["master_bytes"] == 4
    two = CliRunner().invoke(cli, ["plan", "--model", "qwen3-30b-a3b", "--platform", "gb200-nvl72", "--nodes", "2",
                                   "--dtype", "bf16", "--master-bytes", "2", "-o", str(tmp_path / "q.json")])
    assert two.exit_code == 0, two.output
    assert json.loads((tmp_path / "q.json").read_text())["training"]["master_bytes"] == 2


def test_a_master_copy_of_fp32_weights_is_refused():
    """local-cpu trains in fp32 (4-byte weights, no master copy): --master-bytes 2 there was accepted and priced."""
    done = CliRunner().invoke(cli, ["estimate", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1",
                                    "--dp", "2", "--master-bytes", "2"])
    assert done.exit_code == 2 and done.stderr.count("\n") == 1, done.output
    assert "master_bytes=2 with 4-byte weights" in done.stderr and "allowed: master_bytes 0" in done.stderr
