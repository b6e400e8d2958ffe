"""Training tokens: synthetic (seeded, deterministic, learnable) or a memory-mapped .bin of uint16/uint32.

A batch is a pure function of (seed, step): every rank builds the same global batch [global_batch, seq_len + 1]
and takes its dp slice, so resuming at step s needs nothing but s (the data position is the step).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from piper_plan.errors import PiperError


def token_dtype(vocab_size: int):
    """uint16 when every token id fits (the nanoGPT / Megatron .bin convention), else uint32."""
    return np.uint16 if vocab_size <= 2**16 else np.uint32


class SyntheticTokens:
    """Sequences following x[t+1] = (5 x[t] + 7) mod V with 10% random tokens: learnable, so loss falls."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def batch(self, step: int, num_sequences: int) -> torch.Tensor:
        rng = np.random.default_rng([self.seed, step])
        tokens = np.empty((num_sequences, self.seq_len + 1), dtype=np.int64)
        tokens[:, 0] = rng.integers(0, self.vocab_size, num_sequences)
        for t in range(1, self.seq_len + 1):
            tokens[:, t] = (5 * tokens[:, t - 1] + 7) % self.vocab_size
        noise = rng.random(tokens.shape) < 0.1
        tokens[noise] = rng.integers(0, self.vocab_size, int(noise.sum()))
        return torch.from_numpy(tokens)


class MemmapTokens:
    """A flat token file; sequence i of step s starts at ((s x n + i) x seq_len) mod (length - seq_len - 1)."""

    def __init__(self, path: str | Path, vocab_size: int, seq_len: int) -> None:
        self.path, self.seq_len = Path(path), seq_len
        self.tokens = open_token_file(self.path, vocab_size, seq_len)

    def batch(self, step: int, num_sequences: int) -> torch.Tensor:
        span = len(self.tokens) - self.seq_len - 1
        starts = ((step * num_sequences + np.arange(num_sequences)) * self.seq_len) % max(span, 1)
        rows = [np.asarray(self.tokens[s: s + self.seq_len + 1], dtype=np.int64) for s in starts]
        return torch.from_numpy(np.stack(rows))


def open_token_file(path: Path, vocab_size: int, seq_len: int) -> np.memmap:
    """Open and check a token file; every problem is one PiperError naming the file."""
    dtype = token_dtype(vocab_size)
    try:
        tokens = np.memmap(path, dtype=dtype, mode="r")
    except (OSError, ValueError) as exc:
        raise PiperError(f"cannot read token file ({exc.__class__.__name__}: {exc}); expected a flat "
                         f"{np.dtype(dtype).name} .bin", path=str(path), field="runtime.data") from None
    if len(tokens) < seq_len + 1:
        raise PiperError(f"holds {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}",
                         path=str(path), field="runtime.data")
    return tokens


def make_source(data: str | None, vocab_size: int, seq_len: int, seed: int):
    return SyntheticTokens(vocab_size, seq_len, seed) if data is None else MemmapTokens(data, vocab_size, seq_len)


def dp_slice(batch_NS: torch.Tensor, dp_index: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp rank's sequences, as (inputs [n, S], targets [n, S])."""
    n = batch_NS.shape[0] // dp
    mine = batch_NS[dp_index * n: (dp_index + 1) * n]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
