"""Pydantic specs (frozen, extra='forbid'): what is trained, where, and how it is split."""

from piper_plan.specs.model import AttentionSpec, FFNSpec, ModelSpec, MoELayersSpec, MoESpec, NormSpec
from piper_plan.specs.parallel import ParallelPlan, even_split
from piper_plan.specs.platform import SCOPES, PlatformSpec
from piper_plan.specs.training import TrainingSpec

__all__ = ["AttentionSpec", "FFNSpec", "ModelSpec", "MoELayersSpec", "MoESpec", "NormSpec", "ParallelPlan",
           "PlatformSpec", "SCOPES", "TrainingSpec", "even_split"]
