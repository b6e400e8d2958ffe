"""nccl-tests / rccl-tests output -> collectives.csv rows. Samples follow the formats the projects document
(nccl-tests README and PERFORMANCE.md; rccl-tests README), in their current and their older (v2.0) layouts."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from piper_plan.calibration.io import read_table
from piper_plan.calibration.nccl_tests import parse_nccl_tests
from piper_plan.calibration.schema import COLLECTIVES
from piper_plan.cli.main import cli
from piper_plan.errors import PiperError

NCCL_TESTS = """\
# nThread 1 nGpus 1 minBytes 1024 maxBytes 1048576 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid 123456 on    gpu-a01 device  0 [0x07] NVIDIA A100-SXM4-80GB
#  Rank  1 Group  0 Pid 123457 on    gpu-a02 device  0 [0x07] NVIDIA A100-SXM4-80GB
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
           0             0     float    none      -1     0.19    0.00    0.00      0     0.18    0.00    0.00    N/A
        1024            16     float    none      -1    25.61    0.04    0.02      0    24.98    0.04    0.02    N/A
     1048576         16384     float    none      -1    60.12   17.44    8.72      0    59.87   17.51    8.76    N/A
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 4.37
#
"""

RCCL_TESTS = """\
# nThread 1 nGpus 1 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
rccl-tests: Version develop:ae3e635
# Using devices
#  Rank  0 Group  0 Pid  46730 on frontier00001 device  0 [0000:c1:00] AMD Instinct MI250X
#  Rank  1 Group  0 Pid  46731 on frontier00001 device  1 [0000:c6:00] AMD Instinct MI250X
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
     8388608       2097152     float     sum      -1    140.0   59.92  104.86      0    139.5   60.13  105.23      0
   134217728      33554432     float     sum      -1   1820.4   73.73  129.03      0   1818.2   73.82  129.18      0
# Out of bounds values : 0 OK
"""

OLD_NCCL_TESTS = """\
# nThread 1 nGpus 8 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 5 iters: 20 validation: 1
#
# Using devices
#   Rank  0 Pid  40527 on  dgx1 device  0 [0x06] Tesla V100-SXM2-16GB
#
#                                                     out-of-place                       in-place
#       size         count    type   redop     time   algbw   busbw  error     time   algbw   busbw  error
#        (B)    (elements)                     (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
     4194304       1048576   float     sum    84.10   49.87   87.28  0e+00    83.94   49.97   87.44  0e+00
"""


def test_nccl_tests_current_layout():
    rows = parse_nccl_tests(NCCL_TESTS)
    assert [r.size_bytes for r in rows] == [0, 1024, 1048576]
    assert rows[2].seconds == pytest.approx(60.12e-6) and rows[2].algbw_GBps == 17.44 and rows[2].busbw_GBps == 8.72
    assert rows[2].line == 12


def test_rccl_tests_with_banner_line():
    rows = parse_nccl_tests(RCCL_TESTS)
    assert [(r.size_bytes, r.seconds, r.busbw_GBps) for r in rows] == [(8388608, pytest.approx(140.0e-6), 104.86),
                                                                        (134217728, pytest.approx(1820.4e-6), 129.03)]


def test_old_layout_without_root_column():
    (row,) = parse_nccl_tests(OLD_NCCL_TESTS)
    assert (row.size_bytes, row.seconds, row.algbw_GBps, row.wrong) == (4194304, pytest.approx(84.10e-6), 49.87, ("0e+00", "0e+00"))


@pytest.mark.parametrize("bad_line, message", [
    ("     1048576         16384     float\n", "line 10: 3 fields"),
    ("     1048576         16384     float    none      -1    abc   17.44    8.72      0\n", "line 10: not a number"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    text = "".join(NCCL_TESTS.splitlines(keepends=True)[:9]) + bad_line
    with pytest.raises(PiperError) as err:
        parse_nccl_tests(text, "a2a.log")
    assert str(err.value).startswith("a2a.log: ") and message in str(err.value)


def test_an_algbw_that_is_not_size_over_time_is_refused(tmp_path):
    """Before: algbw 9999 GB/s imported where 1 MiB / 45.10 us = 23.25 GB/s."""
    text = "".join(NCCL_TESTS.splitlines(keepends=True)[:9]) + \
        "     1048576        262144     float    none      -1    45.10  9999.0   40.69      0    44.80   23.41   40.96      0\n"
    with pytest.raises(PiperError, match=r"line 10: algbw 9999.0 GB/s is not size / time = 1048576 B / 45.10 = 23.25"):
        parse_nccl_tests(text, "a2a.log")


@pytest.mark.parametrize("op, redop", [("all_to_all", "sum"), ("all_reduce", "none")])
def test_a_log_of_another_collective_is_refused(tmp_path, op, redop):
    """Before: an all_reduce table (redop sum) was imported as --op all_to_all."""
    from piper_plan.calibration.nccl_tests import import_file

    log = tmp_path / "x.log"
    log.write_text("".join(NCCL_TESTS.splitlines(keepends=True)[:9]) +
                   f"     1048576        262144     float    {redop}      -1    45.10   23.25   40.69      0    44.80   23.41   40.96      0\n")
    with pytest.raises(PiperError, match=f"redop '{redop}', but --op {op} prints redop"):
        import_file(log, op, "node", 1, 8)


def test_no_table_is_an_error():
    with pytest.raises(PiperError, match="no nccl-tests data rows"):
        parse_nccl_tests("srun: error: something\n", "x.log")


def test_cli_import_writes_rows(tmp_path):
    log = tmp_path / "alltoall.log"
    log.write_text(NCCL_TESTS)
    out = tmp_path / "cal"
    result = CliRunner().invoke(cli, ["calibrate", "import-nccl-tests", str(log), "--op", "all_to_all", "--nodes", "2",
                                      "--ranks-per-node", "1", "--scope", "switch", "--platform", "dgx-a100",
                                      "--out-dir", str(out)])
    assert result.exit_code == 0, result.output
    frame = read_table(out / "collectives.csv", COLLECTIVES)
    assert list(frame.bytes_per_rank) == [1024, 1048576]  # the zero-byte line carries no information
    assert frame.seconds.tolist() == pytest.approx([25.61e-6, 60.12e-6])
    assert set(frame.num_nodes) == {2} and frame.source.str.startswith("imported:").all()


def test_cli_import_errors_exit_2(tmp_path):
    log = tmp_path / "bad.log"
    log.write_text(NCCL_TESTS.replace("    8.72      0", "    8.72      3"))
    args = ["calibrate", "import-nccl-tests", str(log), "--nodes", "2", "--ranks-per-node", "1", "--platform", "dgx-a100",
            "--out", str(tmp_path)]
    wrong = CliRunner().invoke(cli, args + ["--op", "all_to_all", "--scope", "switch"])
    assert wrong.exit_code == 2 and "#wrong" in wrong.output and "bad.log" in wrong.output
    scope = CliRunner().invoke(cli, args + ["--op", "all_to_all", "--scope", "rack"])
    assert scope.exit_code == 2 and "--scope 'rack'" in scope.output


def test_a_sendrecv_log_imports_as_p2p(tmp_path):
    """Before: sendrecv_perf's table (redop ``sum``: it prints the -o reduction it ignores) was refused as p2p."""
    from piper_plan.calibration.nccl_tests import import_file

    log = tmp_path / "sendrecv.log"
    log.write_text("".join(NCCL_TESTS.splitlines(keepends=True)[:9]) +
                   "     1048576        262144     float     sum      -1    30.00   34.95   34.95      0    29.90   35.07   35.07      0\n")
    (row,) = import_file(log, "p2p", "switch", 2, 1)
    assert row["bytes_per_rank"] == 1048576 and row["busbw_GBps"] == pytest.approx(34.95, rel=1e-3)


def test_a_blank_redop_of_old_sendrecv_parses():
    """Old sendrecv_perf printed an empty reduction name: the line has one field fewer than the header."""
    text = "".join(NCCL_TESTS.splitlines(keepends=True)[:9]) + \
        "     1048576        262144     float              -1    30.00   34.95   34.95      0    29.90   35.07   35.07      0\n"
    (row,) = parse_nccl_tests(text)
    assert (row.redop, row.seconds, row.algbw_GBps) == ("", pytest.approx(30e-6), 34.95)


def test_algbw_tolerance_follows_the_printed_time():
    """A time printed ``1.2e+04`` us is known to +-500 us (4%): algbw 21.74 = 256 MiB / 12,345 us is consistent."""
    text = "".join(NCCL_TESTS.splitlines(keepends=True)[:9]) + \
        "   268435456      67108864     float    none      -1  1.2e+04   21.74   21.74      0  1.2e+04   21.74   21.74      0\n"
    (row,) = parse_nccl_tests(text)
    assert row.seconds == pytest.approx(0.012)
    with pytest.raises(PiperError, match="algbw 25.00 GB/s"):
        parse_nccl_tests(text.replace("21.74   21.74      0  1.2", "25.00   21.74      0  1.2"))


def test_halo_keeps_its_redop_check_and_a_full_line_gets_no_blank(tmp_path):
    """halo_all_to_all moves data (redop none): an all_reduce log is refused as it; a line as long as the header
    whose redop reads like a number is not shifted (it is an error of its own)."""
    from piper_plan.calibration.nccl_tests import import_file

    log = tmp_path / "ar.log"
    log.write_text(RCCL_TESTS)
    with pytest.raises(PiperError, match="redop 'sum', but --op halo_all_to_all prints redop none"):
        import_file(log, "halo_all_to_all", "node", 1, 2)
    text = "".join(NCCL_TESTS.splitlines(keepends=True)[:9]) + \
        "     1048576        262144     float       7      -1    45.10   23.25   40.69      0    44.80   23.41   40.96      0\n"
    assert parse_nccl_tests(text)[0].redop == "7"


@pytest.mark.parametrize("time, algbw, needle", [("45.10", "0e+400", "algbw '0e+400' out of range"),
                                                 ("1e-300", "23.25", "time '1e-300' out of range")])
def test_extreme_printed_numbers_are_one_line(time, algbw, needle):
    """Before: algbw 0e+400 raised OverflowError in the rounding allowance; a time of 1e-300 us was accepted."""
    text = "".join(NCCL_TESTS.splitlines(keepends=True)[:9]) + \
        f"     1048576        262144     float    none      -1    {time}   {algbw}   40.69      0    44.80   23.41   40.96      0\n"
    with pytest.raises(PiperError) as err:
        parse_nccl_tests(text, "a2a.log")
    assert needle in str(err.value)


def _import(tmp_path, text: str, *extra: str, ranks_per_node="1", out=None):
    log = tmp_path / "a2a.log"
    log.write_text(text)
    return CliRunner().invoke(cli, ["calibrate", "import-nccl-tests", str(log), "--op", "all_to_all", "--nodes", "2",
                                    "--ranks-per-node", ranks_per_node, "--scope", "switch", "--platform", "dgx-a100",
                                    "--out-dir", str(tmp_path / "cal") if out is None else out, *extra])


def test_imported_bandwidths_are_size_over_time_so_a_small_message_loads_again(tmp_path):
    """nccl-tests prints 1024 B in 25.61 us as algbw 0.04 (two decimals; 0.00 below 5 MB/s), which the CSV stored
    as printed: a 0.00 row made the whole table unreadable. Rows now hold size / time and its busbw."""
    result = _import(tmp_path, NCCL_TESTS.replace("25.61    0.04    0.02", "25.61    0.00    0.00")
                     .replace("        1024            16", "          64             1"))
    assert result.exit_code == 0, result.output
    frame = read_table(tmp_path / "cal" / "collectives.csv", COLLECTIVES)
    assert frame.algbw_GBps.tolist() == pytest.approx([64 / 25.61e-6 / 1e9, 1048576 / 60.12e-6 / 1e9], rel=1e-5)
    assert frame.busbw_GBps.tolist() == pytest.approx((frame.algbw_GBps / 2).tolist(), rel=1e-5)


def test_a_log_of_another_rank_count_or_two_tables_is_refused(tmp_path):
    """busbw = algbw x (n - 1) / n for all_to_all: the sample's 8.72 / 17.44 is 2 ranks, not 2 x 4. Two tables in
    one file (two runs pasted together) were merged into one op's rows."""
    result = _import(tmp_path, NCCL_TESTS, ranks_per_node="4")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "line 11: busbw 0.02 GB/s is not algbw 0.04 x 0.875 (all_to_all at 8 ranks" in result.stderr
    second = NCCL_TESTS + "# Collective test starting: alltoall_perf\n" + "\n".join(NCCL_TESTS.splitlines()[7:9]) + \
        "\n     2097152         32768     float    none      -1   120.24   17.44    8.72      0   119.87   17.50    8.75    N/A\n"
    result = _import(tmp_path, second)
    assert result.exit_code == 2 and "line 17: a second table after line 12's; import one run per file" in result.stderr
    assert not (tmp_path / "cal").exists()


def test_size_zero_repeats_in_one_run(tmp_path):
    """nccl-tests at 8+ ranks prints several size-0 lines from -b 8 (counts below its alignment round to 0); they
    were taken for two runs pasted together, so real 8-rank alltoall logs did not import."""
    zero = "           0             0     float    none      -1     0.19    0.00    0.00      0     0.18    0.00    0.00    N/A\n"
    lines = NCCL_TESTS.splitlines(keepends=True)
    result = _import(tmp_path, "".join(lines[:10] + [zero, zero] + lines[10:]))
    assert result.exit_code == 0, result.output
    assert len(read_table(tmp_path / "cal" / "collectives.csv", COLLECTIVES)) == 2


def test_one_rank_or_a_blank_out_dir_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """--out-dir '' wrote into the platform's shipped calibration folder; one rank wrote a row estimate divided
    by zero on."""
    monkeypatch.chdir(tmp_path)
    blank = _import(tmp_path, NCCL_TESTS, out="")
    assert blank.exit_code == 2 and "error: --out-dir: '' names no directory" in blank.stderr
    log = tmp_path / "one.log"
    log.write_text(NCCL_TESTS)
    one = CliRunner().invoke(cli, ["calibrate", "import-nccl-tests", str(log), "--op", "all_to_all", "--nodes", "1",
                                   "--ranks-per-node", "1", "--scope", "node", "--platform", "dgx-a100",
                                   "--out-dir", str(tmp_path / "cal")])
    assert one.exit_code == 2 and "one rank runs no collective" in one.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a2a.log", "one.log"]


def test_a_log_of_another_device_or_run_shape_is_refused(tmp_path):
    """The log lists its ranks ('#  Rank  0 ... device  0 [0x07] NVIDIA A100-SXM4-80GB'). Before, an A100 log imported
    for frontier priced MI250X collectives with A100 times, and a 2-host log imported as one node's."""
    for platform in ("frontier", "mi300x"):
        result = _import(tmp_path, NCCL_TESTS, "--platform", platform)
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
        assert "the log's ranks ran on 'NVIDIA A100-SXM4-80GB' and platform" in result.stderr
    log = tmp_path / "one-node.log"
    log.write_text(NCCL_TESTS)
    one_node = CliRunner().invoke(cli, ["calibrate", "import-nccl-tests", str(log), "--op", "all_to_all", "--nodes", "1",
                                        "--ranks-per-node", "2", "--scope", "node", "--platform", "dgx-a100",
                                        "--out-dir", str(tmp_path / "cal")])
    assert one_node.exit_code == 2 and "the log lists 2 ranks on 2 hosts; --nodes 1 --ranks-per-node 2 say 2 on 1" \
        in one_node.stderr and "a container of its own name" in one_node.stderr
    mixed = NCCL_TESTS.replace("gpu-a02 device  0 [0x07] NVIDIA A100-SXM4-80GB", "gpu-a02 device  0 [0x07] NVIDIA H100")
    assert "ran on 2 devices" in _import(tmp_path, mixed).stderr
    assert not (tmp_path / "cal").exists()
    header = "".join(NCCL_TESTS.splitlines(keepends=True)[:6])       # the ranks listed twice: each rank counts once
    assert _import(tmp_path, header + NCCL_TESTS).exit_code == 0
    pcie = _import(tmp_path, NCCL_TESTS.replace("A100-SXM4-80GB", "A100 80GB PCIe"))   # the chip on another board
    assert pcie.exit_code == 2 and "ran on 'NVIDIA A100 80GB PCIe' and platform dgx-a100's device" in pcie.stderr
    assert _import(tmp_path, NCCL_TESTS.replace("A100-SXM4-80GB", "A100-SXM4-40GB")).exit_code == 0     # one board


def test_a_log_must_be_of_the_folders_measured_device(tmp_path):
    """The folder's metadata.json names the device its rows were measured on; a seed's (calibration/frontier) names
    the platform's, which rccl-tests prints otherwise ("AMD Instinct MI250X")."""
    import json

    from piper_plan.catalog import calibration_dir

    cal = tmp_path / "cal"
    cal.mkdir()
    (cal / "metadata.json").write_text(json.dumps({"device": {"name": "NVIDIA H100 80GB HBM3", "type": "cuda"}}))
    result = _import(tmp_path, NCCL_TESTS)
    assert result.exit_code == 2 and "metadata.json's device is 'NVIDIA H100 80GB HBM3'" in result.stderr
    seed = tmp_path / "frontier"
    seed.mkdir()
    (seed / "metadata.json").write_text((calibration_dir("frontier") / "metadata.json").read_text())
    two = "".join(line for line in RCCL_TESTS.splitlines(keepends=True) if "Rank  1" not in line)
    eight = "".join(f"#  Rank  {r} Group  0 Pid  4673{r} on frontier00001 device  {r} [0000:c1:00] AMD Instinct MI250X\n"
                    for r in range(1, 8))
    log = tmp_path / "rccl.log"
    log.write_text(two.replace("MI250X\n", "MI250X\n" + eight, 1))        # busbw 1.75 x algbw: 8 ranks
    result = CliRunner().invoke(cli, ["calibrate", "import-nccl-tests", str(log), "--op", "all_reduce", "--nodes", "1",
                                      "--ranks-per-node", "8", "--scope", "node", "--platform", "frontier",
                                      "--out-dir", str(seed)])
    assert result.exit_code == 0, result.output
