"""Calibration CSV loading (errors name file and line) and atomic merge writes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from piper_plan.calibration.io import measured_keys, merge_rows, read_table
from piper_plan.calibration.schema import ATTENTION, COLLECTIVES, GEMM
from piper_plan.errors import PiperError

HEADER = "device,dtype,m,n,k,groups,seconds,tflops,source\n"
ROW = "cpu,fp32,{m},512,256,1,{s},{t},measured: test\n"
GOOD = ROW.format(m=32, s=0.001, t=2 * 32 * 512 * 256 / 0.001 / 1e12)
"""A row whose tflops is its 2 m n k groups / seconds / 1e12."""


def _gemm(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "gemm.csv"
    path.write_text(HEADER + "".join(lines))
    return path


def _row(m=64, seconds=1e-3):
    return {"device": "cpu", "dtype": "fp32", "m": m, "n": 512, "k": 256, "groups": 1, "seconds": seconds,
            "tflops": 2 * m * 512 * 256 / seconds / 1e12, "source": "measured: test"}


def test_reads_typed_values(tmp_path):
    frame = read_table(_gemm(tmp_path, ROW.format(m=64, s=2 * 64 * 512 * 256 / 0.5e12, t=0.5)), GEMM)
    assert frame.loc[0, "m"] == 64 and frame.loc[0, "tflops"] == 0.5 and frame.loc[0, "dtype"] == "fp32"


@pytest.mark.parametrize("line, message", [
    (ROW.format(m="abc", s=0.001, t=0.5), "line 3: column m: 'abc' is not a number"),
    (ROW.format(m=64, s=-1, t=0.5), "line 3: column seconds: -1.0 out of range"),
    (ROW.format(m=6.5, s=0.001, t=0.5), "line 3: column m: '6.5' is not an integer"),
    (ROW.format(m=64, s=0.001, t=0.5).replace("fp32", "fp64"), "line 3: column dtype: 'fp64' is not one of"),
    ("cpu,fp32,64,512\n", "line 3: 4 fields, the header has 9"),
    (ROW.format(m=64, s=0.001, t="nan"), "line 3: column tflops: 'nan' is not a finite number"),
    (GOOD, "line 3: repeats the point"),
])
def test_bad_value_names_file_and_line(tmp_path, line, message):
    path = _gemm(tmp_path, GOOD, line)
    with pytest.raises(PiperError) as err:
        read_table(path, GEMM)
    assert str(err.value).startswith(str(path)) and message in str(err.value)


def test_missing_column_and_empty_source(tmp_path):
    path = tmp_path / "gemm.csv"
    path.write_text("device,dtype,m\ncpu,fp32,4\n")
    with pytest.raises(PiperError, match=r"line 1: missing columns \['n', 'k'"):
        read_table(path, GEMM)
    with pytest.raises(PiperError, match="line 2: column source: empty"):
        read_table(_gemm(tmp_path, "cpu,fp32,4,4,4,1,1,1,\n"), GEMM)


def test_merge_replaces_same_key_and_sorts(tmp_path):
    merge_rows(tmp_path, GEMM, [_row(256), _row(64)])
    merge_rows(tmp_path, GEMM, [_row(64, seconds=2e-3), _row(16)])
    frame = read_table(tmp_path / "gemm.csv", GEMM)
    assert list(frame.m) == [16, 64, 256]
    assert frame.set_index("m").loc[64, "seconds"] == pytest.approx(2e-3)
    assert measured_keys(tmp_path, GEMM) == {("cpu", "fp32", m, 512, 256, 1) for m in (16, 64, 256)}


def test_interrupted_write_keeps_the_old_file(tmp_path, monkeypatch):
    merge_rows(tmp_path, GEMM, [_row(64)])
    before = (tmp_path / "gemm.csv").read_text()

    def boom(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        merge_rows(tmp_path, GEMM, [_row(128)])
    monkeypatch.undo()
    assert (tmp_path / "gemm.csv").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemm.csv"]  # no temp file left behind


def test_collectives_busbw_may_be_zero_but_seconds_not(tmp_path):
    path = tmp_path / "collectives.csv"
    path.write_text(",".join(COLLECTIVES.column_names) + "\nall_reduce,node,1,1,1024,1e-5,0.1,0,measured: x\n"
                    "all_reduce,node,1,2,1024,0,0.1,0,measured: x\n")
    with pytest.raises(PiperError, match="line 3: column seconds: 0.0 out of range, allowed >= 1e-09"):
        read_table(path, COLLECTIVES)


def test_a_gemm_row_whose_tflops_contradicts_its_shape_and_seconds_is_refused(tmp_path):
    """Accepted before: `calibrate show` listed 1e+06 TFLOPS for a CPU row whose m, n, k and seconds give 0.017."""
    with pytest.raises(PiperError, match=r"line 3: column tflops: 999999, but 2 m n k groups / seconds / 1e12 = "
                                         r"0.0167772; allowed within 1% of it"):
        read_table(_gemm(tmp_path, GOOD, ROW.format(m=64, s=0.001, t=999999)), GEMM)
    grouped = "cpu,fp32,32,512,256,4,0.001,{t},measured: test\n"      # four GEMMs a call count four times
    assert len(read_table(_gemm(tmp_path, grouped.format(t=4 * 0.008388608 * 1.009)), GEMM)) == 1
    with pytest.raises(PiperError, match="line 2: column tflops: 0.00838861"):
        read_table(_gemm(tmp_path, grouped.format(t=0.008388608)), GEMM)


def test_an_attention_row_whose_tflops_contradicts_its_shape_and_seconds_is_refused(tmp_path):
    flops = 4 * 2 * 8 * 1024**2 * 64 * 2 * 0.5                     # b 2, h 8, s 1024, d 64; bwd x2, causal x1/2
    row = "cpu,fp32,bwd,2,1024,8,8,64,true,0.01,{t},measured: test\n"
    path = tmp_path / "attention.csv"
    path.write_text(",".join(ATTENTION.column_names) + "\n" + row.format(t=flops / 0.01 / 1e12))
    assert len(read_table(path, ATTENTION)) == 1
    path.write_text(",".join(ATTENTION.column_names) + "\n" + row.format(t=2 * flops / 0.01 / 1e12))
    with pytest.raises(PiperError, match=r"line 2: column tflops: 0.858993, but the attention FLOPs / seconds / "
                                         r"1e12 = 0.429497"):
        read_table(path, ATTENTION)


def _collectives(tmp_path: Path, *rows: str) -> Path:
    path = tmp_path / "collectives.csv"
    path.write_text(",".join(COLLECTIVES.column_names) + "\n" + "".join(rows))
    return path


@pytest.mark.parametrize("row, message", [
    # a group of one rank: estimate and plan divided by zero (busbw_factor's n = 1 ... (n - 1) / n in the curve)
    ("all_to_all,node,1,1,1048576,4.512e-05,23.24,21.79,seed: x\n",
     "line 2: num_nodes=1 x ranks_per_node=1: a collective needs 2 ranks or more"),
    # 2^32 x 2^32 ranks wrapped to 0 in int64: a division by zero again
    ("all_to_all,switch,4294967296,4294967296,1048576,0.001,1.048576,1,seed: x\n",
     "line 2: column num_nodes: 4294967296 out of range, allowed <= 100000"),
    ("all_to_all,node,1,2,1048576,0.001,999999,0,seed: x\n",
     "line 2: column algbw_GBps: 999999, but bytes_per_rank / seconds / 1e9 = 1.04858"),
    # busbw of 16 ranks (factor 15/16) on a row that says 2 (factor 1/2): the rank count is wrong
    ("all_to_all,node,1,2,1048576,0.001,1.048576,0.98304,seed: x\n",
     "line 2: column busbw_GBps: 0.98304, but algbw x all_to_all's factor at 2 ranks = 0.524288"),
])
def test_a_collectives_row_must_agree_with_itself(tmp_path, row, message):
    good = "all_to_all,node,1,2,1048576,0.001,1.048576,0.524288,seed: x\n"
    assert len(read_table(_collectives(tmp_path, good), COLLECTIVES)) == 1
    with pytest.raises(PiperError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_table(_collectives(tmp_path, row), COLLECTIVES)


def test_rows_an_older_import_wrote_with_printed_bandwidths_still_load(tmp_path):
    """Before 2026-12-03 import-nccl-tests stored nccl-tests' printed two-decimal bandwidths: 1 KiB in 147.1 us at 16
    ranks printed algbw 0.01 (0.00696 exact). Such a row loads; the same figures measured by piper do not."""
    row = "all_reduce,node,1,16,1024,0.0001471,0.01,0.02,{source}\n"
    assert len(read_table(_collectives(tmp_path, row.format(source="imported: old.log")), COLLECTIVES)) == 1
    with pytest.raises(PiperError, match=r"line 2: column algbw_GBps: 0.01, but bytes_per_rank / seconds / 1e9 = "
                                         r"0.00696125; allowed within 1% of it$"):
        read_table(_collectives(tmp_path, row.format(source="measured: x")), COLLECTIVES)
    with pytest.raises(PiperError, match="and the printed rounding; or import the log again"):
        read_table(_collectives(tmp_path, row.replace("0.01,0.02", "0.05,0.09").format(source="imported: x")),
                   COLLECTIVES)


def test_a_merge_past_the_row_limit_or_of_a_bad_row_writes_nothing(tmp_path, monkeypatch):
    """Before: import-nccl-tests merged 12,000 rows into a table every later read refused, and wrote a one-rank
    row the next estimate divided by zero on."""
    import piper_plan.calibration.io as cal_io

    merge_rows(tmp_path, GEMM, [_row(64)])
    before = (tmp_path / "gemm.csv").read_text()
    monkeypatch.setattr(cal_io, "MAX_ROWS", 2)
    with pytest.raises(PiperError, match="adding 2 rows would make 3; a calibration table holds at most 2"):
        merge_rows(tmp_path, GEMM, [_row(16), _row(32)])
    assert (tmp_path / "gemm.csv").read_text() == before
    one_rank = {"op": "all_to_all", "scope": "node", "num_nodes": 1, "ranks_per_node": 1, "bytes_per_rank": 1024,
                "seconds": 1e-5, "algbw_GBps": 0.1024, "busbw_GBps": 0.0, "source": "measured: x"}
    with pytest.raises(PiperError, match=r"collectives.csv \(the rows to add\): line 2: .* needs 2 ranks or more"):
        merge_rows(tmp_path, COLLECTIVES, [one_rank])
    assert not (tmp_path / "collectives.csv").exists()


def test_a_column_twice_or_two_devices_in_one_file_is_one_line(tmp_path):
    """Before: a repeated column was read from its first copy, and the rows of two devices were averaged into one
    curve (a folder's rates are one machine's: `piper calibrate` refuses to mix them when it writes)."""
    path = tmp_path / "gemm.csv"
    path.write_text(HEADER.rstrip("\n") + ",seconds\n" + GOOD.rstrip("\n") + ",999\n")
    with pytest.raises(PiperError, match="line 1: column 'seconds' twice"):
        read_table(path, GEMM)
    other = GOOD.replace("cpu,", "Other CPU,", 1)
    with pytest.raises(PiperError, match=r"holds rows of 2 devices \('Other CPU', 'cpu'\)"):
        read_table(_gemm(tmp_path, GOOD, other), GEMM)


def test_a_measurement_replaces_another_devices_seed_rows_and_never_mixes_measured_ones(tmp_path):
    """Before: measured rows merged beside the seed rows of calibration/frontier (named "AMD Instinct MI250X GCD", as
    the platform file names it; torch names the device otherwise), and the file written was one its reader refuses
    (two devices). Now the seed's rows go; another machine's measured rows are refused, nothing written."""
    seed = {**_row(16), "device": "AMD Instinct MI250X GCD", "source": "seed: a citation"}
    merge_rows(tmp_path, GEMM, [seed, {**seed, "m": 32, "tflops": seed["tflops"] * 2}])
    merge_rows(tmp_path, GEMM, [{**_row(64), "device": "AMD Instinct MI250X/MI250"}])
    frame = read_table(tmp_path / "gemm.csv", GEMM)
    assert list(frame.device) == ["AMD Instinct MI250X/MI250"] and list(frame.m) == [64]
    before = (tmp_path / "gemm.csv").read_text()
    with pytest.raises(PiperError, match="holds rows of 'AMD Instinct MI250X/MI250' and the new rows are of 'cpu'"):
        merge_rows(tmp_path, GEMM, [_row(128)])
    assert (tmp_path / "gemm.csv").read_text() == before
    other = tmp_path / "other"                  # another chip's seed is not what this measurement replaces
    merge_rows(other, GEMM, [seed])
    with pytest.raises(PiperError, match="holds rows of 'AMD Instinct MI250X GCD' and the new rows are of 'NVIDIA"):
        merge_rows(other, GEMM, [{**_row(64), "device": "NVIDIA A100-SXM4-80GB"}])


def test_the_shipped_frontier_seed_takes_a_measurement_of_its_device():
    """Before: calibration/frontier/metadata.json's device was a string, so `piper calibrate --platform frontier`
    (docs/frontier.md's first job) stopped on 'device: expected a mapping' before measuring."""
    from piper_plan.calibration.sweep import check_same_device
    from piper_plan.catalog import calibration_dir

    check_same_device(calibration_dir("frontier"), "AMD Instinct MI250X/MI250")
    with pytest.raises(PiperError, match="holds seed rows of 'AMD Instinct MI250X GCD' and this machine's device is "
                                         "'NVIDIA A100-SXM4-80GB'"):
        check_same_device(calibration_dir("frontier"), "NVIDIA A100-SXM4-80GB")
