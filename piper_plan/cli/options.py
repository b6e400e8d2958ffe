"""Option bundles shared by the commands, declared once, and the loading of what they name.

Each bundle is a decorator; ``@model_options @training_options`` on a command adds the options and their help.
``load_setting`` turns the shared options into (model, platform, training) with one-line errors.
"""

from __future__ import annotations

import typing

import click

from piper_plan.cli.common import AsciiInt
from piper_plan.errors import PiperError
from piper_plan.fileio import ascii_int
from piper_plan.specs.parallel import ParallelPlan, check_layout_mtp
from piper_plan.specs.training import Fp8Recipe, TrainingSpec
from piper_plan.specs.vocab import A2A, LayerSplit, Placement, Recompute, Schedule

DTYPES: tuple[str, ...] = typing.get_args(TrainingSpec.model_fields["dtype"].annotation)
"""Training precisions (TrainingSpec.dtype)."""

FP8_RECIPES: tuple[str, ...] = typing.get_args(Fp8Recipe)
"""fp8 recipes (TrainingSpec.fp8_recipe)."""

DEFAULT_SEQ_LEN = TrainingSpec.model_fields["seq_len"].default
"""--seq when not given: min(this, the model's max_seq_len)."""


def _plan_default(name: str):
    """ParallelPlan's default of a field: the one place a plan default lives (the CLI shows it, never restates it)."""
    value = ParallelPlan.model_fields[name].default
    return getattr(value, "value", value)


def _bundle(*options):
    def decorate(f):
        for option in reversed(options):
            f = option(f)
        return f
    return decorate


def _model_options(required: bool):
    return _bundle(
        click.option("--model", "model_name", required=required, help="Catalog name or YAML/JSON path."),
        click.option("--platform", "platform_name", required=required, help="Catalog name or YAML/JSON path."),
        *_MODEL_KNOBS)


_MODEL_KNOBS = (
    click.option("--mtp-layers", type=AsciiInt(), default=None,
                 help="Multi-token-prediction modules to train, 0 to the model's own count (default: all of them)."),
    click.option("--capacity-factor", default=None, metavar="FACTOR|none",
                 help="MoE token dropping: each expert takes at most FACTOR x its balanced share of tokens (padded to "
                      "it, the rest dropped; Megatron-Core's --moe-expert-capacity-factor with padding); 'none' = "
                      "dropless (default: the model's moe.capacity_factor)."),
)
model_options = _model_options(required=True)
model_options_or_plan = _model_options(required=False)
"""`estimate`'s: --model and --platform are required unless a saved plan (--plan) states them."""

training_options = _bundle(
    click.option("--seq", "seq_len", type=AsciiInt(), default=None,
                 help=f"Sequence length, tokens (default: {DEFAULT_SEQ_LEN}, or the model's max_seq_len if smaller)."),
    click.option("--global-batch", type=AsciiInt(), default=TrainingSpec.model_fields["global_batch"].default,
                 show_default=True, help="Sequences per step."),
    click.option("--dtype", default=None, metavar="|".join(DTYPES),
                 help="Training precision (default: bf16 on GPUs, fp32 on CPU ranks). fp8 / mxfp8: bf16 training "
                      "with 8-bit linear GEMMs, where the platform has the rate. `piper plan` also takes a list "
                      "(bf16,fp8) or 'any' (the default and every 8-bit recipe the platform has a peak for) and "
                      "searches precision as an axis."),
    click.option("--fp8-recipe", type=click.Choice(FP8_RECIPES), default=None,
                 help="How an fp8 run scales its tensors (Megatron-LM's --fp8-recipe): delayed (the default), "
                      "tensorwise (current scaling), blockwise (1x128 / 128x128 blocks); priced by the platform's "
                      "measured time per recipe (efficiency.fp8_recipe_time)."),
    click.option("--grad-bytes", type=click.Choice(["2", "4"]), default=None,
                 help="Bytes per gradient value (default: 2 under bf16 / fp16; 4 = fp32 main gradients, "
                      "Megatron's default)."),
)


def state_knobs(fn):
    """--master-bytes and --flash-attention/--no-flash-attention: training settings a published run states (a
    validation dataset's ``training``) that plan and estimate price; launch keeps the runtime's own."""
    fn = click.option("--master-bytes", type=click.Choice(["0", "2", "4"]), default=None,
                      help="Bytes per parameter of the optimizer's master copy (default 4, fp32; 2: Megatron-Core's "
                           "precision-aware optimizer keeps only the 16 bits bf16 weights lack; 0: none).")(fn)
    return click.option("--flash-attention/--no-flash-attention", "flash_attention", default=None,
                        help="Whether attention keeps the s x s scores (--no-flash-attention: Megatron GPT of "
                             "2022, Korthikanti et al.; default: flash attention, which keeps none).")(fn)


def cost_knobs(fn):
    """--dropout and --recompute-modules: what plan and estimate price beyond the plan's degrees."""
    from piper_plan.cost.options import RECOMPUTE_MODULES

    fn = click.option("--recompute-modules", "recompute_modules", default=None, metavar="LIST",
                      help="What --recompute selective re-runs, as Megatron-Core names its modules: "
                           f"comma-separated from {', '.join(RECOMPUTE_MODULES)} (default: core_attn; piper's "
                           "runtime recomputes core_attn only).")(fn)
    fn = click.option("--cost-option", "cost_option", multiple=True, metavar="NAME=VALUE",
                      help="Any other assumption of the cost model (cost/options.py CostOptions; a dataset's "
                           "`options`), repeatable, the value as YAML: e.g. moe_saved_rows=0 (Megatron-Core >= "
                           "v0.13), cross_entropy_fusion_impl=te, ep_dispatch=per_node, "
                           "cuda_graph_scope=[attn,moe_router].")(fn)
    return click.option("--dropout", is_flag=True,
                        help="Price dropout layers: their 1-byte masks in activation memory (Megatron GPT's, "
                             "Korthikanti et al. 2022; modern MoE pre-training runs without; piper's runtime has "
                             "none).")(fn)

migration_option = click.option("--migration", is_flag=True,
                                help="Record expert migration as enabled in the saved plan (off by default).")
placement_option = click.option("--placement", type=click.Choice(Placement.values()), default="compact",
                                show_default=True, help="Allocation shape.")

parallel_options = _bundle(
    click.option("--dp", type=AsciiInt(), default=_plan_default("dp"), show_default=True,
                 help="Data-parallel degree (dense weights)."),
    click.option("--cp", type=AsciiInt(), default=_plan_default("cp"), show_default=True,
                 help="Context-parallel degree (each sequence split over cp ranks)."),
    click.option("--tp", type=AsciiInt(), default=_plan_default("tp"), show_default=True,
                 help="Tensor-parallel degree."),
    click.option("--pp", type=AsciiInt(), default=_plan_default("pp"), show_default=True, help="Pipeline stages."),
    click.option("--ep", type=AsciiInt(), default=_plan_default("ep"), show_default=True,
                 help="Expert-parallel degree."),
    click.option("--etp", type=AsciiInt(), default=_plan_default("etp"), show_default=True,
                 help="Tensor-parallel degree inside an expert."),
    click.option("--mbs", type=AsciiInt(), default=_plan_default("mbs"), show_default=True,
                 help="Micro-batch size, sequences."),
    click.option("--schedule", type=click.Choice(Schedule.values()), default=_plan_default("schedule"),
                 show_default=True),
    click.option("--virtual-stages", type=AsciiInt(), default=None,
                 help="Model chunks per rank (interleaved; default 2)."),
    click.option("--recompute", type=click.Choice(Recompute.values()), default=_plan_default("recompute"),
                 show_default=True),
    click.option("--zero", type=click.Choice(["0", "1", "2", "3"]), default=str(_plan_default("zero")),
                 show_default=True, help="ZeRO stage: 1 sharded optimizer, 2 / 3 FSDP2 (docs/design-notes.md)."),
    click.option("--dp-replicate", type=AsciiInt(), default=_plan_default("dp_replicate"), show_default=True,
                 help="HSDP with zero 2/3: replicas of the FSDP2 shard group among the dp ranks."),
    click.option("--a2a", type=click.Choice(A2A.values()), default=_plan_default("a2a"), show_default=True),
    click.option("--sequence-parallel/--no-sequence-parallel", default=_plan_default("sequence_parallel"),
                 show_default=True, help="Megatron sequence parallelism with tp > 1."),
    click.option("--layers-split", type=click.Choice([s.value for s in LayerSplit if s != LayerSplit.EXPLICIT]),
                 default=_plan_default("layers_split"), show_default=True,
                 help="Layers per stage: even, FLOP-balanced, or auto (what `piper plan` picks: the one that fits, "
                      "then the faster)."),
    click.option("--layers-per-stage", default=None, help="Explicit layers per stage, e.g. 16,16,15,14."),
    click.option("--virtual-stage-layers", default=None,
                 help="Interleaved: layers of each of the pp x v model chunks, comma-separated in virtual-stage "
                      "order, or a Megatron-Core layout string, e.g. 'Et|(tt|)*30mL'. Default: equal chunks, else "
                      "Megatron-Core's account_for_embedding / loss split."),
)


def precision_text(training) -> str:
    """The training precision as a reader names it: 'bf16', or 'fp8 (tensorwise)' with its recipe."""
    return f"{training.dtype} ({training.fp8_recipe})" if training.fp8_recipe else training.dtype


def check_dtype(dtype: str | None) -> str | None:
    """One --dtype value, or one error line naming what is allowed."""
    if dtype is not None and dtype not in DTYPES:
        also = " (a list or 'any' only for piper plan)" if dtype == "any" or "," in dtype else ""
        raise PiperError(f"{dtype!r}; allowed: {', '.join(DTYPES)}{also}", field="--dtype")
    return dtype


def load_setting(model_name: str, platform_name: str, seq_len: int | None, global_batch: int,
                 routing_skew: float = 1.0, mtp_layers: int | None = None, dtype: str | None = None,
                 grad_bytes: str | None = None, fp8_recipe: str | None = None, capacity_factor: str | None = None,
                 master_bytes: str | None = None, flash_attention: bool | None = None):
    """(model, platform, training) from the shared options; --seq defaults to min(4096, max_seq_len); --dtype,
    --grad-bytes, --fp8-recipe, --master-bytes and --[no-]flash-attention replace the device's defaults
    (TrainingSpec.for_device) when given."""
    from pydantic import ValidationError

    from piper_plan.catalog import load_model, load_platform, platforms_dir, resolve, validation_message
    from piper_plan.specs import TrainingSpec

    check_dtype(dtype)
    model = with_capacity_factor(with_mtp_layers(load_model(model_name), mtp_layers), capacity_factor)
    platform = load_platform(platform_name)
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ_LEN, model.max_seq_len or DEFAULT_SEQ_LEN)
    if fp8_recipe is not None and dtype != "fp8":
        raise PiperError(f"{fp8_recipe}: an fp8 recipe needs --dtype fp8 (given: {dtype or 'the device default'}; "
                         "mxfp8 is a block recipe of its own)", field="--fp8-recipe")
    def check_peak(precision: str) -> None:
        try:
            platform.peak_flops(precision)
        except PiperError as exc:   # the asked precision has no rate there: --dtype is the input to change
            where = resolve(platform_name, platforms_dir(), "platform")
            raise PiperError(f"{exc.message} ({where}, device.peak_flops)", field="--dtype") from None

    if dtype is not None:           # first: what the other training options are checked against follows from it
        check_peak(dtype)
    try:
        given = {k: v for k, v in (("dtype", dtype), ("grad_bytes", None if grad_bytes is None else int(grad_bytes)),
                                   ("fp8_recipe", fp8_recipe), ("flash_attention", flash_attention),
                                   ("master_bytes", None if master_bytes is None else int(master_bytes)))
                 if v is not None}
        training = TrainingSpec.for_device(platform.launch.device, seq_len=seq_len, global_batch=global_batch,
                                           routing_skew=routing_skew, **given)
    except ValidationError as exc:
        raise PiperError(validation_message(exc), field="training options") from None
    check_peak(training.dtype)
    return model, platform, training


def with_capacity_factor(model, text: str | None):
    """``model`` with its MoE layers' capacity factor replaced (--capacity-factor: a number, or 'none' for
    dropless); None keeps the model's. A model without MoE layers or a value out of range is one error line."""
    from piper_plan.catalog import parse_spec
    from piper_plan.fileio import ascii_float
    from piper_plan.specs.model import MoESpec

    if text is None:
        return model
    if model.moe is None:
        raise PiperError(f"{text}: {model.name} has no MoE layer to drop tokens in", field="--capacity-factor")
    factor = None
    if text.strip().lower() != "none":
        low, high = (next(getattr(m, bound) for m in MoESpec.model_fields["capacity_factor"].metadata
                          if hasattr(m, bound)) for bound in ("ge", "le"))
        try:
            factor = ascii_float(text)
        except ValueError:
            factor = None
        if factor is None or not low <= factor <= high:
            raise PiperError(f"{text!r}; allowed: a number from {low:g} to {high:g}, or 'none' (dropless)",
                             field="--capacity-factor")
    data = model.model_dump()
    data["moe"] = {**data["moe"], "capacity_factor": factor}
    return parse_spec(type(model), data, "", field="--capacity-factor")


def capacity_note(model) -> str | None:
    """What a capacity factor does to the prediction (None when dropless)."""
    factor = model.moe.capacity_factor if model.moe is not None else None
    if factor is None:
        return None
    return (f"moe capacity factor {factor:g}: each expert computes {factor:g} x its balanced share of tokens (padding "
            f"counted as work, tokens over it dropped; --routing-skew does not apply); MFU and HFU count every "
            f"token's top_k experts")


def with_mtp_layers(model, mtp_layers: int | None):
    """``model`` training ``mtp_layers`` of its MTP modules (None: all); more than it defines is one error line."""
    from piper_plan.catalog import parse_spec

    if mtp_layers is None or mtp_layers == model.mtp_layers:
        return model
    if not 0 <= mtp_layers <= model.mtp_layers:
        have = f"defines {model.mtp_layers}" if model.mtp_layers else "has no multi-token-prediction module"
        raise PiperError(f"{mtp_layers}; {model.name} {have} (its mtp_layers; Hugging Face num_nextn_predict_layers): "
                         f"allowed 0 to {model.mtp_layers}", field="--mtp-layers")
    return parse_spec(type(model), {**model.model_dump(), "mtp_layers": mtp_layers}, "",   # no cached counts copied
                      field="--mtp-layers")


def cost_options(piper_runtime: bool, dropout: bool = False, recompute_modules: str | None = None,
                 cost_option: tuple[str, ...] = ()):
    """The CostOptions of a plan or an estimate: piper's runtime's (unfused kernels, ...) or the default
    (Megatron's fused kernels), with dropout layers and the selective-recompute modules where asked; what the
    runtime does not do is one error line (modules beside another --recompute: ``unused_modules_note``)."""
    from dataclasses import replace

    from piper_plan.cost.options import DEFAULT_OPTIONS, PIPER_RUNTIME_OPTIONS, RECOMPUTE_MODULES

    options = PIPER_RUNTIME_OPTIONS if piper_runtime else DEFAULT_OPTIONS
    modules = options.recompute_modules if recompute_modules is None else \
        tuple(dict.fromkeys(m.strip() for m in recompute_modules.split(",")))
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown:
        raise PiperError(f"{recompute_modules!r}: {', '.join(map(repr, unknown))} "
                         f"{'is not a module' if len(unknown) == 1 else 'are not modules'} piper prices; allowed: a "
                         f"comma-separated list of {', '.join(RECOMPUTE_MODULES)}", field="--recompute-modules")
    if piper_runtime and (dropout or set(modules) != set(PIPER_RUNTIME_OPTIONS.recompute_modules)):
        what, field = ("trains without dropout", "--dropout") if dropout else \
            (f"recomputes {', '.join(PIPER_RUNTIME_OPTIONS.recompute_modules)} only", "--recompute-modules")
        raise PiperError(f"piper's runtime {what}: drop {field}, or drop --runnable / --piper-runtime", field=field)
    options = replace(options, dropout=dropout or options.dropout, recompute_modules=modules)
    flags = {"recompute_modules": "--recompute-modules" if recompute_modules is not None else None,
             "dropout": "--dropout" if dropout else None}
    result = with_cost_options(options, cost_option, piper_runtime, {k: v for k, v in flags.items() if v})
    return result


def unused_modules_note(options, recompute_modules: str | None, cost_option: tuple[str, ...],
                        recompute: str | None, model) -> str | None:
    """A note where selective-recompute modules were given to a plan that does not recompute selectively (plan
    ranks such plans beside selective ones, so estimate prices them alike rather than refusing), or where some act
    on nothing in ``model`` (Megatron-Core skips them: cost/options.py check_modules_exist), or None."""
    from piper_plan.cost.options import module_absent

    if not modules_asked(recompute_modules, cost_option):
        return None
    if recompute not in (None, Recompute.SELECTIVE.value):
        return (f"recompute modules {', '.join(options.recompute_modules)}: what --recompute selective re-runs; this "
                f"plan has --recompute {recompute}, so they change nothing in it")
    absent = module_absent(model)
    idle = [f"{m} ({absent[m]})" for m in options.recompute_modules if absent.get(m)]
    if not idle:
        return None
    return (f"recompute modules {', '.join(idle)} act on nothing in {model.name}: priced as nothing, as Megatron-Core "
            "skips them there")


def modules_asked(recompute_modules: str | None, cost_option: tuple[str, ...]) -> bool:
    """Whether the selective-recompute modules were given (--recompute-modules or --cost-option recompute_modules=)."""
    return recompute_modules is not None or any(pair.partition("=")[0].strip() == "recompute_modules"
                                                for pair in cost_option)


def with_cost_options(options, pairs: tuple[str, ...], piper_runtime: bool = False, flags: dict | None = None):
    """``options`` with --cost-option NAME=VALUE pairs set (each value read as strict YAML, fileio.parse_yaml),
    checked as a file's ``options`` are (cost/options.py ``cost_options``); piper's runtime's own options are not for
    changing.
    ``flags``: option name -> the flag of its own that set it (it is given once: by that flag or by a pair)."""
    from dataclasses import asdict

    from piper_plan.cost.options import cost_options as parsed_options
    from piper_plan.fileio import parse_yaml

    if not pairs:
        return options
    if piper_runtime:
        raise PiperError(f"{pairs[0]!r}: piper's runtime prices its own kernels: drop --cost-option, or drop "
                         "--runnable / --piper-runtime", field="--cost-option")
    values, given = asdict(options), set()
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name.strip():
            raise PiperError(f"{pair!r}; allowed: NAME=VALUE, NAME one of {', '.join(values)}", field="--cost-option")
        if name.strip() not in values:
            raise PiperError(f"{name.strip()!r} is not a cost option; allowed: {', '.join(values)}",
                             field="--cost-option")
        if name.strip() in (flags or {}):
            raise PiperError(f"{pair!r} sets what {flags[name.strip()]} already sets: give it once",
                             field="--cost-option")
        if name.strip() in given:
            raise PiperError(f"{pair!r} sets {name.strip()} a second time: give it once", field="--cost-option")
        given.add(name.strip())
        where = f"--cost-option {pair!r}"     # read as files' values are (010, on, 1:0 refused, not 8, true, 60)
        values[name.strip()] = parse_yaml(text, where) if text.strip() else None
    return parsed_options(values, field="--cost-option")


def parse_layers(text: str | None, field: str = "--layers-per-stage") -> list[int] | None:
    """'16,16,15' -> [16, 16, 15]."""
    if text is None:
        return None
    try:
        layers = [ascii_int(part) for part in text.split(",")]
    except ValueError:
        raise PiperError(f"{text!r}; allowed: comma-separated layer counts, e.g. 16,16,15",
                         field=field) from None
    return layers


def build_plan(model, platform, training, nodes: int, **options):
    """A ParallelPlan from the parallel options, checked by the one validity check (plans.check_plan)."""
    from pydantic import ValidationError

    from piper_plan.catalog import validation_message
    from piper_plan.plans import check_plan
    from piper_plan.specs import ParallelPlan

    layers = parse_layers(options.pop("layers_per_stage"))
    if layers is not None:
        if options["layers_split"] != "auto":
            raise PiperError("give --layers-split or --layers-per-stage, not both", field="--layers-per-stage")
        options["layers_split"] = LayerSplit.EXPLICIT
    vp_given = options["virtual_stages"] is not None
    if not vp_given:
        options["virtual_stages"] = 2 if options["schedule"] == "interleaved" else 1
    chunks = options.pop("virtual_stage_layers")
    if chunks is not None and set(chunks) <= set("0123456789, -+"):    # counts; anything else: a layout string
        chunks = parse_layers(chunks, "--virtual-stage-layers")
    dp, mbs = options["dp"], options["mbs"]
    options["num_microbatches"] = max(training.global_batch // max(dp * mbs, 1), 1)
    try:
        plan = ParallelPlan(**{**options, "zero": int(options["zero"])}, layers_per_stage=layers,
                            virtual_stage_layers=chunks)
    except ValidationError as exc:
        raise PiperError(validation_message(exc), field="parallel") from None
    given = plan.virtual_stage_layers
    if not vp_given and given is not None and plan.schedule == "interleaved" and len(given) % plan.pp == 0:
        # the layout's chunks say how many virtual stages there are, as Megatron infers vp from its layout;
        # validated again with that count (the chunks parsed once, above)
        vp = len(given) // plan.pp
        try:
            plan = ParallelPlan(**{**plan.model_dump(), "virtual_stages": vp})
        except ValidationError as exc:
            raise PiperError(f"its {len(given)} chunks over pp={plan.pp} make virtual_stages {vp}, and then "
                             f"{validation_message(exc)}", field="--virtual-stage-layers") from None
    check_plan(model, platform, training, nodes, plan)
    check_layout_mtp(chunks, model.mtp_layers, "--virtual-stage-layers")
    return plan
