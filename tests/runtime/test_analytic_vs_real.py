"""Analytic equals real (DESIGN.md tier 4): the resource model's per-rank parameter counts equal the runtime's
numel sums exactly; the activations it predicts are within 10% of what autograd saves for backward. zero 2/3
(FSDP2): the bytes per rank and the collectives per step the runtime measurably holds and sends equal the formulas
of docs/design-notes.md "zero 0-3 in the runtime", written here until the cost model prices them."""

from __future__ import annotations

import importlib
import pytest
import torch

from piper_plan.capability import unsupported_features
from piper_plan.catalog import load_model
from piper_plan.runtime.accounting import SavedTensorTracker, param_counts
from piper_plan.runtime.model import StageModel, init_stage, shrink_spec
from piper_plan.runtime.pipeline import lm_loss
from piper_plan.specs import ParallelPlan, TrainingSpec

import piper_plan.cost.memory as memory  # noqa: E402
TINY = ["tiny-moe", "tiny-moe-plain", "tiny-dense"]


def _stage_numel(model, plan: ParallelPlan, stage: int, ep_rank: int = 0) -> dict:
    layers = plan.stage_layers(model.num_layers)
    module = StageModel(model, sum(layers[:stage]), layers[stage], {"ep_rank": ep_rank, "ep_size": plan.ep})
    return param_counts(module)


@pytest.mark.parametrize("name", TINY + ["mixtral-8x7b", "deepseek-v3", "llama4-maverick", "arctic"])
@pytest.mark.parametrize("pp,dp,ep", [(1, 1, 1), (2, 2, 2), (2, 4, 2), (4, 8, 8)])
def test_rank_param_counts_equal_runtime_numel(name, pp, dp, ep):
    model = load_model(name)
    if name not in TINY:  # catalog models at reduced width and depth; structure (shared, dense layers, DeepSeek-V3's
        # MTP module: on the last stage with, at pp > 1, its copy of the embedding) kept
        model = shrink_spec(model, num_layers=4 * pp if model.num_layers >= 4 * pp else None, num_experts=8,
                            mtp_layers=None)
    plan = ParallelPlan(pp=pp, dp=dp, ep=ep)
    assert unsupported_features(plan, model) == []
    predicted = memory.rank_param_counts(model, plan)
    real = [_stage_numel(model, plan, s) for s in range(pp)]
    assert predicted == real


def test_whole_model_numel_equals_spec_count():
    for name in TINY:
        model = load_model(name)
        assert param_counts(StageModel(model, 0, model.num_layers))["total"] == model.params.total


def _saved_bytes(model, training: TrainingSpec) -> int:
    torch.manual_seed(0)
    module = StageModel(model, 0, model.num_layers)
    init_stage(module, 0)
    tracker = SavedTensorTracker(module)
    x = torch.randint(0, model.vocab_size, (1, training.seq_len + 1))
    with tracker.hooks():
        loss = lm_loss(module(x[:, :-1]), x[:, 1:])
    peak = tracker.peak_bytes
    loss.backward()
    return peak


def _with_gpt_oss_gate(name: str):
    """``name`` with every FFN gated as gpt-oss's experts are (clamped quick_gelu, offset 1): the activation saves
    more than SwiGLU (memory.unfused_ffn_saved)."""
    from piper_plan.specs import ModelSpec

    data = load_model(name).model_dump()
    gate = {"activation": "quick_gelu", "glu_linear_offset": 1.0, "activation_clamp": 7.0}
    for ffn in [data.get("dense_ffn"), (data.get("moe") or {}).get("expert")]:
        if ffn:
            ffn.update(gate)
    return ModelSpec.model_validate(data)


def _with_qk_norm(name: str, kind: str):
    """``name`` with its q and k normalised as AttentionSpec.qk_norm ``kind`` says (Qwen3 per_head, OLMoE full,
    Llama 4 weightless): the norms keep their inputs and rstd (memory.qk_norm_bytes)."""
    from piper_plan.specs import ModelSpec

    data = load_model(name).model_dump()
    data["attention"]["qk_norm"] = kind
    return ModelSpec.model_validate(data)


def _variant(name: str):
    base, _, change = name.partition("+")
    if change == "gpt-oss-gate":
        return _with_gpt_oss_gate(base)
    if change.startswith("qk_norm="):
        return _with_qk_norm(base, change.partition("=")[2])
    return load_model(name)


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-moe-plain", "tiny-dense", "tiny-moe+gpt-oss-gate",
                                  "tiny-dense+gpt-oss-gate", "tiny-moe+qk_norm=per_head", "tiny-moe+qk_norm=full",
                                  "tiny-dense+qk_norm=weightless"])
def test_activation_bytes_within_10_percent(name):
    evaluate = importlib.import_module("piper_plan.cost.evaluate")
    from plans import cpu_platform

    from piper_plan.cost.options import CostOptions
    from piper_plan.specs import PlatformSpec

    data = cpu_platform()
    data["device"]["peak_flops"]["fp32"] = 1e12  # only for the time terms; memory does not read it
    platform = PlatformSpec.model_validate(data)
    model = _variant(name)
    training = TrainingSpec(seq_len=256, global_batch=1, dtype="fp32", weight_bytes=4, grad_bytes=4, master_bytes=0)
    plan = ParallelPlan(pp=1, dp=1, ep=1, mbs=1, num_microbatches=1, schedule="gpipe")
    # unfused_kernels: what piper's own runtime saves (separate RoPE, SwiGLU and GQA-expansion tensors), not the
    # fused Megatron kernels the default describes
    est = evaluate.estimate(model, platform, training, 1, plan, options=CostOptions(unfused_kernels=True))
    comps = est.memory.per_stage[0].components
    predicted = sum(v for k, v in comps.items() if k.startswith("activations/"))
    measured = _saved_bytes(model, training)
    print(f"{name}: predicted {predicted:.0f} B, saved-for-backward {measured} B, "
          f"rel_error {(predicted - measured) / measured:+.3f}")
    assert predicted == pytest.approx(measured, rel=0.01)  # the issue asks 10%; the unfused model is exact to ~2 kB


# ---- zero 2 / 3 (FSDP2): what the runtime holds per rank, against the formulas of docs/design-notes.md -----------
def _zero_plans() -> dict:
    from plans import plan_dict

    return {(pp, zero): plan_dict(pp=pp, dp=4 // pp, ep=2, num_microbatches=2, zero=zero)
            for pp in (1, 2) for zero in (2, 3)}


def _tp2_zero1_plan() -> dict:
    from plans import plan_dict

    return plan_dict(pp=1, dp=2, ep=2, tp=2, num_microbatches=2, zero=1)


@pytest.fixture(scope="module")
def zero_measured(tmp_path_factory):
    """One 4-rank spawn: step 1 of each plan of _zero_plans measured (fsdp_worker.measure_check)."""
    from fsdp_worker import spawn

    jobs = [(f"pp{pp}_zero{zero}", "measure", {"plan": p}) for (pp, zero), p in _zero_plans().items()]
    jobs.append(("tp2_zero1", "measure", {"plan": _tp2_zero1_plan()}))
    jobs.append(("pp1_zero3_hsdp2", "measure", {"plan": _hsdp_plan()}))
    return spawn(4, jobs, tmp_path_factory.mktemp("zero"))


def _hsdp_plan() -> dict:
    """zero 3 with HSDP: dp 4 = 2 replicas x a shard group of 2 (parallel.dp_replicate)."""
    from plans import plan_dict

    plan = plan_dict(pp=1, dp=4, ep=2, num_microbatches=2, zero=3)
    plan["parallel"]["dp_replicate"] = 2
    return plan


def _expected_bytes(pp: int, zero: int, dp: int, edp: int, n: dict) -> dict:
    """fp32 policy (param dtype 4 B): bytes per rank the runtime holds. N_d, N_e: the stage's dense and this rank's
    expert numel; R: the stage root's (embedding, final norm, head); B_d, B_e: the largest block's dense and expert."""
    shard = n["dense"] / dp + n["expert"] / edp
    if pp > 1:     # torch's PipelineStage: no reshard after backward, gradients reduced after the last micro-batch
        gathered, grads = 4 * (n["dense"] + n["expert"]), (4 * (n["dense"] + n["expert"]),) * 2
    else:          # pp = 1: FSDP2's default, every micro-batch's backward reduce-scatters into the sharded gradient
        gathered = 4 * (n["dense"] + n["expert"] if zero == 2 else n["root"] + n["block_dense_max"] + n["block_expert_max"])
        grads = (4 * shard, 4 * shard + 4 * (n["block_dense_max"] + n["block_expert_max"]))
    return {"parameters_bytes": 4 * shard, "optimizer_bytes": 8 * shard, "gathered": gathered, "grads": grads}


@pytest.mark.distributed
def test_zero2_zero3_bytes_per_rank_equal_formulas(zero_measured):
    plans, results = _zero_plans(), zero_measured
    for (pp, zero), plan in plans.items():
        for r in (res[f"pp{pp}_zero{zero}"] for res in results):
            par, mem, peak = plan["parallel"], r["memory"], r["peaks"]
            want = _expected_bytes(pp, zero, par["dp"], par["edp"], r["numel"])
            label = f"pp{pp} zero{zero} stage {r['stage']}"
            print(f"{label}: at rest {mem['parameters_bytes']}, gathered {peak['gathered']}, grads {peak['grads']}, "
                  f"optimizer {mem['optimizer_bytes']}; formulas {want}")
            assert mem["parameters_bytes"] == want["parameters_bytes"], label
            # + AdamW's step counter: one 4-byte scalar per parameter tensor
            assert want["optimizer_bytes"] <= mem["optimizer_bytes"] <= want["optimizer_bytes"] * 1.001, label
            assert peak["gathered"] == want["gathered"], label
            low, high = want["grads"]
            assert low <= peak["grads"] <= high, label


@pytest.mark.distributed
def test_hsdp_bytes_per_rank_equal_the_cost_model(zero_measured):
    """HSDP (dp_replicate 2 of dp 4): dense state sharded over the shard group of 2, experts over edp; the cost
    model's weights-at-rest and optimizer state (memory.state_bytes with PlanBatch.dense_shard) equal the runtime's."""
    from piper_plan.cost.memory import state_bytes
    from piper_plan.planfile import parse_plan_dict

    pf = parse_plan_dict(_hsdp_plan(), "hsdp plan")
    for r in (res["pp1_zero3_hsdp2"] for res in zero_measured):
        n, mem = r["numel"], r["memory"]
        shard = n["dense"] / 2 + n["expert"] / pf.parallel.edp
        assert mem["parameters_bytes"] == 4 * shard
        assert 8 * shard <= mem["optimizer_bytes"] <= 8 * shard * 1.001
        model = state_bytes(pf.training, n["dense"], n["expert"], 2, pf.parallel.edp, 3)
        assert abs(float(model["optimizer"]) - mem["optimizer_bytes"]) <= 0.02 * mem["optimizer_bytes"]


def _expected_collectives(pp: int, zero: int, dp: int, edp: int, nmb: int, blocks: int, n: dict) -> dict:
    """{(op, group size): [count, bytes per rank]} of one step, fp32 (tiny-moe: every block is a MoE block).
    All-gather bytes = this rank's shard (its input); reduce-scatter bytes = the unsharded fp32 gradient."""
    ag, rs = "all_gather_single", "reduce_scatter_single"
    if pp > 1:  # 1F1B, 2 micro-batches on 2 stages: a block is gathered before every op that follows a forward
        gathers = 1 if zero == 2 else 3
        out = {(ag, dp): [1 + gathers * blocks, 4 * (n["root"] + gathers * (n["dense"] - n["root"])) // dp],
               (rs, dp): [1 + blocks, 4 * n["dense"]]}
        return out  # edp = 1 here: the experts' FSDP2 group is one rank, no collective
    passes = 1 if zero == 2 else 2  # zero 3 gathers every block again in backward (the root stays gathered)
    return {(ag, dp): [nmb * (1 + passes * blocks), nmb * 4 * (n["root"] + passes * (n["dense"] - n["root"])) // dp],
            (ag, edp): [nmb * passes * blocks, nmb * passes * 4 * n["expert"] // edp],
            (rs, dp): [nmb * (1 + blocks), nmb * 4 * n["dense"]],
            (rs, edp): [nmb * blocks, nmb * 4 * n["expert"]]}


@pytest.mark.distributed
def test_zero2_zero3_collectives_per_step_equal_formulas(zero_measured):
    plans, results = _zero_plans(), zero_measured
    for (pp, zero), plan in plans.items():
        par = plan["parallel"]
        for r in (res[f"pp{pp}_zero{zero}"] for res in results):
            want = _expected_collectives(pp, zero, par["dp"], par["edp"], par["num_microbatches"], 4 // pp, r["numel"])
            got = {k: v for k, v in r["collectives"].items() if k[0] in ("all_gather_single", "reduce_scatter_single")}
            assert got == want, f"pp{pp} zero{zero} stage {r['stage']}"


def _runtime_estimate(plan: dict):
    """The cost model's figures for a test plan, on the local-cpu platform as piper's runtime runs it."""
    from piper_plan.catalog import load_platform
    from piper_plan.cost.evaluate import estimate
    from piper_plan.cost.options import PIPER_RUNTIME_OPTIONS
    from piper_plan.planfile import parse_plan_dict

    cfg = parse_plan_dict(plan, "test plan")
    local = load_platform("local-cpu")        # the test plans' CPU platform has no fp32 rate; memory needs none
    return estimate(cfg.model, local, cfg.training, cfg.parallel.world // local.devices_per_node, cfg.parallel,
                    options=PIPER_RUNTIME_OPTIONS)


@pytest.mark.distributed
def test_zero2_zero3_cost_model_equals_the_runtime(zero_measured):
    """Analytic = real for FSDP2: the cost model's weights (at rest + gathered) and optimizer state per rank within
    1% of what the runtime holds, its gradients an upper bound within 5% (pp = 1: one layer's unsharded gradient)."""
    for (pp, zero), plan in _zero_plans().items():
        est = _runtime_estimate(plan)
        for r in (res[f"pp{pp}_zero{zero}"] for res in zero_measured):
            comp, mem, peak = est.memory.per_stage[r["stage"]].components, r["memory"], r["peaks"]
            label = f"pp{pp} zero{zero} stage {r['stage']}"
            assert comp["weights"] == pytest.approx(mem["parameters_bytes"] + peak["gathered"], rel=0.01), label
            assert comp["optimizer"] == pytest.approx(mem["optimizer_bytes"], rel=0.01), label
            assert peak["grads"] <= comp["gradients"] <= 1.05 * peak["grads"], label


@pytest.mark.distributed
def test_tp2_zero1_optimizer_state_equals_cost_model(zero_measured):
    """zero 1 with tp = 2 (runtime/optim.py: ZeroRedundancyOptimizer over each DTensor's local shard): this rank's
    AdamW state within 2% of the cost model's optimizer bytes, and about half of what a tp rank holds unsharded."""
    est = _runtime_estimate(_tp2_zero1_plan())
    for r in (res["tp2_zero1"] for res in zero_measured):
        predicted, measured = est.memory.per_stage[r["stage"]].components["optimizer"], r["memory"]["optimizer_bytes"]
        unsharded = 2 * r["memory"]["parameters_bytes"]      # exp_avg + exp_avg_sq of every local parameter
        print(f"tp2 dp2 ep2 zero1: optimizer state {measured} B, cost model {predicted:.0f} B, "
              f"rel_error {(predicted - measured) / measured:+.4f}; unsharded {unsharded} B")
        assert predicted == pytest.approx(measured, rel=0.02)
        assert measured < 0.6 * unsharded


# ---- tensor parallelism: tp2 (and tp2 x pp2) ---------------------------------------------------------------
TP_MODELS = ["tiny-moe", "tiny-moe-plain", "tiny-dense", "mixtral-8x7b", "deepseek-v3", "gpt-22b"]
TP_SEQ_LEN = 256


def _tp_spec(name):
    model = load_model(name)
    return model if name in TINY else shrink_spec(model, num_experts=8 if model.moe else None)


@pytest.fixture(scope="module")
def tp2_real(tmp_path_factory):
    """One 2-rank spawn: per model, rank 0's parameter counts per stage (pp 1 and 2) and saved bytes (pp 1)."""
    from workers import spawn

    models = {}
    for name in TP_MODELS:
        spec = _tp_spec(name)
        splits = [ParallelPlan(pp=pp).stage_layers(spec.num_layers) for pp in (1, 2)]
        models[name] = (spec.model_dump(mode="json"), splits)
    jobs = [("acc", "tp_accounting", {"models": models, "seq_len": TP_SEQ_LEN})]
    return spawn(2, jobs, tmp_path_factory.mktemp("tp2"))[0]["acc"]


def _tp_estimate(name):
    from plans import cpu_platform

    from piper_plan.cost.evaluate import estimate
    from piper_plan.cost.options import CostOptions
    from piper_plan.specs import PlatformSpec

    data = cpu_platform(2)
    data["device"]["peak_flops"]["fp32"] = 1e12  # only for the time terms; memory does not read it
    training = TrainingSpec(seq_len=TP_SEQ_LEN, global_batch=1, dtype="fp32", weight_bytes=4, grad_bytes=4,
                            master_bytes=0)
    plan = ParallelPlan(pp=1, dp=1, tp=2, ep=1, mbs=1, num_microbatches=1, schedule="gpipe")
    return estimate(_tp_spec(name), PlatformSpec.model_validate(data), training, 1, plan,
                    options=CostOptions(unfused_kernels=True))


# The cost model divides every attention, MLP and embedding parameter by tp; the runtime (Megatron-LM's split)
# keeps row-parallel biases (o, down), MLA's q_a / kv_a and their norms and learned positions whole on every rank.
@pytest.mark.distributed
@pytest.mark.parametrize("name", TP_MODELS)
@pytest.mark.parametrize("pp", [1, 2])
def test_tp2_param_counts_equal_runtime_numel(tp2_real, name, pp):
    """Exact per rank, MLA's whole compressions, row-parallel biases and learned positions included."""
    predicted = memory.rank_param_counts(_tp_spec(name), ParallelPlan(pp=pp, dp=1, tp=2, ep=1))
    assert predicted == tp2_real[name]["params"][pp]


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["tiny-moe", "tiny-moe-plain", "tiny-dense"])
def test_tp2_activation_bytes(tp2_real, name):
    comps = _tp_estimate(name).memory.per_stage[0].components
    predicted = sum(v for k, v in comps.items() if k.startswith("activations/"))
    measured = tp2_real[name]["saved_bytes"]
    print(f"{name} tp2: predicted {predicted:.0f} B, saved-for-backward {measured} B, "
          f"rel_error {(predicted - measured) / measured:+.4f}")
    assert predicted == pytest.approx(measured, rel=0.01)   # the cost model prices the gathered inputs (unfused)
