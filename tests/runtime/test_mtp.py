"""Multi-token prediction (DeepSeek-V3 report sec. 2.2; runtime/model.py MTPModule, runtime/pipeline.py MTPLoss):
the runtime's MTP run equals the single-process reference (tests/runtime/reference.py) in losses and gradients at
pp 1, at pp 2 (the last stage's embedding copy summed with the first stage's), with ep 2 and with tp 2; its
parameter counts per rank equal the planner's (cost/params.py) and its saved activations what cost/memory.py
prices; lambda 0 leaves the next-token loss and the shared weights' gradients those of the model without MTP; a
checkpoint saved at pp 2 resumes exactly and reshards to pp 1."""

from __future__ import annotations

import importlib

from pathlib import Path

import pytest
import torch

from piper_plan.capability import unsupported_features
from piper_plan.catalog import load_model
from piper_plan.planfile import parse_plan_dict
from piper_plan.runtime.accounting import SavedTensorTracker, param_counts
from piper_plan.runtime.model import StageModel, init_stage, shrink_spec
from piper_plan.runtime.pipeline import loss_function
from piper_plan.specs import ModelSpec, ParallelPlan, TrainingSpec
from plans import plan_dict
from reference import assert_initial_weights_equal, reference_run, whole_model_name

import piper_plan.cost.memory as memory  # noqa: E402

STEPS, LR, AUX = 2, 1e-2, 0.01
RTOL, ATOL = 1e-4, 1e-6


def with_mtp(name: str = "tiny-moe", mtp_layers: int = 1) -> ModelSpec:
    base = load_model(name)
    if not name.startswith("tiny"):
        base = shrink_spec(base, num_experts=8, mtp_layers=mtp_layers)
    return ModelSpec.model_validate({**base.model_dump(), "mtp_layers": mtp_layers})


def mtp_plan(mtp_layers: int = 1, **kw) -> dict:
    return plan_dict(model_dict=with_mtp("tiny-moe", mtp_layers).model_dump(mode="json"), **kw)


# ---- parameters and memory: analytic = real ----------------------------------------------------------------
@pytest.mark.parametrize("name,mtp_layers", [("tiny-moe", 1), ("tiny-moe", 2), ("tiny-dense", 1), ("deepseek-v3", 1)])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_mtp_rank_param_counts_equal_the_planner(name, mtp_layers, pp):
    """Per stage, the runtime's numel equals memory.rank_param_counts (the last stage: the MTP modules and, at
    pp > 1, the embedding copy); the whole model equals params.total + params.mtp (specs/params.py)."""
    model = with_mtp(name, mtp_layers)
    plan = ParallelPlan(pp=pp, dp=1, ep=1)
    assert unsupported_features(plan, model) == []
    layers = plan.stage_layers(model.num_layers)
    real = [param_counts(StageModel(model, sum(layers[:s]), layers[s])) for s in range(pp)]
    assert memory.rank_param_counts(model, plan) == real
    if pp == 1:
        assert real[0]["total"] == model.params.total + model.params.mtp


def _saved_bytes(model, seq_len: int) -> int:
    torch.manual_seed(0)
    module = StageModel(model, 0, model.num_layers)
    init_stage(module, 0)
    loss_fn = loss_function(module, seq_len, None, 1, 0.1)
    tracker = SavedTensorTracker(module)
    x = torch.randint(0, model.vocab_size, (1, seq_len + 1 + model.mtp_layers))
    with tracker.hooks():
        loss = loss_fn(module(x[:, :seq_len]), x[:, 1:])
    peak = tracker.peak_bytes
    loss.backward()
    return peak


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-dense"])
def test_mtp_activation_bytes_equal_the_cost_model(name):
    """The cost model's last-stage activations (MTP blocks counted like layers, the logits term once more per
    module, 4 d per token around each: cost/stage.py end_bytes) within 1% of what autograd saves."""
    evaluate = importlib.import_module("piper_plan.cost.evaluate")
    from plans import cpu_platform

    from piper_plan.cost.options import CostOptions
    from piper_plan.specs import PlatformSpec

    data = cpu_platform()
    data["device"]["peak_flops"]["fp32"] = 1e12  # only for the time terms; memory does not read it
    model = with_mtp(name)
    training = TrainingSpec(seq_len=256, global_batch=1, dtype="fp32", weight_bytes=4, grad_bytes=4, master_bytes=0)
    plan = ParallelPlan(pp=1, dp=1, ep=1, mbs=1, num_microbatches=1, schedule="gpipe")
    est = evaluate.estimate(model, PlatformSpec.model_validate(data), training, 1, plan,
                            options=CostOptions(unfused_kernels=True))
    predicted = sum(v for k, v in est.memory.per_stage[0].components.items() if k.startswith("activations/"))
    measured = _saved_bytes(model, training.seq_len)
    print(f"{name} + 1 MTP module: predicted {predicted:.0f} B, saved-for-backward {measured} B, "
          f"rel_error {(predicted - measured) / measured:+.4f}")
    assert predicted == pytest.approx(measured, rel=0.01)


# ---- the loss --------------------------------------------------------------------------------------------------
def test_lambda_zero_main_loss_equals_the_model_without_mtp():
    """mtp_loss_weight 0: the next-token loss of every step and the gradients of every shared weight equal those of
    the same model without MTP modules (same data: the extra tokens come after the first seq_len + 1); the
    modules' own gradients are zero. With lambda 0.1 the shared weights' gradients differ. No balance loss here: the
    MTP block's router has its own, which (as every MoE layer's, and as in Megatron-Core) lambda does not scale."""
    with_cfg = parse_plan_dict(mtp_plan(pp=1, dp=1, ep=1, num_microbatches=2), "mtp plan")
    without = parse_plan_dict(plan_dict(pp=1, dp=1, ep=1, num_microbatches=2), "plain plan")
    ref = reference_run(without, STEPS, LR, 0.0)
    got = reference_run(with_cfg, STEPS, LR, 0.0, mtp_weight=0.0)
    assert got["losses"] == ref["losses"]
    for step in range(STEPS):
        for name, grad in got["grads"][step].items():
            if name.startswith("mtp."):
                assert not grad.any(), name
            else:
                torch.testing.assert_close(grad, ref["grads"][step][name], rtol=0, atol=0, msg=name)
    weighted = reference_run(with_cfg, 1, LR, 0.0, mtp_weight=0.1)
    assert weighted["losses"][0] == got["losses"][0]          # step 0's weights: the same next-token loss
    assert not torch.equal(weighted["grads"][0]["embed.weight"], ref["grads"][0]["embed.weight"])
    assert 0 < weighted["mtp_losses"][0] < 2 * weighted["losses"][0]


def test_mtp_bad_input_is_one_line(tmp_path):
    """A negative lambda (plan.json or --mtp-loss-weight) and a token file shorter than seq_len + 1 + mtp_layers:
    one PiperError each, naming the field."""
    from piper_plan.errors import PiperError
    from piper_plan.runtime.data import open_token_file
    from piper_plan.runtime.train import with_runtime

    cfg = parse_plan_dict(mtp_plan(pp=1, dp=1, ep=1), "mtp plan")
    with pytest.raises(PiperError, match="mtp_loss_weight"):
        with_runtime(cfg, mtp_loss_weight=-0.1)
    path = tmp_path / "tokens.bin"
    path.write_bytes(bytes(2 * 17))                              # 17 uint16 tokens: enough for seq 16 without MTP
    open_token_file(path, 512, 16)
    with pytest.raises(PiperError, match=r"fewer than seq_len \+ 1 \+ mtp_layers = 18"):
        open_token_file(path, 512, 16, 1)


def _compare(plan: dict, per_rank: list[dict], steps: int = STEPS) -> None:
    """Losses of every step (next-token and MTP) within 1e-5; step 0's gradients within fp32 reduction-order noise.
    Later steps' gradients are not compared: after AdamW's first step (every weight moved by about lr, whatever the
    size of its gradient) a near-tie in top-k routing can flip on reduction-order noise and move a token to
    another expert (seen at step 1 under tp 2: one layer's expert gradients 50% apart, the loss within 1e-5)."""
    ref = reference_run(parse_plan_dict(plan, "test plan"), steps, LR, AUX)
    reporting = [r for r in per_rank if r["losses"][0] is not None]
    assert len(reporting) == plan["parallel"]["dp"] * plan["parallel"]["tp"]
    for r in reporting:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        if ref["mtp_losses"]:                                   # a model without MTP reports None per step
            assert r["mtp_losses"] == pytest.approx(ref["mtp_losses"], rel=1e-5)
    names = set()
    for r in per_rank:
        assert_initial_weights_equal(ref, r)
        for fqn, grad in r["grads"][0].items():
            name = whole_model_name(fqn)
            names.add(name)
            want = ref["grads"][0][name]
            if ".experts." in name:
                first = r["first_expert"][int(name.split(".")[1])]
                want = want[first: first + grad.shape[0]]
            torch.testing.assert_close(grad, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} step 0: {m}")
    assert names == set(ref["grads"][0])                         # every parameter, the MTP module's included
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref["grads"][0].values()]))
    for r in per_rank:   # the global norm counts the last stage's embedding copy once (train.py _norm_dense)
        assert r["grad_norms"][0] == pytest.approx(float(norm), rel=1e-5)


def test_one_rank_mtp_equals_the_reference(world1):
    """pp 1 through the Trainer (data, loss function, report) on one rank, 2 modules, the chunked loss (8 logit
    rows at a time: ChunkedLoss as the shared head; the reference computes whole logits): losses and gradients.
    The whole-logit head runs in the mesh tests below."""
    from workers import train_and_record

    plan = mtp_plan(2, pp=1, dp=1, ep=1, num_microbatches=2)
    plan["runtime"]["loss_chunk_rows"] = 8
    _compare(plan, [train_and_record(plan, 0, 1, STEPS, AUX)])


# ---- distributed ---------------------------------------------------------------------------------------------
MIGRATION = {"enabled": True, "threshold": 1.0, "interval": 2, "max_iters": 4}
"""Experts migrate at the step-2 boundary, before the checkpoint (the MTP block's MoE layer among the others)."""
MESH_PLANS = {"pp2_dp2_ep2": dict(pp=2, dp=2, ep=2, num_microbatches=2),
              "pp1_dp2_tp2_ep2_zero1": dict(pp=1, dp=2, ep=2, tp=2, num_microbatches=2, zero=1),
              "pp2_tp2_ep2": dict(pp=2, dp=1, ep=2, tp=2, num_microbatches=2),
              "pp4": dict(pp=4, dp=1, ep=1, num_microbatches=4),     # the copy's group: stages 0 and 3 only
              "pp2_dp2_ep2_zero3": dict(pp=2, dp=2, ep=2, num_microbatches=2, zero=3)}
INTERLEAVED = dict(pp=2, dp=2, ep=2, num_microbatches=2, schedule="interleaved")
"""4 chunks of 1 layer on 4 ranks, the module in the last. dp 2: the reduction overlapped with backward must copy
each gradient at its last accumulation (runtime/grad_sync.py): the schedule scales a chunk's gradients after that
chunk's last backward, before the other chunk's parameters of the same bucket are done."""


def mesh_plan(name: str) -> dict:
    if name == "pp2_v2_interleaved":
        plan = mtp_plan(**INTERLEAVED)
        plan["parallel"]["virtual_stages"] = 2
        return plan
    return mtp_plan(**MESH_PLANS[name])


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory):
    """One 4-rank spawn: each plan of MESH_PLANS trained STEPS steps; a pp 2 checkpoint resumed."""
    from workers import spawn

    tmp = tmp_path_factory.mktemp("mtp")
    jobs = [(name, "train", {"plan": mesh_plan(name), "steps": STEPS, "aux": AUX}) for name in MESH_PLANS]
    migrating = {**mtp_plan(pp=2, dp=2, ep=2, num_microbatches=2), "migration": MIGRATION}
    jobs.append(("resume", "resume", {"plan": migrating, "run_dir": str(tmp / "run")}))
    return spawn(4, jobs, tmp)


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(MESH_PLANS))
def test_mtp_mesh_equals_the_reference(mesh_runs, name):
    """pp 2 and 4 (embedding copy on the last stage, its gradient summed with the first stage's), tp 2 (eh_proj
    column-parallel, norms sequence-parallel; with ZeRO-1 over the tp shards, and at pp 2 with the copy
    vocabulary-parallel), ep 2 (the MTP block's experts over the EP group), zero 3 (the module one FSDP2 unit):
    losses, MTP losses and every gradient equal the single-process reference."""
    plan = mesh_plan(name)
    _compare(plan, [r[name] for r in mesh_runs])
    cfg = parse_plan_dict(plan, "test plan")
    if cfg.parallel.zero < 2:      # every rank's parameter bytes = the planner's count for its stage (tp split)
        counts = memory.rank_param_counts(cfg.model, cfg.parallel)
        for r in (r[name] for r in mesh_runs):
            assert r["memory"]["parameters_bytes"] == 4 * counts[r["memory"]["stage"]]["total"]


@pytest.mark.distributed
def test_mtp_interleaved_equals_the_reference(tmp_path):
    from workers import spawn

    plan = mesh_plan("pp2_v2_interleaved")
    _compare(plan, [r["run"] for r in spawn(4, [("run", "train", {"plan": plan, "steps": STEPS, "aux": AUX})],
                                            tmp_path)])


@pytest.mark.distributed
def test_mtp_checkpoint_resumes_exactly(mesh_runs):
    """pp 2 with the MTP module and the embedding copy, experts migrating at step 2 (the MTP block's too): 2 steps,
    save, resume in a fresh trainer: the same losses as 4 straight steps (bit for bit)."""
    res = [r["resume"] for r in mesh_runs]
    for r in res:
        assert r["start"] == 2 and r["resumed"] == r["full"]
    assert res[-1]["full"][0] is not None


# ---- resharding checkpoints ----------------------------------------------------------------------------------
RESHARD = {"pp2": dict(pp=2, dp=1, ep=1, num_microbatches=4),          # global batch 4 on every layout
           "pp1_dp2_ep2": dict(pp=1, dp=2, ep=2, num_microbatches=2),
           "pp1_tp2": dict(pp=1, dp=1, ep=1, tp=2, num_microbatches=4)}


@pytest.fixture(scope="module")
def reshard_runs(tmp_path_factory):
    """One 2-rank spawn (tests/runtime/reshard_worker.py): 4 steps at pp 2 saving at step 2 (the embedding saved
    from both stages under one key, DCP keeping one copy), then resumed at pp 1 x dp 2 x ep 2 and at tp 2."""
    from reshard_worker import worker
    from workers import spawn

    tmp = tmp_path_factory.mktemp("mtp_reshard")
    run_dir = str(tmp / "pp2")
    jobs = [("train", "train", {"plan": mtp_plan(**RESHARD["pp2"]), "run_dir": run_dir})]
    jobs += [(name, "resume", {"plan": mtp_plan(**RESHARD[name]), "run_dir": run_dir})
             for name in ("pp1_dp2_ep2", "pp1_tp2")]
    return {"ranks": spawn(2, jobs, tmp, target=worker), "run_dir": Path(run_dir)}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["pp1_dp2_ep2", "pp1_tp2"])
def test_mtp_checkpoint_reshards_from_pp2(reshard_runs, layout):
    """Steps 3-4 resumed under another layout equal the uninterrupted pp 2 run (other layouts sum in another
    order: 1e-5)."""
    ranks = reshard_runs["ranks"]
    want = [r["train"]["losses"][2:] for r in ranks if r["train"]["losses"][0] is not None]
    got = [r[layout]["losses"] for r in ranks if r[layout]["losses"] and r[layout]["losses"][0] is not None]
    assert want and got and all(r[layout]["start"] == 2 for r in ranks)
    for losses in got:
        assert losses == pytest.approx(want[0], rel=1e-5)


@pytest.mark.distributed
def test_an_mtp_checkpoint_is_the_size_the_cost_model_gives(reshard_runs):
    """estimate's checkpoint.total_bytes counts the MTP module the runtime trains and saves (before, it counted
    model.total_params: DeepSeek-V3's checkpoint 139 GB short at zero 3, against its own per-rank figure)."""
    from test_reshard import _saved_tensor_bytes

    from piper_plan.catalog import load_platform
    from piper_plan.cost.evaluate import estimate
    from piper_plan.cost.options import PIPER_RUNTIME_OPTIONS

    cfg = parse_plan_dict(mtp_plan(**RESHARD["pp2"]), "test plan")
    est = estimate(cfg.model, load_platform("local-cpu"), cfg.training, 1, cfg.parallel, options=PIPER_RUNTIME_OPTIONS)
    saved = _saved_tensor_bytes(reshard_runs["run_dir"] / "checkpoints" / "step_2")
    assert cfg.model.params.mtp > 0 and est.checkpoint.total_bytes == pytest.approx(saved, rel=0.01)
