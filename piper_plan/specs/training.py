"""TrainingSpec: what is trained, independent of how it is split."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PositiveFloat, model_validator

from piper_plan.specs.base import NotBool, Spec
from piper_plan.specs.model import MAX_EXPERTS

MAX_COUNT = 2**31
"""Upper bound of seq_len and global_batch: their product (tokens per step) must fit the cost model's int64."""


LOW_PRECISION_GEMM_DTYPES: dict[str, float] = {"fp8": 2.0, "mxfp8": 2.0 + 2.0 / 32}
"""Training precisions whose GEMMs run in 8 bits -> bytes per parameter of their weight copies (TrainingSpec)."""
Fp8Recipe = Literal["delayed", "tensorwise", "blockwise"]
"""How an fp8 run scales its 8-bit tensors, by Megatron-LM's --fp8-recipe names (megatron/training/arguments.py at
000c4ac, _add_transformer_engine_args; its default is delayed) for Transformer Engine's recipes
(transformer_engine/common/recipe/__init__.py at 000b637): delayed = DelayedScaling (one scale per tensor, from its
amax history), tensorwise = Float8CurrentScaling (one scale per tensor, from the tensor itself: an extra read of
it), blockwise = Float8BlockScaling (1 x 128 blocks of activations and gradients, 128 x 128 of weights: DeepSeek-V3's
recipe). mxfp8 is a dtype of its own (MXFP8BlockScaling)."""
DEFAULT_FP8_RECIPE = "delayed"


class TrainingSpec(Spec):
    """Sequence, batch, precision and optimizer of a training run."""

    seq_len: int = Field(default=4096, ge=1, le=MAX_COUNT)
    """Tokens per sequence (at most 2^31, so token and FLOP counts stay inside int64)."""
    global_batch: int = Field(default=1024, ge=1, le=MAX_COUNT)
    """Sequences per optimizer step (at most 2^31)."""
    dtype: Literal["bf16", "fp16", "fp32", "fp8", "mxfp8"] = "bf16"
    """Training precision. bf16 / fp16 / fp32: every GEMM and activation in that dtype. fp8 / mxfp8: bf16
    training whose linear-layer GEMMs run in 8-bit floating point (fp8: Transformer Engine's per-tensor or blockwise
    recipes, ``fp8_recipe``; mxfp8 = OCP microscaling, one 8-bit scale per 32 values, Blackwell); attention, the
    router, the output layer, elementwise work and communication stay bf16 (LOW_PRECISION_GEMM_DTYPES)."""
    fp8_recipe: Fp8Recipe | None = None
    """The fp8 recipe (Fp8Recipe) of an fp8 run; only with dtype fp8, where it defaults to delayed (Megatron-LM's
    and Transformer Engine's default)."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """Optimizer."""
    weight_bytes: Annotated[Literal[1, 2, 4], NotBool] = 2
    """Bytes per parameter of the working weights (an 8-, 16- or 32-bit format)."""
    grad_bytes: Annotated[Literal[2, 4], NotBool] = 2
    """Bytes per parameter of gradients (Megatron keeps 4)."""
    master_bytes: Annotated[Literal[0, 2, 4], NotBool] = 4
    """Bytes per parameter of the fp32 master copy (0 when training in fp32; 2: the 16 bits bf16 weights lack)."""
    optimizer_bytes: int = Field(default=8, ge=0, le=32)
    """Bytes per parameter of optimizer state (Adam m and v in fp32: 8)."""
    flash_attention: bool = True
    """Attention never materialises the s x s score matrix."""
    tokens_to_train: PositiveFloat = 1e12
    """Tokens of the whole run, for time and node-hours to train."""
    routing_skew: float = Field(default=1.0, ge=1.0, le=MAX_EXPERTS)
    """Expected max / mean tokens per expert-parallel rank (1 = perfectly balanced). No rank can receive more than
    every token's copies its experts can take, so the cost model caps it per plan (cost/memory.py routed_rows)."""

    @model_validator(mode="before")
    @classmethod
    def _fp8_recipe_named(cls, data):
        """An fp8 run names its recipe (the default where none is given), so plan.json says which was priced."""
        if isinstance(data, dict) and data.get("dtype") == "fp8" and data.get("fp8_recipe") is None:
            return {**data, "fp8_recipe": DEFAULT_FP8_RECIPE}
        return data

    @model_validator(mode="after")
    def _fp8_recipe_only_under_fp8(self) -> "TrainingSpec":
        if self.fp8_recipe is not None and self.dtype != "fp8":
            raise ValueError(f"fp8_recipe={self.fp8_recipe} is for dtype fp8 only (dtype {self.dtype}; mxfp8 is a "
                             "block recipe of its own)")
        return self

    @model_validator(mode="after")
    def _gradients_as_wide_as_weights(self) -> "TrainingSpec":
        if self.grad_bytes < self.weight_bytes:
            raise ValueError(f"grad_bytes={self.grad_bytes} is narrower than the weights' weight_bytes="
                             f"{self.weight_bytes} (dtype {self.dtype}): gradients are kept in the weights' dtype or "
                             "wider (fp32 main gradients)")
        return self

    @model_validator(mode="after")
    def _master_copy_only_under_narrower_weights(self) -> "TrainingSpec":
        if self.master_bytes and self.weight_bytes >= 4:
            raise ValueError(f"master_bytes={self.master_bytes} with 4-byte weights (weight_bytes={self.weight_bytes}, "
                             f"dtype {self.dtype}): fp32 weights are their own master copy; allowed: master_bytes 0")
        return self

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
        """Bytes per activation element (fp8 recipes keep bf16 activations: an upper bound, since GEMM inputs
        saved for backward may be kept as their fp8 casts)."""
        return 4 if self.dtype == "fp32" else 2

    @property
    def attention_dtype(self) -> str:
        """The dtype attention and every non-GEMM kernel runs in (bf16 under an fp8 recipe)."""
        return "bf16" if self.dtype in LOW_PRECISION_GEMM_DTYPES else self.dtype

    @property
    def low_precision_copy_bytes(self) -> float:
        """Bytes per parameter of the 8-bit weight copies an fp8 recipe keeps through a step (0 otherwise):
        a rowwise and a columnwise (transposed) copy, since Hopper's fp8 GEMMs need both layouts (Transformer
        Engine docs, "Performance considerations: handling transposes"), cached across the micro-batches of a
        step ("FP8 weight caching"); mxfp8 adds one 1-byte scale per 32 values to each. Counted for every
        parameter (embedding and norms included): a slight over-count."""
        return LOW_PRECISION_GEMM_DTYPES.get(self.dtype, 0.0)

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch
