"""Log-space interpolation, the extrapolation flag, and the Calibration API the cost model calls."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from piper_plan.calibration import Calibration, load_calibration
from piper_plan.calibration.curves import _SMALL_QUERY, LogInterpolator
from piper_plan.calibration.io import merge_rows
from piper_plan.calibration.schema import COLLECTIVES, GEMM, busbw_factor


def gemm_row(m, n, k, tflops, groups=1, dtype="fp32"):
    seconds = 2 * m * n * k * groups / (tflops * 1e12)
    return {"device": "cpu", "dtype": dtype, "m": m, "n": n, "k": k, "groups": groups, "seconds": seconds,
            "tflops": tflops, "source": "measured: test"}


def coll_row(op, scope, nodes, per_node, size, seconds):
    algbw = size / seconds / 1e9
    return {"op": op, "scope": scope, "num_nodes": nodes, "ranks_per_node": per_node, "bytes_per_rank": size,
            "seconds": seconds, "algbw_GBps": algbw, "busbw_GBps": algbw * busbw_factor(op, nodes * per_node),
            "source": "measured: test"}


@pytest.fixture
def cal(tmp_path) -> Calibration:
    # GEMM: TFLOPS 1 at m=10 and 100 at m=1000 (n = k = 256); a second (n, k) family at 512 with 4 and 64.
    merge_rows(tmp_path, GEMM, [gemm_row(10, 256, 256, 1.0), gemm_row(1000, 256, 256, 100.0),
                                gemm_row(10, 512, 512, 4.0), gemm_row(1000, 512, 512, 64.0)])
    # all_to_all: 4 ranks 1 KiB -> 100 us, 1 MiB -> 1000 us; 8 ranks 1 KiB -> 200 us, 1 MiB -> 4000 us.
    merge_rows(tmp_path, COLLECTIVES, [coll_row("all_to_all", "switch", 2, 2, 1024, 1e-4),
                                       coll_row("all_to_all", "switch", 2, 2, 2**20, 1e-3),
                                       coll_row("all_to_all", "switch", 2, 4, 1024, 2e-4),
                                       coll_row("all_to_all", "switch", 2, 4, 2**20, 4e-3)])
    return load_calibration(tmp_path)


def test_gemm_log_linear_between_points(cal):
    # log-linear in m: m=100 is halfway between log 10 and log 1000 -> sqrt(1 x 100) = 10 TFLOPS.
    # n = k = 2^8.5 is halfway (log) between the families 256 and 512: at m=10, sqrt(1 x 4) = 2 TFLOPS
    # (an edge of the triangulation; inside a cell the value is linear on one Delaunay simplex).
    flops, ext = cal.gemm_flops_per_s([10, 100, 1000, 10], [256, 256, 256, 2**8.5], [256, 256, 256, 2**8.5], "fp32")
    assert flops[:3] == pytest.approx([1e12, 10e12, 100e12], rel=1e-9)
    assert flops[3] == pytest.approx(2e12, rel=1e-6)
    assert not ext.any()


def test_gemm_extrapolation_is_flagged_and_clamped(cal):
    flops, ext = cal.gemm_flops_per_s(np.array([1, 5000, 100]), 256, 256, "fp32", groups=np.array([1, 1, 4]))
    assert ext.tolist() == [True, True, True]  # below m, above m, groups never measured
    assert flops[0] == pytest.approx(1e12) and flops[1] == pytest.approx(100e12)


def test_gemm_broadcasts_shapes(cal):
    flops, ext = cal.gemm_flops_per_s(np.array([[10], [1000]]), np.array([256, 512]), 256, "fp32")
    assert flops.shape == ext.shape == (2, 2)


def test_missing_dtype_falls_back_with_a_note(cal):
    flops, ext = cal.gemm_flops_per_s(100, 256, 256, "bf16")
    assert ext.all() and flops == pytest.approx(10e12)
    assert any("bf16" in n for n in cal.notes)


def test_collectives_interpolate_in_bytes_and_ranks(cal):
    sec, ext = cal.collective_seconds("all_to_all", "switch", [4, 4, 8, 6], [2**15, 2**20, 2**15, 1024])
    # 4 ranks: 32 KiB is halfway (log) between 1 KiB and 1 MiB -> sqrt(100 us x 1000 us) = 316 us.
    assert sec[0] == pytest.approx(np.sqrt(1e-4 * 1e-3)) and sec[1] == pytest.approx(1e-3)
    assert sec[2] == pytest.approx(np.sqrt(2e-4 * 4e-3))
    # 6 ranks between 4 and 8: log-linear in ranks at 1 KiB: 100 us^(1-t) x 200 us^t, t = log(1.5)/log(2)
    t = np.log(6 / 4) / np.log(2)
    assert sec[3] == pytest.approx(1e-4 ** (1 - t) * 2e-4**t)
    assert not ext.any()


def test_collectives_extrapolation(cal):
    sec, ext = cal.collective_seconds("all_to_all", "switch", [4, 4, 16, 1, 4], [2**22, 100, 2**20, 2**20, 0])
    assert sec[0] == pytest.approx(4e-3)  # 4x the largest size at the last bandwidth
    assert sec[1] == pytest.approx(1e-4)  # latency floor below the smallest size
    assert sec[2] == pytest.approx(4e-3 * (15 / 16) / (7 / 8))  # busbw kept from 8 ranks
    assert sec[3] == 0 and sec[4] == 0  # one rank, or nothing to send
    assert ext.tolist() == [True, True, True, False, False]
    assert cal.has_collective("all_to_all", "switch") and not cal.has_collective("all_reduce", "switch")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=2**30), min_size=2, max_size=20), st.integers(2, 64))
def test_collective_time_monotone_in_bytes(sizes, ranks):
    frame_rows = [coll_row("all_reduce", "node", 1, 4, 2**e, 1e-5 * (1 + 2**e / 1e8)) for e in range(10, 25, 2)]
    import pandas as pd

    cal = Calibration(__import__("pathlib").Path("."), None, None, pd.DataFrame(frame_rows))
    sizes = np.sort(np.array(sizes, float))
    sec, _ = cal.collective_seconds("all_reduce", "node", ranks, sizes)
    assert np.all(np.diff(sec) >= -1e-15)


def test_interpolator_exact_on_points_and_off_subspace_flag():
    pts = np.array([[10, 1], [100, 1], [1000, 1]], float)
    f = LogInterpolator(pts, np.array([1.0, 2.0, 4.0]))
    v, ext = f(np.array([[10, 1], [100, 1], [1000, 1], [100, 2]], float))
    assert v == pytest.approx([1, 2, 4, 2]) and ext.tolist() == [False, False, False, True]


def test_load_calibration_none_when_absent(tmp_path):
    assert load_calibration(tmp_path / "nothing") is None
    assert load_calibration(tmp_path) is None  # a directory without CSVs


def test_frontier_seed_rows_follow_their_derivation():
    cal = load_calibration("frontier")
    assert all(s.endswith("seed)") for s in cal.sources)
    # X-MoE d2048 E64 d_ffn 1408 k6 s2048: m = 8 x 2048 x 6 / 64 = 1536 tokens per expert, 8 experts per GCD, 43 TFLOPS
    flops, ext = cal.gemm_flops_per_s(1536, 1408, 2048, "bf16", groups=8)
    assert flops == pytest.approx(43e12) and not ext
    # out-projection d7168, T = 8192: 2 x 8192 x 7168^2 / 7.42 ms = 113.5 TFLOPS (~59% of 191.5: X-MoE's ~60% rocBLAS)
    flops, _ = cal.gemm_flops_per_s(8192, 7168, 7168, "bf16")
    assert flops == pytest.approx(2 * 8192 * 7168**2 / 7.42e-3, rel=1e-5)
    assert 0.55 < flops / 191.5e12 < 0.62
    # all-to-all d5120 k6 s4096: 4096 x 6 x 5120 x 2 B = 251.7 MB in (1.89 + 2.23) / 2 ms
    sec, ext = cal.collective_seconds("all_to_all", "node", 8, 4096 * 6 * 5120 * 2)
    assert sec == pytest.approx(2.06e-3) and not ext


def test_grouped_gemm_outside_the_hull_takes_its_own_shape_not_a_near_group_count(tmp_path):
    """A grouped GEMM beyond the measured groups answers from the nearest per-GEMM shape (m, n, k): the Frontier
    seed once priced X-MoE Small's 64-group [768 x 1408 x 2048] experts at the 120 TFLOPS of a 32-group
    [2048 x 2048 x 7168] row, because groups counted like a shape dimension in the nearest-point distance."""
    merge_rows(tmp_path, GEMM, [gemm_row(1536, 1408, 2048, 43.0, groups=8, dtype="bf16"),
                                gemm_row(2048, 2048, 7168, 120.0, groups=32, dtype="bf16"),
                                gemm_row(2048, 2048, 2048, 57.0, dtype="bf16"),
                                gemm_row(8192, 7168, 7168, 113.0, dtype="bf16"),
                                gemm_row(4096, 5120, 5120, 102.0, dtype="bf16")])
    cal = load_calibration(tmp_path)
    rate, extrapolated = cal.gemm_flops_per_s(768, 1408, 2048, "bf16", groups=64)
    assert float(rate) == pytest.approx(43e12) and bool(extrapolated)
    rate, extrapolated = cal.gemm_flops_per_s(1536, 1408, 2048, "bf16", groups=8)   # a measured point: exact
    assert float(rate) == pytest.approx(43e12) and not bool(extrapolated)


@pytest.mark.parametrize("table", ["gemm", "attention"])
def test_a_row_faster_than_the_device_peak_is_refused_naming_the_file(tmp_path, table):
    """A row 10x the datasheet (every column in its allowed range) priced MFU at 199%; now one error line."""
    import csv
    import shutil

    from piper_plan.calibration.curves import load_calibration
    from piper_plan.catalog import calibration_dir, load_platform
    from piper_plan.cost.compute import Rates
    from piper_plan.errors import PiperError

    folder = tmp_path / "local-cpu"
    shutil.copytree(calibration_dir("local-cpu"), folder)
    path = folder / f"{table}.csv"
    rows = list(csv.DictReader(path.read_text().splitlines()))
    row = next(r for r in rows if r["dtype"] == "fp32")
    row["tflops"] = str(float(row["tflops"]) * 10)
    row["seconds"] = str(float(row["seconds"]) / 10)      # the same row ten times faster (its columns agree)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    platform = load_platform("local-cpu")
    assert Rates(platform, "fp32", load_calibration("local-cpu")).peak > 0      # the real rows pass
    with pytest.raises(PiperError, match=rf"{table}\.csv: a fp32 row measures .* above the device's peak"):
        Rates(platform, "fp32", load_calibration(folder))


def test_a_sweep_grid_is_multilinear_over_its_lattice_and_linear_over_its_families():
    """GEMM sweep rows: every (n, k) family at every m and group count. m and groups are the lattice (bilinear in
    log there), the (n, k) families are blended on their own triangles."""
    pts, vals = [], []
    for n, k, base in ((256, 256, 1.0), (512, 512, 4.0), (256, 1024, 2.0)):
        for m in (10, 1000):
            for g in (1, 4):
                pts.append((m, n, k, g))
                vals.append(base * (m / 10) ** 0.5 * g)
    f = LogInterpolator(np.array(pts, float), np.array(vals))
    assert f.lattice == [0, 3] and f.scattered == [1, 2]
    v, ext = f(np.array([[100, 256, 256, 2], [10, 2**8.5, 2**8.5, 1], [20000, 512, 512, 4]], float))
    assert v[0] == pytest.approx(10**0.5 * 2) and v[1] == pytest.approx(2.0)
    assert v[2] == pytest.approx(4.0 * 10 * 4) and ext.tolist() == [False, False, True]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_a_query_gets_one_value_whatever_else_the_call_asks(seed):
    """The measured H200 sweep (a product of m, groups and ten (n, k) shapes): a query's rate must not depend on
    the other queries of the call (`piper plan` prices a batch, `piper estimate` one plan) nor jump between
    neighbouring points. Qhull's triangulation of the whole product once answered one GEMM 601.6 or 612.8 TFLOPS
    as scipy's walk happened to reach it (DeepSeek-V3 on 32 H200 nodes: plan 12.2445 s, estimate 12.2572 s)."""
    cal = load_calibration("h200")
    rng = np.random.default_rng(seed)
    size = _SMALL_QUERY + 100                   # a search's batch: evaluated afresh, its answers not remembered
    m = np.exp(rng.uniform(np.log(4), np.log(16384), size))
    n = np.exp(rng.uniform(np.log(1408), np.log(14336), size))
    k = np.exp(rng.uniform(np.log(1408), np.log(14336), size))
    g = rng.choice([1.0, 2.0, 4.0, 16.0], size)
    batch, _ = cal.gemm_flops_per_s(m, n, k, "bf16", groups=g)
    together, alone = np.split(rng.choice(size, 16, replace=False), 2)     # no row asked twice: none remembered
    some, _ = cal.gemm_flops_per_s(m[together], n[together], k[together], "bf16", groups=g[together])
    assert some.tolist() == pytest.approx(batch[together].tolist(), rel=1e-12)
    for i in alone:
        one, _ = cal.gemm_flops_per_s(m[i], n[i], k[i], "bf16", groups=g[i])
        nudged, _ = cal.gemm_flops_per_s(m[i] * (1 + 1e-9), n[i], k[i] * (1 - 1e-9), "bf16", groups=g[i])
        assert float(one) == pytest.approx(batch[i], rel=1e-12)
        assert float(nudged) == pytest.approx(batch[i], rel=1e-6)


def test_a_few_rows_asked_again_get_the_answers_of_a_fresh_interpolator():
    """An estimate's few rows are remembered per interpolator (each asked again and again); what comes back the
    second time, in any order and beside new rows, is what a fresh interpolator answers, extrapolated flags too."""
    rng = np.random.default_rng(7)
    points = np.exp(rng.uniform(0, 5, (40, 3)))
    values = np.exp(rng.uniform(0, 3, 40))
    queries = np.exp(rng.uniform(-1, 6, (30, 3)))                  # some outside the points' hull: flagged
    remembered = LogInterpolator(points, values)
    first = remembered(queries[:20])
    again = remembered(queries[::-1])
    fresh = LogInterpolator(points, values)(queries[::-1])
    assert again[0].tolist() == fresh[0].tolist() and again[1].tolist() == fresh[1].tolist()
    assert first[0].tolist() == fresh[0][::-1][:20].tolist() and fresh[1].any() and not fresh[1].all()
