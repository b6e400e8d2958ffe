"""piper export: torchtitan 0.3 launches checked by torchtitan's own ConfigManager and ParallelDims, Megatron-LM
flags checked against the names read from Megatron-LM's arguments.py (tests/export/megatron_flags.txt)."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from piper_plan.cli.main import cli
from piper_plan.export import megatron, torchtitan
from piper_plan.planfile import read_plan_file

HERE = Path(__file__).parent
MEGATRON_FLAGS = {line.strip() for line in (HERE / "megatron_flags.txt").read_text().splitlines()
                  if line.startswith("--")}


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def saved_plan(tmp_path, name: str, *args) -> Path:
    out = tmp_path / f"{name}.json"
    res = run("estimate", *args, "-o", out, "--json")
    assert res.exit_code == 0, res.output
    return out


DEEPSEEK = ("--model", "deepseek-v3", "--platform", "frontier", "--nodes", "128", "--dp", "8", "--tp", "4",
            "--pp", "32", "--ep", "8", "--zero", "1")
PLANS = {
    "deepseek-zero1": DEEPSEEK,
    "gptoss-zero0-interleaved-full": ("--model", "gpt-oss-120b", "--platform", "frontier", "--nodes", "8",
                                      "--dp", "32", "--tp", "1", "--pp", "2", "--ep", "16", "--schedule",
                                      "interleaved", "--virtual-stages", "3", "--recompute", "full", "--a2a", "halo"),
    "qwen3-zero3-selective": ("--model", "qwen3-30b-a3b", "--platform", "frontier", "--nodes", "4", "--dp", "16",
                              "--tp", "2", "--ep", "8", "--zero", "3", "--recompute", "selective"),
    "gpt-oss-pp": ("--model", "gpt-oss-120b", "--platform", "frontier", "--nodes", "8", "--dp", "8", "--tp", "2",
                   "--pp", "4", "--ep", "8", "--zero", "2"),
    "qwen3-hsdp": ("--model", "qwen3-30b-a3b", "--platform", "dgx-h100", "--nodes", "2", "--dp", "16", "--ep", "8",
                   "--zero", "3", "--dp-replicate", "2"),
    "qwen3-fp32-grads": ("--model", "qwen3-30b-a3b", "--platform", "dgx-h100", "--nodes", "2", "--dp", "16", "--ep", "8",
                         "--zero", "3", "--grad-bytes", "4"),
    "qwen3-recompute-modules": ("--model", "qwen3-30b-a3b", "--platform", "dgx-h100", "--nodes", "2", "--dp", "16",
                                "--ep", "8", "--recompute", "selective", "--recompute-modules", "mlp,moe_act"),
    "deepseek-fp8-blockwise-te-loss": ("--model", "deepseek-v3", "--platform", "dgx-h100", "--nodes", "128", "--dp", "8",
                                       "--tp", "4", "--pp", "32", "--ep", "8", "--zero", "1", "--dtype", "fp8",
                                       "--fp8-recipe", "blockwise", "--cost-option", "cross_entropy_fusion_impl=te"),
}


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plans")
    return {name: saved_plan(folder, name, *args) for name, args in PLANS.items()}


def test_megatron_flags_are_megatrons(plans):
    for name, path in plans.items():
        written = set(megatron.flags(read_plan_file(path)))
        assert written <= MEGATRON_FLAGS, (name, written - MEGATRON_FLAGS)


def test_megatron_script_carries_the_degrees(plans):
    text = megatron.script(read_plan_file(plans["deepseek-zero1"]))
    for words in ("--tensor-model-parallel-size 4", "--pipeline-model-parallel-size 32",
                  "--expert-model-parallel-size 8", "--micro-batch-size 1", "--global-batch-size", "--bf16",
                  "--use-distributed-optimizer", "--multi-latent-attention", "pretrain_gpt.py"):
        assert words in text


def words_of(text: str, flag: str) -> list[str]:
    """The words after ``flag`` on its line of a script (one argument group per line)."""
    line = next(ln for ln in text.splitlines() if ln.strip().startswith(flag + " ") or ln.strip() == flag)
    return line.strip().rstrip("\\").split()[1:]


def notes_of(text: str) -> list[str]:
    return [ln[2:] for ln in text.splitlines() if ln.startswith("# ")]


def test_hsdp_is_carried_to_both_engines(plans):
    pf = read_plan_file(plans["qwen3-hsdp"])
    titan = torchtitan.script(pf)
    assert words_of(titan, "--parallelism.data_parallel_replicate_degree") == ["2"]
    assert words_of(titan, "--parallelism.data_parallel_shard_degree") == ["8"]
    assert any("dp_replicate 2 (HSDP)" in n and "efsdp = 1" in n and "edp = 2" in n for n in notes_of(titan))
    mega = megatron.script(pf)
    assert words_of(mega, "--num-distributed-optimizer-instances") == ["2"]
    assert any("dp_replicate 2 (HSDP)" in n for n in notes_of(mega))
    fsdp = read_plan_file(plans["qwen3-zero3-selective"])                  # plain FSDP: no replicas on either side
    assert words_of(torchtitan.script(fsdp), "--parallelism.data_parallel_replicate_degree") == ["1"]
    assert "--num-distributed-optimizer-instances" not in megatron.script(fsdp)


def test_recompute_modules_reach_megatron(plans):
    pf = read_plan_file(plans["qwen3-recompute-modules"])
    mega = megatron.script(pf)
    assert words_of(mega, "--recompute-granularity") == ["selective"]
    assert words_of(mega, "--recompute-modules") == ["mlp", "moe_act"]
    assert any("recompute selective (mlp, moe_act)" in n for n in notes_of(torchtitan.script(pf)))
    default = megatron.script(read_plan_file(plans["qwen3-zero3-selective"]))
    assert words_of(default, "--recompute-modules") == ["core_attn"]       # the prediction's own default, stated


def test_megatron_turns_dropout_off_unless_priced(plans, tmp_path):
    assert words_of(megatron.script(read_plan_file(plans["deepseek-zero1"])), "--hidden-dropout") == ["0"]
    priced = saved_plan(tmp_path, "dropout", *PLANS["qwen3-hsdp"], "--dropout")
    assert "--hidden-dropout" not in megatron.script(read_plan_file(priced))


def test_mtp_is_carried_or_noted(plans):
    pf = read_plan_file(plans["deepseek-zero1"])
    assert pf.model.mtp_layers == 1
    assert words_of(megatron.script(pf), "--mtp-num-layers") == ["1"]
    assert any("multi-token prediction" in n for n in notes_of(torchtitan.script(pf)))


def test_unwritten_settings_are_noted(plans, tmp_path):
    """A capacity factor, a prediction option the engines' flags leave out, and the runtime's optimizer settings
    are each named under 'not carried over'."""
    import json

    path = saved_plan(tmp_path, "opts", *PLANS["qwen3-hsdp"], "--cost-option", "shared_expert_overlap=true")
    data = json.loads(path.read_text())
    data["moe"]["capacity_factor"] = data["model"]["moe"]["capacity_factor"] = 1.25   # both: read_plan_file checks
    path.write_text(json.dumps(data))
    pf = read_plan_file(path)
    for text, where in ((megatron.script(pf), "--moe-shared-expert-overlap"), (torchtitan.script(pf), "torchtitan")):
        notes = [n for n in notes_of(text) if n.startswith("not carried over:")]
        assert any("shared_expert_overlap=True" in n and where in n for n in notes), notes
        assert any("capacity factor 1.25" in n for n in notes) == (where == "torchtitan")   # Megatron writes it
    assert any("lr 0.001" in n for n in notes_of(torchtitan.script(pf)) if n.startswith("not carried over:"))
    assert not any("shared_expert_overlap" in n for n in notes_of(megatron.script(read_plan_file(plans["qwen3-hsdp"]))))


def test_a_capacity_factor_plan_from_the_cli_exports_as_flags_or_a_note(tmp_path):
    """`--capacity-factor` writes the factor into the plan's model block as well: torchtitan's export refused it as
    a changed architecture, so its 'not carried over' note never ran (a second consistency pass)."""
    path = saved_plan(tmp_path, "cf", *PLANS["qwen3-hsdp"], "--capacity-factor", "1.25")
    pf = read_plan_file(path)
    assert pf.model.moe.capacity_factor == 1.25
    assert any(n.startswith("not carried over: capacity factor 1.25") for n in notes_of(torchtitan.script(pf)))
    text = megatron.script(pf)                  # Megatron-Core drops and pads as priced: the flags, no note
    assert words_of(text, "--moe-expert-capacity-factor") == ["1.25"] and "--moe-pad-expert-input-to-capacity" in text
    assert not any("capacity factor" in n for n in notes_of(text))


def test_gradient_precision_is_carried_or_noted(plans, tmp_path):
    """The plan's gradient bytes reach both scripts: torchtitan's float32 FSDP reduction for fp32 gradients, a
    'not carried over' note naming the plan's value otherwise (plans differing only in it export differently)."""
    fp32, bf16 = read_plan_file(plans["qwen3-fp32-grads"]), read_plan_file(plans["qwen3-zero3-selective"])
    assert (fp32.training.grad_bytes, bf16.training.grad_bytes) == (4, 2)
    titan = torchtitan.script(fp32)
    assert words_of(titan, "--training.mixed_precision_reduce") == ["float32"]
    assert any(n.startswith("gradients: 4 bytes per value (fp32 main gradients) in the plan") for n in notes_of(titan))
    titan = torchtitan.script(bf16)
    assert "--training.mixed_precision_reduce" not in titan
    assert any(n.startswith("not carried over: gradients: 2 bytes per value") for n in notes_of(titan))
    assert "--grad-reduce-in-bf16" not in megatron.script(fp32)      # Megatron's default: fp32 main gradients
    assert words_of(megatron.script(bf16), "--grad-reduce-in-bf16") == []
    for pf in (fp32, bf16):
        assert not any("gradients:" in n for n in notes_of(megatron.script(pf)))


@pytest.mark.parametrize("grad_bytes, flag", [("4", "--accumulate-allreduce-grads-in-fp32"), ("2", None)])
def test_fp16_gradients_follow_megatrons_fp16_default(tmp_path, grad_bytes, flag):
    """Under --fp16 Megatron keeps gradients in fp16 unless told --accumulate-allreduce-grads-in-fp32 (under --bf16 it
    is the other way round)."""
    dense = ("--model", "tiny-dense", "--platform", "dgx-h100", "--nodes", "1", "--dp", "8", "--seq", "128",
             "--global-batch", "64")                 # Megatron trains MoE in bf16 only (below)
    path = saved_plan(tmp_path, "fp16", *dense, "--dtype", "fp16", "--grad-bytes", grad_bytes)
    text = megatron.script(read_plan_file(path))
    assert words_of(text, "--fp16") == [] and "--grad-reduce-in-bf16" not in text
    assert (flag in text) if flag else "--accumulate-allreduce-grads-in-fp32" not in text
    assert not any("gradients:" in n for n in notes_of(text))


def test_the_precision_recipe_and_fused_loss_reach_megatron(plans):
    """An fp8 plan's recipe is Megatron's --fp8-recipe with its Transformer Engine format; a bf16 plan writes neither;
    the fused cross entropy the prediction assumed is written, not noted."""
    text = megatron.script(read_plan_file(plans["deepseek-fp8-blockwise-te-loss"]))
    assert words_of(text, "--fp8-format") == ["e4m3"] and words_of(text, "--fp8-recipe") == ["blockwise"]
    assert words_of(text, "--bf16") == [] and words_of(text, "--cross-entropy-fusion-impl") == ["te"]
    assert "--cross-entropy-loss-fusion" in text and not any("cross_entropy" in n for n in notes_of(text))
    titan = torchtitan.script(read_plan_file(plans["deepseek-fp8-blockwise-te-loss"]))
    assert words_of(titan, "--config") == ["deepseek_v3_671b_float8"]
    assert any(n.startswith("fp8 recipe blockwise (as priced) -> deepseek_v3_671b_float8 scales rowwise")
               for n in notes_of(titan))
    bf16 = megatron.script(read_plan_file(plans["qwen3-hsdp"]))
    assert "--fp8-format" not in bf16 and "--cross-entropy-loss-fusion" not in bf16


def test_sliding_windows_and_sinks_reach_megatron(plans):
    """gpt-oss: a 128-key window on layers 0, 2, 4, ... and learnable sinks, as Megatron-Bridge's GPT-OSS provider
    sets them (window_size (128, 0), softmax_type learnable)."""
    text = megatron.script(read_plan_file(plans["gpt-oss-pp"]))
    assert words_of(text, "--window-size") == ["128,0"] and words_of(text, "--softmax-type") == ["learnable"]
    assert words_of(text, "--window-attn-skip-freq") == ["'[" + ",".join(["1,0"] * 18) + "]'"]   # shell-quoted
    assert not any("sliding" in n or "sinks" in n for n in notes_of(text))
    assert "--window-size" not in megatron.script(read_plan_file(plans["deepseek-zero1"]))


def test_the_learning_rate_schedule_reaches_megatron(plans):
    """Megatron's --lr defaults to None and its scheduler needs a number: the plan's runtime settings are written
    (before: a note, and a script that stopped at setup)."""
    pf = read_plan_file(plans["qwen3-hsdp"])
    text = megatron.script(pf)       # the runtime block's defaults: lr 1e-3, 10 warmup steps, min ratio 0.1
    assert words_of(text, "--lr") == ["0.001"] and words_of(text, "--lr-decay-style") == ["cosine"]
    assert words_of(text, "--min-lr") == ["0.0001"] and words_of(text, "--lr-warmup-iters") == ["10"]
    assert words_of(text, "--lr-warmup-init") == ["9.09091e-05"]          # lr / 11: piper's first warmup step
    assert words_of(text, "--weight-decay") == ["0.1"] and words_of(text, "--seed") == ["0"]
    assert words_of(text, "--clip-grad") == ["1"] and words_of(text, "--moe-aux-loss-coeff") == ["0.01"]
    assert not any(n.startswith("not carried over: piper's optimizer") for n in notes_of(text))


def test_priced_overlaps_and_buffers_are_noted(tmp_path):
    """Overlaps the prediction priced are named with Megatron's flags; the default two MoE token-row buffers (older
    Megatron-Core) are named with how to price a recent one (before: silently dropped)."""
    pf = read_plan_file(saved_plan(tmp_path, "ov", *PLANS["qwen3-hsdp"], "--cost-option", "a2a_overlap=0.8",
                                   "--cost-option", "dp_overlap=0.5"))
    notes = notes_of(megatron.script(pf))
    assert any("a2a_overlap=0.8" in n and "--overlap-moe-expert-parallel-comm" in n for n in notes), notes
    assert any("dp_overlap=0.5" in n and "--overlap-grad-reduce" in n for n in notes), notes
    assert any(n.startswith("the prediction priced 2 token-row buffer(s) per MoE layer") for n in notes), notes
    zero_rows = read_plan_file(saved_plan(tmp_path, "r0", *PLANS["qwen3-hsdp"], "--cost-option", "moe_saved_rows=0"))
    assert not any("token-row buffers" in n for n in notes_of(megatron.script(zero_rows)))


def test_megatron_fsdp_keeps_cuda_connections_unset(tmp_path):
    """Megatron FSDP (zero 2 / 3) requires CUDA_DEVICE_MAX_CONNECTIONS unset or above 1; tp > 1 without it still
    exports 1."""
    args = ("--model", "qwen3-30b-a3b", "--platform", "dgx-h100", "--nodes", "2", "--dp", "8", "--tp", "2",
            "--ep", "8")
    zero3 = megatron.script(read_plan_file(saved_plan(tmp_path, "z3", *args, "--zero", "3")))
    zero1 = megatron.script(read_plan_file(saved_plan(tmp_path, "z1", *args, "--zero", "1")))
    assert "--use-megatron-fsdp" in zero3 and "CUDA_DEVICE_MAX_CONNECTIONS" not in zero3
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in zero1


def test_an_uneven_split_is_megatrons_layout(tmp_path):
    """An explicit split whose middle stages differ: Megatron's layout, one chunk per stage (before: a note, and
    Megatron's even split, another memory profile than the one predicted)."""
    pf = read_plan_file(saved_plan(tmp_path, "u4", "--model", "qwen3-30b-a3b", "--platform", "dgx-h100", "--nodes",
                                   "2", "--dp", "4", "--pp", "4", "--ep", "4", "--layers-per-stage", "10,12,13,13"))
    assert words_of(megatron.script(pf), "--pipeline-model-parallel-layout") == ["'Et*10|t*12|t*13|t*13L'"]


def test_the_ffn_gate_reaches_megatron(plans, tmp_path):
    """gpt-oss's experts: --quick-geglu with offset 1 and clamp 7 (before: --swiglu, a different model, and a
    note); SwiGLU models keep --swiglu; Grok-1's GELU gate has no flag and says so."""
    gpt_oss = megatron.script(read_plan_file(plans["gpt-oss-pp"]))
    assert "--quick-geglu" in gpt_oss and "--swiglu" not in gpt_oss
    assert words_of(gpt_oss, "--glu-linear-offset") == ["1"] and words_of(gpt_oss, "--activation-func-clamp-value") == ["7"]
    deepseek = megatron.script(read_plan_file(plans["deepseek-zero1"]))
    assert "--swiglu" in deepseek and "--quick-geglu" not in deepseek
    grok = megatron.script(read_plan_file(saved_plan(tmp_path, "grok", "--model", "grok-1", "--platform", "dgx-h100",
                                                     "--nodes", "8", "--dp", "8", "--tp", "8", "--ep", "8")))
    assert "--swiglu" not in grok and "--quick-geglu" not in grok
    assert "the flags make Megatron build gelu FFNs; the model's experts are gated gelu_tanh, which no flag " \
        "written states: set gated_linear_unit and activation_func in its config" in notes_of(grok)


def test_what_the_gate_flags_cannot_state_is_noted():
    """One set of gate flags for every FFN: each FFN whose gate differs from what Megatron builds from them is named
    (GLaM: no flag for its gated-GELU dense FFNs, so Megatron builds plain GELU, the experts' own gate); a SwiGLU
    offset or clamp is not written (Megatron's fused SwiGLU takes neither) but noted, as is a residual MLP's gate;
    a shared-expert shape with no shared experts is no FFN the model builds."""
    from piper_plan.catalog import load_model

    assert megatron.gate_notes(load_model("glam")) == [
        "the flags make Megatron build gelu FFNs; the model's dense FFNs are gated gelu, which no flag written "
        "states: set gated_linear_unit and activation_func in its config"]
    glam = load_model("glam")
    swiglu_experts = glam.model_copy(update={"moe": glam.moe.model_copy(update={
        "expert": glam.moe.expert.model_copy(update={"gated": True})})})
    experts_note = megatron.gate_notes(swiglu_experts)[-1]
    assert experts_note.startswith("the flags make Megatron build gelu FFNs; the model's experts are gated silu")
    assert "--no-bias-swiglu-fusion" not in experts_note            # that hint is for a SwiGLU's offset or clamp
    moe = load_model("tiny-moe")

    def with_moe(**update):
        return moe.model_copy(update={"moe": moe.moe.model_copy(update=update)})

    clamped = with_moe(expert=moe.moe.expert.model_copy(update={"activation_clamp": 7.0, "glu_linear_offset": 1.0}))
    assert megatron.activation_arguments(clamped.moe.expert) == [["--swiglu"]]
    (note,) = megatron.gate_notes(clamped)
    assert note.startswith("the flags make Megatron build gated silu FFNs; the model's experts are gated silu, "
                           "offset 1, clamp 7") and "--no-bias-swiglu-fusion" in note
    residual = with_moe(parallel_dense_ffn=moe.moe.expert.model_copy(update={"activation": "gelu"}))
    assert [n.split(",")[0] for n in megatron.gate_notes(residual)] == [
        "the flags make Megatron build gated silu FFNs; the model's residual MLPs are gated gelu"]
    unused = with_moe(shared_expert=moe.moe.expert.model_copy(update={"gated": False}))
    assert unused.moe.num_shared_experts == 0 and megatron.gate_notes(unused) == []
    assert megatron.gate_notes(moe) == []


def test_export_warns_when_the_stored_prediction_is_not_what_the_plan_costs_now(plans, tmp_path):
    """A hand-edited plan file (here the platform's host time) is priced again, as `piper launch` does, and the
    export says its stored figures are stale."""
    import json

    data = json.loads(plans["qwen3-hsdp"].read_text())
    data["platform"]["efficiency"]["host_s_per_gemm_call"] = 0.0
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    res = run("export", "--engine", "megatron", path, "--json")
    assert res.exit_code == 0, res.output
    (warning,) = json.loads(res.stdout)["warnings"]
    assert warning.startswith("its stored prediction (step ") and "is not what its plan costs now" in warning
    assert json.loads(run("export", "--engine", "megatron", plans["qwen3-hsdp"], "--json").stdout)["warnings"] == []


def test_the_optimizer_is_written_or_noted(plans, tmp_path):
    """An SGD plan: Megatron gets --optimizer sgd as piper's runtime runs it (no momentum, no weight decay: before,
    Adam with weight decay 0.1); torchtitan's command line takes no optimizer kind, so its name is in a 'not carried
    over' note."""
    import json

    data = json.loads(plans["qwen3-hsdp"].read_text())
    data["training"]["optimizer"] = "sgd"
    path = tmp_path / "sgd.json"
    path.write_text(json.dumps(data))
    pf = read_plan_file(path)
    text = megatron.script(pf)
    assert set(megatron.flags(pf)) <= MEGATRON_FLAGS
    assert words_of(text, "--optimizer") == ["sgd"] and words_of(text, "--sgd-momentum") == ["0"]
    assert words_of(text, "--weight-decay") == ["0"]
    assert any(n.startswith("piper's optimizer and loss settings (optimizer sgd,") and "weight decay 0," in n
               for n in notes_of(text))
    assert any(n.startswith("not carried over:") and "optimizer sgd" in n for n in notes_of(torchtitan.script(pf)))
    assert words_of(megatron.script(read_plan_file(plans["qwen3-hsdp"])), "--weight-decay") == ["0.1"]


def test_a_bad_stored_option_is_one_error_line(plans, tmp_path):
    """A hand-edited recompute_modules string is refused, not split into letters as Megatron modules."""
    import json

    path = tmp_path / "edited.json"
    data = json.loads(plans["qwen3-recompute-modules"].read_text())
    data["prediction"]["options"]["recompute_modules"] = "mlp"
    path.write_text(json.dumps(data))
    res = run("export", "--engine", "megatron", path, "-o", tmp_path / "job.sh")
    errors = [line for line in res.stderr.splitlines() if line]
    assert res.exit_code == 2 and len(errors) == 1 and "recompute_modules" in errors[0], res.stderr
    assert not (tmp_path / "job.sh").exists()


def test_export_warns_when_the_plan_does_not_fit(plans, tmp_path):
    plan = saved_plan(tmp_path, "nofit", "--model", "qwen3-30b-a3b", "--platform", "dgx-h100", "--nodes", "2",
                      "--dp", "8", "--pp", "2", "--ep", "8", "--schedule", "gpipe")
    assert not read_plan_file(plan).prediction.fits
    res = run("export", "--engine", "megatron", plan, "-o", tmp_path / "job.sh")
    assert res.exit_code == 0, res.output
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "does not fit" in warnings[0] and "of 79.65 GiB" in warnings[0], res.stderr
    assert "# warning: the plan's own prediction does not fit" in (tmp_path / "job.sh").read_text()
    fits = run("export", "--engine", "torchtitan", plans["qwen3-hsdp"], "-o", tmp_path / "fits.sh")
    assert fits.exit_code == 0 and "warning" not in fits.stderr, fits.stderr
    import json

    edited = json.loads(plans["qwen3-hsdp"].read_text())   # a fitting plan whose stored verdict was edited: export
    edited["prediction"]["fits"] = False                    # judges it as `piper launch` does, priced again, and
    (tmp_path / "edited.json").write_text(json.dumps(edited))   # says the stored verdict is not the plan's
    res = run("export", "--engine", "torchtitan", tmp_path / "edited.json", "-o", tmp_path / "edited.sh")
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert res.exit_code == 0 and len(warnings) == 1 and "does not fit" not in warnings[0], res.stderr
    assert "fits False) is not what its plan costs now (" in warnings[0] and "fits True): the file was edited" \
        in warnings[0]


def test_export_cli_writes_an_executable_script(plans, tmp_path):
    out = tmp_path / "job.sh"
    res = run("export", "--engine", "torchtitan", plans["gptoss-zero0-interleaved-full"], "-o", out)
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "--module gpt_oss" in text
    assert "HALO hierarchical all-to-all (this plan uses it)" in text and "activation_checkpoint:full" in text
    assert out.stat().st_mode & stat.S_IXUSR


@pytest.mark.parametrize("args, needle", [
    (("--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "8", "--dp", "8", "--pp", "8", "--ep", "8"),
     "no registered configuration for model 'mixtral-8x7b'"),
    (("--model", "qwen3-30b-a3b", "--platform", "frontier", "--nodes", "4", "--dp", "16", "--tp", "2", "--ep", "8",
      "--etp", "2"), "etp=2"),
])
def test_torchtitan_refuses_in_one_line(tmp_path, args, needle):
    plan = saved_plan(tmp_path, "p", *args)
    res = run("export", "--engine", "torchtitan", plan, "-o", tmp_path / "job.sh")
    assert res.exit_code == 2
    errors = [line for line in res.stderr.splitlines() if line]
    assert len(errors) == 1 and needle in errors[0], res.stderr
    assert errors[0].startswith(f"error: {plan}: "), errors[0]          # the plan file the engine cannot take
    assert not (tmp_path / "job.sh").exists()


def test_torchtitan_refuses_a_plan_whose_model_was_changed_under_its_name(plans, tmp_path):
    """Before: the export picked qwen3_30b_a3b by name and launched the registered 128-expert model for a plan of
    64 experts (only a stale-prediction warning). The model's source and notes are not its architecture."""
    data = json.loads(plans["qwen3-hsdp"].read_text())
    data["model"]["notes"] = "edited by hand"
    same = tmp_path / "same.json"
    same.write_text(json.dumps(data))
    assert run("export", "--engine", "torchtitan", same, "-o", tmp_path / "same.sh").exit_code == 0
    data["model"]["moe"]["num_experts"] = 64
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    res = run("export", "--engine", "torchtitan", edited, "-o", tmp_path / "job.sh")
    assert res.exit_code == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith(f"error: {edited}: model.moe.num_experts: 64, but the catalog's qwen3-30b-a3b "
                                 "(torchtitan's registered qwen3_30b_a3b) has 128"), res.stderr
    assert not (tmp_path / "job.sh").exists()
    deepseek = json.loads(plans["deepseek-zero1"].read_text())
    deepseek["model"]["mtp_layers"] = 0        # torchtitan's deepseek_v3_671b has no MTP module: closer, not refused
    no_mtp = tmp_path / "no_mtp.json"
    no_mtp.write_text(json.dumps(deepseek))
    assert run("export", "--engine", "torchtitan", no_mtp, "-o", tmp_path / "ds.sh").exit_code == 0


def test_export_bad_plan_file_is_one_line(tmp_path):
    res = run("export", "--engine", "megatron", tmp_path / "missing.json")
    assert res.exit_code == 2 and "file not found" in res.stderr


# ---- torchtitan's own parser (the export extra) --------------------------------------------------------------
CHECK = """
import json, sys, warnings
warnings.filterwarnings("ignore")
from torchtitan.config.manager import ConfigManager
from torchtitan.distributed.parallel_dims import ParallelDims
out = []
for world, args in json.loads(sys.argv[1]):
    cfg = ConfigManager().parse_args(args)
    dims = ParallelDims.from_config(cfg.parallelism, world)
    spec = cfg.model_spec
    out.append({"dp_shard": dims.dp_shard, "dp_replicate": dims.dp_replicate, "tp": dims.tp, "pp": dims.pp,
                "ep": dims.ep, "local_batch": cfg.training.local_batch_size,
                "global_batch": cfg.training.global_batch_size, "seq_len": cfg.training.seq_len,
                "ac": type(cfg.activation_checkpoint).__qualname__, "mp": cfg.training.mixed_precision_param,
                "schedule": cfg.parallelism.pipeline_parallel_schedule,
                "reshard": cfg.parallelism.fsdp_reshard_after_forward,
                "layers_per_stage": cfg.parallelism.pipeline_parallel_layers_per_stage,
                "reduce": cfg.training.mixed_precision_reduce,
                "layers": len(cfg.model_spec.model.layers)})
print("RESULT " + json.dumps(out))
"""


def torchtitan_parse(cases: list[tuple[int, list[str]]]) -> list[dict]:
    """torchtitan's ConfigManager and ParallelDims on each (world, args), in one fresh interpreter (torchtitan
    imports torch and its models: seconds, paid once)."""
    import json

    proc = subprocess.run([sys.executable, "-c", CHECK, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.distributed     # spawns processes (torchtitan's parser in a fresh interpreter, bash -n): not the fast tier
def test_torchtitan_accepts_every_export(plans):
    if os.environ.get("CI") != "true":
        pytest.importorskip("torchtitan")  # the export extra; scripts/install.sh --test installs it
    files = {name: read_plan_file(path) for name, path in plans.items()}
    files = {name: pf for name, pf in files.items() if pf.training.dtype != "fp8"}  # float8 layers need torchao
    got = dict(zip(files, torchtitan_parse([(pf.parallel.world, torchtitan.flat_arguments(pf))
                                            for pf in files.values()])))
    for name, pf in files.items():
        p, g = pf.parallel, got[name]
        assert g["dp_shard"] * g["dp_replicate"] == p.dp and (g["tp"], g["pp"], g["ep"]) == (p.tp, p.pp, p.ep), name
        assert g["global_batch"] == pf.training.global_batch and g["seq_len"] == pf.training.seq_len
        # torchtitan's gradient accumulation x local batch x dp covers the global batch exactly
        assert g["global_batch"] % (g["local_batch"] * p.dp) == 0
        assert g["mp"] == "bfloat16"
        assert g["layers"] == pf.model.num_layers, name      # the registered configuration is the same architecture
    assert got["gptoss-zero0-interleaved-full"]["ac"] == "FullAC.Config"
    assert got["gptoss-zero0-interleaved-full"]["schedule"] == "Interleaved1F1B"
    assert got["gptoss-zero0-interleaved-full"]["dp_shard"] == 16       # zero 0, ep 16: the shard axis holds ep (HSDP 2 x 16)
    lps = got["gptoss-zero0-interleaved-full"]["layers_per_stage"]         # torchtitan: ceil((L + 2) / lps) stages
    assert -(-(36 + 2) // lps) == 2 * 3
    assert got["qwen3-zero3-selective"]["ac"] == "SelectiveAC.Config"
    assert got["qwen3-zero3-selective"]["reshard"] == "always"
    assert got["deepseek-zero1"]["ac"] == "NoneType" and got["deepseek-zero1"]["reshard"] == "never"
    assert (got["qwen3-hsdp"]["dp_replicate"], got["qwen3-hsdp"]["dp_shard"]) == (2, 8)    # HSDP, not plain FSDP
    assert got["qwen3-fp32-grads"]["reduce"] == "float32"


@pytest.mark.distributed     # spawns bash
@pytest.mark.parametrize("engine", ["torchtitan", "megatron"])
def test_every_export_is_a_valid_bash_script(plans, tmp_path, engine):
    for name, path in plans.items():
        out = tmp_path / f"{name}.sh"
        assert run("export", "--engine", engine, path, "-o", out).exit_code == 0
        assert subprocess.run(["bash", "-n", str(out)]).returncode == 0, name


def test_megatron_gets_what_it_needs_to_start_and_route_as_the_model_does(plans, tmp_path):
    # checked against Megatron-LM arguments.py at 000c4ac and Megatron-Core 0.15.0: an fp16 MoE plan and an MoE
    # plan with tp > 1 but no sequence parallelism stop Megatron at start-up or in the first step; tp > 1 needs
    # CUDA_DEVICE_MAX_CONNECTIONS=1 before Blackwell; DeepSeek's group-limited routing and MLA latent norms were not
    # written; zero 2 / 3 ran as zero 1 without Megatron FSDP
    deepseek = megatron.script(read_plan_file(plans["deepseek-zero1"]))
    assert words_of(deepseek, "--moe-router-num-groups") == ["8"] and words_of(deepseek, "--moe-router-group-topk") == ["4"]
    assert "--qk-layernorm" in deepseek and "export CUDA_DEVICE_MAX_CONNECTIONS=1" in deepseek
    assert any("--moe-router-topk-scaling-factor" in n for n in notes_of(deepseek))
    zero3 = megatron.script(read_plan_file(plans["qwen3-zero3-selective"]))
    assert "--use-megatron-fsdp" in zero3 and words_of(zero3, "--ckpt-format") == ["fsdp_dtensor"]
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in megatron.script(read_plan_file(plans["qwen3-hsdp"]))     # tp 1
    qwen3 = ("--model", "qwen3-30b-a3b", "--platform", "dgx-h100", "--nodes", "2", "--ep", "8")
    no_sp = json.loads(saved_plan(tmp_path, "sp", *qwen3, "--dp", "8", "--tp", "2").read_text())
    no_sp["parallel"]["sequence_parallel"] = False                 # hand-edited: no valid plan (moe_tp_without_sp)
    (tmp_path / "no_sp.json").write_text(json.dumps(no_sp))
    for path, needle in ((saved_plan(tmp_path, "refused", *qwen3, "--dp", "16", "--dtype", "fp16"), "bf16 only"),
                         (tmp_path / "no_sp.json", "moe_tp_without_sp: tp=2 with sequence_parallel off")):
        res = run("export", "--engine", "megatron", path, "-o", tmp_path / "job.sh")
        assert res.exit_code == 2 and res.stderr.count("\n") == 1 and needle in res.stderr, res.output
        assert not (tmp_path / "job.sh").exists()


def test_a_plan_saved_before_the_gate_was_in_the_spec_gets_the_catalogs(plans, tmp_path):
    """A schema 4 gpt-oss plan has no gate fields: it is the catalog's gpt-oss, so it reads with the clamped
    quick-GELU gate (before: SwiGLU, which the Megatron export wrote and launch would train); a model that differs
    in anything else keeps what the file says."""
    import json

    data = json.loads(plans["gpt-oss-pp"].read_text())
    data["schema_version"] = 4
    for name in ("activation", "glu_linear_offset", "activation_clamp"):
        data["model"]["moe"]["expert"].pop(name, None)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert read_plan_file(old).model.moe.expert.activation == "quick_gelu"
    assert "--quick-geglu" in megatron.script(read_plan_file(old))
    data["model"]["vocab_size"] += 1                                    # not the catalog's model any more
    old.write_text(json.dumps(data))
    assert read_plan_file(old).model.moe.expert.activation is None


def test_a_cpu_plan_says_the_engine_runs_on_gpus(tmp_path):
    """A plan for CPU ranks over gloo exported to Megatron: the script is a GPU job, and its notes now say the
    platform's device was not carried over (before: nothing about it)."""
    from click.testing import CliRunner

    from piper_plan.cli.main import cli

    path = tmp_path / "cpu.json"
    done = CliRunner().invoke(cli, ["plan", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1", "--seq",
                                    "64", "--global-batch", "8", "--runnable", "-o", str(path)])
    assert done.exit_code == 0, done.output
    assert "not carried over: the plan's platform (local-cpu) runs CPU ranks over gloo; the engine's script runs on " \
        "GPUs (CUDA, NCCL)" in notes_of(megatron.script(read_plan_file(path)))
    gpu = read_plan_file(saved_plan(tmp_path, "gpu", *PLANS["qwen3-hsdp"]))
    assert not any("CPU ranks" in n for n in notes_of(megatron.script(gpu)))
