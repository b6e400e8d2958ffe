"""Framework overhead: overhead.csv rows -> FrameworkOverhead (tier 2), the bench's pieces run on the real runtime
modules, and the parameter-tensor count the optimizer overhead uses equals the runtime's (tier 4)."""

from __future__ import annotations

import os

import pandas as pd
import pytest

from piper_plan.calibration.overhead import OVERHEAD, load_overhead, overhead_from_rows
from piper_plan.catalog import load_model
from piper_plan.cost.overhead import FrameworkOverhead, layer_overhead_seconds, linear_fit, param_tensors_per_layer


def _rows():
    # moe_block: 100 us + 50 us per local expert; optimizer: 20 us + 5 us per tensor; the concurrency workload
    # (moe_block with 4 local experts, 300 us alone) takes 450 / 600 / 1200 us per rank with 1 / 2 / 4 ranks at once
    data = [("attention_layer", 1, 300e-6), ("dense_mlp", 1, 120e-6), ("head_loss", 1, 80e-6),
            ("moe_block", 1, 150e-6), ("moe_block", 2, 200e-6), ("moe_block", 4, 300e-6), ("moe_block", 8, 500e-6),
            ("optimizer_tensor", 8, 60e-6), ("optimizer_tensor", 32, 180e-6),
            ("concurrency", 1, 450e-6), ("concurrency", 2, 600e-6), ("concurrency", 4, 1200e-6)]
    return pd.DataFrame([{"op": o, "size": n, "seconds": s, "source": "measured: test"} for o, n, s in data])


def test_rows_to_overhead_linear_fits():
    ov = overhead_from_rows(_rows())
    assert ov.moe_block_s == pytest.approx(100e-6) and ov.moe_per_local_expert_s == pytest.approx(50e-6)
    assert ov.optimizer_s == pytest.approx(20e-6) and ov.optimizer_per_tensor_s == pytest.approx(5e-6)
    assert ov.attention_layer_s == pytest.approx(300e-6) and ov.head_loss_s == pytest.approx(80e-6)
    assert ov.concurrency_factor == pytest.approx((1.5, 2.0, 4.0))
    # dense layer = attention + dense MLP; MoE layer with 4 local experts = 300 + 100 + 4 x 50 us
    dense, moe = layer_overhead_seconds(ov, 4, has_moe=True, has_dense=True)
    assert float(dense) == pytest.approx(420e-6) and float(moe) == pytest.approx(600e-6)


def test_slowdown_interpolates_then_grows_in_proportion():
    ov = overhead_from_rows(_rows())
    assert ov.slowdown([1, 2, 3, 4, 8]).tolist() == pytest.approx([1.5, 2.0, 3.0, 4.0, 8.0])
    # nothing measured beyond one rank (calibrate overhead --no-concurrency): no slowdown. Before, 16 ranks were
    # priced 16x slower, which made a GPU platform's compute 8x slower per node of 8 devices.
    assert FrameworkOverhead().slowdown([1, 8, 16]).tolist() == [1.0, 1.0, 1.0]
    rows = _rows()
    alone = rows[~rows["op"].str.startswith("concurrency")]
    assert overhead_from_rows(alone).slowdown(8) == 1.0


def test_linear_fit_clamps_negative_intercept():
    assert linear_fit([1, 2, 4], [1.0, 3.0, 7.0]) == pytest.approx((0.0, 2.0), abs=1e-12)


def test_load_overhead_and_calibration_attach(tmp_path):
    from piper_plan.calibration import load_calibration
    from piper_plan.calibration.io import merge_rows
    from piper_plan.catalog import calibration_dir

    assert load_overhead(tmp_path) is None
    merge_rows(tmp_path, OVERHEAD, _rows().to_dict("records"))
    assert load_overhead(tmp_path).moe_per_local_expert_s == pytest.approx(50e-6)
    for f in calibration_dir("local-cpu").glob("gemm.csv"):
        (tmp_path / f.name).write_text(f.read_text())
    assert load_calibration(tmp_path).overhead.attention_layer_s == pytest.approx(300e-6)


def test_bad_overhead_row_is_user_error(tmp_path):
    from piper_plan.errors import PiperError

    (tmp_path / "overhead.csv").write_text("op,size,seconds,source\nmoe_block,0,1e-3,measured: x\n")
    with pytest.raises(PiperError, match="size"):
        load_overhead(tmp_path)


def test_an_overhead_call_of_days_is_refused(tmp_path):
    # the benchmark's whole run takes about 40 s: a row of 999,999 s per call (inside the million seconds any
    # calibration row may hold) would put eleven days into every step of every plan
    from piper_plan.errors import PiperError

    (tmp_path / "overhead.csv").write_text("op,size,seconds,source\nmoe_block,1,999999,measured: x\n")
    with pytest.raises(PiperError, match="seconds"):
        load_overhead(tmp_path)
    (tmp_path / "overhead.csv").write_text("op,size,seconds,source\nmoe_block,1,600,measured: x\n")
    ov = load_overhead(tmp_path)
    assert ov.moe_block_s + ov.moe_per_local_expert_s == pytest.approx(600)     # one local expert's block


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-dense", "tiny-moe-plain"])
def test_param_tensors_per_layer_equal_runtime(name):
    pytest.importorskip("torch")
    from piper_plan.runtime.model import StageModel

    model = load_model(name)
    module = StageModel(model, 0, model.num_layers)
    dense_t, moe_t = param_tensors_per_layer(model)
    for i, block in module.layers.items():
        expected = moe_t if model.is_moe_layer(int(i)) else dense_t
        assert len(list(block.parameters())) == expected


def test_bench_pieces_run_on_the_runtime_modules():
    torch = pytest.importorskip("torch")
    from piper_plan.calibration.bench_overhead import block_calls

    torch.set_num_threads(1)
    calls = block_calls()
    assert {op for op, _ in calls} == {"attention_layer", "dense_mlp", "moe_block", "head_loss", "optimizer_tensor",
                                       "autograd_op", "attention_layer_forward", "moe_block_forward"}
    for call in calls.values():
        call()


def _with_lockstep(extra):
    """_rows() with fine / coarse lockstep rows at 1 and 2 ranks (300 us workload alone) and ``extra`` rows."""
    lockstep = [("concurrency", 1, 300e-6), ("concurrency", 2, 460e-6), ("concurrency_coarse", 1, 900e-6),
                ("concurrency_coarse", 2, 1180e-6), *extra]
    rows = _rows()
    return pd.concat([rows[~rows["op"].str.startswith("concurrency")],
                      pd.DataFrame([{"op": o, "size": n, "seconds": s, "source": "measured: test"}
                                    for o, n, s in lockstep])], ignore_index=True)


def test_lockstep_rows_separate_slowdown_from_wait_per_collective():
    """fine: 1 workload (300 us alone) per collective; coarse: 3. With 2 ranks each workload takes 1.2 x and each
    collective waits 100 us: fine 460 us, coarse 1180 us per iteration -> slowdown 1.2, wait 100 us."""
    ov = overhead_from_rows(_with_lockstep([]))
    assert ov.concurrency_factor == pytest.approx((1.0, 1.2))
    assert ov.sync_wait_s == pytest.approx((0.0, 100e-6), abs=1e-12)
    assert float(ov.wait_seconds(2)) == pytest.approx(100e-6)


@pytest.mark.distributed
def test_lockstep_probe_measures_fine_and_coarse_in_the_same_ranks():
    """Both workloads-per-collective come from one set of gloo ranks (alternating rounds): a coarse iteration
    (3 workloads) costs more than a fine one, and both exist for every rank count."""
    pytest.importorskip("torch")
    from piper_plan.calibration.bench_overhead import COARSE_CALLS, measure_concurrency

    out = measure_concurrency(ranks=(1, 2), iterations=60)
    assert set(out) == {1, 2}
    for by_calls in out.values():
        assert set(by_calls) == {1, COARSE_CALLS}
        assert by_calls[COARSE_CALLS] > by_calls[1] > 0


def test_rows_timed_apart_give_that_rank_count_its_slowdown_and_wait():
    """lockstep_outside / lockstep_wait at 2 ranks (the workload, 300 us alone, took 390 us outside the exchange;
    1.5 ms inside it beyond the exchange alone) replace the fine / coarse split there; 1 rank keeps it."""
    ov = overhead_from_rows(_with_lockstep([("lockstep_outside", 2, 390e-6), ("lockstep_wait", 2, 1.5e-3)]))
    assert ov.concurrency_factor == pytest.approx((1.0, 1.3))
    assert ov.sync_wait_s == pytest.approx((0.0, 1.5e-3), abs=1e-12)
    assert float(ov.wait_seconds(2)) == pytest.approx(1.5e-3)


@pytest.mark.distributed
def test_launched_ranks_write_the_rows_timed_apart(tmp_path):
    """Two ranks started as a launcher starts them (RANK, WORLD_SIZE, MASTER_* in the environment) measure the
    lockstep rows of size 2, the workload and the exchange timed apart; they load into a slowdown and a wait."""
    pytest.importorskip("torch")
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "piper_plan.calibration.bench_overhead", "--launched-ranks", "--out", str(tmp_path),
           "--iterations", "40"]
    base = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd, env={**base, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
    frame = pd.read_csv(tmp_path / "overhead.csv")
    assert set(frame["op"]) == {"concurrency", "concurrency_coarse", "lockstep_outside", "lockstep_wait"}
    assert set(frame["size"]) == {2}
    rows = pd.concat([_rows()[lambda f: ~f["op"].str.startswith("concurrency")], frame], ignore_index=True)
    ov = overhead_from_rows(rows)
    assert ov.concurrency_ranks == (2,) and ov.concurrency_factor[0] >= 1.0 and ov.sync_wait_s[0] >= 0.0


def test_the_forward_rows_give_the_share_full_recompute_runs_again():
    """(attention forward + 4-expert MoE forward) / (their forward + backward): 150 + 100 of 300 + 300 us."""
    rows = pd.concat([_rows(), pd.DataFrame([
        {"op": "attention_layer_forward", "size": 1, "seconds": 150e-6, "source": "measured: test"},
        {"op": "moe_block_forward", "size": 4, "seconds": 100e-6, "source": "measured: test"}])])
    assert overhead_from_rows(rows).forward_share == pytest.approx(250 / 600)
    assert overhead_from_rows(_rows()).forward_share == 0.0        # not measured: recompute adds no overhead


def _gpu_overhead_calibration(tmp_path, scale: float):
    """calibration/h200 with overhead.csv rows of the test's size (``scale`` x _rows(), no concurrency rows)."""
    import shutil

    from piper_plan.calibration import load_calibration
    from piper_plan.calibration.io import merge_rows
    from piper_plan.catalog import calibration_dir

    directory = tmp_path / f"h200-{scale:g}"
    shutil.copytree(calibration_dir("h200"), directory)
    (directory / "overhead.csv").unlink(missing_ok=True)        # the rows measured on the H200
    rows = _rows()
    rows = rows[~rows["op"].str.startswith("concurrency")].assign(seconds=lambda f: f["seconds"] * scale)
    merge_rows(directory, OVERHEAD, rows.to_dict("records"))
    return load_calibration(directory)


def test_on_a_gpu_the_host_is_a_floor_under_the_step_not_an_addition(tmp_path):
    """piper's runtime on a GPU: the host issues while the device runs, so a step takes the longer of the two
    (cost/batch.py host_floor): a small host overhead adds nothing, a large one sets the step (host/framework)."""
    from piper_plan.catalog import load_platform
    from piper_plan.cost.evaluate import estimate
    from piper_plan.cost.options import PIPER_RUNTIME_OPTIONS
    from piper_plan.specs import ParallelPlan, TrainingSpec

    model, h200 = load_model("tiny-moe"), load_platform("h200")
    plan, training = ParallelPlan(dp=8, ep=8, num_microbatches=4), TrainingSpec(seq_len=64, global_batch=32)

    def run(calibration):
        return estimate(model, h200, training, 1, plan, calibration=calibration, options=PIPER_RUNTIME_OPTIONS)

    small, large = run(_gpu_overhead_calibration(tmp_path, 1e-3)), run(_gpu_overhead_calibration(tmp_path, 100.0))
    assert small.time.breakdown.get("host/framework", 0.0) == 0.0 and "framework/layer" not in small.time.breakdown
    assert large.time.breakdown["host/framework"] > 0
    assert large.step_time_s == pytest.approx(sum(large.time.breakdown.values()), rel=1e-9)
    # the host's issue time of the step: per micro-batch each MoE layer 300 (attention) + 100 + 50 us per local
    # expert, each dense one 300 + 120 us, the head 80 us; x 100, x 4 micro-batches: the step takes it
    local = model.moe.num_experts / 8
    moe_layers = sum(model.is_moe_layer(i) for i in range(model.num_layers))
    per_mb = (moe_layers * (400e-6 + 50e-6 * local) + (model.num_layers - moe_layers) * 420e-6 + 80e-6) * 100
    # and the optimizer's: one call per gradient group, 20 us + 5 us per tensor, x 100
    from piper_plan.cost.overhead import expert_tensors_per_layer

    dense_t, moe_t = param_tensors_per_layer(model)
    expert_t = expert_tensors_per_layer(model)
    dense_tensors = (model.num_layers - moe_layers) * dense_t + moe_layers * (moe_t - expert_t) \
        + 2 + (0 if model.tie_embeddings else 1)                      # embedding; final norm and LM head
    optimizer = (20e-6 + 5e-6 * dense_tensors + 20e-6 + 5e-6 * moe_layers * expert_t) * 100
    assert large.step_time_s == pytest.approx(4 * per_mb + optimizer, rel=1e-9)


def test_the_host_floor_takes_the_slowest_host_over_the_schedule(tmp_path):
    """pp 2 with 3 layers and 1 layer + the LM head: the device's slowest stage is the first, the host's the last
    (its loss runs 32 chunks); a host-paced 1F1B schedule takes M + pp - 1 of the slowest host's micro-batches."""
    from piper_plan.catalog import load_platform
    from piper_plan.cost.evaluate import estimate
    from piper_plan.cost.options import PIPER_RUNTIME_OPTIONS
    from piper_plan.specs import ParallelPlan, TrainingSpec

    model, h200 = load_model("tiny-moe"), load_platform("h200")
    training = TrainingSpec(seq_len=32768, global_batch=4)
    plan = ParallelPlan(pp=2, num_microbatches=4, layers_per_stage=[3, 1])
    est = estimate(model, h200, training, 1, plan, calibration=_gpu_overhead_calibration(tmp_path, 100.0),
                   options=PIPER_RUNTIME_OPTIONS)
    host = {True: (400e-6 + 50e-6 * model.moe.num_experts) * 100, False: 420e-6 * 100}    # per layer, ep 1
    first = sum(host[model.is_moe_layer(i)] for i in range(3))
    last = host[model.is_moe_layer(3)] + 80e-6 * 100 * 32768 / 1024                      # 32 loss chunks
    assert last > first
    optimizer = est.time.breakdown["optimizer/step"]
    assert est.step_time_s >= last * (4 + 1) + optimizer
    assert est.step_time_s == pytest.approx(last * (4 + 1), rel=0.05)


def test_each_chunk_of_the_chunked_loss_is_issued_again_in_backward(tmp_path):
    """ChunkedLoss checkpoints each chunk: its head and loss forward runs again in backward, priced at the
    forward's measured share (250 of 600 us here); a micro-batch of 4,096 rows is 4 chunks of 1,024."""
    from piper_plan.calibration import load_calibration
    from piper_plan.calibration.io import merge_rows
    from piper_plan.catalog import load_platform
    from piper_plan.cost.evaluate import estimate
    from piper_plan.cost.options import PIPER_RUNTIME_OPTIONS
    from piper_plan.specs import ParallelPlan, TrainingSpec

    plain = _gpu_overhead_calibration(tmp_path, 100.0)
    forward = [{"op": "attention_layer_forward", "size": 1, "seconds": 150e-6 * 100, "source": "measured: test"},
               {"op": "moe_block_forward", "size": 4, "seconds": 100e-6 * 100, "source": "measured: test"}]
    merge_rows(plain.directory, OVERHEAD, forward)
    with_forward = load_calibration(plain.directory)
    assert with_forward.overhead.forward_share == pytest.approx(250 / 600)
    model, h200 = load_model("tiny-moe"), load_platform("h200")
    plan, training = ParallelPlan(num_microbatches=4), TrainingSpec(seq_len=4096, global_batch=4)

    def step(calibration):
        return estimate(model, h200, training, 1, plan, calibration=calibration, options=PIPER_RUNTIME_OPTIONS)
    before, after = step(plain), step(with_forward)
    assert before.time.breakdown["host/framework"] > 0
    assert after.step_time_s - before.step_time_s == pytest.approx(4 * 80e-6 * 100 * 4 * 250 / 600, rel=1e-9)
