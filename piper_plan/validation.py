"""Published measurements vs the resource model: load ``validation/*.yaml``, predict every row, score it.

Pure computation (no rich, no click, no torch): the CLI (``piper validate``) and ``piper reproduce paper``
render what this returns. A dataset file holds a citation, a platform, training defaults, the tolerances the
project holds itself to, whether it fed any fitted parameter (``used_for_fitting``), and rows. Each row names a
model (catalog name, or inline ``facts`` such as Table IV's E, d, d_ffn), a ``quantity``, and the
``published`` number; rows with ``search`` take the search library's best plan instead of a given one.

Quantities (SI inside; the unit is in the name):

- ``step_time_s``, ``tflops_per_device``, ``mfu``: ``cost.evaluate.estimate`` of the row's plan (or the best plan);
  ``tokens_per_s_per_device``: its tokens/s divided by the plan's world size.
- ``memory.state_GiB``: weights + gradients + master/optimizer state of the peak-memory stage, GiB (2^30).
- ``memory.activation_GiB``: activations saved for backward of the peak-memory stage, GiB.
- ``migration.send_per_gpu_GB`` / ``_GiB`` and ``migration.time_ms``: Piper Table IV, ``cost.step.expert_migration``.

Errors: ``rel_error = (predicted - published) / published`` (DESIGN.md, compare format); summaries in percent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from pydantic import Field, model_validator

from piper_plan.catalog import parse_spec
from piper_plan.errors import PiperError
from piper_plan.specs.base import Name, Spec
from piper_plan.specs.model import MAX_EXPERTS, Width
from piper_plan.specs.parallel import MAX_RANKS, check_layout_mtp
from piper_plan.specs.platform import MAX_NODES

GiB = 2**30
Quantity = Literal["step_time_s", "tflops_per_device", "tokens_per_s_per_device", "mfu", "memory.state_GiB",
                   "memory.activation_GiB",
                   "migration.send_per_gpu_GB", "migration.send_per_gpu_GiB", "migration.time_ms"]
MIGRATION_QUANTITIES = tuple(q for q in get_args(Quantity) if q.startswith("migration."))


# ---- the dataset file format ------------------------------------------------------------------------
MAX_TOLERANCE_PCT = 1000.0
"""The widest tolerance, percent: a prediction 11x off; a wider one would gate nothing."""


class Tolerance(Spec):
    """Allowed absolute percentage errors."""

    row: float = Field(gt=0, le=MAX_TOLERANCE_PCT)
    """Largest allowed |error| of one gated row, percent."""
    mean: float = Field(gt=0, le=MAX_TOLERANCE_PCT)
    """Largest allowed mean |error| over the gated rows of the dataset, percent."""


MIN_PUBLISHED, MAX_PUBLISHED = 1e-9, 1e15
"""Bounds of a row's published value (validation/ today: 1.1 to 23,766)."""


class RowSpec(Spec):
    """One published datapoint."""

    id: Name
    """Unique within the dataset (one line: errors and tables print it)."""
    quantity: Quantity
    """What was published (see the module docstring)."""
    published: float = Field(ge=MIN_PUBLISHED, le=MAX_PUBLISHED)
    """The published value, in the quantity's unit (every quantity here is positive; MIN_PUBLISHED keeps the
    relative error finite)."""
    model: str | None = None
    """Catalog name or path of the model."""
    platform: str | None = None
    """Platform the row ran on, over the dataset's."""
    training: dict | None = None
    """TrainingSpec fields for this row (e.g. dtype), over the dataset's."""
    facts: dict | None = None
    """ModelSpec fields over the catalog entry (nested dicts merge), or for migration rows num_experts / hidden_size / d_ffn."""
    nodes: int | None = Field(default=None, ge=1, le=MAX_NODES)
    """Nodes of the run."""
    seq_len: int | None = Field(default=None, ge=1)
    """Overrides the dataset's training.seq_len."""
    global_batch: int | None = Field(default=None, ge=1)
    """Overrides the dataset's training.global_batch."""
    parallel: dict | None = None
    """ParallelPlan fields of the published run (num_microbatches derived when absent)."""
    search: dict | None = None
    """SearchOptions fields: predict the best plan the search finds (configs not published)."""
    stage: int | None = Field(default=None, ge=0)
    """Pipeline stage a memory quantity is read from (default: the peak-memory stage)."""
    migration: dict | None = None
    """expert_migration arguments for this row, over the dataset's."""
    options: dict | None = None
    """CostOptions fields for this row (e.g. dropout), over the dataset's."""
    tolerance_pct: float | None = Field(default=None, gt=0, le=MAX_TOLERANCE_PCT)
    """Overrides the dataset's row tolerance."""
    gated: bool = True
    """False: reported, never fails the suite (a known inconsistency of the source, explained in ``note``)."""
    split: Literal["fit", "held_out"] | None = None
    """Overrides the dataset's split: 'fit' rows fed a fitted parameter and cannot validate it."""
    note: str | None = None
    """Why a row is ungated, or what was assumed."""

    @model_validator(mode="after")
    def _one_plan_source(self) -> "RowSpec":
        """The published configuration or a search for one, not both: the search would silently win."""
        if self.parallel is not None and self.search is not None:
            raise ValueError("give parallel (the published configuration) or search (for an unpublished one), "
                             "not both")
        return self


class DatasetSpec(Spec):
    """One ``validation/<name>.yaml`` file."""

    name: Name
    """Dataset name (the file stem; one line, not blank: tables and errors print it)."""
    description: str
    """What was measured, on what."""
    citation: str
    """Where the numbers come from."""
    platform: str
    """Platform catalog name the rows ran on."""
    used_for_fitting: bool
    """True when any row fed a fitted parameter (efficiency, overlap, seed calibration): labelled as such."""
    fitted: str | None = None
    """Which parameters the fit rows set, and where they live."""
    use_calibration: bool = True
    """Read calibration/<platform>/ when present (False: the platform's roofline efficiencies)."""
    tolerance_pct: Tolerance
    """Tolerances the suite enforces."""
    require_fit: bool = False
    """Every row's plan, gated or not, must be predicted to fit in device memory (the runs did)."""
    goal_mean_pct: float | None = Field(default=None, gt=0)
    """A stricter mean the project aims for (reported, not enforced)."""
    training: dict = {}
    """TrainingSpec fields shared by the rows."""
    options: dict = {}
    """CostOptions fields shared by the rows."""
    migration: dict = {}
    """expert_migration arguments shared by migration rows (bytes_per_param, matrices, gpus, bandwidth_Bps)."""
    notes: str | None = None
    """Free text shown under the dataset."""
    rows: list[RowSpec] = Field(min_length=1)
    """The datapoints."""


class MigrationFacts(Spec):
    """The layer a migration row prices (cost.step.expert_migration): E, d and d_ffn, bounded as ModelSpec's."""

    num_experts: int = Field(ge=1, le=MAX_EXPERTS)
    hidden_size: Width
    d_ffn: Width


class MigrationArgs(Spec):
    """expert_migration's arguments a dataset or row sets (None: expert_migration's own default)."""

    bytes_per_param: int | None = Field(default=None, ge=1, le=64)
    matrices: int | None = Field(default=None, ge=1, le=8)
    gpus: int | None = Field(default=None, ge=1, le=MAX_RANKS)
    bandwidth_Bps: float | None = Field(default=None, ge=1.0, le=1e15)   # B/s; below 1, a time of inf s


# ---- results -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowResult:
    """One row predicted: rel_error is a signed fraction; detail names the plan used."""

    id: str
    quantity: str
    published: float
    predicted: float | None
    rel_error: float | None
    tolerance_pct: float
    gated: bool
    split: str
    detail: dict = field(default_factory=dict)
    note: str | None = None

    @property
    def abs_pct_error(self) -> float | None:
        return None if self.rel_error is None else abs(self.rel_error) * 100

    @property
    def ok(self) -> bool:
        """Gated rows must be predicted and within tolerance; ungated rows always pass."""
        if not self.gated:
            return True
        return self.abs_pct_error is not None and self.abs_pct_error <= self.tolerance_pct

    def to_dict(self) -> dict:
        return {"id": self.id, "quantity": self.quantity, "published": self.published, "predicted": self.predicted,
                "rel_error": self.rel_error, "abs_pct_error": self.abs_pct_error, "tolerance_pct": self.tolerance_pct,
                "gated": self.gated, "split": self.split, "ok": self.ok, "detail": self.detail, "note": self.note}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class DatasetResult:
    """A dataset's rows and its summary (percent)."""

    spec: DatasetSpec
    rows: list[RowResult]

    def _errors(self, split: str | None = None) -> list[float]:
        return [r.abs_pct_error for r in self.rows
                if r.gated and r.abs_pct_error is not None and (split is None or r.split == split)]

    @property
    def mean_abs_pct_error(self) -> float | None:
        return _mean(self._errors())

    @property
    def max_abs_pct_error(self) -> float | None:
        errors = self._errors()
        return max(errors) if errors else None

    @property
    def held_out_mean_abs_pct_error(self) -> float | None:
        return _mean(self._errors("held_out"))

    def violations(self) -> list[str]:
        """One line per gated row outside its tolerance, per row predicted not to fit where the dataset requires
        every row to, and for the mean."""
        out = [f"{self.spec.name}/{r.id}: {_fmt_err(r)} > {r.tolerance_pct:g}%" for r in self.rows if not r.ok]
        if self.spec.require_fit:
            out += [f"{self.spec.name}/{r.id}: predicted not to fit ({r.detail.get('peak_memory_GiB', 0):.1f} GiB), "
                    "but the published run ran" for r in self.rows if r.detail.get("fits") is False]
        mean, which = self.gate_mean_abs_pct_error
        if mean is not None and mean > self.spec.tolerance_pct.mean:
            out.append(f"{self.spec.name}: {which} |error| {mean:.2f}% > {self.spec.tolerance_pct.mean:g}%")
        return out

    def ungated_summary(self) -> str | None:
        """One line on the held-out rows reported but not gated (mean and max |error|, how many within their row
        tolerance), None when there are none: where a dataset not yet gated stands."""
        rows = [r for r in self.rows if not r.gated and r.split == "held_out" and r.abs_pct_error is not None]
        if not rows:
            return None
        errors = [r.abs_pct_error for r in rows]
        within = sum(r.abs_pct_error <= r.tolerance_pct for r in rows)
        held_out = [r.abs_pct_error for r in self.rows if r.split == "held_out" and r.abs_pct_error is not None]
        return (f"not gated: {len(rows)} held-out rows, mean |error| {_mean(errors):.2f}%, max {max(errors):.2f}%, "
                f"{within} within their row tolerance; all {len(held_out)} held-out rows, gated or not: mean |error| "
                f"{_mean(held_out):.2f}%{self._fit_summary()}")

    def _fit_summary(self) -> str:
        """Where the dataset requires its published runs to fit: how many of its rows are predicted to (and which
        not, with their peak memory)."""
        if not self.spec.require_fit:
            return ""
        fitting = sum(r.detail.get("fits") is True for r in self.rows)
        if fitting == len(self.rows):
            return f"; all {len(self.rows)} rows predicted to fit"
        named = [f"{r.id} ({r.detail['peak_memory_GiB']:.1f} GiB)" for r in self.rows if r.detail.get("fits") is False]
        named += [f"{r.id} (not priced)" for r in self.rows if "fits" not in r.detail]
        return f"; {fitting} of {len(self.rows)} rows predicted to fit, not: {', '.join(named)}"

    @property
    def gate_mean_abs_pct_error(self) -> tuple[float | None, str]:
        """(mean, its name) the dataset's mean tolerance holds: over the gated held-out rows where there are any (a
        fit row fed a constant and cannot test it), else over every gated row."""
        held_out = self.held_out_mean_abs_pct_error
        return (held_out, "held-out mean") if held_out is not None else (self.mean_abs_pct_error, "mean")

    def to_dict(self) -> dict:
        s = self.spec
        return {"name": s.name, "description": s.description, "citation": s.citation, "platform": s.platform,
                "used_for_fitting": s.used_for_fitting, "fitted": s.fitted,
                "tolerance_pct": {"row": s.tolerance_pct.row, "mean": s.tolerance_pct.mean},
                "goal_mean_pct": s.goal_mean_pct, "mean_abs_pct_error": self.mean_abs_pct_error,
                "max_abs_pct_error": self.max_abs_pct_error,
                "held_out_mean_abs_pct_error": self.held_out_mean_abs_pct_error,
                "violations": self.violations(), "rows": [r.to_dict() for r in self.rows]}


def _fmt_err(r: RowResult) -> str:
    return "no prediction" if r.abs_pct_error is None else f"|error| {r.abs_pct_error:.2f}%"


# ---- loading -----------------------------------------------------------------------------------------
def validation_dir() -> Path:
    from piper_plan.catalog import project_root

    return project_root() / "validation"


def dataset_names(folder: Path | None = None) -> list[str]:
    """The datasets of ``folder`` (validation/); one error line where it holds none."""
    from piper_plan.catalog import required_names

    return required_names(folder or validation_dir(), "validation dataset")


def dataset_path(name_or_path: str | Path) -> Path:
    """validation/<name>.yaml for a name, else the path given."""
    path = Path(name_or_path)
    if not path.suffix:
        path = validation_dir() / f"{name_or_path}.yaml"
        if not path.is_file():
            raise PiperError(f"unknown dataset {str(name_or_path)!r}; known: {', '.join(dataset_names())}",
                             field="--dataset")
    return path


def load_dataset(name_or_path: str | Path) -> DatasetSpec:
    """A dataset by name (validation/<name>.yaml) or path; a bad file is one PiperError line."""
    from piper_plan.catalog import load_platform, read_structured

    path = dataset_path(name_or_path)
    spec = parse_spec(DatasetSpec, read_structured(path), str(path))
    ids = [r.id for r in spec.rows]
    if len(set(ids)) != len(ids):
        raise PiperError(f"duplicate row ids in {sorted(i for i in set(ids) if ids.count(i) > 1)}", path=str(path))
    from piper_plan.cost.options import cost_options
    from piper_plan.specs import TrainingSpec

    try:                                          # the dataset's shared settings, then every row's inputs:
        cost_options(spec.options)                # a bad one is found before any row is priced
        in_field("platform", load_platform, spec.platform)
        parse_spec(TrainingSpec, spec.training, "", field="training")
        parse_spec(MigrationArgs, spec.migration, "", field="migration")
    except PiperError as exc:
        raise PiperError(exc.message, path=str(path), field=exc.field) from None
    for row in spec.rows:
        in_row(row, path, check_row, spec, row)
    return spec


def in_field(field: str, fn, *args):
    """``fn(*args)``, a PiperError from it named by ``field`` (a file of its own kept in the message)."""
    try:
        return fn(*args)
    except PiperError as exc:
        raise PiperError(f"{exc.path}: {exc.message}" if exc.path else exc.message, field=field) from None


def in_row(row: RowSpec, path, fn, *args):
    """``fn(*args)``, a PiperError from it named by the dataset file and ``rows[<id>].<field>`` (a file of its own,
    such as the row's model, kept in the message)."""
    try:
        return fn(*args)
    except PiperError as exc:
        message = exc.message if not exc.path or exc.path == str(path) else f"{exc.path}: {exc.message}"
        field = f"rows[{row.id}]" + (f".{exc.field}" if exc.field else "")
        raise PiperError(message, path=str(path) if path else None, field=field) from None


def check_row(spec: DatasetSpec, row: RowSpec) -> None:
    """Every input of ``row`` validated as the spec it becomes (options, training, plan, search options, model
    and its facts, migration arguments); a bad one is a PiperError on the row's field."""
    row_options(spec, row)
    if row.quantity in MIGRATION_QUANTITIES:
        _not_read(row, ("training", "search", "parallel", "nodes", "seq_len", "global_batch", "stage"),
                  "a migration row (its layer's facts and migration arguments set it)")
        migration_inputs(spec, row)
        return
    if not row.quantity.startswith("memory."):
        _not_read(row, ("stage",), f"a {row.quantity} row (stage picks a memory row's stage)")
    if row.nodes is None:
        raise PiperError("needs nodes", field="nodes")
    training = row_training(spec, row)
    model = row_model(row)
    if row.search is not None:
        row_search(row)
    else:
        from piper_plan.catalog import load_platform
        from piper_plan.plans import check_plan

        check_plan(model, load_platform(row.platform or spec.platform), training, row.nodes, row_plan(row, training))
    check_layout_mtp((row.parallel or {}).get("virtual_stage_layers"), model.mtp_layers)


def _not_read(row: RowSpec, fields: tuple[str, ...], what: str) -> None:
    """One error line where ``row`` sets a field its quantity never reads (before, read as given and ignored)."""
    given = [name for name in fields if getattr(row, name) is not None]
    if given:
        raise PiperError(f"{given[0]} does not apply to {what}; allowed: leave it out", field=given[0])


def row_search(row: RowSpec):
    from piper_plan.search.space import SearchOptions

    return parse_spec(SearchOptions, row.search or {}, "", field="search")


def migration_inputs(spec: DatasetSpec, row: RowSpec) -> tuple[MigrationFacts, dict]:
    """(the layer, expert_migration's keyword arguments) of a migration row: its facts, with what they lack from
    its model; the dataset's migration arguments, the row's over them."""
    facts = dict(row.facts or {})
    if row.model is not None and not {"num_experts", "hidden_size", "d_ffn"} <= facts.keys():
        m = row_model(row)
        facts = {"num_experts": m.moe.num_experts, "hidden_size": m.hidden_size,
                 "d_ffn": m.moe.expert.intermediate_size, **facts} if m.moe is not None else facts
    args = parse_spec(MigrationArgs, {**spec.migration, **(row.migration or {})}, "", field="migration")
    layer = parse_spec(MigrationFacts, facts, "", field="facts")
    from piper_plan.cost.step import TABLE_IV_GPUS

    gpus = args.gpus if args.gpus is not None else TABLE_IV_GPUS
    if layer.num_experts % gpus:
        raise PiperError(f"{layer.num_experts} experts do not divide over {gpus} GPUs (migration.gpus); a layer's "
                         "experts are reassigned in equal shares (as `piper migrate simulate` requires)",
                         field="facts.num_experts")
    return layer, args.model_dump(exclude_none=True)


# ---- prediction --------------------------------------------------------------------------------------
class _Inputs:
    """Loaded specs shared by the rows of one dataset (each platform and its calibration loaded once)."""

    def __init__(self, spec: DatasetSpec):
        self.spec = spec
        self._platforms: dict[str, tuple] = {}
        self.platform, self.calibration = self.platform_of(None)

    def platform_of(self, row: RowSpec | None):
        """(platform, calibration or None) of a row: its own platform, else the dataset's."""
        from piper_plan.catalog import has_calibration, load_platform

        name = (row.platform if row is not None else None) or self.spec.platform
        if name not in self._platforms:
            platform, calibration = load_platform(name), None
            if self.spec.use_calibration and has_calibration(platform.name):
                from piper_plan.calibration import load_calibration

                calibration = load_calibration(platform.name)
            self._platforms[name] = (platform, calibration)
        return self._platforms[name]

    def model(self, row: RowSpec):
        return row_model(row)

    def training(self, row: RowSpec):
        return row_training(self.spec, row)

    def options(self, row: RowSpec):
        return row_options(self.spec, row)


def row_model(row: RowSpec):
    """The row's model: the catalog entry (or file) with the row's ``facts`` merged over it."""
    from piper_plan.catalog import load_model
    from piper_plan.specs import ModelSpec

    if row.model is None:
        raise PiperError("needs a model", field="model")
    try:
        model = load_model(row.model)
    except PiperError as exc:                     # an unknown name, or the model file's own mistake (its path kept)
        raise PiperError(f"{exc.path}: {exc.message}" if exc.path else exc.message, field="model") from None
    if not row.facts:
        return model
    return parse_spec(ModelSpec, _deep_merge(model.model_dump(mode="json"), row.facts), "", field="facts")


def row_options(spec: DatasetSpec, row: RowSpec):
    """The row's CostOptions: the dataset's options, the row's over them."""
    from piper_plan.cost.options import cost_options

    return cost_options({**spec.options, **(row.options or {})})


def row_training(spec: DatasetSpec, row: RowSpec):
    """The row's TrainingSpec: the dataset's training, the row's over it, its seq_len and global_batch last."""
    from piper_plan.specs import TrainingSpec

    values = {**spec.training, **(row.training or {})}
    values.update({k: v for k, v in (("seq_len", row.seq_len), ("global_batch", row.global_batch)) if v})
    return parse_spec(TrainingSpec, values, "", field="training")


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def row_plan(row: RowSpec, training):
    """The ParallelPlan of a row with a published configuration."""
    from piper_plan.specs import ParallelPlan

    values = dict(row.parallel or {})
    dp, mbs = values.get("dp", 1), values.get("mbs", 1)
    if "num_microbatches" not in values and all(type(v) is int and v >= 1 for v in (dp, mbs)):
        values["num_microbatches"] = max(training.global_batch // (dp * mbs), 1)
    return parse_spec(ParallelPlan, values, "", field="parallel")


def best_plan(inputs: _Inputs, row: RowSpec, model, training):
    """(plan, search summary) of the search library's best plan for the row."""
    from piper_plan.search.engine import search

    platform, calibration = inputs.platform_of(row)
    result = search(model, platform, training, row.nodes, row_search(row), calibration=calibration)
    if not result.feasible:
        return None, {"feasible": 0, "reasons": result.reasons}
    i = result.best
    best = result.row(i)
    plan = result.plan(model, training, i)
    return plan, {"feasible": result.feasible, "searched": result.candidates_total,
                  "search_tflops_per_device": best["tflops_per_device"]}


def plan_quantity(quantity: str, est, stage: int | None = None) -> float:
    """A plan quantity from an ``Estimate``; memory of ``stage`` (default: the peak-memory stage)."""
    if quantity in ("step_time_s", "tflops_per_device", "mfu"):
        return float(getattr(est, quantity))
    stages = est.memory.per_stage
    if stage is not None and stage >= len(stages):
        raise PiperError(f"{stage}; the plan has {len(stages)} pipeline stage(s): 0 to {len(stages) - 1}",
                         field="stage")
    chosen = max(stages, key=lambda s: s.total_bytes) if stage is None else stages[stage]
    comp = chosen.components
    if quantity == "memory.state_GiB":
        return sum(comp.get(k, 0.0) for k in ("weights", "gradients", "optimizer")) / GiB
    # what the layers save for backward (Korthikanti et al.'s figures), not the one layer a recompute rebuilds
    return sum(v for k, v in comp.items() if k.startswith("activations/") and k != "activations/recompute_working") \
        / GiB


def plan_summary(plan) -> dict:
    keys = ("dp", "cp", "tp", "pp", "ep", "etp", "mbs", "num_microbatches", "schedule", "virtual_stages", "recompute",
            "zero", "a2a", "sequence_parallel")
    return plan.model_dump(mode="json", include=set(keys))


def predict_plan_row(inputs: _Inputs, row: RowSpec) -> tuple[float | None, dict]:
    from piper_plan.cost.evaluate import estimate

    model, training = inputs.model(row), inputs.training(row)
    detail: dict = {}
    if row.search is not None:
        plan, detail = best_plan(inputs, row, model, training)
        if plan is None:
            return None, detail
    else:
        plan = row_plan(row, training)
    platform, calibration = inputs.platform_of(row)
    est = estimate(model, platform, training, row.nodes, plan, calibration=calibration, options=inputs.options(row))
    detail.update(plan=plan_summary(plan), step_time_s=est.step_time_s, tflops_per_device=est.tflops_per_device,
                  mfu=est.mfu, fits=est.fits, peak_memory_GiB=est.memory.peak_bytes / GiB)
    if row.quantity == "tokens_per_s_per_device":
        return est.tokens_per_s / plan.world, detail
    return plan_quantity(row.quantity, est, row.stage), detail


def predict_migration_row(inputs: _Inputs, row: RowSpec) -> tuple[float, dict]:
    """Piper Table IV: bytes per GPU and seconds to reassign one layer's experts (cost.step.expert_migration)."""
    from piper_plan.cost.step import expert_migration

    layer, args = migration_inputs(inputs.spec, row)
    nbytes, seconds = expert_migration(layer.num_experts, layer.hidden_size, layer.d_ffn, **args)
    detail = {"E": layer.num_experts, "d": layer.hidden_size, "d_ffn": layer.d_ffn, "bytes": nbytes,
              "seconds": seconds}
    value = {"migration.send_per_gpu_GB": nbytes / 1e9, "migration.send_per_gpu_GiB": nbytes / GiB,
             "migration.time_ms": seconds * 1e3}[row.quantity]
    return value, detail


def predict_row(inputs: _Inputs, row: RowSpec) -> RowResult:
    predict = predict_migration_row if row.quantity in MIGRATION_QUANTITIES else predict_plan_row
    predicted, detail = in_row(row, None, predict, inputs, row)
    rel = None if predicted is None else (predicted - row.published) / row.published
    split = row.split or ("fit" if inputs.spec.used_for_fitting else "held_out")
    return RowResult(id=row.id, quantity=row.quantity, published=row.published, predicted=predicted, rel_error=rel,
                     tolerance_pct=row.tolerance_pct or inputs.spec.tolerance_pct.row, gated=row.gated, split=split,
                     detail=detail, note=row.note)


def validate_dataset(spec: DatasetSpec) -> DatasetResult:
    """Predict every row of one dataset."""
    inputs = _Inputs(spec)
    return DatasetResult(spec, [predict_row(inputs, row) for row in spec.rows])


def validate(names: list[str] | None = None) -> list[DatasetResult]:
    """Every dataset (or the named ones), in name order."""
    return [_validated(name) for name in (names or dataset_names())]


def _validated(name_or_path: str | Path) -> DatasetResult:
    """One dataset validated; an error met while pricing its rows names the dataset file."""
    spec = load_dataset(name_or_path)
    try:
        return validate_dataset(spec)
    except PiperError as exc:
        if exc.path:
            raise
        raise PiperError(exc.message, path=str(dataset_path(name_or_path)), field=exc.field) from None


def all_violations(results: list[DatasetResult]) -> list[str]:
    return [v for r in results for v in r.violations()]
