"""Calibration curves: log-space interpolation of measured points, with a flag wherever we extrapolate.

Everything here is vectorised over numpy arrays (the search evaluates many plans at once).

- ``LogInterpolator``: piecewise-linear interpolation of log(value) over log(coordinates) (scipy's
  ``LinearNDInterpolator`` on a Delaunay triangulation; ``np.interp`` when the points lie on a line).
  Coordinates that never vary in the data (every GEMM has groups=1, say) are dropped: a query that differs
  there is answered from the remaining coordinates and flagged as extrapolated. Outside the convex hull of
  the data the nearest measured point answers, flagged; ``nearest_weights`` scales each coordinate's log
  distance for that choice (GEMMs: the per-GEMM shape m, n, k decides, the group count only breaks ties).
- Collectives: per (op, scope), one log-log curve of seconds vs bytes per measured group size; between
  group sizes log-linear; beyond the largest message seconds grow linearly with bytes at the last
  bandwidth, below the smallest the smallest time is kept (latency floor); beyond the measured group sizes
  the nearest one is rescaled by nccl-tests' bus-bandwidth factor (busbw is meant to be independent of
  the rank count). All of these are flagged. One rank, or zero bytes, costs nothing (not flagged).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np

from piper_plan.calibration.io import columns_if_present
from piper_plan.calibration.schema import ATTENTION, COLLECTIVES, GEMM, MEMORY, Table, busbw_factor, source_kind

if TYPE_CHECKING:
    import pandas as pd

_RANK_TOL = 1e-9
GEMM_NEAREST_WEIGHTS = (1.0, 1.0, 1.0, 1e-3)
"""A grouped GEMM outside the measured hull takes the rate of the measured per-GEMM shape (m, n, k) nearest to
it; the group count only breaks ties. Weighting groups like the shape let a 64-group [768 x 1408 x 2048] query
take the 120 TFLOPS of a 32-group [2048 x 2048 x 7168] row rather than the 43 of its own shape family."""
_OFF_TOL = 1e-6


_SMALL_QUERY = 256
"""Query rows up to which each row's answer is remembered (LogInterpolator._remembered); above, the distinct rows
are found by a sort of each row's bytes as one value and evaluated afresh."""
_REMEMBERED_ROWS = 65_536
"""Small-query answers an interpolator keeps (LogInterpolator._remembered); past it they are forgotten at once."""


class LogInterpolator:
    """log(value) linear in log(coordinates). points: [P, D] > 0, values: [P] > 0.

    Where the points are a full product of a lattice in some coordinates and point sets ("families") in the others
    (a calibration sweep: every GEMM shape (n, k) at every m and group count; attention on a seq x heads x width
    grid), the value is multilinear over the lattice and piecewise linear over the families' simplices. A Delaunay
    triangulation of the whole product is degenerate (cospherical lattice cells), and Qhull's triangulated output
    of it need not conform: two simplices holding one query could answer 12% apart, and which one scipy's walk
    found depended on the other queries of the call (``piper plan`` and ``piper estimate`` priced one plan
    differently). Without such a lattice, one triangulation of all coordinates, as before."""

    def __init__(self, points: np.ndarray, values: np.ndarray, nearest_weights=None):
        x, y = _mean_duplicates(np.log(np.asarray(points, float)), np.log(np.asarray(values, float)))
        self._answers: dict[tuple, tuple[float, bool]] = {}
        weights = None if nearest_weights is None else np.asarray(nearest_weights, float)
        self.lattice, self.scattered = _lattice_axes(x)
        if self.lattice:
            self.grid = [np.unique(x[:, j]) for j in self.lattice]
            families, family = np.unique(x[:, self.scattered], axis=0, return_inverse=True)
            self.y = np.empty((len(families), *(len(g) for g in self.grid)))
            cell = tuple(np.searchsorted(g, x[:, j]) for g, j in zip(self.grid, self.lattice))
            self.y[(family.ravel(), *cell)] = y
            self.simplices = _Simplices(families, None if weights is None else weights[self.scattered])
        else:
            self.grid, self.y = [], y
            self.simplices = _Simplices(x, weights)

    def __call__(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """query [N, D] > 0 -> (values [N], extrapolated [N] bool). Repeated query rows are computed once."""
        query = np.ascontiguousarray(query, float)
        if len(query) <= _SMALL_QUERY and np.isfinite(query).all():      # a few rows (an estimate)
            return self._remembered(query)
        distinct, codes = _distinct_rows(query)
        values, extrapolated = self._evaluate(distinct)
        return values[codes], extrapolated[codes]

    def _remembered(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A few rows' answers, each row evaluated once per interpolator: an estimate asks for the same shapes again
        and again (every stage, both passes, the plan priced a second time), and a row's answer does not depend on
        the other rows of the call."""
        rows = list(map(tuple, query.tolist()))
        new = [row for row in dict.fromkeys(rows) if row not in self._answers]
        if new:
            if len(self._answers) + len(new) > _REMEMBERED_ROWS:
                self._answers.clear()
            values, extrapolated = self._evaluate(np.array(new, float))
            self._answers.update(zip(new, zip(values.tolist(), extrapolated.tolist())))
        answers = [self._answers[row] for row in rows]
        return np.array([v for v, _ in answers], float), np.array([e for _, e in answers], bool)

    def _evaluate(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        xq = np.log(query)
        vertex, weight, flagged = self.simplices(xq[:, self.scattered])
        if self.lattice:
            per_family, outside = self._multilinear(xq[:, self.lattice])           # [N, F]
            log_v = (weight * np.take_along_axis(per_family, vertex, axis=1)).sum(axis=1)
            flagged = flagged | outside
        else:
            log_v = (weight * self.y[vertex]).sum(axis=1)
        return np.exp(log_v), flagged

    def _multilinear(self, xq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every family's value at each query's lattice coordinates [N, F], clamped to the lattice (flagged)."""
        lower, frac, outside = [], [], np.zeros(len(xq), bool)
        for g, q in zip(self.grid, xq.T):
            outside |= (q < g[0] - _OFF_TOL) | (q > g[-1] + _OFF_TOL)
            q = np.clip(q, g[0], g[-1])
            i = np.clip(np.searchsorted(g, q, side="right") - 1, 0, len(g) - 2)
            lower.append(i)
            frac.append((q - g[i]) / (g[i + 1] - g[i]))
        out = np.zeros((len(xq), self.y.shape[0]))
        for corner in np.ndindex(*(2,) * len(self.grid)):
            w = np.prod([f if c else 1 - f for c, f in zip(corner, frac)], axis=0)
            out += w[:, None] * self.y[(slice(None), *(i + c for c, i in zip(corner, lower)))].T
        return out, outside


class _Simplices:
    """Piecewise-linear interpolation weights over scattered points (in log coordinates) on the subspace they span:
    per query the points whose values to blend and their weights, and a flag where the query lies off that subspace
    or outside the points' hull (the nearest point answers there; ``nearest_weights`` scales each coordinate's
    distance for that choice)."""

    def __init__(self, x: np.ndarray, nearest_weights=None):
        self.nearest_weights = nearest_weights
        self.center = x.mean(axis=0)
        self.x = x - self.center
        self.basis = _principal_axes(self.x)
        self.z = self.x @ self.basis
        self.order = np.argsort(self.z[:, 0]) if self.basis.shape[1] == 1 else None
        self.tri = None
        if self.basis.shape[1] >= 2:
            from scipy.spatial import Delaunay, QhullError

            try:
                self.tri = Delaunay(self.z)
            except QhullError:  # a layout scipy cannot triangulate: nearest point only, flagged
                self.tri = None

    def __call__(self, xq: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """xq [N, d] log coordinates -> (point indices [N, r+1], weights [N, r+1], extrapolated [N])."""
        xq = xq - self.center
        zq = xq @ self.basis
        off = np.linalg.norm(xq - zq @ self.basis.T, axis=1) > _OFF_TOL
        rank = self.basis.shape[1]
        if rank == 0:
            return np.zeros((len(xq), 1), np.int64), np.ones((len(xq), 1)), off
        if rank == 1:
            vertex, weight, outside = self._on_line(zq[:, 0])
        else:
            vertex, weight, outside = self._barycentric(zq, xq)
        return vertex, weight, off | outside

    def _on_line(self, z: np.ndarray):
        """Linear between the two neighbouring points, the end point beyond them (flagged)."""
        line = self.z[self.order, 0]
        outside = (z < line[0] - _OFF_TOL) | (z > line[-1] + _OFF_TOL)
        z = np.clip(z, line[0], line[-1])
        i = np.clip(np.searchsorted(line, z, side="right") - 1, 0, len(line) - 2)
        t = (z - line[i]) / (line[i + 1] - line[i])
        return self.order[np.stack([i, i + 1], axis=1)], np.stack([1 - t, t], axis=1), outside

    def _barycentric(self, zq: np.ndarray, xq: np.ndarray):
        """The Delaunay simplex's vertices and barycentric weights (tolerant on the hull's faces); the nearest point
        outside."""
        rank = zq.shape[1]
        simplex = self.tri.find_simplex(zq, tol=_OFF_TOL) if self.tri is not None else np.full(len(zq), -1)
        inside = simplex >= 0
        vertex = np.zeros((len(zq), rank + 1), np.int64)
        weight = np.zeros((len(zq), rank + 1))
        if inside.any():
            s = simplex[inside]
            t = self.tri.transform[s]  # [N, r+1, r]: affine map to barycentric coordinates
            b = np.einsum("nij,nj->ni", t[:, :-1], zq[inside] - t[:, -1])
            weight[inside] = np.concatenate([b, 1 - b.sum(axis=1, keepdims=True)], axis=1)
            vertex[inside] = self.tri.simplices[s]
        if (~inside).any():
            vertex[~inside, 0] = self._nearest(zq[~inside], xq[~inside])
            weight[~inside, 0] = 1.0
        return vertex, weight, ~inside

    def _nearest(self, zq: np.ndarray, xq: np.ndarray) -> np.ndarray:
        """Index of the point nearest to each query: in the points' subspace, or, with ``nearest_weights``, in every
        log coordinate scaled by its weight."""
        if self.nearest_weights is None:
            from scipy.spatial import cKDTree

            return cKDTree(self.z).query(zq)[1]
        d2 = (((xq[:, None, :] - self.x[None, :, :]) * self.nearest_weights) ** 2).sum(axis=2)
        return np.argmin(d2, axis=1)


def _lattice_axes(x: np.ndarray) -> tuple[list[int], list[int]]:
    """(lattice coordinates, the others) of points x [P, D]: a coordinate with two or more values is a lattice axis
    where the points are every one of its values times the same set of the other coordinates, found one by one."""
    x = np.round(x, 12)
    lattice, rest = [], list(range(x.shape[1]))
    found = True
    while found:
        found = False
        for j in rest:
            others = [c for c in rest if c != j]
            values = np.unique(x[:, j])
            product = len(values) * len(np.unique(x[:, others], axis=0))
            if len(values) > 1 and len(np.unique(x[:, rest], axis=0)) == product:
                lattice.append(j)
                rest = others
                found = True
                break
    return sorted(lattice), rest


def _distinct_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct rows in order of first appearance, index of each row's among them), by one sort of each row's
    bytes as a single value (a C-contiguous float array; the queries are positive, so equal values have equal
    bytes)."""
    row_bytes = rows.view(np.dtype((np.void, rows.itemsize * rows.shape[1]))).ravel()
    _, first, codes = np.unique(row_bytes, return_index=True, return_inverse=True)
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return rows[first[order]], rank[codes.ravel()]


def _mean_duplicates(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Average y over identical rows of x (repeated measurements of one point)."""
    uniq, inverse = np.unique(np.round(x, 12), axis=0, return_inverse=True)
    sums = np.zeros(len(uniq))
    np.add.at(sums, inverse.ravel(), y)
    return uniq, sums / np.bincount(inverse.ravel())


def _principal_axes(centered: np.ndarray) -> np.ndarray:
    """Orthonormal basis [D, r] of the subspace the points span (r = 0 for a single point)."""
    if len(centered) < 2:
        return np.zeros((centered.shape[1], 0))
    _, s, vt = np.linalg.svd(centered, full_matrices=False)
    keep = s > _RANK_TOL * max(1.0, s.max())
    return vt[keep].T


# --------------------------------------------------------------------------------------- collectives


@dataclass(frozen=True)
class CollectiveCurve:
    """One (op, scope): log seconds vs log bytes for each measured group size."""

    op: str
    ranks: np.ndarray  # sorted unique group sizes
    log_bytes: list[np.ndarray] = field(repr=False)
    log_seconds: list[np.ndarray] = field(repr=False)

    @classmethod
    def from_rows(cls, op: str, rows: "Rows") -> "CollectiveCurve":
        ranks_all = rows["num_nodes"] * rows["ranks_per_node"]
        ranks = np.unique(ranks_all)
        xs, ys = [], []
        for r in ranks:
            sub = rows.where(ranks_all == r)
            x, y = _mean_duplicates(np.log(sub.floats(["bytes_per_rank"])), np.log(sub.floats(["seconds"])[:, 0]))
            xs.append(x[:, 0])
            ys.append(y)
        return cls(op, ranks, xs, ys)

    def seconds(self, num_ranks: np.ndarray, bytes_per_rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        r, b = np.broadcast_arrays(np.asarray(num_ranks, float), np.asarray(bytes_per_rank, float))
        out, ext = np.zeros(r.shape), np.zeros(r.shape, bool)
        for value in np.unique(r):
            mask = (r == value) & (b > 0)
            if value <= 1 or not mask.any():
                continue
            out[mask], ext[mask] = self._at_ranks(float(value), b[mask])
        return out, ext

    def _at_ranks(self, r: float, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        i = int(np.searchsorted(self.ranks, r))
        if i < len(self.ranks) and self.ranks[i] == r:
            return self._on_curve(i, b)
        if i == 0 or i == len(self.ranks):
            j = 0 if i == 0 else len(self.ranks) - 1
            s, _ = self._on_curve(j, b)
            scale = busbw_factor(self.op, int(round(r))) / busbw_factor(self.op, int(self.ranks[j]))
            return s * scale, np.ones(len(b), bool)
        (s0, e0), (s1, e1) = self._on_curve(i - 1, b), self._on_curve(i, b)
        t = (np.log(r) - np.log(self.ranks[i - 1])) / (np.log(self.ranks[i]) - np.log(self.ranks[i - 1]))
        return np.exp((1 - t) * np.log(s0) + t * np.log(s1)), e0 | e1

    def _on_curve(self, i: int, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        xb, ys = self.log_bytes[i], self.log_seconds[i]
        lb = np.log(b)
        log_s = np.interp(lb, xb, ys)
        above = lb > xb[-1] + _OFF_TOL
        log_s = np.where(above, ys[-1] + (lb - xb[-1]), log_s)  # constant bandwidth beyond the largest size
        return np.exp(log_s), above | (lb < xb[0] - _OFF_TOL)


# --------------------------------------------------------------------------------------- the API


def _closest_key(wanted: tuple, available: list[tuple]) -> tuple:
    """The available key agreeing with ``wanted`` on the most leading fields (dtype first, then pass, causal)."""
    def score(key: tuple) -> tuple:
        return tuple(int(a == b) for a, b in zip(wanted, key))

    return max(available, key=score)


class Rows:
    """One calibration table as numpy columns (io.read_columns): what the lookups read, without pandas."""

    def __init__(self, table: Table, columns: dict | None = None):
        kinds = {"int": np.int64, "float": float, "str": str, "bool": bool}
        self.table = table
        self.columns = {c.name: np.asarray([] if columns is None else columns[c.name], kinds[c.kind])
                        for c in table.columns}

    @classmethod
    def of(cls, table: Table, rows) -> "Rows":
        """From read_columns' dict, a pandas DataFrame (anything indexable by column name) or None."""
        return cls(table, None if rows is None else {c: np.asarray(rows[c]) for c in table.column_names})

    def __len__(self) -> int:
        return len(self.columns[self.table.columns[0].name])

    @property
    def empty(self) -> bool:
        return len(self) == 0

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    def where(self, mask: np.ndarray) -> "Rows":
        return Rows(self.table, {k: v[mask] for k, v in self.columns.items()})

    def floats(self, names: list[str]) -> np.ndarray:
        """[rows, len(names)] float64."""
        return np.stack([self.columns[n].astype(float) for n in names], axis=1)

    def distinct(self, names: tuple) -> list[tuple]:
        """The distinct value tuples of ``names`` as Python values, sorted by their text."""
        return sorted(set(zip(*(self.columns[n].tolist() for n in names))), key=str)

    def frame(self) -> "pd.DataFrame":
        import pandas as pd

        return pd.DataFrame({k: v.tolist() for k, v in self.columns.items()}, columns=self.table.column_names)


class Calibration:
    """A platform's measured curves (calibration/<platform>/*.csv). Queries broadcast over numpy arrays.

    The tables are held as numpy columns (``Rows``); ``gemm`` / ``attention`` / ``collectives`` give them as
    pandas DataFrames (for reports), so that pricing plans never imports pandas."""

    def __init__(self, directory: Path, gemm=None, attention=None, collectives=None, memory=None):
        """Each table: read_columns' dict of columns, a DataFrame, or None (no rows)."""
        self.directory = Path(directory)
        self.rows = {t.name: Rows.of(t, rows) for t, rows in ((GEMM, gemm), (ATTENTION, attention),
                                                              (COLLECTIVES, collectives), (MEMORY, memory))}
        self.sources: list[str] = _sources(self.directory, self.rows.values())
        """One line per table: how many rows, and how many are seed / measured / imported."""
        self.notes: list[str] = []
        """Fallbacks taken while answering queries (a dtype or pass that had no rows), for the output."""
        self.overhead = None
        """cost.overhead.FrameworkOverhead from overhead.csv (load_calibration sets it), or None."""
        self._cache: dict = {}

    @property
    def gemm(self) -> "pd.DataFrame":
        return self.rows[GEMM.name].frame()

    @property
    def attention(self) -> "pd.DataFrame":
        return self.rows[ATTENTION.name].frame()

    @property
    def collectives(self) -> "pd.DataFrame":
        return self.rows[COLLECTIVES.name].frame()

    @property
    def memory(self) -> "pd.DataFrame":
        return self.rows[MEMORY.name].frame()

    # GEMM ------------------------------------------------------------------------------------------
    def gemm_flops_per_s(self, m, n, k, dtype: str, groups=1) -> tuple[np.ndarray, np.ndarray]:
        """Achieved FLOP/s (2 m n k groups / seconds) of forward GEMMs [m x k] @ [k x n], and the extrapolated mask."""
        m, n, k, g = np.broadcast_arrays(*(np.asarray(v, float) for v in (m, n, k, groups)))
        gemm = self.rows[GEMM.name]
        if gemm.empty:
            raise _no_rows(self.directory, GEMM.filename)
        key, fell_back = self._key(gemm, ("dtype",), (dtype,))
        interp = self._gemm_interp(key)
        query = np.stack([np.maximum(v.ravel(), 1.0) for v in (m, n, k, g)], axis=1)
        tflops, ext = interp(query)
        return (tflops * 1e12).reshape(m.shape), (ext | fell_back).reshape(m.shape)

    def _gemm_interp(self, key: tuple) -> LogInterpolator:
        cache_key = ("gemm", key)
        if cache_key not in self._cache:
            gemm = self.rows[GEMM.name]
            rows = gemm.where(gemm["dtype"] == key[0])
            self._cache[cache_key] = LogInterpolator(rows.floats(["m", "n", "k", "groups"]),
                                                     rows.floats(["tflops"])[:, 0], GEMM_NEAREST_WEIGHTS)
        return self._cache[cache_key]

    # attention -------------------------------------------------------------------------------------
    def attention_flops_per_s(self, seq_len, num_heads, head_dim, causal: bool, pass_: str,
                              dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """Achieved FLOP/s of the attention core (schema.attention_flops convention), and the extrapolated mask."""
        s, h, d = np.broadcast_arrays(*(np.asarray(v, float) for v in (seq_len, num_heads, head_dim)))
        attention = self.rows[ATTENTION.name]
        if attention.empty:
            raise _no_rows(self.directory, ATTENTION.filename)
        key, fell_back = self._key(attention, ("dtype", "pass", "causal"), (dtype, pass_, bool(causal)))
        cache_key = ("attention", key)
        if cache_key not in self._cache:
            rows = attention.where((attention["dtype"] == key[0]) & (attention["pass"] == key[1])
                                   & (attention["causal"] == key[2]))
            self._cache[cache_key] = LogInterpolator(rows.floats(["seq_len", "num_heads", "head_dim"]),
                                                     rows.floats(["tflops"])[:, 0])
        query = np.stack([np.maximum(v.ravel(), 1.0) for v in (s, h, d)], axis=1)
        tflops, ext = self._cache[cache_key](query)
        return (tflops * 1e12).reshape(s.shape), (ext | fell_back).reshape(s.shape)

    def fastest_tflops(self, table: str, dtype: str) -> float:
        """The highest rate any row of ``table`` ("gemm" or "attention") measured in ``dtype`` (0 without rows)."""
        cache_key = ("fastest", table, dtype)
        if cache_key not in self._cache:
            rows = self.rows[table]
            mine = rows.where(rows["dtype"] == dtype) if not rows.empty else rows
            values = mine.floats(["tflops"])[:, 0] if not mine.empty else np.zeros(0)
            self._cache[cache_key] = float(values.max()) if values.size else 0.0
        return self._cache[cache_key]

    def gemm_dtypes(self) -> list[str]:
        """The precisions gemm.csv measured."""
        return sorted(d for (d,) in self._distinct(self.rows[GEMM.name], ("dtype",)))

    def has_gemm(self, dtype: str) -> bool:
        """Whether gemm.csv measured ``dtype`` (another precision's rows would price it at the wrong rate)."""
        return (dtype,) in self._distinct(self.rows[GEMM.name], ("dtype",))

    # memory-bound kernels --------------------------------------------------------------------------
    def memory_Bps(self, kernel: str) -> float:
        """The streaming rate (bytes / s) of a memory-bound ``kernel`` (schema.MEMORY_KERNELS): its fastest row in
        memory.csv, the largest tensors' as a rule (smaller ones pay the launch); 0 where none was measured."""
        cache_key = ("memory", kernel)
        if cache_key not in self._cache:
            rows = self.rows[MEMORY.name]
            mine = rows.where(rows["kernel"] == kernel) if not rows.empty else rows
            self._cache[cache_key] = float(mine.floats(["GBps"])[:, 0].max()) * 1e9 if not mine.empty else 0.0
        return self._cache[cache_key]

    # collectives -----------------------------------------------------------------------------------
    def has_collective(self, op: str, scope: str) -> bool:
        return (op, scope) in self._distinct(self.rows[COLLECTIVES.name], ("op", "scope"))

    def collective_seconds(self, op: str, scope: str, num_ranks, bytes_per_rank) -> tuple[np.ndarray, np.ndarray]:
        """Seconds of one ``op`` over ``num_ranks`` ranks spanning ``scope`` with nccl-tests ``size`` = bytes_per_rank."""
        if not self.has_collective(op, scope):
            have = sorted(f"{o}/{s}" for o, s in self._distinct(self.rows[COLLECTIVES.name], ("op", "scope")))
            raise _no_rows(self.directory, COLLECTIVES.filename, f" for op={op} scope={scope}; has {have} (check has_collective first)")
        cache_key = ("coll", op, scope)
        if cache_key not in self._cache:
            c = self.rows[COLLECTIVES.name]
            self._cache[cache_key] = CollectiveCurve.from_rows(op, c.where((c["op"] == op) & (c["scope"] == scope)))
        return self._cache[cache_key].seconds(num_ranks, bytes_per_rank)

    # helpers ---------------------------------------------------------------------------------------
    def _distinct(self, rows: Rows, columns: tuple) -> list[tuple]:
        """The distinct values of ``columns`` in a table, read once (the tables never change)."""
        cache_key = ("keys", rows.table.name, columns)
        if cache_key not in self._cache:
            self._cache[cache_key] = rows.distinct(columns)
        return self._cache[cache_key]

    def _key(self, rows: Rows, columns: tuple, wanted: tuple) -> tuple[tuple, bool]:
        filename = rows.table.filename
        available = self._distinct(rows, columns)
        if wanted in available:
            return wanted, False
        chosen = _closest_key(wanted, available)
        note = f"{filename}: no rows for {dict(zip(columns, wanted))}; used {dict(zip(columns, chosen))} (flagged extrapolated)"
        if note not in self.notes:
            self.notes.append(note)
        return chosen, True


def _no_rows(directory: Path, filename: str, what: str = ""):
    from piper_plan.errors import PiperError

    path = directory / filename
    if not path.is_file():        # a calibration folder without the file: not a file without rows
        return PiperError(f"no such file in the calibration folder{what} (piper calibrate measures it)", path=str(path))
    if what:
        return PiperError(f"no calibration rows{what}", path=str(path))
    return PiperError("no calibration rows: the file holds its header only (piper calibrate measures them; "
                      "--no-calibration prices with the platform's roofline instead)", path=str(path))


def _sources(directory: Path, tables) -> list[str]:
    from collections import Counter

    lines = []
    for rows in tables:
        if rows.empty:
            continue
        kinds = Counter(source_kind(s) for s in rows["source"].tolist())
        parts = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        lines.append(f"{shown_path(directory / rows.table.filename)}: {len(rows)} rows ({parts})")
    return lines


def shown_path(path: Path) -> str:
    """A path as people (and the committed reports) should see it: relative to the project when inside it."""
    from piper_plan.catalog import project_root

    try:
        return str(path.resolve().relative_to(project_root().resolve()))
    except ValueError:
        return str(path)


def load_calibration(platform: str | Path) -> Calibration | None:
    """The calibration of a platform name (calibration/<name>/) or a directory path; None if it has no CSVs."""
    from piper_plan.catalog import calibration_dir

    directory = Path(platform) if isinstance(platform, Path) or "/" in str(platform) else calibration_dir(str(platform))
    if not directory.is_dir():
        return None
    from piper_plan.calibration.io import read_metadata

    read_metadata(directory)                          # a malformed metadata.json is reported, not skipped
    tables = (GEMM, ATTENTION, COLLECTIVES, MEMORY)
    frames = [columns_if_present(directory, t) for t in tables]
    if all(f is None or not f[t.columns[0].name] for f, t in zip(frames, tables)):
        return None
    calibration = Calibration(directory, *frames)
    from piper_plan.calibration.overhead import load_overhead

    calibration.overhead = load_overhead(directory)   # framework overhead (overhead.csv), None when absent
    return calibration
