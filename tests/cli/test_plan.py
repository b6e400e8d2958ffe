"""``piper plan`` through click (in-process): JSON contract, exit codes, sweep, CSV, --save, bad input."""

from __future__ import annotations

import csv
import io
import json

import pytest

from piper_plan.specs import even_split
from click.testing import CliRunner

from piper_plan.cli.main import cli
from piper_plan.search.report import RUNTIME_MEMORY
from piper_plan.catalog import project_root

ROOT = project_root()


def _run(*args):
    return CliRunner().invoke(cli, ["plan", *args])


def test_json_has_the_contract_fields():
    res = _run("--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "16", "--json", "--top", "5")
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    for key in ("candidates_enumerated", "feasible", "infeasible_reasons", "search_seconds", "plans"):
        assert key in obj
    assert obj["candidates_enumerated"] == obj["feasible"] + sum(obj["infeasible_reasons"].values())
    assert {type(p["sequence_parallel"]) for p in obj["plans"]} == {bool}     # a flag, as plan.json writes it (was 1)
    assert 0 < len(obj["plans"]) <= 5
    for p in obj["plans"]:
        for key in ("dp", "tp", "pp", "ep", "step_time_s", "tokens_per_s", "mfu", "tflops_per_device", "peak_memory_bytes"):
            assert key in p
        assert p["pp"] * p["dp"] * p["tp"] == 128
    tps = [p["tokens_per_s"] for p in obj["plans"]]
    assert tps == sorted(tps, reverse=True)


def test_piper_strategy_json_at_1024_gcds():
    res = _run("--model", "piper-weak-1.7t", "--platform", "frontier", "--nodes", "128", "--strategy", "piper", "--json",
               "--top", "0")
    assert res.exit_code == 0, res.output
    plans = json.loads(res.stdout)["plans"]
    assert plans and {(p["pp"], p["ep"], p["tp"]) for p in plans} == {(32, 32, 1)}


def test_nothing_fits_exit_3_with_closest_and_nodes_needed():
    res = _run("--model", "deepseek-v3", "--platform", "frontier", "--nodes", "1", "--json")
    assert res.exit_code == 3, res.output
    obj = json.loads(res.stdout)
    assert obj["feasible"] == 0 and obj["plans"] == []
    assert len(obj["closest"]) == 5 and all(c["overflow_bytes"] > 0 for c in obj["closest"])
    assert obj["nodes_needed"] is not None and obj["nodes_needed"] > 1
    check = _run("--model", "deepseek-v3", "--platform", "frontier", "--nodes", str(obj["nodes_needed"]), "--json")
    assert check.exit_code == 0


def test_a_space_with_no_valid_candidate_is_nothing_fits_not_a_crash():
    """Every candidate rejected (cp=2 cuts a 6-token sequence into 4 chunks; cp=3 would split it but does not divide
    the world of 2): exit 3, the reasons, no closest; a --cp of which no degree divides the world, or none splits
    the sequence, is one error line (as in `estimate`)."""
    args = ("--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1", "--seq", "6")
    res = _run(*args, "--cp", "2,3", "--json")
    assert res.exit_code == 3, res.output
    obj = json.loads(res.stdout)
    assert obj["feasible"] == 0 and obj["closest"] == [] and set(obj["infeasible_reasons"]) == {"cp_not_divisor_seq"}
    table = _run(*args, "--cp", "2,3")
    assert table.exit_code == 3 and "no candidate is a valid plan" in table.stdout
    for cp, needle in (("3", "--cp: 3: no context-parallel degree divides the world of 2"),
                       ("2", "--cp: 2: no context-parallel degree splits the sequence of 6 tokens into 2 x cp")):
        bad = _run(*args, "--cp", cp)
        assert bad.exit_code == 2 and needle in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr


def test_sweep_json_has_efficiency_per_node_count():
    res = _run("--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "4..16", "--json")
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["sweep"]
    assert [r["nodes"] for r in rows] == [4, 8, 16]
    first = next(r for r in rows if r["best"])
    assert first["efficiency"] == pytest.approx(1.0)


def test_a_sweep_where_nothing_fits_at_any_count_exits_3():
    """As one count where nothing fits does (before: 0, every row saying "nothing fits")."""
    for extra in ((), ("--json",)):
        res = _run("--model", "deepseek-v3", "--platform", "h200", "--nodes", "1..2", *extra)
        assert res.exit_code == 3 and ("nothing fits" in res.stdout or '"feasible": 0' in res.stdout), res.output


def test_min_nodes_json():
    res = _run("--model", "mixtral-8x22b", "--platform", "frontier", "--min-nodes", "--json")
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    assert obj["feasible"] > 0
    below = _run("--model", "mixtral-8x22b", "--platform", "frontier", "--nodes", str(obj["nodes"] - 1), "--json")
    assert obj["nodes"] == 1 or below.exit_code == 3


def test_csv_rows_are_ranked_plans():
    res = _run("--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "8", "--csv", "--top", "3")
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    assert len(rows) == 3 and float(rows[0]["tokens_per_s"]) >= float(rows[2]["tokens_per_s"])


def test_runnable_and_explain_json():
    res = _run("--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "8", "--runnable", "--expert-tp",
               "--explain", "--json")
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    from piper_plan.capability import RUNTIME_CAPABILITY

    assert all(p["schedule"] in RUNTIME_CAPABILITY["schedule"] and p["etp"] == 1 for p in obj["plans"])
    assert obj["infeasible_reasons"]["not_runnable"] > 0
    ex = obj["explain"]
    assert ex["winner"]["tokens_per_s"] >= ex["runner_up"]["tokens_per_s"]
    assert ex["breakdown"]


def test_each_ranked_plan_says_whether_piper_runs_it_and_launch_agrees(tmp_path):
    """Context parallelism is an axis the runtime does not run: with --cp 2 every ranked plan is marked (JSON,
    table) and `launch` refuses the saved one naming it, and its memory misfit. DeepSeek-V3 with its MTP module (the runtime builds it)
    is runnable where it fits as the runtime runs it: the plans ranked with Megatron's fused kernels do not (marked,
    and `launch` refuses the saved one); `launch` writes the job of the one `--runnable` ranked."""
    args = ("--model", "deepseek-v3", "--platform", "dgx-h100", "--nodes", "32", "--top", "3")
    with_cp = json.loads(_run(*args, "--cp", "2", "--json").stdout)["plans"]
    assert all(not p["runnable_by_piper"] and any("parallel.cp=2" in m for m in p["runtime_missing"])
               for p in with_cp)
    table = _run(*args, "--cp", "2")
    assert "1*" in table.stdout and "piper's runtime cannot run it" in table.stdout
    saved = tmp_path / "plan.json"
    assert _run(*args, "--cp", "2", "-o", str(saved)).exit_code == 0
    refused = CliRunner().invoke(cli, ["launch", "--plan", str(saved), "--out-dir", str(tmp_path / "job"), "--dry-run"])
    assert refused.exit_code == 2 and "parallel.cp=2" in refused.stderr and refused.stderr.count("\n") == 1
    assert RUNTIME_MEMORY in with_cp[0]["runtime_missing"]      # both reasons in launch's one line, as in the plan's
    assert "priced as piper's runtime runs it" in refused.stderr     # (before: the missing feature only)
    with_mtp = json.loads(_run(*args, "--runnable", "--json").stdout)["plans"]
    assert all(p["runnable_by_piper"] and p["runtime_missing"] == [] for p in with_mtp)
    fused_rows = json.loads(_run(*args, "--json").stdout)["plans"]   # ranked with Megatron's fused kernels
    assert all(not p["runnable_by_piper"] and p["runtime_missing"] == [RUNTIME_MEMORY]
               and p["peak_memory_bytes_piper_runtime"] > p["peak_memory_bytes"] for p in fused_rows)
    fused = tmp_path / "fused.json"
    assert _run(*args, "-o", str(fused)).exit_code == 0
    refused = CliRunner().invoke(cli, ["launch", "--plan", str(fused), "--out-dir", str(tmp_path / "job2"), "--dry-run"])
    assert refused.exit_code == 2 and "priced as piper's runtime runs it" in refused.stderr
    mtp_plan = tmp_path / "mtp.json"
    assert _run(*args, "--runnable", "-o", str(mtp_plan)).exit_code == 0
    launched = CliRunner().invoke(cli, ["launch", "--plan", str(mtp_plan), "--out-dir", str(tmp_path / "mtp_job"),
                                        "--dry-run"])
    assert launched.exit_code == 0, launched.stderr


def test_human_result_goes_to_stdout_and_saved_to_stderr(tmp_path):
    res = CliRunner().invoke(cli, ["plan", "--model", "tiny-moe", "--platform", "frontier", "--nodes", "1",
                                   "--seq", "512", "--global-batch", "64", "--explain",
                                   "--save", str(tmp_path / "plan.json")])
    assert res.exit_code == 0, res.output
    assert "top plans" in res.stdout and "winner vs runner-up" in res.stdout and "saved" not in res.stdout
    assert res.stderr.startswith("saved ") and res.stderr.count("\n") == 1


@pytest.mark.parametrize("args,needle", [
    (["--model", "mixtrl-8x7b", "--nodes", "4"], "mixtral-8x7b"),
    (["--model", "mixtral-8x7b", "--nodes", "0"], "nodes=0"),
    (["--model", "mixtral-8x7b", "--nodes", "4", "--seq", "65536"], "max_seq_len"),
    (["--model", "tiny-moe", "--nodes", "8", "--seq", "256", "--global-batch", "4"], "global_batch=4"),
    (["--model", "mixtral-8x7b", "--nodes", "4", "--memory-headroom", "1.5"], "headroom"),
    (["--model", "mixtral-8x7b"], "--nodes"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    res = _run("--platform", "frontier", *args)
    assert res.exit_code == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0]


def test_save_writes_a_plan_file(tmp_path):
    from piper_plan.planfile import read_plan_file

    out = tmp_path / "plan.json"
    res = _run("--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "8", "--runnable", "--migration",
               "--save", str(out), "--json", "--top", "1")
    assert res.exit_code == 0, res.output
    best = json.loads(res.stdout)["plans"][0]
    pf = read_plan_file(out)
    assert pf.nodes == 8
    assert (pf.parallel.dp, pf.parallel.pp, pf.parallel.ep, pf.parallel.tp) == (best["dp"], best["pp"], best["ep"], best["tp"])
    assert pf.migration["enabled"] if isinstance(pf.migration, dict) else pf.migration.enabled
    assert pf.prediction.tokens_per_s == pytest.approx(best["tokens_per_s"], rel=1e-6)


@pytest.mark.parametrize("platform, nodes", [("frontier", 128), ("h200", 32)])
def test_saved_plan_prediction_equals_its_ranking_row(tmp_path, platform, nodes):
    """The search prices each candidate with the layer split it saves (DeepSeek-V3: 3 dense layers + LM head
    make the FLOP-balanced split win), so the saved prediction is the ranked row, not a re-estimate of another
    split; on h200 through its measured GEMM sweep, whose rates must not depend on the other plans of the batch."""
    from piper_plan.planfile import read_plan_file

    out = tmp_path / "plan.json"
    res = _run("--model", "deepseek-v3", "--platform", platform, "--nodes", str(nodes), "--seq", "4096",
               "--save", str(out), "--json", "--top", "1")
    assert res.exit_code == 0, res.output
    best = json.loads(res.stdout)["plans"][0]
    pf = read_plan_file(out)
    assert pf.prediction.step_time_s == pytest.approx(best["step_time_s"], rel=1e-12)
    assert pf.prediction.memory.peak_bytes == pytest.approx(best["peak_memory_bytes"], abs=1.0)
    assert pf.parallel.layers_split == "explicit" and pf.parallel.layers_per_stage == pf.prediction.layers_per_stage
    assert (pf.parallel.layers_per_stage != even_split(61, pf.parallel.pp)) == (best["layers_split"] == "balanced")
    if pf.parallel.layers_per_stage is not None:
        assert sum(pf.parallel.layers_per_stage) == 61


# ---- precision as a searched axis (--dtype LIST|any) ------------------------------------------------------
QWEN_H100 = ("--model", "qwen3-30b-a3b", "--platform", "dgx-h100", "--nodes", "2")


def test_precisions_are_one_ranking_each_plan_with_its_dtype():
    both = json.loads(_run(*QWEN_H100, "--dtype", "bf16,fp8", "--json", "--top", "0").stdout)
    alone = {d: json.loads(_run(*QWEN_H100, "--dtype", d, "--json", "--top", "0").stdout) for d in ("bf16", "fp8")}
    assert [p["dtype"] for p in both["precisions"]] == ["bf16", "fp8"]
    assert both["feasible"] == len(both["plans"]) == sum(a["feasible"] for a in alone.values())
    assert both["candidates_enumerated"] == sum(a["candidates_enumerated"] for a in alone.values())
    tps = [p["tokens_per_s"] for p in both["plans"]]
    assert tps == sorted(tps, reverse=True) and [p["rank"] for p in both["plans"]] == list(range(1, len(tps) + 1))
    for d, a in alone.items():  # each precision's own ranking, in its own order, inside the merged one
        assert [p["tokens_per_s"] for p in both["plans"] if p["dtype"] == d] == [p["tokens_per_s"] for p in a["plans"]]
    winner = max(alone, key=lambda d: alone[d]["plans"][0]["tokens_per_s"])
    assert both["dtype"] == both["plans"][0]["dtype"] == winner
    assert all(p["runtime_missing"] for p in both["plans"] if p["dtype"] == "fp8")  # the runtime has no 8-bit GEMMs


def test_any_is_the_default_and_the_platforms_8_bit_recipes(tmp_path):
    res = _run(*QWEN_H100, "--dtype", "any", "--runnable", "--top", "3", "-o", str(tmp_path / "plan.json"))
    assert res.exit_code == 0, res.output
    assert "bf16: " in res.stdout and "fp8 (delayed): " in res.stdout and "mxfp8" not in res.stdout  # no mxfp8 peak
    assert json.loads((tmp_path / "plan.json").read_text())["training"]["dtype"] == "bf16"  # runnable: bf16 wins
    frontier = _run("--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "8", "--dtype", "any", "--json")
    assert frontier.exit_code == 0 and "has no peak for fp8 or mxfp8" in frontier.stderr
    assert "precisions" not in json.loads(frontier.stdout)  # one precision: the plain document


def test_precisions_priced_from_different_kinds_of_rates_are_said_to_be():
    """h200's calibration measures bf16 GEMMs and no fp16 ones: fp16 was priced from the roofline's 0.8 and ranked
    ahead of bf16 without a word (the footnote named each source; the ranking did not say it mixed them)."""
    mixed = _run("--model", "mixtral-8x7b", "--platform", "h200", "--nodes", "4", "--dtype", "bf16,fp16", "--top", "2")
    assert mixed.exit_code == 0, mixed.output
    warnings = [line for line in mixed.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: bf16 GEMMs are priced from h200's measured rows and fp16 from the roofline fallback: "
                        "ranked together, a measurement meets a peak rate (piper calibrate measures no fp16 GEMM on a "
                        "cuda device: rank one precision at a time, or price a plan of each from the roofline alone "
                        "with `piper estimate ... --no-calibration`)"]
    same = _run(*QWEN_H100, "--dtype", "bf16,fp8", "--top", "1")        # no calibration: one kind of rate
    assert same.exit_code == 0 and "warning" not in same.stderr
    from types import SimpleNamespace

    from piper_plan.catalog import load_platform
    from piper_plan.cli.plan import mixed_rate_sources

    searches = [(SimpleNamespace(dtype=d), SimpleNamespace(sources={"compute": c})) for d, c in
                (("bf16", "calibration: gemm.csv"), ("fp8", "calibration: ...; GEMMs in fp8: roofline fallback"))]
    assert mixed_rate_sources(searches, load_platform("h200")).endswith(
        "(measure them: `piper calibrate --platform h200 --only gemm --dtype fp8`)")     # the GPU sweep has fp8


@pytest.mark.parametrize("args, needle", [
    (("--dtype", "bf16,fp9"), "--dtype: 'fp9'; allowed: bf16, fp16, fp32, fp8, mxfp8"),
    (("--dtype", "bf16,fp8", "--explain"), "several precisions are searched at one node count"),
    (("--dtype", "any", "--min-nodes"), "several precisions"),
    (("--dtype", "bf16", "--fp8-recipe", "blockwise"), "--fp8-recipe: blockwise: no fp8 precision is searched (bf16)"),
    (("--dtype", "fp8", "--fp8-recipe", "rowwise"), "Invalid value for '--fp8-recipe'"),
])
def test_precision_search_bad_input_is_one_line(args, needle):
    res = _run(*QWEN_H100, *args)
    assert res.exit_code == 2 and needle in res.stderr and res.stderr.count("\n") == 1, res.stderr


def test_a_precision_the_platform_has_no_rate_for_is_named_before_what_follows_from_it():
    """Before: `--dtype mxfp8 --grad-bytes 2` on a CPU platform said 'grad_bytes=2 is narrower than the weights'
    weight_bytes=4 (dtype mxfp8)', a check of a precision the platform cannot run at all."""
    res = _run("--model", "deepseek-v3", "--platform", "netemu", "--nodes", "1", "--dtype", "mxfp8", "--grad-bytes",
               "2", "--global-batch", "8", "--seq", "64")
    assert res.exit_code == 2 and res.stderr.startswith("error: --dtype: platform netemu has no peak for "
                                                        "dtype=mxfp8") and res.stderr.count("\n") == 1, res.stderr


def test_the_fp8_recipe_prices_the_fp8_plans_only_and_is_saved_with_them(tmp_path):
    args = (*QWEN_H100, "--dtype", "bf16,fp8", "--json", "--top", "0")
    docs = {r: json.loads(_run(*args, "--fp8-recipe", r).stdout) for r in ("delayed", "blockwise")}
    assert [(p["dtype"], p["fp8_recipe"]) for p in docs["blockwise"]["precisions"]] == [("bf16", None),
                                                                                       ("fp8", "blockwise")]
    plans = {r: docs[r]["plans"] for r in docs}
    assert {(p["dtype"], p["fp8_recipe"]) for p in plans["blockwise"]} == {("bf16", None), ("fp8", "blockwise")}
    for dtype in ("bf16", "fp8"):
        tps = [[p["tokens_per_s"] for p in plans[r] if p["dtype"] == dtype] for r in ("delayed", "blockwise")]
        assert tps[0] == tps[1] if dtype == "bf16" else max(tps[1]) < max(tps[0])   # blockwise: slower fp8 GEMMs
    res = _run(*QWEN_H100, "--dtype", "fp8", "--fp8-recipe", "tensorwise", "-o", str(tmp_path / "plan.json"))
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "plan.json").read_text())["training"]["fp8_recipe"] == "tensorwise"
    res = CliRunner().invoke(cli, ["estimate", *QWEN_H100, "--dp", "16", "--ep", "8", "--dtype", "fp8",
                                   "--fp8-recipe", "tensorwise"])
    assert res.exit_code == 0 and ", fp8 (tensorwise): dp=16 " in res.stdout.splitlines()[0], res.stdout[:300]
    res = CliRunner().invoke(cli, ["estimate", *QWEN_H100, "--dp", "16", "--ep", "8", "--dtype", "fp8",
                                   "--fp8-recipe", "tensorwise", "--json"])
    assert (json.loads(res.stdout)["dtype"], json.loads(res.stdout)["fp8_recipe"]) == ("fp8", "tensorwise")
    res = CliRunner().invoke(cli, ["estimate", *QWEN_H100, "--dp", "16", "--ep", "8", "--fp8-recipe", "tensorwise"])
    assert res.exit_code == 2 and res.stderr == ("error: --fp8-recipe: tensorwise: an fp8 recipe needs --dtype fp8 "
                                                 "(given: the device default; mxfp8 is a block recipe of its own)\n")


def test_estimate_takes_one_precision():
    res = CliRunner().invoke(cli, ["estimate", *QWEN_H100, "--dp", "16", "--ep", "8", "--dtype", "any"])
    assert res.exit_code == 2 and "a list or 'any' only for piper plan" in res.stderr, res.stderr


def test_runnable_plans_that_fit_but_need_what_the_runtime_lacks_say_so_not_memory(tmp_path):
    """Every candidate fits but is rejected as not runnable: the runtime's missing feature is named (before: the
    closest candidates "over by 0.0 GiB" and "no node count makes it fit"); launch names it too."""
    res = _run("--model", "tiny-moe", "--platform", "local-cpu", "--seq", "128", "--global-batch", "8", "--nodes", "1",
               "--runnable", "--cp", "2")
    assert res.exit_code == 3
    text = " ".join(res.stdout.split())             # the console wraps at its width, which the test runner sets
    assert "candidates fit in memory, but piper's runtime cannot run them (--runnable): it lacks parallel.cp=2" \
        in text and "makes it fit" not in text
    info = json.loads(_run("--model", "tiny-moe", "--platform", "local-cpu", "--seq", "128", "--global-batch", "8",
                           "--nodes", "1", "--runnable", "--cp", "2", "--json").stdout)
    assert info["fit_but_not_runnable"] > 0 and any("cp" in k for k in info["runtime_missing"])
    model = tmp_path / "cap.yaml"
    model.write_text((ROOT / "models" / "tiny-moe.yaml").read_text().replace("top_k: 2", "top_k: 2\n  capacity_factor: 1.0"))
    launch = CliRunner().invoke(cli, ["launch", "--model", str(model), "--platform", "local-cpu", "--seq", "128",
                                      "--global-batch", "8", "--nodes", "1", "--out-dir", str(tmp_path / "job"),
                                      "--dry-run"])
    assert launch.exit_code == 2 and launch.stderr.count("\n") == 1
    assert "needs what piper's runtime lacks: moe.capacity_factor=1.0" in launch.stderr


def test_csv_and_explain_need_one_node_count_and_csv_stays_csv_when_nothing_fits():
    """Before: --csv / --explain with a node range were silently ignored (a rich table on stdout), and nothing-fits
    printed tables under --csv."""
    for flag in ("--csv", "--explain"):
        res = _run("--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1..4", flag)
        assert res.exit_code == 2 and f"{flag}: {flag} needs one node count" in res.stderr
    res = _run("--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1", "--seq", "6", "--cp", "2,3", "--csv")
    assert res.exit_code == 3 and res.stdout == "" and res.stderr.startswith("nothing fits: tiny-moe")


def test_min_nodes_passes_counts_whose_whole_space_is_refused():
    # 47 x 8 devices admit no dp dividing a global batch of 1024; the bisection raised that count's refusal (exit 2)
    # where 48 fits, and the nothing-fits report swallowed it as "no node count up to 2048 makes it fit". From 33,
    # doubling (66, 132, ...) found only 2048; the powers of two above it find 64, then 48
    args = ("--model", "piper-weak-1.7t", "--platform", "dgx-h100", "--json")
    smallest = json.loads(_run(*args, "--min-nodes", "--top", "1").stdout)
    assert smallest["nodes"] == 48 and smallest["plans"]
    assert json.loads(_run(*args, "--nodes", "47").stdout or "{}") == {}            # 47 itself: refused, exit 2
    assert not json.loads(_run(*args, "--nodes", "40").stdout)["plans"]            # nothing fits below 48
    assert json.loads(_run(*args, "--nodes", "32").stdout)["nodes_needed"] == 48
    cp = json.loads(_run("--model", "tiny-moe", "--platform", "netemu", "--cp", "4", "--min-nodes", "--json").stdout)
    assert cp["nodes"] == 2                                   # 1 node's 2 devices: no cp of 4; 2 nodes: 4 devices
    refused = _run("--model", "tiny-moe", "--platform", "local-cpu", "--cp", "5", "--seq", "100", "--min-nodes")
    assert refused.exit_code == 2 and "--cp: 5" in refused.stderr           # no count admits it: the input's fault
    # a cp of 3 divides no power-of-two world: the counts from 3 (its multiples) are tried, and 6 nodes fit
    three = _run("--model", "mixtral-8x22b", "--platform", "dgx-h100", "--cp", "3", "--seq", "12288",
                 "--global-batch", "1536", "--min-nodes", "--top", "1", "--json")
    assert json.loads(three.stdout)["nodes"] == 6, three.output


def test_probe_counts_take_the_starts_multiples_and_the_powers_of_two():
    from piper_plan.search.engine import probe_counts

    assert probe_counts(1, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert probe_counts(33, 300) == [33, 64, 66, 128, 132, 256, 264, 300]
    assert probe_counts(5, 5) == [5] and probe_counts(6, 5) == []


def test_a_cp_degree_no_plan_can_have_is_named_beside_the_others():
    """--cp 1,3 on 1,024 devices: 3 divides no world of that size; it is named on stderr, the rest searched
    (before: dropped without a word; --cp 3 alone is an error)."""
    res = _run("--model", "deepseek-v3", "--platform", "dgx-h100", "--nodes", "128", "--cp", "1,3", "--top", "1")
    assert res.exit_code == 0
    assert "--cp: cp 3 does not divide the world of 1024 devices: not searched" in res.stderr


def test_a_sweep_says_what_one_search_says():
    """A node sweep: cost-model evaluations beside the enumerated candidates, and each count's best plan marked
    runnable or not with what the runtime lacks (JSON), cp, HFU and the mark in the table (before: none of them)."""
    args = ("--model", "deepseek-v3", "--platform", "dgx-h100", "--nodes", "64..128", "--cp", "2", "--seq", "16384",
            "--global-batch", "256")
    obj = json.loads(_run(*args, "--json").stdout)
    assert 0 < obj["cost_model_evaluations"] < obj["candidates_enumerated"]
    bests = [row["best"] for row in obj["sweep"]]
    assert bests and all(not b["runnable_by_piper"] and any("parallel.cp=2" in m for m in b["runtime_missing"])
                         for b in bests)
    table = _run(*args).stdout
    assert all(h in table for h in ("cp", "HFU")) and "64*" in table and "piper's runtime cannot run it" in table


def test_options_that_change_the_training_mark_every_plan_and_the_table_names_hfu():
    """--dropout: the runtime trains without dropout, so no ranked plan is runnable by it (before: marked
    runnable, which launch then ran without dropout); the table's MFU and HFU say their convention."""
    args = ("--model", "tiny-moe", "--platform", "frontier", "--nodes", "1", "--top", "3")
    plans = json.loads(_run(*args, "--dropout", "--json").stdout)["plans"]
    assert plans and all(not p["runnable_by_piper"] and "options.dropout=true" in p["runtime_missing"][0]
                         for p in plans)
    assert all(p["runnable_by_piper"] for p in json.loads(_run(*args, "--json").stdout)["plans"])
    table = _run(*args).stdout
    assert "HFU" in table and "PaLM's FLOP count" in table


def test_virtual_stages_names_the_chunk_counts_the_search_tries():
    args = ("--model", "gpt-530b", "--platform", "dgx-a100", "--nodes", "35", "--seq", "2048", "--global-batch", "280",
            "--dtype", "fp16", "--top", "0", "--json")
    tried = {p["virtual_stages"] for p in json.loads(_run(*args).stdout)["plans"] if p["schedule"] == "interleaved"}
    assert tried == {3}                         # 2 and 4 chunks cannot lay out 3 layers per stage
    only = _run(*args, "--virtual-stages", "2,4")
    assert only.exit_code == 0 and "interleaved" not in {p["schedule"] for p in json.loads(only.stdout)["plans"]}
    for value in ("1,3", "x", "0"):
        needle = "allowed: comma-separated whole numbers >= 2, e.g. 2,4,8"
        bad = _run(*args, "--virtual-stages", value)
        assert bad.exit_code == 2 and "--virtual-stages: " in bad.stderr and needle in bad.stderr, bad.stderr
