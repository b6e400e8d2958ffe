"""compare holds like against like: CPU tensor accounting vs the prediction without framework bytes; the
runtime keeps plan.json beside metrics.jsonl; CPU platforms train in fp32; runnable plans are priced as piper's
runtime runs."""

import json

import pytest

from click.testing import CliRunner

from piper_plan.catalog import load_model, load_platform
from piper_plan.cli.main import cli
from piper_plan.compare import compare
from piper_plan.cost.evaluate import estimate
from piper_plan.cost.options import PIPER_RUNTIME_OPTIONS
from piper_plan.planfile import read_plan_file
from piper_plan.specs import TrainingSpec

PREDICTION = {"step_time_s": 1.0, "tokens_per_s": 10.0,
              "memory": {"per_stage": [{"total_bytes": 1000, "components": {"weights": 700, "framework": 200,
                                                                          "fragmentation": 100}}]}}


def _records(source: str):
    return [{"step": s, "step_time_s": 1.0, "tokens_per_s": 10.0, "time_s": {},
             "memory_bytes": [{"total_bytes": 700, "source": source}]} for s in (1, 2)]


def test_tensor_accounting_is_compared_without_framework_bytes():
    cpu = compare(PREDICTION, _records("tensor accounting: parameters + ..."))
    assert cpu["memory_bytes_per_stage"][0] == {"predicted": 700, "measured": 700, "rel_error": 0.0}
    gpu = compare(PREDICTION, _records("torch.cuda.max_memory_allocated"))
    assert gpu["memory_bytes_per_stage"][0]["predicted"] == 1000


def test_the_a2a_term_holds_what_the_runtime_a2a_timer_covers():
    """The runtime's a2a timer runs around the exchanges, the count exchange and the waits at them: the predicted
    a2a term and share count all four, as the estimate's a2a share does."""
    breakdown = {"moe/dispatch/inter_node": 0.1, "moe/combine/inter_node": 0.1, "moe/layout": 0.02,
                 "moe/sync_wait": 0.03, "compute/experts": 0.5, "dp/sync/dense": 0.25}
    prediction = dict(PREDICTION, time={"breakdown": breakdown})
    records = [dict(r, time_s={"a2a": 0.25, "dp_sync": 0.25}) for r in _records("torch.cuda.max_memory_allocated")]
    result = compare(prediction, records)
    assert abs(result["time_s"]["a2a"]["predicted"] - 0.25) < 1e-12 and result["time_s"]["a2a"]["rel_error"] == 0
    assert abs(result["a2a_share"]["predicted"] - 0.25) < 1e-12
    assert result["time_s"]["dp_sync"]["predicted"] == 0.25


def test_cpu_platforms_train_in_fp32():
    t = TrainingSpec.for_device("cpu", seq_len=64)
    assert (t.dtype, t.weight_bytes, t.grad_bytes, t.master_bytes, t.optimizer_bytes) == ("fp32", 4, 4, 0, 8)
    assert TrainingSpec.for_device("cuda").dtype == "bf16"


def test_runnable_plans_are_priced_as_piper_runs_them(tmp_path):
    out = tmp_path / "plan.json"
    res = CliRunner().invoke(cli, ["plan", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "2",
                                   "--seq", "64", "--global-batch", "8", "--runnable", "--save", str(out)])
    assert res.exit_code == 0, res.output
    pf = read_plan_file(out)
    assert pf.training.dtype == "fp32"
    model, platform = load_model("tiny-moe"), load_platform("local-cpu")
    again = estimate(model, platform, pf.training, pf.nodes, pf.parallel, calibration=None,
                     options=PIPER_RUNTIME_OPTIONS)
    fused = estimate(model, platform, pf.training, pf.nodes, pf.parallel, calibration=None)
    saved = json.loads(out.read_text())["prediction"]["memory"]["per_stage"][0]["components"]
    act = lambda comps: sum(v for k, v in comps.items() if k.startswith("activations/"))  # noqa: E731
    assert act(saved) == act(again.memory.per_stage[0].components)
    assert act(saved) > act(fused.memory.per_stage[0].components)


def test_a_step_time_far_off_names_the_calibration_and_how_to_measure_this_machine(tmp_path, monkeypatch):
    """The committed local-cpu calibration was measured on another machine: a run here came out 2.5-4x slower than
    predicted and nothing said why. Beyond 25% compare names the calibration folder, its date and the commands."""
    import piper_plan.cli.compare as compare_cli

    monkeypatch.setattr(compare_cli, "_cpu_against_this_one", lambda *args: None)    # whatever CPU runs the test
    plan = tmp_path / "run" / "plan.json"
    plan.parent.mkdir()
    done = CliRunner().invoke(cli, ["plan", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1",
                                    "--seq", "64", "--global-batch", "8", "--runnable", "-o", str(plan)])
    assert done.exit_code == 0, done.output
    pf = read_plan_file(plan)
    predicted = pf.prediction.step_time_s
    layout = {k: v for k, v in json.loads(plan.read_text())["parallel"].items()}
    for factor, hinted in ((1.1, False), (4.0, True)):
        records = [{"schema_version": 1, "step": s, "loss": 6.0, "step_time_s": factor * predicted, "tokens": 512,
                    "tokens_per_s": 512 / (factor * predicted), "time_s": {}, "parallel": layout,
                    "memory_bytes": [{"stage": 0, "total_bytes": 1, "source": "tensor accounting"}]} for s in (1, 2, 3)]
        (plan.parent / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        result = CliRunner().invoke(cli, ["compare", str(plan.parent)])
        assert result.exit_code == 0, result.output
        said = "-75% off; the plan was priced from" in result.stderr and "piper calibrate overhead --platform " \
            "local-cpu" in result.stderr and "(its metadata.json now says measured 20" in result.stderr
        assert said == hinted, result.stderr
        as_json = CliRunner().invoke(cli, ["compare", str(plan.parent), "--json"])
        assert (json.loads(as_json.stdout)["calibration_note"] is not None) == hinted


def test_a_calibration_of_another_cpu_of_the_same_name_is_another_machines():
    """A VM names different CPUs alike ('AMD EPYC'): compare called the committed local-cpu calibration "this
    machine's CPU: not another machine's rates" on a host whose bf16 GEMMs ran 71-366x slower than it records (no
    avx512 flag). The instruction sets calibrate now records tell them apart; with none recorded, compare cannot
    tell and says how to measure this machine."""
    from types import SimpleNamespace

    from piper_plan.calibration.timing import cpu_isa_flags, cpu_name
    from piper_plan.cli.compare import _cpu_against_this_one

    cpu_plan = SimpleNamespace(platform=SimpleNamespace(launch=SimpleNamespace(device="cpu")))
    name, flags = cpu_name(), cpu_isa_flags()
    assert _cpu_against_this_one(cpu_plan, {"name": name, "isa_flags": flags}) == "this"
    assert _cpu_against_this_one(cpu_plan, {"name": name, "isa_flags": flags + " amx_bf16"}) == "another"
    assert _cpu_against_this_one(cpu_plan, {"name": "Another CPU (1 rank)"}) == "another"
    assert _cpu_against_this_one(cpu_plan, {"name": name}) is None            # nothing recorded to tell
    gpu_plan = SimpleNamespace(platform=SimpleNamespace(launch=SimpleNamespace(device="cuda")))
    assert _cpu_against_this_one(gpu_plan, {"name": name, "isa_flags": flags}) is None


def test_on_a_gpu_platform_the_note_names_the_overhead_benchmark_on_its_gpus(tmp_path):
    """`piper calibrate overhead` times the runtime on the platform's device: on a GPU platform the note sends the
    user there, on one of its GPUs (it refused GPU platforms until 2026-12-04, and the note said so)."""
    from piper_plan.cli.compare import _calibration_hint

    out = tmp_path / "plan.json"
    done = CliRunner().invoke(cli, ["plan", "--model", "tiny-moe", "--platform", "h200", "--nodes", "1", "--runnable",
                                    "--global-batch", "64", "-o", str(out)])
    assert done.exit_code == 0, done.output
    note = _calibration_hint(read_plan_file(out), -0.98)
    assert "`piper calibrate --platform h200 --quick`, then `piper calibrate overhead --platform h200` on one of " \
           "its GPUs), re-plan" in note


def test_a_migration_every_few_steps_is_its_mean_cost_per_step():
    """Migration is paid on some steps only: its per-step cost is the mean over the steady steps (before: the
    median, 0 for any run migrating less often than every other step)."""
    records = [{"step": s, "step_time_s": 1.0, "tokens_per_s": 10.0,
                "time_s": {"migration": 0.4 if s % 4 == 0 else 0.0}, "memory_bytes": []} for s in range(1, 10)]
    result = compare(dict(PREDICTION, time={"breakdown": {"migration": 0.1}}), records)
    migration = result["time_s"]["migration"]
    assert migration["measured"] == 0.1 and migration["predicted"] == 0.1      # steps 2..9: 2 of 8 migrate
    assert result["time_notes"] == []


def test_rows_whose_numbers_alone_mislead_are_explained():
    """Before: a run with live migration against a plan that priced none read 'migration ... -100' with no word of
    why, and under zero 2 / 3 the dp_sync row read '-' unexplained."""
    records = [{"step": s, "step_time_s": 1.0, "tokens_per_s": 10.0, "parallel": {"zero": 3},
                "time_s": {"migration": 0.4 if s % 4 == 0 else 0.0}, "memory_bytes": []} for s in range(1, 10)]
    notes = compare(dict(PREDICTION, time={"breakdown": {"dp/sync": 0.2}}), records)["time_notes"]
    assert [n.split(":")[0] for n in notes] == ["migration", "dp_sync"]
    assert "--cost-option migration_fraction=F" in notes[0] and "outside the runtime's dp_sync timer" in notes[1]


def test_cpu_ranks_peak_rss_is_compared_with_the_whole_prediction():
    """CPU ranks report their processes' peak RSS beside their tensor accounting: compared with the prediction's
    whole per-device peak (framework and fragmentation in), where the tensor row leaves both out."""
    records = [dict(r, memory_bytes=[dict(r["memory_bytes"][0], process_peak_rss_bytes=2000)])
               for r in _records("tensor accounting: parameters + ...")]
    result = compare(PREDICTION, records)
    assert result["memory_bytes_per_stage"][0]["predicted"] == 700
    assert result["process_rss_bytes_per_stage"] == [{"predicted": 1000, "measured": 2000, "rel_error": -0.5}]
    assert compare(PREDICTION, _records("torch.cuda.max_memory_allocated"))["process_rss_bytes_per_stage"] == []


def test_compare_names_a_missing_host_price_and_a_resident_memory_gap(tmp_path):
    """A plan priced without host time (no overhead.csv) and far off: the note names that first (before: 'if that
    calibration is another machine's', after a calibration measured a minute earlier). A CPU rank's resident memory
    well above the plan's per-device peak is a note too."""
    from piper_plan.cli.compare import _calibration_hint, _process_memory_note

    plan = tmp_path / "plan.json"
    done = CliRunner().invoke(cli, ["plan", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1",
                                    "--seq", "64", "--global-batch", "8", "--runnable", "-o", str(plan)])
    assert done.exit_code == 0, done.output
    plan_file = read_plan_file(plan)
    unpriced = plan_file.model_copy(update={"prediction": plan_file.prediction.model_copy(update={
        "sources": plan_file.prediction.sources.model_copy(update={"host": "not priced: local-cpu has none"})})})
    hint = _calibration_hint(unpriced, -0.7)
    assert hint.startswith("the step time is -70% off, and the plan priced no host time (not priced: local-cpu")
    assert "`piper calibrate overhead --platform local-cpu`" in hint
    note = _process_memory_note(plan_file, [{"predicted": 2**30, "measured": 2 * 2**30, "rel_error": -0.5}])
    assert note.startswith("the ranks' resident memory peaked at 2 GiB against the plan's 1 GiB per device (-50%)")
    assert _process_memory_note(plan_file, [{"predicted": 2**30, "measured": 1.1 * 2**30, "rel_error": -0.09}]) is None


def test_under_fsdp_dp_sync_is_not_timed_and_the_memory_basis_says_what_it_leaves_out():
    """zero 2 / 3: FSDP2 reduce-scatters inside backward, where the runtime's dp_sync timer does not run (before:
    10 us 'measured' against 6.1 ms predicted, +63,100%); its tensor accounting holds local shards only."""
    records = [dict(r, time_s={"dp_sync": 1e-5}, parallel={"zero": 2})
               for r in _records("tensor accounting: parameters + ...")]
    result = compare(dict(PREDICTION, time={"breakdown": {"dp/sync/dense": 0.006}}), records)
    assert result["time_s"]["dp_sync"] == {"predicted": 0.006, "measured": None, "rel_error": None}
    assert "not FSDP2's gathered weights" in result["memory_basis"]
    plain = compare(dict(PREDICTION, time={"breakdown": {"dp/sync/dense": 0.006}}),
                    [dict(r, parallel={"zero": 1}) for r in records])
    assert plain["time_s"]["dp_sync"]["measured"] == 1e-5 and "gathered" not in plain["memory_basis"]


def test_a_calibration_of_this_cpu_is_not_sent_back_to_be_measured_again(tmp_path, monkeypatch):
    """Far off, but priced from a calibration of this very CPU (its model name and instruction sets): the note no
    longer sends the user to measure this machine (which they just did); it names what remains. Another CPU's is
    named as such, and one that recorded no instruction sets (the committed local-cpu calibration) gets the advice
    with an "if"."""
    import piper_plan.catalog as catalog
    from piper_plan.calibration.timing import cpu_isa_flags, cpu_name
    from piper_plan.cli.compare import _calibration_hint

    plan = tmp_path / "plan.json"
    assert CliRunner().invoke(cli, ["plan", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1", "--seq",
                                    "64", "--global-batch", "8", "--runnable", "-o", str(plan)]).exit_code == 0
    plan_file = read_plan_file(plan)
    (tmp_path / "cal").mkdir()
    monkeypatch.setattr(catalog, "calibration_dir", lambda name: tmp_path / "cal")
    this = cpu_name()
    for device, needle in (({"name": this, "isa_flags": cpu_isa_flags()}, "on this machine's CPU"),
                           ({"name": this, "isa_flags": "avx2"}, "on another machine's CPU"),
                           ({"name": "Another CPU (1 rank)"}, "on another machine's CPU (Another CPU (1 rank); this "
                                                              f"one is {this} with "),
                           ({"name": this}, "If that calibration is another machine's")):    # the committed one's
        (tmp_path / "cal" / "metadata.json").write_text(json.dumps({"device": device, "date": "2026-12-04"}))
        assert needle in _calibration_hint(plan_file, -0.5), (device, _calibration_hint(plan_file, -0.5))


def test_a_prediction_that_moved_with_its_rates_does_not_blame_the_file(tmp_path):
    """After `piper calibrate overhead`, `estimate --plan` said the untouched file 'was edited or saved by another
    piper'; where the rates' sources moved it says that instead."""
    from piper_plan.launch.job import stale_note

    plan = tmp_path / "plan.json"
    assert CliRunner().invoke(cli, ["plan", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1", "--seq",
                                    "64", "--global-batch", "8", "--runnable", "-o", str(plan)]).exit_code == 0
    stored = read_plan_file(plan).prediction
    fresh = stored.model_copy(update={"step_time_s": 2 * stored.step_time_s, "sources": stored.sources.model_copy(
        update={"host": "the runtime's overhead measured in calibration/x/overhead.csv (added to the compute)"})})
    assert stale_note(stored, fresh).endswith("the rates it is priced from changed since it was saved (now host: the "
                                              "runtime's overhead measured in calibration/x/overhead.csv (added to "
                                              "the compute))")
    edited = stored.model_copy(update={"step_time_s": 2 * stored.step_time_s})
    assert stale_note(stored, edited).endswith("the file was edited or saved by another piper")


def test_a_hand_edited_plan_is_compared_as_it_costs(tmp_path):
    """A plan whose batch was edited by hand (its stored prediction still the old batch's): `launch` sized it by what
    it costs and `compare` by the figures written in it (before: -72% against half the batch). compare prices the
    kept plan again, as launch, run and estimate --plan do, and says where the file's figures differ."""
    plan = tmp_path / "run" / "plan.json"
    plan.parent.mkdir()
    assert CliRunner().invoke(cli, ["plan", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1", "--seq",
                                    "64", "--global-batch", "8", "--runnable", "-o", str(plan)]).exit_code == 0
    data = json.loads(plan.read_text())
    stored = data["prediction"]["step_time_s"]
    data["training"]["global_batch"] *= 2
    data["parallel"]["num_microbatches"] *= 2
    plan.write_text(json.dumps(data))
    tokens = data["training"]["global_batch"] * 64
    records = [{"schema_version": 1, "step": s, "loss": 6.0, "step_time_s": 2 * stored, "tokens": tokens,
                "tokens_per_s": tokens / (2 * stored), "time_s": {}, "parallel": data["parallel"],
                "memory_bytes": [{"stage": 0, "total_bytes": 1, "source": "tensor accounting"}]} for s in (1, 2, 3)]
    (plan.parent / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    shown = CliRunner().invoke(cli, ["compare", str(plan.parent), "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["step_time_s"]["predicted"] > 1.5 * stored      # the doubled batch's price
    assert "is not what its plan costs now" in shown.stderr and "compared with the new figures" in shown.stderr


def test_the_first_step_after_a_resume_is_warm_up_too():
    """A resumed run's first step pays allocation and connections again (0.18 s against 0.08 steady): the runtime
    marks every invocation's first step (``warmup``), and compare and the summary leave them out."""
    from piper_plan.compare import steady_steps
    from piper_plan.runtime.metrics import summarise

    records = [{"step": s, "loss": 1.0, "step_time_s": 0.5 if s in (1, 4) else 0.1, "tokens": 8, "tokens_per_s": 1.0,
                "time_s": {}, "memory_bytes": [{"total_bytes": 1}], "expert_tokens": {}, "migrations": [],
                **({"warmup": True} if s in (1, 4) else {})} for s in range(1, 7)]
    assert [r["step"] for r in steady_steps(records)] == [2, 3, 5, 6]
    assert summarise(records)["step_time_s"] == pytest.approx(0.1)
    assert [r["step"] for r in steady_steps(records[:1])] == [1]            # nothing else left: kept
