"""`piper validate`: the published datasets stay within their tolerances, and the checks can fail.

Tier 1 (published numbers with a citation and a tolerance): the citations and tolerances live in
validation/*.yaml; this test runs the real command, so the suite fails when the model drifts.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from piper_plan.cli.main import cli
from piper_plan.errors import PiperError
from piper_plan.validation import DatasetSpec, dataset_names, load_dataset, validate, validate_dataset, validation_dir

# Rows the cost model is known to miss, each gated on its own: every other row and every dataset mean stay gated.
# X-MoE Small: the paper's 90.44 TFLOPS is above every feasible plan's prediction (51.4 at best; the seed expert GEMM
# and attention rates at its shape, docs/paper-search.md). strict: the day the model gets within tolerance, the
# xfail turns into a failure that says "remove me".
KNOWN_OUT_OF_TOLERANCE = {("piper-frontier-moe", "xmoe-small"):
                          "X-MoE Small: the paper's TFLOPS exceed every feasible plan under the seed kernel rates"}


def _validate_json(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(cli, ["validate", "--json", *args])
    return result.exit_code, json.loads(result.stdout)


@functools.lru_cache(maxsize=None)
def _catalog_dataset_json(dataset: str) -> dict:
    """`piper validate --json --dataset NAME` of a catalog dataset, run once per test process (the files do not
    change while the tests run)."""
    return _validate_json("--dataset", dataset)[1]


def _row_json(dataset: str, row_id: str) -> dict:
    (ds,) = _catalog_dataset_json(dataset)["datasets"]
    (row,) = [r for r in ds["rows"] if r["id"] == row_id]
    return row


@pytest.mark.parametrize("name", dataset_names())
def test_dataset_within_tolerance(name):
    """Every gated row within its tolerance (the known misses below excepted) and the dataset's mean within its own."""
    code, out = _validate_json("--dataset", name)
    (ds,) = out["datasets"]
    known = {row_id for (dataset, row_id) in KNOWN_OUT_OF_TOLERANCE if dataset == name}
    assert all(row["predicted"] is not None for row in ds["rows"]), "every row is priced, gated or not"
    gate_mean = ds["held_out_mean_abs_pct_error"] if ds["held_out_mean_abs_pct_error"] is not None \
        else ds["mean_abs_pct_error"]                 # the held-out rows carry the gate (a fit row cannot test its fit)
    if gate_mean is not None:                         # None: no gated row (a dataset reported, not yet gated)
        assert gate_mean <= ds["tolerance_pct"]["mean"]
    for row in ds["rows"]:
        if row["gated"] and row["id"] not in known:
            assert row["abs_pct_error"] <= row["tolerance_pct"], row["id"]
    assert code == (1 if known else 0)


# Rows reported and not gated, each with the cause its dataset's notes give: strict, so the day one gets within its
# tolerance the xfail fails and says "gate me".
UNGATED = {("megatron-bridge-moe", "25.09-qwen3-30b-h100-drop"):
           "token-drop H100 row 2x its dropless twin, which NVIDIA tracks as a dropless regression (Megatron-Bridge "
           "issue 1998) without a cause: 25.09's figure disagrees with 25.11 and 26.02 (dataset notes)",
           ("megatron-bridge-moe", "25.11-gpt-oss-120b-gb200"):
           "GPT-OSS: about 28 us per token per GPU missing on GB200 and B200, EP 8 and 64 alike; cause not found"}


@pytest.mark.parametrize("dataset,row_id", sorted(UNGATED))
def test_ungated_row(dataset, row_id, request):
    row = _row_json(dataset, row_id)              # outside the xfail: a row gated since, or gone, fails here
    assert not row["gated"], "gated now: remove it from UNGATED"
    request.applymarker(pytest.mark.xfail(strict=True, reason=UNGATED[(dataset, row_id)]))
    assert row["abs_pct_error"] <= row["tolerance_pct"]


def test_every_ungated_row_is_listed():
    """A row leaves the gate only with a stated cause (UNGATED above), and UNGATED lists only ungated rows."""
    ungated = {(name, row.id) for name in dataset_names() for row in load_dataset(name).rows if not row.gated}
    assert ungated == set(UNGATED), f"not gated, not listed: {ungated - set(UNGATED)}; listed, not ungated: " \
                                    f"{set(UNGATED) - ungated}"


@pytest.mark.parametrize("dataset,row_id", sorted(KNOWN_OUT_OF_TOLERANCE))
def test_known_out_of_tolerance_row(dataset, row_id, request):
    row = _row_json(dataset, row_id)              # outside the xfail: a row gone fails here
    request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN_OUT_OF_TOLERANCE[(dataset, row_id)]))
    assert row["abs_pct_error"] <= row["tolerance_pct"]


def test_a100_step_time_rows_against_calculon_bar():
    """Korthikanti et al. 2022 Table 3 step times: every row within 10%; mean within 5% (the goal; Calculon
    reaches 3.65% mean / 8.87% max on the same 8 rows)."""
    (ds,) = validate(["korthikanti-a100"])
    steps = [r for r in ds.rows if r.quantity == "step_time_s"]
    assert len(steps) == 8
    errors = [r.abs_pct_error for r in steps]
    assert max(errors) <= 10.0
    assert sum(errors) / len(errors) <= 5.0


def test_table4_switch_base_uses_row_facts_not_catalog():
    """Table IV's Switch-Base: 48 x 128 x 768 x 2048 / 8 B = 1.208e9 B = 1.21 GB (catalog d_ffn 3072 would be 1.81)."""
    (ds,) = validate(["piper-migration-table4"])
    row = next(r for r in ds.rows if r.id == "switch-base")
    assert row.predicted == pytest.approx(48 * 128 * 768 * 2048 / 8 / 1e9)


def test_violation_exits_nonzero(tmp_path):
    """A dataset whose published number is off by 2x must fail the command (exit 1) and name the row."""
    spec = load_dataset("piper-migration-table4")
    data = spec.model_dump()
    data["rows"] = [data["rows"][1]]
    data["rows"][0]["published"] *= 2
    path = tmp_path / "broken.yaml"
    path.write_text(json.dumps(data))
    code, out = _validate_json("--dataset", str(path))
    assert code == 1
    assert out["ok"] is False
    (ds,) = out["datasets"]
    assert ds["rows"][0]["rel_error"] == pytest.approx(-0.5, abs=0.01)
    assert any("mixtral-8x7b" in v for v in ds["violations"])


def test_ungated_row_reported_not_failing():
    spec = load_dataset("piper-migration-table4")
    data = spec.model_dump()
    data["rows"] = [dict(data["rows"][0], published=5.0, gated=False)]
    result = validate_dataset(DatasetSpec.model_validate(data))
    assert result.rows[0].abs_pct_error > 50
    assert result.violations() == []
    assert result.mean_abs_pct_error is None        # ungated rows are not in the gated mean


def test_fit_split_labelled(tmp_path):
    data = load_dataset("piper-migration-table4").model_dump()
    data["used_for_fitting"] = True
    data["rows"] = data["rows"][:2]
    data["rows"][1]["split"] = "held_out"
    result = validate_dataset(DatasetSpec.model_validate(data))
    assert [r.split for r in result.rows] == ["fit", "held_out"]
    assert result.held_out_mean_abs_pct_error == pytest.approx(result.rows[1].abs_pct_error)


def test_the_mean_gate_holds_the_held_out_rows_not_the_fit_ones():
    """A fit row at 0% must not pull a dataset's gated mean under its tolerance (issue 17: the gate is on the
    held-out rows)."""
    data = load_dataset("piper-migration-table4").model_dump()
    data["tolerance_pct"]["mean"] = 30.0
    fit, held_out = dict(data["rows"][0], split="fit"), dict(data["rows"][1], split="held_out")
    held_out["published"] *= 1.5                      # predicted 1/1.5 of it: |error| 33%
    data["rows"] = [fit, dict(fit, id="fit-2"), dict(fit, id="fit-3"), held_out]
    result = validate_dataset(DatasetSpec.model_validate(data))
    assert result.mean_abs_pct_error < 30 < result.held_out_mean_abs_pct_error
    assert any("held-out mean" in v for v in result.violations())


def test_unknown_dataset_is_user_error():
    with pytest.raises(PiperError, match="unknown dataset"):
        load_dataset("no-such-dataset")
    result = CliRunner().invoke(cli, ["validate", "--dataset", "no-such-dataset"])
    assert result.exit_code == 2


def test_markdown_report_holds_every_row(tmp_path):
    from click.testing import CliRunner

    from piper_plan.cli.main import cli

    out = tmp_path / "validation.md"
    res = CliRunner().invoke(cli, ["validate", "--dataset", "piper-migration-table4", "--markdown", str(out)])
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert text.count("| deepseek-v3 |") == 1 and text.count("| deepseek-v3-time |") == 1
    assert text.rstrip().endswith("none")


def test_a_dataset_not_yet_gated_reports_where_its_held_out_rows_stand():
    data = load_dataset("piper-migration-table4").model_dump()
    data["rows"] = [dict(data["rows"][0], gated=False), dict(data["rows"][1], gated=False, split="fit")]
    data["rows"][0]["published"] *= 2                # predicted half of it: |error| 50%
    result = validate_dataset(DatasetSpec.model_validate(data))
    summary = result.ungated_summary()
    assert summary.startswith("not gated: 1 held-out rows, mean |error| 50.") and "0 within" in summary, summary
    data["rows"].append(dict(data["rows"][1], id="held-out-and-gated", split="held_out", gated=True))
    summary = validate_dataset(DatasetSpec.model_validate(data)).ungated_summary()     # the gate's view beside it
    assert "; all 2 held-out rows, gated or not: mean |error| 25." in summary, summary


def test_a_dataset_that_requires_fit_says_which_rows_are_predicted_not_to():
    data = load_dataset("megatron-bridge-moe").model_dump()
    rows = [dict(r, gated=False) for r in data["rows"] if r["id"] in ("25.11-dsv3-gb200-mxfp8", "25.11-qwen3-30b-gb200")]
    result = validate_dataset(DatasetSpec.model_validate(dict(data, rows=rows)))
    assert result.ungated_summary().endswith("; all 2 rows predicted to fit"), result.ungated_summary()
    options = {k: v for k, v in rows[0]["options"].items() if k != "recompute_modules"}
    # without its recompute and at micro-batch 2: 269.1 GiB of 173.2
    oversized = dict(rows[0], parallel=dict(rows[0]["parallel"], recompute="none", mbs=2), options=options)
    result = validate_dataset(DatasetSpec.model_validate(dict(data, rows=[oversized, rows[1]])))
    summary = result.ungated_summary()
    assert "; 1 of 2 rows predicted to fit, not: 25.11-dsv3-gb200-mxfp8 (269.1 GiB)" in summary, summary
    # every row must fit, gated or not: the run did
    assert result.violations() == ["megatron-bridge-moe/25.11-dsv3-gb200-mxfp8: predicted not to fit (269.1 GiB), "
                                   "but the published run ran"], result.violations()
    result.rows[1].detail.pop("fits")                                    # a row the model could not price
    assert result.ungated_summary().endswith(
        "not: 25.11-dsv3-gb200-mxfp8 (269.1 GiB), 25.11-qwen3-30b-gb200 (not priced)"), result.ungated_summary()


DSV3_H100_ESTIMATE = [
    "estimate", "--model", "deepseek-v3", "--platform", "dgx-h100", "--nodes", "128", "--dtype", "fp8",
    "--fp8-recipe", "tensorwise", "--global-batch", "8192", "--seq", "4096", "--grad-bytes", "2", "--tp", "2", "--pp", "8", "--dp", "64", "--ep", "64",
    "--mbs", "1", "--zero", "1", "--schedule", "interleaved", "--virtual-stages", "4",
    "--virtual-stage-layers", "Et|(tt|)*30mL", "--recompute", "selective", "--recompute-modules", "mla_up_proj,mlp",
    "--cost-option", "moe_saved_rows=0", "--cost-option", "cross_entropy_fusion_impl=te",
    "--cost-option", "ep_dispatch=per_node", "--json"]
"""megatron-bridge-moe's row 25.09-dsv3-h100 as a user states it (the dataset's training and options defaults, the
row's degrees and options): issue 17's "the DeepSeek-V3 H100 configuration of the dataset predicted to fit"."""


def test_the_dsv3_h100_row_is_one_estimate_command_away():
    """The CLI prices the row exactly as `piper validate` does (one pipeline), and it fits; without Megatron-Core's
    memory-efficient permutation (moe_saved_rows 2, the default) it would not."""
    row = _row_json("megatron-bridge-moe", "25.09-dsv3-h100")["detail"]
    result = CliRunner().invoke(cli, DSV3_H100_ESTIMATE)
    assert result.exit_code == 0, result.stderr
    est = json.loads(result.stdout)
    assert est["fits"] and row["fits"]
    assert est["step_time_s"] == pytest.approx(row["step_time_s"], rel=1e-12)
    assert est["memory"]["peak_bytes"] / 2**30 == pytest.approx(row["peak_memory_GiB"], rel=1e-12)
    without = [a for a in DSV3_H100_ESTIMATE if a != "moe_saved_rows=0"]
    without.remove("--cost-option")
    assert not json.loads(CliRunner().invoke(cli, without).stdout)["fits"]


@pytest.mark.parametrize("extra, needle", [
    (["--cost-option", "bogus=1"], "--cost-option: 'bogus' is not a cost option; allowed: dropout,"),
    (["--cost-option", "novalue"], "--cost-option: 'novalue'; allowed: NAME=VALUE"),
    (["--cost-option", "moe_saved_rows=-1"], "--cost-option: moe_saved_rows: Input should be greater than or equal"),
    (["--cost-option", "ep_dispatch=[x"], "malformed YAML"),
    # YAML 1.1 spellings are refused as files refuse them (they were read as 8, true and 60)
    (["--cost-option", "loss_chunk_rows=010"], "YAML 1.1 integer spelling"),
    (["--cost-option", "dropout=on"], "YAML 1.1 boolean spelling"),
    (["--cost-option", "moe_saved_rows=1:0"], "YAML 1.1 integer spelling"),
    (["--cost-option", "a2a_overlap=0.5", "--piper-runtime"], "piper's runtime prices its own kernels"),
])
def test_cost_option_bad_input_is_one_line(extra, needle):
    args = ["estimate", "--model", "tiny-moe", "--platform", "frontier", "--nodes", "1", "--dp", "8", "--ep", "8",
            "--no-calibration"]
    result = CliRunner().invoke(cli, args + extra)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and needle in result.stderr, result.stderr


@pytest.mark.parametrize("extra", [["--cost-option", "recompute_modules=[mlp]"], ["--recompute-modules", "mlp"]])
def test_recompute_modules_beside_full_recompute_are_noted_not_silently_unused(extra):
    """plan ranks full-recompute plans beside selective ones whatever the modules, so estimate prices them alike
    and says the modules change nothing (it refused them; before that they were silently unused)."""
    args = ["estimate", "--model", "tiny-moe", "--platform", "frontier", "--nodes", "1", "--dp", "8", "--ep", "8",
            "--no-calibration", "--recompute", "full"]
    result = CliRunner().invoke(cli, args + extra)
    assert result.exit_code == 0, result.stderr
    assert "recompute modules mlp: what --recompute selective re-runs; this plan has --recompute full, so they " \
           "change nothing in it" in result.stderr


@pytest.mark.parametrize("change, needle", [
    ({"stage": 99}, "stage: 99; the plan has 8 pipeline stage(s): 0 to 7"),
    ({"published": 1e-320}, "published: Input should be greater than or equal to"),
    ({"search": {"strategy": "piper"}}, "give parallel (the published configuration) or search"),   # search won
    ({"tolerance_pct": 1e300}, "tolerance_pct: Input should be less than or equal to 1000"),  # gated nothing
])
def test_a_row_stage_past_the_pipeline_or_a_vanishing_published_value_is_one_line(tmp_path, change, needle):
    """Before: an IndexError traceback (stage), and Infinity in the JSON (a relative error over 1e-320)."""
    import yaml

    data = yaml.safe_load((validation_dir() / "korthikanti-a100.yaml").read_text())
    row = next(r for r in data["rows"] if r.get("parallel", {}).get("pp") == 8 and "mem" in r["id"])
    row.update(change)
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(cli, ["validate", "--dataset", str(path)])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and needle in result.stderr, result.stderr
    assert result.stderr.startswith(f"error: {path}: "), result.stderr         # the dataset file is named


def test_an_unknown_dataset_platform_names_the_dataset_file(tmp_path):
    import yaml

    data = yaml.safe_load((validation_dir() / "korthikanti-a100.yaml").read_text())
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump({**data, "platform": "nowhere"}))
    result = CliRunner().invoke(cli, ["validate", "--dataset", str(path)])
    assert result.exit_code == 2 and result.stderr.startswith(f"error: {path}: platform: unknown platform 'nowhere'")


@pytest.mark.parametrize("parallel, needle", [
    ({"virtual_stage_layers": "Et|(tt|)*29mL"}, "virtual_stage_layers_invalid"),     # before: AssertionError
    ({"pp": 200}, "pp_exceeds_layers"),                                             # before: ZeroDivisionError
    ({"ep": 7}, "ep_not_divisor: ep=7 must divide num_experts=256"),                # before: priced, 437.8 tok/s
    ({"mbs": 3}, "batch_not_divisible: global_batch=8192"),                         # before: priced at batch 8064
])
def test_a_rows_published_plan_is_checked_as_estimate_checks_it(tmp_path, parallel, needle):
    import yaml

    data = yaml.safe_load((validation_dir() / "megatron-bridge-moe.yaml").read_text())
    data["rows"] = [r for r in data["rows"] if r["id"] == "25.09-dsv3-h100"]
    data["rows"][0]["parallel"].update(parallel)
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(cli, ["validate", "--dataset", str(path)])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "rows[25.09-dsv3-h100].parallel: invalid plan:" in result.stderr and needle in result.stderr


def test_the_h100_constant_moves_only_the_qwen3_30b_rows(capsys):
    """Fitted on the token-drop row instead of its dropless twin (benchmarks/fit_host_floor.py --instead; for the
    record, the dataset header), dgx-h100's host constant is smaller, and the H100 rows the gate checks do not move:
    neither DeepSeek-V3 nor Qwen3-235B on H100 is host-bound, so which Qwen3-30B row carries the fit decides only
    which of the two is missed."""
    import importlib.util

    from piper_plan.catalog import project_root

    spec = importlib.util.spec_from_file_location("fit_host_floor",
                                                  project_root() / "benchmarks" / "fit_host_floor.py")
    fit_host_floor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit_host_floor)
    fit_host_floor.main(["--instead", "25.09-qwen3-30b-h100-drop"])
    lines = capsys.readouterr().out.splitlines()
    fitted_us = float(lines[0].split("= ")[1].removesuffix(" us"))
    assert 100 < fitted_us < 200                       # the dropless fit row's is 284.8 us (platforms/dgx-h100.yaml)
    errors = {line.split()[0]: line.split()[-1] for line in lines[1:]}
    for row_id in ("25.09-dsv3-h100", "25.11-qwen3-235b-h100"):       # as `piper validate` prices them
        assert errors[row_id] == f"{100 * _row_json('megatron-bridge-moe', row_id)['rel_error']:+.2f}%"
    assert float(errors["25.11-qwen3-30b-h100"].rstrip("%")) > 90


@pytest.mark.parametrize("row_extra, needle", [
    ("training: {seq_len: -5}, ", "rows[r].training: training does not apply to a migration row"),
    ("search: {strategy: zzz}, ", "rows[r].search: search does not apply to a migration row"),
    ("nodes: 4, ", "rows[r].nodes: nodes does not apply to a migration row"),
])
def test_a_migration_row_field_it_never_reads_is_one_line(tmp_path, row_extra, needle):
    """Before: read as given and ignored (a strategy 'zzz', a sequence of -5 tokens), the dataset passing."""
    path = tmp_path / "d.yaml"
    path.write_text("name: d\ndescription: x\ncitation: x\nplatform: frontier\nused_for_fitting: false\n"
                    "tolerance_pct: {row: 1, mean: 1}\nmigration: {bytes_per_param: 16, matrices: 3, gpus: 8, "
                    "bandwidth_Bps: 50000000000}\nrows:\n  - {id: r, facts: {num_experts: 8, hidden_size: 64, "
                    f"d_ffn: 64}}, {row_extra}quantity: migration.time_ms, published: 1.0}}\n")
    result = CliRunner().invoke(cli, ["validate", "--dataset", str(path)])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and needle in result.stderr, result.stderr


def test_a_stage_on_a_row_that_reads_no_memory_is_one_line(tmp_path):
    data = (Path(__file__).resolve().parents[2] / "validation" / "korthikanti-a100.yaml").read_text()
    rows = data.index("rows:")
    first = data.index("- {", rows)
    path = tmp_path / "k.yaml"
    path.write_text(data[:first] + "- {stage: 0, " + data[first + 3:])
    result = CliRunner().invoke(cli, ["validate", "--dataset", str(path)])
    assert result.exit_code == 2 and "stage does not apply to a" in result.stderr, result.stderr
