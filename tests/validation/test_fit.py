"""`piper calibrate fit`: the least-squares fitter recovers parameters it generated data with (tier 2), names its
runs in the written rows, and refuses a run directory without its plan."""

from __future__ import annotations

import json

import pytest

from piper_plan.calibration.fit import fit, load_fit, predict_seconds, read_run, fit_rows, write_fit
from piper_plan.catalog import load_model, load_platform
from piper_plan.errors import PiperError
from piper_plan.planfile import write_plan_file
from piper_plan.specs import ParallelPlan, TrainingSpec

PLANS = [  # (nodes, parallel) on local-cpu (2 ranks per node): a2a over 1 and 2 nodes, pipelines, dp-only
    (1, dict(dp=2, ep=2, mbs=1)), (1, dict(dp=2, ep=2, mbs=2)), (2, dict(dp=4, ep=4, mbs=1)),
    (2, dict(dp=2, ep=2, pp=2, mbs=1)), (2, dict(dp=4, ep=2, mbs=1)), (1, dict(dp=1, pp=2, mbs=1)),
]
TRUE = {"efficiency.gemm": 0.35, "a2a_overlap": 0.4}


def _runs(tmp_path, values):
    """Run directories whose 'measured' times are the model's own prediction under ``values`` (synthetic)."""
    dirs = _plan_dirs(tmp_path)
    runs = [read_run_placeholder(d) for d in dirs]
    truth = predict_seconds(runs, values)
    for d, seconds in zip(dirs, truth):
        lines = [json.dumps({"schema_version": 1, "step": s, "step_time_s": float(seconds) * (3 if s == 0 else 1)})
                 for s in range(4)]
        (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return [read_run(d) for d in dirs], truth


def _plan_dirs(tmp_path):
    """One run directory with a plan.json per entry of PLANS (tiny-moe on local-cpu)."""
    model, platform = load_model("tiny-moe"), load_platform("local-cpu")
    training = TrainingSpec(seq_len=64, global_batch=8)
    dirs = []
    for i, (nodes, par) in enumerate(PLANS):
        plan = ParallelPlan(**par, num_microbatches=8 // (par["dp"] * par["mbs"]))
        d = tmp_path / f"run{i}"
        d.mkdir()
        write_plan_file(d / "plan.json", model, platform, training, nodes, plan, "compact", None)
        dirs.append(d)
    return dirs


def read_run_placeholder(d):
    (d / "metrics.jsonl").write_text(json.dumps({"schema_version": 1, "step": 0, "step_time_s": 1.0}) + "\n")
    return read_run(d)


def test_fit_recovers_generating_parameters(tmp_path):
    runs, truth = _runs(tmp_path, TRUE)
    assert [r.measured_step_s for r in runs] == pytest.approx(list(truth))     # warm-up step left out
    result = fit(runs, calibration=None, names=["efficiency.gemm", "a2a_overlap", "p2p_overlap"])
    assert result.values["efficiency.gemm"] == pytest.approx(0.35, rel=1e-3)
    assert result.values["a2a_overlap"] == pytest.approx(0.4, abs=2e-3)
    assert result.mape_before_pct > 10 and result.mape_after_pct < 0.1


def test_fit_rows_name_runs_and_load_back(tmp_path):
    runs, _ = _runs(tmp_path, TRUE)
    result = fit(runs, calibration=None, names=["efficiency.gemm", "a2a_overlap"])
    rows = fit_rows(result, "piper calibrate fit")
    assert all("run0" in r["source"] and "run5" in r["source"] for r in rows)
    path = write_fit(tmp_path / "fit.csv", rows)
    opts, platform = load_fit(load_platform("local-cpu"), path)
    assert platform.efficiency.gemm == pytest.approx(result.values["efficiency.gemm"])
    assert opts.a2a_overlap == pytest.approx(result.values["a2a_overlap"])


def test_run_without_plan_is_user_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(PiperError, match="plan.json"):
        read_run(tmp_path)


def test_split_runs_holds_out_every_other():
    from piper_plan.calibration.fit import split_runs

    fit_set, held = split_runs(list(range(9)))
    assert fit_set == [0, 2, 4, 6, 8] and held == [1, 3, 5, 7]


def test_overhead_scale_recovered_and_scored_on_held_out_runs(tmp_path):
    """Runs 'measured' with the framework overhead doubled: fitting ``overhead.scale`` on half of them recovers 2,
    and the held-out half's error falls from the unscaled model's to ~0 (calibration: local-cpu's measured rows)."""
    from piper_plan.calibration import load_calibration
    from piper_plan.calibration.fit import holdout_mape_pct, split_runs

    cal = load_calibration("local-cpu")
    assert cal.overhead is not None  # calibration/local-cpu/overhead.csv is a committed fixture
    dirs = _plan_dirs(tmp_path)
    truth = predict_seconds([read_run_placeholder(d) for d in dirs], {"overhead.scale": 2.0}, cal)
    for d, seconds in zip(dirs, truth):
        (d / "metrics.jsonl").write_text("\n".join(json.dumps({"schema_version": 1, "step": s, "step_time_s": float(seconds)})
                                                   for s in range(3)) + "\n")
    fit_set, held = split_runs([read_run(d) for d in dirs])
    result = fit(fit_set, cal, names=["overhead.scale"])
    assert result.values["overhead.scale"] == pytest.approx(2.0, rel=1e-3)
    before, after = holdout_mape_pct(result.values, held, cal)
    assert before > 5 and after < 0.1


def test_a_run_resumed_under_another_layout_fits_its_plans_steps(tmp_path):
    """Before: the steps of the earlier layout (10 s) were averaged in with the plan's (1 s)."""
    d = _plan_dirs(tmp_path)[0]
    here = json.loads((d / "plan.json").read_text())["parallel"]
    other = {**here, "pp": 2, "dp": 1}
    lines = [{"schema_version": 1, "step": s, "step_time_s": 10.0, "parallel": other} for s in (1, 2, 3)] + \
            [{"schema_version": 1, "step": s, "step_time_s": 1.0, "parallel": here} for s in (4, 5, 6)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert read_run(d).measured_step_s == pytest.approx(1.0)


def test_the_fit_says_how_to_price_with_it_since_estimate_does_not_read_it():
    """fit.csv is a record (nothing prices with it); before, nothing said so and a user took the fit as applied."""
    from piper_plan.calibration.fit import how_to_apply

    text = how_to_apply({"a2a_overlap": 0.35, "efficiency.gemm": 0.6123, "overhead.scale": 1.25}, "local-cpu")
    assert text.startswith("fit.csv records the fit; estimate and plan do not apply it. To price with it: ")
    assert "estimate / plan --cost-option a2a_overlap=0.35" in text
    assert "a copy of platform local-cpu's YAML with efficiency.gemm: 0.6123" in text
    assert "overhead.scale: no option takes it" in text
    assert "--cost-option" not in how_to_apply({"efficiency.attention": 0.3}, "frontier")


def test_a_parameter_fitted_to_its_bound_is_the_bound_not_solver_noise(tmp_path):
    # the data were made with no all-to-all overlap: least squares stops just inside its bound (4.8e-13 was printed
    # as a change, '0 -> 4.8e-13'); the fit reports the bound itself
    runs, _ = _runs(tmp_path, {"efficiency.gemm": 0.35, "a2a_overlap": 0.0})
    result = fit(runs, calibration=None, names=["efficiency.gemm", "a2a_overlap"])
    assert result.values["a2a_overlap"] == 0.0
    assert result.values["efficiency.gemm"] == pytest.approx(0.35, rel=1e-3)
