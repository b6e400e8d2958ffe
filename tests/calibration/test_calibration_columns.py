"""The cost model reads calibration CSVs as numpy columns (io.read_columns, curves.Rows), without pandas: the
same values, lookups and reports as the pandas tables, and pricing plans never imports pandas."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd

from piper_plan.calibration import Calibration, load_calibration
from piper_plan.calibration.curves import _distinct_rows
from piper_plan.calibration.io import read_columns, read_table
from piper_plan.calibration.schema import ATTENTION, COLLECTIVES, GEMM
from piper_plan.catalog import calibration_dir

TABLES = (GEMM, ATTENTION, COLLECTIVES)


def test_distinct_rows_equal_a_pandas_groupby():
    """First-appearance order and codes, as the hash groupby the interpolator used before."""
    rng = np.random.default_rng(0)
    rows = rng.integers(1, 6, (5000, 4)).astype(float) * np.array([1.0, 2.5, 1e3, 7.0])
    distinct, codes = _distinct_rows(rows)
    want_codes = pd.DataFrame(rows).groupby(list(range(4)), sort=False).ngroup().to_numpy()
    _, first = np.unique(want_codes, return_index=True)
    assert np.array_equal(codes, want_codes)
    assert np.array_equal(distinct, rows[first])


def test_columns_hold_what_read_table_holds():
    directory = calibration_dir("netemu")
    for table in TABLES:
        columns = read_columns(directory / table.filename, table)
        frame = read_table(directory / table.filename, table)
        assert list(columns) == table.column_names
        assert {k: list(frame[k]) for k in frame} == columns


def test_calibration_from_frames_answers_as_from_columns():
    """The DataFrames a caller may pass and the columns load_calibration reads give the same lookups, sources and
    frames back."""
    directory = calibration_dir("netemu")
    loaded = load_calibration("netemu")
    frames = [read_table(directory / t.filename, t) for t in TABLES]
    from_frames = Calibration(directory, *frames)
    assert from_frames.sources == loaded.sources
    for table, frame in zip(TABLES, frames):
        pd.testing.assert_frame_equal(getattr(loaded, table.name), frame)
    rng = np.random.default_rng(1)
    m, n, k = (rng.integers(1, 8192, 300) for _ in range(3))
    seq = 2 ** rng.integers(6, 13, 50)
    op, scope = sorted(set(zip(frames[2]["op"], frames[2]["scope"])))[0]
    answers = [(cal.gemm_flops_per_s(m, n, k, "fp32"), cal.attention_flops_per_s(seq, 8, 64, True, "fwd", "fp32"),
                cal.collective_seconds(op, scope, np.full(40, 4), 2.0 ** np.arange(40)))
               for cal in (loaded, from_frames)]
    for got, want in zip(*answers):
        assert all(np.array_equal(x, y) for x, y in zip(got, want))


def test_pricing_a_calibrated_platform_imports_no_pandas():
    code = ("import sys, json\n"
            "from piper_plan.cli.common import platform_calibration\n"
            "from piper_plan.catalog import load_model, load_platform\n"
            "from piper_plan.search.engine import search\n"
            "from piper_plan.specs import TrainingSpec\n"
            "r = search(load_model('mixtral-8x7b'), load_platform('frontier'), TrainingSpec(), 8, "
            "calibration=platform_calibration('frontier'))\n"
            "print(json.dumps([r.feasible, 'pandas' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    feasible, pandas_loaded = json.loads(out.strip().splitlines()[-1])
    assert feasible > 0 and not pandas_loaded
