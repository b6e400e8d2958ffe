"""memory.csv: the measured streaming rates of the runtime's memory-bound kernels, and the cost model's use of them
(cost/compute.py Rates.memory_seconds)."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from piper_plan.calibration import load_calibration
from piper_plan.calibration.bench_memory import BYTES_PER_ELEMENT
from piper_plan.calibration.io import merge_rows
from piper_plan.calibration.schema import MEMORY, MEMORY_KERNELS
from piper_plan.catalog import calibration_dir, load_model, load_platform
from piper_plan.cli.main import cli
from piper_plan.cost.evaluate import estimate
from piper_plan.cost.options import PIPER_RUNTIME_OPTIONS
from piper_plan.specs import ParallelPlan, TrainingSpec


def _row(kernel: str, gbps: float, elements: int = 2**26) -> dict:
    nbytes = (BYTES_PER_ELEMENT[kernel] or 4) * elements
    return {"device": "NVIDIA H200", "kernel": kernel, "elements": elements, "bytes": nbytes,
            "seconds": nbytes / gbps / 1e9, "GBps": gbps, "source": "seed: test"}


@pytest.fixture
def h200_with_memory(tmp_path):
    """A copy of calibration/h200 (without its overhead.csv) with a memory.csv of the test's rates."""
    directory = tmp_path / "h200"
    shutil.copytree(calibration_dir("h200"), directory)
    (directory / "overhead.csv").unlink(missing_ok=True)        # the optimizer's host overhead would add to its time

    def write(rates: dict[str, float]):
        (directory / "memory.csv").unlink(missing_ok=True)
        merge_rows(directory, MEMORY, [_row(k, v) for k, v in rates.items()])
        return load_calibration(directory)
    return write


@pytest.mark.bench
def test_the_cpu_sweep_measures_every_kernel_and_its_rows_hold_their_rates(tmp_path):
    result = CliRunner().invoke(cli, ["calibrate", "--platform", "local-cpu", "--quick", "--only", "memory",
                                      "--out-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    calibration = load_calibration(tmp_path)
    rows = calibration.rows["memory"]
    assert sorted(set(rows["kernel"].tolist())) == sorted(MEMORY_KERNELS)
    for kernel in MEMORY_KERNELS:
        assert calibration.memory_Bps(kernel) > 1e8                        # a CPU streams well above 0.1 GB/s
    assert not (tmp_path / "gemm.csv").exists()                            # --only memory measures nothing else
    shown = CliRunner().invoke(cli, ["calibrate", "show", "--platform", str(tmp_path), "--json"])
    assert shown.exit_code == 0, shown.output
    assert sorted(m["kernel"] for m in json.loads(shown.output)["memory"]) == sorted(MEMORY_KERNELS)


def test_the_fastest_row_of_a_kernel_is_its_rate_and_a_kernel_without_rows_has_none(h200_with_memory):
    calibration = h200_with_memory({"copy": 4000.0, "optimizer": 2900.0})
    merge_rows(calibration.directory, MEMORY, [_row("copy", 3000.0, elements=2**24)])   # a slower, smaller row
    calibration = load_calibration(calibration.directory)
    assert calibration.memory_Bps("copy") == pytest.approx(4000e9)
    assert calibration.memory_Bps("cast") == 0.0


def test_a_row_whose_rate_contradicts_its_bytes_and_seconds_is_one_error_line(tmp_path):
    directory = tmp_path / "cal"
    merge_rows(directory, MEMORY, [_row("copy", 4000.0)])
    path = directory / "memory.csv"
    path.write_text(path.read_text().replace(",4000,", ",9000,"))
    result = CliRunner().invoke(cli, ["calibrate", "show", "--platform", str(directory)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "memory.csv" in result.output and "GBps" in result.output and len(result.output.strip().splitlines()) == 1


def test_the_optimizer_and_the_runtimes_copies_take_their_measured_rates(h200_with_memory):
    """Each priced kernel is divided by its own measured rate: halving one rate doubles its term, and a kernel
    without a row keeps the datasheet bandwidth (4,800 GB/s on the H200)."""
    model, h200 = load_model("tiny-moe"), load_platform("h200")
    plan, training = ParallelPlan(dp=8, ep=8, num_microbatches=4), TrainingSpec(seq_len=64, global_batch=32)

    def breakdown(calibration):
        return estimate(model, h200, training, 1, plan, calibration=calibration,
                        options=PIPER_RUNTIME_OPTIONS).time.breakdown

    datasheet = breakdown(h200_with_memory({}))
    fast = breakdown(h200_with_memory({k: 4800.0 for k in MEMORY_KERNELS}))
    assert fast["optimizer/step"] == pytest.approx(datasheet["optimizer/step"], rel=1e-9)
    assert fast["precision/copies"] == pytest.approx(datasheet["precision/copies"], rel=1e-9)
    slow = breakdown(h200_with_memory({k: 2400.0 for k in MEMORY_KERNELS}))
    assert slow["optimizer/step"] == pytest.approx(2 * fast["optimizer/step"], rel=1e-9)
    assert slow["precision/copies"] == pytest.approx(2 * fast["precision/copies"], rel=1e-9)
    assert slow["compute/elementwise"] == pytest.approx(2 * fast["compute/elementwise"], rel=1e-9)
    only_adam = breakdown(h200_with_memory({"optimizer": 2400.0}))
    assert fast["optimizer/step"] < only_adam["optimizer/step"] < slow["optimizer/step"]   # the clip stays at 4800
    assert only_adam["precision/copies"] == pytest.approx(fast["precision/copies"], rel=1e-9)


def test_pipers_runtime_passes_over_its_gradients_three_more_times_than_megatron(h200_with_memory):
    """Before the optimizer, piper's runtime reads its fp32 gradients for the global norm, rewrites them for the clip
    (runtime/optim.py) and divides them by the micro-batch count (runtime/pipeline.py scale_grads): 3 + 2 passes
    of 4 bytes, against Megatron-Core's 2 of its gradient bytes (clip and unscale; the mean folded into its loss).
    On an H200 the division alone took 3.3 ms of a 123 ms step (docs/gpu-check.md)."""
    from piper_plan.cost.options import CostOptions
    from piper_plan.cost.memory import rank_param_counts

    model, h200 = load_model("tiny-moe"), load_platform("h200")
    plan, training = ParallelPlan(dp=8, ep=8, num_microbatches=4), TrainingSpec(seq_len=64, global_batch=32)
    calibration = h200_with_memory({k: 4800.0 for k in MEMORY_KERNELS})

    def optimizer(options):
        return estimate(model, h200, training, 1, plan, calibration=calibration,
                        options=options).time.breakdown["optimizer/step"]

    (rank,) = rank_param_counts(model, plan)
    params = rank["dense"] + rank["expert"]
    extra = params * ((3 + 2) * 4 - 2 * training.grad_bytes) / 4800e9       # the runtime's gradients are fp32
    assert optimizer(PIPER_RUNTIME_OPTIONS) - optimizer(CostOptions()) == pytest.approx(extra, rel=1e-9)
    # zero 1 shards the optimizer's state, not the gradients the norm, the clip and the mean pass over
    sharded = plan.model_copy(update={"zero": 1})
    (shard,) = rank_param_counts(model, sharded)
    adam = 2 * (training.master_bytes + training.optimizer_bytes) + training.grad_bytes + training.weight_bytes
    local = shard["dense"] / 8 + shard["expert"]                      # dense over dp 8; each expert on one rank
    assert estimate(model, h200, training, 1, sharded, calibration=calibration, options=PIPER_RUNTIME_OPTIONS) \
        .time.breakdown["optimizer/step"] == pytest.approx((local * adam + params * 5 * 4) / 4800e9, rel=1e-9)


def test_a_kernel_faster_than_a_gpus_memory_bandwidth_is_refused(h200_with_memory):
    """A self-consistent row above the H200's 4,800 GB/s is a broken measurement, as a GEMM above its peak is."""
    from piper_plan.errors import PiperError

    model, h200 = load_model("tiny-moe"), load_platform("h200")
    calibration = h200_with_memory({"accumulate": 100_000.0})
    with pytest.raises(PiperError, match="accumulate row measures 100000 GB/s, above the device's memory bandwidth"):
        estimate(model, h200, TrainingSpec(seq_len=64, global_batch=32), 1, ParallelPlan(dp=8, ep=8),
                 calibration=calibration, options=PIPER_RUNTIME_OPTIONS)
