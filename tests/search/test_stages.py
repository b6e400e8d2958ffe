"""Balanced pipeline stages: uniform models split evenly; dense layers and the LM head shift layers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from piper_plan.catalog import load_model
from piper_plan.search.stages import balanced_stage_layers, layer_flops_per_token, lm_head_flops_per_token
from piper_plan.specs import even_split


def _max_load(w, split, tail):
    ends = np.cumsum(split)
    loads = [w[e - s:e].sum() for s, e in zip(split, ends)]
    loads[-1] += tail
    return max(loads)


@pytest.mark.parametrize("pp", [1, 2, 4, 8, 32])
def test_uniform_model_without_head_gets_the_even_split(pp):
    model = load_model("piper-weak-1.7t")      # every layer MoE, no vocabulary
    assert balanced_stage_layers(model, 4096, pp) == even_split(32, pp)


@pytest.mark.parametrize("name,pp", [("tiny-mla", 2), ("tiny-moe", 3), ("tiny-dense", 2)])
def test_dp_split_is_optimal_by_brute_force(name, pp):
    model = load_model(name)
    w, tail = layer_flops_per_token(model, 256), lm_head_flops_per_token(model)
    best = min(_max_load(w, list(c), tail) for c in itertools.product(range(1, model.num_layers + 1), repeat=pp)
               if sum(c) == model.num_layers)
    split = balanced_stage_layers(model, 256, pp)
    assert sum(split) == model.num_layers and min(split) >= 1
    assert _max_load(w, split, tail) == pytest.approx(best)


def test_deepseek_v3_dense_layers_and_head_move_layers():
    # First 3 layers dense (lighter than MoE at top-8 x 2048 + shared), LM head 2 x 129280 x 7168 on the last stage:
    # stage 0 gets more layers than the last.
    split = balanced_stage_layers(load_model("deepseek-v3"), 4096, 8)
    assert sum(split) == 61 and split[0] > split[-1]


def test_the_split_is_remembered_and_a_very_deep_model_gets_the_even_split_only(monkeypatch):
    from piper_plan.cost import pipeline
    from piper_plan.cost.pipeline import MAX_BALANCED_LAYERS, split_variants  # re-exported from specs.parallel

    calls = []
    exact = pipeline._partition
    monkeypatch.setattr(pipeline, "_partition", lambda *a: calls.append(a) or exact(*a))
    pipeline._SPLITS.clear()
    model = load_model("deepseek-v3")
    first = balanced_stage_layers(model, 4096, 8)
    first.append(0)                                       # a caller's change does not reach the remembered split
    assert balanced_stage_layers(model, 4096, 8) == first[:-1] and len(calls) == 1
    assert len(split_variants(model, 4096, 8)) == 2      # even and FLOP-balanced
    deep = model.model_copy(update={"num_layers": MAX_BALANCED_LAYERS + 1})
    assert split_variants(deep, 4096, 8) == [even_split(MAX_BALANCED_LAYERS + 1, 8)]   # pp x L^2: not searched
