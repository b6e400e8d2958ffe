"""Parse nccl-tests / rccl-tests text output into collectives.csv rows.

The table both print (nccl-tests README and PERFORMANCE.md; rccl-tests is a fork with the same format):

    #                                                              out-of-place                       in-place
    #       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
    #        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
         1048576        262144     float     sum      -1    45.12   23.24   43.57      0    44.90   23.35   43.79      0

Older releases have no ``root`` column and call ``#wrong`` ``error`` (printed as ``0e+00``); with ``-c 0`` the
check column reads ``N/A``. Columns are found by the header names, so either layout parses. ``size`` is the
per-rank byte count nccl-tests defines for each op (all_to_all: the whole send buffer; all_gather: the
gathered output) -- exactly the ``bytes_per_rank`` of collectives.csv. Out-of-place numbers are used; both
result checks (out-of-place and in-place ``#wrong``) must be 0. A size must be a whole number of bytes, times and
bandwidths finite; a size above 0 printed twice (two runs pasted together) is refused, and so is a second table.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from piper_plan.calibration.io import same_device_name
from piper_plan.calibration.schema import (MAX_MEASURED, MIN_MEASURED, OPS, SCOPES, busbw_factor,
                                           collective_bandwidths_GBps, scope_problem)
from piper_plan.errors import PiperError
from piper_plan.fileio import python_only_number

_TIME_UNITS = {"(us)": 1e-6, "(ms)": 1e-3, "(s)": 1.0}
_REQUIRED = ("time", "algbw", "busbw")
_CHECK_COLUMNS = ("#wrong", "error")
_OK_CHECKS = ("", "0", "0e+00", "N/A")
ALGBW_TOLERANCE = 0.01
"""algbw may differ from size / time by 1% beyond the rounding of the printed time and algbw (half their last digit:
``45.12`` us is +-0.005 us, ``1.2e+04`` us +-500 us)."""
REDUCING_OPS = ("all_reduce", "reduce_scatter")
"""The ops whose table prints a reduction (redop, ``sum`` ...)."""
MOVING_OPS = ("all_to_all", "halo_all_to_all", "all_gather")
"""The ops whose table prints redop ``none``. sendrecv_perf (--op p2p) prints the ``-o`` reduction it ignores (``sum``
by default), so p2p accepts any redop."""
_NUMERIC_START = re.compile(r"[-+]?(?:\d|\.\d)")
"""A line whose first token starts like a number is a data line (banners start with a word)."""
_RANK_LINE = re.compile(r"#\s*Rank\s+(\d+)\b.*?\bon\s+(\S+)\s+device\s+\d+\s+\[[^\]]*\]\s+(\S.*?)\s*$")
"""A rank the log lists under ``# Using devices``: its host and device name (``#  Rank  0 Group  0 Pid 123 on gpu-a01
device  0 [0x07] NVIDIA A100-SXM4-80GB``; v2.0 has no Group)."""


@dataclass(frozen=True)
class NcclTestsRow:
    """One data line: out-of-place time and bandwidths (SI seconds, GB/s as printed)."""

    line: int
    size_bytes: int
    seconds: float
    algbw_GBps: float
    busbw_GBps: float
    wrong: tuple[str, ...]
    """Every result-check column of the line (out-of-place and in-place)."""
    redop: str | None = None
    """The reduction printed (``sum``, ... ; ``none`` for the ops that move data without reducing); None where the
    table has no redop column."""
    bw_rounding: tuple[float, float] = (0.0, 0.0)
    """Half the last printed digit of algbw and of busbw (GB/s): how far each may be from its exact value."""


def parse_nccl_tests(text: str, path: str = "<text>") -> list[NcclTestsRow]:
    """All data rows of an nccl-tests / rccl-tests log; a malformed data line is an error naming the line."""
    columns, unit, rows = None, 1e-6, []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            if rows and stripped.lstrip("#").split()[:2] == ["size", "count"]:
                raise PiperError(f"line {number}: a second table after line {rows[-1].line}'s; import one run per "
                                 "file", path=path)
            columns, unit = _header(stripped, columns, unit, number, path)
            continue
        if not _looks_like_data(stripped):
            continue  # banners some launchers print ("nccl-tests version ...", srun notes)
        if columns is None:
            raise PiperError(f"line {number}: data before the '# size count type ...' header", path=path)
        rows.append(_row(stripped, columns, unit, number, path))
    _check_sizes_unique(rows, path)
    if not rows:
        raise PiperError("no nccl-tests data rows found (expected a '# size count type ... time algbw busbw' table)", path=path)
    return rows


def _check_sizes_unique(rows: list[NcclTestsRow], path: str) -> None:
    """A size above 0 printed twice is two runs pasted together; size 0 repeats in one run (nccl-tests rounds a
    count below its alignment down to 0 for each small -b size: several '0' lines at 8 ranks and more)."""
    first: dict[int, int] = {}
    for r in rows:
        if r.size_bytes == 0:
            continue
        if r.size_bytes in first:
            raise PiperError(f"line {r.line}: size {r.size_bytes} repeats line {first[r.size_bytes]}; import one run "
                             "per file", path=path)
        first[r.size_bytes] = r.line


def _header(line: str, columns: list[str] | None, unit: float, number: int, path: str) -> tuple[list[str] | None, float]:
    tokens = line.lstrip("#").split()
    if tokens[:2] == ["size", "count"]:
        missing = [c for c in _REQUIRED if c not in tokens]
        if missing:
            raise PiperError(f"line {number}: the table header has no {' / '.join(missing)} column; expected "
                             f"'# size count type ... time algbw busbw #wrong ...'", path=path)
        return [("#wrong" if t == "error" else t) for t in tokens], unit
    if tokens[:1] == ["(B)"] and columns is not None:
        units = [t for t in tokens if t in _TIME_UNITS]
        return columns, _TIME_UNITS[units[0]] if units else unit
    return columns, unit


def _looks_like_data(line: str) -> bool:
    return bool(_NUMERIC_START.match(line.split()[0]))


def _row(line: str, columns: list[str], unit: float, number: int, path: str) -> NcclTestsRow:
    tokens = line.split()
    redop_at = columns.index("redop") if "redop" in columns else None
    if redop_at is not None and redop_at < len(tokens) < len(columns) and _NUMERIC_START.match(tokens[redop_at]):
        tokens.insert(redop_at, "")  # old sendrecv_perf printed an empty redop: the field is blank
    if len(tokens) < columns.index("busbw") + 1 or len(tokens) > len(columns):
        raise PiperError(f"line {number}: {len(tokens)} fields, the header has {len(columns)}: {line!r}", path=path)
    i_time, i_alg, i_bus = columns.index("time"), columns.index("algbw"), columns.index("busbw")
    if not re.fullmatch(r"[0-9]{1,18}", tokens[0]):
        raise PiperError(f"line {number}: size {tokens[0]!r} is not allowed; allowed: a whole number of bytes >= 0",
                         path=path)
    size = int(tokens[0])
    try:
        if any(python_only_number(tokens[i]) for i in (i_time, i_alg, i_bus)):
            raise ValueError
        seconds = float(tokens[i_time]) * unit
        algbw, busbw = float(tokens[i_alg]), float(tokens[i_bus])
    except ValueError:
        raise PiperError(f"line {number}: not a number in {ascii(line)}", path=path) from None
    figures = (("time", i_time, seconds, unit), ("algbw", i_alg, algbw, 1.0), ("busbw", i_bus, busbw, 1.0))
    bad = [(name, tokens[i]) for name, i, value, scale in figures
           if not (0 <= value <= MAX_MEASURED) or (name == "time" and value < MIN_MEASURED)
           or _half_last_digit(tokens[i]) * scale > MAX_MEASURED]     # '0e+400': its rounding is the range
    if bad:
        shown = ", ".join(f"{name} {text!r}" for name, text in bad)
        raise PiperError(f"line {number}: {shown} out of range (time {MIN_MEASURED:g} to {MAX_MEASURED:g} s, bandwidths "
                         f"0..{MAX_MEASURED:g} GB/s, each printed to better than that)", path=path)
    derived = size / seconds / 1e9
    time_rounding = _half_last_digit(tokens[i_time]) * unit / seconds
    if abs(algbw - derived) > (ALGBW_TOLERANCE + time_rounding) * derived + _half_last_digit(tokens[i_alg]):
        raise PiperError(f"line {number}: algbw {tokens[i_alg]} GB/s is not size / time = {size} B / "
                         f"{tokens[i_time]} = {derived:.4g} GB/s; allowed: within {ALGBW_TOLERANCE:.0%} and the rounding "
                         "of the printed time and algbw (nccl-tests prints algbw = size / time)", path=path)
    wrong = tuple(tokens[i] if i < len(tokens) else "" for i, c in enumerate(columns) if c == "#wrong")
    redop = tokens[columns.index("redop")] if "redop" in columns else None
    return NcclTestsRow(number, size, seconds, algbw, busbw, wrong, redop,
                        (_half_last_digit(tokens[i_alg]), _half_last_digit(tokens[i_bus])))


def _half_last_digit(printed: str) -> float:
    """Half a unit of the last digit of a printed number: its rounding (``45.12`` -> 0.005, ``1.2e+04`` -> 500);
    infinite where the exponent is beyond what a Decimal holds (``0e+2000000``: refused as out of range)."""
    try:
        return float(Decimal(5).scaleb(Decimal(printed).as_tuple().exponent - 1))
    except ArithmeticError:          # decimal.Overflow, InvalidOperation
        return math.inf


def rows_to_collectives(rows: list[NcclTestsRow], op: str, scope: str, num_nodes: int, ranks_per_node: int,
                        source: str) -> list[dict]:
    """collectives.csv rows (zero-byte lines dropped: nothing to calibrate). The bandwidths are derived from size
    and time (as the CSV defines them), not the printed ones: nccl-tests prints two decimals, so a small message's
    algbw reads 0.00, a value the CSV cannot hold."""
    check_op_scope(op, scope, num_nodes)
    rows = [r for r in rows if r.size_bytes > 0]
    bandwidths = [collective_bandwidths_GBps(op, num_nodes * ranks_per_node, r.size_bytes, r.seconds) for r in rows]
    return [
        {"op": op, "scope": scope, "num_nodes": num_nodes, "ranks_per_node": ranks_per_node,
         "bytes_per_rank": r.size_bytes, "seconds": r.seconds, "algbw_GBps": algbw, "busbw_GBps": busbw,
         "source": source}
        for r, (algbw, busbw) in zip(rows, bandwidths)
    ]


def check_busbw(rows: list[NcclTestsRow], op: str, ranks: int, path: str) -> None:
    """busbw = algbw x the op's factor at the run's rank count (nccl-tests PERFORMANCE.md): a busbw of another
    factor is a log of another op or rank count than --op / --nodes x --ranks-per-node say."""
    factor = busbw_factor(op, ranks)
    for r in rows:
        expected = r.algbw_GBps * factor
        if abs(r.busbw_GBps - expected) > ALGBW_TOLERANCE * expected + r.bw_rounding[1] + factor * r.bw_rounding[0]:
            raise PiperError(f"line {r.line}: busbw {r.busbw_GBps:g} GB/s is not algbw {r.algbw_GBps:g} x {factor:.4g} "
                             f"({op} at {ranks} ranks: nccl-tests PERFORMANCE.md); the log is of another op or rank "
                             "count than --op, --nodes and --ranks-per-node say", path=path)


def check_op_scope(op: str, scope: str, num_nodes: int | None = None) -> None:
    if op not in OPS:
        raise PiperError(f"--op {op!r} is not one of {list(OPS)}")
    if scope not in SCOPES:
        raise PiperError(f"--scope {scope!r} is not one of {list(SCOPES)}")
    problem = None if num_nodes is None else scope_problem(scope, num_nodes)
    if problem:
        raise PiperError(f"--scope {scope} --nodes {num_nodes}: {problem}")


def import_file(path: str | Path, op: str, scope: str, num_nodes: int, ranks_per_node: int,
                devices: dict[str, str] | None = None) -> list[dict]:
    """Parse one nccl-tests / rccl-tests log file into collectives.csv rows; ``devices`` (where -> device name) are
    the names the log's device must match (check_log_ranks)."""
    from piper_plan.fileio import read_text

    check_op_scope(op, scope, num_nodes)
    if num_nodes * ranks_per_node < 2:
        raise PiperError(f"--nodes {num_nodes} --ranks-per-node {ranks_per_node}: one rank runs no collective; "
                         "allowed: 2 ranks or more")
    path = Path(path)
    text = read_text(path)
    rows = parse_nccl_tests(text, str(path))
    wrong = [r.line for r in rows if any(w not in _OK_CHECKS for w in r.wrong)]
    if wrong:
        raise PiperError(f"lines {wrong[:5]}: nccl-tests reports wrong results (#wrong != 0); not importing", path=str(path))
    check_redop(rows, op, str(path))
    check_busbw(rows, op, num_nodes * ranks_per_node, str(path))
    check_log_ranks(log_ranks(text), num_nodes, ranks_per_node, devices or {}, str(path))
    if not any(r.size_bytes > 0 for r in rows):
        raise PiperError("every data row has size 0: nothing to calibrate; allowed: a log with sizes above 0 bytes "
                         "(nccl-tests -b / -e)", path=str(path))
    source = f"imported: nccl-tests output {path.name} ({op}, {num_nodes} nodes x {ranks_per_node} ranks, out-of-place)"
    return rows_to_collectives(rows, op, scope, num_nodes, ranks_per_node, source)


def log_ranks(text: str) -> list[tuple[str, str]]:
    """(host, device name) of each rank the log lists, once per rank number (a log that prints its header twice
    lists them twice); none where it lists none: a table pasted alone."""
    found = {}
    for m in map(_RANK_LINE.match, (line.strip() for line in text.splitlines())):
        if m:
            found.setdefault(int(m.group(1)), (m.group(2), m.group(3)))
    return [found[r] for r in sorted(found)]


def check_log_ranks(ranks: list[tuple[str, str]], num_nodes: int, ranks_per_node: int, devices: dict[str, str],
                    path: str) -> None:
    """Where the log lists its ranks: --nodes x --ranks-per-node of them on --nodes hosts (a 2-node log is not one
    node's: its scope would be wrong), all of one device, and that device the one each of ``devices`` names (the
    platform's, the folder's). Before, an A100 run's log imported for frontier priced MI250X collectives with A100
    times."""
    if not ranks:
        return
    hosts, names = {host for host, _ in ranks}, sorted({name for _, name in ranks})
    if len(ranks) != num_nodes * ranks_per_node or len(hosts) != num_nodes:
        more = (" (where each rank ran in a container of its own name, put the node's name in its 'Rank' line)"
                if len(hosts) > num_nodes else "")
        raise PiperError(f"the log lists {len(ranks)} ranks on {len(hosts)} hosts; --nodes {num_nodes} "
                         f"--ranks-per-node {ranks_per_node} say {num_nodes * ranks_per_node} on {num_nodes}: the "
                         f"log is of another run than they say{more}", path=path)
    if len(names) > 1:
        raise PiperError(f"the log's ranks ran on {len(names)} devices ({', '.join(map(repr, names))}); a calibration "
                         "is one machine's: import a run on one kind of device", path=path)
    for where, expected in devices.items():
        if expected and not same_device_name(names[0], expected):
            raise PiperError(f"the log's ranks ran on {names[0]!r} and {where} is {expected!r}: its times are another "
                             "machine's; import it for a platform of that device (--platform)", path=path)


def check_redop(rows: list[NcclTestsRow], op: str, path: str) -> None:
    """The table's reduction must be the op's: a reduction for all_reduce / reduce_scatter, ``none`` (or blank) for
    the ops that move data (an all_reduce log imported as all_to_all is refused); p2p takes any."""
    if op not in REDUCING_OPS + MOVING_OPS:
        return
    reducing = op in REDUCING_OPS
    bad = [r for r in rows if r.redop is not None and (r.redop in ("none", "")) == reducing]
    if bad:
        wanted = "a reduction (sum, ...)" if reducing else "none"
        raise PiperError(f"line {bad[0].line}: redop {bad[0].redop!r}, but --op {op} prints redop {wanted}: the log is "
                         "of another collective", path=path)
