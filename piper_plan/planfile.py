"""plan.json: the single source of truth of a run (DESIGN.md, "Shared file formats"; schema_version 4).

Written by ``estimate --save``, ``plan --save`` and ``launch``; read by ``launch``, ``compare``, ``calibrate fit``
and the runtime. The ``parallel`` block carries the derived ``edp`` and the resolved ``layers_per_stage`` so that
a reader never re-derives them; on reading, ``edp`` is checked against ``dp x cp x tp / (ep x etp)``, the plan against
the one validity check (``plans.check_plan``), and ``prediction`` against the ``Estimate`` schema: a file that
reads is a valid plan with a well-formed prediction.

Version 2 (2026-12) adds ``parallel.layers_split`` and a typed ``prediction`` (``specs.estimate.Estimate``).
Version-1 files are still read: their fields mean what they wrote (a v1 ``parallel`` block holds every field,
``sequence_parallel`` included), and their prediction must pass the same schema.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, PositiveInt

from piper_plan import __version__
from piper_plan.catalog import parse_spec, read_structured
from piper_plan.cost.options import PIPER_RUNTIME_OPTIONS, cost_options
from piper_plan.errors import PiperError
from piper_plan.fileio import atomic_write_json
from piper_plan.plans import check_plan
from piper_plan.specs import ModelSpec, ParallelPlan, PlatformSpec, TrainingSpec
from piper_plan.specs.base import NotBool, Spec
from piper_plan.specs.estimate import Estimate
from piper_plan.specs.model import MAX_EXPERTS, MoESpec, ffn_dicts
from piper_plan.specs.training import LOW_PRECISION_GEMM_DTYPES

SCHEMA_VERSION = 5
"""5 adds the FFN gate (model FFNs' activation, glu_linear_offset, activation_clamp); 4 added
platform.efficiency.fp8_blockwise_runs_as_mxfp8; 3 added training.fp8_recipe and platform.efficiency.
fp8_recipe_time (a piper that reads only older versions names the version instead of an unknown field); 2 added
parallel.layers_split and the typed prediction."""
READABLE_VERSIONS = (1, 2, 3, 4, 5)
GATE_FIELDS = ("activation", "glu_linear_offset", "activation_clamp")
"""FFNSpec's gate, which files before schema 5 could not state (upgraded_gates)."""

MAX_STEPS = 10**9
"""The most steps a run (or a checkpoint interval, a warmup, a migration interval or window) may take: at one step a
second, 31 years; a larger count is a typo, not a run."""
Steps = Annotated[int, Field(ge=1, le=MAX_STEPS)]
MAX_SWAP_ITERS = 10**6
"""The most hill-climbing swaps per layer of one migration check (placement/migration.py; the search ends sooner
when no swap lowers the load spread)."""


def _token_path(text: str) -> str:
    if not text.strip():
        raise ValueError("a token file's path, not blank (leave the field out for synthetic tokens)")
    return text


MAX_SEED = 2**63 - 1
"""The largest seed: numpy's SeedSequence takes a non-negative integer, torch.manual_seed one below 2^64 (the
runtime seeds each rank with seed + rank, rank < 2^20: still below)."""
UTILISATION_PAIRS = (("mfu", "hfu", 2.0), ("mfu_megatron", "hfu_megatron", 1.0))
"""The prediction's (model, hardware) FLOPs utilisations of one convention and their largest value, hardware's at
least model's (recomputation only adds FLOPs). Megatron's convention counts the FLOPs a causal model runs: at most
the device's peak. PaLM's counts attention non-causally (DESIGN.md, MFU), up to twice what a causal model runs, so
its figures may pass 1 where attention dominates; never 2."""
ROUNDING = 1e-6
"""Relative slack for a figure that equals another up to rounding (hfu = mfu where nothing is recomputed)."""
DERIVED_TOLERANCE = 0.01
"""Relative slack for a prediction's figure derived from its others (tokens_per_s, a2a_share, time to train): a
plan file written by hand may round them (3 significant digits: 0.5%)."""
MAX_RUNTIME_FACTOR = 1e4
"""The largest learning rate, loss weight, weight decay or clipping norm a run takes: far above any that trains
(LLaMA's peak rate is 3e-4), far below float32's 3.4e38, in which torch's optimizers and losses take them (a
larger one overflows there: "value cannot be converted to type float without overflow")."""
RuntimeFactor = Annotated[float, Field(ge=0, le=MAX_RUNTIME_FACTOR)]
"""A weight or coefficient of the runtime: 0 (off) to MAX_RUNTIME_FACTOR."""
PositiveRuntimeFactor = Annotated[float, Field(gt=0, le=MAX_RUNTIME_FACTOR)]
"""A rate or a norm of the runtime: above 0, at most MAX_RUNTIME_FACTOR."""


class MoEBlock(Spec):
    """Routing settings of the run."""

    capacity_factor: float | None = MoESpec.model_fields["capacity_factor"]
    """Tokens per expert capped at capacity_factor x mean; None = dropless (the model spec's field and bounds)."""
    routing_skew: float = Field(default=1.0, ge=1.0, le=MAX_EXPERTS)
    """Expected max / mean tokens per expert-parallel rank the prediction assumed (the training block's, written
    beside it: parse_plan_dict holds them equal)."""


class MigrationBlock(Spec):
    """Expert migration (Piper paper): when and how hard to rebalance. The one settings model of migration:
    plan.json's block, ``piper plan``'s defaults and the runtime's settings (runtime/migration.py)."""

    enabled: bool = True
    """Run the load monitor and the swap planner."""
    threshold: float = Field(default=1.1, ge=1.0)
    """Migrate when max / mean tokens per rank of an EP group exceeds this."""
    interval: Steps = 50
    """Steps between checks."""
    max_iters: Annotated[int, Field(ge=1, le=MAX_SWAP_ITERS)] = 16
    """Hill-climbing swap iterations per check."""
    window: Steps | None = None
    """Steps of load history the swap planner sees (None = ``interval``)."""

    @property
    def window_steps(self) -> int:
        return self.window or self.interval


class RuntimeBlock(Spec):
    """What the runtime does with the plan: the one place of its settings and their defaults (``piper run``'s
    options only override them). Optimizer defaults follow LLaMA (Touvron et al. 2023, section 2.2: AdamW,
    weight decay 0.1, gradient clipping 1.0, cosine decay to 10% of the peak rate after a warmup)."""

    data: Annotated[str, AfterValidator(_token_path)] | None = None
    """Token data (None = synthetic)."""
    steps: Steps = 100
    """Optimizer steps to run."""
    checkpoint_interval: Steps = 50
    """Steps between checkpoints; the run's last step is checkpointed too (``--resume`` continues a run that
    ended between two of them, e.g. under another layout)."""
    keep_checkpoints: Steps = 2
    """Complete checkpoints kept in RUN_DIR/checkpoints/ (the newest ones; older ones are deleted after ``latest``
    moves to a new one)."""
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] = 0
    """Random seed: 0 to 2^63 - 1."""
    lr: PositiveRuntimeFactor = 1e-3
    """Peak learning rate: above 0, at most 1e4."""
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    """After the warmup: cosine decay to ``min_lr_ratio x lr`` at the last step, or constant."""
    warmup_steps: Annotated[int, Field(ge=0, le=MAX_STEPS)] = 10
    """Steps of linear warmup from lr / (warmup_steps + 1) to lr."""
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    """Learning rate at the last step of the cosine decay, as a fraction of ``lr``."""
    weight_decay: RuntimeFactor = 0.1
    """AdamW's decoupled weight decay (matrices only: norms, biases and the router bias are not decayed)."""
    grad_clip_norm: PositiveRuntimeFactor | None = 1.0
    """Clip the global gradient norm (every rank's gradients together) to this; None = no clipping."""
    aux_loss_coeff: RuntimeFactor = 0.01
    """Switch balance-loss coefficient (0 = off; at most 1e4)."""
    mtp_loss_weight: RuntimeFactor = 0.1
    """lambda, the weight of the multi-token-prediction loss (the mean over the model's MTP modules) added to the
    next-token loss (runtime/pipeline.py MTPLoss). 0.1: Megatron-Core's ``mtp_loss_scaling_factor`` default and
    DeepSeek-V3's value for its last 4.8T tokens (0.3 for the first 10T; report sec. 4.2). Unused without MTP."""
    loss_chunk_rows: PositiveInt | None = PIPER_RUNTIME_OPTIONS.loss_chunk_rows
    """Logit rows (tokens) the LM loss computes at once: a micro-batch with more is split into chunks whose
    fp32 logits exist one at a time (runtime/pipeline.py ChunkedLoss); None = the whole micro-batch at once."""
    shared_expert_overlap: bool = PIPER_RUNTIME_OPTIONS.shared_expert_overlap
    """Run the shared experts while the expert dispatch exchange is in flight, in forward and backward
    (runtime/moe.py; Megatron-Core's ``moe_shared_expert_overlap``). The flat dispatcher overlaps; HALO's three
    phases run to completion first."""

    def weight_decay_for(self, optimizer: str) -> float:
        """The weight decay the runtime applies under ``optimizer``: AdamW's decoupled decay; none under SGD, whose
        weight_decay would be an L2 term, not AdamW's decay."""
        return self.weight_decay if optimizer == "adam" else 0.0


class PlanFile(Spec):
    """The parsed plan.json."""

    schema_version: Annotated[Literal[READABLE_VERSIONS], NotBool] = SCHEMA_VERSION
    """Format version."""
    piper_version: str = __version__
    """piper version that wrote the file."""
    model: ModelSpec
    platform: PlatformSpec
    training: TrainingSpec
    nodes: PositiveInt
    """Nodes of the allocation."""
    placement: Literal["compact", "spread"] = "compact"
    """Allocation shape: compact or spread (placement.layout.PLACEMENTS)."""
    parallel: ParallelPlan
    moe: MoEBlock = MoEBlock()
    migration: MigrationBlock = MigrationBlock()
    runtime: RuntimeBlock = RuntimeBlock()
    prediction: Estimate | None = None
    """The cost model's estimate of this plan (None: not priced)."""


def _block(cls, value):
    if value is None:
        return cls()
    return value if isinstance(value, cls) else cls.model_validate(value)


def parallel_block(model, plan: ParallelPlan, prediction: Estimate | None) -> dict:
    """A plan.json's ``parallel`` object (also `estimate --json`'s): the plan with its layer split resolved into
    the explicit list its prediction priced, and the derived ``edp``."""
    parallel = plan.model_dump(mode="json")
    if prediction is not None and prediction.layers_per_stage:     # the split the prediction priced
        parallel.update(layers_per_stage=prediction.layers_per_stage, layers_split="explicit")
    elif plan.layers_per_stage is None and plan.layers_split in ("even", "auto") and plan.pp <= model.num_layers:
        # not priced: the split is fixed to the even one, which the runtime would use for this plan anyway
        parallel.update(layers_per_stage=plan.stage_layers(model.num_layers), layers_split="explicit")
    parallel["edp"] = plan.edp
    return parallel


def plan_file_dict(model, platform, training, nodes, plan: ParallelPlan, placement, prediction: Estimate | None,
                   moe=None, migration=None, runtime=None) -> dict:
    """The JSON object of a plan.json (no I/O)."""
    parallel = parallel_block(model, plan, prediction)
    moe_block = _block(MoEBlock, moe if moe is not None else {
        "capacity_factor": model.moe.capacity_factor if model.moe else None,
        "routing_skew": training.routing_skew})
    return {
        "schema_version": SCHEMA_VERSION, "piper_version": __version__,
        "model": model.model_dump(mode="json"), "platform": platform.model_dump(mode="json"),
        "training": training.model_dump(mode="json"), "nodes": nodes, "placement": placement,
        "parallel": parallel, "moe": moe_block.model_dump(mode="json"),
        "migration": _block(MigrationBlock, migration).model_dump(mode="json"),
        "runtime": _block(RuntimeBlock, runtime).model_dump(mode="json"),
        "prediction": None if prediction is None else prediction.to_json(),
    }


def write_plan_file(path, model, platform, training, nodes, plan, placement, prediction: Estimate | None,
                    moe=None, migration=None, runtime=None) -> Path:
    """Write plan.json atomically (after everything it holds has been computed)."""
    data = plan_file_dict(model, platform, training, nodes, plan, placement, prediction, moe, migration, runtime)
    parse_plan_dict(data, str(path))                     # never write a file the reader would reject
    return atomic_write_json(path, data)


def parse_plan_dict(data: dict, path: str) -> PlanFile:
    """Validate a plan.json object; errors name the file and the field."""
    version = data.get("schema_version")
    if type(version) is not int or version not in READABLE_VERSIONS:   # not True, not 3.0
        raise PiperError(f"{version!r}; this piper reads {', '.join(map(str, READABLE_VERSIONS))} (save the plan "
                         "again with this piper)", path=path, field="schema_version")
    data = dict(data)
    if data.get("prediction") == {}:                    # written before the plan was priced: no prediction
        data["prediction"] = None
    edp = None
    if isinstance(data.get("parallel"), dict):          # anything else: parse_spec names the field and type
        parallel = dict(data["parallel"])
        edp = parallel.pop("edp", None)
        data["parallel"] = parallel
    plan_file = parse_spec(PlanFile, data, path)
    if version < 5:
        plan_file = plan_file.model_copy(update={"model": upgraded_gates(plan_file.model)})
    if edp is not None and edp != plan_file.parallel.edp:
        raise PiperError(f"edp={edp} but dp x cp x tp / (ep x etp) = {plan_file.parallel.edp}", path=path,
                         field="parallel.edp")
    if plan_file.moe.routing_skew != plan_file.training.routing_skew:
        raise PiperError(f"{plan_file.moe.routing_skew!r}, but training.routing_skew is "
                         f"{plan_file.training.routing_skew!r}; allowed: the same skew (piper writes it in both)",
                         path=path, field="moe.routing_skew")
    model_factor = plan_file.model.moe.capacity_factor if plan_file.model.moe else None
    if plan_file.moe.capacity_factor != model_factor:     # an export reads one block, the cost model the other
        raise PiperError(f"{json.dumps(plan_file.moe.capacity_factor)}, but model.moe.capacity_factor is "
                         f"{json.dumps(model_factor)}; "
                         "allowed: the same factor (piper writes it in both; null = dropless)", path=path,
                         field="moe.capacity_factor")
    if plan_file.training.dtype in LOW_PRECISION_GEMM_DTYPES:  # an 8-bit recipe its own hardware has no rate for:
        try:                                                  # an export would ask the engine for it
            plan_file.platform.peak_flops(plan_file.training.dtype)
        except PiperError as exc:
            raise PiperError(exc.message, path=path, field="training.dtype") from None
    check_plan(plan_file.model, plan_file.platform, plan_file.training, plan_file.nodes, plan_file.parallel, path)
    check_prediction(plan_file, path)
    if plan_file.prediction is not None:                # every reader prices with them: checked once, here
        try:
            cost_options(dict(plan_file.prediction.options))
        except PiperError as exc:
            raise PiperError(exc.message, path=path, field=f"prediction.{exc.field or 'options'}") from None
    return plan_file


def upgraded_gates(model: ModelSpec) -> ModelSpec:
    """A model of a file before schema 5, which could not state an FFN's gate: the catalog model of its name where
    the two differ in nothing else (gpt-oss's clamped quick-GELU, Grok-1's GELU gate), else itself (SwiGLU /
    GELU, what those files meant)."""
    from piper_plan.catalog import catalog_names, load_model, models_dir

    if model.name not in catalog_names(models_dir()):
        return model
    catalog = load_model(model.name)
    return catalog if _without_gates(catalog) == _without_gates(model) else model


def _without_gates(model: ModelSpec) -> dict:
    """``model`` as data with every FFN's gate fields removed."""
    data = model.model_dump()
    for ffn in ffn_dicts(data):
        for name in GATE_FIELDS:
            ffn.pop(name, None)
    return data


def check_prediction(plan_file: PlanFile, path: str) -> None:
    """Refuse figures no estimate can hold (a hand-edited prediction): a utilisation beyond its convention's largest
    (UTILISATION_PAIRS) or a hardware one below its model one. A prediction of another batch or platform (the plan
    edited beside it) is not refused here: launch prices the plan again and the job carries that prediction
    (launch/job.py)."""
    pred = plan_file.prediction
    if pred is None:
        return
    if pred.nodes != plan_file.nodes:                 # before: blamed on tokens_per_s, which it derives
        raise PiperError(f"{pred.nodes}, but nodes is {plan_file.nodes}; allowed: the plan's own node count (piper "
                         "writes it in both)", path=path, field="prediction.nodes")
    for model_name, hardware_name, largest in UTILISATION_PAIRS:
        model_u, hardware_u = getattr(pred, model_name), getattr(pred, hardware_name)
        for name, value in ((model_name, model_u), (hardware_name, hardware_u)):
            if value is not None and value > largest:
                raise PiperError(f"{value!r} is not allowed; allowed: 0 to {largest:g} (the device's peak FLOP/s"
                                 f"{'' if largest == 1 else ', attention counted non-causally'})", path=path,
                                 field=f"prediction.{name}")
        if model_u is not None and hardware_u is not None and hardware_u < model_u * (1 - ROUNDING):
            raise PiperError(f"{hardware_u!r} is below {model_name}={model_u!r}; allowed: at least {model_name} "
                             "(it counts the same FLOPs plus what recomputation repeats)", path=path,
                             field=f"prediction.{hardware_name}")
    _check_derived_figures(pred, plan_file.platform.devices_per_node, path)
    _check_prediction_shape(pred, plan_file.parallel, path)


def _check_prediction_shape(pred: Estimate, plan: ParallelPlan, path: str) -> None:
    """A prediction of this plan has one memory row per pipeline stage, the plan's own layer split where the plan
    states one, and a known scope for each group (a hand-edited prediction was shown as the plan's)."""
    from piper_plan.specs.platform import SCOPES

    if len(pred.memory.per_stage) != plan.pp:
        raise PiperError(f"{len(pred.memory.per_stage)} stages, but parallel.pp is {plan.pp}; allowed: one row per "
                         "pipeline stage", path=path, field="prediction.memory.per_stage")
    if pred.layers_per_stage and plan.layers_per_stage and list(pred.layers_per_stage) != list(plan.layers_per_stage):
        raise PiperError(f"{list(pred.layers_per_stage)}, but parallel.layers_per_stage is "
                         f"{list(plan.layers_per_stage)}; allowed: the split the plan states", path=path,
                         field="prediction.layers_per_stage")
    for group, scope in pred.scopes.items():
        if scope not in SCOPES:
            raise PiperError(f"{scope!r} is not a scope; allowed: {', '.join(SCOPES)}", path=path,
                             field=f"prediction.scopes.{group}")


def _check_derived_figures(pred: Estimate, devices_per_node: int, path: str) -> None:
    """The figures a prediction derives from its others (cost/evaluate.py) must agree with them: a hand-edited
    tokens_per_s or a2a_share was shown by `compare` and `export` as the plan's prediction."""
    from piper_plan.specs.vocab import A2A_TIME_PREFIX

    a2a_s = sum(v for k, v in pred.time.breakdown.items() if k.startswith(A2A_TIME_PREFIX))
    devices = pred.nodes * devices_per_node
    derived = (("a2a_share", pred.a2a_share, a2a_s / pred.step_time_s,
                f"the {A2A_TIME_PREFIX} terms of time.breakdown / step_time_s"),
               ("tokens_per_s", pred.tokens_per_s, pred.tflops_per_device * 1e12 * devices / pred.model_flops_per_token
                if pred.model_flops_per_token > 0 else pred.tokens_per_s,
                "tflops_per_device x 1e12 x devices / model_flops_per_token"),
               ("training.time_to_train_s", pred.training.time_to_train_s, pred.training.steps * pred.step_time_s,
                "training.steps x step_time_s"))
    for name, value, expected, formula in derived:
        if abs(value - expected) > DERIVED_TOLERANCE * abs(expected) + 1e-12:
            raise PiperError(f"{value!r}, but {formula} = {expected:.6g}; allowed: within {DERIVED_TOLERANCE:.0%} of "
                             "it (the prediction derives it)", path=path, field=f"prediction.{name}")


PLATFORM_BLOCK_FIELDS = ("device", "node", "network", "efficiency", "memory", "launch", "max_nodes")
"""PlatformSpec's fields but ``name`` and ``description`` (which the model block has too): an error naming one
without a file (a platform's own check, e.g. ``PlatformSpec.peak_flops``) is about the plan's ``platform`` block."""


def in_plan_file(exc: PiperError, path) -> PiperError:
    """``exc`` naming the plan file ``path`` where it names no file, and a field of the plan's platform block as the
    plan file spells it (``launch.env.A`` -> ``platform.launch.env.A``); ``exc`` itself where it names a file."""
    if exc.path:
        return exc
    field = exc.field
    if field and field.split(".")[0] in PLATFORM_BLOCK_FIELDS:
        field = f"platform.{field}"
    return PiperError(exc.message, path=str(path), field=field)


def does_not_fit(prediction: Estimate | None, whose: str = "the plan's own prediction") -> str | None:
    """Why the plan's own prediction (or ``whose``) does not fit the device (launch refuses it, export warns), or
    None."""
    if prediction is None or prediction.fits:
        return None
    mem = prediction.memory
    return (f"{whose} does not fit: peak {mem.peak_bytes / 2**30:.2f} GiB of "
            f"{mem.device_bytes / 2**30:.2f} GiB per device")


def priced_from_calibration(plan_file: PlanFile) -> bool:
    """Whether the file's prediction took its compute rates from calibration/<platform>/ (its sources say so)."""
    stored = plan_file.prediction
    return stored is not None and stored.sources.compute.startswith("calibration")


def read_plan_file(path) -> PlanFile:
    """Read and validate plan.json."""
    return parse_plan_dict(read_structured(Path(path)), str(path))
