"""Sliding-window attention: the window bounds the keys each query scores, in the layers the spec names."""

from __future__ import annotations

import pytest

from piper_plan.catalog import load_model
from piper_plan.cost.flops import attention_score_flops_per_token, keys_per_query


def test_gpt_oss_alternating_window_by_hand():
    """gpt-oss: 36 layers, 18 with a 128-key window. s = 8192: PaLM counts (18 x 8192 + 18 x 128) / 36 keys per
    query; megatron (18 x 4096 + 18 x (128 - 128 x 127 / (2 x 8192))) / 36."""
    model = load_model("gpt-oss-120b")
    assert model.attention.sliding_layers(model.num_layers) == 18
    assert keys_per_query(model, 8192, "palm") == pytest.approx((8192 + 128) / 2)
    assert keys_per_query(model, 8192, "megatron") == pytest.approx((4096 + 128 - 128 * 127 / 16384) / 2)
    full = model.model_copy(update={"attention": model.attention.model_copy(update={"sliding_window": None})})
    assert attention_score_flops_per_token(model, 8192) < 0.52 * attention_score_flops_per_token(full, 8192)


def test_a_window_longer_than_the_sequence_changes_nothing():
    model = load_model("gpt-oss-120b")
    assert keys_per_query(model, 64, "megatron") == pytest.approx(
        (32 + (64 - 64 * 63 / 128)) / 2)    # w capped at s: the causal mean (s + 1) / 2 in the window layers
