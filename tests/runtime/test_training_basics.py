"""Training basics, each shown effective on one in-process rank: device selection, learning-rate warmup and
cosine decay, global gradient-norm clipping, weight decay, fused AdamW on GPUs, GQA through SDPA's enable_gqa,
fp16 / fp8 / mxfp8 refused with one line."""

from __future__ import annotations

import math

import pytest
import torch

from piper_plan.errors import PiperError
from piper_plan.planfile import RuntimeBlock, parse_plan_dict
from plans import plan_dict


def _cfg(**runtime):
    plan = plan_dict(pp=1, dp=1, ep=1, num_microbatches=2, seq_len=16)
    plan["runtime"].update(runtime)
    return parse_plan_dict(plan, "test plan")


def _trainer(**runtime):
    from piper_plan.runtime.train import Trainer

    return Trainer(_cfg(**runtime), 0, 1, torch.device("cpu"))


# ---- device selection ------------------------------------------------------------------------------
@pytest.mark.parametrize("visible,local,expected", [(1, 0, 0), (1, 3, 0), (1, 7, 0), (8, 3, 3), (4, 6, 2)])
def test_device_setup_with_one_or_all_devices_visible(monkeypatch, visible, local, expected):
    """--gpus-per-task=1 (one visible device) -> cuda:0 for every local rank; all visible -> the local rank."""
    from piper_plan.runtime.train import select_device

    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    plan = plan_dict(pp=1, dp=1, ep=1)
    plan["platform"]["launch"] = {**plan["platform"]["launch"], "device": "cuda", "backend": "nccl"}
    device = select_device(parse_plan_dict(plan, "test plan"), local)
    assert device == torch.device("cuda", expected) and chosen == [expected]


def test_cpu_platform_selects_the_cpu(monkeypatch):
    from piper_plan.runtime.train import select_device

    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("set_device on a CPU platform"))
    assert select_device(_cfg(), 5) == torch.device("cpu")


# ---- learning rate ---------------------------------------------------------------------------------
def test_warmup_then_cosine_to_the_floor():
    from piper_plan.runtime.optim import lr_at

    rt = RuntimeBlock(lr=1e-3, warmup_steps=4, min_lr_ratio=0.1, steps=20)
    lrs = [lr_at(s, 20, rt) for s in range(20)]
    assert lrs[:4] == pytest.approx([1e-3 * (s + 1) / 5 for s in range(4)])
    assert lrs[4] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4)
    assert all(a > b for a, b in zip(lrs[4:], lrs[5:]))                       # decays monotonically
    mid = 4 + (19 - 4) / 2
    assert lr_at(int(mid), 20, rt) > 1e-4 + 0.45 * 9e-4 > lr_at(int(mid) + 1, 20, rt)
    assert [lr_at(s, 20, rt.model_copy(update={"lr_schedule": "constant"})) for s in (4, 19)] == [1e-3, 1e-3]


def test_the_optimizer_steps_with_the_scheduled_rate(world1):
    from piper_plan.runtime.optim import lr_at

    trainer = _trainer(lr=2e-3, lr_schedule="cosine", warmup_steps=2, steps=6)
    for step in range(3):
        trainer.train_step(step)
        groups = [g for o in trainer.optimizer.optims for g in o.param_groups]
        assert {g["lr"] for g in groups} == {lr_at(step, 6, trainer.cfg.runtime)}


# ---- clipping and weight decay ---------------------------------------------------------------------
def _grad_norm(trainer) -> float:
    return math.sqrt(sum(float(q.grad.square().sum()) for q in trainer.module.parameters() if q.grad is not None))


def test_gradient_norm_clipping_bounds_the_global_norm(world1):
    free = _trainer(grad_clip_norm=None)
    free.train_step(0)
    raw = _grad_norm(free)
    clipped = _trainer(grad_clip_norm=raw / 10)
    clipped.train_step(0)
    assert float(clipped.grad_norm) == pytest.approx(raw, rel=1e-5)             # the norm before clipping
    assert _grad_norm(clipped) == pytest.approx(raw / 10, rel=1e-4)
    loose = _trainer(grad_clip_norm=raw * 10)
    loose.train_step(0)
    assert _grad_norm(loose) == pytest.approx(raw, rel=1e-6)                    # under the bound: untouched


def test_weight_decay_shrinks_matrices_and_spares_norms_and_biases(world1):
    """AdamW's decoupled decay: p <- p - lr x wd x p on top of the same Adam update."""
    lr, wd = 1e-2, 0.5
    plain, decayed = _trainer(lr=lr, weight_decay=0.0), _trainer(lr=lr, weight_decay=wd)
    before = {n: q.detach().clone() for n, q in plain.module.named_parameters()}
    plain.train_step(0)
    decayed.train_step(0)
    p_plain, p_decay = dict(plain.module.named_parameters()), dict(decayed.module.named_parameters())
    matrix, norm = "layers.0.attn.q.weight", "layers.0.norm1.weight"
    torch.testing.assert_close(p_decay[matrix] - p_plain[matrix], -lr * wd * before[matrix], rtol=1e-3, atol=1e-7)
    assert torch.equal(p_decay[norm], p_plain[norm])
    assert torch.equal(p_decay["layers.0.mlp.router.weight"] != p_plain["layers.0.mlp.router.weight"],
                       torch.ones_like(p_plain["layers.0.mlp.router.weight"], dtype=torch.bool))


def test_adamw_is_fused_on_gpus_only():
    from piper_plan.runtime.optim import Optimizers

    training = _cfg().training
    named = [("w", torch.nn.Parameter(torch.ones(4, 4)))]
    on_gpu = Optimizers([(named, None, 1)], training, RuntimeBlock(), torch.device("cuda"), 0)
    on_cpu = Optimizers([(named, None, 1)], training, RuntimeBlock(), torch.device("cpu"), 0)
    assert on_gpu.optims[0].defaults["fused"] is True and not on_cpu.optims[0].defaults["fused"]


def test_sgd_applies_no_weight_decay_as_the_megatron_export_writes():
    """The runtime's SGD has no weight decay and no momentum: the same rule (RuntimeBlock.weight_decay_for) the
    Megatron export writes as --weight-decay 0."""
    from piper_plan.runtime.optim import Optimizers

    named = [("w", torch.nn.Parameter(torch.ones(4, 4)))]
    training = _cfg().training
    sgd = Optimizers([(named, None, 1)], training.model_copy(update={"optimizer": "sgd"}), RuntimeBlock(),
                     torch.device("cpu"), 0).optims[0]
    adam = Optimizers([(named, None, 1)], training, RuntimeBlock(), torch.device("cpu"), 0).optims[0]
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0
    assert [g["weight_decay"] for g in sgd.param_groups] == [0.0]
    assert [g["weight_decay"] for g in adam.param_groups] == [RuntimeBlock().weight_decay] == [0.1]


# ---- attention and precision -----------------------------------------------------------------------
def test_gqa_through_sdpa_equals_expanded_heads_and_expands_nothing():
    from piper_plan.runtime.model import attention_core
    from host_syncs import aten
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        seen: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.overloadpacket)
            return func(*args, **(kwargs or {}))

    q, k, v = torch.randn(2, 8, 10, 16), torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
    with Ops() as ops:
        got = attention_core(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                                           is_causal=True)
    torch.testing.assert_close(got, ref)
    assert aten.repeat_interleave not in ops.seen and aten.expand not in ops.seen


@pytest.mark.parametrize("dtype,why", [("fp16", "loss scaling"), ("fp8", "8-bit GEMMs"), ("mxfp8", "8-bit GEMMs")])
def test_precisions_the_runtime_lacks_are_refused_with_one_line(dtype, why):
    from piper_plan.runtime.train import preflight

    plan = plan_dict(pp=1, dp=2, ep=2)
    plan["training"]["dtype"] = dtype
    peaks = plan["platform"]["device"]["peak_flops"]
    peaks.setdefault(dtype, 2 * peaks["bf16"])      # an 8-bit rate on the test platform, so the runtime's check speaks
    with pytest.raises(PiperError, match=f"training.dtype={dtype} .runtime supports fp32, bf16: .*{why}") as err:
        preflight(parse_plan_dict(plan, "test plan"), 2, False)
    assert "\n" not in str(err.value)


def test_one_set_of_defaults_and_the_command_line_overrides(tmp_path):
    """The runtime's defaults are RuntimeBlock's (steps 100, not a second default); options only override."""
    import json

    from piper_plan.runtime.train import load_plan, parse_args

    plan = plan_dict(pp=1, dp=1, ep=1)
    plan["runtime"], plan["migration"] = {"seed": 3}, {}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    cfg = load_plan(parse_args(["--plan", str(path)]))
    assert cfg.runtime == RuntimeBlock(seed=3) and cfg.runtime.steps == 100
    cfg = load_plan(parse_args(["--plan", str(path), "--steps", "7", "--lr", "0.5"]))
    assert (cfg.runtime.steps, cfg.runtime.lr, cfg.runtime.seed) == (7, 0.5, 3)
    assert cfg.migration == type(cfg.migration)() and cfg.migration.window_steps == 50


def test_bad_runtime_setting_is_one_line(tmp_path):
    import json

    from piper_plan.runtime.train import load_plan, parse_args

    plan = plan_dict(pp=1, dp=1, ep=1)
    plan["runtime"]["warmup_steps"] = -1
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    with pytest.raises(PiperError, match="warmup_steps") as err:
        load_plan(parse_args(["--plan", str(path)]))
    assert "\n" not in str(err.value)


def test_a_bad_runtime_override_is_one_line():
    """`--lr nan` / `--steps 0` on the trainer's command line: a PiperError naming the field, not pydantic's."""
    from piper_plan.runtime.train import with_runtime

    cfg = parse_plan_dict(plan_dict(pp=1, dp=2, ep=2), "test plan")
    for override, field in (({"lr": float("nan")}, "lr"), ({"steps": 0}, "steps")):
        with pytest.raises(PiperError, match=field) as err:
            with_runtime(cfg, **override)
        assert "\n" not in str(err.value)


def test_rms_norm_takes_the_inputs_dtype_for_its_weight():
    """Under autocast the activations are bf16 and the norm's weight fp32; torch then skips its fused rms_norm
    kernel (a warning on an H200, docs/gpu-check.md). The runtime's RMSNorm casts the weight: bf16 out, equal to
    torch's rms_norm with a bf16 weight; fp32 unchanged."""
    import torch
    import torch.nn.functional as F

    from piper_plan.runtime.model import RMSNorm

    norm = RMSNorm(8, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (8,), norm.weight, 1e-5), rtol=0, atol=0)
    half = norm(x.bfloat16())
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half, F.rms_norm(x.bfloat16(), (8,), norm.weight.bfloat16(), 1e-5), rtol=0, atol=0)
