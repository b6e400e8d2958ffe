"""TrainingSpec: what is trained, independent of how it is split."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat

from piper_plan.specs.base import Spec

MAX_COUNT = 2**31
"""Upper bound of seq_len and global_batch: their product (tokens per step) must fit the cost model's int64."""


class TrainingSpec(Spec):
    """Sequence, batch, precision and optimizer of a training run."""

    seq_len: int = Field(default=4096, ge=1, le=MAX_COUNT)
    """Tokens per sequence (at most 2^31, so token and FLOP counts stay inside int64)."""
    global_batch: int = Field(default=1024, ge=1, le=MAX_COUNT)
    """Sequences per optimizer step (at most 2^31)."""
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """Compute dtype of weights and activations."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """Optimizer."""
    weight_bytes: int = Field(default=2, ge=1)
    """Bytes per parameter of the working weights."""
    grad_bytes: int = Field(default=2, ge=1)
    """Bytes per parameter of gradients (Megatron keeps 4)."""
    master_bytes: int = Field(default=4, ge=0)
    """Bytes per parameter of the fp32 master copy (0 when training in fp32)."""
    optimizer_bytes: int = Field(default=8, ge=0)
    """Bytes per parameter of optimizer state (Adam m and v in fp32: 8)."""
    flash_attention: bool = True
    """Attention never materialises the s x s score matrix."""
    tokens_to_train: PositiveFloat = 1e12
    """Tokens of the whole run, for time and node-hours to train."""
    routing_skew: float = Field(default=1.0, ge=1.0)
    """Expected max / mean tokens per expert-parallel rank (1 = perfectly balanced)."""

    @classmethod
    def for_device(cls, device: str, **fields) -> "TrainingSpec":
        """Defaults for the platform's device type: mixed precision on GPUs (bf16 weights and gradients, fp32
        master and Adam state: the paper's 16 B/param); plain fp32 on CPU ranks, as piper's runtime trains there
        (fp32 weights and gradients, Adam state, no master copy: also 16 B/param, but 4-byte activations)."""
        if device == "cpu":
            fields = {"dtype": "fp32", "weight_bytes": 4, "grad_bytes": 4, "master_bytes": 0, **fields}
        return cls(**fields)

    @property
    def state_bytes_per_param(self) -> int:
        """Weights + gradients + master + optimizer state (the paper's 16)."""
        return self.weight_bytes + self.grad_bytes + self.master_bytes + self.optimizer_bytes

    @property
    def activation_bytes(self) -> int:
        """Bytes per activation element."""
        return 4 if self.dtype == "fp32" else 2

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch
