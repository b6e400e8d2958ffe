"""Uneven pipeline stage splits: the rule lives in ``piper_plan.cost.pipeline`` (one place, used by the cost
model's ``evaluate`` and by ``plan --save``); re-exported here for the search's callers."""

from piper_plan.cost.pipeline import (balanced_stage_layers, layer_flops_per_token, layers_per_stage_of,
                                      lm_head_flops_per_token, split_variants)

__all__ = ["balanced_stage_layers", "layer_flops_per_token", "layers_per_stage_of", "lm_head_flops_per_token",
           "split_variants"]
