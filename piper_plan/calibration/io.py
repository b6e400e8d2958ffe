"""Read and write calibration CSVs: validation that names the file and line, atomic merge writes.

A bad value is a PiperError "calibration/x/gemm.csv: line 7: column tflops: 'abc' is not a number".
Line numbers count the header as line 1, as an editor shows them. Writes go through
``piper_plan.fileio.atomic_write_text``: a reader (or an interrupted sweep) sees the old file or the new one.
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from piper_plan.calibration.schema import Column, Table
from piper_plan.errors import PiperError
from piper_plan.fileio import atomic_write_json, atomic_write_text, python_only_number

if TYPE_CHECKING:
    import pandas as pd

MAX_ROWS = 10_000
"""Most data rows in one calibration CSV (a full sweep writes a few thousand; the GEMM curve triangulates its
points in 4-D, which takes seconds at this size and minutes at 100,000 scattered rows)."""
_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}


def read_table(path: str | Path, table: Table, drop_keys: set[tuple] = frozenset()) -> pd.DataFrame:
    """Load and validate one calibration CSV; an empty file (header only) gives an empty frame.

    Rows whose key is in ``drop_keys`` are left out before they are checked (a merge that replaces them: a
    re-import repairs a row an older piper wrote badly)."""
    import pandas as pd

    return pd.DataFrame(read_columns(path, table, drop_keys), columns=table.column_names)


def read_columns(path: str | Path, table: Table, drop_keys: set[tuple] = frozenset()) -> dict[str, list]:
    """``read_table`` without pandas: the validated values of each column (what the cost model reads)."""
    path = Path(path)
    from piper_plan.fileio import read_text

    return _validated_columns(path, table, *_parse_raw(read_text(path), path), drop_keys)


def _validated_columns(path: Path, table: Table, header: list[str], raw: list[list[str]],
                       drop_keys: set[tuple] = frozenset()) -> dict[str, list]:
    """The checked values of each column of parsed CSV rows; ``path`` names them in errors."""
    missing = [c for c in table.column_names if c not in header]
    if missing:
        raise PiperError(f"line 1: missing columns {missing}; a {table.filename} has {table.column_names}", path=str(path))
    twice = sorted({c for c in header if header.count(c) > 1})
    if twice:
        raise PiperError(f"line 1: column {', '.join(map(repr, twice))} twice (which one holds the values?); a "
                         f"{table.filename} has each of {table.column_names} once", path=str(path))
    at = {name: header.index(name) for name in table.column_names}
    lines = [i + 2 for i in range(len(raw))]
    if drop_keys:
        kept = [(line, r) for line, r in zip(lines, raw)
                if tuple(_key_text(r[at[k]]) for k in table.key) not in drop_keys]
        lines, raw = [line for line, _ in kept], [r for _, r in kept]
    out = {c.name: [_convert(path, line, c, r[at[c.name]]) for line, r in zip(lines, raw)] for c in table.columns}
    if table.row_check is not None:
        for i, line in enumerate(lines):
            problem = table.row_check({name: values[i] for name, values in out.items()})
            if problem:
                raise PiperError(f"line {line}: {problem}", path=str(path))
    _check_unique(path, out, table, lines)
    devices = sorted(set(out.get("device", ())))
    if len(devices) > 1:
        raise PiperError(f"holds rows of {len(devices)} devices ({', '.join(map(repr, devices[:3]))}); a calibration "
                         "folder is one machine's (the curves would mix their rates): measure each into a folder of "
                         "its own", path=str(path))
    return out


def _key_text(value) -> str:
    """A key value as the CSV writes it (so that a replaced row is recognised before it is parsed)."""
    text = str(value).strip()
    try:
        number = float(text)
        return str(int(number)) if number.is_integer() else text
    except ValueError:
        return text.lower() if text.lower() in _TRUE | _FALSE else text


def _parse_raw(text: str, path: Path) -> tuple[list[str], list[list[str]]]:
    """(header, data rows) of a CSV's text, fields stripped; blank lines skipped."""
    reader = csv.reader(io.StringIO(text))
    try:
        rows = list(reader)
    except csv.Error as exc:   # a lone carriage return in a field, a field over csv's size limit
        raise PiperError(f"line {reader.line_num}: not a CSV row ({exc})", path=str(path)) from None
    rows = [r for r in rows if r]  # blank lines
    if not rows:
        raise PiperError("line 1: empty file, expected a header row", path=str(path))
    if len(rows) - 1 > MAX_ROWS:
        raise PiperError(f"{len(rows) - 1:,} rows; a calibration table holds at most {MAX_ROWS:,} (interpolating "
                         "among more is too slow to plan with)", path=str(path))
    header = [h.strip() for h in rows[0]]
    for line, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise PiperError(f"line {line}: {len(row)} fields, the header has {len(header)}", path=str(path))
    return header, [[v.strip() for v in r] for r in rows[1:]]


def _convert(path: Path, line: int, col: Column, value: str):
    where = f"line {line}: column {col.name}"
    if col.kind == "str":
        if col.choices is not None and value not in col.choices:
            raise PiperError(f"{where}: {value!r} is not one of {list(col.choices)}", path=str(path))
        if col.name == "source" and not value:
            raise PiperError(f"{where}: empty; every row names what measured it or its citation", path=str(path))
        return value
    if col.kind == "bool":
        low = value.lower()
        if low not in _TRUE | _FALSE:
            raise PiperError(f"{where}: {value!r} is not a boolean (true/false)", path=str(path))
        return low in _TRUE
    number = _parse_number(path, where, col, value)
    _check_range(path, where, col, number)
    return number


def _parse_number(path: Path, where: str, col: Column, value: str):
    try:
        if python_only_number(value):
            raise ValueError
        number = float(value)
    except ValueError:
        raise PiperError(f"{where}: {ascii(value)} is not a number", path=str(path)) from None
    if number != number or number in (float("inf"), float("-inf")):
        raise PiperError(f"{where}: {value!r} is not a finite number", path=str(path))
    if col.kind == "int":
        if number != int(number):
            raise PiperError(f"{where}: {value!r} is not an integer", path=str(path))
        return int(number)
    return number


def _check_range(path: Path, where: str, col: Column, number: float) -> None:
    if col.max_value is not None and number > col.max_value:
        raise PiperError(f"{where}: {number!r} out of range, allowed <= {col.max_value:g}", path=str(path))
    if col.min_value is None:
        return
    ok = number >= col.min_value if col.min_inclusive else number > col.min_value
    if not ok:
        bound = ">=" if col.min_inclusive else ">"
        raise PiperError(f"{where}: {number!r} out of range, allowed {bound} {col.min_value:g}", path=str(path))


def _check_unique(path: Path, columns: dict[str, list], table: Table, lines: list[int]) -> None:
    seen = set()
    for line, key in zip(lines, zip(*(columns[k] for k in table.key))):
        if key in seen:
            raise PiperError(f"line {line}: repeats the point {list(table.key)} of an earlier row", path=str(path))
        seen.add(key)


def table_path(directory: str | Path, table: Table) -> Path:
    return Path(directory) / table.filename


def present(path: Path) -> bool:
    """Whether a calibration file is there to read: anything at ``path``, a symbolic link to nothing or a link loop
    included (its read then says so in one line; before, such a link read as an absent file and the plan was priced
    without it, e.g. without overhead.csv's host time, without a word)."""
    return path.is_symlink() or path.exists()


def read_if_present(directory: str | Path, table: Table) -> pd.DataFrame | None:
    """The validated table of ``directory``, or None if its file does not exist (a directory in its place is an
    error, not an absent file)."""
    path = table_path(directory, table)
    return read_table(path, table) if present(path) else None


def columns_if_present(directory: str | Path, table: Table) -> dict[str, list] | None:
    """``read_if_present`` without pandas (read_columns)."""
    path = table_path(directory, table)
    return read_columns(path, table) if present(path) else None


def render_csv(frame: pd.DataFrame, table: Table) -> str:
    """CSV text of ``frame`` in the table's column order; floats with 6 significant digits, bools lower case."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(table.column_names)
    for row in frame[table.column_names].itertuples(index=False):
        writer.writerow([_fmt(v) for v in row])
    return buf.getvalue()


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def merge_rows(directory: str | Path, table: Table, rows: Iterable[dict]) -> Path:
    """Add ``rows`` to ``directory/<table>.csv`` (a new row replaces an old one at the same key), atomically."""
    import pandas as pd

    path = table_path(directory, table)
    new = pd.DataFrame(list(rows), columns=table.column_names)
    text = render_csv(new, table)           # the new rows pass the reader's checks, or nothing is written
    _validated_columns(Path(f"{path} (the rows to add)"), table, *_parse_raw(text, path))
    replaced = {tuple(_key_text(v) for v in key) for key in new[list(table.key)].itertuples(index=False, name=None)}
    old = read_table(path, table, drop_keys=replaced) if present(path) else None
    if old is not None and "device" in table.column_names:
        old = _same_device_rows(old, new, path)
    frame = new if old is None or old.empty else pd.concat([old, new], ignore_index=True)
    frame = frame.drop_duplicates(list(table.key), keep="last").sort_values(list(table.key), kind="stable")
    if len(frame) > MAX_ROWS:
        raise PiperError(f"adding {len(new):,} rows would make {len(frame):,}; a calibration table holds at most "
                         f"{MAX_ROWS:,} (nothing written)", path=str(path))
    return atomic_write_text(path, render_csv(frame, table))


def _same_device_rows(old, new, path: Path):
    """The old rows of the new rows' device. Seed rows of the same chip under another name are dropped (a measurement
    replaces the seed: calibration/frontier names its device as the platform file does, torch as the driver does);
    any other device's rows are an error, nothing written (before, the file was written and then refused when
    read)."""
    devices = set(new["device"])
    others = old[~old["device"].isin(devices)]
    if others.empty:
        return old
    seed = others["source"].astype(str).str.startswith("seed:").all()
    if seed and all(same_device_name(o, d) for o in set(others["device"]) for d in devices):
        return old[old["device"].isin(devices)]
    raise PiperError(f"holds rows of {others['device'].iloc[0]!r} and the new rows are of "
                     f"{sorted(devices)[0]!r}; a calibration folder is one machine's (the curves would mix their "
                     "rates): measure into a folder of its own (nothing written)", path=str(path))


FORM_FACTORS = ("pcie", "sxm", "nvl", "oam")
"""How a GPU is attached, as vendors' names say it: the same chip on PCIe and on SXM / NVL / OAM boards has other
links between its devices."""


def same_device_name(a: str, b: str) -> bool:
    """Whether two names are one device's as different tools print them: the chip (the first word with a digit)
    equal, case apart, with '/', '-' and spaces between words, and the form factor where both names give one.
    platforms/frontier.yaml's "AMD Instinct MI250X GCD", rccl-tests' "AMD Instinct MI250X" and HIP's "AMD Instinct
    MI250X/MI250" are one; so are platforms/dgx-h100.yaml's "NVIDIA H100 SXM5 80GB" and nccl-tests' "NVIDIA H100 80GB
    HBM3"; "NVIDIA H100 PCIe" is not the SXM5 board, and "NVIDIA A100 80GB PCIe" not "NVIDIA H100 80GB HBM3". Names
    without such a word must have the same words."""
    words_a, words_b = ([w for w in re.split(r"[\s/-]+", name.lower()) if w] for name in (a, b))
    chip_a, chip_b = (next((w for w in words if any(c.isdigit() for c in w)), None) for words in (words_a, words_b))
    if chip_a is None or chip_b is None:
        return set(words_a) == set(words_b)
    form_a, form_b = (next((f for w in words for f in FORM_FACTORS if w.startswith(f)), None)
                      for words in (words_a, words_b))
    return chip_a == chip_b and (form_a is None or form_b is None or form_a == form_b)


def measured_keys(directory: str | Path, table: Table) -> set[tuple]:
    """Keys of the points already in ``directory`` (for --resume)."""
    frame = read_if_present(directory, table)
    if frame is None:
        return set()
    return set(frame[list(table.key)].itertuples(index=False, name=None))


def read_metadata(directory: str | Path) -> dict:
    """metadata.json of a calibration folder ({} when absent); a malformed one is an error naming it."""
    from piper_plan.fileio import read_document

    path = Path(directory) / "metadata.json"
    return read_document(path) if present(path) else {}


def recorded_device(metadata: dict, directory: str | Path) -> dict:
    """The device section of ``metadata`` (``directory``'s metadata.json: name, type, a CPU's isa_flags, ...): {}
    when there is none; anything but a mapping there is an error naming the file."""
    device = metadata.get("device")
    if device is None:
        return {}
    if not isinstance(device, dict):
        raise PiperError(f"expected a mapping (name, type, ...) as piper calibrate writes it, found "
                         f"{type(device).__name__}", path=str(Path(directory) / "metadata.json"), field="device")
    return device


def write_metadata(directory: str | Path, metadata: dict) -> Path:
    """metadata.json, merged into any existing one (a later sweep adds its section), atomically."""
    path = Path(directory) / "metadata.json"
    old = read_metadata(directory)
    old.update(metadata)
    return atomic_write_json(path, old)
