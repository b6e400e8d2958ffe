"""``piper calibrate fit``: fit a platform's efficiency and overlap parameters to measured runs.

A run directory holds ``plan.json`` (the plan and its model, platform, training) and the runtime's
``metrics.jsonl``. For every run the measured step time is the steady-state median (``compare.compare``);
the prediction is ``cost.evaluate.estimate`` under trial parameters. Least squares (scipy ``least_squares``,
trust-region reflective with bounds) minimises the log-ratio residuals ``log(predicted / measured)`` (a
relative error, symmetric in over- and under-prediction).

Parameters (each only when it changes some prediction — a parameter the runs cannot see is not fitted):

- ``efficiency.gemm`` / ``efficiency.attention``: the roofline fallback's efficiencies (PlatformSpec.efficiency),
  used when the platform has no GEMM / attention calibration rows.
- ``a2a_overlap`` / ``p2p_overlap`` / ``dp_overlap`` / ``tp_overlap``: CostOptions, the fraction of that
  communication hidden behind compute.
- ``overhead.scale``: a factor on the measured framework overhead (calibration/<platform>/overhead.csv,
  cost/overhead.py), for a machine whose load differs between calibration and runs.

Honesty: what is fitted on some runs cannot validate on them. ``split_runs`` holds every other run out, and
``holdout_mape_pct`` reports the error on the held-out runs with the fitted values (benchmarks/closed_loop.py).

The result is written to ``calibration/<platform>/fit.csv`` (parameter, value, before/after error, source naming
the runs); :func:`load_fit` reads it back as (CostOptions, platform with fitted efficiencies). ``estimate`` and
``plan`` do not apply it: a fit is reported with its held-out error, and ``how_to_apply`` names the options and
platform fields that price with it. Pure except ``read_run`` and ``write_fit``; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from piper_plan.errors import PiperError

FIT_FILE = "fit.csv"
PARAMETERS: dict[str, tuple[float, float, float]] = {   # name -> (lower, upper, default)
    "efficiency.gemm": (0.02, 1.0, None),
    "efficiency.attention": (0.02, 1.0, None),
    "a2a_overlap": (0.0, 0.95, 0.0),
    "p2p_overlap": (0.0, 0.95, 0.0),
    "dp_overlap": (0.0, 0.95, 0.0),
    "tp_overlap": (0.0, 0.95, 0.0),
    "overhead.scale": (0.2, 5.0, 1.0),
}


@dataclass(frozen=True)
class Run:
    """One measured run: its plan file and its steady-state measured step time."""

    path: str
    plan_file: object           # planfile.PlanFile
    measured_step_s: float


@dataclass(frozen=True)
class FitResult:
    """Fitted values, and per run the prediction before and after."""

    platform: str
    values: dict[str, float]
    before: dict[str, float]
    runs: list[str]
    measured_s: list[float]
    predicted_before_s: list[float]
    predicted_after_s: list[float]

    @staticmethod
    def _mape(pred, meas) -> float:
        return float(np.mean(np.abs(np.asarray(pred) / np.asarray(meas) - 1)) * 100)

    @property
    def mape_before_pct(self) -> float:
        return self._mape(self.predicted_before_s, self.measured_s)

    @property
    def mape_after_pct(self) -> float:
        return self._mape(self.predicted_after_s, self.measured_s)

    def to_dict(self) -> dict:
        return {"platform": self.platform, "values": self.values, "before": self.before,
                "mape_before_pct": self.mape_before_pct, "mape_after_pct": self.mape_after_pct,
                "runs": [{"run": r, "measured_s": m, "predicted_before_s": b, "predicted_after_s": a}
                         for r, m, b, a in zip(self.runs, self.measured_s, self.predicted_before_s,
                                               self.predicted_after_s)]}


# ---- I/O -------------------------------------------------------------------------------------------
def read_run(run_dir: str | Path) -> Run:
    """RUN_DIR/plan.json + RUN_DIR/metrics.jsonl -> Run; a missing file is one PiperError line."""
    from piper_plan.compare import check_same_job, compare, layout_records
    from piper_plan.metricsfile import read_metrics
    from piper_plan.planfile import read_plan_file

    d = Path(run_dir)
    if not d.is_dir():
        raise PiperError("not found" if not d.exists() else "not a directory; a run directory is expected",
                         path=str(d))
    for name in ("plan.json", "metrics.jsonl"):
        if not (d / name).is_file():
            raise PiperError(f"missing {name}: a run directory holds the plan.json it ran and the runtime's "
                             "metrics.jsonl", path=str(d))
    pf = read_plan_file(d / "plan.json")
    records = read_metrics(d / "metrics.jsonl")
    check_same_job(pf, records, str(d / "metrics.jsonl"), str(d / "plan.json"))
    records = layout_records(pf, records, str(d / "metrics.jsonl"), str(d / "plan.json"))
    measured = compare({}, records)["step_time_s"]["measured"]
    if not measured:
        raise PiperError("no step_time_s in metrics.jsonl", path=str(d / "metrics.jsonl"))
    return Run(str(d), pf, float(measured))


def check_one_platform(runs: list[Run]) -> None:
    """A fit prices every run with one platform and calibration and writes that platform's fit.csv: runs of another
    platform (another name, or the same name with other figures) are refused, naming the first that differs."""
    first = runs[0].plan_file.platform
    for run in runs[1:]:
        other = run.plan_file.platform
        if other != first:
            what = f"platform {other.name}" if other.name != first.name else f"another {other.name} (other figures)"
            raise PiperError(f"ran on {what}, but {runs[0].path} ran on {first.name}; fit runs of one platform",
                             path=run.path)


def how_to_apply(values: dict[str, float], platform_name: str) -> str:
    """How to price with fitted ``values``: estimate and plan do not read fit.csv (it records the fit and its error;
    docs/closed-loop.md reports such a fit without tuning the table to it), so each value is named where it goes."""
    options = " ".join(f"--cost-option {k}={v:.4g}" for k, v in values.items() if "." not in k)
    platform = ", ".join(f"{k}: {v:.4g}" for k, v in values.items() if k.startswith("efficiency."))
    parts = ([f"estimate / plan {options}"] if options else []) + \
            ([f"a copy of platform {platform_name}'s YAML with {platform}"] if platform else []) + \
            (["overhead.scale: no option takes it (scale overhead.csv's seconds)"] if "overhead.scale" in values else [])
    return "fit.csv records the fit; estimate and plan do not apply it. To price with it: " + "; ".join(parts)


def fit_path(platform_name: str) -> Path:
    from piper_plan.catalog import calibration_dir

    return calibration_dir(platform_name) / FIT_FILE


def fit_rows(result: FitResult, command: str) -> list[dict]:
    runs = ", ".join(Path(r).name for r in result.runs)
    source = f"{command}: least squares over {len(result.runs)} runs ({runs})"
    return [{"parameter": k, "value": v, "before": result.before.get(k), "mape_before_pct": result.mape_before_pct,
             "mape_after_pct": result.mape_after_pct, "source": source} for k, v in result.values.items()]


def write_fit(path: Path, rows: list[dict]) -> Path:
    import pandas as pd

    from piper_plan.fileio import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, pd.DataFrame(rows).to_csv(index=False))


def _fit_row_problem(row: dict) -> str | None:
    lower, upper, _ = PARAMETERS[row["parameter"]]
    if not lower <= row["value"] <= upper:
        return f"{row['parameter']}={row['value']:g} outside its range {lower:g}..{upper:g}"
    return None


def fit_table():
    """fit.csv's schema: parameter (a PARAMETERS name), value (inside its bounds), source; other columns are notes."""
    from piper_plan.calibration.schema import SOURCE, Column, Table

    return Table("fit", (Column("parameter", "str", "fitted parameter", choices=tuple(PARAMETERS)),
                         Column("value", "float", "fitted value"), SOURCE), key=("parameter",),
                 row_check=_fit_row_problem)


def load_fit(platform, path: Path | None = None):
    """(CostOptions, platform) with the fitted values of calibration/<platform>/fit.csv applied; unchanged if absent."""
    from piper_plan.calibration.io import read_table
    from piper_plan.cost.options import CostOptions

    path = path or fit_path(platform.name)
    if not path.exists():
        return CostOptions(), platform
    frame = read_table(path, fit_table())
    return apply(platform, CostOptions(), dict(zip(frame["parameter"], frame["value"].astype(float))))


# ---- pure ------------------------------------------------------------------------------------------
def apply(platform, options, values: dict[str, float]):
    """(CostOptions, PlatformSpec) with ``values`` set (``overhead.scale`` is applied by scaled_calibration)."""
    eff = {k.split(".", 1)[1]: v for k, v in values.items() if k.startswith("efficiency.")}
    if eff:
        platform = platform.model_copy(update={"efficiency": platform.efficiency.model_copy(update=eff)})
    opts = {k: v for k, v in values.items() if not k.startswith(("efficiency.", "overhead."))}
    return options.model_copy(update=opts) if hasattr(options, "model_copy") else _replace(options, opts), platform


def _replace(options, values):
    from dataclasses import replace

    return replace(options, **values)


def scaled_calibration(calibration, scale: float):
    """A shallow copy of ``calibration`` whose framework overhead (``.overhead``) is ``scale`` times larger."""
    import copy
    from dataclasses import fields, replace

    overhead = getattr(calibration, "overhead", None)
    if overhead is None or scale == 1.0:
        return calibration
    def times(value):
        return tuple(v * scale for v in value) if isinstance(value, tuple) else value * scale

    seconds = {f.name: times(getattr(overhead, f.name)) for f in fields(overhead) if f.name.endswith("_s")}
    out = copy.copy(calibration)
    out.overhead = replace(overhead, **seconds)
    return out


def predict_seconds(runs: list[Run], values: dict[str, float], calibration=None, options=None) -> np.ndarray:
    """Predicted step seconds of every run under ``values`` (``options``: the base CostOptions)."""
    from piper_plan.cost.evaluate import estimate
    from piper_plan.cost.options import CostOptions

    out = []
    calibration = scaled_calibration(calibration, values.get("overhead.scale", 1.0))
    for run in runs:
        pf = run.plan_file
        opts, platform = apply(pf.platform, options or CostOptions(), values)
        est = estimate(pf.model, platform, pf.training, pf.nodes, pf.parallel, calibration=calibration,
                       placement=pf.placement, options=opts)
        out.append(est.step_time_s)
    return np.asarray(out)


def _current(name: str, runs: list[Run]) -> float:
    if name.startswith("efficiency."):
        return float(getattr(runs[0].plan_file.platform.efficiency, name.split(".", 1)[1]))
    return PARAMETERS[name][2]


def sensitive_parameters(runs: list[Run], calibration=None, names=None, rel_step: float = 0.05,
                         options=None) -> list[str]:
    """Parameters whose change moves at least one prediction (the others cannot be fitted from these runs)."""
    base = predict_seconds(runs, {}, calibration, options)
    keep = []
    for name in names or PARAMETERS:
        lo, hi, _ = PARAMETERS[name]
        value = _current(name, runs)
        trial = min(hi, value + rel_step) if value + rel_step <= hi else value - rel_step
        moved = predict_seconds(runs, {name: max(lo, trial)}, calibration, options)
        if np.any(np.abs(moved / base - 1) > 1e-6):
            keep.append(name)
    return keep


def check_names(names) -> None:
    """Every name is a fittable parameter (one line naming the bad one and the known ones)."""
    unknown = [n for n in names or () if n not in PARAMETERS]
    if unknown:
        raise PiperError(f"{unknown[0]!r} is not a fittable parameter; known: {', '.join(PARAMETERS)}", field="--param")


def fit(runs: list[Run], calibration=None, names=None, options=None, determined: bool = False) -> FitResult:
    """Least-squares fit of the sensitive parameters to the runs' measured step times.

    ``determined``: refuse a fit of more parameters than runs (each run gives one equation; the CLI asks for this,
    a script fitting a held-out split may accept an underdetermined least-squares solution)."""
    from scipy.optimize import least_squares

    if not runs:
        raise PiperError("no runs to fit", field="RUN_DIR")
    check_names(names)
    measured = np.array([r.measured_step_s for r in runs])
    names = sensitive_parameters(runs, calibration, names, options=options)
    if determined and len(names) > len(runs):
        raise PiperError(f"{len(names)} parameters ({', '.join(names)}) from {len(runs)} run(s): underdetermined by "
                         f"{len(names) - len(runs)}; give at most {len(runs)} --param, or more runs", field="--param")
    start = np.array([_current(n, runs) for n in names])
    before = predict_seconds(runs, {}, calibration, options)
    if not names:
        return FitResult(runs[0].plan_file.platform.name, {}, {}, [r.path for r in runs], measured.tolist(),
                         before.tolist(), before.tolist())
    lower = np.array([PARAMETERS[n][0] for n in names])
    upper = np.array([PARAMETERS[n][1] for n in names])

    def residuals(x):
        return np.log(predict_seconds(runs, dict(zip(names, x)), calibration, options) / measured)

    sol = least_squares(residuals, np.clip(start, lower, upper), bounds=(lower, upper), diff_step=1e-3)
    values = {n: float(v) for n, v in zip(names, at_bounds(sol.x, lower, upper))}
    return FitResult(runs[0].plan_file.platform.name, values, dict(zip(names, start.tolist())),
                     [r.path for r in runs], measured.tolist(), before.tolist(),
                     predict_seconds(runs, values, calibration, options).tolist())


def at_bounds(x, lower, upper, rel_tol: float = 1e-6):
    """``x`` with values within ``rel_tol`` of their range of a bound set to it: the solver stops strictly inside
    its bounds (a fitted 0 comes back as 4.8e-13), which is the bound, not a change."""
    near = rel_tol * (upper - lower)
    return np.where(x - lower <= near, lower, np.where(upper - x <= near, upper, x))


def split_runs(runs: list, every: int = 2) -> tuple[list, list]:
    """(fit set, held-out set): every ``every``-th run (the 2nd, 4th, ...) is held out."""
    held = [r for i, r in enumerate(runs) if i % every == every - 1]
    return [r for i, r in enumerate(runs) if i % every != every - 1], held


def holdout_mape_pct(values: dict[str, float], runs: list[Run], calibration=None, options=None) -> tuple[float, float]:
    """(MAPE before, MAPE after) in percent on runs the fit never saw, with the fitted ``values``."""
    measured = np.array([r.measured_step_s for r in runs])
    before = predict_seconds(runs, {}, calibration, options)
    after = predict_seconds(runs, values, calibration, options)
    return FitResult._mape(before, measured), FitResult._mape(after, measured)
