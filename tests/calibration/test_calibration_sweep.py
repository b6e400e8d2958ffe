"""The quick CPU sweep end to end (4 gloo ranks as 2 nodes x 2, spawned by `piper calibrate`), resume, interrupt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from piper_plan.calibration import load_calibration
from piper_plan.calibration.bench_attention import attention_points
from piper_plan.calibration.bench_gemm import gemm_points
from piper_plan.calibration.io import merge_rows, read_table
from piper_plan.calibration.schema import ATTENTION, COLLECTIVES, GEMM, busbw_factor
from piper_plan.calibration.sweep import Reporter, SweepOptions, run_calibration
from piper_plan.cli.main import cli

pytestmark = pytest.mark.distributed

OLD_GEMM = {"dtype": "fp32", "m": 8, "n": 512, "k": 256, "groups": 1, "seconds": 1.0, "tflops": 2 * 8 * 512 * 256 / 1e12,
            "source": "measured: kept by --resume"}
OLD_COLL = {"op": "all_reduce", "scope": "node", "num_nodes": 1, "ranks_per_node": 2, "bytes_per_rank": 1024,
            "seconds": 1.0, "algbw_GBps": 1.024e-6, "busbw_GBps": 1.024e-6, "source": "measured: kept by --resume"}


def _cpu_name() -> str:
    import torch

    from piper_plan.calibration.timing import device_name

    return device_name(torch.device("cpu"))


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """One quick sweep with --resume over a directory that already holds one GEMM and one collective point."""
    out = tmp_path_factory.mktemp("local-cpu")
    merge_rows(out, GEMM, [{"device": _cpu_name(), **OLD_GEMM}])
    merge_rows(out, COLLECTIVES, [OLD_COLL])
    result = CliRunner().invoke(cli, ["calibrate", "--platform", "local-cpu", "--quick", "--resume", "--out", str(out),
                                      "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)              # --json: what was written, and nothing else on stdout
    assert report["out_dir"] == str(out.resolve()) and report["skipped"]["gemm"] == 1
    assert report["skipped"]["collectives"] == 1          # before: the collective sweep's resume was not counted
    assert report["rows_written"]["gemm"] == len(gemm_points("cpu", quick=True)) - 1 and "wrote " in result.stderr
    return out


def test_quick_sweep_writes_every_point(swept):
    assert len(read_table(swept / "gemm.csv", GEMM)) == len(gemm_points("cpu", quick=True))
    assert len(read_table(swept / "attention.csv", ATTENTION)) == len(attention_points("cpu", quick=True))
    coll = read_table(swept / "collectives.csv", COLLECTIVES)
    # 5 ops x 2 groups (node: 2 ranks of node 0; switch: all 4 ranks, or the rank pair 0-2 for p2p) x 6 sizes
    assert len(coll) == 60
    assert sorted(set(zip(coll.op, coll.scope, coll.num_nodes, coll.ranks_per_node)))[:4] == [
        ("all_gather", "node", 1, 2), ("all_gather", "switch", 2, 2), ("all_reduce", "node", 1, 2), ("all_reduce", "switch", 2, 2)]
    ranks = coll.num_nodes * coll.ranks_per_node
    factor = [busbw_factor(op, n) for op, n in zip(coll.op, ranks)]
    assert (coll.algbw_GBps * factor).tolist() == pytest.approx(coll.busbw_GBps.tolist(), rel=1e-4)
    assert (coll.algbw_GBps * coll.seconds * 1e9).tolist() == pytest.approx(coll.bytes_per_rank.tolist(), rel=1e-4)


def test_resume_kept_points_already_measured(swept):
    gemm = read_table(swept / "gemm.csv", GEMM).set_index(["dtype", "m", "n", "k", "groups"])
    assert gemm.loc[("fp32", 8, 512, 256, 1), "source"] == "measured: kept by --resume"
    coll = read_table(swept / "collectives.csv", COLLECTIVES).set_index(["op", "scope", "ranks_per_node", "bytes_per_rank"])
    assert coll.loc[("all_reduce", "node", 2, 1024), "seconds"] == 1.0
    assert (coll.source.str.startswith("measured: piper calibrate")).sum() == 59


def test_metadata_and_loader(swept):
    meta = json.loads((swept / "metadata.json").read_text())
    assert meta["platform"] == "local-cpu" and meta["collectives"]["world_size"] == 4
    assert meta["collectives"]["ranks_per_node"] == 2 and meta["versions"]["torch"]
    assert meta["last_run"]["skipped"]["gemm"] == 1 and meta["device"]["memory_bytes_per_rank"] > 0
    cal = load_calibration(swept)
    flops, ext = cal.gemm_flops_per_s(64, 512, 256, "fp32")
    assert flops > 0 and not ext
    sec, ext = cal.collective_seconds("all_to_all", "switch", 4, 2**16)
    assert sec > 0 and not ext


def test_show_json_reports_ranges(swept):
    result = CliRunner().invoke(cli, ["calibrate", "show", "--platform", str(swept), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    fp32 = next(c for c in data["gemm"] if c["dtype"] == "fp32")
    assert fp32["range"]["m"] == [8, 512] and fp32["kinds"] == {"measured": fp32["rows"]}
    a2a = next(c for c in data["collectives"] if c["op"] == "all_to_all" and c["scope"] == "switch")
    assert a2a["num_ranks"] == [4] and a2a["bytes_per_rank"] == [1024, 2**20]


class _StopAfter(Reporter):
    def __init__(self, n: int):
        self.n = n

    def advance(self, task, label, done=None):
        self.n -= 1
        if self.n == 0:
            raise KeyboardInterrupt


def test_interrupted_sweep_keeps_measured_rows(tmp_path):
    opts = SweepOptions(platform="local-cpu", out_dir=tmp_path, quick=True, only=("gemm",))
    with pytest.raises(KeyboardInterrupt):
        run_calibration(opts, _StopAfter(7))
    assert len(read_table(tmp_path / "gemm.csv", GEMM)) == 7  # 5 flushed + 2 written on the way out
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    result = run_calibration(SweepOptions(platform="local-cpu", out_dir=tmp_path, quick=True, resume=True, only=("gemm",)))
    assert result.skipped["gemm"] == 7 and result.rows_written["gemm"] == len(gemm_points("cpu", quick=True)) - 7


def test_calibration_modules_import_no_torch():
    code = ("import sys, piper_plan.calibration, piper_plan.calibration.sweep, piper_plan.calibration.bench_gemm, "
            "piper_plan.calibration.bench_attention, piper_plan.calibration.bench_collectives, "
            "piper_plan.calibration.nccl_tests, piper_plan.calibration.slurm, piper_plan.calibration.report\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"


def test_call_seconds_fastest_call_ignores_the_slow_ones():
    """On a shared host noise only adds time: ``statistic="min"`` reports the fastest call (about 2 ms here),
    the median the typical one (about 20 ms)."""
    import time
    from types import SimpleNamespace

    from piper_plan.calibration.timing import call_seconds

    def fn_from(durations):
        it = iter(durations)
        return lambda: time.sleep(next(it))

    cpu = SimpleNamespace(type="cpu")
    durations = [0.02] + [0.02, 0.002, 0.02, 0.02, 0.02]  # the first call sizes the sample (one call each)
    fastest = call_seconds(fn_from(durations), cpu, 0, 5, 0.0, "min")
    typical = call_seconds(fn_from(durations), cpu, 0, 5, 0.0, "median")
    assert 0.002 <= fastest < 0.01 <= 0.02 <= typical


def test_interleaved_call_times_alternates_and_keeps_each_operations_calls():
    """Two operations compared with each other are timed in turn, the lead swapping every round (warm-up A B, then
    A B, B A, A B), so a slow spell of the host lands on both; each keeps its own calls' (start, seconds); the
    untimed ``before`` (a barrier in the all-to-all bench) runs ahead of every timed call."""
    import time
    from types import SimpleNamespace

    from piper_plan.calibration.timing import interleaved_call_times

    order: list[str] = []
    sleeps = {"a": iter([0.0, 0.002, 0.02, 0.002]), "b": iter([0.0, 0.03, 0.03, 0.004])}

    def op(name):
        def call():
            order.append(name)
            time.sleep(next(sleeps[name]))
        return call

    cpu = SimpleNamespace(type="cpu")
    times = interleaved_call_times({"a": op("a"), "b": op("b")}, cpu, 1, 3, before=lambda: order.append("|"))
    assert order == ["a", "b", "|", "a", "|", "b", "|", "b", "|", "a", "|", "a", "|", "b"]
    assert [len(times[k]) for k in "ab"] == [3, 3]
    assert 0.002 <= min(d for _, d in times["a"]) < 0.004 <= min(d for _, d in times["b"]) < 0.01
    starts = [t for t, _ in times["a"]]
    assert starts == sorted(starts)


def test_an_exchange_lasts_from_the_first_start_to_the_last_end_on_one_clock():
    """Rank 0 starts at 0 and is done at 5 ms; rank 1 starts 3 ms late (descheduled) and needs 4 ms: the call took
    7 ms, though neither rank's own span is over 5 ms. Across hosts (no shared clock) the slowest own span."""
    from piper_plan.calibration.timing import exchange_spans

    per_rank = [[(10.000, 0.005), (20.000, 0.004)], [(10.003, 0.004), (20.000, 0.006)]]
    assert exchange_spans(per_rank, shared_clock=True) == pytest.approx([0.007, 0.006])
    assert exchange_spans(per_rank, shared_clock=False) == pytest.approx([0.005, 0.006])


def _sweep_ranks(launcher_pid: int) -> list[int]:
    """The pids of the collective sweep's ranks started by ``launcher_pid`` (their parent)."""
    out = subprocess.run(["pgrep", "-P", str(launcher_pid), "-f", "piper_plan.calibration.bench_collectives"],
                         capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def _start_sweep(tmp_path):
    """`piper calibrate --only collectives` as a user starts it, and its 4 ranks once they are up."""
    import time

    proc = subprocess.Popen([str(Path(sys.executable).parent / "piper"), "calibrate", "--platform", "local-cpu", "--quick",
                             "--only", "collectives", "--out-dir", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(ranks := _sweep_ranks(proc.pid)) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(ranks) == 4, proc.communicate(timeout=60)
    return proc, ranks


def test_a_rank_that_crashes_stops_the_sweep_in_one_line_naming_its_signal(tmp_path):
    """Before, the other ranks waited for it in gloo's rendezvous or a collective (30 minutes) and so did the
    command; now it ends at once, exit 2, one line naming the rank and the signal."""
    import signal

    proc, ranks = _start_sweep(tmp_path)
    os.kill(max(ranks), signal.SIGSEGV)
    _, err = proc.communicate(timeout=60)
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, err
    assert len(lines) == 1 and "killed by SIGSEGV" in lines[0] and "1 of 4 ranks" in lines[0], err
    assert "Traceback" not in err
    assert _sweep_ranks(proc.pid) == [] and not any(_alive(pid) for pid in ranks)


def test_killing_the_command_ends_its_ranks(tmp_path):
    """A `piper calibrate` killed outright (SIGKILL: no handler runs) takes its ranks with it."""
    import signal
    import time

    proc, ranks = _start_sweep(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in ranks)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
