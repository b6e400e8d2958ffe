"""`plan` and `estimate` price a plan identically, directly and through a saved plan.json: one pricing pipeline
(cost/batch.py), the layer split and sequence parallelism part of the plan."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from piper_plan.cli.main import cli
from piper_plan.cost.evaluate import estimate
from piper_plan.cli.common import platform_calibration
from piper_plan.planfile import read_plan_file

CASES = [("deepseek-v3", "frontier", 256), ("mixtral-8x7b", "frontier", 8)]


def _run(*args) -> dict:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _estimate_args(model, platform, nodes, row) -> list:
    args = ["estimate", "--model", model, "--platform", platform, "--nodes", nodes, "--json"]
    for key in ("dp", "tp", "pp", "ep", "etp", "mbs", "schedule", "recompute", "zero", "a2a"):
        args += [f"--{key}", row[key]]
    return args + ["--virtual-stages", row["virtual_stages"], "--layers-split", row["layers_split"]]


@pytest.mark.parametrize("model,platform,nodes", CASES)
def test_every_ranked_plan_estimates_the_same_directly_and_through_plan_json(tmp_path, model, platform, nodes):
    ranked = _run("plan", "--model", model, "--platform", platform, "--nodes", nodes, "--json", "--top", 10)
    assert len(ranked["plans"]) == 10
    calibration = platform_calibration(platform)
    for i, row in list(enumerate(ranked["plans"]))[::2]:          # every other one of the top 10
        saved = tmp_path / f"plan{i}.json"
        direct = _run(*_estimate_args(model, platform, nodes, row), "--save", saved)
        assert direct["step_time_s"] == pytest.approx(row["step_time_s"], rel=1e-9), row
        assert direct["memory"]["peak_bytes"] == pytest.approx(row["peak_memory_bytes"], rel=1e-9, abs=1.0), row
        pf = read_plan_file(saved)
        again = estimate(pf.model, pf.platform, pf.training, pf.nodes, pf.parallel, calibration=calibration,
                         placement=pf.placement)
        assert again.step_time_s == pytest.approx(row["step_time_s"], rel=1e-9)
        assert again.memory.peak_bytes == pytest.approx(row["peak_memory_bytes"], rel=1e-9, abs=1.0)
        assert pf.prediction.step_time_s == direct["step_time_s"]
        assert pf.parallel.layers_per_stage == direct["layers_per_stage"]


def test_a_plan_means_the_same_after_a_round_trip(tmp_path):
    """Mixtral 8x7B on 8 Frontier nodes, dp8 tp2 pp4 ep8: sequence parallelism and the split are the plan's own
    fields, so saving and reloading changes nothing (it used to: 57.12 s / 48.7 GB vs 57.38 s / 51.0 GB)."""
    args = ["estimate", "--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", 8, "--dp", 8, "--tp", 2,
            "--pp", 4, "--ep", 8, "--zero", 0, "--no-calibration", "--json"]
    saved = tmp_path / "plan.json"
    direct = _run(*args, "--save", saved)
    pf = read_plan_file(saved)
    again = estimate(pf.model, pf.platform, pf.training, pf.nodes, pf.parallel)
    assert again.step_time_s == direct["step_time_s"]
    assert again.memory.peak_bytes == direct["memory"]["peak_bytes"]
    no_sp = CliRunner().invoke(cli, [str(a) for a in (*args, "--no-sequence-parallel")])
    assert no_sp.exit_code == 2 and "moe_tp_without_sp: tp=2 with sequence_parallel off" in no_sp.stderr


def test_sequence_parallelism_is_part_of_the_price_of_a_dense_plan():
    """On a dense model --no-sequence-parallel is a valid plan: every rank then keeps the whole sequence's norm and
    dropout activations, so its peak memory is higher than with sequence parallelism."""
    args = ["estimate", "--model", "gpt-22b", "--platform", "frontier", "--nodes", 4, "--dp", 4, "--tp", 8,
            "--pp", 1, "--no-calibration", "--json"]
    with_sp, without_sp = _run(*args), _run(*args, "--no-sequence-parallel")
    assert without_sp["memory"]["peak_bytes"] > with_sp["memory"]["peak_bytes"]



def test_plan_with_recompute_modules_ranks_plans_estimate_prices_alike_with_the_same_flags():
    """--recompute-modules says what selective recompute re-runs; plan still ranks plans without recompute or with
    full recompute (excluding them hid faster plans), and estimate prices every ranked plan alike with the same
    flags, noting the modules where the plan does not recompute selectively (it used to refuse those)."""
    common = ["--model", "mixtral-8x7b", "--platform", "dgx-h100", "--nodes", 4, "--recompute-modules",
              "moe_act,layernorm"]
    ranked = _run("plan", *common, "--json", "--top", 12)
    assert {"none", "selective"} <= {row["recompute"] for row in ranked["plans"]}
    for row in ranked["plans"][:6]:
        direct = _run(*_estimate_args("mixtral-8x7b", "dgx-h100", 4, row), *common[6:])
        assert direct["step_time_s"] == pytest.approx(row["step_time_s"], rel=1e-9), row
        assert direct["memory"]["peak_bytes"] == pytest.approx(row["peak_memory_bytes"], rel=1e-9, abs=1.0), row
        assert direct["options"]["recompute_modules"] == ["moe_act", "layernorm"]
