"""Every catalog model (and every ModelSpec feature) builds in the torch runtime at reduced size: the runtime's
parameter count per component equals the spec's exact count (specs.params.count_params), forward + backward
run, every parameter gets a gradient, the model is causal; the norm layouts (Arctic, Grok-1, parallel
residual) compute the reference formulas; recompute (selective / full) is bit-identical to none; the
interleaved chunk construction equals the whole model. Single process, except one 2-rank spawn (interleaved
1F1B over pp=2 with selective recompute, and pp=1 x ep=2 with full recompute, each against the reference)."""

from __future__ import annotations

import re

import pytest
import torch

from piper_plan.catalog import load_model, project_root
from piper_plan.errors import PiperError
from piper_plan.runtime.accounting import SavedTensorTracker
from piper_plan.runtime.model import (MTPModule, StageModel, VirtualStages, attention_core, build_rank_module,
                                      chunk_layers, init_stage, shrink_spec)
from piper_plan.runtime.pipeline import lm_loss
from piper_plan.specs import ParallelPlan
from piper_plan.specs.params import count_params

torch.set_num_threads(1)
CATALOG = sorted(p.stem for p in (project_root() / "models").glob("*.yaml"))
COMPONENTS = ("embedding", "attention", "dense_mlp", "router", "routed_experts", "shared_experts", "norms", "lm_head",
              "mtp")


def component_of(name: str) -> str:
    """Runtime parameter name -> the ParamBreakdown field that counts it (an MTP module: ``mtp``, all its own)."""
    if name.startswith("mtp."):
        return "mtp"
    if name.startswith(("embed.", "pos.")):
        return "embedding"
    if name.startswith("lm_head."):
        return "lm_head"
    if name.startswith("final_norm.") or re.match(r"layers\.\d+\.norm\d\.", name):
        return "norms"
    part = name.split(".")[2:]
    if part[0] == "attn":
        return "attention"
    if part[0] == "residual_mlp" or part[1] in ("up", "gate", "down"):
        return "dense_mlp"
    return {"router": "router", "experts": "routed_experts", "shared": "shared_experts",
            "shared_gate": "shared_experts"}[part[1]]


def runtime_counts(module) -> dict[str, int]:
    out = dict.fromkeys(COMPONENTS, 0)
    for name, p in module.named_parameters():
        out[component_of(name)] += p.numel()
    return out


def build(spec, recompute="none", aux=0.0, seed=0) -> StageModel:
    module = StageModel(spec, 0, spec.num_layers, {"aux_loss_coeff": aux}, recompute)
    init_stage(module, seed)
    return module


def tokens(spec, batch=2, seq=12, seed=0):
    return torch.randint(0, spec.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))


def check_builds_and_trains(spec) -> None:
    module = build(spec)  # no balance loss: every router must learn from the LM loss alone (top-1 models
    # weight by the raw score, normalize_top_k: false, as Switch and Llama 4 do)
    want = count_params(spec)
    assert runtime_counts(module) == {c: getattr(want, c) for c in COMPONENTS}
    x = tokens(spec)
    logits = module(x[:, :-1])
    lm_loss(logits, x[:, 1:]).backward()
    silent = [n for n, p in module.named_parameters() if p.grad is None or float(p.grad.abs().max()) < 1e-7]
    assert silent == []  # every built parameter takes part in the function
    changed = x[:, :-1].clone()
    changed[:, -1] = (changed[:, -1] + 1) % spec.vocab_size
    with torch.no_grad():
        again = module(changed)
    torch.testing.assert_close(again[:, :-1], logits[:, :-1].detach(), rtol=0, atol=1e-6)  # causal
    assert not torch.allclose(again[:, -1], logits[:, -1].detach())


@pytest.mark.parametrize("name", CATALOG)
def test_catalog_model_at_reduced_size(name):
    check_builds_and_trains(shrink_spec(load_model(name)))


def test_catalog_models_at_full_size_on_the_meta_device():
    """Full width and depth (no memory: meta tensors): the whole model's numel equals the spec's exact count,
    which equals transformers' meta-device count for the HF models (reference/models.md; catalog tests)."""
    for name in CATALOG:
        spec = load_model(name)
        if spec.vocab_size is None:  # the papers' abstract models: no embedding, not runnable (capability)
            continue
        with torch.device("meta"):
            module = StageModel(spec, 0, spec.num_layers)
        assert runtime_counts(module) == {c: getattr(spec.params, c) for c in COMPONENTS}, name


def _variant(base: str, **update):
    spec = load_model(base)
    data = spec.model_dump()
    for key, value in update.items():
        node = data
        *path, leaf = key.split("__")
        for p in path:
            node = node[p]
        node[leaf] = value
    return type(spec).model_validate(data)


VARIANTS = {
    "qk_norm_per_head": ("tiny-moe", {"attention__qk_norm": "per_head"}),
    "qk_norm_full": ("tiny-moe", {"attention__qk_norm": "full"}),
    "qk_norm_weightless": ("tiny-moe", {"attention__qk_norm": "weightless"}),
    "sinks_and_biases": ("tiny-moe", {"attention__sinks": True, "attention__qkv_bias": True,
                                      "attention__o_bias": True}),
    "sliding_window_with_sinks": ("tiny-moe", {"attention__sliding_window": 3, "attention__sliding_window_every": 2,
                                               "attention__sinks": True}),
    "router_bias_sigmoid": ("tiny-moe", {"moe__router_bias": True, "moe__scoring": "sigmoid"}),
    "group_limited_routing": ("tiny-moe", {"moe__routing_groups": 4, "moe__routing_group_top_k": 2,
                                           "moe__routing_group_score_top": 2}),
    "shared_expert_gate": ("tiny-moe", {"moe__num_shared_experts": 1, "moe__shared_expert_gate": True}),
    "explicit_layers": ("tiny-moe", {"moe__layers__explicit": [1, 2], "dense_ffn": {"intermediate_size": 96}}),
    "layernorm_no_bias": ("tiny-moe", {"norm": {"kind": "layernorm", "bias": False}}),
    "parallel_residual_2_norms": ("tiny-moe", {"parallel_attn_mlp": True}),
    "parallel_dense_ffn_2_norms": ("tiny-moe", {"moe__parallel_dense_ffn": {"intermediate_size": 64}}),
    "grok_parallel_4_norms": ("tiny-moe", {"norm__per_layer": 4, "parallel_attn_mlp": True}),
    "arctic_sequential_3_norms": ("tiny-moe", {"norm__per_layer": 3,
                                               "moe__parallel_dense_ffn": {"intermediate_size": 64}}),
    "mla_full_rank_q_biases": ("tiny-mla", {"attention__q_lora_rank": None, "attention__qkv_bias": True,
                                             "attention__o_bias": True}),
    "no_final_norm_learned_positions": ("tiny-dense", {"norm__final": False, "learned_position_embeddings": True}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_spec_feature_variants(variant):
    base, update = VARIANTS[variant]
    spec = _variant(base, **update)
    check_builds_and_trains(spec)


def test_layer_rule_places_moe_layers():
    spec = _variant("tiny-moe", num_layers=8, dense_ffn={"intermediate_size": 96},
                    moe__layers={"first_k_dense": 3, "every": 2, "phase": 1})
    assert [i for i, b in build(spec).layers.items() if b.is_moe] == ["3", "5", "7"]
    spec = _variant("tiny-moe", dense_ffn={"intermediate_size": 96}, moe__layers={"explicit": [0, 2]})
    module = build(spec)
    assert [int(i) for i, b in module.layers.items() if b.is_moe] == [0, 2]
    assert sorted(module.moe_layers()) == [0, 2]
    deep = _variant("tiny-moe", num_layers=8, dense_ffn={"intermediate_size": 96}, moe__layers={"explicit": [1, 6]})
    assert shrink_spec(deep).moe_layers == (1,)  # explicit indices beyond the reduced depth are dropped


def test_sinks_rescale_attention_by_the_sink_share():
    """softmax over [scores, s] then drop s == SDPA output x sum(exp scores) / (sum(exp scores) + exp(s))."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0])
    scores = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    mass = scores.exp().sum(-1, keepdim=True)
    share = mass / (mass + sinks.exp().view(1, 2, 1, 1))
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(attention_core(q, k, v, sinks), plain * share)
    torch.testing.assert_close(attention_core(q, k, v, torch.full((2,), -1e4)), plain)


def _windowed_attention_by_hand(q, k, v, sinks, window):
    """Query by query in float64: softmax over the scores of keys max(0, i - window + 1) .. i (and the head's sink
    logit, which carries no value), times their values; GQA by repeating K and V."""
    H, G, S = q.shape[1], k.shape[1], q.shape[2]
    q, k, v = (t.double() for t in (q, k, v))
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
    out = torch.zeros_like(q[..., :1].expand(*q.shape[:-1], v.shape[-1])).clone()
    for i in range(S):
        keys = slice(max(0, i - window + 1), i + 1)
        scores = (q[:, :, i:i + 1] @ k[:, :, keys].transpose(-1, -2)) / q.shape[-1] ** 0.5     # [B, H, 1, w]
        extra = (sinks.double().view(1, H, 1, 1).exp() if sinks is not None else 0.0)
        weights = scores.exp() / (scores.exp().sum(-1, keepdim=True) + extra)
        out[:, :, i] = (weights @ v[:, :, keys])[:, :, 0]
    return out


@pytest.mark.parametrize("sinks", [None, torch.tensor([0.3, -0.5, 1.0, 0.0])], ids=["plain", "sinks"])
@pytest.mark.parametrize("window", [1, 3, 7])
def test_sliding_window_attends_to_the_window_only(sinks, window):
    """A windowed layer's attention equals, query by query, the softmax over itself and the window - 1 keys
    before it (transformers' sliding_window_causal_mask_function); a window as long as the sequence is plain
    causal attention. GQA (4 query heads on 2 kv heads), through SDPA (no sinks) and the explicit path (sinks)."""
    g = torch.Generator().manual_seed(2)
    q, (k, v) = torch.randn(2, 4, 7, 8, generator=g), (torch.randn(2, 2, 7, 8, generator=g) for _ in range(2))
    got = attention_core(q, k, v, sinks, window)
    torch.testing.assert_close(got, _windowed_attention_by_hand(q, k, v, sinks, window).float())
    if window >= 7:
        torch.testing.assert_close(got, attention_core(q, k, v, sinks))
    else:
        assert not torch.allclose(got, attention_core(q, k, v, sinks))


def test_windowed_layers_follow_the_global_layer_index():
    """gpt-oss's pattern (window on layers 0, 2, ...) comes from the global layer index, so a stage or model chunk
    starting at an odd layer windows the same layers as the whole model; a query beyond the window does not see
    the first token in a windowed layer and does in a full one; the reduced spec keeps a window that masks."""
    spec = shrink_spec(load_model("gpt-oss-120b"))
    assert spec.attention.sliding_window == 4
    whole = build(spec)
    assert [whole.layers[str(i)].attn.core.window for i in range(4)] == [4, None, 4, None]
    tail = StageModel(spec, 1, 3, {})
    assert [tail.layers[str(i)].attn.core.window for i in (1, 2, 3)] == [None, 4, None]
    odd = _variant("tiny-moe", num_layers=3, mtp_layers=1, attention__sliding_window=4,
                   attention__sliding_window_every=2)      # an MTP block is shaped like the last layer (2: windowed)
    assert MTPModule(odd, odd.num_layers, {}).block.attn.core.window == 4
    x = torch.randn(1, 9, spec.hidden_size, generator=torch.Generator().manual_seed(3))
    moved = x.clone()
    moved[:, 0] += 1.0
    with torch.no_grad():
        for layer, sees_token_0 in ((whole.layers["0"].attn, False), (whole.layers["1"].attn, True)):
            changed = ~torch.isclose(layer(moved), layer(x), rtol=0, atol=1e-6).all(-1)[0]
            assert changed[:4].all() and bool(changed[4:].any()) == sees_token_0


def _block_io(spec):
    module = build(spec)
    block = module.layers["1"]
    x = torch.randn(2, 6, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    return block, x


def test_arctic_norm_layout():
    """modeling_arctic.py (parallel_attn_mlp_res): h = x + A(n1 x); out = h + R(n3 h) + MoE(n2 x)."""
    block, x = _block_io(shrink_spec(load_model("arctic")))
    with torch.no_grad():
        h = x + block.attn(block.norm1(x))
        want = h + block.residual_mlp(block.norm3(h)) + block.mlp(block.norm2(x))
        torch.testing.assert_close(block(x), want)


def test_grok_sandwich_norm_layout():
    """grok-1 model.py DecoderLayer: h = x + n3(A(n1 x)); out = h + n4(M(n2 h))."""
    block, x = _block_io(shrink_spec(load_model("grok-1")))
    with torch.no_grad():
        torch.nn.init.normal_(block.norm3.weight, 1.0, 0.5)  # the post norms must be where they belong
        torch.nn.init.normal_(block.norm4.weight, 1.0, 0.5)
        h = x + block.norm3(block.attn(block.norm1(x)))
        torch.testing.assert_close(block(x), h + block.norm4(block.mlp(block.norm2(h))))


def test_parallel_residual_layout():
    """GPT-NeoX use_parallel_residual: out = x + A(n1 x) + M(n2 x)."""
    block, x = _block_io(_variant("tiny-moe", parallel_attn_mlp=True))
    with torch.no_grad():
        torch.testing.assert_close(block(x), x + block.attn(block.norm1(x)) + block.mlp(block.norm2(x)))


def _loss_and_grads(spec, recompute):
    module = build(spec, recompute, aux=0.01)
    tracker = SavedTensorTracker(module)
    x = tokens(spec, batch=2, seq=32)
    with tracker.hooks():
        loss = lm_loss(module(x[:, :-1]), x[:, 1:])
    loss.backward()
    counts = {i: m.expert_tokens.clone() for i, m in module.moe_layers().items()}
    return loss.detach(), {n: p.grad for n, p in module.named_parameters()}, counts, tracker.peak_bytes


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-mla", "arctic"])
def test_recompute_is_bit_identical_and_saves_memory(name):
    spec = load_model(name) if name.startswith("tiny") else shrink_spec(load_model(name))
    ref_loss, ref_grads, ref_counts, none_bytes = _loss_and_grads(spec, "none")
    saved = {"none": none_bytes}
    for mode in ("selective", "full"):
        loss, grads, counts, saved[mode] = _loss_and_grads(spec, mode)
        assert torch.equal(loss, ref_loss)
        for n, g in grads.items():
            assert torch.equal(g, ref_grads[n]), f"{mode}: {n}"
        for i, c in counts.items():  # the recomputed forward does not count routed tokens twice
            assert torch.equal(c, ref_counts[i])
    assert saved["full"] < saved["selective"] < saved["none"]
    print(f"{name}: saved-for-backward bytes {saved}")


def test_interleaved_chunks_equal_the_whole_model():
    spec = load_model("tiny-moe")
    plan = ParallelPlan(pp=1, schedule="interleaved", virtual_stages=4)
    assert chunk_layers(spec, ParallelPlan(pp=2, schedule="interleaved", virtual_stages=2)) == [1, 1, 1, 1]
    module = build_rank_module(spec, plan, 0, {}, seed=0)
    assert isinstance(module, VirtualStages) and len(module.chunks) == 4
    assert sorted(module.moe_layers()) == [0, 1, 2, 3]
    whole = build(spec)
    x = tokens(spec)[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(module(x), whole(x), rtol=0, atol=0)
    with pytest.raises(PiperError, match="divisible by pp x virtual_stages"):
        chunk_layers(spec, ParallelPlan(pp=2, schedule="interleaved", virtual_stages=3))


@pytest.mark.distributed
def test_two_ranks_interleaved_and_recompute_match_reference(tmp_path):
    from plans import plan_dict
    from reference import reference_run
    from workers import spawn

    from piper_plan.planfile import parse_plan_dict

    steps, lr, aux = 2, 1e-2, 0.01
    inter = plan_dict(pp=2, dp=1, ep=1, schedule="1f1b", num_microbatches=2, steps=steps)
    inter["parallel"].update(schedule="interleaved", virtual_stages=2, recompute="selective")
    full = plan_dict(pp=1, dp=2, ep=2, num_microbatches=2, steps=steps, model="tiny-mla")
    full["parallel"]["recompute"] = "full"
    plans = {"interleaved": inter, "ep_full": full}
    jobs = [(k, "train", {"plan": p, "steps": steps, "aux": aux}) for k, p in plans.items()]
    results = spawn(2, jobs, tmp_path)
    for key, plan in plans.items():
        ref = reference_run(parse_plan_dict(plan, "test plan"), steps, lr, aux)
        per_rank = [r[key] for r in results]
        seen = set()
        for r in per_rank:
            if r["losses"][0] is not None:
                assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
            for step in range(steps):
                for name, grad in r["grads"][step].items():
                    plain = re.sub(r"^chunks\.\d+\.", "", name)
                    seen.add(plain)
                    want = ref["grads"][step][plain]
                    if ".experts." in plain:
                        first = r["first_expert"][int(plain.split(".")[1])]
                        want = want[first: first + grad.shape[0]]
                    torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6, msg=f"{key} {name} step {step}")
        assert seen == set(ref["grads"][0])


@pytest.mark.parametrize("first", ["full", "none", "inference"])
def test_the_grouped_gemm_probe_runs_apart_from_the_first_forward(first):
    # the probe (a tiny forward + backward, cached) ran inside the first checkpointed block's forward: with full
    # recompute its saved tensors were counted in the forward and not in the recomputation ("58 / 55"), so
    # every MoE run with --recompute full crashed at its first step; and a first call without grad (shape
    # inference, evaluation) cached "no grouped GEMMs" for the whole run
    from piper_plan.runtime import moe

    spec = load_model("tiny-moe")
    moe._grouped_mm_works.cache_clear()
    if first in ("none", "inference"):
        with torch.no_grad() if first == "none" else torch.inference_mode():
            build(spec)(tokens(spec)[:, :-1])
        assert moe._grouped_mm_works("cpu", torch.float32)
    else:
        loss, _, _, _ = _loss_and_grads(spec, "full")
        assert torch.isfinite(loss)
